"""Simulated nodes on this machine, for the tests of losing a node (issue 39).

Each node is a mount, PID and UTS namespace::

    unshare --mount --pid --uts --fork --mount-proc --propagation private --kill-child \\
        python -m support.nodeinit SPEC

whose first process (``support/nodeinit.py``, PID 1 inside) sets the node's hostname
(``node0``, ``node1``...), mounts a fresh tmpfs on ``/dev/shm``, bind-mounts the node's own
directory ``<tmp_path>/node<K>/nvme`` at the same path on every node (``NVME``,
``/local_nvme``), then starts the node's ranks (``support/noderank.py``: one Python process
per rank, running a module-level function by import path under torch.distributed, gloo on
127.0.0.1: the network namespace is shared, so loopback joins the nodes). The job's code is
thus what runs on a cluster: the same root path on every rank, a different disk behind it,
hosts told apart by their hostnames, a ``/dev/shm`` per host. Everything else, the test's
``tmp_path`` included, is the one file system every node sees (the "shared storage": where
results, markers and, later, a drain root live).

Killing a node (``Cluster.kill_node``) SIGKILLs its namespace's first process: the kernel then
kills every process of that PID namespace at once (its ranks, their save threads), and the
node's mounts go with it. ``replace_node`` empties its NVMe directory (a new machine).

Use::

    with Cluster(tmp_path, nodes=2, ranks_per_node=1) as cluster:
        job = cluster.start(my_fn, arg1, arg2)  # my_fn(rank, world, arg1, arg2) -> JSON
        job.wait_for("step2-writing", rank=1)   # a rank called reached("step2-writing")
        cluster.kill_node(1)
        results = job.wait(killed_nodes=(1,))   # one result per rank, None on killed nodes
        cluster.replace_node(1)
        results = cluster.run(load_fn)          # a new job on the same nodes (or nodes=[0])

In a rank, ``reached(name, hold_s=...)`` records that it got to a point of a save (a file in the
job's shared out dir) and may hold there, so that the test kills the node at that moment.

Every wait is bounded (``JOB_TIMEOUT_S`` for a job, each node's init kills its ranks after it
too) and ``Cluster.close()`` (a context manager's exit) kills every namespace still running;
a node also dies with the test process (PR_SET_PDEATHSIG on unshare, ``--kill-child``):
nothing here can hang a CI run or outlive it. ``unavailable()`` says why nodes cannot be
simulated (not root, no ``unshare``): tests skip with that reason.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterable, Sequence

NVME = "/local_nvme"  # each node's own directory is mounted here, on every node
JOB_TIMEOUT_S = 240  # a whole job; a hang fails the test instead of blocking CI
OUT_ENV = "GDSW_NODES_OUT"  # set in each rank: the job's shared out dir (results, markers)
RANK_ENV = "GDSW_NODES_RANK"
TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent


@functools.cache
def unavailable() -> str | None:
    """Why nodes cannot be simulated here (a reason to skip), or None when they can."""
    if os.geteuid() != 0:
        return "simulated nodes need root (unshare --mount --pid --uts)"
    for tool in ("unshare", "mount"):
        if shutil.which(tool) is None:
            return f"simulated nodes need util-linux's {tool!r}, not found on PATH"
    try:
        os.makedirs(NVME, exist_ok=True)  # the mount point, on the host, once
    except OSError as e:
        return f"cannot create the mount point {NVME} on this machine: {e}"
    probe = "hostname nodeprobe && mount -t tmpfs tmpfs /dev/shm && test $$ = 1"
    try:
        r = subprocess.run([*_unshare(), "sh", "-c", probe], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare does not work here: {e}"
    if r.returncode != 0:
        return f"unshare does not work here (namespaces refused?): {r.stderr.strip()}"
    return None


def _unshare() -> list[str]:
    # --kill-child: if unshare itself dies, its child (PID 1 of the node) is SIGKILLed, so the
    # whole namespace goes; --propagation private: no mount made inside reaches the host.
    return ["unshare", "--mount", "--pid", "--uts", "--fork", "--mount-proc", "--propagation", "private",
            "--kill-child"]


def _die_with_parent() -> None:
    """In the unshare process, before exec: SIGKILL when the test process dies (prctl
    PR_SET_PDEATHSIG), so a killed test run leaves no node behind (--kill-child does the rest)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reached(name: str, hold_s: float = 0.0) -> None:
    """In a rank: record that this rank reached point ``name`` (the file ``marks/<name>-rank<R>``
    in the job's out dir, written atomically), then sleep ``hold_s`` seconds: time for the test
    to kill the node here (bounded, so a rank nobody kills goes on)."""
    out, rank = Path(os.environ[OUT_ENV]), os.environ[RANK_ENV]
    tmp = out / "marks" / f".{name}-rank{rank}"
    tmp.write_text(socket.gethostname())
    os.replace(tmp, out / "marks" / f"{name}-rank{rank}")
    if hold_s > 0:
        time.sleep(hold_s)


