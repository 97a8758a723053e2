"""The package's face: one version, typing marker shipped, the old module name of the
multi-rank package still importable (with a DeprecationWarning)."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

import pytest

import gdswriter


def test_the_version_is_written_once():
    from gdswriter._version import __version__

    assert gdswriter.__version__ == __version__ == importlib.metadata.version("gdswriter")


def test_the_package_ships_its_typing_marker():
    assert (Path(gdswriter.__file__).parent / "py.typed").is_file()


def test_the_old_name_of_the_multi_rank_package_still_imports_and_warns():
    sys.modules.pop("gdswriter.dist", None)
    with pytest.warns(DeprecationWarning, match="gdswriter.distributed"):
        from gdswriter.dist import GDSStorageWriter
    assert GDSStorageWriter is gdswriter.GDSStorageWriter
    with pytest.raises(ImportError):
        from gdswriter.dist import nothing_of_that_name  # noqa: F401


def _modules_after(code: str) -> set[str]:
    import json
    import subprocess

    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys, json\nprint(json.dumps(sorted(sys.modules)))"],
                         capture_output=True, text=True, check=True).stdout
    return set(json.loads(out.splitlines()[-1]))


def test_import_gdswriter_loads_no_tool_cli_multi_rank_module_nor_torch():
    loaded = _modules_after("import gdswriter")
    ours = {m for m in loaded if m.startswith("gdswriter")}
    assert ours <= {"gdswriter", "gdswriter._version", "gdswriter.errors"}, ours
    assert "torch" not in loaded


def test_the_checkpointer_loads_no_tool_cli_or_integration_module():
    loaded = _modules_after("from gdswriter import GDSCheckpointer, load_state")
    above = [m for m in loaded if m.startswith(("gdswriter.tools", "gdswriter.commands", "gdswriter.cli",
                                                "gdswriter.integrations", "gdswriter.testing"))]
    assert above == []


def test_a_single_process_checkpointer_loads_no_multi_rank_module(tmp_path):
    """Constructing, saving and loading in one process (no torch.distributed init) never imports
    gdswriter.distributed: the session is chosen without it (gdswriter/session.py)."""
    loaded = _modules_after(f"""
