"""The power-loss file system process: the model (model.py) served over FUSE (mfusepy, libfuse 3).

Run as ``python -m powerloss.fs MOUNTPOINT --out DIR --control SOCKET [--image FILE] ...``
(``tests/`` on the path). It mounts MOUNTPOINT in the foreground, single-threaded, and
serves until unmounted (``fusermount3 -u``), SIGTERM or SIGINT, or its parent's death
(PR_SET_PDEATHSIG). ``--image`` starts from a saved durable image instead of an empty file
system: that is how a remount after a power cut shows exactly what the disk kept. Given
several ``--image``, it serves them in turn at the same mount point: on the ``next`` command
and an unmount it mounts the next one (checking every state a cut may leave then costs no new
process; the path stays the same, which gdswriter's secondary roots rely on).

Every call counts as an operation if it changes something (create, mkdir, unlink, rmdir,
rename, link, symlink, write, truncate, open with O_TRUNC, chmod, utimens) or asks for
durability (fsync, fdatasync, fsyncdir: the "syncs"). A power cut happens:

* when armed, as the (N+1)-th sync (or operation) after arming arrives, before it takes
  effect, i.e. after N more have completed (``--cut-after-syncs``/``--cut-after-ops`` or the
  ``arm`` command);
* on the ``cut`` command.

At the cut the process writes the requested images of the disk (model.py: ``none`` is the
durable state; ``lag``, ``drop``, ``random:SEED`` and ``all`` add states where some pending changes
reached the disk) to ``--out`` as ``<digest>.img``, equal images once, with ``cut.json``
naming them, and from then on fails every call with EIO, as a dead disk would (the test kills
the application). Unmounting a single image without a cut is a clean shutdown: everything
becomes durable and ``--out``/clean.img holds it.

Control socket (a Unix stream socket; one command line per connection, one JSON line back):
``ping`` (says which image is served); ``cut [VARIANTS]``; ``arm syncs|ops N [VARIANTS]``;
``log`` (every operation so far, in order); ``stats`` (counts, which rename and O_DIRECT paths
ran); ``next`` (serve the next image after the coming unmount).

``--no-direct`` refuses O_DIRECT opens with EINVAL (as file systems without direct I/O do), so
applications take their buffered path; ``--no-exchange`` refuses renameat2(RENAME_EXCHANGE)
with EINVAL. Either way, durability follows fsync/fdatasync only, never the open flags.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import json
import os
import signal
import socketserver
import stat
import sys
import threading
import time
from pathlib import Path

from .model import (
    DIR,
    FILE,
    ROOT_INO,
    SYMLINK,
    Model,
    Node,
    decode_image,
    distinct,
    encode_image,
)

CONTROL_TIMEOUT_S = 30.0


def _import_mfusepy():
    import mfusepy

    if mfusepy.fuse_version_major != 3:
        raise SystemExit(f"powerloss.fs needs libfuse 3 (found libfuse {mfusepy.fuse_version_major}): "
                         f"apt-get install fuse3 libfuse3-3")
    return mfusepy


class PowerLossFS:
    """The FUSE operations (mfusepy's path-based API; open files by handle) over a Model."""

    def __init__(self, model: Model, out: Path, *, variants: str, no_direct: bool, no_exchange: bool):
        self.model, self.out = model, out
        self.variants = variants
        self.no_direct, self.no_exchange = no_direct, no_exchange
        self.lock = threading.RLock()
        self.handles: dict[int, int] = {}  # fh -> inode (files and directories)
        self.next_fh = 1
        self.ops = self.syncs = 0
        self.armed: tuple[str, int, str] | None = None  # ("syncs"|"ops", count at which to cut, variants)
        self.dead = False
        self.cut_info: dict | None = None
        self.log: list[list] = []
        self.stats = {"fsync": 0, "fdatasync": 0, "fsyncdir": 0, "exchange_done": 0, "exchange_refused": 0,
                      "direct_open": 0, "direct_refused": 0}

    # -- bookkeeping -----------------------------------------------------------
    def _begin(self, what: list, *, sync: bool = False) -> None:
        """Count a changing call; cut the power first if this is the armed one. Holds the lock."""
        self._check_alive()
        self.ops += 1
        self.syncs += sync
        if self.armed is not None:
            unit, at, variants = self.armed
            if (self.syncs if unit == "syncs" else self.ops) >= at and (sync or unit == "ops"):
                self.cut(variants, reason=what)
                raise OSError(errno.EIO, "the power is off")
        self.log.append([self.ops, self.syncs, *what])

    def _check_alive(self) -> None:
        if self.dead:
            raise OSError(errno.EIO, "the power is off")

    def arm(self, unit: str, n: int, variants: str | None) -> None:
        if unit not in ("syncs", "ops") or n < 0:
            raise ValueError(f"arm {unit} {n}: expected 'syncs' or 'ops' and N >= 0")
        now = self.syncs if unit == "syncs" else self.ops
        self.armed = (unit, now + n + 1, variants or self.variants)

    def cut(self, variants: str | None = None, reason: list | None = None) -> dict:
        """Power fails now: write the images of what the disk holds, then refuse everything."""
        if self.dead:
            return self.cut_info or {}
        named = self.model.variant_images(variants or self.variants)  # a bad spec raises before the cut
        self.dead = True
        images = {}
        for digest, (names, raw) in distinct(named).items():
            (self.out / f"{digest}.img").write_bytes(raw)
            images[digest] = names
        pending = sorted(n.ino for n in self.model.nodes.values() if n.pending)
        self.cut_info = {"ops": self.ops, "syncs": self.syncs, "refused": reason, "images": images,
                         "pending": pending}
        tmp = self.out / "cut.json.tmp"
        tmp.write_text(json.dumps(self.cut_info))
        tmp.rename(self.out / "cut.json")
        return self.cut_info

    def clean_shutdown(self) -> None:
        with self.lock:
            if self.dead:
                return
            self.model.sync_all()
            (self.out / "clean.img").write_bytes(encode_image(self.model.durable_image()))

    # -- helpers ---------------------------------------------------------------
    def _node(self, path: str | None, fh: int | None = None) -> Node:
        if fh is not None and fh in self.handles:
            return self.model.node(self.handles[fh])
        if path is None:
            raise OSError(errno.EBADF, "no path and no handle")
        return self.model.resolve(path)

    def _handle(self, n: Node) -> int:
        fh = self.next_fh
        self.next_fh += 1
        self.handles[fh] = n.ino
        return fh

    def _attrs(self, n: Node) -> dict:
        kind = {FILE: stat.S_IFREG, DIR: stat.S_IFDIR, SYMLINK: stat.S_IFLNK}[n.kind]
        size = len(n.data) if n.kind == FILE else len(n.target) if n.kind == SYMLINK else 4096
        return {"st_mode": kind | n.mode, "st_ino": n.ino, "st_nlink": self.model.nlink(n), "st_size": size,
                    "st_blocks": -(-size // 512), "st_blksize": 4096, "st_uid": os.getuid(), "st_gid": os.getgid(),
                    "st_mtime": n.mtime_ns, "st_ctime": n.mtime_ns, "st_atime": n.mtime_ns}

    def _open_check(self, path: str, flags: int) -> None:
        if flags & os.O_DIRECT:
            if self.no_direct:
                self.stats["direct_refused"] += 1
                raise OSError(errno.EINVAL, f"O_DIRECT refused on {path} (--no-direct)")
            self.stats["direct_open"] += 1

    # -- FUSE operations: reading ------------------------------------------------
    def getattr(self, path, fh=None):
        with self.lock:
            self._check_alive()
            return self._attrs(self._node(path, fh))

    def readdir(self, path, fh):
        with self.lock:
            self._check_alive()
            n = self._node(path, fh)
            # with an inode number each: readdir(3) skips entries whose d_ino is 0
            kinds = {FILE: stat.S_IFREG, DIR: stat.S_IFDIR, SYMLINK: stat.S_IFLNK}
            return [(".", {"st_mode": stat.S_IFDIR, "st_ino": n.ino}, 0),
                    ("..", {"st_mode": stat.S_IFDIR, "st_ino": ROOT_INO}, 0),
                    *((name, {"st_mode": kinds[self.model.node(i).kind], "st_ino": i}, 0)
                      for name, i in n.entries.items())]

    def readlink(self, path):
        with self.lock:
            self._check_alive()
            return self.model.resolve(path).target

    def read(self, path, size, offset, fh):
        with self.lock:
            self._check_alive()
            return bytes(self._node(path, fh).data[offset:offset + size])

    def statfs(self, path):
        used = sum(len(n.data) for n in self.model.nodes.values()) // 4096
        total = 1 << 22  # 16 GiB of 4 KiB blocks
        return {"f_bsize": 4096, "f_frsize": 4096, "f_blocks": total, "f_bfree": total - used, "f_bavail": total - used,
                    "f_files": 1 << 20, "f_ffree": (1 << 20) - len(self.model.nodes), "f_namemax": 255}

    def access(self, path, amode):
        with self.lock:
            self._check_alive()
            self.model.resolve(path)
        return 0

    def opendir(self, path):
        with self.lock:
            self._check_alive()
            n = self.model.resolve(path)
            if n.kind != DIR:
                raise OSError(errno.ENOTDIR, path)
            return self._handle(n)

    def releasedir(self, path, fh):
        with self.lock:
            self.handles.pop(fh, None)
        return 0

    def open(self, path, flags):
        with self.lock:
            self._check_alive()
            n = self.model.resolve(path)
            self._open_check(path, flags)
            if flags & os.O_TRUNC and n.kind == FILE:
                self._begin(["truncate", path, 0])
                self.model.truncate(n, 0)
            return self._handle(n)

    def release(self, path, fh):
        with self.lock:
            self.handles.pop(fh, None)
        return 0

    def flush(self, path, fh):
        return 0

    # -- FUSE operations: changing ------------------------------------------------
    def create(self, path, mode, flags=0):
        with self.lock:
            self._check_alive()
            self._open_check(path, flags)
            try:
                n = self.model.resolve(path)
            except FileNotFoundError:
                n = None
            if n is not None:
                if flags & os.O_EXCL:
                    raise OSError(errno.EEXIST, path)
                if flags & os.O_TRUNC:
                    self._begin(["truncate", path, 0])
                    self.model.truncate(n, 0)
                return self._handle(n)
            self._begin(["create", path])
            return self._handle(self.model.create(path, FILE, mode))

    def mkdir(self, path, mode):
        with self.lock:
            self._begin(["mkdir", path])
            self.model.create(path, DIR, mode)
        return 0

    def symlink(self, path, target):
        with self.lock:
            self._begin(["symlink", path, target])
            self.model.create(path, SYMLINK, 0o777, target)
        return 0

    def link(self, path, existing):
        with self.lock:
            self._begin(["link", existing, path])
            self.model.link(existing, path)
        return 0

    def unlink(self, path):
        with self.lock:
            self._begin(["unlink", path])
            self.model.remove(path, directory=False)
        return 0

    def rmdir(self, path):
        with self.lock:
            self._begin(["rmdir", path])
            self.model.remove(path, directory=True)
        return 0

    def rename(self, old, new, flags=0):
        with self.lock:
            self._check_alive()
            if flags & 2 and self.no_exchange:  # RENAME_EXCHANGE
                self.stats["exchange_refused"] += 1
                raise OSError(errno.EINVAL, "RENAME_EXCHANGE refused (--no-exchange)")
            self._begin(["rename", old, new, flags])
            self.model.rename(old, new, flags)
            if flags & 2:
                self.stats["exchange_done"] += 1
        return 0

    def write(self, path, data, offset, fh):
        with self.lock:
            n = self._node(path, fh)
            self._begin(["write", path, offset, len(data)])
            return self.model.write(n, offset, data)

    def truncate(self, path, length, fh=None):
        with self.lock:
            n = self._node(path, fh)
            self._begin(["truncate", path, length])
            self.model.truncate(n, length)
        return 0

    def chmod(self, path, mode):
        with self.lock:
            n = self._node(path)
            self._begin(["chmod", path, mode])
            self.model.chmod(n, mode)
        return 0

    def chown(self, path, uid, gid):
        with self.lock:
            self._check_alive()
        return 0

    def utimens(self, path, times=None):
        with self.lock:
            n = self._node(path)
            self._begin(["utimens", path])
            self.model.touch(n, times[1] if times else time.time_ns())
        return 0

    def fsync(self, path, datasync, fh):
        with self.lock:
            n = self._node(path, fh)
            kind = "fdatasync" if datasync else "fsync"
            self._begin([kind, path], sync=True)
            self.stats[kind] += 1
            self.model.fsync(n, datasync=bool(datasync))
        return 0

    def fsyncdir(self, path, datasync, fh):
        with self.lock:
            n = self._node(path, fh)
            self._begin(["fsyncdir", path], sync=True)
            self.stats["fsyncdir"] += 1
            self.model.fsync(n, datasync=False)
        return 0

    # -- control -------------------------------------------------------------------
    def control(self, line: str) -> dict:
        words = line.split()
        cmd = words[0] if words else ""
        with self.lock:
            if cmd == "ping":
                return {"ok": True, "dead": self.dead}
            if cmd == "cut":
                return {"ok": True, **self.cut(words[1] if len(words) > 1 else None, reason=["control"])}
            if cmd == "arm" and len(words) in (3, 4):
                self.arm(words[1], int(words[2]), words[3] if len(words) == 4 else None)
                return {"ok": True}
            if cmd == "log":
                return {"ok": True, "log": self.log}
            if cmd == "stats":
                return {"ok": True, "ops": self.ops, "syncs": self.syncs, "dead": self.dead, **self.stats}
        return {"ok": False, "error": f"unknown command {line!r}: ping, cut [VARIANTS], arm syncs|ops N "
                                      f"[VARIANTS], log, stats, next"}


class _Serving:
    """Which image the process serves now, and whether to go on to the next after an unmount."""

    def __init__(self):
        self.fs: PowerLossFS | None = None
        self.index = -1
        self.go_on = False

    def control(self, line: str) -> dict:
        if line.strip() == "next":
            self.go_on = True
            return {"ok": True}
        reply = self.fs.control(line)
        return {**reply, "image": self.index} if line.strip() == "ping" else reply


def _serve_control(serving: _Serving, path: str) -> socketserver.UnixStreamServer:
    class Handler(socketserver.StreamRequestHandler):
        def handle(self):
            self.request.settimeout(CONTROL_TIMEOUT_S)
            line = self.rfile.readline().decode().strip()
            try:
                reply = serving.control(line)
            except Exception as e:  # a bad command must not kill the file system
                reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            self.wfile.write((json.dumps(reply) + "\n").encode())

    if os.path.exists(path):
        os.unlink(path)
    server = socketserver.UnixStreamServer(path, Handler)
    threading.Thread(target=server.serve_forever, args=(0.05,), name="powerloss-control", daemon=True).start()
    return server


def _die_with_parent() -> None:
    """SIGTERM (libfuse's handler unmounts and exits) when the process that started us dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:
        os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m powerloss.fs", description=__doc__.split("\n\n")[0])
    ap.add_argument("mountpoint")
    ap.add_argument("--out", required=True, help="directory for cut.json and the images")
    ap.add_argument("--control", required=True, help="path of the control socket")
    ap.add_argument("--image", action="append", default=[],
                    help="start from this durable image (default: an empty file system); given several "
                         "times, the images lie side by side in directories 0, 1, ...")
    ap.add_argument("--variants", default="none", help="images to write at a cut (comma-separated): none, lag, drop, all, random:SEED")
    ap.add_argument("--cut-after-syncs", type=int)
    ap.add_argument("--cut-after-ops", type=int)
    ap.add_argument("--no-direct", action="store_true", help="refuse O_DIRECT (EINVAL)")
    ap.add_argument("--no-exchange", action="store_true", help="refuse renameat2(RENAME_EXCHANGE) (EINVAL)")
    args = ap.parse_args(argv)
    mfusepy = _import_mfusepy()
    _die_with_parent()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    serving = _Serving()

    class Fuse(mfusepy.FUSE):
        def rename_fuse_3(self, old: bytes, new: bytes, flags: int) -> int:
            # mfusepy drops renameat2's flags; RENAME_EXCHANGE must not become a plain rename
            return self.operations.rename(old.decode(self.encoding, self.errors),
                                          new.decode(self.encoding, self.errors), flags)

    class Ops(mfusepy.Operations):
        use_ns = True

    server = None
    try:
        for i, image in enumerate(args.image or [None]):
            model = Model(decode_image(Path(image).read_bytes()) if image else None)
            fs = PowerLossFS(model, out, variants=args.variants, no_direct=args.no_direct,
                             no_exchange=args.no_exchange)
            if args.cut_after_syncs is not None:
                fs.arm("syncs", args.cut_after_syncs, None)
            if args.cut_after_ops is not None:
                fs.arm("ops", args.cut_after_ops, None)
            serving.fs, serving.index, serving.go_on = fs, i, False
            server = server or _serve_control(serving, args.control)
            ops = Ops()
            for name in ("getattr", "readdir", "readlink", "read", "statfs", "access", "opendir", "releasedir",
                         "open", "release", "flush", "create", "mkdir", "symlink", "link", "unlink", "rmdir",
                         "rename", "write", "truncate", "chmod", "chown", "utimens", "fsync", "fsyncdir"):
                setattr(ops, name, getattr(fs, name))
            try:
                Fuse(ops, args.mountpoint, foreground=True, nothreads=True, hard_remove=True, use_ino=True,
                     fsname="powerloss", subtype="powerloss")
            except RuntimeError as e:  # the FUSE loop ended with an error
                if not serving.go_on:
                    raise
                # the harness asked for the next image and unmounted this one: how this image's loop
                # ended (once in CI, ECONNABORTED reading /dev/fuse) changes nothing in the next one
                print(f"powerloss fs: image {i}'s loop ended with {e!r} after 'next'; serving image {i + 1}",
                      file=sys.stderr, flush=True)
            if len(args.image) <= 1:
                fs.clean_shutdown()
            if not serving.go_on:  # unmounted for good (or SIGTERM): stop
                break
    finally:
        if server is not None:
            server.shutdown()
        with contextlib.suppress(OSError):
            os.unlink(args.control)
    return 0


if __name__ == "__main__":
    sys.exit(main())
