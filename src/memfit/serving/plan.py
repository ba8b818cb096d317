"""``serve_plan``: a model's KV cache as vLLM pages it, and the startup budget that sizes it.

Two ways to the KV budget, as in vLLM: ``--kv-cache-memory BYTES`` sizes the KV pool from the
bytes given, with no profile run (``vllm/v1/worker/gpu_worker.py: determine_available_memory``
returns ``kv_cache_memory_bytes`` as it is); or ``--gpu`` with ``--gpu-memory-utilization``,
where the budget is ``ceil(util x total) - (weights + activation peak + memory outside torch)
- CUDA-graph estimate`` (:mod:`memfit.serving.budget`, :mod:`memfit.serving.weights`). The
blocks, tokens and concurrency vLLM logs then follow from the model's layers and the flags.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit.errors import MemfitError, read_json_file
from memfit.serving.budget import Budget, default_batch_limits, requested_memory
from memfit.serving.budget import engine_version as engine_version_spec
from memfit.serving.kv_spec import (
    LayerKV,
    kv_spec,
    model_context_length,
    text_config,
)
from memfit.serving.speculative import SpeculativeDecoding, speculative_decoding
from memfit.serving.speculative import draft_layers as draft_layer_kv
from memfit.serving.startup import startup_budget
from memfit.serving.vllm import (
    VLLM_SOURCE,
    VLLM_VERSION,
    EngineLayerSpec,
    KVCacheGroup,
    MambaCacheMode,
    SpecKind,
    align_hybrid_block_size,
    bytes_per_block,
    default_block_size,
    fits,
    kv_cache_groups,
    kv_cache_tokens,
    mamba_prefill_checkpoints,
    max_concurrency,
    max_memory_usage_bytes,
    max_model_len_that_fits,
    num_gpu_blocks,
)
from memfit.serving.weights import check_quant

__all__ = ["ServePlan", "load_config", "serve_plan", "startup_budget", "vllm_layer_specs"]

_QWEN2_MODELS = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "qwen2_vl", "qwen2_vl_text",
                 "qwen2_5_vl", "qwen2_5_vl_text")
_BUDGET_KEYS = ("weights_bytes", "activation_peak_bytes", "non_torch_bytes",
                "cuda_graph_bytes")

# The sliding windows of the presets whose config.json has them (their TransformerSpec keeps
# the shapes only). Values from each model's config.json on the Hub.
_PRESET_WINDOWS: dict[str, dict[str, Any]] = {
    "gemma-2-9b": {"sliding_window": 4096},
    "gemma-3-1b": {"sliding_window": 512},
    "gemma-3-4b": {"sliding_window": 1024},
    "gemma-3-12b": {"sliding_window": 1024},
    "gemma-3-27b": {"sliding_window": 1024},
    "mistral-7b": {"sliding_window": 4096},
    "phi-3-mini": {"sliding_window": 2047},
}

DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
"""``vllm serve``'s default ``max_num_batched_tokens`` on an H100 or H200 (70 GiB or more, not an
A100: ``vllm/engine/arg_utils.py: EngineArgs.get_batch_defaults``, ``OPENAI_API_SERVER``;
2048 on smaller GPUs and A100s, 16384 from 160 GiB). Only sliding-window layers' per-request
most depends on it."""


def load_config(model: str | Path | Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """A model's name and its transformers config dict: a dict as given; a ``config.json`` (or
    its folder); a hub id in the local cache; or a preset (its shapes written as a config)."""
    if isinstance(model, Mapping):
        return str(model.get("_name_or_path") or model.get("model_type") or "config"), \
            dict(model)
    from memfit.models import (
        HFModelSpec,
        TransformerSpec,
        cached_snapshot,
        is_preset,
        resolve_model,
    )
    from memfit.models.hub import looks_like_hub_id

    text = str(model).strip()
    path = Path(text).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    if not path.is_file() and looks_like_hub_id(text) and not is_preset(text):
        path = cached_snapshot(text) / "config.json"
    if path.is_file():
        data = read_json_file(path, what="config file", fix="pass a Hugging Face config.json")
        if not isinstance(data, dict):
            raise MemfitError(f"{path}: expected a JSON object; pass a Hugging Face config.json")
        return text, data
    spec = resolve_model(text)  # a preset, or a MemfitError naming the closest ones
    if isinstance(spec, HFModelSpec):
        return spec.name, dict(spec.config)
    assert isinstance(spec, TransformerSpec)
    if spec.arch != "decoder":
        raise MemfitError(f"{spec.name} is an {spec.arch} model; serve-plan sizes a decoder's "
                          "KV cache (pass a causal LM)")
    config = {"model_type": spec.family, "hidden_size": spec.hidden_size,
              "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.num_heads,
              "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
              "max_position_embeddings": spec.max_position_embeddings or None,
              "intermediate_size": spec.intermediate_size, "vocab_size": spec.vocab_size,
              "tie_word_embeddings": spec.tie_embeddings, "attention_bias": spec.qkv_bias,
              "mlp_bias": spec.mlp_bias, "num_local_experts": spec.num_experts,
              "torch_dtype": "bfloat16", **_PRESET_WINDOWS.get(spec.name, {})}
    return spec.name, config


def vllm_layer_specs(layers: list[LayerKV], *, block_size: int, max_model_len: int,
                     mamba_page_padded: int | None = None,
                     mamba_block_size: int | None = None, checkpoint_blocks: int = 0,
                     speculative_blocks: int = 0, extra_retained_tokens: int = 0,
                     ) -> tuple[list[int], list[EngineLayerSpec]]:
    """The layers vLLM allocates cache for and their specs
    (``vllm/v1/worker/gpu_model_runner.py: GPUModelRunner.get_kv_cache_spec``): a layer with
    a ``kv_sharing_target_layer_name`` (Gemma 3n's shared layers) gets none; attention layers
    ``Attention.get_kv_cache_spec`` (``vllm/model_executor/layers/attention/attention.py``: a
    sliding layer's block is ``--block-size`` when the backend runs it unsplit) or
    ``MLAAttention.get_kv_cache_spec`` (``mla_attention.py``: one head of
    ``kv_lora_rank + qk_rope_head_dim``); a Mamba / linear layer one state page
    (``MambaBase.get_kv_cache_spec``) of ``mamba_block_size`` tokens, by default
    ``max_model_len`` (``vllm/model_executor/models/config.py: MambaModelConfig``, without
    prefix caching; with it, the attention block size), with ``checkpoint_blocks`` prefill
    checkpoint pages and ``speculative_blocks`` draft-token pages; a sliding layer keeps
    ``extra_retained_tokens`` more (multi-module MTP). A speculative draft's layers
    (``LayerKV.draft``) get specs like the target's (:mod:`memfit.serving.speculative`)."""
    indices, specs = [], []
    for layer in layers:
        if layer.kind == "shared":
            continue
        if layer.kind in ("mamba", "linear"):
            spec = EngineLayerSpec(kind="mamba", block_size=mamba_block_size or max_model_len,
                                   state_bytes=layer.state_bytes,
                                   page_size_padded=mamba_page_padded,
                                   checkpoint_blocks=checkpoint_blocks,
                                   speculative_blocks=speculative_blocks)
        else:
            kind: SpecKind = "mla" if layer.kind == "mla" else \
                "sliding" if layer.kind == "sliding" else "full"
            spec = EngineLayerSpec(kind=kind, block_size=block_size,
                                   num_kv_heads=layer.num_kv_heads, head_size=layer.head_size,
                                   head_size_v=layer.head_size_v, dtype_bytes=layer.dtype_bytes,
                                   sliding_window=layer.sliding_window,
                                   extra_retained_tokens=extra_retained_tokens
                                   if kind == "sliding" else 0)
        indices.append(layer.index)
        specs.append(spec)
    return indices, specs


@dataclass(frozen=True, kw_only=True)
class ServePlan:
    """What vLLM does with a KV budget of ``kv_cache_bytes`` on each GPU of the TP group.

    Known limitations: this part takes the KV budget as given (vLLM's ``--kv-cache-memory``);
    the weights, profile-run activations, memory outside torch and CUDA graphs are a later part
    (None here).
    """

    engine: str
    engine_version: str
    model: str
    tp: int
    kv_cache_dtype: str
    block_size: int
    max_model_len: int
    max_num_batched_tokens: int
    max_in_flight_tokens: int
    kv_cache_bytes: int
    layers: tuple[LayerKV, ...]
    groups: tuple[KVCacheGroup, ...]
    bytes_per_block: int
    """One block over every layer sharing it (the pool's unit)."""
    num_gpu_blocks: int
    kv_cache_tokens: int
    max_concurrency: float
    request_bytes: int
    """The bytes one request of ``max_model_len`` tokens needs (vLLM's startup check)."""
    fits: bool
    """Whether vLLM starts: one request of ``max_model_len`` fits beside the null block
    (``kv_cache_planning.py: _check_enough_kv_cache_memory``); else it raises at startup."""
    max_model_len_that_fits: int
    model_context: int | None
    max_num_seqs: int | None = None
    budget: Budget | None = None
    """The startup budget that chose ``kv_cache_bytes`` (None with ``--kv-cache-memory``)."""
    concurrency: int | None = None
    """Requests of ``max_model_len`` tokens wanted at once
    (for :attr:`utilization_for_concurrency`)."""
    mamba_cache_mode: MambaCacheMode | None = None
    """A hybrid model's ``mamba_cache_mode``: ``align`` with prefix caching, ``none`` without
    (None: no Mamba layers)."""
    speculative: SpeculativeDecoding | None = None
    """Speculative decoding's settings (None: off); its draft layers are in ``layers``."""
    source: str = VLLM_SOURCE

    @property
    def kv_bytes_for_concurrency(self) -> int | None:
        """The KV budget ``concurrency`` requests of ``max_model_len`` need: vLLM's
        concurrency is ``num_blocks / blocks per request``, and startup needs one request
        beside the null block."""
        if self.concurrency is None:
            return None
        return max(self.concurrency * self.request_bytes,
                   self.request_bytes + self.bytes_per_block)

    @property
    def utilization_for_concurrency(self) -> float | None:
        """The ``--gpu-memory-utilization`` that gives :attr:`kv_bytes_for_concurrency` (above
        1: no setting does on this GPU)."""
        need = self.kv_bytes_for_concurrency
        if need is None or self.budget is None:
            return None
        return self.budget.utilization_for(need)

    @property
    def startup_oom(self) -> str | None:
        """Why vLLM would fail before serving, or None: the baseline (CUDA context, NCCL,
        cuBLAS) leaves less free than requested (``request_memory``), or weights, activations,
        memory outside torch and CUDA graphs exceed the budget ("No available memory for the
        cache blocks")."""
        b = self.budget
        if b is None:
            return None
        if not b.baseline_fits:
            return (f"the CUDA context, NCCL and cuBLAS ({b.baseline_bytes:,} B) leave less than "
                    f"--gpu-memory-utilization {b.gpu_memory_utilization} x total free: vLLM "
                    "refuses to start (vllm/v1/worker/utils.py: request_memory); lower it")
        if b.kv_cache_bytes <= 0:
            return (f"weights, activation peak, memory outside torch and CUDA graphs "
                    f"({b.requested_bytes - b.kv_cache_bytes:,} B) exceed the "
                    f"{b.requested_bytes:,} B budget: vLLM raises 'No available memory for the "
                    "cache blocks'; raise --gpu-memory-utilization, quantize, or add --tp")
        return None

    @property
    def log_line(self) -> str:
        """The line vLLM logs at startup for this budget, formatted as it formats it
        (``vllm/v1/core/kv_cache_utils.py: update_kv_cache_capacity``)."""
        return (f"GPU KV cache size: {self.kv_cache_tokens:,} tokens, Maximum concurrency for "
                f"{self.max_model_len:,} tokens per request: {self.max_concurrency:.2f}x")

    def to_json(self) -> dict[str, Any]:
        """The stable ``--json`` keys (bytes as integers); the profile-run keys are null."""
        out: dict[str, Any] = {
            "engine": self.engine, "engine_version": self.engine_version, "model": self.model,
            "tp": self.tp, "kv_cache_dtype": self.kv_cache_dtype, "block_size": self.block_size,
            "max_model_len": self.max_model_len,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_in_flight_tokens": self.max_in_flight_tokens,
            **self._budget_json(),
            "kv_cache_bytes": self.kv_cache_bytes, "kv_cache_tokens": self.kv_cache_tokens,
            "num_gpu_blocks": self.num_gpu_blocks,
            "max_concurrency": round(self.max_concurrency, 2),
            "max_model_len_that_fits": self.max_model_len_that_fits,
            "bytes_per_block": self.bytes_per_block, "request_bytes": self.request_bytes,
            "fits": self.fits, "log_line": self.log_line,
            "kv_cache_groups": [_group_json(g) for g in self.groups],
            "layers": [_layer_json(layer) for layer in self.layers],
            "source": self.source,
        }
        if self.mamba_cache_mode is not None:
            out["mamba_cache_mode"] = self.mamba_cache_mode
        if self.speculative is not None:
            out["speculative"] = {**self.speculative.to_json(), "draft_layers": sum(
                layer.draft for layer in self.layers)}
            if self.budget is not None:
                out["speculative"]["note"] = ("the draft's weights, activations and CUDA "
                                              "graphs are not in the startup budget")
        if self.budget is None:
            out["note"] = ("the KV budget is --kv-cache-memory (no profile run): weights, "
                           "activation peak, memory outside torch and CUDA graphs are null")
        return out

    def _budget_json(self) -> dict[str, Any]:
        b = self.budget
        if b is None:
            return {k: None for k in _BUDGET_KEYS}
        return {
            "gpu": b.gpu, "gpu_total_bytes": b.total_bytes,
            "gpu_memory_utilization": b.gpu_memory_utilization,
            "requested_bytes": b.requested_bytes, "max_num_seqs": self.max_num_seqs,
            "weights_bytes": b.weights_bytes, "weights_parts": dict(b.weights_parts),
            "activation_peak_bytes": b.activation_peak_bytes,
            "activation_source": b.activation_source,
            "non_torch_bytes": b.non_torch_bytes, "cuda_graph_bytes": b.cuda_graph_bytes,
            "cuda_graphs": dict(b.cuda_graph_counts),
            "cuda_graphs_in_budget": b.cuda_graphs_in_budget,
            "baseline_bytes": b.baseline_bytes, "baseline_parts": dict(b.baseline_parts),
            "available_kv_log_line": b.log_line, "budget_log_lines": b.log_lines,
            "concurrency": self.concurrency,
            "kv_bytes_for_concurrency": self.kv_bytes_for_concurrency,
            "gpu_memory_utilization_for_concurrency": self.utilization_for_concurrency,
            "startup_oom": self.startup_oom,
            "multimodal": None if b.multimodal is None else b.multimodal.to_json(),
            "estimates": ["non_torch_bytes", "cuda_graph_bytes"] + (
                [] if b.activation_source == "profile_run" else ["activation_peak_bytes"]) + (
                [] if b.multimodal is None else ["multimodal.encoder_peak_bytes"]),
        }


def _group_json(g: KVCacheGroup) -> dict[str, Any]:
    s = g.spec
    return {"kind": "uniform_type" if g.uniform_type else s.kind, "layers": list(g.layers),
            "block_size": g.block_size, "page_size_bytes": g.page_size_bytes,
            "num_kv_heads": s.num_kv_heads, "head_size": s.head_size,
            "dtype_bytes": s.dtype_bytes, "sliding_window": s.sliding_window}


def _layer_json(layer: LayerKV) -> dict[str, Any]:
    out = {k: v for k, v in dataclasses.asdict(layer).items()
           if v not in (None, (), 0, False) or k in ("index", "kind")}
    out["bytes_per_token"] = layer.bytes_per_token
    if layer.kind in ("mamba", "linear"):
        out["state_bytes"] = layer.state_bytes
    return out


def _positive(value: Any, flag: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise MemfitError(f"{flag} must be a positive integer, got {value!r}")
    return value


def serve_plan(model: str | Path | Mapping[str, Any], *, kv_cache_memory: int | None = None,
               gpu: str | None = None, gpu_memory_utilization: float = 0.9, tp: int = 1,
               kv_cache_dtype: str = "auto", block_size: int | None = None,
               max_model_len: int | None = None,
               max_num_batched_tokens: int | None = None, max_num_seqs: int | None = None,
               quant: str | None = None, enforce_eager: bool = False,
               activation_peak_bytes: int | None = None, cuda_graph_bytes: int | None = None,
               concurrency: int | None = None,
               async_scheduling: bool = True, prefix_caching: bool = True,
               max_images: int | None = None, max_videos: int | None = None,
               max_pixels: int | None = None,
               speculative_method: str | None = None,
               num_speculative_tokens: int | None = None, draft_layers: int | None = None,
               draft_model: str | Path | Mapping[str, Any] | None = None,
               engine_version: str = VLLM_VERSION) -> ServePlan:
    """vLLM's KV pool for ``model`` on each GPU of the TP group: from ``kv_cache_memory``
    bytes (vLLM's ``--kv-cache-memory``: no profile run), else from ``gpu``'s memory and
    ``gpu_memory_utilization`` less the startup budget (:func:`startup_budget`).

    >>> p = serve_plan("llama-3-8b", kv_cache_memory=2**30)  # 1 GiB, 2 MiB blocks
    >>> p.num_gpu_blocks, p.kv_cache_tokens
    (512, 8192)

    ``max_model_len`` defaults to the model's context (as vLLM derives it); above it is refused,
    as vLLM refuses it. ``async_scheduling`` (vLLM's default, ``vllm/config/vllm.py:
    VllmConfig.__post_init__``) keeps two batches in flight (``max_concurrent_batches``), so a
    sliding-window layer holds ``2 x max_num_batched_tokens`` tokens past its window
    (``VllmConfig.max_in_flight_tokens``). In a hybrid Mamba / linear-attention model the
    attention block grows until its page holds a Mamba state (:func:`~memfit.serving.vllm.
    align_hybrid_block_size`), so ``block_size`` in the plan may exceed the one given; with
    ``prefix_caching`` (``mamba_cache_mode`` ``align``) the block is also a multiple of the
    state layers' prefill-checkpoint alignment and each request holds 2 or 3 state pages per
    Mamba group instead of 1 (:func:`~memfit.serving.vllm.mamba_prefill_checkpoints`, read for
    ``gpu``'s compute capability, Hopper without one).
    ``max_images`` / ``max_videos`` / ``max_pixels`` size a vision-language model's encoder
    (:mod:`memfit.serving.multimodal`). Bad input raises MemfitError (one line).

    ``speculative_method`` (``eagle`` / ``eagle3`` / ``mtp`` / ``ngram`` / ``draft_model``)
    with ``num_speculative_tokens`` adds the draft's layers to the pool (``draft_layers``
    EAGLE layers of the target's shape, default 1; MTP's ``num_nextn_predict_layers``; a
    ``draft_model``'s own config) and ``K`` state pages per request to Mamba layers
    (:mod:`memfit.serving.speculative`, where each rule's source is cited).

    ``engine_version`` (``--engine-version``; :data:`memfit.serving.budget.ENGINE_VERSIONS`,
    others refused) picks the startup budget's version rules: the profile run's sampler, the
    CUDA-graph capture sizes and whether the graphs are subtracted. The KV-cache arithmetic
    is 0.33's in every version.
    """
    version = engine_version_spec(engine_version).version
    if kv_cache_memory is not None and (isinstance(kv_cache_memory, bool) or not isinstance(
            kv_cache_memory, int) or kv_cache_memory < 0):
        raise MemfitError(f"--kv-cache-memory must be a number of bytes >= 0, got "
                          f"{kv_cache_memory!r}")
    if kv_cache_memory is None and gpu is None:
        raise MemfitError("pass --gpu NAME (the KV budget from --gpu-memory-utilization) or "
                          "--kv-cache-memory BYTES")
    requested_memory(1, gpu_memory_utilization)  # (0, 1] or one line
    wanted = None if concurrency is None else _positive(concurrency, "--concurrency")
    spec_gpu = None
    if gpu is not None:
        from memfit.gpus import get_gpu

        spec_gpu = get_gpu(gpu)
    check_quant(quant, spec_gpu.compute_capability if spec_gpu else None)
    seqs_default, tokens_default = default_batch_limits(
        spec_gpu.usable_bytes, spec_gpu.name) if spec_gpu else (1024,
                                                                DEFAULT_MAX_NUM_BATCHED_TOKENS)
    max_num_batched_tokens = _positive(max_num_batched_tokens or tokens_default,
                                       "--max-num-batched-tokens")
    max_num_seqs = _positive(max_num_seqs or seqs_default, "--max-num-seqs")
    name, config = load_config(model)
    layers = kv_spec(config, tp=tp, kv_cache_dtype=kv_cache_dtype)
    speculative = None
    if speculative_method is not None:
        speculative = speculative_decoding(speculative_method, num_speculative_tokens, config,
                                           max_num_batched_tokens)
        layers += draft_layer_kv(
            speculative, layers, config, num_draft_layers=draft_layers, tp=tp,
            kv_cache_dtype=kv_cache_dtype,
            draft_config=None if draft_model is None else load_config(draft_model)[1])
    elif num_speculative_tokens is not None or draft_layers is not None or \
            draft_model is not None:
        raise MemfitError("--num-speculative-tokens, --draft-layers and --draft-model need "
                          "--speculative-method eagle|eagle3|mtp|ngram|draft_model")
    if block_size is None:  # vLLM's: the attention backend's preferred size on this GPU
        from memfit.runtime import compute_capability_for

        nope = text_config(config).get("qk_nope_head_dim")
        block_size = default_block_size(
            mla=any(layer.kind == "mla" for layer in layers),
            qk_nope_head_dim=nope if isinstance(nope, int) else None,
            compute_capability=None if spec_gpu is None else (
                spec_gpu.compute_capability or compute_capability_for(spec_gpu.name)))
    block_size = _positive(block_size, "--block-size")
    context = model_context_length(config)
    if max_model_len is None:
        if context is None:
            raise MemfitError(f"{name}: the config gives no context length; pass --max-model-len")
        max_model_len = context
    max_model_len = _positive(max_model_len, "--max-model-len")
    if context is not None and max_model_len > context:
        raise MemfitError(
            f"--max-model-len {max_model_len} is above {name}'s context of {context} tokens; "
            "vLLM refuses it (vllm/config/model.py: _get_and_verify_max_len) unless "
            "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1; pass --max-model-len <= " + str(context))
    states = [layer for layer in layers if layer.kind in ("mamba", "linear")]
    mamba_padded = mamba_block = None
    mamba_mode: MambaCacheMode | None = None
    checkpoint_blocks = 0
    if states:
        attn = [layer for layer in layers if layer.kind in ("full", "sliding", "mla")]
        if not attn or any(layer.kind == "mla" for layer in attn):
            raise MemfitError(f"{name}: hybrid models without attention layers, or with MLA, "
                              "are not modelled yet")
        # MambaModelConfig.verify_and_update_config: prefix caching turns 'align' on
        mamba_mode = "align" if prefix_caching else "none"
        from memfit.runtime import compute_capability_for

        text = text_config(config)
        key_dim = text.get("linear_key_head_dim")
        checkpoint_alignment, checkpoint_blocks = mamba_prefill_checkpoints(
            str(text.get("model_type")), mamba_cache_mode=mamba_mode,
            compute_capability=None if spec_gpu is None else (
                spec_gpu.compute_capability or compute_capability_for(spec_gpu.name)),
            linear_key_head_dim=key_dim if isinstance(key_dim, int) else None)
        block_size, mamba_padded = align_hybrid_block_size(
            attn[0].bytes_per_token, max(layer.state_bytes for layer in states), block_size,
            checkpoint_alignment=checkpoint_alignment if mamba_mode == "align" else None)
        if mamba_mode == "align":  # Platform._align_hybrid_block_size
            mamba_block = block_size
    kinds = {layer.kind for layer in layers}
    if str(text_config(config).get("model_type")) in _QWEN2_MODELS and \
            {"sliding", "full"} <= kinds:
        raise MemfitError(f"{name} uses sliding windows on some layers only; vLLM refuses it "
                          "(vllm/model_executor/models/qwen2.py: Qwen2Model asserts "
                          "max_window_layers == num_hidden_layers)")
    indices, specs = vllm_layer_specs(layers, block_size=block_size, max_model_len=max_model_len,
                                      mamba_page_padded=mamba_padded,
                                      mamba_block_size=mamba_block,
                                      checkpoint_blocks=checkpoint_blocks,
                                      speculative_blocks=0 if speculative is None
                                      else speculative.num_speculative_tokens,
                                      extra_retained_tokens=0 if speculative is None
                                      else speculative.extra_retained_tokens)
    groups = kv_cache_groups(indices, specs)
    budget = None
    if kv_cache_memory is None:
        assert spec_gpu is not None
        budget = startup_budget(
            model, config, gpu=spec_gpu, gpu_memory_utilization=gpu_memory_utilization, tp=tp,
            quant=quant, max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs, enforce_eager=enforce_eager,
            activation_peak_bytes=activation_peak_bytes, cuda_graph_bytes=cuda_graph_bytes,
            max_model_len=max_model_len, max_images=max_images, max_videos=max_videos,
            max_pixels=max_pixels,
            engine_version=version)
        kv_cache_memory = max(budget.kv_cache_bytes, 0)
    blocks = num_gpu_blocks(groups, kv_cache_memory)
    in_flight = (2 if async_scheduling else 1) * max_num_batched_tokens
    mode: MambaCacheMode = mamba_mode or "none"
    most = max_concurrency(groups, blocks, max_model_len, max_in_flight_tokens=in_flight,
                           mamba_cache_mode=mode)
    return ServePlan(
        engine="vllm", engine_version=version, model=name, tp=tp,
        kv_cache_dtype=kv_cache_dtype, block_size=block_size, max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens, max_in_flight_tokens=in_flight,
        kv_cache_bytes=kv_cache_memory, layers=tuple(layers), groups=tuple(groups),
        bytes_per_block=bytes_per_block(groups) if groups else 0, num_gpu_blocks=blocks,
        kv_cache_tokens=kv_cache_tokens(most, max_model_len),
        max_concurrency=most,
        request_bytes=max_memory_usage_bytes(groups, max_model_len,
                                             max_in_flight_tokens=in_flight,
                                             mamba_cache_mode=mode),
        fits=fits(groups, kv_cache_memory, max_model_len, max_in_flight_tokens=in_flight,
                  mamba_cache_mode=mode),
        max_model_len_that_fits=max_model_len_that_fits(
            groups, kv_cache_memory, context or max_model_len, max_in_flight_tokens=in_flight,
            mamba_cache_mode=mode),
        model_context=context, max_num_seqs=max_num_seqs, budget=budget,
        concurrency=wanted, mamba_cache_mode=mamba_mode, speculative=speculative)
