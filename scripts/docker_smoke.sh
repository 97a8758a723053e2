#!/usr/bin/env bash
# The image of docker/Dockerfile, built and run with podman on a CPU base (docker/README.md), then
# used as a user would: `gdswriter doctor` and a save/load inside the container, the checkpoint
# directory mounted from the host, and the step verified from the host (`gdswriter verify`).
#
#   bash scripts/docker_smoke.sh      as root, with podman, runc and debootstrap
#                                     (Debian: apt-get install podman runc debootstrap)
#
# Exit status 0: passed; 77: skipped, with the reason on stderr (no podman, not root...); other: failed.
# Settings (environment):
#   GDSWRITER_DOCKER_CACHE   the debootstrap root, torch's wheel house (default /var/tmp/gdswriter-docker)
#   GDSWRITER_DOCKER_CKPT    the host's checkpoint directory (default: a new one, removed after a pass)
#   GDSWRITER_DOCKER_REBUILD 1: build the Debian and CPU torch base images again (else reused by tag)
#   GDSWRITER_HOST_PYTHON    the host Python that verifies (default .venv/bin/python, else python3)
# The base images are built once per machine (about 4 minutes in all with them: debootstrap, torch);
# the gdswriter image on every run, since it is what is under test (podman reuses the layers of
# an unchanged checkout: about 30 s in all then).
set -euo pipefail
cd "$(dirname "$0")/.."

