"""Durability under power loss: gdswriter saves on a file system that forgets what was not synced.

The file system (tests/powerloss/, a FUSE file system in its own process) keeps every write and
every directory change in a volatile cache and makes it durable only on fsync/fdatasync of
the file or fsync of the directory (the model: tests/powerloss/model.py). A power cut keeps
the durable state only; the next mount shows exactly that (and, to expose a missing sync that
later calls would hide, also states in which the disk had written some of the pending changes
on its own: all but one object's, all but one directory change, a random part of each).

Each scenario starts from a root holding steps 1 and 2 (keep_last=2, two data files per root),
then one real process runs: save 3, save 3 again (a re-save), save 4 (retention deletes 2),
wait, export step 4 to safetensors, close. The power is cut:

* before each durability call of that run, for every one of them (a dry run counts them: N),
  and after the last (N + 1 cuts), so that every protocol step is hit;
* at random: before a random operation of any kind, and at a random moment (timer);
  ``GDSWRITER_POWERLOSS_CUTS`` sets how many (default 4 per scenario).

After each cut, for each state the disk may hold, the file system restarts from that state and:

* every step that appears committed (a manifest, listed by ``CommitProtocol.committed_steps``)
  loads with verify=True bit-exact to the generation its save wrote, and ``gdswriter verify
  --all`` passes;
* the committed steps are one of the states the run passes through (old steps survive until
  retention deletes them; a re-save replaces a step atomically where the file system can
  exchange names, else the step is briefly absent), never an earlier state than what the
  application was told was done (a returned ``save`` is durable, a finished export exists);
* ``latest`` holds a step number, and names a committed step (except during a re-save without
  exchange, when it names the step being replaced and readers fall back);
* an export, if present, is complete and holds that step's tensors;
* opening a GDSCheckpointer (which removes leftovers) keeps every committed step, and
  ``load()`` restores the newest, bit-exact.

Scenarios: one root where the file system accepts O_DIRECT and RENAME_EXCHANGE (the engine's
fdatasync and the exchange path), one root where it refuses both (buffered I/O + fsync, and the
re-save fallback), two roots in two directories of one mount, and a root that does not exist
yet (``mnt/new/run/ssd0``: the checkpointer creates it, then saves 1 and 2; its name and its
parents' must be durable before a returned save counts as durable), the same with two roots
(the first save also marks them), and two ranks of a gloo process group saving to two roots
together (the multi-rank commit protocol of dist/commit.py; rank 0 exports).

``scripts/sync_mutations.py`` removes each fsync/fdatasync/directory fsync of gdswriter in turn
and checks that this test fails.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path

from support import models as M
import pytest
import torch
from powerloss import model as pm
from powerloss.harness import (
    AppServer,
    PowerLossMount,
    is_mounted,
    require_fuse,
    subprocess_env,
)

SETUP = [["save", 1, 1], ["save", 2, 2]]
PLAN = [["save", 3, 3], ["save", 3, 4], ["save", 4, 5], ["wait"], ["export", 4], ["export-hf", 4]]
OPTIONS = {"keep_last": 2, "files_per_root": 2}
# The committed {step: gen} states the plan passes through, in order.
STATES_EXCHANGE = [{1: 1, 2: 2}, {1: 1, 2: 2, 3: 3}, {2: 2, 3: 3}, {2: 2, 3: 4}, {2: 2, 3: 4, 4: 5}, {3: 4, 4: 5}]
STATES_NO_EXCHANGE = STATES_EXCHANGE[:3] + [{2: 2}] + STATES_EXCHANGE[3:]
# What an acknowledgement in the progress file guarantees: at least this state.
# (Retention is no promise: a failed delete is logged and retried after the next save.)
ACKED = {"saved 3 3": {1: 1, 2: 2, 3: 3}, "saved 3 4": {2: 2, 3: 4}, "saved 4 5": {2: 2, 3: 4, 4: 5}}
# A root that does not exist yet: the first save creates it.
FRESH_PLAN = [["save", 1, 1], ["save", 2, 2]]
FRESH_STATES = [{}, {1: 1}, {1: 1, 2: 2}]
FRESH_ACKED = {"saved 1 1": {1: 1}, "saved 2 2": {1: 1, 2: 2}}
# Through torch.distributed.checkpoint (GDSStorageWriter, node-local roots: rank 1 leads its own
# secondary root), no retention: re-saving step 3 un-commits it, then commits it again, while
# rank 1 writes beside the committed step_3 on its root.
DCP_SETUP = [["save", 1, 1], ["save", 2, 2]]
DCP_PLAN = [["save", 3, 3], ["save", 3, 4], ["save", 4, 5]]
DCP_STATES = [{1: 1, 2: 2}, {1: 1, 2: 2, 3: 3}, {1: 1, 2: 2}, {1: 1, 2: 2, 3: 4}, {1: 1, 2: 2, 3: 4, 4: 5}]
DCP_ACKED = {"saved 3 3": DCP_STATES[1], "saved 3 4": DCP_STATES[3], "saved 4 5": DCP_STATES[4]}
RANDOM_CUTS = int(os.environ.get("GDSWRITER_POWERLOSS_CUTS", "4"))
SWEEP_VARIANTS = "lag,drop"


@dataclass(frozen=True)
class Scenario:
    name: str
    n_roots: int = 1
    direct: bool = True  # the file system accepts O_DIRECT
    exchange: bool = True  # the file system accepts renameat2(RENAME_EXCHANGE)
    engine: str = "auto"
    fresh: bool = False  # the roots (and their parent) do not exist before the run
    ranks: int = 1  # processes in the job's gloo group: every rank saves (dist/commit.py's protocol)
    dcp: bool = False  # saves through torch.distributed.checkpoint, rank r writing to root r

    @property
    def setup(self) -> list[list]:
        return DCP_SETUP if self.dcp else SETUP

    @property
    def plan(self) -> list[list]:
        return DCP_PLAN if self.dcp else FRESH_PLAN if self.fresh else PLAN

    @property
    def states(self) -> list[dict[int, int]]:
        if self.dcp:
            return DCP_STATES
        if self.fresh:
            return FRESH_STATES
        one_root = self.n_roots == 1 and self.ranks == 1  # a multi-rank re-save un-commits, then commits
        return STATES_EXCHANGE if self.exchange and one_root else STATES_NO_EXCHANGE

    @property
    def acked(self) -> dict[str, dict[int, int]]:
        return DCP_ACKED if self.dcp else FRESH_ACKED if self.fresh else ACKED

    @property
    def options(self) -> dict:
        return {"files_per_root": 2, "dcp": True} if self.dcp else OPTIONS


SCENARIOS = [Scenario("fresh-root", fresh=True),
             Scenario("fresh-two-roots", fresh=True, n_roots=2),  # the first save also marks the roots
             Scenario("one-root"),
             Scenario("one-root-buffered-no-exchange", direct=False, exchange=False, engine="posix"),
             Scenario("two-roots", n_roots=2),
             Scenario("two-ranks-two-roots", n_roots=2, ranks=2),
             Scenario("dcp-two-ranks-node-local-roots", n_roots=2, ranks=2, dcp=True)]


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def fuse(tmp_path_factory):
    """Skip where FUSE cannot work at all; fail where only the project's set-up is missing."""
    require_fuse(tmp_path_factory.mktemp("fuse-probe"))


