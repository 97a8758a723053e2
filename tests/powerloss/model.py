"""The durability model: a file system in memory that knows what a power cut would keep.

Every object (file, directory, symlink) is an inode with two states:

* the **live** state, what applications see now;
* the **durable** state, what survives a power cut.

Changes go to the live state and are appended to the object's log of pending changes.
Only these calls move live state into the durable state:

* ``fsync(file)``: the file's data, size and metadata (mode, mtime);
* ``fdatasync(file)``: the file's data and size (Linux: size changes needed to read the
  data back are part of fdatasync), not mode or mtime;
* ``fsync(directory)`` (FUSE's fsyncdir): the directory's entries, i.e. which names it holds
  and which inode each names (creates, unlinks, renames and links inside it), and its mode.

Nothing else is durable: not a file's name (fsync of a file does not persist the entry that
names it: fsync its directory), not the contents of a directory's children (fsync of a
directory does not persist its files' data), not a new directory's existence in its parent.
An object that a durable entry names but that was never fsynced itself survives in the state
it was created in (an empty file or directory). A rename is a change of the directory (or
two directories) it touches: within one directory it is one atomic change; across two
directories the removal of the old name becomes durable with the old directory's fsync and
the new name with the new directory's, so a cut between them can show the object under both
names or under neither (POSIX promises nothing more; ALICE and CrashMonkey use the same
per-directory model). RENAME_EXCHANGE in one directory is one atomic change.

A power cut produces the durable image ("none": every pending change lost) and, on request,
images where some pending changes did reach the disk, as a real disk may have written them
on its own before the power went:

* ``lag``: for each directory with pending changes, an image where everything pending reached
  the disk except that directory's changes. This is what exposes a missing fsync of that
  directory even when a later fsync of it would hide the omission in the "none" image (e.g.
  the files of a deleted directory gone while the directory's own removal was not persisted);
* ``drop``: for each directory with two or more pending changes, and each of them, an image
  where everything pending reached the disk except that one change: journaling file systems
  keep a directory's changes in order, POSIX does not promise it;
* ``random``: each object with pending changes independently keeps none, all, or part of
  them: for a file, a random subset of its pending writes (each write possibly torn at 4 KiB
  page boundaries, writes reordered) and possibly the live size with zeros where writes were
  lost; for a directory, a random prefix of its pending entry changes (a directory's own
  changes keep their order, as journaling file systems keep them);
* ``all``: every pending change persisted (what a process crash leaves).

Not modelled: torn sector writes inside a 4 KiB page, corruption of data that was durable,
metadata a file system writes on its own (timestamps other than mtime, block maps), reads
returning data that later disappears (the kernel page cache of a real file system), and
ordering guarantees stronger than POSIX's that some file systems give (ext4's data=ordered,
rename-over-file heuristics); a program that needs those would pass on ext4 and fail here.

Images serialise to a compact file (JSON header + raw data), so a new file-system process
can mount exactly the durable state.
"""

from __future__ import annotations

import errno
import hashlib
import json
import random
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

FILE, DIR, SYMLINK = "file", "dir", "symlink"
ROOT_INO = 1
PAGE = 4096
RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2


def _err(code: int, what: str = "") -> OSError:
    return OSError(code, f"{errno.errorcode.get(code, code)}: {what}")


@dataclass
class Saved:
    """One object's state as it is (or would be) on the disk."""

    kind: str
    mode: int
    data: bytes = b""  # files
    entries: dict[str, int] = field(default_factory=dict)  # directories: name -> inode
    target: str = ""  # symlinks
    mtime_ns: int = 0

    def copy(self) -> Saved:
        return Saved(self.kind, self.mode, self.data, dict(self.entries), self.target, self.mtime_ns)


