"""The DCP plug-in's messages (dcp_messages.py): their wire forms are the plain lists and dicts
the plug-in always sent in DCP's storage_data, they come back equal, and a malformed one is
refused as an internal error, naming what it is, before anything is committed."""

import pytest

pytest.importorskip("torch.distributed.checkpoint")

from torch.distributed.checkpoint.metadata import MetadataIndex  # noqa: E402
from torch.distributed.checkpoint.storage import WriteResult  # noqa: E402

from gdswriter.distributed.dcp_messages import (ChunkEntry, Decision, GlobalPlanData, HeldChunk,  # noqa: E402
                                                KeepBeside, LocalPlanData, Piece, PlanItem, RankReport, RootsOffer,
                                                SharedRootOffer)
from gdswriter.distributed.dcp_writer_parts import REPORT_FQN, checked_reports  # noqa: E402
from gdswriter.errors import GDSWriterError  # noqa: E402

LOCAL = LocalPlanData((HeldChunk('["w", [0], [4], "float32"]', 16),),
                      RootsOffer((("id0", "/r0"),), ({"committed": [1, 2]},)), (("id0", 2),))
ITEMS = (PlanItem('["w", [0], [4], "float32"]', 16, "w", (0,)), PlanItem("bytes:b", None, "b", None))
GLOBAL = GlobalPlanData(ITEMS, (Piece(0, 0, 16), Piece(1, 0, None)), None, (KeepBeside("id0", 2, ("a.bin",)),), (),
                        Decision(3, "ab12cd34", (1, 2), 2))
REPORT = RankReport(0, 3, "ab12cd34", ([0, "data-rank0-r0-f0.bin", 4096, {"engine": "x", "rank": 0, "host": "h"}],),
                    (ChunkEntry(0, 0, 0, 0, 16, 123),), ((0, ["w", 0, "float32", [4], [1], "cpu", "tensor", None]),
                                                          (1, ["b", 0, "uint8", [5], [1], "cpu", "tensor", None])),
                    ((1, 5),), (0,))


def test_messages_travel_as_the_plain_lists_and_dicts_they_were_and_come_back_equal():
    assert LOCAL.to_wire() == {"held": [['["w", [0], [4], "float32"]', 16]],
                               "open": {"roots": [["id0", "/r0"]], "probes": [{"committed": [1, 2]}]},
                               "beside": [["id0", 2]]}
    wire = GLOBAL.to_wire()
    assert wire == {"items": [['["w", [0], [4], "float32"]', 16, "w", [0]], ["bytes:b", None, "b", None]],
                    "pieces": [[0, 0, 16], [1, 0, None]], "layout": None, "live": [["id0", 2, ["a.bin"]]],
                    "former": [], "step": 3, "token": "ab12cd34", "clean": [1, 2], "latest": 2}
    assert REPORT.to_wire()["chunks"] == [[0, 0, 0, 0, 16, 123]] and REPORT.nbytes == 16
    assert "published" not in REPORT.manifest_report() and REPORT.manifest_report()["tensors"] == []
    for msg in (LOCAL, GLOBAL, REPORT, SharedRootOffer({"roots": []}, 3, "{}")):
        assert type(msg).from_wire(msg.to_wire()) == msg


@pytest.mark.parametrize("damage", [
    lambda w: w.update(pieces=[[0, 0]]),
    lambda w: w.update(pieces=[[0, "0", 16]]),
    lambda w: w.update(items=[["k", "16", "w", [0]]]),
    lambda w: w.update(step="3"),
    lambda w: w.update(live=[["id0", 2, "a.bin"]]),
    lambda w: w.pop("token"),
])
def test_a_malformed_global_plan_is_refused_as_an_internal_error(damage):
    wire = GLOBAL.to_wire()
    damage(wire)
    with pytest.raises(GDSWriterError, match="malformed .*internal: report it"):
        GlobalPlanData.from_wire(wire)


def test_a_malformed_local_plan_is_refused():
    wire = LOCAL.to_wire()
    wire["open"]["probes"] = []  # a probe per root
    with pytest.raises(GDSWriterError, match="malformed root offer"):
        LocalPlanData.from_wire(wire)


def test_finish_takes_a_malformed_report_for_no_report_and_commits_nothing():
    def results(report: dict) -> list:
        return [[WriteResult(index=MetadataIndex(REPORT_FQN), size_in_bytes=16, storage_data=report)]]

    assert checked_reports(results(REPORT.to_wire()), 3, "ab12cd34", ITEMS) == [REPORT]
    bad = REPORT.to_wire()
    bad["chunks"] = [[0, 0, 0, 0, "16", 123]]  # a length that is no number
    with pytest.raises(GDSWriterError, match="rank 0 sent no report of this save"):
        checked_reports(results(bad), 3, "ab12cd34", ITEMS)
    with pytest.raises(GDSWriterError, match="not recorded exactly once"):
        checked_reports(results({**REPORT.to_wire(), "sizes": []}), 3, "ab12cd34", ITEMS)
