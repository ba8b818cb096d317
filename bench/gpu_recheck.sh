#!/usr/bin/env bash
# A GPU session's second call (after bench/gpu_session.sh found something): the validation matrix
# again, the anatomy of the configs still off (bench/cuda_peak_anatomy.py) and the CUDA tests
# named in $TESTS side by side (memory only), then bench/fit.py alone (timed).
#   CONFIGS="llama/fp32/sgd-momentum/ckpt-full/b8 ..." TESTS="tests/x.py::y" bash bench/gpu_recheck.sh OUTDIR
set -u
OUT=${1:?usage: bench/gpu_recheck.sh OUTDIR}
. bench/gpu_env.sh
( timeout "${VALIDATE_S:-200}" python3 bench/validate_gpu.py --json "$OUT/validate.json" \
    >"$OUT/validate.log" 2>&1; step validate $? ) &
( timeout "${ANATOMY_S:-200}" python3 bench/cuda_peak_anatomy.py ${CONFIGS:-} \
    --out "$OUT/anatomy.json" >"$OUT/anatomy.log" 2>&1; step anatomy $?
  timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts="-ra" ${TESTS:-} \
    >>"$LOG" 2>&1; step pytest $? ) &
wait
timeout "${FIT_S:-150}" python3 bench/fit.py --device cuda --out "$OUT/fit.json" >>"$LOG" 2>&1
step fit $?
python3 - "$OUT/validate.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["results"]:
    print(f'{r["config"]:58s} {100 * r["error_allocated"]:+7.2f}% {100 * (r["error_reserved"] or 0):+7.2f}%')
print(d["summary"])
PY
cat "$OUT/anatomy.log"; tail -40 "$LOG"
