"""Review (tenth session): steps whose storages are packed 64 bytes apart (format 2.1,
PACK_BELOW 64 KiB) read by the multi-rank readers: a single-process step loaded by N gloo ranks
(read together, read apart, and with node-local roots), bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from support.ranks import run_ranks

STEP = 5


def _state(seed: int) -> dict:
    """test_dense_pack's mid_state plus the edges: float8 storages, storages of 64 KiB - 1,
    64 KiB, 64 KiB + 1 and 1 MiB, views into the middle of a packed storage (one not
    contiguous), and a 0-dim tensor."""
    from test_dense_pack import mid_state

    g = torch.Generator().manual_seed(seed)
    state = mid_state(seed)
    for dt in (torch.float8_e4m3fn, torch.float8_e5m2):
        state[f"f8_{dt}"] = torch.randn(3001, generator=g).to(dt)
    for n in (65535, 65536, 65537, 1 << 20, (1 << 20) + 64):
        state[f"u8_{n}"] = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    mid = torch.randn(60, 100, generator=g)  # 24,000 bytes: packed
    state.update({"mid_base": mid, "mid_rows": mid[17:23], "mid_cols": mid[5:40, 3::7], "scalar": torch.tensor(2.5 + seed)})
    return state


def _save(tmp_path: Path) -> Path:
    from support.models import small_options

    from gdswriter import GDSCheckpointer

    root = tmp_path / "root"
    state = _state(3)
    with GDSCheckpointer(state, None, root=str(root), options=small_options(files_per_root=2)) as ck:
        ck.save(STEP)
    torch.save({k: v.clone() for k, v in state.items()}, tmp_path / "expected.pt")
    return root


def _load(rank: int, world: int, roots: list[str], out: str, apart: bool) -> dict:
    from support.models import small_options

    from gdswriter import GDSCheckpointer

    if apart:
        import gdswriter.distributed.load as dist_load

        dist_load.read_replicated_once = lambda *a, **k: (None, True)  # private: on every rank alike
    root = roots[rank * len(roots) // world]
    state = _state(11)  # other values, same shapes
    error = None
    with GDSCheckpointer(state, None, root=root, options=small_options(files_per_root=2)) as ck:
        try:
            ck.load(STEP)
        except Exception as e:  # noqa: BLE001 - what the test checks
            error = f"{type(e).__name__}: {e}"
    want = torch.load(Path(out, "expected.pt"))
    diff = sorted(k for k, w in want.items()
                  if not torch.equal(state[k].contiguous().view(-1).view(torch.uint8),
                                     w.contiguous().view(-1).view(torch.uint8)))
    return {"error": error, "diff": diff}


@pytest.mark.parametrize("world,apart,local", [(2, False, False), (3, False, False), (2, True, False),
                                               (2, False, True)], ids=["together2", "together3", "apart", "local"])
def test_a_packed_single_process_step_loads_bit_exact_on_n_ranks(tmp_path, world, apart, local):
    root = _save(tmp_path)
    roots = [str(root)]
    if local:
        (tmp_path / "node1").mkdir()
        roots.append(str(tmp_path / "node1"))
    res = run_ranks(world, _load, roots, str(tmp_path), apart, out=tmp_path / "r")
    assert [x["error"] for x in res] == [None] * world, res
    assert [x["diff"] for x in res] == [[]] * world, res


@pytest.mark.parametrize("mode", ["host", "live"])
def test_the_edge_storages_round_trip_verify_and_export_in_one_process(tmp_path, capsys, mode):
    """The same edge state in one process: load_state, a load into the live tensors, verify and
    an export gives the saved bytes."""
    from support.models import small_options
    from test_dense_pack import assert_same, snapshot

    from gdswriter import GDSCheckpointer, load_state
    from gdswriter.cli import main as cli_main

    state = _state(4)
    want = snapshot(state)
    with GDSCheckpointer(state, None, tmp_path, options=small_options(snapshot=mode, files_per_root=2)) as ck:
        ck.save(1)
        with torch.no_grad():
            for v in state.values():
                v.view(-1).view(torch.uint8).zero_() if v.is_contiguous() else v.zero_()
        ck.load(1)
    assert_same(dict(state), want)
    assert_same(load_state(tmp_path, 1)[1]["model"], want)
    assert cli_main(["verify", str(tmp_path), "--all"]) == 0, capsys.readouterr().out
    assert cli_main(["export", str(tmp_path), "--step", "1", "--to", "torch", str(tmp_path / "m.pt")]) == 0
    got = {k.split("/", 1)[1]: v for k, v in torch.load(tmp_path / "m.pt", weights_only=True).items()}
    assert {k for k in want if k.startswith(("u8_", "f8_"))} <= set(got)
    for k, v in got.items():
        assert torch.equal(v.contiguous().view(-1).view(torch.uint8), want[k].contiguous().view(-1).view(torch.uint8)), k


@pytest.mark.parametrize("mode", ["host", "live"])
def test_the_edge_storages_round_trip_through_the_kvikio_engine(monkeypatch, tmp_path, mode):
    """The GPU path's engine (engines/kvikio.py over the fake KvikIO, host tensors taken for
    device memory: no GPU here) saves the packed edge state and loads it into the live tensors
    bit for bit; the host reader loads its files too."""
    from support.engines import install_fake_kvikio
    from support.models import small_options
    from test_dense_pack import assert_same, snapshot

    import gdswriter.engines.kvikio as gds
    from gdswriter import GDSCheckpointer, load_state
    from gdswriter.options import EngineOptions, KiB

    fake = install_fake_kvikio(monkeypatch, tmp_path / "probe")
    state = _state(6)
    want = snapshot(state)
    eng = gds.GdsEngine(EngineOptions(buffer_bytes=256 * KiB, request_bytes=64 * KiB, num_buffers=3, queue_depth=16))
    with GDSCheckpointer(state, None, tmp_path / "root", engines=[eng],
                         options=small_options(snapshot=mode, files_per_root=2)) as ck:
        ck.save(1)
        with torch.no_grad():
            for v in state.values():
                v.view(-1).view(torch.uint8).zero_() if v.is_contiguous() else v.zero_()
        ck.load(1)
    assert {"read", "write"} <= {k for k, _, _ in fake.calls}  # the device path ran both ways
    assert_same(dict(state), want)
    assert_same(load_state(tmp_path / "root", 1)[1]["model"], want)
