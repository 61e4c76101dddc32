#!/usr/bin/env bash
# The GPU check in one call (device tool, or any CUDA machine): the `cuda` tests, the GPU step benchmark,
# the host Adam benchmark on that machine's CPU, then the whole suite with the device tier on the GPU.
# Logs go to $OUT (default ./gpu_out). Every part is bounded by its own timeout.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CHUNKMEM_CACHE_DIR=/tmp/chunkmem-cache
py=python3
{ nvidia-smi -L; $py -c 'import torch; print(torch.__version__, torch.cuda.get_device_name())'; nproc; } 2>&1 | tee "$OUT/machine.log"
# build the host Adam kernel once, before pytest's workers race for it
$py -c 'from chunkmem.optim import host_adam_ext as h; print("host adam kernel:", h.kernel() and "built" or h.load_error())' 2>&1 | tee -a "$OUT/machine.log"
timeout ${T_CUDA:-120} $py -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda.py -rfE 2>&1 | tee "$OUT/cuda_tests.log" | tail -25
timeout ${T_BENCH:-170} $py benchmarks/gpu_step.py ${GPU_STEP_ARGS:-} 2>&1 | tee "$OUT/gpu_step.log" | tail -40
timeout ${T_ADAM:-40} $py benchmarks/host_adam.py --no-compile --rounds 5 --no-fail 2>&1 | tee "$OUT/host_adam.log" | tail -15
timeout ${T_SUITE:-150} $py -m pytest -q -p no:cacheprovider -n ${WORKERS:-12} tests -rfE --timeout 100 2>&1 > "$OUT/suite.log"
echo "suite rc $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/suite.log" | tail -8
