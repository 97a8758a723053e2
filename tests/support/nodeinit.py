"""The first process of a simulated node (support/nodes.py): PID 1 of its namespaces.

``python -m support.nodeinit SPEC`` (SPEC: JSON from ``Cluster.start``) sets the hostname
``node<K>``, mounts a fresh tmpfs on ``/dev/shm``, bind-mounts the node's NVMe directory at
``NVME``, starts the node's ranks (support/noderank.py) and waits for them, at most the job's
timeout (then it kills them: nothing hangs). Its exit code is 0 when every rank exited 0. When
it dies (SIGKILL from the test), the kernel kills every process of the node.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time


def setup(spec: dict) -> None:
    """This node's own hostname, /dev/shm and NVMe (the mounts are private to the namespace)."""
    socket.sethostname(f"node{spec['node']}")
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={spec['shm_bytes']},mode=1777", "tmpfs", "/dev/shm"],
                   check=True, timeout=30)
    subprocess.run(["mount", "--bind", spec["nvme_host"], spec["nvme"]], check=True, timeout=30)


def main(spec: dict) -> int:
    setup(spec)
    env = dict(os.environ, GDSW_NODE=str(spec["node"]))
    procs = [subprocess.Popen([sys.executable, "-m", "support.noderank", spec["target"], str(rank), str(spec["world"]),
                              str(spec["port"]), spec["out"], json.dumps(spec["args"])], env=env)
             for rank in spec["ranks"]]
    deadline = time.monotonic() + spec["timeout"]
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    print(f"node{spec['node']}: rank exit codes {codes}", flush=True)
    return 0 if all(c == 0 for c in codes) else 1


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
