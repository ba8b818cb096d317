"""SGLang's KV-pool arithmetic: layers -> ``cell_size`` -> token budget -> the lines it logs.

Each rule restates one function of SGLang :data:`SGLANG_VERSION`, read in its PyPI wheel
(:data:`SGLANG_SOURCE`; paths below are under ``sglang/srt/``). Plain arithmetic on
:class:`~memfit.serving.kv_spec.LayerKV` records; nothing imports SGLang or torch.

How SGLang sizes its pool at startup (``mem_cache/kv_cache_configurator.py:
KVCacheConfigurator._resolve_memory_pool_config``), in GiB floats as SGLang computes them:

1. ``pre_model_load_memory``: free GPU memory before the weights load, after CUDA context and
   NCCL (``distributed/bootstrap.py: measure_pre_model_load_memory``; ``utils/common.py:
   get_available_gpu_memory`` returns ``torch.cuda.mem_get_info`` free bytes / 2**30);
2. ``rest_memory = available_after_weights - pre_model_load_memory x (1 - mem_fraction_static)``
   (``_profile_available_bytes``; the slack is a share of the *pre-load free* memory, not of
   the card's total); a hybrid Mamba model then carves its state pool out of it
   (``_handle_max_mamba_cache``); ``int(rest_memory x 2**30)`` bytes are left for KV;
3. ``max_total_num_tokens = bytes // cell_size``, floored to ``page_size``
   (``model_executor/pool_configurator.py: DefaultPoolConfigurator.calculate_pool_sizes``;
   ``HybridSWAPoolConfigurator`` for sliding-window models), then capped by
   ``--max-total-tokens`` (``_apply_token_constraints``);
4. ``max_running_requests`` from the tokens (``resolve_max_num_reqs``).

``cell_size`` (``DefaultPoolConfigurator._compute_cell_size``) is the bytes one token takes over
every layer of the pool on one TP rank: ``kv_heads x (head_dim + v_head_dim) x layers x
dtype`` for MHA/GQA (``ModelConfig.get_num_kv_heads``: ``max(1, kv_heads // tp)``), ``(kv_lora_rank
+ qk_rope_head_dim) x layers x dtype`` for MLA (``calculate_mla_kv_cache_dim``; the latent is not
split by TP). Where SGLang's layout differs from vLLM's:

- sliding-window layers get their own pool only for the hybrid-SWA architectures
  (``configs/model_config.py: is_hybrid_swa_model``: gpt-oss, Llama-4, MiMo-V2, Gemma-4, ...);
  Gemma-2/3 and Mistral keep every layer in the one full-size pool;
- Gemma 3n's shared-KV layers are allocated like the layers they read
  (``model_runner_components/layer_setup.py: resolve_layer_indices`` counts every layer);
- Mamba / linear-attention layers hold a per-request state in a separate pool sized from
  ``mamba_full_memory_ratio`` (conv state bf16, SSM state float32 unless the config's
  ``mamba_ssm_dtype`` says otherwise: ``configs/mamba_utils.py: mamba2_state_dtype``).

Known limitations: CUDA only (``SGLANG_ENABLE_POST_CAPTURE_KV_SIZING`` off, its default), one
pipeline stage, no data-parallel attention, DCP, speculative decoding, HiCache/HiSparse, unified
memory pool, DSA indexers (DeepSeek-V3.2/V4), fp4/mxfp8 KV, multimodal reservations or
``--max-mamba-cache-size``; the per-tensor float32 all-reduce of free memory at TP > 1 is taken
as exact.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from memfit.errors import DoesNotFitError, MemfitError
from memfit.serving.kv_spec import LayerKV, text_config

__all__ = [
    "SGLANG_HYBRID_SWA_ARCHS",
    "SGLANG_KV_DTYPES",
    "SGLANG_SOURCE",
    "SGLANG_VERSION",
    "SGLangKVPool",
    "check_mem_fraction_static",
    "default_mem_fraction_static",
    "gpu_memory_defaults",
    "mamba_cache_per_req",
    "sglang_cell_size",
    "sglang_kv_dtype",
    "sglang_kv_tokens",
    "sglang_layers",
    "sglang_log_lines",
    "torch_dtype_name",
]

SGLANG_VERSION = "0.5.23"
"""The SGLang release whose arithmetic this module restates."""
SGLANG_SOURCE = ("sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl from PyPI (sha256 "
                 "00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937)")
"""Where the rules were read: file and function names in the docstrings refer to it."""

GIB = 1 << 30
MIB = 1 << 20

SGLANG_KV_DTYPES: dict[str, str] = {"auto": "auto", "fp8_e4m3": "fp8_e4m3",
                                    "fp8_e5m2": "fp8_e5m2", "bf16": "bfloat16",
                                    "bfloat16": "bfloat16"}
"""``--kv-cache-dtype`` values SGLang takes (``arg_groups/fields/model.py``) that are modelled,
and the :func:`~memfit.serving.kv_spec.kv_spec` name of each (mxfp8 and the fp4 recipes are
not modelled)."""

# The torch dtype SGLang names in its log for each KV dtype (mem_cache/kv_cache_dtype.py:
# configure_kv_cache_dtype; CUDA, not ROCm's fnuz).
_TORCH_NAMES = {"fp8_e4m3": "torch.float8_e4m3fn", "fp8_e5m2": "torch.float8_e5m2",
                "bfloat16": "torch.bfloat16", "float16": "torch.float16"}

SGLANG_HYBRID_SWA_ARCHS = frozenset({
    "BeamForCausalLM", "Llama4ForConditionalGeneration", "GptOssForCausalLM",
    "GraniteSWAForCausalLM", "GraniteMoeSWAForCausalLM", "IQuestQ1ForCausalLM", "MiMoV2ForCausalLM",
    "MiMoV2FlashForCausalLM", "Step3p5ForCausalLM", "Step3p7ForConditionalGeneration",
    "Gemma4ForCausalLM", "Gemma4ForConditionalGeneration", "LagunaForCausalLM",
    "MellumForCausalLM"})
"""Architectures whose sliding-window layers get their own (smaller) pool
(``configs/model_config.py: is_hybrid_swa_model``, the non-MTP, non-DeepSeek-V4 entries); any
other model keeps its sliding layers at full size in the one pool."""

# Prefill CUDA-graph token buckets (arg_groups/cuda_graph_hook.py:
# generate_prefill_cuda_graph_batch_sizes).
_PREFILL_BUCKETS = (list(range(4, 33, 4)) + list(range(48, 257, 16)) + list(range(288, 513, 32))
                    + list(range(576, 1025, 64)) + list(range(1280, 4097, 256)))


def _prefill_graph_sizes(max_bs: int) -> int:
    """How many prefill graphs SGLang captures up to ``max_bs`` tokens: the fixed buckets, then
    every 512 from 4608 (``generate_prefill_cuda_graph_batch_sizes``)."""
    return sum(1 for s in _PREFILL_BUCKETS if s <= max_bs) + len(range(4608, max_bs + 1, 512))


def gpu_memory_defaults(gpu_memory_bytes: int, tp: int = 1) -> tuple[int, int]:
    """``(chunked_prefill_size, cuda_graph_max_bs)`` SGLang picks for a GPU of this size
    (``arg_groups/memory_hook.py: handle_gpu_memory_settings``), by ``nvidia-smi``'s total in
    MiB: below 20 GiB (2048, 8); 20-35 GiB (4096, 48, or 160 at TP >= 4); 35-60 GiB (4096, 32 or
    160); 60-160 GiB (8192, 256 or 512); from 160 GiB (16384, 512).

    >>> gpu_memory_defaults(81559 * 2**20)  # H100 80GB
    (8192, 256)
    """
    mib = gpu_memory_bytes / MIB
    if mib < 20 * 1024:
        return 2048, 8
    if mib < 35 * 1024:
        return 4096, 48 if tp < 4 else 160
    if mib < 60 * 1024:
        return 4096, 32 if tp < 4 else 160
    if mib < 160 * 1024:
        return 8192, 256 if tp < 4 else 512
    return 16384, 512


def default_mem_fraction_static(gpu_memory_bytes: int, tp: int = 1, *, pp: int = 1,
                                chunked_prefill_size: int | None = None,
                                cuda_graph_max_bs: int | None = None,
                                max_running_requests: int | None = None,
                                max_prefill_tokens: int = 16384, mla: bool = False,
                                decode_cuda_graph: bool = True,
                                prefill_cuda_graph: bool = True) -> float:
    """SGLang's ``--mem-fraction-static`` when none is given
    (``arg_groups/memory_hook.py: handle_gpu_memory_settings``, the pre-capture branch), for a
    GPU whose ``nvidia-smi`` total is ``gpu_memory_bytes``::

        reserved_mib = 512 + 1.5 x max(chunked_prefill_size, 2048)
                       + tp x pp / 8 x 1024
                       + 2 x cuda_graph_max_bs                       (decode graphs)
                       + 8 x number of prefill graphs, or 1536 with MLA   (prefill graphs)
        reserved_mib = max(reserved_mib, 10240) on GPUs above 60 GiB
        mem_fraction_static = round((gpu_mib - reserved_mib) / gpu_mib, 3)

    ``chunked_prefill_size`` and ``cuda_graph_max_bs`` default by GPU size
    (:func:`gpu_memory_defaults`); a default ``cuda_graph_max_bs`` above
    ``max_running_requests`` is lowered to it; with chunked prefill off (``-1``) the activation
    term uses ``max_prefill_tokens``. The graph terms are ``reserve_for_graph_mb``: prefill graphs
    (breakable, SGLang's default on CUDA: ``model_executor/cuda_graph_config.py:
    default_prefill_backend``) are captured up to ``chunked_prefill_size`` tokens. Not modelled:
    DP attention, DeepEP, disaggregation, speculative decoding, vision models.

    >>> default_mem_fraction_static(81559 * 2**20, 1)  # H100 80GB, TP 1
    0.83
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise MemfitError(f"--tp must be a positive integer, got {tp!r}")
    mib = gpu_memory_bytes / MIB
    chunk_default, bs_default = gpu_memory_defaults(gpu_memory_bytes, tp)
    chunk = chunk_default if chunked_prefill_size is None else chunked_prefill_size
    max_bs = bs_default if cuda_graph_max_bs is None else cuda_graph_max_bs
    if cuda_graph_max_bs is None and max_running_requests is not None:
        max_bs = min(max_bs, max_running_requests)
    activation_tokens = max(chunk if chunk > 0 else max_prefill_tokens, 2048)
    reserved = 512 + activation_tokens * 1.5 + tp * pp / 8 * 1024
    if decode_cuda_graph:
        reserved += max_bs * 2
    if prefill_cuda_graph:
        reserved += 1.5 * 1024 if mla else _prefill_graph_sizes(chunk) * 8
    if mib > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    return round((mib - reserved) / mib, 3)


