"""Route ``scaled_dot_product_attention`` to the kernel CUDA would pick, so its saved tensors count.

On a CPU target nothing is routed: torch's own CPU selection runs on the fake tensors' metadata
(flash-attention-for-CPU or math) exactly as in the real run.

On a CUDA target the choice and the inputs each kernel receives follow PyTorch's source: the
``sdp_utils.cpp`` of ``main`` (commit 001f694a, 2026), the ``sdp_utils_cpp.h`` header shipped with
the installed torch 2.13, ``attention.cpp`` as of 2.5-2.8 (its ``preprocess_mask`` and
``pad_last_dim`` unchanged since 2.3), and, for what changed around 2.11 (the GPU machines'
release), the pull requests that changed it (pytorch#169849/#171627: cuDNN priority;
pytorch#191085: memory-efficient GQA, after 2.13). The v2.11.0 tag itself could not be fetched
here (the repository snapshot is over the size limit); differences are noted where they matter:

- ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``: ``select_sdp_backend`` tries the
  backends in ``priority_order`` and takes the first whose ``can_use_*`` filters all pass
  (:func:`choose_cuda_backend` mirrors them filter by filter);
- ``aten/src/ATen/native/transformers/attention.cpp``: ``scaled_dot_product_attention`` converts a
  boolean mask to an additive one (``convert_boolean_attn_mask``), pads the head dimension to a
  multiple of 8 for flash (``pad_last_dim<8, false>``), pads and expands the mask for the
  memory-efficient kernel (``preprocess_mask``), and lets only the math path expand grouped-query
  K/V (``pre_process_group_query_attention_input``);
- ``torch/_meta_registrations.py``: the shapes of what each kernel returns and so saves for
  backward (flash: output + float32 logsumexp [B, H, L]; memory-efficient: output + float32
  logsumexp [B, H, ceil(L/32)*32]; cuDNN: output + float32 stats [B, H, L, 1]; plus the RNG seed
  and offset scalars). The fake kernels are those meta functions, so routing to the right op is
  what makes the bytes right.

Not modelled: nested tensors; kernel workspaces freed inside the op (the memory-efficient
kernel's float32 output accumulator for head_dim > 128, its backward's float32 gradient
accumulators); the storage-offset alignment filter ``check_data_ptr_alignment_mem_efficient``
(``main`` only); cuDNN library-version gates other than the one that decides its priority.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from memfit._compat import torch_internals
from memfit.errors import MemfitError
from memfit.trace.dropout import cuda_dropout
from memfit.trace.norms import cuda_rms_norm

aten = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)

FLASH, EFFICIENT, CUDNN, MATH = "flash", "efficient", "cudnn", "math"
# ATen/Context.h: sdp_priority_order's default, the order of at::SDPBackend ids 1, 2, 0, 3.
DEFAULT_ORDER = (FLASH, EFFICIENT, MATH, CUDNN)
# sdp_utils.cpp: priority_order, when check_prefer_cudnn_attention() holds.
CUDNN_ORDER = (CUDNN, FLASH, EFFICIENT, MATH)
_BACKEND_IDS = {0: MATH, 1: FLASH, 2: EFFICIENT, 3: CUDNN}  # at::SDPBackend
# The first release whose wheels bundle a cuDNN newer than 9.15.0, the version
# check_prefer_cudnn_attention requires (pytorch#169849: "cuDNN 9.15.1 required for seq_len not
# divisible by 128 fix, CUDA <= 12.9 wheels ship with older cuDNN"); the preference code itself
# is already in 2.10, whose wheels' cuDNN is below the threshold.
CUDNN_PREFERRED_SINCE = (2, 11)
# The first release whose memory-efficient kernel takes grouped-query K/V (pytorch#191085,
# July 2026: "adds native grouped-query attention (GQA) to NVIDIA CUDA memory-efficient SDPA");
# 2.11 instantiates check_batch_size_and_num_heads_dense<false> for it.
EFFICIENT_GQA_SINCE = (2, 14)


def torch_release() -> tuple[int, int]:
    """The installed torch's (major, minor): the release whose ``sdp_utils.cpp`` is followed."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def prefers_cudnn(compute_capability: tuple[int, int],
                  release: tuple[int, int] | None = None) -> bool:
    """``sdp_utils.cpp: check_prefer_cudnn_attention``: cuDNN first on sm90 and sm100/sm103
    (``major == 9 || major == 10``, ``!minor || minor == 3`` on CUDA 12 builds) when the runtime
    cuDNN is newer than 9.15.0 (see :data:`CUDNN_PREFERRED_SINCE`), unless the environment sets
    ``TORCH_CUDNN_SDPA_DEPRIORITIZED``."""
    if os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "").strip().lower() in (
            "1", "true", "on", "yes"):
        return False
    if (release or torch_release()) < CUDNN_PREFERRED_SINCE:
        return False
    major, minor = compute_capability
    return major in (9, 10) and minor in (0, 3)