@pytest.fixture(scope="module")
def app(fuse, tmp_path_factory):
    server = AppServer(tmp_path_factory.mktemp("app") / "server.log")
    try:
        import gdswriter
        assert Path(server.gdswriter_file).resolve() == Path(gdswriter.__file__).resolve(), (
            "the application and the test must import the same gdswriter")
        yield server
    finally:
        server.close()


# ----------------------------------------------------------------------------- the model alone
def _model_with(ops) -> pm.Model:
    m = pm.Model()
    ops(m)
    return m


def _fsync_path(m: pm.Model, path: str, datasync: bool = False) -> None:
    m.fsync(m.resolve(path), datasync=datasync)


def test_model_data_without_entry_and_entry_without_data():
    def ops(m):
        m.create("/d", pm.DIR, 0o755)
        _fsync_path(m, "/")
        a = m.create("/d/a", pm.FILE, 0o644)
        m.write(a, 0, b"x" * 5000)
        m.fsync(a, datasync=True)  # data durable, name not
        b = m.create("/d/b", pm.FILE, 0o644)
        m.write(b, 0, b"y" * 10)

    m = _model_with(ops)
    assert pm.listing(m.durable_image()) == {"/d": None}, "a synced file whose name was not synced is gone"
    _fsync_path(m, "/d")
    assert pm.listing(m.durable_image()) == {"/d": None, "/d/a": b"x" * 5000, "/d/b": b""}, (
        "a name synced before the file's data: the file is empty")


