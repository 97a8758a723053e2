"""Coverage-guided fuzzing of every parser of checkpoint bytes (atheris: libFuzzer for Python).

    python tests/fuzz/fuzz.py --runs 20000 --seed 1          the CI campaign (about a minute)
    python tests/fuzz/fuzz.py --time 3600 --corpus DIR        a long campaign by hand (DIR keeps the corpus)
    python tests/fuzz/fuzz.py --replay FILE...                run inputs once (a finding, a regression)
    python tests/fuzz/fuzz.py --replay DIR --coverage         the parsers' lines a corpus executes

Seeds: every target fed the real files of tests/fuzz/seeds (tests/fuzz/make_seeds.py) and the
inputs of tests/fuzz/regressions. Mutations: libFuzzer's byte mutations, and half the time a
JSON-aware one (a node of the decoded payload replaced by boundary values, spliced, dropped or
duplicated). The outcomes (typed errors by name) are printed every 5000 inputs. Exit status 0: no finding; otherwise libFuzzer's (the input is written as
``crash-<sha1>`` under --artifacts, default the current directory) or 1 for --replay.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import copy
import json
import os
import random
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent.parent))

import harness  # noqa: E402

REGRESSIONS = HERE / "regressions"

_INTS = [0, 1, -1, 2, 7, 255, 4096, 2 ** 31, 2 ** 32, 2 ** 40, 2 ** 62, 2 ** 63 - 1, 2 ** 63, 2 ** 64, -(2 ** 63),
         10 ** 30]
_STRS = ["", "a", "x" * 300, "..", "a/b", "\u0000", "float32", "uint8", "bool", "int64", "all", "R", "manifest.json",
         "manifest-rank00001.json", "strided", "contiguous_format", "gdswriter", "gdswriter-shard", "dcp",
         "model.weight", "0" * 32]
_TAGGED = [{"$int": "0x" + "f" * 3700}, {"$int": "-0x1"}, {"$float": "nan"}, {"$float": "bits:7ff8000000000001"},
           {"$bytes": "AAAA"}, {"$tensor": 0}, {"$tensor": 99}, {"$ndarray": 1}, {"$npscalar": ["int8", 300]},
           {"$npscalar": ["float16", 1e300]}, {"$dtype": "float8_e4m3fn"}, {"$device": "cuda:99"},
           {"$size": [2 ** 63]}, {"$tuple": []}, {"$dict": [[{"$int": "0x" + "f" * 3700}, 1]]},
           {"$odict": [], "meta": {"$dict": []}}]


def _nodes(tree, path=()):
    yield path, tree
    if isinstance(tree, list):
        for i, x in enumerate(tree):
            yield from _nodes(x, path + (i,))
    elif isinstance(tree, dict):
        for k, x in tree.items():
            yield from _nodes(x, path + (k,))


def _replace(tree, path, value):
    if not path:
        return value
    parent = tree
    for k in path[:-1]:
        parent = parent[k]
    parent[path[-1]] = value
    return tree


def _value(rng: random.Random, nodes: list):
    pick = rng.random()
    if pick < 0.35:
        return rng.choice(_INTS) + rng.choice([0, 0, 0, 1, -1])
    if pick < 0.5:
        return rng.choice(_STRS)
    if pick < 0.65:
        return copy.deepcopy(rng.choice(_TAGGED))
    if pick < 0.85:
        return copy.deepcopy(rng.choice(nodes)[1])  # splice another part of the same input
    return rng.choice([None, True, False, 1.5, -0.0, [], {}, float("inf")])


def mutate_json(tree, rng: random.Random):
    """One structural change to a decoded JSON payload."""
    nodes = list(_nodes(tree))
    path, node = rng.choice(nodes)
    op = rng.random()
    if isinstance(node, list) and node and op < 0.4:
        i = rng.randrange(len(node))
        if op < 0.15:
            del node[i]
        elif op < 0.3:
            node.insert(i, copy.deepcopy(node[i]))
        else:
            node.append(_value(rng, nodes))
        return tree
    if isinstance(node, dict) and node and op < 0.4:
        key = rng.choice(list(node))
        if op < 0.2:
            del node[key]
        else:
            node[rng.choice(_STRS + [key])] = _value(rng, nodes)
        return tree
    return _replace(tree, path, _value(rng, nodes))


def custom_mutator(data: bytes, max_size: int, seed: int) -> bytes:
    import atheris

    rng = random.Random(seed)
    if len(data) > 1 and rng.random() < 0.5:
        tree = harness.loads(data[1:])
        if tree is not harness.NOT_JSON:
            head = data[:1] if rng.random() < 0.95 else bytes([rng.randrange(256)])
            out = head + json.dumps(mutate_json(tree, rng), separators=(",", ":")).encode()
            if len(out) <= max_size:
                return out
    return atheris.Mutate(data, max_size)


def corpus_dir(given: str | None, fx: harness.Fixtures) -> Path:
    """The corpus directory, holding the seed inputs and the regression inputs."""
    d = Path(given) if given else Path(tempfile.mkdtemp(prefix="gdswriter-fuzz-corpus-"))
    d.mkdir(parents=True, exist_ok=True)
    for name, data in harness.seed_inputs(fx).items():
        (d / f"seed-{name}").write_bytes(data)
        (d / f"seed-{name}-raw").write_bytes(bytes([data[0] | harness.RAW]) + data[1:])
    for p in sorted(REGRESSIONS.glob("*")) if REGRESSIONS.is_dir() else []:
        (d / f"regression-{p.name}").write_bytes(p.read_bytes())
    return d


PARSERS = {  # module: the functions that read checkpoint bytes (their nested code included)
    "format/manifest.py": {"decode_json", "from_json_bytes", "from_body", "_from_body", "_nonneg", "_int", "_str",
                           "_list", "_relpath", "_file_info", "_chunk", "_shard", "_dist_info", "problem",
                           "byte_extent"},
    "format/sharded.py": {"from_json_bytes", "from_body", "parse_global", "parse_step", "check_shard_bytes", "merge",
                          "from_json", "_parse_global", "_parse_shard", "_int", "_text", "_list", "_plain_name",
                          "_ints_in", "_texts_of", "_shards_ok", "_roots_ok", "_make", "overlapping", "load_merged",
                          "read_shard", "parse_shard", "match_roots"},
    "format/state_codec.py": {"decode_state", "_dec_float", "_dec_int", "_dec_b64", "_show", "shown", "key_text",
                              "dec", "array", "np_scalar", "tensor", "tensor_refs"},
    "format/commit.py": {"from_json_bytes", "root_identity", "_read_small_text", "latest_named", "step_owner",
                         "owned_by"},
    "format/assembly.py": {"build_manifest", "remap_tree", "tree_for_rank", "_pairs", "record_from_json"},
    "distributed/dcp_codec.py": {"metadata_from_json", "_ints", "_opt_str", "_tensor_entry", "_storage_data"},
    "distributed/dcp_paths.py": {"is_gdswriter_marker"},
    "distributed/dcp_reader.py": {"_read_metadata", "read_data", "records_of", "copy_chunk", "chunk_view",
                                  "check_dcp_records", "_bytes_problem", "_chunk_problem", "whole_target"},
    "distributed/dcp_offline.py": {"dcp_items", "dcp_model_keys", "read_dcp_items", "is_dcp_step"},
    "distributed/shards.py": {"assemble", "overlap", "target_block", "_distinct_bytes"},
    "load/reader.py": {"load_state", "read_manifest", "parse_manifest", "check_data_files", "check_file_sizes",
                       "read_tensors", "read_storages", "tensors_from_storages", "state_keys", "placeholder_tensors"},
}


def _code_lines(code) -> set[int]:
    lines = {line for _, _, line in code.co_lines() if line is not None and line != code.co_firstlineno}
    for c in code.co_consts:
        if hasattr(c, "co_lines"):
            lines |= _code_lines(c)
    return lines


def _parser_lines(code, names: set[str]) -> set[int]:
    """The lines of the functions named ``names`` in a module's (or class's) code."""
    out: set[int] = set()
    for c in code.co_consts:
        if hasattr(c, "co_lines"):
            out |= _code_lines(c) if c.co_name in names else _parser_lines(c, names)
    return out


def line_coverage(run) -> None:
    """Run ``run()`` under a line tracer; print, per module, the lines of its parsers it executed."""
    root = HERE.parent.parent / "gdswriter"
    hit: dict[str, set[int]] = collections.defaultdict(set)

    def tracer(frame, event, arg):
        name = frame.f_code.co_filename
        if not name.startswith(str(root)):
            return None
        hit[name].add(frame.f_lineno)
        return tracer

    sys.settrace(tracer)
    try:
        run()
    finally:
        sys.settrace(None)
    total_hit = total = 0
    for rel, names in PARSERS.items():
        path = root / rel
        lines = _parser_lines(compile(path.read_text(), str(path), "exec"), names)
        n = len(lines & hit[str(path)])
        total_hit, total = total_hit + n, total + len(lines)
        print(f"  {rel:28s} {n:5d} of {len(lines):5d} lines ({100 * n / len(lines):.0f}%)")
    print(f"  {'together':28s} {total_hit:5d} of {total:5d} lines ({100 * total_hit / total:.0f}%)")


def replay(files: list[str], coverage: bool = False) -> int:
    fx = harness.Fixtures()
    failed = 0

    def run() -> None:
        nonlocal failed
        for f in files:
            try:
                outcome = harness.run_one(fx, Path(f).read_bytes())
                if not coverage:
                    print(f"{f}: {outcome}")
            except BaseException as e:  # noqa: BLE001 - a finding: reported, the others still run
                failed += 1
                print(f"{f}: FINDING {type(e).__name__}: {str(e)[:500]}")

    try:
        harness.limit_memory()
        if coverage:
            print(f"lines of the parsers (fuzz.PARSERS) executed by {len(files)} inputs:")
            line_coverage(run)
        else:
            run()
    finally:
        fx.close()
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=0, help="executions (0: until --time)")
    ap.add_argument("--time", type=int, default=0, help="seconds (0: until --runs)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--corpus", help="corpus directory, kept (default: a temporary one)")
    ap.add_argument("--artifacts", default="./", help="where libFuzzer writes a finding (a prefix)")
    ap.add_argument("--max-len", type=int, default=16384)
    ap.add_argument("--replay", nargs="+", metavar="FILE", help="run these inputs once (a directory: its files)")
    ap.add_argument("--coverage", action="store_true", help="with --replay: the parsers' lines they execute")
    args = ap.parse_args()
    if os.environ.get("MALLOC_ARENA_MAX") is None:  # threads' malloc arenas would eat the address-space cap
        os.environ["MALLOC_ARENA_MAX"] = "2"
        os.execv(sys.executable, [sys.executable, *sys.argv])
    os.environ.setdefault("GDSWRITER_DIRECT_IO", "0")
    if args.replay:
        files = [str(f) for p in map(Path, args.replay) for f in (sorted(p.iterdir()) if p.is_dir() else [p])]
        return replay(files, args.coverage)

    import atheris

    with atheris.instrument_imports(include=["gdswriter"]):
        harness.modules()
    fx = harness.Fixtures()
    atexit.register(fx.close)
    corpus = corpus_dir(args.corpus, fx)
    for p in sorted(corpus.iterdir()):  # warm up (engines, threads) before the memory cap is set
        try:
            harness.run_one(fx, p.read_bytes())
        except BaseException:  # noqa: BLE001 - libFuzzer runs it again and reports it
            pass
    cap = harness.limit_memory()
    outcomes: collections.Counter = collections.Counter()

    def one_input(data: bytes) -> None:
        outcomes[harness.run_one(fx, data)] += 1
        if sum(outcomes.values()) % 5000 == 0:
            summary()

    def summary() -> None:
        print(f"gdswriter fuzz: {sum(outcomes.values())} inputs, outcomes {dict(outcomes.most_common())}; "
              f"address space capped at {cap >> 20} MiB; corpus {corpus}", flush=True)

    atexit.register(summary)  # libFuzzer ends the process without it, except after a finding: every 5000 too
    argv = [sys.argv[0], str(corpus), f"-seed={args.seed}", f"-max_len={args.max_len}", "-rss_limit_mb=0",
            "-timeout=30", f"-artifact_prefix={args.artifacts}", "-print_final_stats=1"]
    argv += [f"-runs={args.runs}"] if args.runs else []
    argv += [f"-max_total_time={args.time}"] if args.time else []
    atheris.Setup(argv, one_input, custom_mutator=custom_mutator)
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    sys.exit(main())