def sglang_kv_dtype(config: Mapping[str, Any], kv_cache_dtype: str) -> str:
    """The kv_spec dtype name for SGLang's ``--kv-cache-dtype``; ``auto`` is fp8 when the
    checkpoint's quantization says its KV is FP8 (``configure_kv_cache_dtype``)."""
    if kv_cache_dtype not in SGLANG_KV_DTYPES:
        raise MemfitError(f"--kv-cache-dtype {kv_cache_dtype!r} is not one SGLang takes (or is "
                          f"not modelled); valid: {', '.join(SGLANG_KV_DTYPES)}")
    quant = config.get("quantization_config")
    if kv_cache_dtype == "auto" and isinstance(quant, Mapping) and \
            str(quant.get("kv_cache_quant_algo", "")).upper() == "FP8":
        return "fp8_e4m3"
    return SGLANG_KV_DTYPES[kv_cache_dtype]


def torch_dtype_name(config: Mapping[str, Any], kv_dtype: str) -> str:
    """The torch dtype SGLang prints for the pool: the KV dtype, or for ``auto`` the model's
    (float32 checkpoints run in float16, Gemma's in bfloat16: ``configs/model_config.py:
    _get_and_verify_dtype``)."""
    if kv_dtype != "auto":
        return _TORCH_NAMES[kv_dtype]
    data = text_config(config)
    name = str(data.get("dtype") or data.get("torch_dtype") or "bfloat16").removeprefix("torch.")
    if name in ("float32", "float"):
        name = "bfloat16" if "gemma" in str(data.get("model_type", "")) else "float16"
    return _TORCH_NAMES.get({"half": "float16"}.get(name, name), "torch.bfloat16")


