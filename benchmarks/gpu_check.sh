#!/usr/bin/env bash
# The GPU check in one call (the device tool, or any CUDA machine): machine info and the host Adam kernel build,
# the `cuda` tests, the GPU step benchmark (336M GPT: PCIe bandwidth, then plain PyTorch, every chunkmem placement
# and the FSDP2 / torchao offloading peers in fp32 and bf16, as many rows as fit its time), and the host Adam
# benchmark on that machine's CPU. Logs and gpu_step.json go to $OUT (default ./gpu_out), the JSON also to
# benchmarks/results/.
# SECTIONS picks the parts (default machine,cuda,step,adam; the kernel build runs whatever is picked, since the
# other parts need it). Every part is bounded by its own timeout (T_MACHINE, T_BUILD, T_CUDA, T_BENCH, T_ADAM)
# and all of them together by T_TOTAL (default 450 s: 7.5 minutes); the step benchmark gets --total-limit of
# T_BENCH or what is left before the host Adam part, whichever is less. GPU_STEP_ARGS replaces the step
# benchmark's default arguments (--sizes 350m --warmup 2 --steps 4 --limit 60; e.g. "--plan quick").
# CHUNKMEM_COMMIT names the commit measured in the JSON (the device tool's copy of the checkout has a stale .git:
# start the call with CHUNKMEM_COMMIT=<sha>).
# RUN_SUITE=1 also runs the whole suite with the device tier on the GPU: most tests compare bitwise against CPU
# references or build their inputs on the CPU, so expect failures that are the tests', not chunkmem's.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export OUT PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 CHUNKMEM_CACHE_DIR=/tmp/chunkmem-cache
py=python3
SECTIONS=${SECTIONS:-machine,cuda,step,adam}
DEADLINE=$(( SECONDS + ${T_TOTAL:-450} ))
has() { [[ ",$SECTIONS," == *",$1,"* ]]; }
# cap N: N seconds, or what is left before the deadline if less (at least 1)
cap() { local left=$(( DEADLINE - SECONDS )); (( left < 1 )) && left=1; echo $(( $1 < left ? $1 : left )); }

if has machine; then
  timeout $(cap ${T_MACHINE:-30}) bash -c "nvidia-smi -L; $py -c 'import torch; print(torch.__version__, torch.cuda.get_device_name())'; nproc" 2>&1 | tee "$OUT/machine.log"
fi
# build the host kernel once, before anything races for it
timeout $(cap ${T_BUILD:-90}) $py -c 'from chunkmem.optim import host_adam_ext as h; print("host adam kernel:", h.kernel() and "built" or h.load_error())' 2>&1 | tee -a "$OUT/machine.log"
if has cuda; then
  timeout $(cap ${T_CUDA:-120}) $py -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda.py -rfE 2>&1 | tee "$OUT/cuda_tests.log" | tail -25
fi
if has step; then
  reserve=10; has adam && reserve=$(( reserve + ${T_ADAM:-40} ))
  limit=$(( DEADLINE - SECONDS - reserve )); (( limit > ${T_BENCH:-330} )) && limit=${T_BENCH:-330}
  if (( limit < 60 )); then
    echo "gpu_step.py: not started, ${limit} s left for it" | tee "$OUT/gpu_step.log"
  else
    # the script ends its rows within --total-limit; the timeout is the backstop
    timeout $(( limit + 10 )) $py benchmarks/gpu_step.py --total-limit $limit \
      ${GPU_STEP_ARGS:---sizes 350m --warmup 2 --steps 4 --limit 60} 2>"$OUT/gpu_step.err" | tee "$OUT/gpu_step.log"
  fi
fi
if has adam; then
  timeout $(cap ${T_ADAM:-40}) $py benchmarks/host_adam.py --no-compile --rounds 5 --no-fail 2>&1 | tee "$OUT/host_adam.log" | tail -15
fi
if [ "${RUN_SUITE:-0}" = 1 ]; then
  timeout ${T_SUITE:-300} $py -m pytest -q -p no:cacheprovider -n ${WORKERS:-12} tests -rfE --timeout 100 > "$OUT/suite.log" 2>&1
  echo "suite rc $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/suite.log" | tail -8
fi