cache=${GDSWRITER_DOCKER_CACHE:-/var/tmp/gdswriter-docker}
torch_version=2.13.0+cpu
debian_image=localhost/gdswriter-debian:bookworm
base_image=localhost/gdswriter-cpu-base:${torch_version/+/-}
image=localhost/gdswriter:cpu-smoke
debian_mirror=${GDSWRITER_DEBIAN_MIRROR:-http://deb.debian.org/debian}

skip() { echo "docker smoke: SKIPPED: $*" >&2; exit 77; }
step() { echo "docker smoke: $*" >&2; }

command -v podman >/dev/null 2>&1 || skip "podman is not installed (apt-get install podman runc debootstrap)"
[ "$(id -u)" -eq 0 ] || skip "needs root (rootful podman; debootstrap)"
[ -x /usr/sbin/runc ] || skip "runc is not installed at /usr/sbin/runc (apt-get install runc)"

# crun fails on this kernel's hybrid cgroups: runc, with cgroupfs. The nofile/nproc limits are
# ones the sandbox allows (podman's defaults are refused here).
podman=(podman --runtime /usr/sbin/runc --cgroup-manager=cgroupfs)
limits=(--ulimit nofile=20000:20000 --ulimit nproc=1024:1024)

host_python=${GDSWRITER_HOST_PYTHON:-}
if [ -z "$host_python" ]; then
    if [ -x .venv/bin/python ]; then host_python=.venv/bin/python; else host_python=python3; fi
fi

mkdir -p "$cache"
if [ "${GDSWRITER_DOCKER_REBUILD:-0}" = 1 ]; then
    "${podman[@]}" rmi -f "$image" "$base_image" "$debian_image" >/dev/null 2>&1 || true
fi

# 1. Debian 12 with Python 3.11 and pip, from Debian's packages (nothing pulled from a registry).
if ! "${podman[@]}" image exists "$debian_image"; then
    command -v debootstrap >/dev/null 2>&1 || skip "debootstrap is not installed (apt-get install debootstrap)"
    step "debootstrap bookworm -> $debian_image"
    rm -rf "$cache/rootfs"
    debootstrap --variant=minbase --include=python3,python3-pip,ca-certificates \
        bookworm "$cache/rootfs" "$debian_mirror" >"$cache/debootstrap.log" 2>&1 \
        || { tail -20 "$cache/debootstrap.log" >&2; exit 1; }
    rm -rf "$cache/rootfs/var/cache/apt/archives/"*.deb "$cache/rootfs/var/lib/apt/lists/"*
    tar -C "$cache/rootfs" -c . | "${podman[@]}" import --change 'CMD ["/bin/bash"]' - "$debian_image" >/dev/null
    rm -rf "$cache/rootfs"
fi

# 2. NVIDIA's PyTorch container's CPU stand-in: torch's CPU wheel from pip's own configuration
# (here a find-links directory on the local disk; PyPI's torch of the same version is a CUDA
# build), its dependencies with it, handed to the build as a build context: built offline.
if ! "${podman[@]}" image exists "$base_image"; then
    step "torch $torch_version wheel house -> $cache/wheels"
    rm -rf "$cache/wheels"
    "$host_python" -m pip download -q --only-binary=:all: --python-version 3.11 --implementation cp \
        --abi cp311 --platform manylinux_2_28_x86_64 -d "$cache/wheels" "torch==$torch_version" 2>/dev/null
    ls "$cache/wheels"/torch-*+cpu-*.whl >/dev/null \
        || { echo "docker smoke: pip found no CPU wheel of torch $torch_version" >&2; exit 1; }
    step "build $base_image (docker/cpu-base.Dockerfile)"
    "${podman[@]}" build -q --format docker "${limits[@]}" --network none -f docker/cpu-base.Dockerfile \
        --build-arg "DEBIAN_IMAGE=$debian_image" --build-arg "TORCH_VERSION=$torch_version" \
        --build-context "wheels=$cache/wheels" -t "$base_image" docker/ >/dev/null
fi

# 3. The image under test: docker/Dockerfile as it is, on the CPU base, without the GDS extra.
# apt and pip fetch over the network as with NVIDIA's base. The host's CA bundle is mounted for
# the build's RUN steps only (never into a layer): this machine's network re-signs TLS.
step "build $image (docker/Dockerfile, BASE_IMAGE=$base_image, GDS_EXTRA=)"
ca=()
[ -f /etc/ssl/certs/ca-certificates.crt ] && ca=(-v /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro)
"${podman[@]}" build -q --format docker "${limits[@]}" "${ca[@]}" -f docker/Dockerfile \
    --ignorefile docker/Dockerfile.dockerignore --build-arg "BASE_IMAGE=$base_image" --build-arg GDS_EXTRA= \
    -t "$image" . >/dev/null

ckpt=${GDSWRITER_DOCKER_CKPT:-}
remove_ckpt=0
if [ -z "$ckpt" ]; then
    ckpt=$(mktemp -d "$cache/ckpt.XXXXXX")
    remove_ckpt=1
fi
mkdir -p "$ckpt"
ckpt=$(cd "$ckpt" && pwd)
# As docker/README.md runs it, less the GPU flags: seccomp=unconfined lets io_uring through
# (podman's default profile answers ENOSYS); memlock is left at the sandbox's own limit.
run=("${podman[@]}" run --rm "${limits[@]}" --security-opt seccomp=unconfined -v "$ckpt:/ckpt" "$image")

step "gdswriter doctor (in the container, /ckpt = $ckpt)"
"${run[@]}" doctor

# A save and a load through the image's entry point: 4 MiB weights (above every small-copy
# threshold), AdamW's state, a plain value; loaded into fresh objects and compared bit for bit.
# The last line carries the saved tensors' sha256, for a check from the host.
step "save and load (in the container)"
"${run[@]}" python3 -c '
import hashlib, json, torch
from gdswriter import GDSCheckpointer

def make():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

model, opt = make()
model(torch.randn(16, 1024)).square().mean().backward()
opt.step()
data = {"epoch": 3, "batch": 41}
with GDSCheckpointer(model, opt, root="/ckpt/run", state={"data": data}) as ck:
    ck.save(7)
fresh, fresh_opt = make()
fresh_data = {"epoch": 0, "batch": 0}
with GDSCheckpointer(fresh, fresh_opt, root="/ckpt/run", state={"data": fresh_data}) as ck:
    assert ck.load() == 7
for name, t in model.state_dict().items():
    assert torch.equal(fresh.state_dict()[name], t), name
for p, q in zip(model.parameters(), fresh.parameters()):
    for k in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(opt.state[p][k], fresh_opt.state[q][k]), k
assert fresh_data == data, fresh_data
sums = {k: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        for k, t in model.state_dict().items()}
print("saved and loaded step 7 bit for bit")
print("GDSWRITER_SMOKE " + json.dumps({"step": 7, "model_sha256": sums}))
'

step "gdswriter verify (on the host: $host_python)"
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$host_python" -m gdswriter.cli verify "$ckpt/run"

if [ "$remove_ckpt" = 1 ]; then
    rm -rf "$ckpt"
fi
step "passed"