def test_model_fdatasync_covers_size_not_mode():
    m = pm.Model()
    f = m.create("/f", pm.FILE, 0o644)
    _fsync_path(m, "/")
    m.fsync(f, datasync=False)
    m.write(f, 0, b"abc")
    m.truncate(f, 10)
    m.chmod(f, 0o600)
    m.fsync(f, datasync=True)
    img = m.durable_image()
    assert img[f.ino].data == b"abc" + bytes(7) and img[f.ino].mode == 0o644
    m.fsync(f, datasync=False)
    assert m.durable_image()[f.ino].mode == 0o600


def test_model_rename_across_directories_is_two_changes():
    def ops(m):
        for d in ("/a", "/b"):
            m.create(d, pm.DIR, 0o755)
        f = m.create("/a/f", pm.FILE, 0o644)
        m.write(f, 0, b"data")
        m.fsync(f, datasync=False)
        for d in ("/", "/a", "/b"):
            _fsync_path(m, d)
        m.rename("/a/f", "/b/g")

    m = _model_with(ops)
    assert "/a/f" in pm.listing(m.durable_image()) and "/b/g" not in pm.listing(m.durable_image())
    _fsync_path(m, "/b")  # only the new directory: the file now has both names
    assert {"/a/f", "/b/g"} <= set(pm.listing(m.durable_image()))
    m = _model_with(ops)
    _fsync_path(m, "/a")  # only the old directory: the file has neither
    assert not {"/a/f", "/b/g"} & set(pm.listing(m.durable_image()))


def test_model_exchange_and_rename_in_one_directory_are_atomic():
    m = pm.Model()
    for name, data in (("/x", b"old"), ("/y", b"new")):
        f = m.create(name, pm.FILE, 0o644)
        m.write(f, 0, data)
        m.fsync(f, datasync=False)
    _fsync_path(m, "/")
    m.rename("/y", "/x", pm.RENAME_EXCHANGE)
    m.create("/other", pm.FILE, 0o644)
    for name, img in m.variant_images("lag,drop,all,random:1,random:2,random:3"):
        got = pm.listing(img)
        assert (got["/x"], got["/y"]) in ((b"old", b"new"), (b"new", b"old")), (name, got)
    m.rename("/y", "/z")
    for name, img in m.variant_images("lag,all,random:1,random:2,random:3"):
        got = pm.listing(img)
        assert (got["/x"], got.get("/y") or got.get("/z")) in ((b"old", b"new"), (b"new", b"old")), (name, got)
    with pytest.raises(OSError):
        m.rename("/x", "/nope", pm.RENAME_EXCHANGE)


def test_model_lag_and_drop_images():
    m = pm.Model()
    m.create("/d", pm.DIR, 0o755)
    _fsync_path(m, "/")
    f = m.create("/d/f", pm.FILE, 0o644)
    m.write(f, 0, b"1234")
    m.rename("/d/f", "/d/g")
    images = dict(m.variant_images("lag,drop,all"))
    assert pm.listing(images["none"]) == {"/d": None}
    assert pm.listing(images["all"]) == {"/d": None, "/d/g": b"1234"}
    assert f"lag-{f.ino}" not in images, "only directories lag: a file's unsynced data is not in 'none' already"
    d = m.resolve("/d").ino
    assert pm.listing(images[f"lag-{d}"]) == {"/d": None}
    assert pm.listing(images[f"drop-{d}.0"]) == {"/d": None, "/d/g": b"1234"}  # the create lost, the rename kept
    assert pm.listing(images[f"drop-{d}.1"]) == {"/d": None, "/d/f": b"1234"}
    raw = pm.encode_image(images["all"])
    assert pm.encode_image(pm.decode_image(raw)) == raw


def test_model_random_images_only_mix_pending_changes():
    m = pm.Model()
    f = m.create("/f", pm.FILE, 0o644)
    m.write(f, 0, b"a" * 10000)
    m.fsync(f, datasync=False)
    _fsync_path(m, "/")
    m.write(f, 4096, b"b" * 8192)
    seen = set()
    for seed in range(40):
        data = pm.listing(m.random_image(random.Random(seed)))["/f"]
        assert data[:4096] == b"a" * 4096 and set(data[4096:]) <= {ord("a"), ord("b"), 0}
        seen.add(data)
    assert len(seen) >= 3, "random images should differ"


