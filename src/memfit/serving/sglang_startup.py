"""SGLang's startup on a GPU: the weights load, then the KV pool takes what
``--mem-fraction-static`` leaves (:func:`sglang_plan`, the inputs given;
:func:`sglang_serve_plan`, the weights and the memory before them planned as for vLLM).

The pool arithmetic is :mod:`memfit.serving.sglang`'s (SGLang 0.5.23, each rule cited there).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit.errors import DoesNotFitError, MemfitError
from memfit.serving.kv_spec import LayerKV, kv_spec, model_context_length, text_config
from memfit.serving.sglang import (
    SGLANG_HYBRID_SWA_ARCHS,
    SGLANG_SOURCE,
    SGLANG_VERSION,
    SGLangKVPool,
    check_mem_fraction_static,
    default_mem_fraction_static,
    gpu_memory_defaults,
    sglang_kv_dtype,
    sglang_kv_tokens,
    sglang_log_lines,
    torch_dtype_name,
)

__all__ = ["SGLangPlan", "sglang_plan", "sglang_serve_plan"]


@dataclass(frozen=True, kw_only=True)
class SGLangPlan:
    """SGLang's KV pool for one model on each GPU of a TP group, with the flags it resolved.

    Known limitations: see the module docstring; the weights and the memory outside torch are
    inputs here, not derived.
    """

    engine: str
    engine_version: str
    model: str
    tp: int
    kv_cache_dtype: str
    mem_fraction_static: float
    mem_fraction_static_is_default: bool
    chunked_prefill_size: int
    cuda_graph_max_bs: int
    page_size: int
    context_len: int
    hybrid_swa: bool
    total_bytes: int
    weights_bytes: int
    non_torch_bytes: int
    pre_load_bytes: int
    """Free memory before the weights load: ``total - non_torch`` (SGLang's
    ``pre_model_load_memory``)."""
    available_bytes_after_weights: int
    pool: SGLangKVPool
    layers: tuple[LayerKV, ...]
    log_lines: tuple[str, ...]
    source: str = SGLANG_SOURCE

    @property
    def kv_cache_tokens(self) -> int:
        return self.pool.max_total_num_tokens

    @property
    def kv_cache_bytes(self) -> int:
        return self.pool.kv_bytes

    def to_json(self) -> dict[str, Any]:
        """Stable keys, bytes as integers."""
        p = self.pool
        return {
            "engine": self.engine, "engine_version": self.engine_version, "model": self.model,
            "tp": self.tp, "kv_cache_dtype": self.kv_cache_dtype,
            "mem_fraction_static": self.mem_fraction_static,
            "mem_fraction_static_is_default": self.mem_fraction_static_is_default,
            "chunked_prefill_size": self.chunked_prefill_size,
            "cuda_graph_max_bs": self.cuda_graph_max_bs, "page_size": self.page_size,
            "context_len": self.context_len, "hybrid_swa": self.hybrid_swa,
            "total_bytes": self.total_bytes, "weights_bytes": self.weights_bytes,
            "non_torch_bytes": self.non_torch_bytes, "pre_load_bytes": self.pre_load_bytes,
            "available_bytes_after_weights": self.available_bytes_after_weights,
            "cell_size": p.cell_size, "kv_budget_bytes": p.kv_budget_bytes,
            "kv_cache_bytes": p.kv_bytes, "kv_cache_tokens": p.max_total_num_tokens,
            "swa_tokens": p.swa_tokens, "max_running_requests": p.max_running_requests,
            "max_mamba_cache_size": p.max_mamba_cache_size,
            "mamba_cache_bytes": p.mamba_conv_bytes + p.mamba_ssm_bytes,
            "log_lines": list(self.log_lines), "source": self.source,
            # the keys every serve plan has (vLLM's too): SGLang profiles no activation peak
            # and subtracts no CUDA-graph estimate (both live in the 1 - mem_fraction_static
            # left over); its pages are its blocks
            "activation_peak_bytes": None, "cuda_graph_bytes": None,
            "num_gpu_blocks": p.max_total_num_tokens // self.page_size,
            "max_concurrency": self.max_concurrency,
            "max_model_len_that_fits": self.max_model_len_that_fits,
        }

    @property
    def max_concurrency(self) -> float:
        """Requests of ``context_len`` tokens the pool holds at once (SGLang logs no such
        figure; vLLM's "Maximum concurrency" for comparison)."""
        return self.pool.max_total_num_tokens / self.context_len

    @property
    def max_model_len_that_fits(self) -> int:
        """The longest request the pool holds: SGLang serves ``min(context_len - 1, pool - 1)``
        tokens (``managers/tp_worker.py: TpModelWorker.get_worker_info``, which warns when the
        pool is the smaller)."""
        return min(self.context_len, self.pool.max_total_num_tokens)


def _is_hybrid_swa(config: Mapping[str, Any]) -> bool:
    """``is_hybrid_swa_model``: the architecture is in SGLang's list (Laguna only with a
    window), or the text config sets ``is_hybrid_swa``."""
    archs = [str(a) for a in config.get("architectures") or ()]
    data = text_config(config)
    if not archs and data.get("model_type") == "gpt_oss":  # a config without architectures
        archs = ["GptOssForCausalLM"]
    if "LagunaForCausalLM" in archs and not data.get("sliding_window"):
        return False
    if "BeamForCausalLM" in archs:
        return "sliding_attention" in (data.get("layer_types") or ())
    return any(a in SGLANG_HYBRID_SWA_ARCHS for a in archs) or bool(data.get("is_hybrid_swa"))


def sglang_plan(config_or_model: str | Path | Mapping[str, Any], *, total_bytes: int,
                weights_bytes: int, non_torch_bytes: int = 0, tp: int = 1,
                kv_cache_dtype: str = "auto", mem_fraction_static: float | None = None,
                max_model_len: int | None = None, page_size: int = 1,
                max_running_requests: int | None = None, max_total_tokens: int | None = None,
                chunked_prefill_size: int | None = None, cuda_graph_max_bs: int | None = None,
                swa_full_tokens_ratio: float = 0.8,
                disable_hybrid_swa_memory: bool = False) -> SGLangPlan:
    """SGLang's pool for a model on a GPU of ``total_bytes`` (``nvidia-smi``'s total; it also
    picks the defaults), with ``weights_bytes`` of weights and ``non_torch_bytes`` resident
    before they load (CUDA context, NCCL) on each rank.

    >>> p = sglang_plan({"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32,
    ...                  "num_key_value_heads": 8, "num_hidden_layers": 32,
    ...                  "max_position_embeddings": 8192, "torch_dtype": "bfloat16"},
    ...                 total_bytes=80 * 2**30, weights_bytes=16 * 2**30,
    ...                 mem_fraction_static=0.8)
    >>> p.kv_cache_tokens  # (64 - 80 x 0.2) GiB / 131072 B per token
    393216

    ``max_model_len`` is SGLang's ``--context-length`` (default: the config's context).
    """
    # Imported here: plan.py is where the engines are put together and may import this module.
    from memfit.serving.plan import load_config

    for value, flag in ((total_bytes, "total_bytes"), (weights_bytes, "weights_bytes"),
                        (non_torch_bytes, "non_torch_bytes")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise MemfitError(f"{flag} must be a number of bytes >= 0, got {value!r}")
    if total_bytes <= weights_bytes + non_torch_bytes:
        raise DoesNotFitError(f"the weights ({weights_bytes:,} B) and the memory outside torch "
                          f"({non_torch_bytes:,} B) fill the GPU ({total_bytes:,} B); use more "
                          "GPUs (--tp) or a smaller model")
    optional: tuple[tuple[int | None, str], ...] = (
        (max_model_len, "--max-model-len"), (page_size, "--page-size"),
        (max_running_requests, "--max-running-requests"), (max_total_tokens, "--max-total-tokens"))
    for option, flag in optional:
        if option is not None and (isinstance(option, bool) or not isinstance(option, int)
                                   or option < 1):
            raise MemfitError(f"{flag} must be a positive integer, got {option!r}")
    if not 0 < swa_full_tokens_ratio <= 1:
        raise MemfitError(f"--swa-full-tokens-ratio must be in (0, 1], got "
                          f"{swa_full_tokens_ratio!r}")
    if mem_fraction_static is not None:
        check_mem_fraction_static(mem_fraction_static)
    name, config = load_config(config_or_model)
    kv_name = sglang_kv_dtype(config, kv_cache_dtype)
    layers = kv_spec(config, tp=tp, kv_cache_dtype=kv_name)
    hybrid = _is_hybrid_swa(config) and not disable_hybrid_swa_memory
    context = max_model_len if max_model_len is not None else model_context_length(config)
    if context is None:
        raise MemfitError(f"{name}: the config gives no context length; pass --max-model-len")
    chunk_default, bs_default = gpu_memory_defaults(total_bytes, tp)
    chunk = chunk_default if chunked_prefill_size is None else chunked_prefill_size
    max_bs = bs_default if cuda_graph_max_bs is None else cuda_graph_max_bs
    if cuda_graph_max_bs is None and max_running_requests is not None:
        max_bs = min(max_bs, max_running_requests)
    mla = any(layer.kind == "mla" for layer in layers)
    is_default = mem_fraction_static is None
    fraction = default_mem_fraction_static(
        total_bytes, tp, chunked_prefill_size=chunk, cuda_graph_max_bs=max_bs, mla=mla,
    ) if mem_fraction_static is None else mem_fraction_static
    pre_load = total_bytes - non_torch_bytes
    after = pre_load - weights_bytes
    data = text_config(config)
    ssm_bytes = {"bfloat16": 2, "float16": 2}.get(str(data.get("mamba_ssm_dtype")), 4)
    pool = sglang_kv_tokens(
        layers, available_bytes_after_weights=after, total_bytes=pre_load,
        mem_fraction_static=fraction, page_size=page_size, hybrid_swa=hybrid,
        swa_full_tokens_ratio=swa_full_tokens_ratio, context_len=context,
        max_total_tokens=max_total_tokens, max_running_requests=max_running_requests,
        mamba_ssm_dtype_bytes=ssm_bytes)
    lines = sglang_log_lines(pool, dtype_name=torch_dtype_name(config, kv_name),
                             chunked_prefill_size=chunk, context_len=context)
    return SGLangPlan(
        engine="sglang", engine_version=SGLANG_VERSION, model=name, tp=tp,
        kv_cache_dtype=kv_cache_dtype, mem_fraction_static=fraction,
        mem_fraction_static_is_default=is_default, chunked_prefill_size=chunk,
        cuda_graph_max_bs=max_bs, page_size=page_size, context_len=context, hybrid_swa=hybrid,
        total_bytes=total_bytes, weights_bytes=weights_bytes, non_torch_bytes=non_torch_bytes,
        pre_load_bytes=pre_load, available_bytes_after_weights=after, pool=pool,
        layers=tuple(layers), log_lines=tuple(lines))


def sglang_serve_plan(model: str | Path | Mapping[str, Any], *, gpu: str, tp: int = 1,
                      quant: str | None = None, kv_cache_dtype: str = "auto",
                      mem_fraction_static: float | None = None,
                      max_model_len: int | None = None, page_size: int = 1,
                      max_running_requests: int | None = None) -> SGLangPlan:
    """SGLang's pool for ``model`` on each ``gpu`` (``memfit gpus``) of a TP group, with the
    weights as they load (:func:`memfit.serving.startup.startup_weights`, as for vLLM: the
    same column/row sharding and padded vocabulary) and the memory before them: the CUDA
    context and NCCL's buffers, which exist when SGLang measures ``pre_model_load_memory``
    (``distributed/bootstrap.py: measure_pre_model_load_memory`` runs after the process group
    starts). cuBLAS's workspace is allocated at the first matmul, after the pool: it is left
    in the ``1 - mem_fraction_static`` share with the activations and CUDA graphs."""
    from memfit.gpus import get_gpu
    from memfit.serving.plan import load_config
    from memfit.serving.startup import baseline_parts, startup_weights

    spec = get_gpu(gpu)
    _, config = load_config(model)
    weights = startup_weights(model, config, gpu=spec, tp=tp, quant=quant)
    base = baseline_parts(spec, tp)
    return sglang_plan(model, total_bytes=spec.usable_bytes, weights_bytes=weights.total,
                       non_torch_bytes=base["cuda_context"] + base["nccl"], tp=tp,
                       kv_cache_dtype=kv_cache_dtype, mem_fraction_static=mem_fraction_static,
                       max_model_len=max_model_len, page_size=page_size,
                       max_running_requests=max_running_requests)
