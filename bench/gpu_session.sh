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

# Phase 1, memory only, side by side: the validation matrix, every GPU-marked test (and the
# CUDA tests that skip without CUDA), the parallel wrappers over NCCL, 2:4 compression.
( timeout "${VALIDATE_S:-220}" python3 bench/validate_gpu.py --json "$OUT/validate.json" \
    >"$OUT/validate.log" 2>&1; step validate $? ) &
GPU_TESTS=$(grep -rlE "mark\.gpu|cuda\.is_available\(\)" tests | sort)
( timeout "${PYTEST_S:-200}" python3 -m pytest -q -p no:cacheprovider -o addopts="-ra" -m gpu \
    $GPU_TESTS --junitxml="$OUT/pytest-gpu.xml" >"$OUT/pytest.log" 2>&1; step pytest_gpu $?
  timeout 60 python3 -m pytest -q -p no:cacheprovider -o addopts="-ra" -m "not gpu" -k cuda \
    $GPU_TESTS >>"$OUT/pytest.log" 2>&1; step pytest_cuda $? ) &
( timeout "${PARALLEL_S:-150}" python3 bench/parallel_cuda.py --out "$OUT/parallel-cuda.json" \
    >"$OUT/parallel.log" 2>&1; step parallel_cuda $?
  timeout 60 python3 bench/semi_structured.py --out "$OUT/semi-structured.json" \
    >>"$OUT/parallel.log" 2>&1; step semi_structured $?
  timeout 60 python3 bench/semi_structured_training.py --out "$OUT/semi-structured-training.json" \
    >>"$OUT/parallel.log" 2>&1; step semi_structured_training $? ) &
wait
# Phase 2, timed, alone on the GPU.
timeout "${TECH_S:-80}" python3 bench/techniques.py --device cuda --out "$OUT/techniques.json" \
  >>"$LOG" 2>&1
step techniques $?
if [ "${FIT_S:-170}" != 0 ]; then  # FIT_S=0 leaves the fit grid for another call
  timeout "${FIT_S:-170}" python3 bench/fit.py --device cuda --out "$OUT/fit.json" >>"$LOG" 2>&1
  step fit $?
fi
python3 - "$OUT/validate.json" <<'PY' || true
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["results"]:
    print(f'{r["config"]:58s} {100 * (r.get("error_allocated") or 0):+7.2f}% '
          f'{100 * (r.get("error_reserved") or 0):+7.2f}%')
print(d.get("summary"))
PY
tail -25 "$OUT/pytest.log"; cat "$OUT/parallel.log" | grep -v "^\[rank"; tail -70 "$LOG"
