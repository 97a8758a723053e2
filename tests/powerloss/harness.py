"""The test side of the power-loss file system: start it, mount it, cut the power, unmount it.

``PowerLossMount`` runs ``python -m powerloss.fs`` in its own process and always takes the
mount down again (``fusermount3 -u``, then a lazy unmount and an abort of the FUSE
connection if the process does not answer, then SIGKILL), so that a failing or timed-out
test leaves no mount and no process behind. The file-system process also dies with its
parent (PR_SET_PDEATHSIG), which unmounts it.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
INSTALL_HINT = ("install them with `apt-get install -y fuse3 libfuse3-3` and `pip install -e '.[test]'` "
                "(.ci/run does both)")


def fuse_unavailable() -> str | None:
    """Why FUSE cannot work on this machine at all (a reason to skip), or None."""
    if not sys.platform.startswith("linux"):
        return "FUSE power-loss tests need Linux"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse on this machine (FUSE is not available, e.g. in this container)"
    if os.geteuid() != 0:
        return "the power-loss tests mount FUSE file systems and must run as root"
    try:
        os.close(os.open("/dev/fuse", os.O_RDWR))
    except OSError as e:
        return f"/dev/fuse cannot be opened ({e.strerror}): FUSE is not usable here"
    return None


def setup_problem() -> str | None:
    """What is missing that the project's set-up installs (a failure, not a skip), or None."""
    missing = []
    if shutil.which("fusermount3") is None:
        missing.append("fusermount3 (Debian package fuse3)")
    try:
        import mfusepy  # noqa: F401  (loads libfuse at import)
    except (ImportError, OSError) as e:
        missing.append(f"mfusepy with libfuse 3 ({type(e).__name__}: {e})")
    return f"missing {', '.join(missing)}: {INSTALL_HINT}" if missing else None


def mount_refused(workdir: Path) -> str | None:
    """Mount and unmount an empty power-loss file system under ``workdir``: why the kernel
    refuses FUSE mounts here (e.g. a container without CAP_SYS_ADMIN), or None. Any other
    failure is raised: it is a bug, not a reason to skip."""
    fs = PowerLossMount(workdir / "mnt", workdir / "fs")
    try:
        fs.start()
    except RuntimeError:
        log = fs.fs_log()
        if "not permitted" in log or "Permission denied" in log:
            return f"FUSE mounts are refused here: {log.strip().splitlines()[-1]}"
        raise
    fs.unmount()
    return None


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for helper processes: the caller's PYTHONPATH first (so that a scratch
    copy of gdswriter given there is the one imported), then tests/ and the repository."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p] + [str(TESTS), str(REPO)]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths), **extra)


def is_mounted(mountpoint: Path) -> bool:
    """From /proc/self/mountinfo: os.path.ismount stats the mount, which a dead or
    powered-off file system answers with an error (and ismount with False)."""
    where = os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(mountpoint))),
                         os.path.basename(os.path.abspath(mountpoint)))
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4]
            for esc, ch in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
                point = point.replace(esc, ch)
            if point == where:
                return True
    return False


def force_unmount(mountpoint: Path) -> None:
    """Take a FUSE mount down whatever state its server is in (no-op when not mounted)."""
    if not is_mounted(mountpoint):
        return
    for cmd in (["fusermount3", "-u", str(mountpoint)], ["fusermount3", "-uz", str(mountpoint)],
                ["umount", "-l", str(mountpoint)]):
        if cmd[1] == "-uz":  # the polite unmount failed: abort the connection so nothing can hang on it
            _abort_connection(mountpoint)
        subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30, check=False)
        if not is_mounted(mountpoint):
            return


def _abort_connection(mountpoint: Path) -> None:
    try:
        minor = os.minor(os.stat(mountpoint).st_dev)
        Path(f"/sys/fs/fuse/connections/{minor}/abort").write_text("1")
    except OSError:
        pass


