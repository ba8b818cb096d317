"""Autograd's gradient accumulation as the real engine runs it, for the tracker
(:mod:`memfit.trace.tracker`): autograd's input buffer sums two gradients of one input in place
when it holds the only reference, but never for tensor subclasses such as fake tensors
(``torch/csrc/autograd/input_buffer.cpp``: ``accumulate``)."""

from __future__ import annotations

from typing import Any

import torch

from memfit._compat import torch_internals

__all__ = ["ADD", "ADD_", "called_by_autograd_engine", "gradient_accumulation"]

aten = torch.ops.aten
ADD = aten.add.Tensor
ADD_ = aten.add_.Tensor


def called_by_autograd_engine() -> bool:
    """Whether the op being dispatched was called by autograd's C++ engine itself (not by a
    Python backward)."""
    # Skipped: the tracker's dispatch frames and this module's own (the frames between the
    # dispatch and this call).
    return torch_internals.called_by_autograd_engine(("tracker.py", "grad_accumulation.py"))


def _dense(t: torch.Tensor) -> bool:
    """``is_non_overlapping_and_dense``: the elements fill the storage span exactly, in some
    order of the dimensions."""
    expected = 1
    for size, stride in sorted(((s, st) for s, st in zip(t.shape, t.stride(), strict=True)
                                if s != 1), key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def _accumulates_in_place(t: Any, other: Any) -> bool:
    if not isinstance(t, torch.Tensor) or not isinstance(other, torch.Tensor):
        return False
    if t.layout is not torch.strided or other.layout is not torch.strided:
        return False  # a sparse gradient is summed out of place (input_buffer.cpp)
    if t.shape != torch.broadcast_shapes(t.shape, other.shape) or t.dtype != torch.promote_types(
            t.dtype, other.dtype) or not _dense(t):
        return False
    # One tensor holds the storage, plus the storage's Python object the tracker made.
    return torch_internals.storage_use_count(t) <= 2


def gradient_accumulation(args: Any) -> tuple[Any, Any]:
    """Autograd's input buffer sums two gradients for the same input in place into one of them
    when it holds the only reference (``input_buffer.cpp``: ``accumulate``), but never for
    tensor subclasses such as fake tensors, which always get an out-of-place ``add``. Model
    the real tensors: run ``add_`` on the operand the real engine would reuse."""
    if torch.is_grad_enabled() or len(args) != 2 or not called_by_autograd_engine():
        return ADD, args
    a, b = args
    if _accumulates_in_place(a, b):
        return ADD_, (a, b)
    if _accumulates_in_place(b, a):
        return ADD_, (b, a)
    return ADD, args