def priority_order(compute_capability: tuple[int, int],
                   release: tuple[int, int] | None = None) -> tuple[str, ...]:
    """``sdp_utils.cpp: priority_order``: the order set with
    ``torch.nn.attention.sdpa_kernel(..., set_priority=True)`` if the user changed it, else the
    default, with cuDNN moved first where :func:`prefers_cudnn` holds."""
    ids = torch_internals.sdp_priority_order()
    order = tuple(_BACKEND_IDS[i] for i in ids if i in _BACKEND_IDS) if ids is not None else (
        DEFAULT_ORDER)
    if order == DEFAULT_ORDER and prefers_cudnn(compute_capability, release):
        return CUDNN_ORDER
    return order


def enabled_backends() -> frozenset[str]:
    """The backends enabled by ``torch.backends.cuda.enable_*_sdp`` or ``sdpa_kernel`` (these
    global flags work on CPU builds too)."""
    flags = {FLASH: torch.backends.cuda.flash_sdp_enabled(),
             EFFICIENT: torch.backends.cuda.mem_efficient_sdp_enabled(),
             MATH: torch.backends.cuda.math_sdp_enabled(),
             CUDNN: torch.backends.cuda.cudnn_sdp_enabled()}
    return frozenset(name for name, on in flags.items() if on)


def minimum_gemm_alignment(dtype: torch.dtype, compute_capability: tuple[int, int]) -> int:
    """``sdp_utils.cpp: minimum_gemm_alignment``: 4 elements from sm80, raised to 128 bits
    (8 half / 4 float elements) where tensor cores run (sm80+, or half precision on sm70+)."""
    is_half = dtype in _HALF
    major = compute_capability[0]
    use_tc = major >= 8 or (major >= 7 and is_half)  # use_tensor_cores
    alignment = 4 if major >= 8 else 1
    if use_tc:
        alignment = max(alignment, 128 // (16 if is_half else 32))
    return alignment


def _in_sm_range(cc: tuple[int, int], low: tuple[int, int], high: tuple[int, int]) -> bool:
    return low <= cc <= high  # sdp_utils.cpp: check_sm_version<lower, upper>


def _heads_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool, *,
              supports_gqa: bool, requires_same_num_heads: bool = True) -> bool:
    """``sdp_utils_cpp.h: check_batch_size_and_num_heads_dense<supports_gqa,
    requires_same_num_heads>``: equal batch sizes; equal head counts, or with ``enable_gqa`` on a
    backend that supports it, key heads (and value heads unless they must equal key heads)
    dividing the query heads."""
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        return False
    hq, hk, hv = q.shape[-3], k.shape[-3], v.shape[-3]
    if hq == hk == hv:
        return True
    if not (enable_gqa and supports_gqa):
        return False
    if requires_same_num_heads and hk != hv:
        return False
    return hk > 0 and hv > 0 and hq % hk == 0 and hq % hv == 0


