"""`gdswriter demo`: the engine against raw references on one directory, then a toy checkpoint."""

from __future__ import annotations

import contextlib
import math
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crc32c as _crc32c

from .._version import __version__
from ..tools.measure import cold, disk_reference, mem_available, mount_of
from ..units import GiB, MiB, gbps, human, parse_size
from ._common import EXIT_CORRUPT, EXIT_OK, UsageError, out, table, yes_no


def register(sub) -> None:
    sp = sub.add_parser("demo", help="measure the engine against the disk's ceiling, then a toy checkpoint",
                        description="Write SIZE bytes through the I/O engine (durably) and read them back from a "
                                    "cold cache, checking crc32c; measure the disk's ceiling on the same directory "
                                    "(fio when installed; it is optional: without it, gdswriter's built-in "
                                    "multi-queue O_DIRECT loop); then save and load a small toy checkpoint. Needs "
                                    "about 2 x SIZE + 2 x CKPT-SIZE free (8.5 GiB by default); everything it writes "
                                    "is removed afterwards. Takes about a minute on a 1 GB/s disk.")
    sp.add_argument("--dir", metavar="D", help="directory to test (default: a temporary directory under the "
                                               "current one)")
    sp.add_argument("--size", default="4G", metavar="SIZE", help="bytes to write and read (K/M/G suffixes; "
                                                                  "default 4G)")
    sp.add_argument("--engine", default="auto", choices=("auto", "io_uring", "posix"), help="I/O engine")
    sp.add_argument("--ckpt-size", default="256M", metavar="SIZE", help="toy checkpoint size (default 256M)")
    sp.add_argument("--no-fio", action="store_true", help="use the built-in ceiling reference even if fio is installed")
    sp.set_defaults(func=run)


