"""Coverage-guided fuzzing of every parser of checkpoint bytes (atheris: libFuzzer for Python).

    python tests/fuzz/fuzz.py --runs 20000 --seed 1          the CI campaign (about a minute)
    python tests/fuzz/fuzz.py --time 3600 --corpus DIR        a long campaign by hand (DIR keeps the corpus)
    python tests/fuzz/fuzz.py --replay FILE...                run inputs once (a finding, a regression)

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


def replay(files: list[str]) -> int:
    fx = harness.Fixtures()
    failed = 0
    try:
        harness.limit_memory()
        for f in files:
            try:
                print(f"{f}: {harness.run_one(fx, Path(f).read_bytes())}")
            except BaseException as e:  # noqa: BLE001 - a finding: reported, the others still run
                failed += 1
                print(f"{f}: FINDING {type(e).__name__}: {str(e)[:500]}")
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
    ap.add_argument("--replay", nargs="+", metavar="FILE")
    args = ap.parse_args()
    if os.environ.get("MALLOC_ARENA_MAX") is None:  # threads' malloc arenas would eat the address-space cap
        os.environ["MALLOC_ARENA_MAX"] = "2"
        os.execv(sys.executable, [sys.executable, *sys.argv])
    os.environ.setdefault("GDSWRITER_DIRECT_IO", "0")
    if args.replay:
        return replay(args.replay)

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
