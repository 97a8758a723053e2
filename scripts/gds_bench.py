"""Durable save and cold load of GPU-resident state through every path, in one run, one table.

    python3 scripts/gds_bench.py --dir /nvme/bench --size 8G [--rounds 2] [--time-budget 170]

The state: bf16 matrices of 128 MiB plus small vectors, SIZE bytes in all, on the GPU.
Each method saves it durably (data on stable storage when the call returns), the page cache
is dropped, and it loads it back into GPU memory; the loaded bytes are compared with the
source. Methods, most important first (a round stops starting new ones when the time budget
would be exceeded; with several rounds they interleave, and the best of each is shown):

  ceiling        GPU -> pinned host buffer (D2H) + 4 threads of O_DIRECT pwrite, and back:
                 the raw path without checksums, manifests or commit (the probe's reference);
                 plus fio's disk-only figure and gdsio's GPU-direct one where installed
  io_uring       GDSCheckpointer on gdswriter's pinned-buffer engine (cudaHostRegister'ed
                 staging pool, D2H copies, io_uring + O_DIRECT)
  kvikio         GDSCheckpointer on the KvikIO engine (true GDS where it works, else KvikIO's
                 compat mode; the table says which), crc32c computed on the GPU
  gds            the same, refusing anything but true GPUDirect Storage
  kvikio raw     KvikIO CuFile pwrite/pread of the tensors, no checksums (KvikIO's own speed)
  safetensors    safetensors.torch save_file + fsync / load_file(device="cuda")
  DCP            torch.distributed.checkpoint save / load in place (single process)
  torch.save     torch.save + fsync / torch.load(map_location="cuda")

Also measured: crc32c on the GPU (GB/s). Every result line is printed as soon as it is
measured and the JSON file (--json) rewritten, so a run cut short keeps what it has.
``--device cpu`` runs the harness on host tensors (the methods that need CUDA are skipped):
that is how its logic is tested on machines without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gdswriter import CheckpointOptions, EngineOptions, GDSCheckpointer  # noqa: E402
from gdswriter.tools.bench import fsync_path  # noqa: E402
from gdswriter.tools.measure import fio_reference  # noqa: E402
from gdswriter.tools.pagecache import drop_caches, evict  # noqa: E402
from gdswriter.units import parse_size  # noqa: E402

MiB = 1 << 20
BIG = 128 * MiB  # bytes per large tensor (bf16 8192 x 8192)
SMALL = 16 << 10  # bytes per small tensor


class Skip(Exception):
    """A method that cannot run here; the reason is shown in the table."""


def make_state(nbytes: int, device: str) -> dict[str, torch.Tensor]:
    """About ``nbytes`` of tensors: large bf16 matrices and one small vector per matrix."""
    g = torch.Generator(device=device).manual_seed(0)
    n_big = max(1, nbytes // (BIG + SMALL))
    side = int((min(BIG, nbytes // n_big) // 2) ** 0.5)
    state = {}
    for i in range(n_big):
        state[f"layer{i}.weight"] = torch.randn(side, side, generator=g, device=device, dtype=torch.bfloat16)
        state[f"layer{i}.norm"] = torch.randn(SMALL // 4, generator=g, device=device)
    return state


def state_bytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k].to(a[k].device)) for k in a)


def cold(paths) -> bool:
    """Evict the files (and the whole page cache where allowed): the load reads the disk."""
    os.sync()
    for p in paths:
        with contextlib.suppress(OSError):
            evict(p)
    return drop_caches()


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def files_under(d: Path) -> list[Path]:
    return [p for p in d.rglob("*") if p.is_file()]


# ---------------------------------------------------------------------------- methods
class Method:
    """One way to save and load the state. ``write`` and ``load`` are timed; ``prepare`` is not."""

    in_place = False  # load() fills the live state's tensors (else it returns new ones)

    def prepare(self, state: dict, d: Path):
        return state

    def write(self, prepared, d: Path) -> None:
        raise NotImplementedError

    def load(self, state: dict, d: Path) -> dict:
        raise NotImplementedError

    def describe(self, d: Path) -> str:
        return ""


class Gdswriter(Method):
    """GDSCheckpointer with one engine: save(1) durable + committed, load(1) in place, verified."""

    in_place = True

    def __init__(self, engine: str):
        self.engine = engine
        self.ck = None

    def prepare(self, state, d):
        opts = CheckpointOptions(engine=EngineOptions.from_env(engine=self.engine))
        self.ck = GDSCheckpointer(state, None, root=d, options=opts)
        _ = self.ck.engine_info  # the engine's buffers and threads exist before the clock starts
        return self.ck

    def write(self, ck, d):
        ck.save(1)

    def load(self, state, d):
        try:
            self.ck.load(1)
        finally:
            self.ck.close()
        return state

    def describe(self, d):
        from gdswriter.format.commit import CommitProtocol
        from gdswriter.load.reader import read_manifest

        info = self.ck.engine_info
        files = read_manifest(CommitProtocol([d]), 1).files
        written_by = "/".join(sorted({f.info.get("engine", "?") for f in files}))
        pool = getattr(self.ck.engines[0], "_pool", None)
        pinned = f"; staging pool cudaHostRegister'ed: {pool.cuda_pinned}" if pool is not None else ""
        return f"engine {info.name}, CUDA path {info.cuda_path}; manifest: files by {written_by}{pinned}"


class Ceiling(Method):
    """D2H into one pinned buffer, then 4 threads of O_DIRECT pwrite in 64 MiB pieces; the reverse."""

    chunk = 64 * MiB

    def prepare(self, state, d):
        srcs = [t.view(-1).view(torch.uint8) for t in state.values()]
        total = -(-sum(s.numel() for s in srcs) // 4096) * 4096
        raw = torch.empty(total + 4096, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        start = -raw.data_ptr() % 4096  # O_DIRECT wants aligned memory (cudaHostAlloc's already is)
        self.pinned = raw[start:start + total]
        return srcs

    def _io(self, path: Path, write: bool) -> None:
        fd = os.open(path, (os.O_WRONLY | os.O_CREAT | os.O_TRUNC if write else os.O_RDONLY) | os.O_DIRECT, 0o644)
        try:
            mv = memoryview(self.pinned.numpy())
            offs = list(range(0, len(mv), self.chunk))
            errors = []

            def worker(k):
                try:
                    for o in offs[k::4]:
                        n = min(self.chunk, len(mv) - o)
                        m = os.pwrite(fd, mv[o:o + n], o) if write else os.preadv(fd, [mv[o:o + n]], o)
                        if m != n:
                            raise OSError(f"short {'write' if write else 'read'} at {o}: {m} of {n}")
                except BaseException as e:  # noqa: BLE001 - re-raised below
                    errors.append(e)

            ts = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
            [t.start() for t in ts]
            [t.join() for t in ts]
            if errors:
                raise errors[0]
            if write:
                os.fsync(fd)
        finally:
            os.close(fd)

    def write(self, srcs, d):
        o = 0
        for s in srcs:
            self.pinned[o:o + s.numel()].copy_(s, non_blocking=True)
            o += s.numel()
        if srcs[0].is_cuda:
            torch.cuda.synchronize()
        self._io(d / "ceiling.bin", True)

    def load(self, state, d):
        self._io(d / "ceiling.bin", False)
        out, o = {}, 0
        for k, t in state.items():
            n = t.numel() * t.element_size()
            out[k] = torch.empty_like(t)
            out[k].view(-1).view(torch.uint8).copy_(self.pinned[o:o + n], non_blocking=True)
            o += n
        return out


class KvikioRaw(Method):
    """KvikIO's own speed: CuFile pwrite/pread of each tensor at 4 KiB-aligned offsets, no checksums."""

    def prepare(self, state, d):
        try:
            import kvikio
        except Exception as e:  # noqa: BLE001
            raise Skip(f"KvikIO unavailable: {type(e).__name__}: {e}") from e
        self.kvikio = kvikio
        self.offsets, o = [], 0
        for t in state.values():
            self.offsets.append(o)
            o = -(-(o + t.numel() * t.element_size()) // 4096) * 4096
        return state

    def write(self, state, d):
        with self.kvikio.CuFile(d / "kvikio.bin", "w") as f:
            futs = [f.pwrite(t.view(-1).view(torch.uint8), file_offset=o) for t, o in zip(state.values(), self.offsets)]
            for fu in futs:
                fu.get()
            os.fsync(f.fileno())

    def load(self, state, d):
        out = {k: torch.empty_like(t) for k, t in state.items()}
        with self.kvikio.CuFile(d / "kvikio.bin", "r") as f:
            futs = [f.pread(t.view(-1).view(torch.uint8), file_offset=o) for t, o in zip(out.values(), self.offsets)]
            for fu in futs:
                fu.get()
        return out


class Safetensors(Method):
    def prepare(self, state, d):
        try:
            import safetensors.torch  # noqa: F401
        except ImportError as e:
            raise Skip("safetensors is not installed") from e
        return state

    def write(self, state, d):
        import safetensors.torch

        safetensors.torch.save_file(state, str(d / "model.safetensors"))
        fsync_path(d / "model.safetensors")

    def load(self, state, d):
        import safetensors.torch

        return safetensors.torch.load_file(str(d / "model.safetensors"), device=str(next(iter(state.values())).device))


class Dcp(Method):
    """torch.distributed.checkpoint in one process (no process group), fsync'ed files."""

    in_place = True

    def write(self, state, d):
        import torch.distributed.checkpoint as dcp

        with _quiet_warnings():
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(d / "dcp"), sync_files=True), no_dist=True)

    def load(self, state, d):
        import torch.distributed.checkpoint as dcp

        with _quiet_warnings():
            dcp.load(state, storage_reader=dcp.FileSystemReader(str(d / "dcp")), no_dist=True)
        return state


