"""A DCP step read in one process, without DCP (export)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from collections.abc import Sequence

import torch

from ..engines.select import create_engine
from ..errors import CorruptCheckpointError, InvalidOptionError
from ..format.manifest import Manifest
from ..format.state_codec import key_text
from ..options import EngineOptions
from .dcp_codec import metadata_from_json
from .group import Coordinator
from .rebuild import rebuild_state
from .roots import discover_layout


def is_dcp_step(m: Manifest) -> bool:
    """``m`` was saved through GDSStorageWriter."""
    return m.dist is not None and m.dist.layout == "dcp" and m.dist.dcp is not None


def dcp_items(m: Manifest) -> dict[str, int]:
    """{fqn: the index of its first tensor record} of a DCP step (DCP's flattened keys)."""
    pairs = m.state.get("$dict") if isinstance(m.state, dict) else None
    if not isinstance(pairs, list):
        raise CorruptCheckpointError(f"step {m.step}: the state of this DCP step is not the map of its items")
    out = {}
    for pair in pairs:
        if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str) and isinstance(pair[1], dict)
                and type(pair[1].get("$tensor")) is int and 0 <= pair[1]["$tensor"] < len(m.tensors)):
            raise CorruptCheckpointError(f"step {m.step}: a damaged item entry in the state of this DCP step")
        out[pair[0]] = pair[1]["$tensor"]
    return out


def dcp_model_keys(m: Manifest, name: str = "model") -> dict[str, str]:
    """{fqn: key in the model's state_dict} of the items a DCP step holds under its state's
    ``name`` entry (``dcp.save({"model": model.state_dict(), ...})``): from DCP's planner_data
    (the key path of each flattened item), else from the "model." prefix of the fqns."""
    md = metadata_from_json(m.dist.dcp)
    items = dcp_items(m)
    paths = md.planner_data if isinstance(md.planner_data, dict) else {}
    out = {}
    for fqn in items:
        path = paths.get(fqn)
        if isinstance(path, (tuple, list)) and len(path) >= 2 and path[0] == name:
            out[fqn] = ".".join(key_text(p) for p in path[1:])
        elif not isinstance(path, (tuple, list)) and fqn.startswith(name + "."):
            out[fqn] = fqn[len(name) + 1:]
    return out


def read_dcp_items(roots: Sequence[Path], m: Manifest, fqns: Sequence[str], *, verify: bool = True,
                   engine_options: EngineOptions | None = None) -> dict[str, torch.Tensor]:
    """{fqn: whole tensor} of the named items of DCP step ``m`` under ``roots`` (all roots of the
    checkpoint, the primary first), in one process: only their bytes are read, each tensor's
    chunks (the ranks' shards) assembled; BytesIO items come back as uint8 tensors."""
    items = dcp_items(m)
    missing = [f for f in fqns if f not in items]
    if missing:
        raise InvalidOptionError(f"step {m.step} holds no item {missing[0]!r}")
    coord = Coordinator.solo()
    layout = discover_layout(coord, list(roots), create=False)
    wanted = replace(m, state={"$dict": [[f, {"$tensor": items[f]}] for f in fqns]})
    with create_engine(engine_options) as engine:
        state = rebuild_state(coord, layout, wanted, {}, None, engine, verify=verify, what=f"reading step {m.step}")
    return dict(state)