def _target(fn: Callable | str) -> str:
    if isinstance(fn, str):
        return fn
    if "<locals>" in fn.__qualname__:
        raise ValueError(f"{fn.__qualname__}: a rank runs a module-level function (it is imported by name)")
    return f"{fn.__module__}:{fn.__qualname__}"


def namespace_pids(init_pid: int) -> list[int]:
    """The host PIDs of every process in the PID namespace whose first process is ``init_pid``."""
    try:
        ns = os.readlink(f"/proc/{init_pid}/ns/pid_for_children")
    except OSError:
        return []
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/ns/pid") == ns:
                    pids.append(int(entry))
            except OSError:
                pass  # gone meanwhile
    return sorted(pids)


class Job:
    """One job: a set of nodes, each running its ranks. Ranks are numbered node by node, in the
    order of ``nodes``: node ``nodes[i]`` runs ranks ``i*R .. i*R+R-1``."""

    def __init__(self, cluster: Cluster, nodes: Sequence[int], out: Path, procs: dict[int, subprocess.Popen]):
        self.cluster, self.nodes, self.out, self.procs = cluster, list(nodes), out, procs
        self.world = len(self.nodes) * cluster.ranks_per_node
        self.started = time.monotonic()

    def ranks_of(self, node: int) -> list[int]:
        r = self.cluster.ranks_per_node
        i = self.nodes.index(node)
        return list(range(i * r, (i + 1) * r))

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs.values())

    def wait_for(self, name: str, *, rank: int = 0, timeout: float = 60.0) -> str:
        """Wait until ``rank`` called ``reached(name)``; returns the hostname it reached it on.
        Fails (with the ranks' errors) when the job ends first or ``timeout`` passes."""
        mark = self.out / "marks" / f"{name}-rank{rank}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if mark.exists():
                return mark.read_text()
            if not self.running():
                break
            time.sleep(0.02)
        if mark.exists():
            return mark.read_text()
        what = "the job ended" if not self.running() else f"{timeout} s passed"
        raise AssertionError(f"rank {rank} never reached {name!r} ({what}); errors: {self.errors()}")

    def errors(self) -> dict[int, str]:
        return {r: (self.out / f"error-{r}.txt").read_text() for r in range(self.world)
                if (self.out / f"error-{r}.txt").exists()}

    def wait(self, timeout: float = JOB_TIMEOUT_S, killed_nodes: Iterable[int] = ()) -> list[Any]:
        """Wait for every node to end; returns each rank's (JSON) result, None for the ranks of
        ``killed_nodes`` (which must have been killed). A rank that raised, a node that failed or
        a job still running after ``timeout`` (then killed) fails the test, as run_ranks does."""
        killed = set(killed_nodes)
        deadline = self.started + timeout
        for p in self.procs.values():
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        hung = [k for k, p in self.procs.items() if p.poll() is None]
        for k in hung:
            self.cluster.kill_node(k)
        errors = self.errors()
        logs = {k: self.log(k) for k in self.nodes if k not in killed and self.procs[k].returncode != 0}
        assert not hung, f"nodes {hung} still running after {timeout} s; errors: {errors}"
        assert not errors, "\n".join(f"--- rank {r} ---\n{t}" for r, t in errors.items())
        assert not logs, "\n".join(f"--- node {k} (exit {self.procs[k].returncode}) ---\n{t}" for k, t in logs.items())
        dead = {r for k in killed for r in self.ranks_of(k)}
        return [None if r in dead else json.loads((self.out / f"result-{r}.json").read_text())
                for r in range(self.world)]

    def log(self, node: int) -> str:
        """What node ``node``'s init and ranks printed (their stdout and stderr)."""
        path = self.out / f"node{node}.log"
        return path.read_text(errors="replace")[-6000:] if path.exists() else ""