import torch
from gdswriter import GDSCheckpointer
ck = GDSCheckpointer({{"w": torch.ones(8)}}, None, {str(tmp_path)!r})
ck.save(1)
assert ck.load() == 1
ck.close()""")
    assert "gdswriter.checkpointer" in loaded and "gdswriter.session" in loaded
    assert [m for m in loaded if m.startswith("gdswriter.distributed") or m == "gdswriter.dist"] == []


def test_both_sessions_have_what_the_checkpointer_asks_of_a_session():
    import inspect

    from gdswriter.distributed.session import DistSession
    from gdswriter.session import LocalSession, Session

    asked = {n: inspect.signature(f) for n, f in vars(Session).items() if inspect.isfunction(f) and n[0] != "_"}
    assert {"prepare", "write_and_commit", "apply_retention", "load", "close"} <= set(asked)
    for impl in (LocalSession, DistSession):
        for name, sig in asked.items():
            assert list(inspect.signature(getattr(impl, name)).parameters) == list(sig.parameters), (impl, name)


def test_the_save_handle_types_keep_their_names():
    from gdswriter import SaveHandle, SaveStats
    from gdswriter.checkpointer import SaveHandle as from_checkpointer

    assert SaveHandle is from_checkpointer and SaveStats.__module__ == "gdswriter.save.handle"


def test_the_benchmark_names_moved_to_tools_and_still_resolve_with_a_warning():
    from gdswriter.tools.bench import run_bench

    with pytest.warns(DeprecationWarning, match="gdswriter.tools.bench"):
        assert gdswriter.run_bench is run_bench
    assert "run_bench" not in gdswriter.__all__


def _import_graph() -> tuple[dict[str, set[str]], list[str]]:
    """The house rules' view of the package (docs/architecture.md, rules 1 and 2), read from the
    source with ast: {module: the gdswriter modules it imports}, every import counted wherever it
    stands (in a function, under TYPE_CHECKING), and the underscore names that cross a module
    ("user: owner._name"): imported by name, or read as an attribute of an imported module."""
    import ast

    top = Path(gdswriter.__file__).parent
    files = {".".join(p.relative_to(top.parent).with_suffix("").parts).removesuffix(".__init__"): p
             for p in top.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    crossing: list[str] = []

    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__")

    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        modules: dict[str, str] = {}  # local name -> the gdswriter module it is bound to
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "gdswriter":
                        graph[mod].add(a.name)
                        if a.asname:
                            modules[a.asname] = a.name
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
                source = ".".join(base + ([node.module] if node.module else []))
                if source.split(".")[0] != "gdswriter":
                    continue
                for a in node.names:
                    if f"{source}.{a.name}" in files:  # a module (an underscore module is the package's own)
                        graph[mod].add(f"{source}.{a.name}")
                        modules[a.asname or a.name] = f"{source}.{a.name}"
                    else:
                        graph[mod].add(source)
                        if private(a.name):
                            crossing.append(f"{mod}: {source}.{a.name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules \
                    and private(node.attr):
                crossing.append(f"{mod}: {modules[node.value.id]}.{node.attr}")
    return graph, sorted(set(crossing))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm; the package is small enough to recurse
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(w)
                if w == v:
                    break
            if len(part) > 1 or v in graph.get(v, ()):
                out.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_no_import_cycle_in_the_package_deferred_imports_included():
    graph, _ = _import_graph()
    assert len(graph) > 50 and "gdswriter.fs" in graph["gdswriter.format.commit"]  # the graph was read
    assert _cycles(graph) == []


def test_no_underscore_name_crosses_a_module():
    _, crossing = _import_graph()
    assert crossing == []


# The functions above the complexity ceiling (pyproject: C901, max-complexity 15) on the day the rule
# came in, each marked with a noqa for C901 at the end of its def line. Refactors lower this number;
# it never rises (lower it here when a marker goes). gdswriter/distributed/dcp.py is exempt by a per-file-ignore
# until its split lands. 16: load_own and plan_from_shards split (issue 38). 3: state_codec's enc
# and dec, manifest's _from_body, affinity's assign_bytes, sharded's _parse_shard, verify's verify_step,
# deepspeed's from_plain, distributed.commit's vote, benchmarks/report.py's report, fake_kvikio's _build,
# dist_scaling's _round, gpu_probe's bandwidth, test_powerloss's check_image. 1: read_reached and
# fetch_storages on the one read executor (distributed/readexec.py).
_COMPLEX_FUNCTIONS_CEILING = 1


def test_the_functions_above_the_complexity_ceiling_only_get_fewer():
    repo = Path(__file__).resolve().parents[1]
    marked = [f"{p.relative_to(repo)}:{i}" for d in ("gdswriter", "tests", "benchmarks", "scripts")
              for p in sorted((repo / d).rglob("*.py"))
              for i, line in enumerate(p.read_text().splitlines(), 1)
              if line.lstrip().startswith(("def ", "async def ")) and line.rstrip().endswith("# noqa: C901")]
    assert len(marked) <= _COMPLEX_FUNCTIONS_CEILING, marked


# No function in gdswriter/ over 80 lines (docs/architecture.md, issue 38), counted from its def line
# to its last line, docstring included. The ones not split yet are named here, with why; the list only
# shrinks (an entry whose function was split fails the test too, so that it is taken out).
_LONG_FUNCTIONS_ALLOWED: set[str] = set()


def test_no_function_in_the_package_is_over_80_lines():
    import ast

    repo = Path(__file__).resolve().parents[1]
    long = {f"{p.relative_to(repo)}:{node.name}"
            for p in sorted((repo / "gdswriter").rglob("*.py"))
            for node in ast.walk(ast.parse(p.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 80}
    assert sorted(long - _LONG_FUNCTIONS_ALLOWED) == [], "split these by idea (docs/architecture.md)"
    assert sorted(_LONG_FUNCTIONS_ALLOWED - long) == [], "no longer over 80 lines: take them out of the list"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_names_bound(tree, *, on_any_object: bool) -> set[str]:
    """The underscore names a module binds: defs, classes, assignments, import aliases and
    parameters, and attributes it sets on `self`/`cls` (or, with ``on_any_object``, on anything)."""
    import ast

    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and (
                on_any_object or isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            out.add(node.attr)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update(a.asname for a in node.names if a.asname)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
    return {n for n in out if _private(n)}


def _private_reach() -> list[tuple[str, str, int]]:
    """Every place in tests/ that touches an underscore name of the package, as (file, name, line):
    `obj._name` (read or written), `setattr(obj, "_name", ...)` and `monkeypatch.setattr(obj,
    "_name", ...)` (also getattr/hasattr/delattr), `monkeypatch.setattr("gdswriter.m._name", ...)`,
    and `from gdswriter.m import _name` / `import gdswriter._m`. A name counts when the package binds
    it and the test file (or tests/support) does not: names the tests bind themselves are theirs.
    Read with ast, so the count is the same on every machine."""
    import ast

    repo = Path(__file__).resolve().parents[1]
    ours: set[str] = set()
    for p in (repo / "gdswriter").rglob("*.py"):
        ours |= _private_names_bound(ast.parse(p.read_text(), str(p)), on_any_object=True)
        if _private(p.stem):
            ours.add(p.stem)
    ours -= {"_optimizer_step_pre_hooks", "_metadata"}  # torch's (optimizer hooks, a state dict's metadata)
    support: set[str] = set()
    for p in (repo / "tests" / "support").rglob("*.py"):
        support |= _private_names_bound(ast.parse(p.read_text(), str(p)), on_any_object=False)
    reach = []
    for p in sorted((repo / "tests").rglob("*.py")):
        tree = ast.parse(p.read_text(), str(p))
        theirs = _private_names_bound(tree, on_any_object=False) | support
        for node in ast.walk(tree):
            named: list[str] = []  # through the package's module path: the package's for sure
            guessed: list[str] = []  # on an object: the package's unless the tests bind the name too
            if isinstance(node, ast.Attribute):
                guessed = [node.attr]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "gdswriter":
                named = node.module.split(".") + [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                named = [c for a in node.names if a.name.split(".")[0] == "gdswriter" for c in a.name.split(".")]
            elif isinstance(node, ast.Call) and node.args:
                func = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
                strings = [a.value if isinstance(a, ast.Constant) and isinstance(a.value, str) else None
                           for a in node.args[:2]]
                if func in ("setattr", "getattr", "hasattr", "delattr") and len(strings) == 2 and strings[1]:
                    guessed = [strings[1]]
                elif func in ("setattr", "delattr") and (strings[0] or "").startswith("gdswriter."):
                    named = strings[0].split(".")
            reach += [(str(p.relative_to(repo)), n, node.lineno) for n in named + guessed
                      if _private(n) and n in ours and (n in named or n not in theirs)]
    return sorted(set(reach))


# Where tests may touch a private name of the package (_private_reach), as (test file, name): each
# place that does is a place where a refactor breaks a test that tests nothing wrong (issue 38), so
# tests go through public seams (documented in the modules that have them: gdswriter/testing lists
# them). 164 places when this was counted first, 131 under the last ceiling, 20 now, all here.
PRIVATE_REACH_ALLOWED: dict[tuple[str, str], str] = {
    ("tests/test_package.py", "_version"): "checks the one file the version is written in",
    ("tests/test_cli.py", "_TAGS"): "every state_codec tag is in docs/format.md (the tags are not an API)",
    ("tests/test_engine_faults.py", "_done"): "a Ctrl-C inside the POSIX backend's own completion queue",
    ("tests/test_dist_dcp.py", "_check_secondary_final"):
        "another rank's rename (or a cleaning job) between OrderedCommit's count and its own rename",
    ("tests/test_dist_dcp.py", "_write"): "rank 0's write of a re-save fails after the others wrote beside it",
    ("tests/test_dist_dcp.py", "_wrote"): "a rank as if it failed before write_data last time (opens afresh)",
    ("tests/test_dist_dcp.py", "_engines"): "GDSStorageWriter keeps its engines from save to save, drops them on "
                                            "failure and pickling",
    ("tests/test_dcp_paths.py", "_engines"): "GDSStorageWriter made one engine per root, kept across checkpoint_ids",
    ("tests/test_dist_safety.py", "_session"): "GDSStorageWriter still holds its roots' lock when DCP skips finish",
    ("tests/test_dist_scale.py", "_open_shared"): "counts the host-tmpfs set-ups of a multi-rank load",
    ("tests/test_dcp_drain.py", "_publish"): "this rank's commit after another rank's commit (rename) of the drain "
                                             "directory right after its mark (drain.put_mark): a race two "
                                             "processes cannot be timed into",
    ("tests/test_drain_ranks.py", "_publish"): "GDSCheckpointer's drain: the same race, the other rank's rename "
                                               "landing before this rank reads the draft",
}


def test_the_tests_reach_into_private_names_only_through_the_allowlist():
    """Tests use public seams; a private name a test touches is in PRIVATE_REACH_ALLOWED, with its
    reason, and every entry there is still used (a stale one fails too). At most 20 entries."""
    reach = {(p, n) for p, n, _ in _private_reach()}
    assert len(PRIVATE_REACH_ALLOWED) <= 20
    assert not reach - PRIVATE_REACH_ALLOWED.keys(), (
        f"tests reach into private names: {sorted(reach - PRIVATE_REACH_ALLOWED.keys())}; use a public seam "
        f"(or add an entry to PRIVATE_REACH_ALLOWED, with its reason)")
    assert not PRIVATE_REACH_ALLOWED.keys() - reach, (
        f"stale entries in PRIVATE_REACH_ALLOWED: {sorted(PRIVATE_REACH_ALLOWED.keys() - reach)}; remove them")
