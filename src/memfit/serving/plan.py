"""``serve_plan``: a model's KV cache as vLLM pages it, and the startup budget that sizes it.

Two ways to the KV budget, as in vLLM: ``--kv-cache-memory BYTES`` sizes the KV pool from the
bytes given, with no profile run (``vllm/v1/worker/gpu_worker.py: determine_available_memory``
returns ``kv_cache_memory_bytes`` as it is); or ``--gpu`` with ``--gpu-memory-utilization``,
where the budget is ``ceil(util x total) - (weights + activation peak + memory outside torch)
- CUDA-graph estimate`` (:mod:`memfit.serving.budget`, :mod:`memfit.serving.weights`). The
blocks, tokens and concurrency vLLM logs then follow from the model's layers and the flags.

The arguments of :func:`serve_plan`, in detail:

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
(:mod:`memfit.serving.multimodal`).

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

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit.errors import MemfitError, read_json_file
from memfit.serving.budget import default_batch_limits, requested_memory
from memfit.serving.budget import engine_version as engine_version_spec
from memfit.serving.kv_spec import (
    LayerKV,
    kv_spec,
    model_context_length,
    text_config,
)
from memfit.serving.result import ServePlan
from memfit.serving.speculative import SpeculativeDecoding, speculative_decoding
from memfit.serving.speculative import draft_layers as draft_layer_kv
from memfit.serving.startup import startup_budget
from memfit.serving.vllm import (
    VLLM_VERSION,
    EngineLayerSpec,
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

    The arguments in detail: the module docstring. Bad input raises MemfitError (one line).
    """
    version = engine_version_spec(engine_version).version
    _check_budget_args(kv_cache_memory, gpu, gpu_memory_utilization)
    wanted = None if concurrency is None else _positive(concurrency, "--concurrency")
    spec_gpu, max_num_batched_tokens, max_num_seqs = _gpu_and_limits(
        gpu, quant, max_num_batched_tokens, max_num_seqs)
    capability = None
    if spec_gpu is not None:
        from memfit.runtime import compute_capability_for

        capability = spec_gpu.compute_capability or compute_capability_for(spec_gpu.name)
    name, config = load_config(model)
    _check_multimodal_flags(name, config, max_images, max_videos, max_pixels)
    layers = kv_spec(config, tp=tp, kv_cache_dtype=kv_cache_dtype)
    speculative, layers = _with_draft(
        layers, config, speculative_method, num_speculative_tokens, draft_layers, draft_model,
        max_num_batched_tokens=max_num_batched_tokens, tp=tp, kv_cache_dtype=kv_cache_dtype)
    if block_size is None:  # vLLM's: the attention backend's preferred size on this GPU
        nope = text_config(config).get("qk_nope_head_dim")
        block_size = default_block_size(
            mla=any(layer.kind == "mla" for layer in layers),
            qk_nope_head_dim=nope if isinstance(nope, int) else None,
            compute_capability=capability)
    block_size = _positive(block_size, "--block-size")
    max_model_len, context = _max_model_len(name, config, max_model_len)
    hybrid = _hybrid(name, layers, config, block_size, prefix_caching, capability)
    block_size = hybrid.block_size
    kinds = {layer.kind for layer in layers}
    if str(text_config(config).get("model_type")) in _QWEN2_MODELS and \
            {"sliding", "full"} <= kinds:
        raise MemfitError(f"{name} uses sliding windows on some layers only; vLLM refuses it "
                          "(vllm/model_executor/models/qwen2.py: Qwen2Model asserts "
                          "max_window_layers == num_hidden_layers)")
    indices, specs = vllm_layer_specs(layers, block_size=block_size, max_model_len=max_model_len,
                                      mamba_page_padded=hybrid.mamba_padded,
                                      mamba_block_size=hybrid.mamba_block,
                                      checkpoint_blocks=hybrid.checkpoint_blocks,
                                      speculative_blocks=0 if speculative is None
                                      else speculative.num_speculative_tokens,
                                      extra_retained_tokens=0 if speculative is None
                                      else speculative.extra_retained_tokens)
    groups = kv_cache_groups(indices, specs)
    budget = None
    if kv_cache_memory is None:
        budget = startup_budget(
            model, config, gpu=spec_gpu, gpu_memory_utilization=gpu_memory_utilization, tp=tp,
            quant=quant, max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs, enforce_eager=enforce_eager,
            activation_peak_bytes=activation_peak_bytes, cuda_graph_bytes=cuda_graph_bytes,
            max_model_len=max_model_len, max_images=max_images, max_videos=max_videos,
            max_pixels=max_pixels, engine_version=version)
        kv_cache_memory = max(budget.kv_cache_bytes, 0)
    blocks = num_gpu_blocks(groups, kv_cache_memory)
    in_flight = (2 if async_scheduling else 1) * max_num_batched_tokens
    mode: MambaCacheMode = hybrid.mamba_mode or "none"
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
        concurrency=wanted, mamba_cache_mode=hybrid.mamba_mode, speculative=speculative)


