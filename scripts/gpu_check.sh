#!/usr/bin/env bash
# The GPU verification run: the one script a session with a device runs (about 6 minutes on an
# H200, and up to 6 more for the FastPersist section). Sections are independent, each under its
# own timeout; each prints a header, and a summary at the end lists every section's exit status.
# Logs and JSON land in $OUT.
#
#   OUT=/some/dir bash scripts/gpu_check.sh
#
# No network there: KvikIO and other wheels missing from the image are carried in .whl/ at
# the repository root (kvikio-cu13, libkvikio-cu13, rapids-logger, crc32c; pytest and its
# dependencies if the image lacks them) and installed with --no-index into /tmp/site. gdswriter
# itself is imported from this checkout (PYTHONPATH), not installed.
#
# Exit status: 0 when every section that ran passed (on a machine without CUDA the GPU
# sections are skipped with "no CUDA device" and the script still exits 0); otherwise the
# number of failed sections.
#
# Knobs: GDS_BENCH_SIZE (8G), GDS_BENCH_BUDGET (seconds for the benchmark, 150),
# GDS_BENCH_DIR (.bench-tmp/gpu-check), GDS_DOCTOR_TEST_SIZE (256M), GDS_TESTS_TIMEOUT (180),
# GDSWRITER_TRAINING_SIZE (state size of the training-loop benchmark, 1G), GDS_FASTPERSIST_COUNTS
# (64@2G,10000,100000), GDS_FASTPERSIST_ROUNDS (2), GDS_FASTPERSIST_TIMEOUT (360).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-.gpu-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
BENCH_DIR=${GDS_BENCH_DIR:-$PWD/.bench-tmp/gpu-check}
PY=${PYTHON:-python3}
SECONDS=0
declare -a SUMMARY=()
FAILED=0

section() { echo; echo "=== $1  [t=${SECONDS}s]"; }

# run NAME TIMEOUT CMD...: runs CMD under a timeout, tees its output to $OUT/NAME.log, records the result.
run() {
    local name=$1 limit=$2 rc
    shift 2
    timeout --kill-after=15 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    rc=${PIPESTATUS[0]}
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        echo "!!! $name: timed out after ${limit}s"
    fi
    if [ "$rc" -ne 0 ]; then
        FAILED=$((FAILED + 1))
    fi
    SUMMARY+=("$(printf '%-12s exit %-3s (%ss)' "$name" "$rc" "$SECONDS")")
    return 0
}

skip() { SUMMARY+=("$(printf '%-12s skipped: %s' "$1" "$2")"); echo "--- $1 skipped: $2"; }

section "environment"
{
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,pci.bus_id,memory.total,driver_version --format=csv,noheader 2>&1
    else
        echo "no nvidia-smi"
    fi
    echo "kernel $(uname -r), $(nproc) cpus, memlock $(ulimit -l), io_uring_disabled $(cat /proc/sys/kernel/io_uring_disabled 2>&1)"
    echo "nvidia-fs: $(head -1 /proc/driver/nvidia-fs/version 2>/dev/null) $(compgen -G '/dev/nvidia-fs*' | head -1)"
    echo "cufile.json: ${CUFILE_ENV_PATH_JSON:-/etc/cufile.json}; tools: $(command -v gdsio fio 2>/dev/null | tr '\n' ' ')"
} 2>&1 | tee "$OUT/environment.txt"

HAS_CUDA=0
if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    HAS_CUDA=1
else
    echo "no CUDA device: the GPU tests and the benchmark are skipped"
fi

section "install carried wheels"
if [ "$HAS_CUDA" -eq 0 ]; then
    skip install "no CUDA device (the carried wheels are for the GPU machine)"
elif compgen -G ".whl/*.whl" >/dev/null; then
    run install 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
else
    skip install "no .whl/ directory with wheels"