# ----------------------------------------------------------------------------- the FUSE file system
def _fsync_dir(path) -> None:
    """Not gdswriter.fs.fsync_dir: scripts/sync_mutations.py removes that one's fsync, and
    the tests of the file system itself must not fail for it."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remount(tmp_path: Path, image: Path, name: str) -> PowerLossMount:
    return PowerLossMount(tmp_path / "mnt", tmp_path / name, image=image)


def test_fuse_power_cut_keeps_only_synced_state(fuse, tmp_path):
    mnt = tmp_path / "mnt"
    with PowerLossMount(mnt, tmp_path / "fs1", variants="lag") as fs:
        os.mkdir(mnt / "d")
        _fsync_dir(mnt)
        with open(mnt / "d" / "kept", "wb") as f:
            f.write(b"k" * 70000)
            os.fsync(f.fileno())
        _fsync_dir(mnt / "d")
        with open(mnt / "d" / "data-only", "wb") as f:  # data synced, name not
            f.write(b"x" * 100)
            os.fdatasync(f.fileno())
        with open(mnt / "d" / "kept", "r+b") as f:  # an overwrite, never synced
            f.write(b"LOST")
        os.rename(mnt / "d" / "kept", mnt / "d" / "renamed")  # never synced
        assert sorted(os.listdir(mnt / "d")) == ["data-only", "renamed"]
        info = fs.cut()
        with pytest.raises(OSError):
            os.listdir(mnt / "d")  # the disk is gone
    assert not is_mounted(mnt)
    assert len(info["images"]) >= 2
    none = next(d for d, names in info["images"].items() if "none" in names)
    with _remount(tmp_path, fs.image_path(none), "fs2"):
        assert os.listdir(mnt / "d") == ["kept"]
        assert (mnt / "d" / "kept").read_bytes() == b"k" * 70000


def test_fuse_direct_io_and_exchange_are_accepted_or_refused(fuse, tmp_path):
    mnt = tmp_path / "mnt"
    for refuse in (False, True):
        with PowerLossMount(mnt, tmp_path / f"fs-{refuse}", no_direct=refuse, no_exchange=refuse) as fs:
            for n in ("a", "b"):
                (mnt / n).write_bytes(n.encode())
            try:
                os.close(os.open(mnt / "a", os.O_RDONLY | os.O_DIRECT))
                direct = True
            except OSError:
                direct = False
            from gdswriter.fs import exchange_paths
            swapped = exchange_paths(mnt / "a", mnt / "b")
            assert (direct, swapped) == (not refuse, not refuse)
            assert (mnt / "a").read_bytes() == (b"a" if refuse else b"b")
            st = fs.stats()
            assert (st["direct_open"], st["direct_refused"]) == ((0, 1) if refuse else (1, 0))
            assert (st["exchange_done"], st["exchange_refused"]) == ((0, 1) if refuse else (1, 0))


def test_fuse_cut_armed_after_n_syncs(fuse, tmp_path):
    mnt = tmp_path / "mnt"
    with PowerLossMount(mnt, tmp_path / "fs1", cut_after_syncs=2) as fs:
        for i in range(4):
            fd = os.open(mnt / f"f{i}", os.O_WRONLY | os.O_CREAT)
            try:
                os.write(fd, b"z")
                os.fsync(fd)
            except OSError:
                break
            finally:
                os.close(fd)
        info = fs.cut_result()
        assert info is not None and info["syncs"] == 3 and info["refused"][0] == "fsync"
        log = fs.oplog()
        assert [e[2] for e in log].count("fsync") == 2
    with _remount(tmp_path, fs.image_path(next(iter(info["images"]))), "fs2"):
        assert os.listdir(mnt) == []  # no directory fsync: no names survive


def test_fuse_clean_unmount_keeps_everything(fuse, tmp_path):
    mnt = tmp_path / "mnt"
    with PowerLossMount(mnt, tmp_path / "fs1") as fs:
        os.makedirs(mnt / "a" / "b")
        (mnt / "a" / "b" / "f").write_bytes(b"hello")
        os.symlink("b/f", mnt / "a" / "link")
        os.link(mnt / "a" / "b" / "f", mnt / "a" / "hard")
    with _remount(tmp_path, fs.clean_image(), "fs2"):
        assert (mnt / "a" / "link").read_bytes() == b"hello" == (mnt / "a" / "hard").read_bytes()
        assert os.stat(mnt / "a" / "hard").st_nlink == 2


OWNER = """
import sys, time
from pathlib import Path
from powerloss.harness import PowerLossMount
fs = PowerLossMount(Path(sys.argv[1]), Path(sys.argv[2]))
fs.start()
print(fs.proc.pid, flush=True)
time.sleep(600)
"""


def test_fuse_mount_dies_with_its_owner(fuse, tmp_path):
    """A test process killed outright (a CI timeout) leaves no mount and no file-system process."""
    import signal
    import subprocess
    import sys
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(tmp_path / "mnt"), str(tmp_path / "fs")],
                             env=subprocess_env(), stdout=subprocess.PIPE, text=True)
    try:
        fs_pid = int(owner.stdout.readline())
        assert is_mounted(tmp_path / "mnt")
        owner.send_signal(signal.SIGKILL)
        owner.wait(30)
        deadline = time.monotonic() + 30
        while is_mounted(tmp_path / "mnt") or os.path.exists(f"/proc/{fs_pid}"):
            assert time.monotonic() < deadline, "the mount or its process outlived the test process"
            time.sleep(0.05)
    finally:
        owner.kill()
        owner.wait()
        from powerloss.harness import force_unmount
        force_unmount(tmp_path / "mnt")


# ----------------------------------------------------------------------------- gdswriter under power loss
class Checker:
    """Runs the plan on the power-loss mount and checks every state a cut leaves."""

    def __init__(self, tmp_path: Path, app: AppServer, scenario: Scenario):
        self.tmp, self.app, self.sc = tmp_path, app, scenario
        self.mnt = tmp_path / "mnt"
        self.runs = 0
        self.images_checked = 0
        self.run_s = self.check_s = 0.0
        self.states_seen: set[int] = set()
        self.expected_cache: dict[int, tuple[dict, dict]] = {}

    def roots(self) -> list[Path]:
        top = self.mnt / "new" / "run" if self.sc.fresh else self.mnt
        return [top / f"ssd{i}" for i in range(self.sc.n_roots)]

    def mount(self, name: str, **kw) -> PowerLossMount:
        return PowerLossMount(self.mnt, self.tmp / name, no_direct=not self.sc.direct,
                              no_exchange=not self.sc.exchange, **kw)

    def job(self, actions, progress: Path) -> dict:
        return {"roots": [str(r) for r in self.roots()], "actions": actions, "progress": str(progress),
                "options": {**self.sc.options, "engine": {"engine": self.sc.engine}, "ranks": self.sc.ranks}}

    def make_base(self) -> Path:
        with self.mount("base") as fs:
            (self.mnt / "exports").mkdir()
            if not self.sc.fresh:
                progress = self.tmp / "base.progress"
                code = self.app.run(self.job(self.sc.setup, progress))
                assert code == 0, progress.read_text()
        return fs.clean_image()

    def cut_run(self, base: Path, name: str, *, variants: str, after_syncs: int | None = None,
                after_ops: int | None = None, delay: float | None = None) -> tuple[dict, list[str], dict]:
        """Run the plan from ``base`` and cut the power (when armed, after ``delay`` s, or at
        the end). Returns (cut.json, progress lines, the file system's stats)."""
        self.runs += 1
        t0 = time.monotonic()
        fs = self.mount(name, image=base, variants=variants, cut_after_syncs=after_syncs, cut_after_ops=after_ops)
        progress = self.tmp / f"{name}.progress"
        with fs:
            on_start = None
            if delay is not None:
                def on_start():
                    time.sleep(delay)
                    fs.cut()
            code = self.app.run(self.job(self.sc.plan, progress), on_start=on_start)
            lines = progress.read_text().splitlines()
            info = fs.cut_result()
            if info is None:
                assert code == 0 and lines[-1] == "closed", f"{name}: the run failed without a power cut: {lines}"
                info = fs.cut(variants)
            else:
                assert code != 0 or lines[-1] == "closed", f"{name}: the run went on without its disk: {lines}"
            stats = {**fs.stats(), "log": fs.oplog()}
        self.run_s += time.monotonic() - t0
        return info, lines, stats

    def expected(self, gen: int):
        if gen not in self.expected_cache:
            from powerloss.app import expected
            self.expected_cache[gen] = expected(gen)
        return self.expected_cache[gen]

    def check_cut(self, name: str, info: dict, lines: list[str]) -> None:
        """Mount each state the cut may have left, in turn at the same place, and check it."""
        t0 = time.monotonic()
        digests = sorted(info["images"])
        with PowerLossMount(self.mnt, self.tmp / f"{name}-check",
                            image=[self.tmp / name / f"{d}.img" for d in digests]) as fs:
            for i, digest in enumerate(digests):
                if i:
                    fs.next_image(i)
                where = (f"{self.sc.name} {name}, disk state {info['images'][digest]} (cut after {info['syncs']} "
                         f"syncs, {info['ops']} operations, before {info['refused']}; application: {lines})")
                self.check_image(where, lines)
                self.images_checked += 1
        self.check_s += time.monotonic() - t0

    def check_image(self, where: str, lines: list[str]) -> None:
        """A GDSCheckpointer job's disk: the committed steps are a state the run passes through, none
        older than what was acknowledged; ``latest`` names a committed step; each step loads
        bit-exact (checksums verified) as its generation; an acknowledged export is there, and one
        under its final name is whole; opening the roots changes nothing committed and leaves
        nothing behind, and load() gives the newest step."""
        if self.sc.dcp:
            return self.check_dcp_image(where, lines)
        from gdswriter import load_state
        from gdswriter.format.commit import CommitProtocol
        from gdswriter.load.reader import read_manifest

        roots = self.roots()
        proto = CommitProtocol(roots)
        steps = proto.committed_steps()
        state = {}
        for s in steps:
            try:
                state[s] = read_manifest(proto, s).metadata["gen"]
            except Exception as e:
                pytest.fail(f"step {s} is committed but its manifest is unreadable ({type(e).__name__}: {e}); {where}")
        states = self.sc.states
        assert state in states, f"committed steps {state} are not a state the run passes through; {where}"
        idx = states.index(state)
        acked = self.sc.acked
        floor = max((states.index(acked[ln]) for ln in lines if ln in acked), default=0)
        assert idx >= floor, (f"committed steps {state}, but the application had been told {states[floor]} was "
                              f"saved: an acknowledged save was lost; {where}")
        self.states_seen.add(idx)
        named = self.check_latest(roots, steps, state, where)

        for s in steps:  # every committed step loads bit-exact, checksums verified
            try:
                _got_step, tree = load_state([str(r) for r in roots], s, verify=True, engine_options=M.small_engine())
            except Exception as e:
                pytest.fail(f"committed step {s} does not load ({type(e).__name__}: {e}); {where}")
            self.assert_gen(tree["model"], tree["extra"]["progress"], state[s], f"step {s}; {where}")
        if steps:
            self.verify_all(roots, where)
        self.check_exports(where, lines)
        self.check_reopened(roots, steps, state, named, where)

    def check_latest(self, roots: list[Path], steps: list[int], state: dict, where: str) -> int | None:
        """The step ``latest`` names (None where there is none yet): a committed one, but in the
        no-exchange run's one gap; it may lag behind the first commit, never disappear."""
        if not (roots[0] / "latest").exists():  # written after the first commit: may lag behind it, never disappear
            assert self.sc.fresh and max(steps, default=0) <= 1, f"`latest` is missing; {where}"
            return None
        latest_text = (roots[0] / "latest").read_text()
        assert re.fullmatch(r"\d+\n", latest_text), f"`latest` holds {latest_text!r}; {where}"
        named = int(latest_text)
        if named not in steps:
            assert self.sc.states is STATES_NO_EXCHANGE and state == {2: 2} and named == 3, (
                f"`latest` names step {named}, which is not committed ({steps}); {where}")
        return named

    def check_exports(self, where: str, lines: list[str]) -> None:
        """An acknowledged export (Hugging Face directory, safetensors file) is there; one under its
        final name, acknowledged or not, is whole and holds step 4's weights."""
        from powerloss.app import EXPORT_DIR, HF_CONFIG, export_name, hf_export_name

        hf = self.mnt / EXPORT_DIR / hf_export_name(4)
        if "exported-hf 4" in lines:
            assert hf.is_dir(), f"the Hugging Face export was acknowledged, and is gone; {where}"
        if hf.exists():  # under its final name: complete, whatever the cut
            from safetensors.torch import load_file
            try:
                assert json.loads((hf / "config.json").read_text()) == HF_CONFIG
                flat = load_file(str(hf / "model.safetensors"))
            except Exception as e:
                pytest.fail(f"{hf} exists under its final name, and is damaged ({type(e).__name__}: {e}); {where}")
            model, _ = self.expected(5)
            assert flat.keys() == model.keys() and all(torch.equal(flat[k], v) for k, v in model.items()), (
                f"{hf}: the weights are not step 4's; {where}")
        export = self.mnt / EXPORT_DIR / export_name(4)
        if "exported 4" in lines:
            assert export.exists(), f"the export was acknowledged, and is gone; {where}"
        if export.exists():
            from safetensors.torch import load_file
            try:
                flat = load_file(str(export))
            except Exception as e:
                pytest.fail(f"{export} exists under its final name, and is damaged ({e}); {where}")
            model, _ = self.expected(5)
            for k, v in model.items():
                got = [t for name, t in flat.items() if name.endswith(k)]
                assert len(got) == 1 and torch.equal(got[0], v), f"export: {k} differs; {where}"

    def check_reopened(self, roots: list[Path], steps: list[int], state: dict, named: int | None,
                       where: str) -> None:
        """Opening the roots with a checkpointer changes no committed step and leaves no temporary
        directory, trash or uncommitted secondary step; load() gives the newest step."""
        from powerloss.app import make_net

        from gdswriter import GDSCheckpointer
        from gdswriter.format.commit import parse_step_dir

        net, extra = make_net(), {}
        with GDSCheckpointer(net, None, roots, state={"progress": extra}, options=M.small_options(**OPTIONS)) as ck:
            assert ck.steps() == steps, f"opening the root changed the committed steps; {where}"
            for i, r in enumerate(roots):
                names = os.listdir(r)
                assert not [n for n in names if n.startswith((".tmp-", ".trash-"))], f"leftovers {names}; {where}"
                orphans = [n for n in names if i and parse_step_dir(n) is not None and parse_step_dir(n) not in steps]
                assert not orphans, (f"secondary root {r.name} keeps step directories that are not committed and "
                                     f"that opening did not remove: {orphans}; {where}")
            if steps:
                newest = ck.load()
                assert newest == (named if named in steps else max(steps)), f"load() gave step {newest}; {where}"
                self.assert_gen(net.state_dict(), extra, state[newest], f"load() of step {newest}; {where}")

    def check_dcp_image(self, where: str, lines: list[str]) -> None:
        """A DCP job's disk: the committed steps are a state the run passes through, none older
        than what was acknowledged; each loads bit-exact (checksums verified) as its generation;
        ``latest`` names a committed step but during the re-save (step 3 un-committed, then
        committed again); ``gdswriter verify --all`` passes."""
        from gdswriter import load_state
        from gdswriter.format.commit import CommitProtocol

        roots = self.roots()
        steps = CommitProtocol(roots[:1]).committed_steps()
        state, trees = {}, {}
        for s in steps:
            try:
                _got_step, trees[s] = load_state([str(r) for r in roots], s, verify=True,
                                                 engine_options=M.small_engine())
            except Exception as e:
                pytest.fail(f"committed step {s} does not load ({type(e).__name__}: {e}); {where}")
            state[s] = int(trees[s]["progress.gen"])
        states = self.sc.states
        assert state in states, f"committed steps {state} are not a state the run passes through; {where}"
        floor = max((states.index(self.sc.acked[ln]) for ln in lines if ln in self.sc.acked), default=0)
        # the re-save's gap (step 3 un-committed) looks like the first state: the first match from the floor
        idx = next((i for i, st in enumerate(states) if st == state and i >= floor), None)
        assert idx is not None, (f"committed steps {state}, but the application had been told {states[floor]} was "
                                 f"saved: an acknowledged save was lost; {where}")
        self.states_seen.add(idx)
        latest = (roots[0] / "latest").read_text()
        assert re.fullmatch(r"\d+\n", latest), f"`latest` holds {latest!r}; {where}"
        assert int(latest) in steps or (state == {1: 1, 2: 2} and int(latest) == 3), (
            f"`latest` names step {int(latest)}, which is not committed ({steps}); {where}")
        for s in steps:
            want_model, want_extra = self.expected(state[s])
            tree = trees[s]
            assert sorted(tree) == sorted([f"model.{k}" for k in want_model] + ["progress.ema", "progress.gen"]), where
            for k, v in want_model.items():
                assert torch.equal(tree[f"model.{k}"], v), f"step {s}: {k} is not generation {state[s]}'s; {where}"
            assert torch.equal(tree["progress.ema"], want_extra["ema"]), f"step {s}: ema; {where}"
        self.verify_all(roots, where)

    def verify_all(self, roots: list[Path], where: str) -> None:
        """``gdswriter verify --all`` over every committed step of ``roots`` passes."""
        from gdswriter.cli import main as cli_main

        argv = ["verify", str(roots[0]), "--all", "--scratch", "1M"] + [
            a for r in roots[1:] for a in ("--secondary", str(r))]
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            rc = cli_main(argv)
        assert rc == 0, f"gdswriter verify --all exit {rc}: {out.getvalue()[-2000:]}; {where}"

    def assert_gen(self, model: dict, extra: dict, gen: int, where: str) -> None:
        want_model, want_extra = self.expected(gen)
        assert sorted(model) == sorted(want_model), where
        for k, v in want_model.items():
            assert torch.equal(model[k], v), f"{k} is not generation {gen}'s; {where}"
        assert extra["gen"] == gen and torch.equal(extra["ema"], want_extra["ema"]), where


def _short(path: str) -> str:
    """A path of the op log without the random parts of temporary names."""
    return re.sub(r"(\.(?:tmp|trash)-[^/]*?)-[0-9]+-[0-9a-f]{8}|-[0-9a-f]{8}$", r"\1", path)


@pytest.mark.slow  # minutes in all: run with -m slow (.ci/run does)
@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_power_cut_at_every_sync_and_at_random(tmp_path, app, scenario, monkeypatch):
    for knob, value in (("BUFFER_BYTES", "256K"), ("NUM_BUFFERS", "3"), ("REQUEST_BYTES", "64K")):
        monkeypatch.setenv(f"GDSWRITER_{knob}", value)  # small engines for `gdswriter verify`
    t0 = time.monotonic()
    ck = Checker(tmp_path, app, scenario)
    base = ck.make_base()

    # dry run: the durability calls of one run, in order; its end is the last cut point
    t_dry = time.monotonic()
    info, lines, stats = ck.cut_run(base, "dry", variants=SWEEP_VARIANTS)
    dry_s = time.monotonic() - t_dry
    n_syncs = stats["syncs"]
    assert lines[-1] == "closed" and n_syncs >= (5 if scenario.fresh else 12) * scenario.n_roots, (n_syncs, lines)
    if scenario.direct:
        assert stats["direct_open"] > 0 and stats["direct_refused"] == 0, stats
    else:
        assert stats["direct_open"] == 0 and stats["direct_refused"] > 0, stats
    resaves_one_root = scenario.n_roots == 1 and not scenario.fresh  # re-saving on one root tries the exchange
    assert (stats["exchange_done"] > 0) == (resaves_one_root and scenario.exchange), stats
    assert stats["exchange_refused"] == (1 if resaves_one_root and not scenario.exchange else 0), stats
    ck.check_cut("dry", info, lines)

    for k in range(n_syncs):  # before the (k+1)-th durability call
        info, lines, _ = ck.cut_run(base, f"sync{k}", variants=SWEEP_VARIANTS, after_syncs=k)
        assert info["syncs"] == k + 1 and info["refused"][0] in ("fsync", "fdatasync", "fsyncdir"), info
        ck.check_cut(f"sync{k}", info, lines)
    assert ck.states_seen == set(range(len(scenario.states))), (
        f"the sweep should reach every state of the run: {sorted(ck.states_seen)}")

    rng = random.Random(f"{scenario.name}-{RANDOM_CUTS}")
    for i in range(RANDOM_CUTS):
        seed = rng.randrange(1 << 30)
        if i % 2 == 0:  # before a random operation of any kind
            name, kw = f"op{i}", {"variants": f"lag,random:{seed},random:{seed + 1}",
                                      "after_ops": rng.randrange(stats["ops"])}
        else:  # at a random moment
            name, kw = f"timer{i}", {"variants": f"random:{seed}", "delay": rng.uniform(0, dry_s)}
        info, lines, _ = ck.cut_run(base, name, **kw)
        ck.check_cut(name, info, lines)

    syncs = [f"{e[2]} {_short(e[3])}" for e in stats["log"] if e[2] in ("fsync", "fdatasync", "fsyncdir")]
    print(f"\npower loss [{scenario.name}]: the run's durability calls: " + "; ".join(syncs))
    print(f"power loss [{scenario.name}]: {ck.runs} runs cut (every one of {n_syncs} syncs + end + "
          f"{RANDOM_CUTS} random), {ck.images_checked} disk states checked, states reached "
          f"{sorted(ck.states_seen)}, exchange {'used' if stats['exchange_done'] else 'not used'}, "
          f"O_DIRECT {'accepted' if scenario.direct else 'refused'}; {time.monotonic() - t0:.1f} s "
          f"({ck.run_s:.1f} s running, {ck.check_s:.1f} s checking)")
