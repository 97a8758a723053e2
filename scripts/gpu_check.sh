#!/usr/bin/env bash
# GPU checks for a CUDA machine (e.g. the device tool's H200): the GPU tests, a short
# save/load benchmark of a CUDA-resident model, and the training-loop overlap benchmark
# (checkpoint every iteration; GDSWRITER_TRAINING_SIZE, default 1G). A few minutes. Output
# also lands in $OUT if set.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-.gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# Use the machine's torch (CUDA build); install only our pure-Python deps.
python3 -m pip install -q --no-deps -e . 2>&1 | tail -2
python3 -c "import crc32c" 2>/dev/null || python3 -m pip install -q crc32c
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -m pytest -q -m gpu tests/test_gpu.py tests/test_overlap_gpu.py 2>&1 | tee "$OUT/gpu-tests.log"
GDSWRITER_BENCH_SIZES=${GDSWRITER_BENCH_SIZES:-4G} python3 - <<'PY' 2>&1 | tee "$OUT/gpu-bench.txt"
import os, time, tempfile, torch
from gdswriter import GDSCheckpointer
from gdswriter.options import _env_int
size = _env_int("GDSWRITER_BENCH_SIZES", os.environ["GDSWRITER_BENCH_SIZES"].split(",")[0])
n_layers = max(1, size // (64 << 20))
model = torch.nn.ModuleList(torch.nn.Linear(4096, 4096, bias=False) for _ in range(n_layers)).cuda()
nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
d = tempfile.mkdtemp(dir=os.getcwd())
with GDSCheckpointer(model, None, root=d) as ck:
    torch.cuda.synchronize(); t = time.perf_counter(); ck.save(1); dt = time.perf_counter() - t
    print(f"gdswriter save (CUDA model, {ck.engine_info.name}): {nbytes/dt/1e9:.2f} GB/s ({nbytes/2**30:.1f} GiB)")
    os.system("sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null")
    t = time.perf_counter(); ck.load(); torch.cuda.synchronize(); dt = time.perf_counter() - t
    print(f"gdswriter load (cold): {nbytes/dt/1e9:.2f} GB/s")
p = os.path.join(d, "ref.pt")
t = time.perf_counter()
with open(p, "wb") as f:
    torch.save(model.state_dict(), f); f.flush(); os.fsync(f.fileno())
dt = time.perf_counter() - t
print(f"torch.save + fsync: {nbytes/dt/1e9:.2f} GB/s")
os.system(f"rm -rf {d}")
PY
python3 benchmarks/training_loop.py --device cuda --size "${GDSWRITER_TRAINING_SIZE:-1G}" --iters 20 --rounds 4 \
  --dir "$PWD" 2>&1 | tee "$OUT/training-loop.txt"