def sglang_layers(layers: Sequence[LayerKV], *, hybrid_swa: bool = False) -> list[LayerKV]:
    """The layers as SGLang's pools hold them: a shared-KV layer takes the shape of the layer it
    reads (SGLang allocates every layer); a sliding layer stays ``sliding`` only when
    ``hybrid_swa`` (else it is a full-size layer of the one pool)."""
    by_index = {layer.index: layer for layer in layers}
    out = []
    for layer in layers:
        if layer.kind == "shared":
            assert layer.shares_with is not None
            target = by_index[layer.shares_with]
            layer = LayerKV(index=layer.index, kind=target.kind, num_kv_heads=target.num_kv_heads,
                            head_size=target.head_size, head_size_v=target.head_size_v,
                            dtype_bytes=target.dtype_bytes, sliding_window=target.sliding_window)
        if layer.kind == "sliding" and not hybrid_swa:
            layer = LayerKV(index=layer.index, kind="full", num_kv_heads=layer.num_kv_heads,
                            head_size=layer.head_size, head_size_v=layer.head_size_v,
                            dtype_bytes=layer.dtype_bytes)
        out.append(layer)
    return out


def _pool_bytes_per_token(layers: Sequence[LayerKV], kinds: tuple[str, ...]) -> int:
    return sum(layer.bytes_per_token for layer in layers if layer.kind in kinds)