class Cluster:
    """``nodes`` simulated nodes of ``ranks_per_node`` ranks each, under ``tmp_path``: node K's
    NVMe is ``tmp_path/node<K>/nvme`` on the host, ``NVME`` inside the node; the jobs' out dirs
    are ``tmp_path/jobs/job<N>``; ``shared`` (``tmp_path/shared``) is storage every node sees."""

    def __init__(self, tmp_path: str | os.PathLike, nodes: int, ranks_per_node: int = 1, *,
                 shm_bytes: int = 256 << 20):
        reason = unavailable()
        if reason:
            raise RuntimeError(reason)
        self.base = Path(tmp_path)
        self.node_count, self.ranks_per_node, self.shm_bytes = nodes, ranks_per_node, shm_bytes
        self.shared = self.base / "shared"
        self.shared.mkdir(parents=True, exist_ok=True)
        for k in range(nodes):
            self.nvme_dir(k).mkdir(parents=True, exist_ok=True)
        self.jobs: list[Job] = []
        self.running: dict[int, subprocess.Popen] = {}  # node -> its unshare process, while it runs

    def nvme_dir(self, node: int) -> Path:
        """Node ``node``'s NVMe directory, as the host (the test) sees it."""
        return self.base / f"node{node}" / "nvme"

    def start(self, fn: Callable | str, *args: Any, nodes: Sequence[int] | None = None,
              timeout: float = JOB_TIMEOUT_S) -> Job:
        """Start ``fn(rank, world, *args)`` (a module-level function, or "module:function") on
        every rank of ``nodes`` (default: all); ``args`` must be JSON. Returns at once."""
        nodes = list(range(self.node_count)) if nodes is None else list(nodes)
        busy = [k for k in nodes if k in self.running and self.running[k].poll() is None]
        if busy:
            raise RuntimeError(f"nodes {busy} still run a job: wait for it or kill them first")
        out = self.base / "jobs" / f"job{len(self.jobs)}"
        (out / "marks").mkdir(parents=True)
        port, world = free_port(), len(nodes) * self.ranks_per_node
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(TESTS), str(REPO),
                                                                         os.environ.get("PYTHONPATH")])))
        procs = {}
        for i, k in enumerate(nodes):
            spec = {"node": k, "nvme_host": str(self.nvme_dir(k)), "nvme": NVME, "shm_bytes": self.shm_bytes,
                    "ranks": list(range(i * self.ranks_per_node, (i + 1) * self.ranks_per_node)),
                    "world": world, "port": port, "out": str(out), "target": _target(fn),
                    "args": list(args), "timeout": timeout}
            with open(out / f"node{k}.log", "wb") as log:
                procs[k] = subprocess.Popen([*_unshare(), sys.executable, "-m", "support.nodeinit", json.dumps(spec)],
                                            env=env, cwd=str(TESTS), stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True, preexec_fn=_die_with_parent)
            self.running[k] = procs[k]
        job = Job(self, nodes, out, procs)
        self.jobs.append(job)
        return job

    def run(self, fn: Callable | str, *args: Any, nodes: Sequence[int] | None = None,
            timeout: float = JOB_TIMEOUT_S) -> list[Any]:
        """``start`` then ``wait``: each rank's result."""
        return self.start(fn, *args, nodes=nodes, timeout=timeout).wait(timeout)

    def init_pid(self, node: int) -> int | None:
        """The host PID of node ``node``'s first process (PID 1 inside), None when not running."""
        p = self.running.get(node)
        if p is None or p.poll() is not None:
            return None
        try:
            children = Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()
        except OSError:
            return None
        return int(children[0]) if children else None

    def pids(self, node: int) -> list[int]:
        """The host PIDs of every process of node ``node`` (its init and ranks)."""
        init = self.init_pid(node)
        return namespace_pids(init) if init else []

    def kill_node(self, node: int, timeout: float = 30.0) -> None:
        """SIGKILL node ``node``'s first process: every process of the node dies at once. Returns
        once they all have (the kernel reaps the namespace before its init's parent sees it end)."""
        p = self.running.get(node)
        if p is None:
            return
        init = self.init_pid(node)
        try:
            if init:
                os.kill(init, signal.SIGKILL)
            else:
                p.kill()
        except ProcessLookupError:
            pass
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()  # --kill-child: the namespace goes with unshare
            p.wait(timeout)
        if init:
            left = namespace_pids(init)
            assert not left, f"node {node}: processes {left} outlived its first process"

    def replace_node(self, node: int) -> None:
        """Node ``node`` replaced by a new machine: its NVMe directory emptied (it must not run)."""
        p = self.running.get(node)
        if p is not None and p.poll() is None:
            raise RuntimeError(f"node {node} still runs: kill_node({node}) first")
        shutil.rmtree(self.nvme_dir(node))
        self.nvme_dir(node).mkdir(parents=True)

    def close(self) -> None:
        """Kill every node still running (a finalizer: bounded, never raises for a node)."""
        for k in list(self.running):
            try:
                self.kill_node(k, timeout=10.0)
            except Exception:  # noqa: BLE001 - close every other node anyway
                pass
        self.running.clear()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