def _last_dim_contiguous(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         mask: torch.Tensor | None, *, ignore_singleton: bool) -> bool:
    """``sdp_utils_cpp.h: check_last_dim_stride_equals_1_dense``: q, k, v (unless head_dim is 1,
    where allowed) and, on GPUs, the mask have stride 1 in their last dimension."""
    qkv = all(t.stride(-1) == 1 for t in (q, k, v)) or (ignore_singleton and q.shape[-1] == 1)
    return qkv and (mask is None or mask.stride(-1) == 1)


def _mask_shape_ok(mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor) -> bool:
    """``sdp_utils_cpp.h: check_attn_mask_shape`` (a filter of the cuDNN backend)."""
    if mask is None:
        return True
    if mask.requires_grad:
        return False
    if mask.shape[-2] not in (q.shape[2], 1) or mask.shape[-1] not in (k.shape[2], 1):
        return False
    if mask.dim() == 2:
        return True
    return mask.dim() == 4 and mask.shape[0] in (1, q.shape[0]) and mask.shape[1] in (
        1, q.shape[1])


def can_use_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  attn_mask: torch.Tensor | None, cc: tuple[int, int], *, dropout_p: float,
                  is_causal: bool, enable_gqa: bool, requires_grad: bool) -> bool:
    """``sdp_utils.cpp: can_use_flash_attention``, filter by filter."""
    head_dim = q.shape[-1]
    if attn_mask is not None:  # check_for_attn_mask
        return False
    if not (k.shape[-1] == head_dim and v.shape[-1] == head_dim and head_dim <= 256):
        return False  # check_head_dim_size_flash
    if not _in_sm_range(cc, (8, 0), (12, 1)):  # check_flash_attention_hardware_support
        return False
    # check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120: training refused on
    # sm86-sm89 and sm120-sm121 for head_dim in (192, 224], or above 224 with dropout.
    if requires_grad and (_in_sm_range(cc, (8, 6), (8, 9)) or _in_sm_range(cc, (12, 0), (12, 1))):
        if not (head_dim <= 192 or (dropout_p == 0.0 and head_dim > 224)):
            return False
    if is_causal and q.shape[-2] != k.shape[-2]:  # check_flash_causal_non_square_seqlens
        return False
    if q.dtype not in _HALF:  # check_dtypes_flash_attention (sm80+: fp16, bf16)
        return False
    return (_heads_ok(q, k, v, enable_gqa, supports_gqa=True)  # backend_supports_gqa = true
            and q.shape[-2] > 0 and k.shape[-2] > 0  # check_nonzero_sequence_lengths_dense
            and _last_dim_contiguous(q, k, v, None, ignore_singleton=True))


def can_use_efficient(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      attn_mask: torch.Tensor | None, cc: tuple[int, int], *, enable_gqa: bool,
                      release: tuple[int, int] | None = None) -> bool:
    """``sdp_utils.cpp: can_use_mem_efficient_attention``, filter by filter."""
    if not _in_sm_range(cc, (5, 0), (12, 1)):  # check_mem_efficient_hardware_support
        return False
    alignment = minimum_gemm_alignment(q.dtype, cc)  # check_head_dim_size_mem_efficient
    if not (q.shape[-1] == k.shape[-1] and q.shape[-1] % alignment == 0 and q.shape[-1] > 0
            and v.shape[-1] % alignment == 0 and v.shape[-1] > 0):
        return False
    gqa = (release or torch_release()) >= EFFICIENT_GQA_SINCE
    if not (q.shape[-2] > 0 and k.shape[-2] > 0
            and _last_dim_contiguous(q, k, v, attn_mask, ignore_singleton=False)
            and _heads_ok(q, k, v, enable_gqa, supports_gqa=gqa)):
        return False
    dtypes = (torch.float16, torch.float32, torch.bfloat16) if cc >= (8, 0) else (
        torch.float16, torch.float32)
    return q.dtype in dtypes  # check_tensor_dtype


