"""vLLM's KV-cache arithmetic: layer specs -> pages -> groups -> blocks -> tokens and concurrency.

Each rule below restates one function of vLLM's V1 engine, named in its docstring as
``file: function``; the version is :data:`VLLM_VERSION`, read in its PyPI source distribution
(:data:`VLLM_SOURCE`). Everything here is plain integer arithmetic on :class:`EngineLayerSpec`
(vLLM's ``KVCacheSpec`` subclasses, one per layer that holds cache); nothing imports vLLM or
torch.

The pipeline, as ``vllm/v1/core/kv_cache_planning.py: get_kv_cache_configs`` runs it for one
worker (no pipeline parallelism):

1. :func:`kv_cache_groups` (``get_kv_cache_groups``): one group when every layer has the same
   spec, one group of per-layer pages when every layer is the same *type* (all full attention,
   or all sliding with one window), else pages unified and layers split into equal-size groups;
2. :func:`num_gpu_blocks` (``get_kv_cache_config_from_groups``): the bytes given divided by the
   bytes of one block over all the layers that share it (:func:`bytes_per_block`);
3. :func:`max_concurrency` and :func:`kv_cache_tokens` (``vllm/v1/core/kv_cache_utils.py:
   get_max_concurrency_for_kv_cache_config``, ``get_kv_cache_capacity``): the line vLLM logs,
   "GPU KV cache size: N tokens, Maximum concurrency for L tokens per request: X.XXx";
4. :func:`max_memory_usage_bytes`, :func:`fits` and :func:`max_model_len_that_fits`
   (``_max_memory_usage_bytes_from_groups``, ``_check_enough_kv_cache_memory``,
   ``_estimate_max_model_len_from_groups``): the startup check that one request of
   ``max_model_len`` tokens fits beside the null block, and the largest that does.

Known limitations: no pipeline or decode-context parallelism (one worker's layers), no
``num_gpu_blocks_override``, no ``--disable-hybrid-kv-cache-manager``, no chunked-local
(Llama-4) attention, no per-token-head or nvfp4 KV, no
hisparse host pool. Mixed page sizes follow ``unify_kv_cache_spec_page_size`` (a layer-outer KV
layout); a block-outermost layout packs them instead (``_get_packed_kv_cache_groups``), which
is not modelled. Kernel block-stride alignment is taken as 1 byte (the case when the backend
runs the block size unsplit).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from memfit.errors import MemfitError

__all__ = ["VLLM_SOURCE", "VLLM_VERSION", "EngineLayerSpec", "KVCacheGroup", "MambaCacheMode",
           "SpecKind", "align_hybrid_block_size", "bytes_per_block",
           "fits", "kv_cache_groups", "kv_cache_tokens", "mamba_prefill_checkpoints",
           "max_concurrency", "max_memory_usage_bytes", "max_model_len_that_fits",
           "num_gpu_blocks"]

VLLM_VERSION = "0.33.0"
"""The vLLM release whose arithmetic this module restates."""
VLLM_SOURCE = ("vllm-0.33.0.tar.gz from PyPI (sha256 f4c33c2503d52bb411146afa9618a4f48bed68912f6"
               "17e6803ac8d76e4c74112)")
"""Where the rules were read: file and function names in the docstrings refer to it."""

SpecKind = Literal["full", "sliding", "mla", "mamba"]

MambaCacheMode = Literal["none", "align"]
"""``CacheConfig.mamba_cache_mode`` (``vllm/config/cache.py``: ``Literal["align", "none"]``;
0.33 has no ``all``): ``align`` whenever prefix caching is on, ``none`` when it is off
(``vllm/model_executor/models/config.py: MambaModelConfig.verify_and_update_config``)."""


def cdiv(a: int, b: int) -> int:
    """``vllm/utils/math_utils.py: cdiv``: ceiling division."""
    return -(a // -b)


@dataclass(frozen=True, kw_only=True)
class EngineLayerSpec:
    """One cache-holding layer as vLLM's KV cache manager sees it, on one TP rank.

    ``kind`` picks the ``KVCacheSpec`` subclass (``vllm/v1/kv_cache_interface.py``):
    ``full`` is ``FullAttentionSpec``, ``sliding`` ``SlidingWindowSpec``, ``mla``
    ``MLAAttentionSpec``, ``mamba`` ``MambaSpec``. Two layers with equal fields are one spec
    (vLLM groups layers by spec equality: ``kv_cache_planning.py:
    _get_kv_cache_groups_uniform_page_size``).
    """

    kind: SpecKind
    block_size: int
    """Tokens per block (``--block-size``); for ``mamba`` the tokens one state page stands for."""
    num_kv_heads: int = 0
    head_size: int = 0
    head_size_v: int = 0
    dtype_bytes: int = 0
    sliding_window: int | None = None
    state_bytes: int = 0
    """``mamba``: the bytes of one request's state (every state tensor, all dtypes)."""
    checkpoint_blocks: int = 0
    """``mamba``: ``MambaSpec.num_prefill_checkpoint_blocks``, the extra state page a layer that
    exports prefill checkpoints keeps per request in ``align`` mode
    (:func:`mamba_prefill_checkpoints`)."""
    page_size_padded: int | None = None
    """A page padded up to another spec's page (``unify_kv_cache_spec_page_size``), or None."""
    speculative_blocks: int = 0
    """``mamba``: ``MambaSpec.num_speculative_blocks``, ``num_speculative_tokens`` state pages
    more per request under speculative decoding (:mod:`memfit.serving.speculative`)."""
    extra_retained_tokens: int = 0
    """``sliding``: ``SlidingWindowSpec.extra_retained_tokens``, tokens kept below the window
    for multi-module MTP's re-prefill (``K - 1``; else 0)."""

    @property
    def real_page_size_bytes(self) -> int:
        """``AttentionSpec.unpadded_page_size_bytes``: ``num_kv_heads x block_size x
        (head_size + head_size_v) x dtype`` (one state per token; MLA's ``head_size_v`` is 0:
        one latent, no separate V, ``MLAAttentionSpec``); Mamba the state's bytes
        (``MambaSpec.page_size_bytes``)."""
        if self.kind == "mamba":
            return self.state_bytes
        return (self.num_kv_heads * self.block_size * (self.head_size + self.head_size_v)
                * self.dtype_bytes)

    @property
    def page_size_bytes(self) -> int:
        """``AttentionSpec.page_size_bytes`` / ``MambaSpec.page_size_bytes``: the padded page
        where one is set, else the real one."""
        if self.page_size_padded is not None:
            return self.page_size_padded
        return self.real_page_size_bytes

    def max_memory_usage_bytes(self, max_model_len: int, max_in_flight_tokens: int,
                               mamba_cache_mode: MambaCacheMode = "none") -> int:
        """The most one request can hold in this layer:

        - full / MLA (``FullAttentionSpec.max_memory_usage_bytes``):
          ``cdiv(max_model_len, block_size) x page``;
        - sliding (``SlidingWindowSpec.max_admission_blocks_per_request``):
          ``(cdiv(min(window - 1 + extra_retained + max_in_flight_tokens, max_model_len),
          block_size) + 1) x page`` (the window need not start at a block boundary);
        - Mamba (``MambaSpec.max_memory_usage_bytes``): ``1 + speculative_blocks`` pages; with
          ``mamba_cache_mode`` ``align``, ``2 + speculative_blocks + checkpoint_blocks`` (the
          running state, the last block boundary's, one per draft token, and a prefill
          checkpoint's).
        """
        page = self.page_size_bytes
        if self.kind == "sliding":
            assert self.sliding_window is not None
            tokens = min(self.sliding_window - 1 + self.extra_retained_tokens
                         + max_in_flight_tokens, max_model_len)
            return (cdiv(tokens, self.block_size) + 1) * page
        if self.kind == "mamba":
            base = 2 + self.checkpoint_blocks if mamba_cache_mode == "align" else 1
            return page * (base + self.speculative_blocks)
        return cdiv(max_model_len, self.block_size) * page

    def same_type(self, other: EngineLayerSpec) -> bool:
        """``UniformTypeKVCacheSpecs.is_uniform_type`` for two layers: one block size, and both
        full attention (``KVCacheSpec.is_uniform_with_collection``: the registered base class,
        ``FullAttentionSpec`` or ``MLAAttentionSpec``), both sliding with one window
        (``SlidingWindowSpec.is_uniform_with_collection``), or both Mamba."""
        if self.block_size != other.block_size:
            return False
        if self.kind == "sliding":
            return other.kind == "sliding" and other.sliding_window == self.sliding_window
        return other.kind == self.kind


