"""A small, deterministic training setup for checkpoint/resume tests.

Everything random (initialisation, data, dropout) is driven by the global torch
RNG, so a resume is only bit-exact when the RNG state is restored as well.
Training runs on one intra-op thread so that losses are reproducible across
processes.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from gdswriter.checkpointer import CheckpointOptions
from gdswriter.options import EngineOptions, KiB

VOCAB = 61
SEQ = 12
BATCH = 4
DIM = 32


def small_engine(**overrides) -> EngineOptions:
    kw = dict(buffer_bytes=256 * KiB, request_bytes=64 * KiB, num_buffers=3, queue_depth=16)
    kw.update(overrides)
    return EngineOptions(**kw)


def small_options(**kw) -> CheckpointOptions:
    """CheckpointOptions with small engine buffers (fast to set up in tests)."""
    engine = kw.pop("engine", None) or small_engine()
    return CheckpointOptions(engine=engine, **kw)


class Block(nn.Module):
    """Pre-norm transformer block: hand-written causal attention + MLP, both with dropout."""

    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = self.qkv(h).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        att = self.drop(att.masked_fill(mask, float("-inf")).softmax(-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.mlp(self.ln2(x)))


class TinyLM(nn.Module):
    """Token embedding tied to the output head, learned positions, two blocks."""

    def __init__(self, vocab: int = VOCAB, dim: int = DIM, layers: int = 2, heads: int = 4, dropout: float = 0.1):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        nn.init.normal_(self.emb.weight, std=0.02)
        self.pos = nn.Parameter(torch.randn(SEQ, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.drop = nn.Dropout(dropout)
        self.register_buffer("seen_tokens", torch.zeros((), dtype=torch.int64))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.emb(tokens) + self.pos[: tokens.shape[1]])
        for blk in self.blocks:
            x = blk(x)
        if self.training:
            self.seen_tokens += tokens.numel()
        return self.head(self.ln_f(x))


def make_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic batch drawn from the global torch RNG: next-token prediction on a
    noisy arithmetic sequence."""
    start = torch.randint(0, VOCAB, (BATCH, 1))
    stride = torch.randint(1, 4, (BATCH, 1))
    seq = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    noise = torch.rand(BATCH, SEQ + 1) < 0.1
    seq = torch.where(noise, torch.randint(0, VOCAB, (BATCH, SEQ + 1)), seq)
    return seq[:, :-1], seq[:, 1:]


def build(seed: int, *, lr: float = 3e-3, scaler: bool = True):
    """(model, optimizer, scheduler, grad scaler or None), initialised from ``seed``."""
    torch.manual_seed(seed)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10, eta_min=1e-4)
    gs = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2) if scaler else None
    return model, opt, sched, gs


@contextlib.contextmanager
def one_thread():
    """Torch's intra-op threads set to one while inside (then back as they were), so that each
    kernel computes the same way in every process whatever the load (a parallel kernel's
    threads may finish in another order under contention and round differently)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def train_steps(model: nn.Module, opt, sched, n: int, scaler=None) -> list[float]:
    """Run ``n`` optimizer steps; return the losses (python floats)."""
    losses = []
    model.train()
    with one_thread():
        for _ in range(n):
            x, y = make_batch()
            logits = model(x)
            loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
            sched.step()
            losses.append(loss.item())
    return losses


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), f"{k} differs"


def fill_random(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random bytes into every byte of t's storage (any dtype)."""
    st = t.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8).set_(st, 0, (st.nbytes(),), (1,))
    flat.copy_(torch.randint(0, 256, (st.nbytes(),), dtype=torch.uint8, generator=gen))
    return t


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes a tensor views, as a flat uint8 tensor (works for every dtype: no dtype kernels run)."""
    assert t.is_contiguous()
    n = t.numel() * t.element_size()
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage(), t.storage_offset() * t.element_size(),
                                                   (n,), (1,)).clone()


# ----------------------------------------------------------------------------- crash tests
CRASH_PRIME = 7919


def crash_base(total_bytes: int, pieces: int = 3) -> dict[str, torch.Tensor]:
    """Fixed random int32 tensors of about ``total_bytes`` in all (the same in every process)."""
    g = torch.Generator().manual_seed(1234)
    n = total_bytes // 4 // pieces
    return {f"t{i}": torch.randint(-2 ** 31, 2 ** 31 - 1, (n,), dtype=torch.int32, generator=g)
            for i in range(pieces)}


def crash_state(base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    state = {k: v.clone() for k, v in base.items()}
    state["gen"] = torch.zeros((), dtype=torch.int64)
    return state


def crash_fill(state: dict[str, torch.Tensor], base: dict[str, torch.Tensor], gen: int) -> None:
    """Make ``state`` hold generation ``gen``: every byte depends on it (int32 wraps, exactly)."""
    for k, b in base.items():
        torch.add(b, gen * CRASH_PRIME, out=state[k])
    state["gen"].fill_(gen)


def crash_matches(saved: dict[str, torch.Tensor], base: dict[str, torch.Tensor], gen: int,
                  sample: int | None = None) -> bool:
    """``saved`` holds generation ``gen`` (with ``sample``: checks the first and last
    ``sample`` elements of each tensor only)."""
    if int(saved["gen"]) != gen:
        return False
    for k, b in base.items():
        got = saved[k]
        if got.shape != b.shape or got.dtype != b.dtype:
            return False
        parts = [slice(None)] if sample is None else [slice(0, sample), slice(-sample, None)]
        if not all(torch.equal(got[p], torch.add(b[p], gen * CRASH_PRIME)) for p in parts):
            return False
    return True


def fsdp_mlp(world: int, seed: int):
    """An MLP sharded with FSDP2 (fully_shard) over all ``world`` ranks of the default group (70
    output rows shard unevenly), its Adam optimizer and the mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(96, 256), nn.ReLU(), nn.Linear(256, 70))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.01), mesh


def full_state(model, opt) -> dict[str, torch.Tensor]:
    """The model's and the optimizer's state as whole tensors (a DTensor's full_tensor(), a
    plain tensor cloned), by "model/<key>" and "opt/<param id>/<key>": what a load must give
    back bit for bit, whatever the mesh."""
    out = {}
    for k, v in model.state_dict().items():
        out[f"model/{k}"] = v.full_tensor() if hasattr(v, "full_tensor") else v.clone()
    for pid, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            out[f"opt/{pid}/{k}"] = v.full_tensor() if hasattr(v, "full_tensor") else v.clone()
    return out
