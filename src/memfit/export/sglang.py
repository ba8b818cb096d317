"""SGLang launch settings from a serve plan: the ``python -m sglang.launch_server`` command
line, or the keyword arguments of ``sglang.Engine(...)`` (``--format python``).

Flags are SGLang 0.5.23's: each ``ServerArgs`` field is ``--`` + its name with ``-`` for ``_``
(``sglang/srt/arg_groups/arg_utils.py``), the fields in ``sglang/srt/arg_groups/fields/``:
``model_path`` (``model.py``), ``tp_size`` (``parallel.py``; alias ``--tensor-parallel-size``),
``context_length`` and ``kv_cache_dtype`` (``model.py``; choices ``auto``, ``fp8_e5m2``,
``fp8_e4m3``, ``bf16``, ...), ``mem_fraction_static``, ``max_running_requests``,
``chunked_prefill_size`` and ``page_size`` (``schedule.py``), ``cuda_graph_backend_decode`` /
``cuda_graph_backend_prefill`` (``exec_.py``; ``disabled`` turns CUDA graphs off).
``sglang.Engine(**kwargs)`` takes the same field names (``sglang/srt/entrypoints/engine.py:
Engine.__init__`` builds ``ServerArgs(**kwargs)``).
"""

from __future__ import annotations

from typing import Any

from memfit.export._base import Export, Gap
from memfit.export._serve import (
    ServeSettings,
    looks_like_checkpoint,
    render_command,
    render_python,
)

__all__ = ["engine_kwargs"]

# memfit / vLLM --kv-cache-dtype -> SGLang's (vLLM's plain "fp8" is e4m3 on CUDA:
# vllm/config/cache.py: CacheDType); "auto" is SGLang's default and not written.
_KV_DTYPES = {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2",
              "bfloat16": "bf16"}


def engine_kwargs(s: ServeSettings, gaps: list[Gap], notes: list[str]) -> dict[str, Any]:
    """The ``ServerArgs`` the plan chose, by field name, in the order they are printed."""
    out: dict[str, Any] = {"model_path": s.model, "tp_size": s.tp,
                           "context_length": s.max_model_len}
    if s.mem_fraction_static is not None:
        out["mem_fraction_static"] = s.mem_fraction_static
    elif s.gpu_memory_utilization is not None:
        gaps.append(Gap(setting="gpu_memory_utilization", value=s.gpu_memory_utilization,
                        reason="SGLang's --mem-fraction-static covers the weights and the KV "
                        "pool only, not vLLM's whole budget; choose it by hand"))
    elif s.kv_cache_bytes is not None:
        gaps.append(Gap(setting="kv_cache_bytes", value=s.kv_cache_bytes,
                        reason="SGLang sizes its KV pool from --mem-fraction-static (or caps "
                        "it in tokens with --max-total-tokens), not from bytes"))
    if s.kv_cache_dtype != "auto":
        if s.kv_cache_dtype in _KV_DTYPES:
            out["kv_cache_dtype"] = _KV_DTYPES[s.kv_cache_dtype]
        else:
            gaps.append(Gap(setting="kv_cache_dtype", value=s.kv_cache_dtype,
                            reason="not one of SGLang's --kv-cache-dtype choices; it keeps "
                            "the model's dtype with auto"))
    if s.engine == "sglang":
        out["page_size"] = s.block_size
    if s.max_num_seqs is not None:
        out["max_running_requests"] = s.max_num_seqs
    out["chunked_prefill_size"] = s.max_num_batched_tokens
    if s.engine != "sglang":
        notes.append("--chunked-prefill-size carries the plan's max_num_batched_tokens (the "
                     "tokens one prefill step takes)")
    if s.enforce_eager:
        out["cuda_graph_backend_decode"] = "disabled"
        out["cuda_graph_backend_prefill"] = "disabled"
    if s.engine != "sglang":
        notes.append(f"the plan was sized by {s.engine}'s rules; SGLang pages its KV pool its "
                     "own way (its #tokens will differ)")
    if not looks_like_checkpoint(s.model):
        notes.append(f"model {s.model!r} is memfit's name for it: replace it with the "
                     "checkpoint's hub id or path")
    return out


def export(s: ServeSettings, form: str = "command") -> Export:
    """``python -m sglang.launch_server`` (``form`` command) or ``sglang.Engine(...)``
    (``form`` python) for ``s``."""
    gaps: list[Gap] = []
    notes: list[str] = []
    kwargs = engine_kwargs(s, gaps, notes)
    if form == "python":
        return Export(target="sglang", text=render_python("import sglang", "engine = "
                                                          "sglang.Engine", kwargs),
                      filename="serve_sglang.py", gaps=tuple(gaps), notes=tuple(notes),
                      data=kwargs)
    argv = ["python", "-m", "sglang.launch_server"]
    for key, value in kwargs.items():
        argv += ["--" + key.replace("_", "-"), str(value)]
    return Export(target="sglang", text=render_command(argv), filename="serve_sglang.sh",
                  gaps=tuple(gaps), notes=tuple(notes), data=argv)
