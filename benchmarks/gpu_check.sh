#!/usr/bin/env bash
# The GPU check in one call (the device tool, or any CUDA machine): the `cuda` tests, the GPU step benchmark
# (336M GPT, every placement against plain PyTorch; about 150 s on an H100), and the host Adam benchmark on that
# machine's CPU. Logs go to $OUT (default ./gpu_out); every part is bounded by its own timeout.
# RUN_SUITE=1 also runs the whole suite with the device tier on the GPU: most tests compare bitwise against CPU
# references or build their inputs on the CPU, so expect failures that are the tests', not chunkmem's.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CHUNKMEM_CACHE_DIR=/tmp/chunkmem-cache
py=python3
{ nvidia-smi -L; $py -c 'import torch; print(torch.__version__, torch.cuda.get_device_name())'; nproc; } 2>&1 | tee "$OUT/machine.log"
# build the host kernel once, before anything races for it
$py -c 'from chunkmem.optim import host_adam_ext as h; print("host adam kernel:", h.kernel() and "built" or h.load_error())' 2>&1 | tee -a "$OUT/machine.log"
timeout ${T_CUDA:-120} $py -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda.py -rfE 2>&1 | tee "$OUT/cuda_tests.log" | tail -25
timeout ${T_BENCH:-240} $py benchmarks/gpu_step.py ${GPU_STEP_ARGS:---sizes 350m --warmup 2 --steps 5 --limit 40} 2>"$OUT/gpu_step.err" | tee "$OUT/gpu_step.log"
timeout ${T_ADAM:-40} $py benchmarks/host_adam.py --no-compile --rounds 5 --no-fail 2>&1 | tee "$OUT/host_adam.log" | tail -15
if [ "${RUN_SUITE:-0}" = 1 ]; then
  timeout ${T_SUITE:-300} $py -m pytest -q -p no:cacheprovider -n ${WORKERS:-12} tests -rfE --timeout 100 > "$OUT/suite.log" 2>&1
  echo "suite rc $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/suite.log" | tail -8
fi