def sglang_cell_size(layers: Sequence[LayerKV], *, hybrid_swa: bool = False,
                     swa_full_tokens_ratio: float = 0.8) -> float:
    """Bytes per token of ``max_total_num_tokens`` on one TP rank (SGLang's ``cell_size``).

    One pool (``DefaultPoolConfigurator._compute_cell_size``): the sum over the attention
    layers of ``kv_heads x (head_dim + v_head_dim) x dtype`` (MLA ``(kv_lora_rank +
    qk_rope_head_dim) x dtype``); Mamba / linear layers add nothing per token. Hybrid SWA
    (``HybridSWAPoolConfigurator._recompute_cell_size``): ``full + swa_full_tokens_ratio x
    swa`` (a float), or the SWA layers alone when no layer is full.

    >>> from memfit.serving.kv_spec import kv_spec
    >>> llama = {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32,
    ...          "num_key_value_heads": 8, "num_hidden_layers": 32, "torch_dtype": "bfloat16"}
    >>> sglang_cell_size(kv_spec(llama))  # 8 x (128 + 128) x 32 x 2
    131072
    """
    pool = sglang_layers(layers, hybrid_swa=hybrid_swa)
    full = _pool_bytes_per_token(pool, ("full", "mla"))
    swa = _pool_bytes_per_token(pool, ("sliding",))
    if not swa:
        return full
    if not full:
        return swa
    return full + swa_full_tokens_ratio * swa


def mamba_cache_per_req(layers: Sequence[LayerKV], *, conv_dtype_bytes: int = 2,
                        ssm_dtype_bytes: int = 4) -> int:
    """One request's Mamba / linear-attention state over every state layer
    (``configs/mamba_utils.py: BaseLinearStateParams.mamba_cache_per_req``): the conv state in
    ``SGLANG_MAMBA_CONV_DTYPE`` (bfloat16), the SSM state in ``mamba_ssm_dtype`` (float32 unless
    the config or ``SGLANG_MAMBA_SSM_DTYPE`` says otherwise); the shapes are kv_spec's (the
    same element counts as ``Mamba2StateShape.create``)."""
    total = 0
    for layer in layers:
        if layer.kind in ("mamba", "linear"):
            conv, *ssm = layer.state_shapes
            total += math.prod(conv) * conv_dtype_bytes + \
                sum(math.prod(s) for s in ssm) * ssm_dtype_bytes
    return total