@dataclass(frozen=True, kw_only=True)
class KVCacheGroup:
    """``KVCacheGroupSpec``: layers that share one block table.

    ``specs`` holds one spec per layer; ``uniform_type`` marks vLLM's
    ``UniformTypeKVCacheSpecs`` (one group whose layers differ in page size), whose page is the
    sum of its layers' pages.
    """

    layers: tuple[int, ...]
    specs: tuple[EngineLayerSpec, ...]
    uniform_type: bool = False

    @property
    def spec(self) -> EngineLayerSpec:
        return self.specs[0]

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def page_size_bytes(self) -> int:
        """The group spec's page: one layer's page, or (uniform type) the sum over its layers
        (``UniformTypeKVCacheSpecs.page_size_bytes``)."""
        if self.uniform_type:
            return sum(s.page_size_bytes for s in self.specs)
        return self.spec.page_size_bytes

    def blocks_per_request(self, max_model_len: int, max_in_flight_tokens: int,
                           mamba_cache_mode: MambaCacheMode = "none") -> int:
        """Blocks of this group one request of ``max_model_len`` tokens takes:
        ``cdiv(spec most, spec page)``, for a uniform-type group the most any of its layers
        takes (``UniformTypeKVCacheSpecs.max_memory_usage_pages``)."""
        return max(cdiv(s.max_memory_usage_bytes(max_model_len, max_in_flight_tokens,
                                                 mamba_cache_mode), s.page_size_bytes)
                   for s in (self.specs if self.uniform_type else self.specs[:1]))


