#!/usr/bin/env bash
# Entry point of the gdswriter image.
#
#   docker run ... gdswriter doctor [DIR...] [--json]   runs `gdswriter doctor` (DIR defaults to
#                                                       $GDSWRITER_DOCTOR_DIR, /ckpt, if it exists)
#   docker run ... gdswriter python3 train.py          runs the command as given
#   docker run -it ... gdswriter bash                  a shell
#
# Either way the command runs under NVIDIA's own entry point when the base image has one (it
# sets up CUDA forward compatibility and prints the container banner), and its exit status is
# the container's.
set -euo pipefail

ngc_entrypoint=${GDSWRITER_NGC_ENTRYPOINT:-/opt/nvidia/nvidia_entrypoint.sh}
doctor_dir=${GDSWRITER_DOCTOR_DIR:-/ckpt}

if [ "$#" -eq 0 ]; then
    set -- bash
fi

if [ "$1" = "doctor" ]; then
    shift
    has_dir=0
    skip_value=0
    for arg in "$@"; do
        if [ "$skip_value" -eq 1 ]; then
            skip_value=0
        elif [ "$arg" = "--test-size" ]; then
            skip_value=1
        elif [ "${arg#-}" = "$arg" ]; then
            has_dir=1
        fi
    done
    if [ "$has_dir" -eq 0 ] && [ -d "$doctor_dir" ]; then
        set -- "$@" "$doctor_dir"
    fi
    set -- gdswriter doctor "$@"
fi

if [ -x "$ngc_entrypoint" ]; then
    exec "$ngc_entrypoint" "$@"
fi
exec "$@"