class Node:
    """An inode: live state, the log of changes not yet durable, and what it was born as."""

    __slots__ = ("born", "data", "entries", "ino", "kind", "log", "meta_dirty", "mode", "mtime_ns", "target")

    def __init__(self, ino: int, kind: str, mode: int, target: str = "", mtime_ns: int | None = None):
        self.ino, self.kind, self.mode, self.target = ino, kind, mode, target
        self.data = bytearray()
        self.entries: dict[str, int] = {}
        self.mtime_ns = time.time_ns() if mtime_ns is None else mtime_ns
        # pending changes since the last sync of this object: files ("write", offset, bytes) and
        # ("size", n); directories the entries each change writes, ((name, inode or None), ...)
        self.log: list[tuple] = []
        self.meta_dirty = False  # mode or mtime changed since the last fsync
        self.born = Saved(kind, mode, target=target, mtime_ns=self.mtime_ns)

    def saved_live(self) -> Saved:
        return Saved(self.kind, self.mode, bytes(self.data), dict(self.entries), self.target, self.mtime_ns)

    @property
    def pending(self) -> bool:
        return bool(self.log) or self.meta_dirty


class Model:
    """The file system: inodes by number, the durable state of each, the operation counters."""

    def __init__(self, image: dict[int, Saved] | None = None):
        self.nodes: dict[int, Node] = {}
        self.durable: dict[int, Saved] = {}
        if image is None:
            image = {ROOT_INO: Saved(DIR, 0o755)}
        if ROOT_INO not in image or image[ROOT_INO].kind != DIR:
            raise ValueError("an image needs a root directory (inode 1)")
        for ino, s in image.items():
            n = Node(ino, s.kind, s.mode, s.target, s.mtime_ns)
            n.data, n.entries = bytearray(s.data), dict(s.entries)
            self.nodes[ino] = n
            self.durable[ino] = s.copy()
        self.next_ino = max(self.nodes) + 1

    # -- lookups -------------------------------------------------------------
    def node(self, ino: int) -> Node:
        return self.nodes[ino]

    def resolve(self, path: str) -> Node:
        """The live inode at absolute ``path`` (no symlinks followed: the kernel resolves them)."""
        n = self.nodes[ROOT_INO]
        for part in path.split("/"):
            if not part:
                continue
            if n.kind != DIR:
                raise _err(errno.ENOTDIR, path)
            ino = n.entries.get(part)
            if ino is None:
                raise _err(errno.ENOENT, path)
            n = self.nodes[ino]
        return n

    def parent_of(self, path: str) -> tuple[Node, str]:
        head, _, name = path.rstrip("/").rpartition("/")
        if not name:
            raise _err(errno.EINVAL, path)
        parent = self.resolve(head or "/")
        if parent.kind != DIR:
            raise _err(errno.ENOTDIR, path)
        return parent, name

    def nlink(self, n: Node) -> int:
        if n.kind == DIR:
            return 2 + sum(self.nodes[i].kind == DIR for i in n.entries.values())
        return sum(list(p.entries.values()).count(n.ino) for p in self.nodes.values() if p.kind == DIR) or 1

    # -- changes -----------------------------------------------------------
    def _new(self, kind: str, mode: int, target: str = "") -> Node:
        n = Node(self.next_ino, kind, mode, target)
        self.nodes[n.ino] = n
        self.next_ino += 1
        return n

    def _link(self, parent: Node, name: str, ino: int) -> None:
        if name in parent.entries:
            raise _err(errno.EEXIST, name)
        parent.entries[name] = ino
        parent.log.append(((name, ino),))
        parent.mtime_ns = time.time_ns()

    def create(self, path: str, kind: str, mode: int, target: str = "") -> Node:
        parent, name = self.parent_of(path)
        if name in parent.entries:
            raise _err(errno.EEXIST, path)
        n = self._new(kind, stat.S_IMODE(mode), target)
        self._link(parent, name, n.ino)
        return n

    def link(self, existing: str, path: str) -> None:
        n = self.resolve(existing)
        if n.kind == DIR:
            raise _err(errno.EPERM, existing)
        parent, name = self.parent_of(path)
        self._link(parent, name, n.ino)

    def remove(self, path: str, *, directory: bool) -> None:
        parent, name = self.parent_of(path)
        ino = parent.entries.get(name)
        if ino is None:
            raise _err(errno.ENOENT, path)
        n = self.nodes[ino]
        if directory and n.kind != DIR:
            raise _err(errno.ENOTDIR, path)
        if not directory and n.kind == DIR:
            raise _err(errno.EISDIR, path)
        if directory and n.entries:
            raise _err(errno.ENOTEMPTY, path)
        del parent.entries[name]
        parent.log.append(((name, None),))
        parent.mtime_ns = time.time_ns()

    def rename(self, old: str, new: str, flags: int = 0) -> None:
        op, oname = self.parent_of(old)
        np, nname = self.parent_of(new)
        src = op.entries.get(oname)
        if src is None:
            raise _err(errno.ENOENT, old)
        dst = np.entries.get(nname)
        if flags & ~(RENAME_NOREPLACE | RENAME_EXCHANGE) or flags == RENAME_NOREPLACE | RENAME_EXCHANGE:
            raise _err(errno.EINVAL, f"rename flags {flags}")
        if self.nodes[src].kind == DIR and self._inside(np.ino, src):
            raise _err(errno.EINVAL, f"{new} is inside {old}")
        if flags & RENAME_EXCHANGE:
            if dst is None:
                raise _err(errno.ENOENT, new)
            if self.nodes[dst].kind == DIR and self._inside(op.ino, dst):
                raise _err(errno.EINVAL, f"{old} is inside {new}")
            op.entries[oname], np.entries[nname] = dst, src
            if op is np:
                op.log.append(((oname, dst), (nname, src)))
            else:
                op.log.append(((oname, dst),))
                np.log.append(((nname, src),))
        else:
            if dst is not None:
                if flags & RENAME_NOREPLACE:
                    raise _err(errno.EEXIST, new)
                if dst == src:
                    return  # two names of one inode: POSIX says do nothing
                s, d = self.nodes[src], self.nodes[dst]
                if d.kind == DIR and s.kind != DIR:
                    raise _err(errno.EISDIR, new)
                if s.kind == DIR and d.kind != DIR:
                    raise _err(errno.ENOTDIR, new)
                if d.kind == DIR and d.entries:
                    raise _err(errno.ENOTEMPTY, new)
            del op.entries[oname]
            np.entries[nname] = src
            if op is np:
                op.log.append(((oname, None), (nname, src)))
            else:
                op.log.append(((oname, None),))
                np.log.append(((nname, src),))
        now = time.time_ns()
        op.mtime_ns = np.mtime_ns = now

    def _inside(self, dir_ino: int, ancestor: int) -> bool:
        """True when live directory ``dir_ino`` is ``ancestor`` or lies below it."""
        todo, seen = [ancestor], set()
        while todo:
            i = todo.pop()
            if i == dir_ino:
                return True
            if i in seen:
                continue
            seen.add(i)
            todo.extend(c for c in self.nodes[i].entries.values() if self.nodes[c].kind == DIR)
        return False

    def write(self, n: Node, offset: int, data: bytes) -> int:
        if n.kind != FILE:
            raise _err(errno.EISDIR)
        end = offset + len(data)
        if offset > len(n.data):
            n.data.extend(bytes(offset - len(n.data)))
        n.data[offset:end] = data
        n.log.append(("write", offset, bytes(data)))
        n.mtime_ns = time.time_ns()
        return len(data)

    def truncate(self, n: Node, size: int) -> None:
        if n.kind != FILE:
            raise _err(errno.EISDIR)
        if size < len(n.data):
            del n.data[size:]
        else:
            n.data.extend(bytes(size - len(n.data)))
        n.log.append(("size", size))
        n.mtime_ns = time.time_ns()

    def chmod(self, n: Node, mode: int) -> None:
        n.mode = stat.S_IMODE(mode)
        n.meta_dirty = True

    def touch(self, n: Node, mtime_ns: int) -> None:
        n.mtime_ns = mtime_ns
        n.meta_dirty = True

    # -- durability ------------------------------------------------------------
    def base(self, ino: int) -> Saved:
        """What the disk holds for ``ino``: its last synced state, else the state it was born in."""
        s = self.durable.get(ino)
        return s if s is not None else self.nodes[ino].born

    def fsync(self, n: Node, *, datasync: bool) -> None:
        """fsync (or fdatasync) of a file, or fsync of a directory (fsyncdir)."""
        live = n.saved_live()
        if datasync and n.meta_dirty:
            b = self.base(n.ino)
            live.mode, live.mtime_ns = b.mode, b.mtime_ns
        else:
            n.meta_dirty = False
        self.durable[n.ino] = live
        n.log = []

    def sync_all(self) -> None:
        """Everything becomes durable (a clean unmount or sync(2))."""
        for n in self.nodes.values():
            self.fsync(n, datasync=False)

    # -- power cut -------------------------------------------------------------
    def image(self, choose) -> dict[int, Saved]:
        """The on-disk image where ``choose(node)`` gives the saved state of each object; only
        objects reachable from the root through the chosen directory entries exist."""
        out: dict[int, Saved] = {}
        todo = [ROOT_INO]
        while todo:
            ino = todo.pop()
            if ino in out:
                continue
            s = choose(self.nodes[ino])
            out[ino] = s
            if s.kind == DIR:
                todo.extend(s.entries.values())
        return out

    def durable_image(self) -> dict[int, Saved]:
        return self.image(lambda n: self.base(n.ino))

    def live_image(self) -> dict[int, Saved]:
        return self.image(lambda n: n.saved_live() if n.pending else self.base(n.ino))

    def lag_images(self) -> list[tuple[str, dict[int, Saved]]]:
        """For each directory with pending changes: every pending change persisted but its own.
        (A file's unsynced data needs no such image: the durable image already lacks it, and
        only a later fsync of the same file could make it durable.)"""
        return [(f"lag-{lag}", self.image(lambda n, lag=lag: self.base(n.ino) if n.ino == lag or not n.pending
                                          else n.saved_live()))
                for lag in sorted(i for i, n in self.nodes.items() if n.pending and n.kind == DIR)]

    def drop_images(self) -> list[tuple[str, dict[int, Saved]]]:
        """For each directory with two or more pending changes, and each of them: every pending
        change persisted but that one (POSIX orders nothing that is not fsynced)."""
        out = []
        for d in sorted(i for i, n in self.nodes.items() if n.kind == DIR and len(n.log) >= 2):
            for k in range(len(self.nodes[d].log)):
                def choose(n: Node, d=d, k=k) -> Saved:
                    if n.ino != d:
                        return n.saved_live() if n.pending else self.base(n.ino)
                    s = self.base(d).copy()
                    s.mode, s.mtime_ns = n.mode, n.mtime_ns
                    for i, op in enumerate(n.log):
                        if i != k:
                            _apply_entry_op(s.entries, op)
                    return s
                out.append((f"drop-{d}.{k}", self.image(choose)))
        return out

    def variant_images(self, spec: str) -> list[tuple[str, dict[int, Saved]]]:
        """The images a power cut leaves: "none" always, then each kind ``spec`` (comma-separated)
        asks for: lag, drop, all, random:SEED."""
        out = [("none", self.durable_image())]
        for v in spec.split(","):
            if v in ("", "none"):
                continue
            if v == "lag":
                out += self.lag_images()
            elif v == "drop":
                out += self.drop_images()
            elif v == "all":
                out.append(("all", self.live_image()))
            elif v.startswith("random:"):
                out.append((v, self.random_image(random.Random(v))))
            else:
                raise ValueError(f"unknown image variant {v!r}: none, lag, drop, all, random:SEED")
        return out

    def random_image(self, rng: random.Random) -> dict[int, Saved]:
        picks: dict[int, Saved] = {}

        def choose(n: Node) -> Saved:
            if not n.pending:
                return self.base(n.ino)
            if n.ino not in picks:
                how = rng.choice(("none", "all", "part"))
                picks[n.ino] = (self.base(n.ino) if how == "none" else n.saved_live() if how == "all"
                                else self._partial(n, rng))
            return picks[n.ino]

        return self.image(choose)

    def _partial(self, n: Node, rng: random.Random) -> Saved:
        s = self.base(n.ino).copy()
        if rng.random() < 0.5:
            s.mode, s.mtime_ns = n.mode, n.mtime_ns
        if n.kind == DIR:
            for op in n.log[:rng.randint(0, len(n.log))]:
                _apply_entry_op(s.entries, op)
            return s
        data = bytearray(s.data)
        for op in n.log:
            if rng.random() < 0.5:
                continue
            if op[0] == "size":
                _resize(data, op[1])
                continue
            _, off, buf = op
            # a write reaches the disk whole, or torn: some of its 4 KiB pages only
            torn = rng.random() < 0.5
            for lo in range(off - off % PAGE, off + len(buf), PAGE):
                a, b = max(lo, off), min(lo + PAGE, off + len(buf))
                if not torn or rng.random() < 0.5:
                    if a > len(data):
                        data.extend(bytes(a - len(data)))
                    data[a:b] = buf[a - off:b - off]
        if rng.random() < 0.5:
            _resize(data, len(n.data))  # the size reached the disk, some data did not: zeros
        s.data = bytes(data)
        return s