fi
"$PY" - <<'PY' 2>&1 | tee -a "$OUT/environment.txt"
import importlib
for name in ("torch", "crc32c", "numpy", "pytest", "kvikio", "cupy", "pynvml", "safetensors"):
    try:
        m = importlib.import_module(name)
        print(f"  {name:<12} {getattr(m, '__version__', '?')}")
    except Exception as e:  # noqa: BLE001
        print(f"  {name:<12} MISSING ({type(e).__name__}: {str(e)[:100]})")
import torch
print("  torch.cuda", torch.version.cuda, "available:", torch.cuda.is_available())
PY

mkdir -p "$BENCH_DIR"

section "gdswriter doctor"
run doctor 120 "$PY" -m gdswriter.cli doctor "$BENCH_DIR" --test-size "${GDS_DOCTOR_TEST_SIZE:-256M}"
"$PY" -m gdswriter.cli doctor "$BENCH_DIR" --json --no-io-test >"$OUT/doctor.json" 2>/dev/null || true

section "gdswriter topology"
if "$PY" -m gdswriter.cli topology --help >/dev/null 2>&1; then
    run topology 60 "$PY" -m gdswriter.cli topology
else
    skip topology "this checkout has no 'gdswriter topology'"
fi

section "GPU tests (pytest -m gpu)"
if [ "$HAS_CUDA" -eq 0 ]; then
    skip gpu-tests "no CUDA device"
elif ! "$PY" -c "import pytest" 2>/dev/null; then
    skip gpu-tests "pytest is not installed: carry its wheels in .whl/ (pytest, pluggy, iniconfig, packaging)"
    FAILED=$((FAILED + 1))
else
    run gpu-tests "${GDS_TESTS_TIMEOUT:-180}" "$PY" -m pytest -q -m gpu -p no:cacheprovider -rs \
        --junitxml="$OUT/gpu-tests.xml" tests/test_gpu.py tests/test_gpu_checksum.py tests/test_engine_contract.py \
        tests/test_gds_engine.py tests/test_overlap_gpu.py tests/test_topology.py tests/test_dist_gpu.py
fi

section "benchmark: durable save + cold load of GPU tensors"
if [ "$HAS_CUDA" -eq 0 ]; then
    skip bench "no CUDA device"
else
    budget=${GDS_BENCH_BUDGET:-150}
    run bench $((budget + 45)) "$PY" scripts/gds_bench.py --dir "$BENCH_DIR" --size "${GDS_BENCH_SIZE:-8G}" \
        --time-budget "$budget" --json "$OUT/bench.json"
fi

section "training loop: checkpoint every iteration (CUDA model)"
if [ "$HAS_CUDA" -eq 0 ]; then
    skip training "no CUDA device"
else
    run training 240 "$PY" benchmarks/training_loop.py --device cuda --size "${GDSWRITER_TRAINING_SIZE:-1G}" \
        --iters 20 --rounds 4 --dir "$BENCH_DIR" \
        --cases "none,gdswriter live,gdswriter host,torch.save thread,dcp.async_save,copy+crc only"
fi

section "many tensors beside DeepSpeed FastPersist, from GPU tensors"
# FastPersist's own setting: torch.save of CUDA tensors into its FastFileWriter (libaio, O_DIRECT);
# gdswriter and torch.save+fsync in the same interleaved rounds, with the disk's ceiling. Without
# DeepSpeed (or libaio-dev for its async_io op, which JIT-compiles on first use) the table says
# "skipped deepspeed: <why>" and the other cases still run.
if [ "$HAS_CUDA" -eq 0 ]; then
    skip fastpersist "no CUDA device"
else
    run fastpersist "${GDS_FASTPERSIST_TIMEOUT:-360}" "$PY" benchmarks/tensor_counts.py --device cuda \
        --counts "${GDS_FASTPERSIST_COUNTS:-64@2G,10000,100000}" --size 256M --rounds "${GDS_FASTPERSIST_ROUNDS:-2}" \
        --compare deepspeed,torch --dir "$BENCH_DIR" --json
fi

rm -rf "$BENCH_DIR"

section "summary  (total ${SECONDS}s; logs in $OUT)"
printf '  %s\n' "${SUMMARY[@]}" | tee "$OUT/summary.txt"
exit "$FAILED"
