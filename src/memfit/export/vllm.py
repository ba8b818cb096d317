"""vLLM launch settings from a serve plan: the ``vllm serve`` command line, or the keyword
arguments of ``vllm.LLM(...)`` (``--format python``).

Flags are vLLM 0.33's (``vllm/engine/arg_utils.py: EngineArgs.add_cli_args``):
``--tensor-parallel-size``, ``--max-model-len``, ``--gpu-memory-utilization``,
``--kv-cache-memory-bytes``, ``--kv-cache-dtype``, ``--block-size``,
``--max-num-batched-tokens``, ``--max-num-seqs``, ``--enforce-eager``, and the ``--no-``
forms a boolean field gets (``_compute_kwargs``: ``argparse.BooleanOptionalAction``) for
``--no-async-scheduling`` and ``--no-enable-prefix-caching``. ``vllm.LLM`` takes the same
names as keywords (``vllm/entrypoints/llm.py: LLM.__init__``, the rest through ``**kwargs``
to ``EngineArgs``).
"""

from __future__ import annotations

from typing import Any

from memfit.export._base import Export
from memfit.export._serve import (
    ServeSettings,
    looks_like_checkpoint,
    render_command,
    render_python,
)

__all__ = ["engine_kwargs"]


def engine_kwargs(s: ServeSettings, notes: list[str]) -> dict[str, Any]:
    """The ``EngineArgs`` the plan chose, by field name, in the order they are printed."""
    out: dict[str, Any] = {"model": s.model, "tensor_parallel_size": s.tp,
                           "max_model_len": s.max_model_len}
    if s.gpu_memory_utilization is not None:
        out["gpu_memory_utilization"] = s.gpu_memory_utilization
    elif s.kv_cache_bytes is not None:
        # the plan was sized from a KV budget in bytes: vLLM then skips the profile run
        # (vllm/v1/worker/gpu_worker.py: determine_available_memory) and ignores the utilization
        out["kv_cache_memory_bytes"] = s.kv_cache_bytes
    if s.kv_cache_dtype not in ("auto", "bf16"):  # SGLang's bf16: the model's dtype
        out["kv_cache_dtype"] = s.kv_cache_dtype
    if s.hybrid:
        notes.append(f"no --block-size: vLLM grows the attention block to a Mamba state page "
                     f"itself (the plan's {s.block_size})")
        if not s.prefix_caching:  # planned with mamba_cache_mode none
            out["enable_prefix_caching"] = False
    elif s.engine == "vllm":  # an SGLang plan's page (--page-size) is not vLLM's block
        out["block_size"] = s.block_size
    out["max_num_batched_tokens"] = s.max_num_batched_tokens
    if s.max_num_seqs is not None:
        out["max_num_seqs"] = s.max_num_seqs
    else:
        notes.append("--max-num-seqs: the plan chose none; vLLM's default for the GPU applies")
    if not s.async_scheduling:
        out["async_scheduling"] = False
    if s.enforce_eager:
        out["enforce_eager"] = True
    if s.engine != "vllm":
        notes.append(f"the plan was sized by {s.engine}'s rules; vLLM pages its KV cache its "
                     "own way (its tokens and concurrency will differ)")
    if not looks_like_checkpoint(s.model):
        notes.append(f"model {s.model!r} is memfit's name for it: replace it with the "
                     "checkpoint's hub id or path")
    return out


def _flag(key: str, value: Any) -> list[str]:
    name = "--" + key.replace("_", "-")
    if value is True:
        return [name]
    if value is False:
        return ["--no-" + key.replace("_", "-")]
    return [name, str(value)]


def export(s: ServeSettings, form: str = "command") -> Export:
    """``vllm serve`` (``form`` command) or ``vllm.LLM(...)`` (``form`` python) for ``s``."""
    notes: list[str] = []
    kwargs = engine_kwargs(s, notes)
    if form == "python":
        return Export(target="vllm", text=render_python("from vllm import LLM", "llm = LLM",
                                                        kwargs),
                      filename="serve_vllm.py", notes=tuple(notes), data=kwargs)
    argv = ["vllm", "serve", kwargs["model"]]
    for key, value in kwargs.items():
        if key != "model":
            argv += _flag(key, value)
    return Export(target="vllm", text=render_command(argv), filename="serve_vllm.sh",
                  notes=tuple(notes), data=argv)