def can_use_cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  attn_mask: torch.Tensor | None, cc: tuple[int, int], *, dropout_p: float,
                  enable_gqa: bool) -> bool:
    """``sdp_utils.cpp: can_use_cudnn_attention`` for a cuDNN 9 build, filter by filter."""
    if torch.are_deterministic_algorithms_enabled() and not (
            torch.is_deterministic_algorithms_warn_only_enabled()):
        return False  # check_cudnn_deterministic
    if q.dtype not in (_HALF if cc >= (8, 0) else (torch.float16,)):
        return False  # check_dtypes_low_precision
    if not _mask_shape_ok(attn_mask, q, k):  # check_attn_mask_shape
        return False
    if not _in_sm_range(cc, (8, 0), (12, 1)):  # check_cudnn_hardware_support
        return False
    if dropout_p * 16.0 != math.floor(dropout_p * 16.0):  # check_cudnn_dropout
        return False
    if not (q.shape[-2] > 0 and k.shape[-2] > 0
            and _last_dim_contiguous(q, k, v, attn_mask, ignore_singleton=True)
            and _heads_ok(q, k, v, enable_gqa, supports_gqa=True, requires_same_num_heads=False)):
        return False
    # check_cudnn_tensor_shapes: batch and heads <= 65535; head dims <= 128 (192/128 on sm90 and
    # sm10x; 256 only with cuDNN > 9.22, newer than 2.11's) and multiples of 8; no key/value
    # sequence of length 1, nor a query of length 1 with dropout.
    d_qk, d_v = q.shape[-1], v.shape[-1]
    if q.shape[0] > 65535 or q.shape[1] > 65535:
        return False
    sm90_or_10x = cc == (9, 0) or cc[0] == 10
    if not ((d_qk <= 128 and d_v <= 128) or (sm90_or_10x and d_qk == 192 and d_v == 128)):
        return False
    if d_qk % 8 or d_v % 8:
        return False
    return k.shape[-2] != 1 and not (dropout_p != 0.0 and q.shape[-2] == 1)


def choose_cuda_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        attn_mask: torch.Tensor | None, compute_capability: tuple[int, int], *,
                        dropout_p: float = 0.0, is_causal: bool = False,
                        enable_gqa: bool = False, requires_grad: bool | None = None,
                        enabled: Sequence[str] | None = None,
                        order: Sequence[str] | None = None,
                        release: tuple[int, int] | None = None) -> str:
    """``"cudnn"``, ``"flash"``, ``"efficient"`` or ``"math"``: what
    ``sdp_utils.cpp: select_sdp_backend`` returns on a GPU of ``compute_capability``.

    ``enabled`` and ``order`` default to torch's global flags and priority order (so
    ``sdpa_kernel`` and ``torch.backends.cuda.enable_flash_sdp(False)`` in the traced step take
    effect); ``release`` to the installed torch. ``requires_grad`` defaults to
    ``input_requires_grad``: grad mode on and an input requiring grad."""
    if requires_grad is None:
        requires_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    on = frozenset(enabled_backends() if enabled is None else enabled)
    four_d = q.dim() == 4 and k.dim() == 4 and v.dim() == 4  # check_tensor_shapes
    for backend in order or priority_order(compute_capability, release):
        if backend not in on:  # check_runtime_disabled_*
            continue
        if backend == MATH:
            return MATH
        if not four_d:
            continue
        if backend == FLASH and can_use_flash(
                q, k, v, attn_mask, compute_capability, dropout_p=dropout_p,
                is_causal=is_causal, enable_gqa=enable_gqa, requires_grad=requires_grad):
            return FLASH
        if backend == EFFICIENT and can_use_efficient(q, k, v, attn_mask, compute_capability,
                                                      enable_gqa=enable_gqa, release=release):
            return EFFICIENT
        if backend == CUDNN and can_use_cudnn(q, k, v, attn_mask, compute_capability,
                                              dropout_p=dropout_p, enable_gqa=enable_gqa):
            return CUDNN
    raise MemfitError(
        f"no scaled_dot_product_attention kernel accepts these inputs on sm"
        f"{compute_capability[0]}{compute_capability[1]} with the enabled backends "
        f"({', '.join(sorted(on)) or 'none'}); torch raises 'No available kernel' here too: "
        f"enable the math backend (torch.backends.cuda.enable_math_sdp(True))")


