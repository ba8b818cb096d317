"""Route ``scaled_dot_product_attention`` to the kernel CUDA would pick, so its saved tensors count.

On a CPU target nothing is routed: torch's own CPU selection runs on the fake tensors' metadata
(flash-attention-for-CPU or math) exactly as in the real run.

On a CUDA target the choice follows ``sdp_utils.cpp`` (torch 2.4-2.11 priority: flash, then
memory-efficient, then math; cuDNN attention ranks after math and is never picked by default):
- flash: compute capability >= 8.0, fp16/bf16, no explicit mask, head_dim <= 256. Saves the output
  and a float32 logsumexp [batch, heads, seq_q] (plus two scalar RNG tensors).
- memory-efficient: compute capability >= 5.0 (bf16 needs 8.0), fp32/fp16/bf16, masks allowed,
  head_dim divisible by 8 (fp16/bf16) or 4 (fp32). Saves the output and a float32 logsumexp padded
  to a multiple of 32 along the sequence; a boolean mask is first converted to an additive one.
- math: everything else; materialises the [batch, heads, seq_q, seq_k] attention weights.

Known limitations: nested tensors and the cuDNN backend are not modelled; backend flags set with
``torch.nn.attention.sdpa_kernel`` inside the model are ignored.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

aten = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)


def choose_cuda_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        attn_mask: torch.Tensor | None, compute_capability: tuple[int, int]) -> str:
    """``"flash"``, ``"efficient"`` or ``"math"``: what CUDA SDPA would run for these inputs."""
    head_dim = q.shape[-1]
    same_dim = k.shape[-1] == head_dim and v.shape[-1] == head_dim
    four_d = q.dim() == 4 and k.dim() == 4 and v.dim() == 4
    if (four_d and same_dim and compute_capability >= (8, 0) and q.dtype in _HALF
            and attn_mask is None and head_dim <= 256):
        return "flash"
    align = 8 if q.dtype in _HALF else 4
    dtype_ok = q.dtype == torch.float32 or q.dtype == torch.float16 or (
        q.dtype == torch.bfloat16 and compute_capability >= (8, 0))
    if four_d and dtype_ok and compute_capability >= (5, 0) and head_dim % align == 0 and (
            v.shape[-1] % align == 0):
        return "efficient"
    return "math"


def _expand_gqa(q: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    if t.dim() == 4 and q.dim() == 4 and t.shape[1] != q.shape[1]:
        return t.repeat_interleave(q.shape[1] // t.shape[1], dim=1)
    return t


def cuda_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
              is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False, *,
              compute_capability: tuple[int, int]) -> torch.Tensor:
    """Scaled dot-product attention through the kernel CUDA would choose."""
    backend = choose_cuda_backend(q, k, v, attn_mask, compute_capability)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if backend == "flash":
        # Flash handles grouped-query attention natively in recent torch; the memory of an
        # expanded k/v copy is what older releases did, so expand only when heads differ.
        k, v = _expand_gqa(q, k), _expand_gqa(q, v)
        return aten._scaled_dot_product_flash_attention(  # type: ignore[no-any-return]
            q, k, v, dropout_p, is_causal, False, scale=scale)[0]
    if backend == "efficient":
        k, v = _expand_gqa(q, k), _expand_gqa(q, v)
        bias = attn_mask
        if bias is not None and bias.dtype == torch.bool:
            bias = torch.zeros(bias.shape, dtype=q.dtype, device=q.device).masked_fill_(
                bias.logical_not(), -math.inf)
        return aten._scaled_dot_product_efficient_attention(  # type: ignore[no-any-return]
            q, k, v, bias, needs_grad, dropout_p, is_causal, scale=scale)[0]
    k, v = _expand_gqa(q, k), _expand_gqa(q, v)
    return aten._scaled_dot_product_attention_math(  # type: ignore[no-any-return]
        q, k, v, attn_mask, dropout_p, is_causal, scale=scale)[0]


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


class CudaSdpaRouting(TorchFunctionMode):
    """Sends ``F.scaled_dot_product_attention`` calls to :func:`cuda_sdpa`.

    On the CPU stand-in for CUDA it also maps explicit CUDA devices in model code
    (``device="cuda"``, ``.cuda()``, ``.to("cuda")``) to the stand-in, so such code runs.
    """

    def __init__(self, compute_capability: tuple[int, int], *, cuda_on_cpu: bool) -> None:
        super().__init__()
        self.compute_capability = compute_capability
        self.cuda_on_cpu = cuda_on_cpu

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.cuda_on_cpu:
            if func is torch.Tensor.cuda:
                return args[0]
            if kwargs or len(args) > 1:
                args, kwargs = _host_device(args, kwargs)
        if func is F.scaled_dot_product_attention:
            args = list(args)
            device = args[0].device.type
            if torch.is_autocast_enabled(device):
                # SDPA is on autocast's lower-precision list: cast first, then choose the kernel.
                low = torch.get_autocast_dtype(device)
                args = [a.to(low) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                        for a in args]
                kwargs = {k: (a.to(low) if isinstance(a, torch.Tensor) and a.is_floating_point()
                              else a) for k, a in kwargs.items()}
            return cuda_sdpa(*args, **kwargs, compute_capability=self.compute_capability)
        return func(*args, **kwargs)
