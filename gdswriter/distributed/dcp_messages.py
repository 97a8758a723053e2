"""The messages GDSStorageWriter passes in DCP's ``storage_data``: typed here, plain on the wire.

A rank's local plan carries a LocalPlanData, the coordinator's global plan for each rank a
GlobalPlanData, and each rank's last WriteResult its RankReport to finish(). DCP gathers and
scatters them (pickled); they travel as ``to_wire()``, the plain lists and dicts of JSON-able
values they always were, and are checked as ``from_wire()`` decodes them (GDSWriterError, an
internal error: every rank runs the same code). None is stored as such: a report's files,
chunks and records become the manifest through format/assembly.build_manifest, which takes
the report's wire form, so the bytes on disk do not depend on these classes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import GDSWriterError
from ..format.manifest import ChunkRecord


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise GDSWriterError(f"dcp.save: a malformed {what} in DCP's plans or results (internal: report it, with "
                             f"the gdswriter version of every rank); nothing was committed")


def _is_int(x: Any) -> bool:
    return type(x) is int


def _row(x: Any, n: int, what: str) -> list:
    _need(isinstance(x, (list, tuple)) and len(x) == n, what)
    return list(x)


def _rows(x: Any, what: str) -> list:
    _need(isinstance(x, (list, tuple)), what)
    return list(x)


@dataclass(frozen=True)
class HeldChunk:
    """A tensor chunk a rank holds: its key (rankfiles.group_held's) and bytes. Wire: [key, nbytes]."""
    key: str
    nbytes: int

    def to_wire(self) -> list:
        return [self.key, self.nbytes]

    @classmethod
    def from_wire(cls, x: Any) -> HeldChunk:
        key, nbytes = _row(x, 2, "held chunk")
        _need(isinstance(key, str) and _is_int(nbytes) and nbytes >= 0, "held chunk")
        return cls(key, nbytes)


@dataclass(frozen=True)
class RootsOffer:
    """What a rank opening its roots learnt of them alone (roots.build_table and probe_root's
    input). Wire: {"roots": [[id, path], ...], "probes": [probe, ...]}."""
    roots: tuple[tuple[str, str], ...]
    probes: tuple[dict, ...]

    def to_wire(self) -> dict:
        return {"roots": [[i, p] for i, p in self.roots], "probes": list(self.probes)}

    @classmethod
    def from_wire(cls, x: Any) -> RootsOffer:
        _need(isinstance(x, dict), "root offer")
        roots = tuple(tuple(_row(r, 2, "root offer")) for r in _rows(x.get("roots"), "root offer"))
        probes = tuple(_rows(x.get("probes"), "root offer"))
        _need(len(probes) == len(roots) and all(isinstance(p, dict) for p in probes)
              and all(isinstance(i, str) and isinstance(p, str) for i, p in roots), "root offer")
        return cls(roots, probes)  # type: ignore[arg-type]


@dataclass(frozen=True)
class LocalPlanData:
    """A rank's local plan: the chunks it holds, its roots' offer when this save opens them, and
    the (root id, step) it wrote beside a committed step. Wire: {"held", "open", "beside"}."""
    held: tuple[HeldChunk, ...]
    offer: RootsOffer | None
    beside: tuple[tuple[str, int], ...]

    def to_wire(self) -> dict:
        return {"held": [h.to_wire() for h in self.held], "open": None if self.offer is None else self.offer.to_wire(),
                "beside": [[rid, step] for rid, step in self.beside]}

    @classmethod
    def from_wire(cls, x: Any) -> LocalPlanData:
        _need(isinstance(x, dict), "local plan")
        beside = tuple(tuple(_row(b, 2, "local plan")) for b in _rows(x.get("beside"), "local plan"))
        _need(all(isinstance(rid, str) and _is_int(step) for rid, step in beside), "local plan")
        offer = x.get("open")
        return cls(tuple(HeldChunk.from_wire(h) for h in _rows(x.get("held"), "local plan")),
                   None if offer is None else RootsOffer.from_wire(offer), beside)  # type: ignore[arg-type]


@dataclass(frozen=True)
class PlanItem:
    """Item i of a save, in plan order (record i of the manifest): a tensor chunk (its key, bytes,
    fqn and offsets) or a BytesIO item (nbytes and offsets None). Wire: [key, nbytes, fqn, offsets]."""
    key: str
    nbytes: int | None
    fqn: str
    offsets: tuple[int, ...] | None

    @property
    def is_bytes(self) -> bool:
        return self.nbytes is None

    def to_wire(self) -> list:
        return [self.key, self.nbytes, self.fqn, None if self.offsets is None else list(self.offsets)]

    @classmethod
    def from_wire(cls, x: Any) -> PlanItem:
        key, nbytes, fqn, offsets = _row(x, 4, "plan item")
        _need(isinstance(key, str) and isinstance(fqn, str) and (nbytes is None or _is_int(nbytes))
              and (offsets is None or (isinstance(offsets, list) and all(map(_is_int, offsets)))), "plan item")
        return cls(key, nbytes, fqn, None if offsets is None else tuple(offsets))


@dataclass(frozen=True)
class Piece:
    """The bytes of item ``item`` a rank writes: [offset, offset + length) of a tensor chunk, or
    the whole BytesIO item (offset 0, length None). Wire: [item, offset, length]."""
    item: int
    offset: int
    length: int | None

    def to_wire(self) -> list:
        return [self.item, self.offset, self.length]

    @classmethod
    def from_wire(cls, x: Any) -> Piece:
        item, offset, length = _row(x, 3, "piece")
        _need(_is_int(item) and _is_int(offset) and (length is None or _is_int(length)), "piece")
        return cls(item, offset, length)


@dataclass(frozen=True)
class KeepBeside:
    """For a root's leader: the data files the committed manifest of ``step`` lists on root
    ``root_id``, which commit.clean_resaved keeps. Wire: [root id, step, names]."""
    root_id: str
    step: int
    names: tuple[str, ...]

    def to_wire(self) -> list:
        return [self.root_id, self.step, list(self.names)]

    @classmethod
    def from_wire(cls, x: Any) -> KeepBeside:
        rid, step, names = _row(x, 3, "file list")
        _need(isinstance(rid, str) and _is_int(step) and isinstance(names, list)
              and all(isinstance(n, str) for n in names), "file list")
        return cls(rid, step, tuple(names))


def keep_wire(entries: tuple[KeepBeside, ...] | list[KeepBeside]) -> list[list]:
    """``entries`` as commit.clean_resaved takes them."""
    return [e.to_wire() for e in entries]


@dataclass(frozen=True)
class Decision:
    """The coordinator's decision for a save: its step, the temporary directories' token, the
    committed steps each root's leader cleans with, and the latest step."""
    step: int
    token: str
    clean: tuple[int, ...]
    latest: int | None


@dataclass(frozen=True)
class GlobalPlanData:
    """A rank's global plan: every item, the pieces it writes, its part of the root table (when
    this save opens the roots; rank 0 holds the whole table: None), the files to keep beside
    committed steps on the roots it leads (``live``) and on its earlier roots (``former``), and
    the decision. Wire: {"items", "pieces", "layout", "live", "former", "step", "token",
    "clean", "latest"}."""
    items: tuple[PlanItem, ...]
    pieces: tuple[Piece, ...]
    layout: dict | None
    live: tuple[KeepBeside, ...]
    former: tuple[KeepBeside, ...]
    decision: Decision

    def to_wire(self, items_wire: list | None = None) -> dict:
        """``items_wire``: the items' wire form, made once for every rank's plan."""
        d = self.decision
        return {"items": items_wire if items_wire is not None else [i.to_wire() for i in self.items],
                "pieces": [p.to_wire() for p in self.pieces], "layout": self.layout,
                "live": keep_wire(self.live), "former": keep_wire(self.former),
                "step": d.step, "token": d.token, "clean": list(d.clean), "latest": d.latest}

    @classmethod
    def from_wire(cls, x: Any) -> GlobalPlanData:
        _need(isinstance(x, dict), "global plan")
        step, token, clean, latest, layout = (x.get(k) for k in ("step", "token", "clean", "latest", "layout"))
        _need(_is_int(step) and isinstance(token, str) and isinstance(clean, list) and all(map(_is_int, clean))
              and (latest is None or _is_int(latest)) and (layout is None or isinstance(layout, dict)), "global plan")
        return cls(tuple(PlanItem.from_wire(i) for i in _rows(x.get("items"), "global plan")),
                   tuple(Piece.from_wire(p) for p in _rows(x.get("pieces"), "global plan")), layout,
                   tuple(KeepBeside.from_wire(e) for e in _rows(x.get("live"), "global plan")),
                   tuple(KeepBeside.from_wire(e) for e in _rows(x.get("former"), "global plan")),
                   Decision(step, token, tuple(clean), latest))


@dataclass(frozen=True)
class ChunkEntry:
    """``length`` bytes of item ``item`` at ``item_offset``, written to the rank's file ``file``
    at ``file_offset``, with their crc32c. Wire: [item, file, file_offset, item_offset, length,
    crc] (format/assembly.build_manifest's chunk)."""
    item: int
    file: int
    file_offset: int
    item_offset: int
    length: int
    crc: int

    def to_wire(self) -> list:
        return [self.item, self.file, self.file_offset, self.item_offset, self.length, self.crc]

    @classmethod
    def from_wire(cls, x: Any) -> ChunkEntry:
        row = _row(x, 6, "report chunk")
        _need(all(map(_is_int, row)), "report chunk")
        return cls(*row)


@dataclass(frozen=True)
class RankReport:
    """What a rank's write_data reports to finish(): its files (rankfiles.file_entries), the
    chunks written, each item's record (item 0-offset pieces only), a BytesIO item's size, and
    the joint roots it published (None: the coordinator, which publishes none). Wire: the
    report dict build_manifest takes, "published" only when not None."""
    rank: int
    step: int
    token: str
    files: tuple[list, ...]
    chunks: tuple[ChunkEntry, ...]
    records: tuple[tuple[int, list], ...]  # (item, format/assembly.record_json's record)
    sizes: tuple[tuple[int, int], ...]
    published: tuple[int, ...] | None = None

    @property
    def nbytes(self) -> int:
        return sum(c.length for c in self.chunks)

    def file_chunks(self, fid: int) -> tuple[ChunkRecord, ...]:
        """The chunks written into file ``fid`` as the manifest records them (what the copies
        and the drain check each byte they read against)."""
        return tuple(ChunkRecord(fid, c.file_offset, c.item_offset, c.length, c.crc) for c in self.chunks
                     if c.file == fid)

    def to_wire(self) -> dict:
        out = {"rank": self.rank, "step": self.step, "token": self.token, "files": list(self.files),
               "chunks": [c.to_wire() for c in self.chunks], "records": [[i, r] for i, r in self.records],
               "sizes": [[i, n] for i, n in self.sizes]}
        if self.published is not None:
            out["published"] = list(self.published)
        return out

    def manifest_report(self) -> dict:
        """The report as build_manifest takes it for a DCP step (no tree, no tensor references)."""
        out = self.to_wire()
        out.pop("published", None)
        out.update(tree=None, tensors=[])
        return out

    @classmethod
    def from_wire(cls, x: Any) -> RankReport:
        _need(isinstance(x, dict), "rank report")
        rank, step, token, published = x.get("rank"), x.get("step"), x.get("token"), x.get("published")
        _need(_is_int(rank) and _is_int(step) and isinstance(token, str)
              and (published is None or (isinstance(published, list) and all(map(_is_int, published)))), "rank report")
        records = tuple(tuple(_row(r, 2, "report record")) for r in _rows(x.get("records"), "rank report"))
        sizes = tuple(tuple(_row(s, 2, "report size")) for s in _rows(x.get("sizes"), "rank report"))
        _need(all(isinstance(r, list) for _, r in records) and all(_is_int(n) for _, n in sizes), "rank report")
        files = tuple(_row(f, 4, "report file") for f in _rows(x.get("files"), "rank report"))
        chunks = tuple(ChunkEntry.from_wire(c) for c in _rows(x.get("chunks"), "rank report"))
        return cls(rank, step, token, files, chunks, records, sizes,  # type: ignore[arg-type]
                   None if published is None else tuple(published))


@dataclass(frozen=True)
class SharedRootOffer:
    """GDSStorageReader's one-shared-root load (dcp_reader.open_one_shared_root): rank 0's part of
    the one-root table, the step and its manifest's text, sent with the decision (not in DCP's
    storage_data: over the reader's own decision round). Wire: {"part", "step", "manifest"}."""
    part: dict
    step: int
    manifest: str

    def to_wire(self) -> dict:
        return {"part": self.part, "step": self.step, "manifest": self.manifest}

    @classmethod
    def from_wire(cls, x: Any) -> SharedRootOffer:
        _need(isinstance(x, dict), "shared-root offer")
        part, step, manifest = x.get("part"), x.get("step"), x.get("manifest")
        _need(isinstance(part, dict) and _is_int(step) and isinstance(manifest, str), "shared-root offer")
        return cls(part, step, manifest)
