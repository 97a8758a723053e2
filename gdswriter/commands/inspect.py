"""`gdswriter inspect`: a step's tensors, files and metadata, from its manifest alone."""

from __future__ import annotations

import json

from ..format.commit import CommitProtocol
from ..load.reader import state_keys
from ..units import human
from ._common import (EXIT_OK, add_roots_argument, is_contiguous, item_size, load_manifest, numel, open_roots, out,
                      table, tensor_ranges, when)


def register(sub) -> None:
    sp = sub.add_parser("inspect", help="show a step's tensors, files and metadata",
                        description="Show a step's format version, metadata, data files and, per tensor: name, "
                                    "dtype, shape, bytes and the file byte ranges holding it. Reads only the "
                                    "manifest.")
    add_roots_argument(sp)
    sp.add_argument("--step", type=int, metavar="N", help="step to show (default: the latest)")
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    sp.set_defaults(func=run)


def run(args) -> int:
    roots = open_roots(args.root, args.secondary)
    protocol = CommitProtocol(roots)
    latest = protocol.latest()
    step, m, mbytes = load_manifest(protocol, args.step)
    users: dict[int, list[str]] = {}
    for t in m.tensors:
        users.setdefault(t.storage, []).append(t.name)

    def file_path(fid: int) -> str:
        f = m.files[fid]
        return str(protocol.step_dir(step, f.root) / f.path) if f.root < len(roots) else f"<root #{f.root}>/{f.path}"

    tensors = []
    for rec in m.tensors:
        nbytes = numel(rec.shape) * item_size(rec.dtype)
        ranges = tensor_ranges(m, rec)
        tensors.append({
            "name": rec.name, "dtype": rec.dtype, "shape": list(rec.shape), "stride": list(rec.stride),
            "bytes": nbytes, "contiguous": is_contiguous(rec), "storage": rec.storage,
            "byte_offset": rec.byte_offset, "device": rec.device, "kind": rec.kind,
            "shared_with": [n for n in users[rec.storage] if n != rec.name],
            "ranges": [{"file": fid, "path": m.files[fid].path, "begin": a, "end": b} for fid, a, b in ranges],
        })
    if args.json:
        doc = {
            "root": str(roots[0]), "roots": [str(r) for r in roots], "step": step, "latest": step == latest,
            "format": "gdswriter", "version": f"{m.version[0]}.{m.version[1]}", "created_unix": m.created_unix,
            "metadata": m.metadata, "state_keys": state_keys(m), "manifest_bytes": mbytes,
            "files": [{"index": i, "root": f.root, "path": f.path, "size": f.size, "location": file_path(i)}
                      for i, f in enumerate(m.files)],
            "storages": [{"nbytes": s.nbytes, "chunks": [
                {"file": c.file, "file_offset": c.file_offset, "storage_offset": c.storage_offset,
                 "length": c.length, "crc32c": c.crc32c} for c in s.chunks]} for s in m.storages],
            "tensors": tensors,
        }
        out(json.dumps(doc, indent=2))
        return EXIT_OK

    total = sum(f.size for f in m.files)
    out(f"checkpoint  {protocol.step_dir(step)}")
    out(f"step        {step}" + (" (latest)" if step == latest else f" (latest is {latest})"))
    out(f"format      gdswriter {m.version[0]}.{m.version[1]}")
    out(f"created     {when(m.created_unix)}")
    out(f"metadata    {json.dumps(m.metadata, sort_keys=True)}")
    keys = state_keys(m)
    if keys is not None:
        out(f"state       {', '.join(keys) if keys else '(empty)'}")
    out(f"data files  {len(m.files)}, {human(total)} ({total} bytes) + manifest {mbytes} bytes")
    for line in table([["#", "ROOT", "FILE", "BYTES"]] +
                       [[i, f.root, file_path(i), f.size] for i, f in enumerate(m.files)], right={0, 1, 3}):
        out(line)
    shared = sum(1 for t in tensors if t["shared_with"])
    out(f"storages    {len(m.storages)}, {sum(s.nbytes for s in m.storages)} bytes")
    out(f"tensors     {len(tensors)}" + (f" ({shared} share their storage with another tensor)" if shared else ""))
    rows = [["NAME", "DTYPE", "SHAPE", "BYTES", "FILE[BEGIN, END)", "NOTES"]]
    for t in tensors:
        where = " + ".join(f"{m.files[r['file']].path}[{r['begin']}, {r['end']})" for r in t["ranges"]) or "-"
        notes = []
        if not t["contiguous"]:
            notes.append(f"stride {tuple(t['stride'])}")
        if t["shared_with"]:
            shown = ", ".join(t["shared_with"][:3]) + (", ..." if len(t["shared_with"]) > 3 else "")
            notes.append(f"storage {t['storage']} shared with {shown}")
        if t["kind"] != "tensor":
            notes.append(t["kind"])
        if t["device"] != "cpu":
            notes.append(f"saved from {t['device']}")
        rows.append([t["name"], t["dtype"], list(t["shape"]), t["bytes"], where, "; ".join(notes)])
    for line in table(rows, right={3}):
        out(line)
    return EXIT_OK
