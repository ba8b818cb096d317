"""Autocast as the target device does it, around the traced forward and loss.

- CPU target: ``torch.autocast("cpu")`` itself (its op lists apply to fake CPU tensors).
- CUDA target on a CUDA build of torch: the low-level switches (``torch.autocast("cuda")``
  refuses without a GPU, but ``set_autocast_enabled("cuda")`` applies CUDA's op lists to fake CUDA
  tensors).
- CUDA target on a CPU-only build (fake CUDA tensors cannot run autograd there: that build has
  no CUDA device guard): the step runs on fake CPU tensors under ``torch.autocast("cpu")``, and a
  torch-function mode applies CUDA's policy to every op whose CUDA policy differs from its CPU
  policy (:data:`CUDA_RULES`), running the op with CPU autocast off, as CUDA's wrapper runs it
  with autocast excluded (``aten/src/ATen/autocast_mode.h: WrapFunction_``,
  ``ExcludeDispatchKeyGuard no_autocast``).

The lists are torch's: ``aten/src/ATen/autocast_mode.h`` (``AT_FORALL_LOWER_PRECISION_FP``,
``AT_FORALL_FP32``, ``AT_FORALL_FP32_SET_OPT_DTYPE``, ``AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE``,
``AT_FORALL_PROMOTE``, registered for CUDA by ``TORCH_LIBRARY_IMPL(aten, Autocast, m)`` in
``autocast_mode.cpp``) against ``TORCH_LIBRARY_IMPL(aten, AutocastCPU, m)`` there.
``tests/trace/test_autocast.py`` checks them against the installed torch itself: which ops carry an
AutocastCUDA / AutocastCPU kernel (the dispatcher), and what each kernel does (fake CUDA tensors
under CUDA autocast, which a CPU-only build runs for forward ops).

Known limitations of the emulation: it sees calls made from Python (``F.layer_norm``,
``Tensor.softmax``...), not ops inside C++ composites; CUDA's autocast cache of leaf weights'
casts is not applied to the ops cast here (``mv``, ``addmv``, ``addr``, RNN cells...); CPU-only
fp32 entries of linear algebra and FFT ops keep CPU's behaviour (CUDA runs them in the input
dtype, or refuses bf16); CUDA's fused fp16-to-fp32 softmax/log_softmax is not modelled.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from memfit._compat.torch_internals import has_dispatch_kernel

_LOW = (torch.float16, torch.bfloat16)


def _functions(*names: str) -> set[Callable[..., Any]]:
    found: set[Callable[..., Any]] = set()
    for name in names:
        for owner in (torch, torch.Tensor, F, torch.special, torch.linalg):
            fn = getattr(owner, name, None)
            if fn is not None and callable(fn):
                found.add(fn)
    return found


# CUDA policy -> the aten ops (their Python names) where CUDA's policy differs from CPU's.
# lower_precision_fp on CUDA (AT_FORALL_LOWER_PRECISION_FP); CPU autocast has no kernel for these
# and leaves fp32 inputs in fp32.
CUDA_LOWER = ("mv", "addmv", "addr", "chain_matmul", "multi_dot", "einsum", "lstm_cell",
              "gru_cell", "rnn_tanh_cell", "rnn_relu_cell")
# fp32 on CUDA (AT_FORALL_FP32); CPU keeps the input's precision for these (its fp32 list is
# mostly losses, which are fp32 on both and listed here too: the call is the same).
CUDA_FP32 = ("acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
             "reciprocal", "rsqrt", "sinh", "tan", "pow", "__pow__", "__rpow__", "softplus",
             "layer_norm", "group_norm", "rms_norm", "frobenius_norm", "nuclear_norm",
             "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss",
             "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss",
             "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
             "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits",
             "dist", "pdist", "cdist", "renorm", "logsumexp", "interpolate", "upsample",
             "upsample_nearest", "upsample_bilinear")
# fp32_set_opt_dtype on CUDA (AT_FORALL_FP32_SET_OPT_DTYPE), and norm's fp32_append_dtype
# (AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE): the op itself writes fp32 from 16-bit input, no
# fp32 copy of the input (CPU's prod is "fp32": it copies).
CUDA_FP32_OPT_DTYPE = ("softmax", "log_softmax", "cumsum", "cumprod", "sum", "prod",
                       "vector_norm", "matrix_norm", "norm")
# promote on CUDA (AT_FORALL_PROMOTE): mixed 16/32-bit inputs run in the widest; CPU has none.
CUDA_PROMOTE = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "tensordot",
                "scatter_add", "grid_sample")
# CPU-only fp32 entries with no CUDA autocast kernel (pools and pads in 3-D, padding modes,
# trace): CUDA runs them in the input's dtype. F.pad covers reflection_/replication_pad*.
CPU_ONLY = ("pad", "avg_pool3d", "max_pool3d", "adaptive_avg_pool3d", "adaptive_max_pool3d",
            "fractional_max_pool2d", "fractional_max_pool3d", "max_unpool2d", "max_unpool3d",
            "trace")

CUDA_RULES: dict[str, tuple[str, ...]] = {
    "lower_precision_fp": CUDA_LOWER, "fp32": CUDA_FP32, "fp32_set_opt_dtype": CUDA_FP32_OPT_DTYPE,
    "promote": CUDA_PROMOTE, "none": CPU_ONLY}
"""The emulation's rules by CUDA policy ("none": no CUDA autocast kernel, CPU's is undone)."""

# Rules for ops whose AutocastCUDA kernel arrived in a later torch than the floor: applied only
# when the installed torch registers that kernel (the user's torch is the one that runs the step).
# rms_norm: in AT_FORALL_FP32 of torch 2.13's autocast_mode.h; torch 2.11's dispatcher has no
# AutocastCUDA kernel for aten::rms_norm (checked on 2.11.0+cu130), so 2.11 keeps bf16 there.
_GATED = {"rms_norm": "aten::rms_norm"}


def rule_applies(name: str) -> bool:
    """Whether the emulation applies its rule for ``name`` in the installed torch."""
    op = _GATED.get(name)
    return op is None or has_dispatch_kernel(op, "AutocastCUDA")


_POLICY: dict[Any, str] = {}
for _policy, _names in CUDA_RULES.items():
    for _fn in _functions(*(n for n in _names if rule_applies(n))):
        _POLICY[_fn] = _policy
_CROSS_ENTROPY = {F.cross_entropy}


def _cast(x: Any, to: torch.dtype, only: tuple[torch.dtype, ...]) -> Any:
    if isinstance(x, torch.Tensor) and x.dtype in only and x.dtype != to:
        return x.to(to)
    if isinstance(x, list | tuple):
        return type(x)(_cast(v, to, only) for v in x)
    return x


def _floats(x: Any) -> Iterator[torch.dtype]:
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        yield x.dtype
    elif isinstance(x, list | tuple):
        for v in x:
            yield from _floats(v)


@contextmanager
def _cpu_autocast_off() -> Iterator[None]:
    torch.set_autocast_enabled("cpu", False)
    try:
        yield
    finally:
        torch.set_autocast_enabled("cpu", True)


def _apply(policy: str, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """Run ``func`` as CUDA autocast's ``WrapFunction_<policy>`` does (autocast_mode.h)."""
    low = torch.get_autocast_dtype("cpu")
    if policy == "lower_precision_fp":  # cached_cast(lower, arg): floating, not double
        args = _cast(args, low, (torch.float32, torch.float16, torch.bfloat16))
        kwargs = {k: _cast(v, low, (torch.float32, torch.float16, torch.bfloat16))
                  for k, v in kwargs.items()}
    elif policy == "fp32":
        args, kwargs = _cast(args, torch.float32, _LOW), {
            k: _cast(v, torch.float32, _LOW) for k, v in kwargs.items()}
    elif policy == "fp32_set_opt_dtype":
        if (kwargs.get("dtype") is None and args and isinstance(args[0], torch.Tensor)
                and args[0].is_floating_point() and args[0].dtype != torch.float64
                and not any(isinstance(a, torch.dtype) for a in args)):
            kwargs = {**kwargs, "dtype": torch.float32}
    elif policy == "promote":
        dtypes = set(_floats((args, tuple(kwargs.values()))))
        if len(dtypes) > 1 and torch.float64 not in dtypes:
            widest = torch.float32 if torch.float32 in dtypes else low
            args = _cast(args, widest, (torch.float16, torch.bfloat16, torch.float32))
            kwargs = {k: _cast(v, widest, (torch.float16, torch.bfloat16, torch.float32))
                      for k, v in kwargs.items()}
    with _cpu_autocast_off():
        return func(*args, **kwargs)