@dataclass(frozen=True, kw_only=True)
class SGLangKVPool:
    """SGLang's pools on one TP rank for a memory budget.

    Known limitations: see the module docstring (CUDA, one stage, no DP attention or
    speculative decoding).
    """

    cell_size: float
    """Bytes per token of ``max_total_num_tokens`` (a float under hybrid SWA)."""
    kv_budget_bytes: int
    """``int(rest_memory x 2**30)``: the bytes left for KV after the slack and any Mamba pool."""
    max_total_num_tokens: int
    full_tokens: int
    """Tokens of the full-attention pool (``max_total_num_tokens``)."""
    swa_tokens: int
    """Tokens of the sliding-window pool under hybrid SWA (``int(full x ratio)`` paged), else 0."""
    page_size: int
    max_running_requests: int
    max_mamba_cache_size: int
    mamba_per_req_bytes: int
    full_k_bytes: int
    """K buffers of the full pool: ``(tokens + page_size)`` rows (one padding page) x the
    layers' K bytes (``MHATokenToKVPool._kv_buffer_shapes``); MLA's latent is here, V is 0."""
    full_v_bytes: int
    swa_k_bytes: int
    swa_v_bytes: int
    mamba_conv_bytes: int
    mamba_ssm_bytes: int
    mla: bool

    @property
    def kv_bytes(self) -> int:
        """Every KV buffer SGLang allocates (padding pages included)."""
        return self.full_k_bytes + self.full_v_bytes + self.swa_k_bytes + self.swa_v_bytes


def check_mem_fraction_static(mem_fraction_static: float) -> float:
    if isinstance(mem_fraction_static, bool) or not isinstance(mem_fraction_static, int | float) \
            or not 0 < mem_fraction_static <= 1:
        raise MemfitError(f"--mem-fraction-static must be in (0, 1], got {mem_fraction_static!r}")
    return float(mem_fraction_static)


def _split_tokens(tokens: int, full_layers: list[LayerKV], swa_layers: list[LayerKV], *,
                  page_size: int, swa_full_tokens_ratio: float) -> tuple[int, int]:
    """The pool's (full, SWA) tokens: a hybrid model's SWA pool is ``swa_full_tokens_ratio`` of
    the full one (paged) and must hold one request's window plus a page."""
    if swa_layers and full_layers:
        full_tokens = tokens
        swa_tokens = int(full_tokens * swa_full_tokens_ratio) // page_size * page_size
        window = max(layer.sliding_window or 0 for layer in swa_layers)
        if window + page_size >= swa_tokens:
            raise MemfitError(
                f"SWA pool ({swa_tokens} tokens) cannot hold one request (sliding window "
                f"{window} + page {page_size}); SGLang refuses to start "
                "(MemoryPoolConfigurator.validate_swa_pool_size): raise "
                "--swa-full-tokens-ratio or the KV budget")
    elif swa_layers:
        full_tokens, swa_tokens = 0, tokens
    else:
        full_tokens, swa_tokens = tokens, 0
    return full_tokens, swa_tokens


def _mamba_state_bytes(pool: Sequence[LayerKV], slots: int, *,
                       ssm_dtype_bytes: int) -> tuple[int, int]:
    """The Mamba / linear-attention state buffers of ``slots`` requests: (conv, ssm) bytes."""
    conv = ssm = 0
    for layer in pool:
        if layer.kind in ("mamba", "linear"):
            conv_shape, *ssm_shapes = layer.state_shapes
            conv += slots * math.prod(conv_shape) * 2
            ssm += slots * sum(math.prod(s) for s in ssm_shapes) * ssm_dtype_bytes
    return conv, ssm