def run(args) -> int:
    from ..engines.select import create_engine
    from ..options import EngineOptions

    size = -(-parse_size(args.size) // 4096) * 4096
    ckpt_size = parse_size(args.ckpt_size)
    base = Path(args.dir) if args.dir else Path.cwd()
    if base.exists() and not base.is_dir():
        raise UsageError(f"--dir {base} is not a directory")
    made_base = not base.exists()
    base.mkdir(parents=True, exist_ok=True)
    need = 2 * size + 2 * ckpt_size
    free = shutil.disk_usage(base).free
    if free < need:
        if made_base:
            with contextlib.suppress(OSError):
                base.rmdir()
        raise UsageError(f"not enough free space in {base.resolve()}: the demo needs {human(need)} (2 x --size "
                          f"{human(size)} + the toy checkpoint), {human(free)} is free. Pass --dir on a bigger "
                          f"file system or a smaller --size")
    opts = EngineOptions.from_env(engine=args.engine)
    work = Path(tempfile.mkdtemp(prefix=".gdswriter-demo-", dir=base))
    cache: dict = {}
    try:
        moved = 4 * size + 2 * ckpt_size
        fio = ("not used (--no-fio)" if args.no_fio else "installed" if shutil.which("fio")
               else "not installed (optional)")
        out(f"gdswriter {__version__} demo: {human(size)} through the engine in {work} ({mount_of(work)})")
        out(f"needs       {human(need)} free here ({human(free)} free; all removed afterwards); moves "
            f"{human(moved)} through the disk: {_duration(moved / 1e9)} at 1 GB/s, "
            f"{_duration(moved / 3e9)} at 3 GB/s; fio {fio}")
        pattern = _Pattern.of(size)
        engine_file = work / "engine.bin"
        with create_engine(opts) as engine:
            eng = _engine_round_trip(engine, engine_file, pattern, cache)
        with contextlib.suppress(OSError):
            engine_file.unlink()
        ok = not (eng.bad_w or eng.bad_r or eng.bad_mem)
        info = eng.info
        direct = (f"yes ({info.direct_memory_alignment}-byte aligned memory goes zero-copy)"
                  if info.direct_io else "no")
        out(f"engine      {info.name}: direct I/O {direct}, registered buffers "
             f"{yes_no(info.registered_buffers)}, page-locked {yes_no(info.page_locked)}, "
             f"huge-page buffers {yes_no(info.huge_page_buffers)}"
             + (f"; fallback reason: {info.reason}" if info.reason else ""))

        # -- the disk's ceiling on the same directory: fio if installed, else the built-in loop
        try:
            ref, why = disk_reference(work / "reference.bin", size, memoryview(pattern.src_np), cache,
                                      use_fio=not args.no_fio)
        except OSError as e:
            ref, why = None, f"failed: {e.strerror or e}"
        out(f"ceiling     {ref.name if ref else 'none'} ({why})")
        how = "posix_fadvise(DONTNEED)" + (" + drop_caches" if cache.get("dropped") else
                                            " (drop_caches not permitted)")
        out(f"cold cache  {how}; write timings include fdatasync")
        out("")
        eng_w, eng_r = size / eng.t_write, size / eng.t_read
        _print_against_ceiling(info.name, eng_w, eng_r, ref, opts)
        out(f"  crc32c: {len(pattern.offsets)} span(s) written, read back and recomputed from memory: "
             + ("ok" if ok else f"MISMATCH (write {eng.bad_w}, read {eng.bad_r}, memory {eng.bad_mem})"))

        # -- a small end-to-end checkpoint
        out("")
        ck_ok = _demo_checkpoint(work / "ckpt", ckpt_size, opts, cache, eng_w, eng_r)
        ok = ok and ck_ok
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if made_base:
            with contextlib.suppress(OSError):
                base.rmdir()
    return EXIT_OK if ok else EXIT_CORRUPT


@dataclass
class _Pattern:
    """What the engine writes: ``size`` bytes as spans of one random block (the last one cut
    short), with each span's expected crc32c."""

    size: int
    block: int
    src: Any  # torch.Tensor (uint8, ``block`` bytes)
    src_np: Any  # its numpy view
    offsets: list[int]
    expect: list[int]

    @staticmethod
    def of(size: int) -> _Pattern:
        import torch

        block = min(size, 64 * MiB)
        gen = torch.Generator().manual_seed(1234)
        src = torch.randint(0, 256, (block,), dtype=torch.uint8, generator=gen)
        src_np = src.numpy()
        crc_block = _crc32c.crc32c(src_np)
        tail = size % block
        crc_tail = _crc32c.crc32c(src_np[:tail]) if tail else crc_block
        offsets = list(range(0, size, block))
        expect = [crc_tail if (o + block > size) else crc_block for o in offsets]
        return _Pattern(size, block, src, src_np, offsets, expect)


@dataclass
class _EngineRun:
    """The engine's round trip: its info, the seconds to write (durably) and to read (cold), and
    the spans whose crc32c differed on write, on read and as recomputed from memory."""

    info: Any
    t_write: float
    t_read: float
    bad_w: int
    bad_r: int
    bad_mem: int


def _engine_round_trip(engine, path: Path, pattern: _Pattern, cache: dict) -> _EngineRun:
    """Write ``pattern`` to one file through ``engine``, durably, then read it back from a cold
    cache in batches of at most a quarter of the available memory (1 GiB at most)."""
    import torch

    from ..engines.base import ReadSpan, WriteSpan

    size, block, offsets, expect = pattern.size, pattern.block, pattern.offsets, pattern.expect
    spans = [WriteSpan(o, pattern.src[:min(block, size - o)]) for o in offsets]
    t0 = time.perf_counter()
    crcs = engine.write_file(path, spans, size=size, durable=True)
    t_write = time.perf_counter() - t0
    bad_w = sum(1 for a, b in zip(crcs, expect) if a != b)
    cold(path, cache)
    avail = mem_available()
    dest_len = max(block, min(size, 1 * GiB, (avail // 4) // block * block if avail else GiB))
    dest = torch.zeros(dest_len, dtype=torch.uint8)  # touched: page faults are not the engine's time
    t_read, bad_r, bad_mem = 0.0, 0, 0
    for start in range(0, size, dest_len):
        batch = [o for o in offsets if start <= o < start + dest_len]
        rspans = [ReadSpan(o, dest[o - start:o - start + min(block, size - o)]) for o in batch]
        t0 = time.perf_counter()
        got = engine.read_file(path, rspans)
        t_read += time.perf_counter() - t0
        for o, g, s in zip(batch, got, rspans):
            want = expect[o // block]
            bad_r += g != want
            bad_mem += _crc32c.crc32c(s.out.numpy()) != want  # what landed in memory, recomputed
    del dest
    return _EngineRun(engine.info, t_write, t_read, bad_w, bad_r, bad_mem)


def _print_against_ceiling(name: str, eng_w: float, eng_r: float, ref: Any, opts: Any) -> None:
    """The engine's GB/s beside the ceiling's (``ref``, None when not measured), and their ratio."""

    def cell(x: float | None) -> str:
        return f"{x / 1e9:.2f}" if x else "-"

    def share(x: float, ceiling: float | None) -> str:
        return f"{100 * x / ceiling:.0f}%" if ceiling else "-"

    rows = [["", "write GB/s", "read GB/s"],
            [f"gdswriter engine ({name})", cell(eng_w), cell(eng_r)],
            [f"ceiling: {ref.name if ref else 'not measured'}", cell(ref and ref.write_bps),
             cell(ref and ref.read_bps)],
            ["engine / ceiling", share(eng_w, ref and ref.write_bps), share(eng_r, ref and ref.read_bps)]]
    for line in table(rows, right={1, 2}):
        out(line)
    if ref and (eng_w > 1.1 * ref.write_bps or eng_r > 1.1 * ref.read_bps):
        out("  (above 100%: the disk's speed moved between the two measurements, or the engine keeps more "
            f"requests in flight ({opts.queue_depth} x {human(opts.request_bytes)}) than the reference; a "
            "larger --size evens out drift)")


def _duration(seconds: float) -> str:
    if seconds < 1:
        return "under 1 s"
    return f"about {seconds:.0f} s" if seconds < 90 else f"about {seconds / 60:.1f} min"


def _demo_checkpoint(root: Path, ckpt_size: int, opts, cache: dict, eng_w: float, eng_r: float) -> bool:
    """Save and load a toy model (the first save of a fresh checkpointer: it streams through
    the snapshot pool's ring, save/pool.py) and compare with the engine's own speed above:
    what a save or load does besides moving bytes (the step directory, the manifest, the
    fsyncs; reading and checking the manifest, applying the state) is said in milliseconds
    when it weighs at this size."""
    import torch

    from ..checkpointer import GDSCheckpointer
    from ..options import CheckpointOptions

    d = max(64, math.isqrt(max(ckpt_size // 16, 1)) // 64 * 64)  # 4 fp32 d x d layers ~ ckpt_size
    torch.manual_seed(0)
    with torch.no_grad():
        model = torch.nn.Sequential(*[torch.nn.Linear(d, d) for _ in range(4)])
    params = [p for p in model.state_dict().values()]
    nbytes = sum(p.numel() * p.element_size() for p in params)
    before = [_crc32c.crc32c(p.detach().numpy()) for p in params]
    with GDSCheckpointer(model, root=root, options=CheckpointOptions(engine=opts)) as ck:
        _ = ck.engine_info  # create the engine (buffers, ring) before timing
        t0 = time.perf_counter()
        ck.save(1)
        t_save = time.perf_counter() - t0
        for f in (root / "step_000000000001").iterdir():
            cold(f, cache)
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        t0 = time.perf_counter()
        ck.load(1)
        t_load = time.perf_counter() - t0
    after = [_crc32c.crc32c(p.detach().numpy()) for p in model.state_dict().values()]
    ok = after == before
    shutil.rmtree(root, ignore_errors=True)
    rows = [["checkpoint", "GB/s", "seconds", ""],
            ["save (durable + committed)", f"{gbps(nbytes, t_save):.2f}", f"{t_save:.3f}", ""],
            ["load (cold, verified)", f"{gbps(nbytes, t_load):.2f}", f"{t_load:.3f}", ""]]
    out(f"checkpoint  GDSCheckpointer save + load of a toy model: {len(params)} tensors, {human(nbytes)}")
    for line in table(rows, right={1, 2}):
        out(line)
    out("  loaded tensors equal the saved ones: " + ("ok" if ok else "MISMATCH"))
    w, r = nbytes / t_save / eng_w, nbytes / t_load / eng_r
    if w < 0.9 or r < 0.9:
        out(f"  save at {100 * w:.0f}% and load at {100 * r:.0f}% of the engine's write and read above: besides "
            f"moving the bytes, a save spent {max(0.0, t_save - nbytes / eng_w) * 1e3:.0f} ms and the load "
            f"{max(0.0, t_load - nbytes / eng_r) * 1e3:.0f} ms on what every checkpoint does (step directory, "
            f"manifest and fsyncs; reading and checking the manifest, applying the state), which weighs at "
            f"{human(nbytes)}; a larger --ckpt-size shows the engine's speed")
    return ok
