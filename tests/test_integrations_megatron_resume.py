"""A training run checkpointed through gdswriter's Megatron strategies (issue 41), killed during
a save and between saves, resumed on fresh gloo ranks from the newest committed checkpoint: its
final parameters, AdamW state and RNG states equal an uninterrupted run's bit for bit. Also
GDSLoadShardedStrategy.load_tensors_metadata (what Megatron's strict loads read)."""

from __future__ import annotations

import hashlib
import os
import signal

import pytest
import torch

from tests.support.ranks import run_ranks
from tests.support.megatron_run import ForkedCaller, KillAfterFirstFile  # noqa: E402

pytest.importorskip("megatron.core.dist_checkpointing", reason="megatron-core is not installed: pip install "
                    "--no-deps megatron-core==0.16.1 (.ci/run does)")

ROWS, COLS = 1024, 1024  # a 4 MiB float32 weight, 2 MiB per rank at TP=2 (its AdamW moments alike)
BATCH = 8
TOTAL, EVERY = 6, 2  # train 6 steps, save after every 2nd
SEED = 20260


class Trainer:
    """One TP rank: its row shard of a linear layer's weight, AdamW on it, a data RNG shared by
    the ranks (common state) and a dropout RNG of its own (a ShardedObject)."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        full = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(SEED))
        self.weight = torch.nn.Parameter(full.chunk(world, 0)[rank].clone())
        self.opt = torch.optim.AdamW([self.weight], lr=1e-3, weight_decay=0.01)
        self.data_rng = torch.Generator().manual_seed(SEED + 1)
        self.drop_rng = torch.Generator().manual_seed(SEED + 2 + rank)
        self.step = 0

    def train_step(self) -> None:
        import torch.distributed as dist

        x = torch.randn(BATCH, COLS, generator=self.data_rng)
        keep = torch.rand(BATCH, ROWS // self.world, generator=self.drop_rng) > 0.1
        y = (x @ self.weight.t()) * keep
        local = (y ** 2).mean()
        total = local.detach().clone()
        dist.all_reduce(total)  # the ranks' losses couple their updates, as a TP layer's do
        (local / (1.0 + total)).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1

    def moments(self) -> dict[str, torch.Tensor]:
        st = self.opt.state.get(self.weight)
        if not st:  # a fresh run about to load: the live tensors the load fills
            return {"exp_avg": torch.zeros_like(self.weight), "exp_avg_sq": torch.zeros_like(self.weight)}
        return {"exp_avg": st["exp_avg"], "exp_avg_sq": st["exp_avg_sq"]}

    def sharded_state_dict(self) -> dict:
        from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

        def shard(key, t):
            return ShardedTensor.from_rank_offsets(key, t.detach(), (0, self.rank, self.world))

        m = self.moments()
        return {
            "model": {"weight": shard("layer.weight", self.weight)},
            "optimizer": {k: shard(f"optimizer.state.{k}.layer.weight", v) for k, v in m.items()},
            "rng": ShardedObject("rng.dropout", self.drop_rng.get_state(), (self.world,), (self.rank,), replica_id=0),
            "step": self.step,
            "data_rng": self.data_rng.get_state(),
        }

    def restore(self, loaded: dict) -> None:
        with torch.no_grad():
            self.weight.copy_(loaded["model"]["weight"])
        st = loaded["optimizer"]
        self.opt.state[self.weight] = {"step": torch.tensor(float(loaded["step"])),
                                       "exp_avg": st["exp_avg"].clone(), "exp_avg_sq": st["exp_avg_sq"].clone()}
        self.drop_rng.set_state(loaded["rng"])
        self.data_rng.set_state(loaded["data_rng"])
        self.step = loaded["step"]

    def digest(self) -> dict[str, str]:
        """sha256 of the raw bytes of everything the run's future depends on."""
        st = self.opt.state[self.weight]
        parts = {"weight": self.weight.detach(), "exp_avg": st["exp_avg"], "exp_avg_sq": st["exp_avg_sq"],
                 "adam_step": st["step"], "data_rng": self.data_rng.get_state(),
                 "drop_rng": self.drop_rng.get_state()}
        return {k: hashlib.sha256(v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
                for k, v in parts.items()} | {"step": str(self.step)}


def newest_committed(folder: str) -> str | None:
    """The newest iter_* directory whose save was finalized (Megatron writes metadata.json last)."""
    done = sorted(d for d in os.listdir(folder) if d.startswith("iter_")
                  and os.path.exists(os.path.join(folder, d, "metadata.json"))) if os.path.isdir(folder) else []
    return os.path.join(folder, done[-1]) if done else None


def _run(rank: int, world: int, folder: str, mode: str) -> dict:
    """Train to TOTAL, saving (async, finalized after the next step) every EVERY steps. ``mode``:
    "full"; "in-save" (SIGKILL while step 4's files are written); "between" (SIGKILL after
    step 5, step 4 finalized); "resume" (load the newest committed checkpoint first)."""
    from megatron.core import dist_checkpointing

    import gdswriter.distributed.dcp_writer as plugin
    from gdswriter.integrations import megatron as gds_megatron
    from tests.support.models import one_thread

    gds_megatron.register()
    t = Trainer(rank, world)
    resumed_from = None
    with one_thread():
        if mode == "resume":
            resumed_from = newest_committed(folder)
            if resumed_from is not None:
                t.restore(dist_checkpointing.load(t.sharded_state_dict(), resumed_from))
        strategy, pending = gds_megatron.GDSSaveShardedStrategy(), None
        while t.step < TOTAL:
            t.train_step()
            if pending is not None:
                pending.finalize()
                pending = None
            if mode == "between" and t.step == 5:
                os.kill(os.getpid(), signal.SIGKILL)
            if t.step % EVERY == 0:
                if mode == "in-save" and t.step == 4:
                    written = plugin.write_files

                    def write_then_die(fplan, spans, rc, engines, **kw):
                        return written(fplan, spans, rc, [KillAfterFirstFile(e, hold_s=1) for e in engines], **kw)

                    plugin.write_files = write_then_die  # the plug-in's own (public) name for its writes
                ckpt = os.path.join(folder, f"iter_{t.step:07d}")
                os.makedirs(ckpt, exist_ok=True)
                pending = ForkedCaller(gds_megatron.save(t.sharded_state_dict(), ckpt, strategy,
                                                         async_sharded_save=True))
        if pending is not None:
            pending.finalize()
        strategy.close()
    return {"digest": t.digest(), "from": None if resumed_from is None else os.path.basename(resumed_from)}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    base = tmp_path_factory.mktemp("megatron-full")
    return run_ranks(2, _run, str(base / "ckpt"), "full", out=base / "out")


@pytest.mark.parametrize("mode, resumes_from", [("in-save", "iter_0000002"), ("between", "iter_0000004")])
def test_a_killed_run_resumes_bit_for_bit(tmp_path, uninterrupted, mode, resumes_from):
    """2 ranks (TP=2) killed with SIGKILL during step 4's save, or after it was finalized; fresh
    ranks load the newest committed checkpoint (step 2, or 4), train to step 6 saving as before,
    and end with the uninterrupted run's weights, AdamW moments and step, and RNG states."""
    folder = tmp_path / "ckpt"
    run_ranks(2, _run, str(folder), mode, out=tmp_path / "o1", killed=(0, 1))
    if mode == "in-save":
        assert not (folder / "iter_0000004" / "metadata.json").exists()
    resumed = run_ranks(2, _run, str(folder), "resume", out=tmp_path / "o2")
    assert [r["from"] for r in resumed] == [resumes_from] * 2
    for rank in (0, 1):
        assert resumed[rank]["digest"] == uninterrupted[rank]["digest"], f"rank {rank}"
    assert uninterrupted[0]["digest"]["weight"] != uninterrupted[1]["digest"]["weight"]  # shards, not copies


def _metadata(rank: int, world: int, folder: str) -> dict:
    """Save one step at TP=2, then each rank alone asks for its tensors' metadata."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from gdswriter.integrations import megatron as gds_megatron

    gds_megatron.register()
    t = Trainer(rank, world)
    t.train_step()
    ckpt = os.path.join(folder, "iter_0000001")
    os.makedirs(ckpt, exist_ok=True)
    strategy = gds_megatron.GDSSaveShardedStrategy()
    gds_megatron.save(t.sharded_state_dict(), ckpt, strategy)
    strategy.close()
    # strict loads compare the keys with the checkpoint's (the strategy's load_sharded_metadata)
    dist_checkpointing.load(Trainer(rank, world).sharded_state_dict(), ckpt, strict=StrictHandling.RAISE_ALL)
    partial = Trainer(rank, world).sharded_state_dict()
    del partial["optimizer"]["exp_avg_sq"]
    _, missing, unexpected = dist_checkpointing.load(partial, ckpt, strict=StrictHandling.RETURN_ALL)
    out = {"missing": sorted(missing), "unexpected": sorted(unexpected)}
    if rank == 1:  # not a collective: rank 0 is not asking
        md = dist_checkpointing.load_tensors_metadata(ckpt)
        full = load_sharded_metadata(ckpt, gds_megatron.GDSLoadShardedStrategy())
        out |= {"tensors": {k: [list(v.global_shape), str(v.dtype), list(v.local_shape)] for k, v in md.items()},
                "all": sorted(full)}
    return out


def test_load_tensors_metadata_gives_global_shapes_and_dtypes(tmp_path):
    """Strict loads on both ranks (RAISE_ALL passes; RETURN_ALL names the key left out as missing), then
    dist_checkpointing.load_tensors_metadata (the strategy from metadata.json) on one rank: the
    global shape and dtype of every ShardedTensor, as torch_dist's strategy returns them; the
    sharded metadata adds the ShardedObjects by unique key, without the common state."""
    first, got = run_ranks(2, _metadata, str(tmp_path / "ckpt"), out=tmp_path / "out")
    for r in (first, got):
        # Megatron's words: "missing" is in the checkpoint, not asked for
        assert r["missing"] == ["optimizer.state.exp_avg_sq.layer.weight"] and r["unexpected"] == [], r
    want = [[ROWS, COLS], "torch.float32", [ROWS, COLS]]
    assert got["tensors"] == {"layer.weight": want, "optimizer.state.exp_avg.layer.weight": want,
                              "optimizer.state.exp_avg_sq.layer.weight": want}
    assert got["all"] == sorted([*got["tensors"], "rng.dropout/shard_0_2", "rng.dropout/shard_1_2"])


def test_load_tensors_metadata_of_a_missing_checkpoint_is_a_typed_error(tmp_path):
    from gdswriter.errors import CheckpointNotFoundError
    from gdswriter.integrations.megatron import GDSLoadShardedStrategy

    strategy = GDSLoadShardedStrategy()
    with pytest.raises(CheckpointNotFoundError):
        strategy.load_tensors_metadata(tmp_path)
    strategy.close()