def _cross_entropy(input: torch.Tensor, target: torch.Tensor, weight: Any = None,
                   size_average: Any = None, ignore_index: int = -100, reduce: Any = None,
                   reduction: str = "mean", label_smoothing: float = 0.0) -> torch.Tensor:
    """CUDA's ``cross_entropy_loss`` has no autocast kernel: its composite
    (``aten/src/ATen/native/LossNLL.cpp: cross_entropy_loss``) calls ``log_softmax`` (CUDA:
    fp32_set_opt_dtype, an fp32 result and no fp32 copy of the logits) then ``nll_loss`` (fp32).
    CPU autocast's ``cross_entropy_loss`` is "fp32" and copies the logits to fp32 first. With
    label smoothing (more ops in the composite) CPU's behaviour is kept."""
    if label_smoothing:
        return F.cross_entropy(input, target, weight, size_average, ignore_index, reduce,
                               reduction, label_smoothing)
    dim = 1 if input.dim() >= 2 else 0
    with _cpu_autocast_off():
        logp = torch.log_softmax(input, dim, dtype=torch.float32)
        return F.nll_loss(logp, target, weight, size_average, ignore_index, reduce, reduction)


class _CudaAutocastOnCpu(TorchFunctionMode):
    """Applies CUDA's autocast policies to fake CPU tensors (see the module docstring)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if torch.is_autocast_enabled("cpu"):
            policy = _POLICY.get(func)
            if policy is not None:
                return _apply(policy, func, args, kwargs)
            if func in _CROSS_ENTROPY and args and isinstance(args[0], torch.Tensor) and (
                    args[0].dtype in _LOW):
                return _cross_entropy(*args, **kwargs)
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
