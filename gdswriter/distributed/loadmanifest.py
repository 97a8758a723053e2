"""The manifest of a step a multi-rank load reads, on every rank.

The primary rank resolves the step and sends its manifest.json to every rank
(``broadcast_manifest_bytes``); a 1.3 step's manifest is a global one, and a load that
reshards needs the whole step: each shard is read by a rank that sees its root and merged on
the primary rank (``gather_merged``), which costs what a 1.2 load cost. Loads of the saved
layout read only their own shard instead (load.py ``load_own``).
"""

from __future__ import annotations

import errno
from dataclasses import replace

from ..errors import CorruptCheckpointError, RankFailedError, UnreachableDataError
from ..format.commit import CommitProtocol, step_dir_name
from ..format.manifest import MANIFEST_NAME, Manifest
from ..format.sharded import SHARDED_VERSION, GlobalManifest, merge, parse_shard, parse_step, read_shard
from ..load.reader import parse_manifest, read_manifest_bytes
from .group import Coordinator, bounded, describe, unbound
from .loadplan import reach_of
from .roots import RootLayout, discover_layout


def broadcast_manifest(coord: Coordinator, protocol: CommitProtocol, step: int | None, what: str, src: int = 0,
                       layout: RootLayout | None = None) -> tuple[int, Manifest]:
    """Collective: rank ``src`` (the primary rank: it sees the primary root) resolves ``step``
    (None: the latest) and sends its manifest to every rank. A 1.3 step's shards are merged
    (``gather_merged``: each is read by a rank that reaches it, merged on ``src``) so that every
    rank gets the whole step: the general path, for loads that reshard."""
    step, raw = broadcast_manifest_bytes(coord, protocol, step, what, src)
    return step, received_manifest(coord, protocol, step, raw, what, src, layout)


def received_manifest(coord: Coordinator, protocol: CommitProtocol, step: int, raw: bytes, what: str, src: int = 0,
                      layout: RootLayout | None = None) -> Manifest:
    """Collective where ``raw`` (the manifest.json of ``step`` that rank ``src`` read and sent
    to every rank) is a 1.3 step's global manifest: ``broadcast_manifest``'s step, parsed."""
    parsed = parse_step(raw, str(protocol.step_dir(step) / MANIFEST_NAME))
    if isinstance(parsed, Manifest):
        return parse_manifest(protocol, step, parsed)
    if layout is None:
        layout = discover_layout(Coordinator.solo(), list(protocol.roots), create=False)
    return gather_merged(coord, layout, parsed, what, src)


def json_text(raw: bytes, where: str) -> str:
    """A manifest's (or shard's) bytes as the text the ranks send each other; bytes that are not
    UTF-8 are a damaged checkpoint (CorruptCheckpointError), as parsing them would say."""
    try:
        return raw.decode()
    except UnicodeDecodeError as e:
        raise CorruptCheckpointError(f"{where} is not UTF-8 JSON ({e}); the checkpoint is damaged: load an "
                                     f"earlier step") from e


def broadcast_manifest_bytes(coord: Coordinator, protocol: CommitProtocol, step: int | None, what: str,
                             src: int = 0) -> tuple[int, bytes]:
    """Collective: the step ``src`` resolves and its manifest.json's bytes, on every rank."""
    msg: dict = {}
    error = None
    if coord.rank == src:
        try:
            step = protocol.require(step)
            msg = {"step": step, "manifest": json_text(read_manifest_bytes(protocol, step),
                                                       str(protocol.step_dir(step) / MANIFEST_NAME))}
        except Exception as e:  # noqa: BLE001 - every rank raises below
            error, msg = e, {"error": describe(e)}
    msg = coord.broadcast(msg, f"{what} (manifest)", src=src)
    if "error" in msg:
        coord.agree(error or RuntimeError(msg["error"]) if coord.rank == src else None, what,
                    hint="the live state was not changed")
    return msg["step"], msg["manifest"].encode()