# -- what attention.cpp does before the kernel ----------------------------------------------

def convert_boolean_attn_mask(mask: torch.Tensor | None, dtype: torch.dtype
                              ) -> torch.Tensor | None:
    """``attention.cpp: convert_boolean_attn_mask``: a boolean mask becomes an additive one of the
    query's dtype and the mask's shape (``at::where(mask.logical_not(), -inf, 0)``)."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    zero = torch.scalar_tensor(0.0, dtype=dtype, device=mask.device)
    return torch.where(mask.logical_not(), -math.inf, zero)


def _aligned(t: torch.Tensor, alignment: int) -> bool:
    """``attention.cpp: aligned_tensor<alignment>``."""
    return all(t.stride(i) % alignment == 0 for i in range(t.dim() - 1)) and t.stride(-1) == 1


def preprocess_mask(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``attention.cpp: preprocess_mask`` (2.3 through ``main``): a mask whose strides are not
    multiples of 8 elements is copied with its last dimension padded (``pad_bias<8>``: by
    ``8 - S % 8``, a whole 8 when ``S`` is already a multiple) and sliced back; then it is expanded
    (a view) to [B, H, L, S]. The memory-efficient kernel saves that bias for backward, so the
    padded copy lives until then. (Releases 2.0-2.2 expanded first and padded to 16, copying the
    full [B, H, L, S]; not modelled.)"""
    if not _aligned(mask, 8):
        last = mask.shape[-1]
        mask = F.pad(mask, (0, 8 - last % 8))[..., :last]
    return mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def _pad_last_dim(t: torch.Tensor, alignment: int) -> torch.Tensor:
    """``attention.cpp: pad_last_dim<alignment, false>``: a copy padded to a multiple."""
    last = t.shape[-1]
    return t if last % alignment == 0 else F.pad(t, (0, alignment - last % alignment))


def cuda_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
              is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False, *,
              compute_capability: tuple[int, int]) -> torch.Tensor:
    """Scaled dot-product attention as ``attention.cpp: scaled_dot_product_attention`` runs it on
    CUDA: the backend :func:`choose_cuda_backend` picks, with the inputs it gets there."""
    backend = choose_cuda_backend(q, k, v, attn_mask, compute_capability, dropout_p=dropout_p,
                                  is_causal=is_causal, enable_gqa=enable_gqa)
    # should_compute_logsumexp: an input requires grad and grad mode is on.
    compute_lse = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    mask = convert_boolean_attn_mask(attn_mask, q.dtype)
    if backend == CUDNN:
        # Grouped-query K/V go in unexpanded (check_batch_size_and_num_heads_dense<true, false>).
        return aten._scaled_dot_product_cudnn_attention(  # type: ignore[no-any-return]
            q, k, v, mask, compute_lse, dropout_p, is_causal, False, scale=scale)[0]
    if backend == FLASH:
        # Unexpanded grouped-query K/V; head_dim padded to a multiple of 8 (copies the kernel
        # saves), the output sliced back; the scale from the original head_dim.
        head_dim = q.shape[-1]
        og_scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
        out = aten._scaled_dot_product_flash_attention(
            _pad_last_dim(q, 8), _pad_last_dim(k, 8), _pad_last_dim(v, 8), dropout_p,
            is_causal, False, scale=og_scale)[0]
        return out if out.shape[-1] == head_dim else out[..., :head_dim]
    if backend == EFFICIENT:
        if mask is not None:
            mask = preprocess_mask(mask, q, k)
        return aten._scaled_dot_product_efficient_attention(  # type: ignore[no-any-return]
            q, k, v, mask, compute_lse, dropout_p, is_causal, scale=scale)[0]
    # The math composite upcasts half inputs to float32, expands grouped-query K/V itself
    # (repeat_interleave) and drops out through at::dropout (a 1-byte mask on CUDA, dropout.py).
    return aten._scaled_dot_product_attention_math(  # type: ignore[no-any-return]
        q, k, v, mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa)[0]


