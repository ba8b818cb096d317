#!/usr/bin/env bash
# The README Status list's GPU checks as one script, for a session lent a GPU (device tool):
#   bash bench/gpu_session.sh OUTDIR
# Memory-only checks run side by side (each process has its own allocator statistics and NVML
# reads per process); the timing benches run afterwards, alone on the GPU. Each step has its own
# time limit so the whole script ends inside one device call; results are written as they come.
set -u
OUT=${1:?usage: bench/gpu_session.sh OUTDIR}
. bench/gpu_env.sh
{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda)"
  for m in torchao bitsandbytes liger_kernel transformers peft; do
    python3 -c "import $m; print('$m', getattr($m, '__version__', '?'))" 2>&1 | tail -1
  done
} >"$LOG" 2>&1

timeout "${FACTS_S:-60}" python3 bench/cuda_facts.py --out "$OUT/cuda-facts.json" >>"$LOG" 2>&1
step cuda_facts $?
# Phase 1, memory only, side by side: the validation matrix and the GPU-marked tests.
( timeout "${VALIDATE_S:-240}" python3 bench/validate_gpu.py --json "$OUT/validate.json" \
    >"$OUT/validate.log" 2>&1; step validate $? ) &
( timeout "${PYTEST_S:-200}" python3 -m pytest -q -p no:cacheprovider -m gpu -o addopts="-ra" \
    tests/fitting/test_batch_size.py tests/guard/test_guard.py tests/profiling/test_profile.py \
    tests/profiling/test_profile_peak.py tests/techniques/test_tech_allocator.py \
    tests/techniques/test_tech_loss.py tests/techniques/test_tech_optim.py \
    tests/techniques/test_tech_precision.py tests/techniques/test_tech_quant.py \
    tests/techniques/test_tech_offload.py >"$OUT/pytest.log" 2>&1; step pytest $? ) &
wait
# The CUDA offload test is not marked gpu (it skips without CUDA): run it too.
timeout 40 python3 -m pytest -q -p no:cacheprovider -o addopts="-ra" \
  tests/techniques/test_tech_offload.py -k cuda >>"$OUT/pytest.log" 2>&1
step pytest_offload $?
# Phase 2, timed, alone on the GPU.
timeout "${TECH_S:-130}" python3 bench/techniques.py --device cuda --out "$OUT/techniques.json" \
  >>"$LOG" 2>&1
step techniques $?
timeout "${FIT_S:-110}" python3 bench/fit.py --device cuda --out "$OUT/fit.json" >>"$LOG" 2>&1
step fit $?
tail -40 "$OUT/validate.log"; tail -15 "$OUT/pytest.log"; tail -60 "$LOG"