class PowerLossMount:
    """One power-loss file-system process mounted at ``mountpoint``.

    ``image``: a durable image to start from (None: empty; a list: served in turn, see
    ``next_image``). ``workdir`` receives the control
    socket, the process's log, cut.json and the images of a cut (``images()``)."""

    def __init__(self, mountpoint: Path, workdir: Path, *, image: Path | list[Path] | None = None,
                 variants: str = "none", no_direct: bool = False, no_exchange: bool = False,
                 cut_after_syncs: int | None = None, cut_after_ops: int | None = None):
        self.mountpoint, self.workdir = Path(mountpoint), Path(workdir)
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.socket = self.workdir / "control.sock"
        self.args = [sys.executable, "-m", "powerloss.fs", str(self.mountpoint), "--out", str(self.workdir),
                     "--control", str(self.socket), "--variants", variants]
        for p in [] if image is None else image if isinstance(image, list) else [image]:
            self.args += ["--image", str(p)]
        if no_direct:
            self.args.append("--no-direct")
        if no_exchange:
            self.args.append("--no-exchange")
        if cut_after_syncs is not None:
            self.args += ["--cut-after-syncs", str(cut_after_syncs)]
        if cut_after_ops is not None:
            self.args += ["--cut-after-ops", str(cut_after_ops)]
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> PowerLossMount:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.unmount()

    def start(self, timeout: float = 30.0) -> None:
        if is_mounted(self.mountpoint):
            raise RuntimeError(f"{self.mountpoint} is already a mount point")
        self._log = open(self.workdir / "fs.log", "ab")  # noqa: SIM115 (the mount's log: closed in unmount)
        self.proc = subprocess.Popen(self.args, env=subprocess_env(), stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not (is_mounted(self.mountpoint) and self.socket.exists()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.unmount()
                raise RuntimeError(f"the power-loss file system did not mount at {self.mountpoint}: "
                                   f"{self.fs_log()[-3000:]}")
            time.sleep(0.005)

    def next_image(self, index: int, timeout: float = 30.0) -> None:
        """Unmount, and wait until the process serves image ``index`` of its list at the same place."""
        self.control("next")
        # one plain unmount: force_unmount would take the next image down again if it came up fast
        subprocess.run(["fusermount3", "-u", str(self.mountpoint)], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=30, check=False)
        deadline = time.monotonic() + timeout
        while True:
            if is_mounted(self.mountpoint):
                with contextlib.suppress(OSError):
                    if self.control("ping").get("image") == index:
                        return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the power-loss file system did not mount image {index}: {self.fs_log()[-3000:]}")
            time.sleep(0.005)

    def fs_log(self) -> str:
        try:
            return (self.workdir / "fs.log").read_text(errors="replace")
        except OSError:
            return ""

    def control(self, command: str, timeout: float = 30.0) -> dict:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(str(self.socket))
            s.sendall(command.encode() + b"\n")
            buf = b""
            while not buf.endswith(b"\n"):
                chunk = s.recv(1 << 20)
                if not chunk:
                    break
                buf += chunk
        reply = json.loads(buf)
        if not reply.get("ok"):
            raise RuntimeError(f"power-loss fs refused {command!r}: {reply.get('error')}")
        return reply

    def cut(self, variants: str | None = None) -> dict:
        return self.control("cut" + (f" {variants}" if variants else ""))

    def arm(self, unit: str, n: int, variants: str | None = None) -> None:
        self.control(f"arm {unit} {n}" + (f" {variants}" if variants else ""))

    def stats(self) -> dict:
        return self.control("stats")

    def oplog(self) -> list[list]:
        return self.control("log")["log"]

    def cut_result(self) -> dict | None:
        """cut.json of this mount's power cut: {"ops", "syncs", "refused", "images": {digest: names}, "pending"}."""
        p = self.workdir / "cut.json"
        return json.loads(p.read_text()) if p.exists() else None

    def image_path(self, digest: str) -> Path:
        return self.workdir / f"{digest}.img"

    def clean_image(self) -> Path:
        """After a clean unmount: the image holding everything (a clean shutdown syncs)."""
        return self.workdir / "clean.img"

    def unmount(self, timeout: float = 30.0) -> None:
        """Unmount and wait for the process; escalate as needed. Idempotent."""
        try:
            force_unmount(self.mountpoint)
            if self.proc is not None:
                try:
                    self.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout)
        finally:
            if self.proc is not None and self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            force_unmount(self.mountpoint)
            if getattr(self, "_log", None) is not None:
                self._log.close()
                self._log = None


class AppServer:
    """The fork server of powerloss.app: imports torch and gdswriter once, runs each job in a
    fresh child. ``run`` returns the child's exit status; a child that outlives ``timeout``
    is killed (and the test then fails on its status)."""

    def __init__(self, log_path: Path, timeout: float = 180.0):
        self._log = open(log_path, "ab")  # noqa: SIM115 (the app's log: closed in close)
        self.proc = subprocess.Popen([sys.executable, "-m", "powerloss.app"], env=subprocess_env(),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log)
        self._buf = b""
        try:
            self.gdswriter_file = self._read(timeout)["gdswriter"]
        except BaseException:
            self.close()
            raise

    def _read(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError(f"the application server said nothing for {timeout:.0f} s")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"the application server died (status {self.proc.wait()})")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def run(self, job: dict, *, timeout: float = 180.0, on_start=None) -> int:
        self.proc.stdin.write((json.dumps(job) + "\n").encode())
        self.proc.stdin.flush()
        pid = self._read(60)["pid"]
        if on_start is not None:
            on_start()
        try:
            return self._read(timeout)["exit"]
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            self._read(60)
            raise

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def require_fuse(probe_dir: Path) -> None:
    """For a test's fixture: pytest.skip where FUSE cannot work at all (no /dev/fuse, not root, a
    mount refused in ``probe_dir``), pytest.fail where only the project's set-up is missing."""
    import pytest

    why = fuse_unavailable()
    if why:
        pytest.skip(why)
    problem = setup_problem()
    if problem:
        pytest.fail(problem)
    why = mount_refused(probe_dir)
    if why:
        pytest.skip(why)
