"""CUDA's fused RMSNorm on the CPU stand-in.

``F.rms_norm`` (and ``nn.RMSNorm``) is ``aten::rms_norm``, CompositeImplicitAutograd:
``aten/src/ATen/native/layer_norm.cpp: rms_norm_symint`` takes ``rms_norm_composite`` for a
channels-last or complex input and when the weight's dtype differs from the input's ("Mismatch
dtype between input and module ... Can not dispatch to fused implementation"), and otherwise
calls ``aten::_fused_rms_norm``. On a CUDA tensor that is one kernel that writes the output
(the input's dtype) and ``rstd`` (one value per normalized row in the accumulation type:
float32 for 16-bit and float32 inputs). Its derivative
(``tools/autograd/derivatives.yaml``: ``_fused_rms_norm``) keeps ``input``, ``weight`` and
``result1`` (``rstd``) and calls ``_fused_rms_norm_backward``, which writes the input's and the
weight's gradients. Measured here on torch 2.11.0+cu130 with fake CUDA tensors: ``F.rms_norm``
dispatches exactly one ``aten._fused_rms_norm`` for float32 and bfloat16 inputs.

On the CPU the same call takes the composite path instead: ``pow``, ``mean``, ``add``,
``rsqrt``, two ``mul`` (and, for a 16-bit input, a float32 copy of the whole input), several of
them saved for backward. :func:`cuda_rms_norm` makes the stand-in allocate and keep what the
fused kernel does. The values are not computed (the trace's tensors are fake).
"""

from __future__ import annotations

import math
from typing import Any

import torch


def _rstd_shape(x: torch.Tensor, normalized_shape: tuple[int, ...]) -> list[int]:
    # layer_norm.cpp: rms_norm's rstd keeps the leading dimensions, 1 for each normalized one
    lead = x.dim() - len(normalized_shape)
    return [*x.shape[:lead], *([1] * len(normalized_shape))]


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    # at::opmath_type: float for Half/BFloat16/Float, double for Double
    return torch.float64 if dtype == torch.float64 else torch.float32


class _FusedRmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, normalized_shape: tuple[int, ...],
                weight: torch.Tensor | None) -> torch.Tensor:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        rstd = x.new_empty(_rstd_shape(x, normalized_shape), dtype=_acc_dtype(x.dtype))
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, weight, _rstd = ctx.saved_tensors
        grad_x = torch.empty_like(x, memory_format=torch.contiguous_format) \
            if ctx.needs_input_grad[0] else None
        grad_w = torch.empty_like(weight) \
            if weight is not None and ctx.needs_input_grad[2] else None
        return grad_x, None, grad_w


def cuda_rms_norm(x: torch.Tensor, normalized_shape: Any, weight: torch.Tensor | None = None,
                  eps: float | None = None) -> torch.Tensor:
    """``F.rms_norm`` as CUDA's ``_fused_rms_norm`` allocates and saves (see the module doc);
    where CUDA takes the composite path, the composite. A strided (non-contiguous, not
    channels-last) input is left to the composite too: what the CUDA kernel copies is not
    modelled."""
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    composite = (
        len(shape) > x.dim() or tuple(x.shape[x.dim() - len(shape):]) != shape
        or math.prod(shape) == 0  # torch's own error, or nothing to do
        or x.is_complex() or (weight is not None and weight.dtype != x.dtype)
        or not x.is_contiguous()  # channels-last takes the composite; others: not modelled
    )
    if composite:
        return torch.rms_norm(x, list(shape), weight, eps)
    return _FusedRmsNorm.apply(x, shape, weight)