def _shard_readers(g: GlobalManifest, layout: RootLayout) -> list[int | None]:
    """The rank of this job that reads each shard: one of the ranks that see its root (by
    identity, from the root table every rank holds), spread by shard number; None: no rank does."""
    ranks_of = {info.id: info.ranks for info in layout.table}
    out: list[int | None] = []
    for ref in g.shards:
        ranks = ranks_of.get(g.roots[ref.root].id, ())
        out.append(ranks[ref.rank % len(ranks)] if ranks else None)
    return out


def gather_merged(coord: Coordinator, layout: RootLayout, g: GlobalManifest, what: str, src: int) -> Manifest:
    """Collective: the whole 1.3 step (format/sharded.py ``merge``) on every rank. Each shard is
    read by a rank that sees its root, checked against its recorded size and crc32c, and sent to
    ``src``, which merges and validates them and broadcasts the result. This costs what a 1.2
    load cost (every rank receives every record); loads of the saved layout read only their own
    shard instead (``load_own``)."""
    readers = _shard_readers(g, layout)
    mine: list = []
    error = None
    try:
        lost = [k for k, r in enumerate(readers) if r is None]
        if lost:
            info = g.roots[g.shards[lost[0]].root]
            raise UnreachableDataError(errno.ENOENT, f"{what}: rank {lost[0]}'s manifest shard is on root id {info.id} "
                                                     f"(saved at {info.path}), which no rank of this job sees: give "
                                                     f"some rank that root (mount it)")
        reach = reach_of(g, layout)
        for k, r in enumerate(readers):
            if r == coord.rank:
                ref = g.shards[k]
                where = reach[ref.root] / step_dir_name(g.step)  # type: ignore[operator]
                mine.append([k, json_text(read_shard(where, g, ref, reach[0]), str(where / ref.name))])
    except Exception as e:  # noqa: BLE001 - every rank learns of it
        error, mine = e, []
    got = coord.gather({"error": describe(error)} if error else {"shards": mine}, f"{what} (manifest shards)", dst=src)
    msg: dict | None = None
    merge_error = None
    if got is not None:
        failures = {r: x["error"] for r, x in enumerate(got) if "error" in x}
        if not failures:
            try:
                texts = {k: t for x in got for k, t in x["shards"]}
                shards = [parse_shard(texts[k].encode(), g, ref, f"step {g.step}'s {ref.name}")
                          for k, ref in enumerate(g.shards)]
                msg = _manifest_message(merge(g, shards))
            except Exception as e:  # noqa: BLE001 - every rank learns of it
                merge_error = e
                failures = {coord.rank: describe(e)}
        if failures:
            msg = bounded(failures)
    msg = coord.broadcast(msg, f"{what} (the merged manifest)", src=src)
    if "manifest" not in msg:
        shown, total = unbound(msg)
        if error is not None or merge_error is not None:
            raise error or merge_error  # type: ignore[misc]
        raise RankFailedError(what, shown, "the live state was not changed", total=total)
    m = Manifest.from_json_bytes(msg["manifest"].encode(), where=f"step {g.step} (its shards merged)")
    files = list(m.files)
    for i, path in msg.get("copied", ()):  # files read from a copy (loadcopies.py): in its folder
        files[i] = replace(files[i], path=path)
    return replace(m, files=tuple(files), version=SHARDED_VERSION, created_unix=g.created_unix)


def _manifest_message(m: Manifest) -> dict:
    """The merged manifest as gather_merged sends it: its JSON, whose data files are plain
    names, and [file index, path] of each file read from a copy (format/copies.py: a path in
    the step's copies folder, which a manifest of its own may not name)."""
    copied = [[i, f.path] for i, f in enumerate(m.files) if "/" in f.path]
    plain = replace(m, files=tuple(replace(f, path=f.path.rpartition("/")[2]) for f in m.files)) if copied else m
    return {"manifest": plain.to_json_bytes().decode(), **({"copied": copied} if copied else {})}