def _resize(data: bytearray, size: int) -> None:
    if size < len(data):
        del data[size:]
    else:
        data.extend(bytes(size - len(data)))


def _apply_entry_op(entries: dict[str, int], op: tuple) -> None:
    """A directory change as the disk sees it: the names it writes, each to an inode or to
    nothing, all at once (a rename or exchange inside one directory is one such change)."""
    for name, ino in op:
        if ino is None:
            entries.pop(name, None)
        else:
            entries[name] = ino


# ----------------------------------------------------------------------------- image files
def encode_image(image: dict[int, Saved]) -> bytes:
    """A canonical byte string (equal images encode equally): 8-byte header length, JSON header, data."""
    header, blobs, pos = [], [], 0
    for ino in sorted(image):
        s = image[ino]
        header.append([ino, s.kind, s.mode, s.mtime_ns, s.target, sorted(s.entries.items()), pos, len(s.data)])
        blobs.append(s.data)
        pos += len(s.data)
    head = json.dumps(header, separators=(",", ":")).encode()
    return len(head).to_bytes(8, "little") + head + b"".join(blobs)


def decode_image(raw: bytes) -> dict[int, Saved]:
    n = int.from_bytes(raw[:8], "little")
    data = memoryview(raw)[8 + n:]
    out = {}
    for ino, kind, mode, mtime_ns, target, entries, pos, size in json.loads(raw[8:8 + n]):
        out[ino] = Saved(kind, mode, bytes(data[pos:pos + size]), dict(entries), target, mtime_ns)
    return out


def image_digest(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()[:16]


def listing(image: dict[int, Saved]) -> dict[str, bytes | str | None]:
    """path -> file bytes (files), None (directories) or "-> target" (symlinks): for tests and reports."""
    out: dict[str, bytes | str | None] = {}

    def walk(ino: int, prefix: str, seen: frozenset) -> None:
        for name, child in sorted(image[ino].entries.items()):
            s, path = image[child], f"{prefix}/{name}"
            if s.kind == DIR:
                out[path] = None
                if child not in seen:
                    walk(child, path, seen | {child})
            else:
                out[path] = s.data if s.kind == FILE else f"-> {s.target}"

    walk(ROOT_INO, "", frozenset({ROOT_INO}))
    return out


def distinct(images: Iterable[tuple[str, dict[int, Saved]]]) -> dict[str, tuple[list[str], bytes]]:
    """Group equal images: digest -> (variant names, encoded image)."""
    out: dict[str, tuple[list[str], bytes]] = {}
    for name, img in images:
        raw = encode_image(img)
        out.setdefault(image_digest(raw), ([], raw))[0].append(name)
    return out
