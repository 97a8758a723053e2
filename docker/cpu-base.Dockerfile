# A CPU stand-in for NVIDIA's PyTorch container, so that docker/Dockerfile can be built and run
# where that image cannot be pulled (no GPU, no NVIDIA registry): Debian with Python 3.11, pip and
# a CPU build of torch, installed system-wide as NVIDIA's container has it. No CUDA, no cuFile, no
# KvikIO: docker/README.md lists what differs. scripts/docker_smoke.sh builds it:
#
#   podman build -f docker/cpu-base.Dockerfile --build-arg DEBIAN_IMAGE=<debootstrap image> \
#       --build-context wheels=<directory holding torch's CPU wheel and its dependencies> \
#       -t gdswriter-cpu-base docker/
#
# DEBIAN_IMAGE is any Debian 12 image with python3 and python3-pip (the smoke script imports
# one made with debootstrap; debian:bookworm plus those two packages is the same). Nothing is
# fetched while building: pip reads only the `wheels` build context.
ARG DEBIAN_IMAGE=debian:bookworm
FROM ${DEBIAN_IMAGE}

ARG TORCH_VERSION=2.13.0+cpu

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# NVIDIA's container lets pip install into the system Python; Debian's marker (PEP 668) would
# refuse docker/Dockerfile's `pip install`, so it goes. One layer: torch with its dependencies.
RUN --mount=type=bind,from=wheels,target=/wheels \
    rm -f /usr/lib/python3*/EXTERNALLY-MANAGED \
    && python3 -m pip install --no-cache-dir --no-index --find-links /wheels "torch==${TORCH_VERSION}" \
    && python3 -c 'import torch; assert not torch.cuda.is_available(); print("torch", torch.__version__)'

WORKDIR /workspace
