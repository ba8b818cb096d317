#!/usr/bin/env bash
# A separate virtual environment holding vLLM 0.33.0 for bench/serving_vllm_parity.py.
# memfit does not depend on vLLM; this venv only runs vLLM's own KV cache arithmetic
# (vllm/v1/core/kv_cache_utils.py) on CPU.  The venv is gitignored (.venv/).
#
#   bash bench/serving_vllm/setup.sh            # full `pip install vllm==0.33.0` (several GB)
#   MODE=minimal bash bench/serving_vllm/setup.sh
#       vllm==0.33.0 without its dependencies, CPU torch, and the pure-Python packages
#       that vllm.v1.core.kv_cache_utils and vllm.config import.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="$here/.venv"
python="${PYTHON:-python3}"
mode="${MODE:-full}"
"$python" -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
if [ "$mode" = full ]; then
    "$venv/bin/pip" install vllm==0.33.0
else
    "$venv/bin/pip" install --index-url https://download.pytorch.org/whl/cpu torch==2.14.0
    "$venv/bin/pip" install --no-deps vllm==0.33.0
    "$venv/bin/pip" install -r "$here/requirements-minimal.txt"
fi
"$venv/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
