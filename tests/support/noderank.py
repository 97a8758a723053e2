"""One rank of a simulated node (support/nodes.py), started by the node's init.

``python -m support.noderank MODULE:FUNCTION RANK WORLD PORT OUT ARGS_JSON`` joins the job's
process group (gloo, ``tcp://127.0.0.1:PORT``: the nodes share the network namespace), runs
``FUNCTION(rank, world, *args)`` and writes its JSON result to ``OUT/result-<rank>.json``, or
the traceback to ``OUT/error-<rank>.txt`` (as support/ranks.py does for spawned ranks).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path

from support.nodes import OUT_ENV, RANK_ENV


def main(target: str, rank: int, world: int, port: int, out: str, args: list) -> None:
    os.environ[OUT_ENV], os.environ[RANK_ENV] = out, str(rank)
    try:
        import torch
        import torch.distributed as dist

        module, _, name = target.partition(":")
        fn = importlib.import_module(module)
        for part in name.split("."):
            fn = getattr(fn, part)
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=120))
        result = fn(rank, world, *args)
        tmp = Path(out, f".result-{rank}.json")
        tmp.write_text(json.dumps(result))
        os.replace(tmp, Path(out, f"result-{rank}.json"))
    except BaseException:  # noqa: BLE001 - the test reports it
        Path(out, f"error-{rank}.txt").write_text(traceback.format_exc())
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)  # no destroy_process_group: a peer may be gone on purpose (a killed node)


if __name__ == "__main__":
    t, r, w, p, o, a = sys.argv[1:7]
    main(t, int(r), int(w), int(p), o, json.loads(a))
