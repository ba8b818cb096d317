#!/usr/bin/env bash
# A separate virtual environment holding vLLM 0.33.0 for bench/serving_vllm_parity.py.
# memfit does not depend on vLLM; this venv only runs vLLM's own KV cache arithmetic
# (vllm/v1/core/kv_cache_planning.py, kv_cache_utils.py) on a CPU. The venv is gitignored.
#
#   bash bench/serving_vllm/setup.sh        # PYTHON=python3.11 to pick the interpreter
#
# The plain install works on a machine without a GPU: pip brings vLLM's pinned torch
# (2.14.0+cu130) and its CUDA wheels, about 10 GB, in 3-4 minutes on a fast index; `import
# vllm` then works on the CPU (it logs "Failed to import from vllm._C", the CUDA kernels, which
# the KV arithmetic does not use).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="$here/.venv"
"${PYTHON:-python3}" -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install vllm==0.33.0
"$venv/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