def _check_budget_args(kv_cache_memory: int | None, gpu: str | None,
                       gpu_memory_utilization: float) -> None:
    """One of the two budgets, each well formed (one line otherwise)."""
    if kv_cache_memory is not None and (isinstance(kv_cache_memory, bool) or not isinstance(
            kv_cache_memory, int) or kv_cache_memory < 0):
        raise MemfitError(f"--kv-cache-memory must be a number of bytes >= 0, got "
                          f"{kv_cache_memory!r}")
    if kv_cache_memory is None and gpu is None:
        raise MemfitError("pass --gpu NAME (the KV budget from --gpu-memory-utilization) or "
                          "--kv-cache-memory BYTES")
    requested_memory(1, gpu_memory_utilization)  # (0, 1] or one line


def _multimodal(config: Mapping[str, Any]) -> bool:
    """Whether vLLM may treat the model as multimodal: a vision tower in the config, or a
    multimodal family or architecture (vLLM decides by the architecture, not the config's
    keys, so a VL model type without its ``vision_config`` counts)."""
    from memfit.serving.multimodal import MULTIMODAL_FAMILIES

    model_type = str(config.get("model_type", ""))
    archs = config.get("architectures") or []
    return (isinstance(config.get("vision_config"), Mapping)
            or model_type in MULTIMODAL_FAMILIES or "vl" in model_type.split("_")
            or any(str(a).endswith("ForConditionalGeneration") for a in archs))


def _check_multimodal_flags(name: str, config: Mapping[str, Any], max_images: int | None,
                            max_videos: int | None, max_pixels: int | None) -> None:
    """Refuse the image/video limits on a model without a vision tower: vLLM refuses them
    (``vllm/config/model.py``: "`limit_mm_per_prompt` is only supported for multimodal
    models", and the same for ``mm_processor_kwargs``), and nothing here could use them."""
    given = [flag for flag, value in (("--max-images", max_images), ("--max-videos", max_videos),
                                      ("--max-pixels", max_pixels)) if value is not None]
    if given and not _multimodal(config):
        raise MemfitError(f"{', '.join(given)}: {name} has no vision encoder (no "
                          "vision_config); vLLM refuses --limit-mm-per-prompt and "
                          "--mm-processor-kwargs for a text-only model: drop the option")


def _gpu_and_limits(gpu: str | None, quant: str | None, max_num_batched_tokens: int | None,
                    max_num_seqs: int | None) -> tuple[Any, int, int]:
    """The catalog GPU (or None), the quantization checked against it, and the scheduler's
    limits: those given, else ``vllm serve``'s defaults for the GPU."""
    spec_gpu = None
    if gpu is not None:
        from memfit.gpus import get_gpu

        spec_gpu = get_gpu(gpu)
        if spec_gpu.vendor not in ("nvidia", "custom"):
            platform = {"amd": "ROCm", "apple": "Metal (MPS)"}.get(spec_gpu.vendor,
                                                                   spec_gpu.vendor)
            raise MemfitError(f"the vLLM plan restates vLLM's CUDA platform; {spec_gpu.name} "
                              f"is {spec_gpu.vendor} ({platform}: other attention backends "
                              "and block sizes), not modelled yet: pick an NVIDIA GPU (or, "
                              "in serve-plan, pass --kv-cache-memory BYTES)")
    check_quant(quant, spec_gpu.compute_capability if spec_gpu else None)
    seqs_default, tokens_default = default_batch_limits(
        spec_gpu.usable_bytes, spec_gpu.name) if spec_gpu else (1024,
                                                                DEFAULT_MAX_NUM_BATCHED_TOKENS)
    tokens = _positive(max_num_batched_tokens or tokens_default, "--max-num-batched-tokens")
    seqs = _positive(max_num_seqs or seqs_default, "--max-num-seqs")
    # every running request takes at least one token a step (a default budget is left to
    # vLLM's own defaults, which may raise it)
    if max_num_batched_tokens is not None and tokens < seqs:
        raise MemfitError(f"--max-num-batched-tokens {tokens} is below --max-num-seqs {seqs}; "
                          "vLLM refuses it (vllm/config/scheduler.py: SchedulerConfig "
                          "'must be greater than or equal to max_num_seqs'): raise "
                          "--max-num-batched-tokens or lower --max-num-seqs")
    return spec_gpu, tokens, seqs


