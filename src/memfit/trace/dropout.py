"""CUDA's dropout on the CPU stand-in: the fused kernel and its 1-byte mask.

``aten/src/ATen/native/Dropout.cpp: dropout`` (the op behind ``F.dropout``, ``nn.Dropout`` and
the math SDPA path's internal dropout) takes ``at::native_dropout`` when
``is_fused_kernel_acceptable``: the input is on CUDA (or XPU, lazy, privateuse1), ``0 < p < 1``
and it has elements. ``native_dropout`` returns the output and a boolean mask, and its backward
keeps only that mask (``derivatives.yaml``: ``native_dropout_backward(grad, result1, ...)``):
1 byte per element. Everywhere else, the CPU included, ``dropout`` runs ``_dropout_impl``:
``noise = empty_like(input).bernoulli_(1 - p).div_(1 - p)`` and ``input * noise``, whose backward
keeps ``noise`` in the input's dtype (4 bytes per element in float32, 2 in bfloat16).

So on the stand-in, ``aten::dropout`` is given a kernel at the ``AutogradCPU`` key (which takes
precedence over its ``CompositeImplicitAutograd`` one) that makes CUDA's choice, for as long as
:func:`cuda_dropout` is entered. The in-place ``dropout_``, ``feature_dropout`` and
``alpha_dropout`` use ``_dropout_impl`` on CUDA too, so they are left alone.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

aten = torch.ops.aten
_lock = threading.Lock()
_depth = 0
_library: Any = None


def _is_fused_kernel_acceptable(x: torch.Tensor, p: float) -> bool:
    """``Dropout.cpp: is_fused_kernel_acceptable`` for an input on CUDA."""
    return 0 < p < 1 and x.numel() > 0


def _dropout(x: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    """``Dropout.cpp: dropout`` as it runs on a CUDA tensor."""
    if train and _is_fused_kernel_acceptable(x, p):
        return aten.native_dropout.default(x, p, train)[0]  # type: ignore[no-any-return]
    if p == 0 or not train or x.numel() == 0:
        # ``_dropout_impl``: "if (p == 0 || !train || input.sym_numel() == 0) return input;" —
        # the input itself, no copy (the decomposition would copy it).
        return x
    return aten.dropout.default.decompose(x, p, train)  # type: ignore[no-any-return]


@contextlib.contextmanager
def cuda_dropout() -> Iterator[None]:
    """Make ``aten::dropout`` on CPU tensors take CUDA's fused kernel while entered (re-entrant;
    the registration is removed when the outermost exits)."""
    global _depth, _library
    with _lock:
        if _depth == 0:
            library = torch.library.Library("aten", "IMPL")
            library.impl("dropout", _dropout, "AutogradCPU")
            _library = library
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _library is not None:
                _library._destroy()
                _library = None