class TorchSave(Method):
    def write(self, state, d):
        with open(d / "model.pt", "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    def load(self, state, d):
        return torch.load(d / "model.pt", map_location=next(iter(state.values())).device, weights_only=True)


@contextlib.contextmanager
def _quiet_warnings():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# ---------------------------------------------------------------------------- harness
class Bench:
    def __init__(self, args):
        self.args = args
        self.results: list[dict] = []
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def record(self, row: dict) -> None:
        self.results.append(row)
        w = f"{row['write_gbps']:6.2f}" if row.get("write_gbps") else "     -"
        r = f"{row['read_gbps']:6.2f}" if row.get("read_gbps") else "     -"
        ok = {True: "ok", False: "MISMATCH", None: "-"}[row.get("ok")]
        print(f"  {row['method']:<28} write {w} GB/s  read {r} GB/s  {ok:<8} {row.get('note', '')}", flush=True)
        if self.args.json:
            with open(self.args.json, "w") as f:
                json.dump({"size_bytes": self.args.nbytes, "device": self.args.device, "results": self.results},
                          f, indent=1)

    def measure(self, name: str, method: Method, state: dict, nbytes: int) -> None:
        """One durable save + cold load of ``state`` by ``method``, in a fresh directory; the
        loaded bytes are compared with the reference copy."""
        d = Path(self.args.dir) / "".join(c if c.isalnum() else "_" for c in name)
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        loaded = None
        try:
            prepared = method.prepare(state, d)
            synchronize(self.args.device)
            t = time.perf_counter()
            method.write(prepared, d)
            t_w = time.perf_counter() - t
            note = method.describe(d)
            if method.in_place:  # the load must put every byte back
                for v in state.values():
                    v.zero_()
            was_cold = cold(files_under(d))
            synchronize(self.args.device)
            t = time.perf_counter()
            loaded = method.load(state, d)
            synchronize(self.args.device)
            t_r = time.perf_counter() - t
            ok = same(self.reference, loaded)
            self.record({"method": name, "write_gbps": nbytes / t_w / 1e9, "read_gbps": nbytes / t_r / 1e9,
                         "ok": ok, "cold": was_cold, "note": note + ("" if was_cold else " (read not cold)")})
        except Skip as e:
            self.record({"method": name, "ok": None, "note": f"skipped: {e}"})
        except Exception as e:  # noqa: BLE001 - one method failing must not stop the others
            traceback.print_exc(limit=4, file=sys.stdout)
            self.record({"method": name, "ok": None, "note": f"failed: {type(e).__name__}: {str(e)[:200]}"})
        finally:
            del loaded
            restore = getattr(method, "ck", None)
            if restore is not None:
                restore.close()
            for k, v in state.items():  # whatever happened, the next method starts from the true state
                v.copy_(self.reference[k])
            shutil.rmtree(d, ignore_errors=True)
            if self.args.device == "cuda":
                torch.cuda.empty_cache()

    def references(self, state, nbytes: int) -> None:
        """Disk-side ceilings that need no gdswriter: gdsio (GPU direct) and fio (host memory)."""
        d = Path(self.args.dir)
        gdsio = shutil.which("gdsio") or next(iter(sorted(Path("/usr/local").glob("cuda*/gds/tools/gdsio"))), None)
        if gdsio and self.args.device == "cuda":
            rows = {}
            for kind, flag in (("write", "1"), ("read", "0")):
                cmd = [str(gdsio), "-f", str(d / "gdsio.bin"), "-d", "0", "-w", "8", "-s", str(nbytes), "-i", "1M",
                       "-x", "0", "-I", flag]
                try:
                    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
                    rows[kind] = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else p.stderr.strip()[-200:]
                except (OSError, subprocess.SubprocessError) as e:
                    rows[kind] = str(e)
            with contextlib.suppress(OSError):
                os.unlink(d / "gdsio.bin")
            self.record({"method": "gdsio (GPU direct, -x 0)", "ok": None,
                         "note": f"write: {rows.get('write')} | read: {rows.get('read')}"})
        else:
            self.record({"method": "gdsio", "ok": None, "note": "not installed" if not gdsio else "needs CUDA"})
        if shutil.which("fio") is None:
            self.record({"method": "fio (disk only)", "ok": None, "note": "fio not installed"})
            return
        try:
            ref = fio_reference(d / "fio.bin", nbytes, {})
            w, r = ref.write_bps, ref.read_bps
            self.record({"method": "fio (disk only)", "write_gbps": w / 1e9, "read_gbps": r / 1e9, "ok": None,
                         "note": "io_uring, O_DIRECT, 4 MiB, QD16, from host memory"})
        except Exception as e:  # noqa: BLE001 - a reference that fails is reported, not fatal
            self.record({"method": "fio (disk only)", "ok": None, "note": f"failed: {e}"})

    def crc_speed(self, state) -> None:
        from gdswriter.cuda.checksum import crc32c_tensors

        ts = [t.view(-1).view(torch.uint8) for t in state.values()][:8]
        n = sum(t.numel() for t in ts)
        crc32c_tensors(ts[:1])  # tables uploaded, kernels warm
        synchronize(self.args.device)
        t = time.perf_counter()
        crc32c_tensors(ts)
        dt = time.perf_counter() - t
        self.record({"method": f"crc32c on {self.args.device} (torch)", "ok": None,
                     "note": f"{n / dt / 1e9:.2f} GB/s over {n / 2**30:.2f} GiB"})


METHODS = {  # key: (label, factory, needs CUDA)
    "ceiling": ("ceiling (D2H + O_DIRECT x4)", Ceiling, False),
    "io_uring": ("gdswriter io_uring", lambda: Gdswriter("io_uring"), False),
    "kvikio": ("gdswriter kvikio", lambda: Gdswriter("kvikio"), True),
    "gds": ("gdswriter gds", lambda: Gdswriter("gds"), True),
    "kvikio-raw": ("kvikio raw (no crc)", KvikioRaw, True),
    "safetensors": ("safetensors", Safetensors, False),
    "dcp": ("DCP", Dcp, False),
    "torch.save": ("torch.save / torch.load", TorchSave, False),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=str(Path.cwd() / ".bench-tmp" / "gds"), help="directory to write in")
    ap.add_argument("--size", default="8G", help="bytes of state (K/M/G suffixes; default 8G)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds over all methods, interleaved (default 2)")
    ap.add_argument("--time-budget", type=float, default=170.0,
                    help="seconds: no method starts when it would likely end past this (default 170)")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {','.join(METHODS)}")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="where the state lives")
    ap.add_argument("--no-references", action="store_true", help="skip gdsio/fio")
    ap.add_argument("--json", help="write the results here (rewritten after every measurement)")
    args = ap.parse_args(argv)
    args.nbytes = parse_size(args.size)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gds_bench: no CUDA device: nothing to measure (use --device cpu to exercise the harness)")
        return 0
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in names if m not in METHODS]
    if unknown:
        ap.error(f"unknown method(s) {unknown}; choose from {list(METHODS)}")
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    bench = Bench(args)
    state = make_state(args.nbytes, args.device)
    nbytes = state_bytes(state)
    bench.reference = {k: v.clone() for k, v in state.items()}
    print(f"gds_bench: {len(state)} tensors, {nbytes / 2**30:.2f} GiB on {args.device}, in {args.dir} "
          f"({subprocess.run(['df', '-hT', args.dir], capture_output=True, text=True).stdout.splitlines()[-1]})",
          flush=True)
    if args.device == "cuda":
        print(f"   {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    bench.crc_speed(state)
    if not args.no_references:
        bench.references(state, min(nbytes, 4 << 30))
    estimate = {}  # seconds each method took last time
    for rnd in range(args.rounds):
        print(f"-- round {rnd + 1}", flush=True)
        for key in names:
            label, factory, needs_cuda = METHODS[key]
            if needs_cuda and args.device != "cuda":
                bench.record({"method": label, "ok": None, "note": "skipped: needs CUDA"})
                continue
            guess = estimate.get(key, 3 * nbytes / 1e9)  # ~1 GB/s each way on a first visit
            if bench.elapsed() + guess > args.time_budget:
                bench.record({"method": label, "ok": None, "note": f"skipped: time budget ({args.time_budget:.0f} s)"})
                continue
            t = time.perf_counter()
            bench.measure(label, factory(), state, nbytes)
            estimate[key] = time.perf_counter() - t
    summarize(bench.results)
    return 0


def summarize(results: list[dict]) -> None:
    """One table: the best write and read of each method over the rounds."""
    best: dict[str, dict] = {}
    for r in results:
        b = best.setdefault(r["method"], {"write": None, "read": None, "ok": r.get("ok"), "note": r.get("note", "")})
        if r.get("write_gbps"):
            b["write"] = max(b["write"] or 0, r["write_gbps"])
            b["read"] = max(b["read"] or 0, r["read_gbps"])
            b["ok"] = r["ok"] if b["ok"] is not False else False
            b["note"] = r.get("note", "")
    print("\n== summary: best of rounds (GB/s; durable writes, cold reads)")
    print(f"  {'method':<28} {'write':>7} {'read':>7}  {'check':<8} note")
    for name, b in best.items():
        w = f"{b['write']:7.2f}" if b["write"] else "      -"
        r = f"{b['read']:7.2f}" if b["read"] else "      -"
        print(f"  {name:<28} {w} {r}  {({True: 'ok', False: 'MISMATCH', None: '-'}[b['ok']]):<8} {b['note']}")


if __name__ == "__main__":
    sys.exit(main())