def _unify_page_size(specs: list[EngineLayerSpec]) -> list[EngineLayerSpec]:
    """``kv_cache_planning.py: unify_kv_cache_spec_page_size``: every page grows to the largest,
    an attention page by multiplying its block size when it divides the largest, else (non-MLA
    attention, and Mamba whose page does not scale with the block) by padding; an MLA page that
    does not divide is refused."""
    largest = max(s.page_size_bytes for s in specs)
    out = []
    for s in specs:
        if s.page_size_bytes == largest:
            out.append(s)
        elif s.kind == "mamba":
            out.append(replace(s, page_size_padded=largest))
        elif largest % s.page_size_bytes == 0:
            # AttentionSpec.copy_with_new_block_size: no padded page to scale here
            out.append(replace(s, block_size=s.block_size * (largest // s.page_size_bytes)))
        elif s.kind != "mla":
            out.append(replace(s, page_size_padded=largest))
        else:
            raise MemfitError(
                f"vLLM cannot unify this model's KV pages (an MLA page of {s.page_size_bytes} B "
                f"does not divide {largest} B: kv_cache_planning.py: "
                "unify_kv_cache_spec_page_size raises NotImplementedError); try another "
                "--block-size")
    return out


def kv_cache_groups(layers: Sequence[int], specs: Sequence[EngineLayerSpec]) -> list[KVCacheGroup]:
    """``kv_cache_planning.py: get_kv_cache_groups`` (hybrid KV cache manager on).

    ``layers`` are the layer indices holding cache, ``specs`` their specs (same order). Rules:

    - every spec equal (``is_kv_cache_spec_uniform``): one group of all layers;
    - every spec of one type (``UniformTypeKVCacheSpecs.from_specs``): one group whose page is
      the sum of the layers' pages;
    - else ``unify_kv_cache_spec_page_size`` then ``_get_kv_cache_groups_uniform_page_size``:
      layers grouped by spec in order of first appearance; the group size is the fewest layers
      of any spec, or the most when the most is under 1.5 x the fewest; each spec's layers are
      split into ``cdiv(n, group_size)`` groups, group ``i`` taking ``layers[i::n_groups]``.

    >>> full = EngineLayerSpec(kind="full", block_size=16, num_kv_heads=8, head_size=128,
    ...                        head_size_v=128, dtype_bytes=2)
    >>> [g.layers for g in kv_cache_groups([0, 1, 2], [full] * 3)]
    [(0, 1, 2)]
    """
    if len(layers) != len(specs):
        raise ValueError("one spec per layer")
    if not specs:
        return []
    if all(s == specs[0] for s in specs):
        return [KVCacheGroup(layers=tuple(layers), specs=tuple(specs))]
    if all(specs[0].same_type(s) for s in specs):
        return [KVCacheGroup(layers=tuple(layers), specs=tuple(specs), uniform_type=True)]
    unified = _unify_page_size(list(specs))
    by_spec: dict[EngineLayerSpec, list[int]] = {}
    for layer, spec in zip(layers, unified, strict=True):
        by_spec.setdefault(spec, []).append(layer)
    counts = [len(v) for v in by_spec.values()]
    group_size = min(counts)
    if max(counts) < min(counts) * 1.5:
        group_size = max(counts)
    groups = []
    for spec, members in by_spec.items():
        n_groups = cdiv(len(members), group_size)
        for i in range(n_groups):
            part = members[i::n_groups]
            groups.append(KVCacheGroup(layers=tuple(part), specs=(spec,) * len(part)))
    return groups


def align_hybrid_block_size(attn_bytes_per_token: int, mamba_page: int, block_size: int, *,
                            kernel_block: int = 16,
                            checkpoint_alignment: int | None = None) -> tuple[int, int | None]:
    """A hybrid attention/Mamba model's attention block size and padded Mamba page
    (``vllm/platforms/interface.py: Platform._align_hybrid_block_size``): the smallest multiple
    of the kernel alignment whose attention page holds the Mamba state, rounded up to a
    multiple of ``kernel_block``; ``--block-size`` grows to it when smaller (vllm #54458), and
    the Mamba page is padded to the attention page.

    The kernel alignment is ``max(kernel_block, block_size)``; with ``mamba_cache_mode``
    ``align`` (prefix caching) it is also a multiple of the Mamba layers' prefill-checkpoint
    alignment, ``lcm(alignment, checkpoint_alignment or 1)`` (``checkpoint_alignment`` from
    :func:`mamba_prefill_checkpoints`; pass None without prefix caching). In ``align`` mode the
    Mamba block is this block size too (``cache_config.mamba_block_size = block_size``).

    ``kernel_block`` is the attention backend's smallest kernel block: 16 for FlashAttention
    (``flash_attn.py: get_supported_kernel_block_sizes``, ``MultipleOf(16)``; its FA4 head-dim-
    256 and fp8 variants on SM90+ differ).

    >>> align_hybrid_block_size(2048, 1097728, 16)  # Qwen3-Next-like: 16 x cdiv(1097728, 32768)
    (544, 1114112)
    >>> align_hybrid_block_size(2048, 1097728, 16, checkpoint_alignment=64)  # 64 x 9
    (576, 1179648)
    """
    alignment = max(kernel_block, block_size)
    alignment = math.lcm(alignment, checkpoint_alignment or 1)
    attn_block = alignment * cdiv(mamba_page, alignment * attn_bytes_per_token)
    attn_block = kernel_block * cdiv(attn_block, kernel_block)
    block_size = max(block_size, attn_block)
    attn_page = block_size * attn_bytes_per_token
    return block_size, (None if attn_page == mamba_page else attn_page)


FLASHINFER_GDN_CHECKPOINT_ALIGNMENT = 64
"""``vllm/v1/attention/backends/gdn_attn.py: FLASHINFER_GDN_CHECKPOINT_ALIGNMENT``."""


def mamba_prefill_checkpoints(model_type: str, *, mamba_cache_mode: MambaCacheMode,
                              compute_capability: str | None,
                              linear_key_head_dim: int | None = None) -> tuple[int | None, int]:
    """The Mamba layers' prefill-checkpoint alignment (tokens, or None) and
    ``num_prefill_checkpoint_blocks``, as each model's state layer declares them:

    - Jamba's ``MambaMixer`` (``mamba_mixer.py``): neither (``MambaBase``'s defaults: None, 0);
    - Nemotron-H's ``MambaMixer2`` (``mamba_mixer2.py: MambaMixer2.get_kv_cache_spec``): one
      checkpoint block, no alignment (``get_prefill_checkpoint_alignment`` is ``MambaBase``'s
      None);
    - Qwen3-Next's ``QwenGatedDeltaNetAttention`` (``gdn/qwen_gdn_linear_attn.py``): in
      ``align`` mode with the FlashInfer GDN prefill kernel, an alignment of
      :data:`FLASHINFER_GDN_CHECKPOINT_ALIGNMENT` (``__init__``) and one checkpoint block
      (``get_kv_cache_spec``); else neither. ``_resolve_gdn_prefill_backend`` picks FlashInfer
      on SM90, and on SM10x / SM12x when ``linear_key_head_dim`` is 128 and the CUDA runtime is
      13 or newer (vLLM 0.33's wheels: torch 2.14.0+cu130, so taken as met); Triton elsewhere
      (SM80, SM89, ROCm). Without a GPU (``compute_capability`` None) Hopper is assumed, as the
      parity bench's FlashAttention backend is.

    ``get_mamba_prefill_checkpoint_alignment`` (``mamba/abstract.py``) is the LCM over the
    layers, None unless every layer declares one; one model has one kind of state layer here.

    >>> mamba_prefill_checkpoints("qwen3_next", mamba_cache_mode="align",
    ...                           compute_capability="9.0", linear_key_head_dim=128)
    (64, 1)
    >>> mamba_prefill_checkpoints("qwen3_next", mamba_cache_mode="align",
    ...                           compute_capability="8.0", linear_key_head_dim=128)
    (None, 0)
    """
    if model_type == "nemotron_h":
        return None, 1
    if model_type != "qwen3_next" or mamba_cache_mode != "align":
        return None, 0
    cc = compute_capability or "9.0"
    major, _, minor = cc.partition(".")
    if not (major.isdigit() and minor.isdigit()):  # a ROCm gfx target: Triton / FlyDSL
        return None, 0
    flashinfer = (int(major), int(minor)) == (9, 0) or (
        int(major) in (10, 12) and linear_key_head_dim == 128)
    if not flashinfer:
        return None, 0
    return FLASHINFER_GDN_CHECKPOINT_ALIGNMENT, 1


def bytes_per_block(groups: Sequence[KVCacheGroup]) -> int:
    """The bytes one block takes over every layer that shares it
    (``kv_cache_planning.py: _get_kv_cache_bytes_per_block``): the largest group's sum of its
    layers' pages (padding layers of a smaller group included, as the largest group sets the
    pool's width)."""
    return max(sum(s.page_size_bytes for s in g.specs) for g in groups)


def num_gpu_blocks(groups: Sequence[KVCacheGroup], available_bytes: int) -> int:
    """``kv_cache_planning.py: get_kv_cache_config_from_groups``:
    ``available_memory // bytes_per_block``; an attention-free model gets 1 (the null block)."""
    if not groups:
        return 1
    return max(available_bytes // bytes_per_block(groups), 0)


def _blocks_per_request(groups: Sequence[KVCacheGroup], max_model_len: int,
                        max_in_flight_tokens: int, mamba_cache_mode: MambaCacheMode) -> int:
    return sum(g.blocks_per_request(max_model_len, max_in_flight_tokens, mamba_cache_mode)
               for g in groups)


def max_concurrency(groups: Sequence[KVCacheGroup], num_blocks: int, max_model_len: int, *,
                    max_in_flight_tokens: int,
                    mamba_cache_mode: MambaCacheMode = "none") -> float:
    """"Maximum concurrency for L tokens per request: X.XXx"
    (``vllm/v1/core/kv_cache_utils.py: get_max_concurrency_for_kv_cache_config``):
    ``num_blocks / sum over groups of cdiv(group most, group page)`` (every group draws its
    blocks from one pool)."""
    if not groups:
        return 0.0
    return num_blocks / _blocks_per_request(groups, max_model_len, max_in_flight_tokens,
                                            mamba_cache_mode)


def kv_cache_tokens(max_concurrency_: float, max_model_len: int) -> int:
    """"GPU KV cache size: N tokens" (``vllm/v1/core/kv_cache_utils.py:
    get_kv_cache_capacity``): ``int(max_concurrency x max_model_len)``, the tokens of context
    the pool holds at ``max_model_len`` per request (with sliding-window groups, more than
    blocks x block size per group; vllm #51041)."""
    return int(max_concurrency_ * max_model_len)


def max_memory_usage_bytes(groups: Sequence[KVCacheGroup], max_model_len: int, *,
                           max_in_flight_tokens: int,
                           mamba_cache_mode: MambaCacheMode = "none") -> int:
    """The bytes one request of ``max_model_len`` tokens needs
    (``kv_cache_planning.py: _max_memory_usage_bytes_from_groups``):
    ``bytes_per_block x sum over groups of the group's blocks per request``."""
    if not groups:
        return 0
    return bytes_per_block(groups) * _blocks_per_request(groups, max_model_len,
                                                         max_in_flight_tokens, mamba_cache_mode)


def fits(groups: Sequence[KVCacheGroup], available_bytes: int, max_model_len: int, *,
         max_in_flight_tokens: int, mamba_cache_mode: MambaCacheMode = "none") -> bool:
    """Whether vLLM starts (``kv_cache_planning.py: get_kv_cache_configs`` then
    ``_check_enough_kv_cache_memory``): the bytes left after the null block the block pool
    holds back (``available - bytes_per_block``) are positive and hold one request of
    ``max_model_len`` tokens."""
    if not groups:
        return True
    check = available_bytes - bytes_per_block(groups)
    return check > 0 and max_memory_usage_bytes(
        groups, max_model_len, max_in_flight_tokens=max_in_flight_tokens,
        mamba_cache_mode=mamba_cache_mode) <= check


def max_model_len_that_fits(groups: Sequence[KVCacheGroup], available_bytes: int,
                            upper: int, *, max_in_flight_tokens: int,
                            mamba_cache_mode: MambaCacheMode = "none") -> int:
    """The largest ``max_model_len`` in ``[1, upper]`` whose one request fits beside the null
    block (``kv_cache_planning.py: _estimate_max_model_len_from_groups``, the same binary
    search, on ``available - bytes_per_block``); 0 when not even one token fits.

    Note: vLLM's search holds ``max_num_batched_tokens`` (so the in-flight tokens) fixed while
    ``max_model_len`` moves, as here."""
    if not groups:
        return upper
    check = available_bytes - bytes_per_block(groups)

    def fits_len(n: int) -> bool:
        return max_memory_usage_bytes(groups, n, max_in_flight_tokens=max_in_flight_tokens,
                                      mamba_cache_mode=mamba_cache_mode) <= check

    if not fits_len(1):
        return 0
    left, right, best = 1, upper, 1
    while left <= right:
        mid = (left + right) // 2
        if fits_len(mid):
            best, left = mid, mid + 1
        else:
            right = mid - 1
    return best


DEFAULT_BLOCK_SIZE = 16
"""``CacheConfig.DEFAULT_BLOCK_SIZE`` (``vllm/config/cache.py``)."""


def default_block_size(*, mla: bool, qk_nope_head_dim: int | None,
                       compute_capability: str | None) -> int:
    """The block size vLLM 0.33 picks when ``--block-size`` is not given: the preferred size of
    the attention backend it selects (``vllm/platforms/interface.py:
    Platform.update_block_size_for_backend``; ``AttentionBackend.get_preferred_block_size``:
    16 where the backend's kernels take it, else their smallest size).

    On CUDA (``vllm/platforms/cuda.py: _get_backend_priorities``) every backend chosen first
    takes 16 (FlashAttention and FlashAttention-MLA on sm90, FlashInfer on sm100, Triton
    elsewhere: ``MultipleOf(16)`` or ``[16, 32, 64]``), except MLA on sm100, where FlashInfer-MLA
    comes first when ``qk_nope_head_dim`` is 64, 128 or 192 (its ``supports_combination``) and
    takes ``[32, 64]`` only (``mla/flashinfer_mla.py: get_supported_kernel_block_sizes``): 32.
    Not modelled: FlashAttention-4's sm90 fp8 block for head size 512
    (``flash_attn.py: _get_sm90_fa4_fp8_kv_block_size``), used only when FA4 is selected.
    Without a GPU (``compute_capability`` None) the default stays 16.

    >>> default_block_size(mla=True, qk_nope_head_dim=128, compute_capability="10.0")
    32
    >>> default_block_size(mla=True, qk_nope_head_dim=128, compute_capability="9.0")
    16
    """
    major = int(str(compute_capability).split(".")[0]) if compute_capability else None
    if mla and major == 10 and qk_nope_head_dim in (64, 128, 192):
        return 32
    return DEFAULT_BLOCK_SIZE