def sglang_kv_tokens(layers: Sequence[LayerKV], *, available_bytes_after_weights: int,
                     total_bytes: int, mem_fraction_static: float, page_size: int = 1,
                     hybrid_swa: bool = False, swa_full_tokens_ratio: float = 0.8,
                     context_len: int | None = None, max_total_tokens: int | None = None,
                     max_running_requests: int | None = None,
                     mamba_full_memory_ratio: float = 0.9, mamba_slots_per_request: int = 3,
                     mamba_ssm_dtype_bytes: int = 4) -> SGLangKVPool:
    """SGLang's pool sizes on one TP rank.

    ``total_bytes`` is SGLang's ``pre_model_load_memory``: the free GPU memory before the
    weights load (the card's memory less CUDA context, NCCL and anything else resident);
    ``available_bytes_after_weights`` the free memory after they load (the ``avail mem`` of
    "Load weight end"). Then (``_profile_available_bytes``, GiB floats)::

        rest = available_after_weights - total x (1 - mem_fraction_static)
        Mamba (auto-sized, _handle_max_mamba_cache):
            max_mamba_cache_size = int((rest x r / (1 + r) x 2**30 - per_req) // per_req)
            rest -= (max_mamba_cache_size + 1) x per_req          (r = mamba_full_memory_ratio)
        kv_budget = int(rest x 2**30)
        max_total_num_tokens = kv_budget // cell_size // page_size x page_size
                               (then min(., max_total_tokens), paged again)
        hybrid SWA: swa_tokens = int(tokens x swa_full_tokens_ratio) // page_size x page_size
        max_running_requests = min(requested or max(min(int(tokens / context_len x 512), 4096),
                                   2048), tokens // 2, max_mamba_cache_size // slots)

    (``resolve_max_num_reqs``; ``mamba_slots_per_request`` is ``_calculate_mamba_ratio``: 3
    with the radix cache on and no extra buffer). ``context_len`` is needed only for the
    default ``max_running_requests``; SGLang does not clamp the pool to it (it warns when the
    pool holds fewer tokens than one context). Raises MemfitError where SGLang refuses to start.
    """
    fraction = check_mem_fraction_static(mem_fraction_static)
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise MemfitError(f"--page-size must be a positive integer, got {page_size!r}")
    pool = sglang_layers(layers, hybrid_swa=hybrid_swa)
    if not any(layer.kind in ("full", "sliding", "mla") for layer in pool):
        raise MemfitError("the model has no attention layers; SGLang's KV pool needs one")
    pre_load = total_bytes / GIB
    avail = available_bytes_after_weights / GIB
    rest = avail - pre_load * (1 - fraction)
    per_req = mamba_cache_per_req(pool, ssm_dtype_bytes=mamba_ssm_dtype_bytes)
    max_mamba = 0
    if per_req:
        budget = rest * mamba_full_memory_ratio / (1 + mamba_full_memory_ratio) * GIB
        max_mamba = int((budget - per_req) // per_req)
        if max_mamba <= 0:
            raise DoesNotFitError(
                f"not enough GPU memory for the Mamba state cache (max_mamba_cache_size="
                f"{max_mamba}); SGLang refuses to start: raise --mem-fraction-static or use a "
                "GPU with more memory")
        rest -= (max_mamba + 1) * per_req / GIB
    if rest <= 0:
        minimum = 1 - avail / pre_load if pre_load else 1.0
        raise DoesNotFitError(
            f"the weights leave no GPU memory for the KV cache under --mem-fraction-static="
            f"{fraction}; SGLang refuses to start: raise --mem-fraction-static above "
            f"{math.ceil(minimum * 1000) / 1000:.3f}")
    kv_budget = int(rest * GIB)
    cell = sglang_cell_size(pool, hybrid_swa=hybrid_swa,
                            swa_full_tokens_ratio=swa_full_tokens_ratio)
    tokens = int(kv_budget // cell) // page_size * page_size
    if max_total_tokens is not None:
        tokens = min(tokens, max_total_tokens) // page_size * page_size
    if tokens <= 0:
        raise MemfitError(f"not enough memory for one KV page (max_total_num_tokens={tokens}); "
                          "SGLang refuses to start: increase --mem-fraction-static")
    full_layers = [layer for layer in pool if layer.kind in ("full", "mla")]
    swa_layers = [layer for layer in pool if layer.kind == "sliding"]
    full_tokens, swa_tokens = _split_tokens(tokens, full_layers, swa_layers, page_size=page_size,
                                            swa_full_tokens_ratio=swa_full_tokens_ratio)
    if max_running_requests is not None:
        reqs = min(max_running_requests, tokens // 2)
    else:
        if context_len is None:
            raise MemfitError("pass context_len (the model's context) or max_running_requests")
        reqs = min(max(min(int(tokens / context_len * 512), 4096), 2048), tokens // 2)
    if per_req:
        reqs = min(reqs, max_mamba // mamba_slots_per_request)
    rows_full, rows_swa = full_tokens + page_size, swa_tokens + page_size

    def k_v(rows: int, group: list[LayerKV]) -> tuple[int, int]:
        k = sum(layer.num_kv_heads * layer.head_size * layer.dtype_bytes for layer in group)
        v = sum(layer.num_kv_heads * layer.head_size_v * layer.dtype_bytes for layer in group)
        return rows * k, rows * v

    full_k, full_v = k_v(rows_full, full_layers) if full_layers else (0, 0)
    swa_k, swa_v = k_v(rows_swa, swa_layers) if swa_layers else (0, 0)
    conv, ssm = _mamba_state_bytes(pool, max_mamba + 1, ssm_dtype_bytes=mamba_ssm_dtype_bytes)
    return SGLangKVPool(
        cell_size=cell, kv_budget_bytes=kv_budget, max_total_num_tokens=tokens,
        full_tokens=full_tokens, swa_tokens=swa_tokens, page_size=page_size,
        max_running_requests=reqs, max_mamba_cache_size=max_mamba, mamba_per_req_bytes=per_req,
        full_k_bytes=full_k, full_v_bytes=full_v, swa_k_bytes=swa_k, swa_v_bytes=swa_v,
        mamba_conv_bytes=conv, mamba_ssm_bytes=ssm,
        mla=any(layer.kind == "mla" for layer in pool))


def sglang_log_lines(pool: SGLangKVPool, *, dtype_name: str = "torch.bfloat16",
                     chunked_prefill_size: int | None = None, max_prefill_tokens: int = 16384,
                     context_len: int | None = None,
                     available_gpu_mem_bytes: int | None = None) -> list[str]:
    """The startup lines SGLang logs for ``pool``, formatted as it formats them:

    - hybrid SWA: "Use sliding window memory pool. full_layer_tokens=F, swa_layer_tokens=S"
      (``HybridSWAPoolConfigurator._solve_pool_sizes``);
    - Mamba: "Mamba Cache is allocated. max_mamba_cache_size: N, conv_state size: X.XXGB,
      ssm_state size: Y.YYGB " (``mem_cache/memory_pool.py: MambaPool.__init__``);
    - "[Full |SWA ]KV Cache is allocated. dtype: D, #tokens: N, K size: X.XX GB, V size: Y.YY
      GB" (MLA: "KV size: X.XX GB"; ``KVCache._finalize_allocation_log``, GB = 2**30 bytes);
    - "max_total_num_tokens=N, chunked_prefill_size=C, max_prefill_tokens=P,
      max_running_requests=R, context_len=L, available_gpu_mem=X.XX GB"
      (``managers/scheduler.py``), when ``context_len`` is given; ``available_gpu_mem`` is
      measured after CUDA-graph capture, so it is printed only when given.
    """
    lines = []
    if pool.swa_tokens and pool.full_tokens:
        lines.append(f"Use sliding window memory pool. full_layer_tokens={pool.full_tokens}, "
                     f"swa_layer_tokens={pool.swa_tokens}")
    if pool.mamba_per_req_bytes:
        lines.append(f"Mamba Cache is allocated. max_mamba_cache_size: "
                     f"{pool.max_mamba_cache_size}, conv_state size: "
                     f"{pool.mamba_conv_bytes / GIB:.2f}GB, ssm_state size: "
                     f"{pool.mamba_ssm_bytes / GIB:.2f}GB ")
    hybrid = bool(pool.swa_tokens and pool.full_tokens)
    pools = [("Full " if hybrid else "", pool.full_tokens, pool.full_k_bytes, pool.full_v_bytes),
             ("SWA " if hybrid else "", pool.swa_tokens, pool.swa_k_bytes, pool.swa_v_bytes)]
    for label, tokens, k, v in pools:
        if not (k or v):
            continue
        head = f"{label}KV Cache is allocated. dtype: {dtype_name}, #tokens: {tokens}, "
        if pool.mla:
            lines.append(head + f"KV size: {k / GIB:.2f} GB")
        else:
            lines.append(head + f"K size: {k / GIB:.2f} GB, V size: {v / GIB:.2f} GB")
    if context_len is not None:
        line = (f"max_total_num_tokens={pool.max_total_num_tokens}, chunked_prefill_size="
                f"{chunked_prefill_size}, max_prefill_tokens={max_prefill_tokens}, "
                f"max_running_requests={pool.max_running_requests}, context_len={context_len}")
        if available_gpu_mem_bytes is not None:
            line += f", available_gpu_mem={available_gpu_mem_bytes / GIB:.2f} GB"
        lines.append(line)
    return lines
