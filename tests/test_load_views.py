"""A load's per-tensor work done in bulk: a read run's chunks checksummed in one call
(gdswriter.crc.crc32c_spans, compiled or, with GDSWRITER_NATIVE=0, in Python), and a saved dict
of tensors alone decoded by whole-list operations (format/state_codec.py ``tensor_pairs``).
Either way a damaged chunk is still named by its tensor, every tensor loads bit-exact in its
place, and a hostile state tree is still the per-pair decoder's typed error."""

from __future__ import annotations

import collections
import json

import pytest
import torch

from gdswriter import GDSCheckpointer, load_state
from gdswriter.errors import ChecksumMismatchError, CorruptCheckpointError
from gdswriter.format.state_codec import decode_state, decode_state_slots, encode_state, fill_slots

def _state() -> dict:
    g = torch.Generator().manual_seed(4)
    return {"w": {f"p{i}": torch.randn(1 + i % 97, generator=g) for i in range(2000)},  # 0.4 MB: sparse runs
            "d": {f"q{i}": torch.randn(256 + i % 7, generator=g) for i in range(3000)},  # 3 MB: dense runs
            "opt": {i: {"m": torch.randn(5, generator=g), "step": torch.tensor(float(i))} for i in range(40)}}


@pytest.mark.parametrize("victim", ["w/p0", "w/p1234", "w/p1999", "d/q0", "d/q1500", "d/q2999"])
def test_a_flipped_byte_in_a_run_names_its_tensor_both_ways(tmp_path, crc_path, victim):
    state = _state()
    with GDSCheckpointer(state, None, tmp_path) as ck:
        ck.save(1)
    got = load_state(tmp_path, 1)[1]
    for k, t in [*state["w"].items(), *state["d"].items()]:
        x = got["model"][k[0].replace("p", "w").replace("q", "d")][k]
        assert torch.equal(x, t) and x.untyped_storage().nbytes() == t.nbytes, k  # exactly its own bytes
    data = sorted((tmp_path / "step_000000000001").glob("data-*.bin"))[0]
    raw = bytearray(data.read_bytes())
    want = state[victim.split("/")[0]][victim.split("/")[1]].numpy().tobytes()
    at = raw.find(want)
    assert at >= 0 and raw.find(want, at + 1) < 0
    raw[at + len(want) // 2] ^= 0x04
    data.write_bytes(bytes(raw))
    with pytest.raises(ChecksumMismatchError, match=f"{victim}\\b"):
        load_state(tmp_path, 1)


def _tree(pairs: list) -> dict:
    return {"$dict": pairs}


def _tensors(n: int) -> list[torch.Tensor]:
    return [torch.full((2,), float(i)) for i in range(n)]


def test_a_large_dict_of_tensors_decodes_as_the_per_pair_decoder_does():
    """str and int keys, an OrderedDict with its _metadata, one tensor under two keys, a dict
    among the tensors (then the loop decodes all of it): the same objects in the same places,
    and fill_slots puts the tensors read where the placeholders were."""
    tensors = _tensors(60)
    od = collections.OrderedDict((f"k{i}", tensors[i]) for i in range(20))
    od._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    state = {"sd": {f"layer{i}.weight": tensors[i] for i in range(30)},
             "ints": {i: tensors[i + 30] for i in range(20)},
             "tied": {**{f"a{i}": tensors[50 + i % 5] for i in range(20)}},
             "od": od,
             "mixed": {**{f"t{i}": tensors[i] for i in range(20)}, "lr": 0.1}}
    tree, found = encode_state(state)
    tree = json.loads(json.dumps(tree))
    got = decode_state(tree, found)
    assert list(got) == list(state)
    for name, d in state.items():
        assert type(got[name]) is type(d) and list(got[name]) == list(d), name
        for k, v in d.items():
            assert got[name][k] is v if isinstance(v, torch.Tensor) else got[name][k] == v, (name, k)
    assert got["od"]._metadata == od._metadata
    stand_ins = [torch.empty(0) for _ in found]
    skeleton, slots = decode_state_slots(tree, stand_ins)
    assert slots is not None
    where = {id(t): i for i, t in enumerate(found)}
    assert skeleton["sd"]["layer3.weight"] is stand_ins[where[id(tensors[3])]]
    fill_slots(slots, found)
    assert all(skeleton[name][k] is v for name, d in state.items() for k, v in d.items() if isinstance(v, torch.Tensor))


BAD = {
    "duplicate key": ([[f"k{i}", {"$tensor": i}] for i in range(20)] + [["k3", {"$tensor": 0}]], "duplicate dict key"),
    "index past the end": ([[f"k{i}", {"$tensor": i}] for i in range(19)] + [["k19", {"$tensor": 20}]], "out of range"),
    "negative index": ([[f"k{i}", {"$tensor": i}] for i in range(19)] + [["k19", {"$tensor": -1}]], "out of range"),
    "bool index": ([[f"k{i}", {"$tensor": i}] for i in range(19)] + [["k19", {"$tensor": True}]], "out of range"),
    "float index": ([[f"k{i}", {"$tensor": i}] for i in range(19)] + [["k19", {"$tensor": 1.0}]], "out of range"),
    "extra key": ([[f"k{i}", {"$tensor": i}] for i in range(19)] + [["k19", {"$tensor": 1, "x": 2}]], "malformed"),
    "pair of three": ([[f"k{i}", {"$tensor": i}] for i in range(19)] + [["k19", {"$tensor": 1}, 3]], r"not a \[key"),
    "pair as a string": ([[f"k{i}", {"$tensor": i}] for i in range(19)] + ["ab"], r"not a \[key"),
    "bool key": ([[f"k{i}", {"$tensor": i}] for i in range(19)] + [[True, {"$tensor": 1}]], None),
    "list key": ([[f"k{i}", {"$tensor": i}] for i in range(19)] + [[[1], {"$tensor": 1}]], "key"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_hostile_dict_of_tensors_is_the_per_pair_decoders_error(case):
    """Each list is long enough for the bulk path (16 pairs or more); what it cannot take whole
    goes to the per-pair loop, whose typed error (or value) stands."""
    pairs, message = BAD[case]
    tensors = _tensors(20)
    if message is None:  # a bool key is a valid key: decoded as itself
        got = decode_state(_tree(pairs), tensors)
        assert list(got)[-1] is True and got[True] is tensors[1]
        return
    for decode in (decode_state, decode_state_slots):
        with pytest.raises(CorruptCheckpointError, match=message):
            decode(_tree(pairs), tensors)


def test_a_partial_read_checks_its_sparse_runs_both_ways(tmp_path, crc_path):
    """read_tensors of every third tensor (an export's or DeepSpeed's partial read): the storages
    left out leave gaps, so the wanted ones are read in sparse runs through a scratch buffer and
    summed in their runs' buffers; each loads its own bytes, and a flipped byte in one is its
    tensor's ChecksumMismatchError."""
    from gdswriter.format.commit import CommitProtocol
    from gdswriter.load.reader import read_manifest, read_tensors

    g = torch.Generator().manual_seed(8)
    state = {f"t{i}": torch.randn(300, generator=g) for i in range(3000)}
    with GDSCheckpointer(state, None, tmp_path) as ck:
        ck.save(1)
    protocol = CommitProtocol([tmp_path])
    names = read_manifest(protocol, 1).tensor_names()
    wanted = list(range(0, len(names), 3))
    got = read_tensors(protocol, read_manifest(protocol, 1), wanted)
    for i in wanted:
        assert torch.equal(got[i], state[names[i].rsplit("/", 1)[1]]), names[i]
    victim = names[wanted[500]]
    data = sorted((tmp_path / "step_000000000001").glob("data-*.bin"))[0]
    raw = bytearray(data.read_bytes())
    at = raw.find(state[victim.rsplit("/", 1)[1]].numpy().tobytes())
    raw[at + 600] ^= 0x01
    data.write_bytes(bytes(raw))
    with pytest.raises(ChecksumMismatchError, match=f"{victim}\\b"):
        read_tensors(protocol, read_manifest(protocol, 1), wanted)