def _is_cuda(device: Any) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _host_device(args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """Replace an explicit CUDA device with the CPU stand-in (see engine.py's note)."""
    if "device" in kwargs and _is_cuda(kwargs["device"]):
        kwargs = {**kwargs, "device": "cpu"}
    if any(_is_cuda(a) for a in args):
        args = tuple("cpu" if _is_cuda(a) else a for a in args)
    return args, kwargs


_RMS_NORM = {F.rms_norm, torch.rms_norm}
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
              "enable_gqa")  # F.scaled_dot_product_attention's parameters, in order


class CudaRouting(TorchFunctionMode):
    """CUDA's choice of kernels on the CPU stand-in: ``F.scaled_dot_product_attention`` calls go to
    :func:`cuda_sdpa`, and (``cuda_on_cpu``) ``dropout`` takes CUDA's fused kernel
    (:func:`memfit.trace.dropout.cuda_dropout`) and ``F.rms_norm`` CUDA's fused RMSNorm
    (:func:`memfit.trace.norms.cuda_rms_norm`) for as long as the mode is entered: forward,
    backward and any recompute inside it.

    On the CPU stand-in for CUDA it also maps explicit CUDA devices in model code
    (``device="cuda"``, ``.cuda()``, ``.to("cuda")``) to the stand-in, so such code runs.
    """

    def __init__(self, compute_capability: tuple[int, int], *, cuda_on_cpu: bool) -> None:
        super().__init__()
        self.compute_capability = compute_capability
        self.cuda_on_cpu = cuda_on_cpu
        self._dropout: Any = None

    def __enter__(self) -> CudaRouting:
        if self.cuda_on_cpu:
            self._dropout = cuda_dropout()
            self._dropout.__enter__()
        try:
            return super().__enter__()  # type: ignore[no-any-return]
        except BaseException:
            self._exit_dropout(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._exit_dropout(*exc)

    def _exit_dropout(self, *exc: Any) -> None:
        if self._dropout is not None:
            dropout, self._dropout = self._dropout, None
            dropout.__exit__(*exc)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.cuda_on_cpu:
            if func is torch.Tensor.cuda:
                return args[0]
            if kwargs or len(args) > 1:
                args, kwargs = _host_device(args, kwargs)
        if self.cuda_on_cpu and func in _RMS_NORM:
            # CUDA's fused kernel (trace/norms.py); autocast's fp32 rule, where this torch has
            # it, was applied by the autocast emulation (entered inside this mode) before.
            return cuda_rms_norm(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            call = dict(zip(_SDPA_ARGS, args, strict=False))
            call.update(kwargs)
            device = call["query"].device.type
            if device in ("cpu", "cuda") and torch.is_autocast_enabled(device):
                # SDPA is on autocast's lower-precision list: cast first, then choose the kernel.
                low = torch.get_autocast_dtype(device)
                call = {k: (a.to(low) if isinstance(a, torch.Tensor) and a.is_floating_point()
                            else a) for k, a in call.items()}
            return cuda_sdpa(call.pop("query"), call.pop("key"), call.pop("value"), **call,
                             compute_capability=self.compute_capability)
        return func(*args, **kwargs)


CudaSdpaRouting = CudaRouting  # the name engine.py imports
