# Sourced by bench/gpu_session.sh and bench/gpu_recheck.sh (OUT set): the environment of a lent
# GPU machine. Optional wheels (torchao, bitsandbytes, liger-kernel; the GPU image lacks them)
# are installed from .whl/ when it exists (the device README says how to download them).
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MEMFIT_PROGRESS=0
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="$PWD/src:/tmp/site"
else
  export PYTHONPATH="$PWD/src"
fi
LOG=$OUT/session.log
T0=$(date +%s)
step() { echo "== $1 rc=$2 at +$(( $(date +%s) - T0 ))s" >>"$LOG"; }
