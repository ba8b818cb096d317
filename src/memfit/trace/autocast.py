"""Autocast as the target device does it, around the traced forward and loss.

- CPU target: ``torch.autocast("cpu")`` itself (its op lists apply to fake CPU tensors).
- CUDA target on a CUDA build of torch: the low-level switches (``torch.autocast("cuda")``
  refuses without a GPU, but ``set_autocast_enabled("cuda")`` applies CUDA's op lists to fake CUDA
  tensors).
- CUDA target on a CPU-only build (fake CUDA tensors cannot run autograd there: that build has
  no CUDA device guard): the step runs on fake CPU tensors under ``torch.autocast("cpu")``, and a
  torch-function mode applies the ops where CUDA's lists differ from CPU's: CUDA runs these in
  fp32 (``layer_norm``, ``group_norm``, ``softmax``, ``exp``, ``pow``, ``rsqrt``, ``sum``,
  losses...),
  CPU autocast leaves them in the input's lower precision.

Known limitations of the emulation: it sees calls made from Python (``F.layer_norm``,
``Tensor.softmax``...), not ops inside C++ composites (e.g. the inside of ``F.rms_norm``, which
upcasts to fp32 itself anyway); CUDA's fused fp16-to-fp32 softmax/log_softmax (no fp32 copy of
fp16 input) is not modelled: the fp32 copy CUDA makes for bf16 input is counted for fp16 too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_LOW = (torch.float16, torch.bfloat16)


def _functions(*names: str) -> set[Callable[..., Any]]:
    found: set[Callable[..., Any]] = set()
    for name in names:
        for owner in (torch, torch.Tensor, F, torch.special, torch.linalg):
            fn = getattr(owner, name, None)
            if fn is not None and callable(fn):
                found.add(fn)
    return found


# CUDA autocast's "fp32" policy (aten/src/ATen/autocast_mode.cpp): inputs cast to float32.
_CUDA_FP32 = _functions(
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow", "__pow__", "__rpow__", "softplus", "layer_norm",
    "group_norm", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm",
    "logsumexp", "interpolate", "upsample", "upsample_nearest", "upsample_bilinear",
    "frobenius_norm", "nuclear_norm")
# CUDA autocast's "fp32_set_opt_dtype" policy: run with dtype=float32 unless a dtype is given.
_CUDA_FP32_OPT_DTYPE = _functions(
    "softmax", "log_softmax", "cumsum", "cumprod", "sum", "prod", "vector_norm", "matrix_norm")


def _to_fp32(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.dtype in _LOW:
        return x.float()
    if isinstance(x, list | tuple):
        return type(x)(_to_fp32(v) for v in x)
    return x


class _CudaAutocastOnCpu(TorchFunctionMode):
    """Applies CUDA's fp32 autocast policies to fake CPU tensors (see the module docstring)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if torch.is_autocast_enabled("cpu"):
            if func in _CUDA_FP32:
                args, kwargs = _to_fp32(args), {k: _to_fp32(v) for k, v in kwargs.items()}
            elif (func in _CUDA_FP32_OPT_DTYPE and kwargs.get("dtype") is None and args
                  and isinstance(args[0], torch.Tensor) and args[0].dtype in _LOW
                  and not any(isinstance(a, torch.dtype) for a in args)):
                kwargs = {**kwargs, "dtype": torch.float32}
        return func(*args, **kwargs)


@contextmanager
def cuda_autocast_emulation() -> Iterator[None]:
    """CUDA's autocast lists on fake CPU tensors for the whole traced step.

    Note: [autocast in the recompute] The mode stays on through forward, backward and optimizer,
    and acts only while CPU autocast is enabled (``torch.is_autocast_enabled("cpu")``), the state
    that stands for CUDA autocast here. Activation checkpointing re-runs a forward during backward
    under the autocast *state* it recorded (``torch/utils/checkpoint.py: _get_autocast_kwargs``,
    restored by ``CheckpointFunction.backward`` (reentrant) and ``recompute_fn`` in
    ``_checkpoint_without_reentrant_generator``); it does not restore torch-function modes. A mode
    entered only around the forward would be gone in the recompute, which would then take CPU's
    lists and save tensors of other dtypes ("Recomputed values ... have different metadata").
    Keyed on the state, the recompute sees exactly the forward's policies, for every checkpoint
    flavour (reentrant, non-reentrant, selective) and whoever wraps the blocks.
    """
    with _CudaAutocastOnCpu():
        yield


@contextmanager
def target_autocast(device: str, dtype: torch.dtype | None, *,
                    emulate_cuda: bool) -> Iterator[None]:
    """Autocast for ``device`` ("cpu" or "cuda") at ``dtype``; no-op when ``dtype`` is None.

    ``emulate_cuda``: the target is CUDA but tensors are fake CPU tensors (CPU-only torch build):
    this enters CPU autocast, and :func:`cuda_autocast_emulation`, which the caller keeps active
    for the whole step, applies CUDA's lists while it is on.
    """
    if dtype is None:
        yield
        return
    if device == "cpu" or emulate_cuda:
        with torch.autocast("cpu", dtype=dtype):
            yield
        return
    prev_enabled = torch.is_autocast_enabled("cuda")
    prev_dtype = torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled("cuda", prev_enabled)
        torch.set_autocast_dtype("cuda", prev_dtype)
