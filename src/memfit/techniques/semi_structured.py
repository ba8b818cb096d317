"""2:4 semi-structured sparsity of the linear layers: prune, then compress where torch can.

:func:`apply_semi_structured_sparsity` keeps the 2 largest-magnitude weights in every group of 4
along each row (the input dimension: what the sparse tensor cores skip), zeroes the other 2, and
then, where the backend runs, converts the weight:

- inference: ``torch.sparse.to_sparse_semi_structured``, the compressed kept values plus their
  4-bit position codes (9/8 bytes per fp16/bf16 weight instead of 2; the layouts and their
  sources are in :mod:`memfit.semi_structured`);
- training: torchao's ``SemiSparseLinear`` (torchao/sparsity/training/__init__.py), which keeps
  the dense weight (its gradient and optimizer states too) and, in every forward, prunes and
  compresses it again with torch's tile kernel; the compressed W, W^T and a bitmask are saved
  for backward (:func:`memfit.semi_structured.training_bytes`: 19/8 bytes per weight). It
  speeds the matmuls up; it saves no memory, it costs some. The weight is not pruned up front:
  the kernel chooses the kept values each step (see ``mode`` below).

The inference backends need a CUDA weight in fp16 or bf16 on compute capability 8.0 or later,
with torch's shape minimums (``_DTYPE_SHAPE_CONSTRAINTS`` of torch/sparse/semi_structured.py:
``SparseSemiStructuredTensorCUSPARSELT`` / ``SparseSemiStructuredTensorCUTLASS``). Elsewhere,
on CPU for one, the pruned weights stay dense (the mask applied) and the report says why: the
compressed form needs CUDA. Training cannot run at all without them, so it is refused.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from memfit._noise import require
from memfit.errors import MemfitError
from memfit.semi_structured import (
    MIN_COMPUTE_CAPABILITY,
    compressed_bytes,
    shape_problem,
    training_bytes,
    training_shape_problem,
)

log = logging.getLogger(__name__)

Backend = Literal["auto", "cutlass", "cusparselt"]
SparseMode = Literal["inference", "training"]

_FORMATS: dict[torch.dtype, str] = {torch.float16: "fp16", torch.bfloat16: "bf16"}


def mask_2_4(weight: torch.Tensor) -> torch.Tensor:
    """The 2:4 magnitude mask of a 2-D weight: True for the 2 largest ``|w|`` in each group of 4
    consecutive input columns (ties go to the lower column).

    >>> mask_2_4(torch.tensor([[1., -4., 3., 2.]]))
    tensor([[False,  True,  True, False]])
    """
    if weight.dim() != 2 or weight.shape[1] % 4:
        raise MemfitError(f"2:4 sparsity groups the input dimension by 4; a weight of shape "
                          f"{tuple(weight.shape)} has no such groups")
    groups = weight.detach().abs().reshape(weight.shape[0], -1, 4)
    # A stable descending sort keeps the lower column first among equal magnitudes.
    order = torch.sort(groups, dim=-1, descending=True, stable=True).indices[..., :2]
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, order, True)
    return mask.reshape(weight.shape)


@dataclass
class SemiStructuredReport:
    """What :func:`apply_semi_structured_sparsity` did to each eligible linear layer."""

    pruned: list[str] = field(default_factory=list)
    """Layers whose weights now hold 2 nonzeros in every group of 4."""
    converted: list[str] = field(default_factory=list)
    """Of which stored compressed (inference) or run by torchao's ``SemiSparseLinear``
    (training)."""
    dense: dict[str, str] = field(default_factory=dict)
    """Pruned layers kept as dense tensors, with why (no CUDA, a dtype or shape the kernels
    lack)."""
    skipped: dict[str, str] = field(default_factory=dict)
    """Linear layers left as they were, with why."""
    dense_bytes: int = 0
    """Bytes of the pruned layers' weights as dense tensors (training: of the swapped layers'
    weights, which stay dense)."""
    compressed_bytes: int = 0
    """Bytes of the same weights in the compressed layout, for the layers whose dtype and
    shape the backend takes (:func:`memfit.semi_structured.compressed_bytes`); the layers
    that cannot be compressed count their dense bytes."""
    training_bytes: int = 0
    """Training: what each forward of the swapped layers adds and keeps until their backward
    (the compressed W, W^T and bitmask; :func:`memfit.semi_structured.training_bytes`), on top
    of the dense weights, which stay."""


def _default_targets(name: str, module: nn.Linear) -> bool:
    return name.split(".")[-1] not in ("lm_head", "head", "classifier", "score")


def _why_dense(weight: torch.Tensor, backend: str) -> str | None:
    if weight.device.type != "cuda":
        return (f"on {weight.device.type}: the compressed form needs CUDA (torch's CUTLASS and "
                "cuSPARSELt kernels); the pruned weight stays dense")
    if weight.dtype not in _FORMATS:
        return f"{weight.dtype}: the 2:4 kernels memfit uses take fp16 and bf16 weights"
    capability = torch.cuda.get_device_capability(weight.device)
    if capability < MIN_COMPUTE_CAPABILITY:
        return "compute capability below 8.0: no sparse tensor cores"
    if backend == "cutlass" and capability[0] != 8:
        return _CUTLASS_SM8X.format(cc=f"{capability[0]}.{capability[1]}")
    return shape_problem(weight.shape[0], weight.shape[1], _FORMATS[weight.dtype], backend)


# Note: [CUTLASS 2:4 is sm8x only] torch's CUTLASS 2:4 matmul refuses any other compute
# capability at the first product ("sparse_semi_structured_mad_op : Supported only on GPUs with
# compute capability 8.x"), though the conversion itself succeeds: measured on an H100 (9.0),
# torch 2.11.0+cu130, bench/results/semi-structured-kernels-h100-2026-11-27.json. cuSPARSELt
# runs there.
_CUTLASS_SM8X = ("torch's CUTLASS 2:4 kernels run on compute capability 8.x only, not {cc}; "
                 "use backend='cusparselt' (or 'auto')")


def _backend(backend: Backend) -> str:
    if backend != "auto":
        return backend
    from torch.backends import cusparselt

    return "cusparselt" if cusparselt.is_available() else "cutlass"


def _compress(weight: torch.Tensor, backend: str) -> torch.Tensor:
    from torch.sparse import SparseSemiStructuredTensorCUSPARSELT, SparseSemiStructuredTensorCUTLASS

    # The backend's class directly, rather than flipping the global _FORCE_CUTLASS.
    cls: Any = (SparseSemiStructuredTensorCUTLASS if backend == "cutlass"
                else SparseSemiStructuredTensorCUSPARSELT)
    return cls.from_dense(weight.detach().contiguous())


def _training_refusal(name: str, weight: torch.Tensor) -> str | None:
    """Why torchao's SemiSparseLinear cannot run at all for this weight (the whole call is
    refused), or None."""
    if weight.device.type != "cuda":
        return (f"2:4 training runs torchao's SemiSparseLinear, whose kernels (torch's "
                f"_sparse_semi_structured_tile, cuSPARSELt) need CUDA; the weight of {name!r} is "
                f"on {weight.device.type}: move the model to an NVIDIA GPU of compute capability "
                "8.0+ first")
    if weight.dtype not in _FORMATS:
        return (f"2:4 training: the weight of {name!r} is {weight.dtype}; torch's 2:4 tile kernel "
                "takes fp16 and bf16 weights (not fp32 under autocast): convert the model with "
                ".half() or .bfloat16() first")
    if torch.cuda.get_device_capability(weight.device) < MIN_COMPUTE_CAPABILITY:
        return ("2:4 training: this GPU has compute capability below 8.0, no sparse tensor "
                "cores; use an A100, H100 or later, or drop 2:4 sparsity")
    from torch.backends import cusparselt

    if not cusparselt.is_available():
        return ("2:4 training: this torch build has no cuSPARSELt "
                "(torch.backends.cusparselt.is_available() is False), which torchao's "
                "SemiSparseLinear calls; install a CUDA build of torch from pytorch.org")
    return None


class _SparsifyStraightThrough(torch.autograd.Function):
    """The weight as a cuSPARSELt 2:4 tensor, built by torch's own
    ``SparseSemiStructuredTensorCUSPARSELT.prune_dense_static_sort`` (the same tile kernel and
    algorithm as torchao's ``_SparsifyFunc``); the gradient passes straight through, as
    torchao's does.

    Note: [torchao's 2:4 training on torch 2.11] torchao 0.17's ``_SparsifyFunc`` passes the
    tile kernel's packed values to the tensor as they come, 1-D, and torch 2.11's
    ``_cslt_sparse_mm`` asserts a 2-D matrix ("compressed_A.dim() == 2 INTERNAL ASSERT FAILED",
    aten/src/ATen/native/sparse/cuda/cuSPARSELtOps.cpp:302): its ``SemiSparseLinear`` fails at
    the first forward. torch's constructor views them as 2-D; measured on an H100 and an H200,
    torch 2.11.0+cu130 (bench/results/semi-structured-kernels-h200-2026-11-27.json)."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        from torch.sparse import SparseSemiStructuredTensorCUSPARSELT

        return SparseSemiStructuredTensorCUSPARSELT.prune_dense_static_sort(weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad


@functools.cache
def _semi_sparse_linear(base: type[Any]) -> Any:
    """torchao's ``SemiSparseLinear`` (``base``) with its weight sparsified by
    :class:`_SparsifyStraightThrough` (Note: [torchao's 2:4 training on torch 2.11])."""

    class SemiSparseLinear(base):  # type: ignore[valid-type, misc]
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.linear(x, _SparsifyStraightThrough.apply(self.weight),
                                        self.bias)

    SemiSparseLinear.__qualname__ = SemiSparseLinear.__name__ = "SemiSparseLinear"
    SemiSparseLinear.__module__ = __name__
    return SemiSparseLinear


def _swap_for_training(model: nn.Module, layers: list[tuple[str, nn.Linear]],
                       report: SemiStructuredReport) -> None:
    """Swap each layer whose shape the tile kernel takes to torchao's ``SemiSparseLinear``
    (shared parameters, no copy); the rest go to ``report.skipped``."""
    runnable: list[tuple[str, nn.Linear]] = []
    for name, mod in layers:
        why_not = _training_refusal(name, mod.weight)
        if why_not is not None:
            raise MemfitError(why_not)
        why = training_shape_problem(mod.out_features, mod.in_features,
                                     _FORMATS[mod.weight.dtype])
        if why is not None:
            report.skipped[name] = why
        else:
            runnable.append((name, mod))
    if not runnable:
        first = next(iter(report.skipped.items()), None)
        raise MemfitError("2:4 training: no linear layer torchao's SemiSparseLinear can run"
                          + (f" ({first[0]}: {first[1]})" if first else ""))
    training = require("torchao.sparsity.training", "quant",
                       "2:4 training (torchao's SemiSparseLinear)")
    cls = _semi_sparse_linear(training.SemiSparseLinear)
    for name, mod in runnable:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, cls.from_dense(mod))
        report.converted.append(name)
        fmt = _FORMATS[mod.weight.dtype]
        report.dense_bytes += mod.weight.numel() * mod.weight.element_size()
        report.training_bytes += training_bytes(mod.out_features, mod.in_features, fmt).total


def apply_semi_structured_sparsity(
        model: nn.Module, *, mode: SparseMode = "inference", backend: Backend = "auto",
        targets: Callable[[str, nn.Linear], bool] | None = None) -> SemiStructuredReport:
    """Prune the linear layers of ``model`` to 2:4 by magnitude and, where torch's kernels run,
    store them compressed (``mode="inference"``), or swap them to torchao's ``SemiSparseLinear``
    (``mode="training"``). In place; returns a :class:`SemiStructuredReport`.

    ``targets(name, linear)`` chooses the layers (default: every ``nn.Linear`` but a head named
    ``lm_head``, ``head``, ``classifier`` or ``score``); a layer whose input features are not a
    multiple of 4, or whose weight another module shares, is skipped. ``backend="auto"`` is
    cuSPARSELt where torch has it, else CUTLASS (what ``to_sparse_semi_structured`` picks).

    ``mode="training"`` needs the model on a CUDA GPU of compute capability 8.0+, in fp16 or
    bf16 (inputs too), torch with cuSPARSELt and torchao; otherwise it is refused in one line.
    Layers whose dimensions are not multiples of 128 stay ``nn.Linear`` (``report.skipped``).
    The weights are not pruned up front: each forward, torch's ``_sparse_semi_structured_tile``
    (``algorithm=""``: ``LargestValuesGreedy<IdentityOp>``, ComputeSparseTile.h) keeps in every
    4 x 4 tile the largest values, by signed value, not magnitude, at most 2 per row and per
    column, so that W and W^T are both 2:4; the dense weight gets the whole gradient (straight-
    through, torchao/sparsity/training/autograd.py: ``_SparsifyFunc.backward``). ``backend``
    does not apply: torchao's ``SemiSparseLinear`` always runs cuSPARSELt.

    >>> model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    >>> report = apply_semi_structured_sparsity(model)   # on CPU: pruned, kept dense
    >>> report.pruned, list(report.dense)
    (['0', '2'], ['0', '2'])
    """
    if mode not in ("inference", "training"):
        raise MemfitError(f"mode={mode!r}: give 'inference' (compressed weights) or 'training' "
                          "(torchao's SemiSparseLinear)")
    if backend not in ("auto", "cutlass", "cusparselt"):
        raise MemfitError(f"backend={backend!r}: give 'auto', 'cutlass' or 'cusparselt'")
    chosen = targets or _default_targets
    owners: dict[int, int] = {}
    for mod in model.modules():
        for p in mod.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    report = SemiStructuredReport()
    layers: list[tuple[str, nn.Linear]] = []
    for name, mod in list(model.named_modules()):
        if not isinstance(mod, nn.Linear) or not chosen(name, mod):
            continue
        if mod.in_features % 4:
            report.skipped[name] = f"{mod.in_features} input features: not groups of 4"
            continue
        if owners.get(id(mod.weight), 0) > 1:
            report.skipped[name] = "its weight is shared (tied) with another module"
            continue
        layers.append((name, mod))
    if mode == "training":
        _swap_for_training(model, layers, report)
        log.info("memfit: 2:4 training: %d linear layer(s) on torchao's SemiSparseLinear "
                 "(+%d bytes per forward, held for backward)", len(report.converted),
                 report.training_bytes)
        return report
    kernel_backend = _backend(backend)
    if backend == "cutlass" and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability()
        if capability[0] != 8 and capability >= MIN_COMPUTE_CAPABILITY:
            raise MemfitError(_CUTLASS_SM8X.format(cc=f"{capability[0]}.{capability[1]}"))
    for name, mod in layers:
        w = mod.weight
        with torch.no_grad():
            w.mul_(mask_2_4(w))
        report.pruned.append(name)
        size = w.numel() * w.element_size()
        report.dense_bytes += size
        why = _why_dense(w, kernel_backend)
        fmt = _FORMATS.get(w.dtype)
        fits = fmt is not None and shape_problem(w.shape[0], w.shape[1], fmt,
                                                 kernel_backend) is None
        report.compressed_bytes += (compressed_bytes(w.shape[0], w.shape[1], fmt,
                                                     kernel_backend).total
                                    if fits and fmt is not None else size)
        if why is not None:
            report.dense[name] = why
            continue
        mod.weight = nn.Parameter(_compress(w, kernel_backend), requires_grad=False)
        report.converted.append(name)
    log.info("memfit: 2:4 sparsity: %d linear layer(s) pruned, %d compressed%s",
             len(report.pruned), len(report.converted),
             f"; {len(report.dense)} kept dense ({next(iter(report.dense.values()))})"
             if report.dense else "")
    return report