def _with_draft(layers: list[LayerKV], config: Mapping[str, Any], method: str | None,
                num_speculative_tokens: int | None, draft_layers: int | None,
                draft_model: str | Path | Mapping[str, Any] | None, *,
                max_num_batched_tokens: int, tp: int, kv_cache_dtype: str,
                ) -> tuple[SpeculativeDecoding | None, list[LayerKV]]:
    """Speculative decoding's settings and the draft's layers added to the pool
    (:mod:`memfit.serving.speculative`), or None and the layers as they are."""
    if method is None:
        if num_speculative_tokens is not None or draft_layers is not None or \
                draft_model is not None:
            raise MemfitError("--num-speculative-tokens, --draft-layers and --draft-model need "
                              "--speculative-method eagle|eagle3|mtp|ngram|draft_model")
        return None, layers
    speculative = speculative_decoding(method, num_speculative_tokens, config,
                                       max_num_batched_tokens)
    return speculative, layers + draft_layer_kv(
        speculative, layers, config, num_draft_layers=draft_layers, tp=tp,
        kv_cache_dtype=kv_cache_dtype,
        draft_config=None if draft_model is None else load_config(draft_model)[1])


def _max_model_len(name: str, config: Mapping[str, Any], max_model_len: int | None
                   ) -> tuple[int, int | None]:
    """``max_model_len`` (the model's context when not given; above it refused, as vLLM
    refuses it) and the model's context."""
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
    return max_model_len, context


@dataclass(frozen=True)
class _Hybrid:
    """A hybrid model's block and state-page alignment (the block as given otherwise)."""

    block_size: int
    mamba_padded: int | None = None
    mamba_block: int | None = None
    mamba_mode: MambaCacheMode | None = None
    checkpoint_blocks: int = 0


def _hybrid(name: str, layers: list[LayerKV], config: Mapping[str, Any], block_size: int,
            prefix_caching: bool, capability: str | None) -> _Hybrid:
    """The attention block grown to hold a Mamba state page (and, with prefix caching,
    ``mamba_cache_mode`` align, a multiple of the state layers' prefill-checkpoint alignment:
    :func:`~memfit.serving.vllm.mamba_prefill_checkpoints`)."""
    states = [layer for layer in layers if layer.kind in ("mamba", "linear")]
    if not states:
        return _Hybrid(block_size)
    attn = [layer for layer in layers if layer.kind in ("full", "sliding", "mla")]
    if not attn or any(layer.kind == "mla" for layer in attn):
        raise MemfitError(f"{name}: hybrid models without attention layers, or with MLA, "
                          "are not modelled yet")
    # MambaModelConfig.verify_and_update_config: prefix caching turns 'align' on
    mode: MambaCacheMode = "align" if prefix_caching else "none"
    text = text_config(config)
    key_dim = text.get("linear_key_head_dim")
    alignment, checkpoint_blocks = mamba_prefill_checkpoints(
        str(text.get("model_type")), mamba_cache_mode=mode, compute_capability=capability,
        linear_key_head_dim=key_dim if isinstance(key_dim, int) else None)
    block_size, padded = align_hybrid_block_size(
        attn[0].bytes_per_token, max(layer.state_bytes for layer in states), block_size,
        checkpoint_alignment=alignment if mode == "align" else None)
    return _Hybrid(block_size, padded, block_size if mode == "align" else None, mode,
                   checkpoint_blocks)  # Platform._align_hybrid_block_size
