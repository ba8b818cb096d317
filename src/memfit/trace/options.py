"""What a trace may be asked for, and the facts of its target: the precisions and devices the
engine models (:data:`PRECISIONS`, :data:`DEVICES`), the checks made before tracing
(:func:`check_request`), the GPU's compute capability and runtime parts, and the hooks one rank
of a parallel layout passes in (:class:`RankHooks`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

import torch
from torch import nn

from memfit import vocab
from memfit._loss import LossFn, check_loss_fn, model_loss
from memfit.dtypes import torch_dtype
from memfit.errors import MemfitError, suggest
from memfit.gpus import GpuSpec
from memfit.trace.optim import OptimizerFactory


def _dtypes(p: vocab.Precision) -> tuple[torch.dtype | None, torch.dtype | None]:
    """(autocast dtype, dtype the model is cast to) of ``p``; None: no autocast, and the model
    as given for fp32 parameters ("-mixed" is autocast over fp32 parameters)."""
    return (torch_dtype(p.autocast) if p.autocast else None,
            None if p.params == "fp32" else torch_dtype(p.params))


PRECISIONS = {name: _dtypes(vocab.precision(name)) for name in vocab.names("precision", "trace")}
"""Precision name -> (autocast dtype, parameter dtype), from :class:`memfit.vocab.Precision`."""

DEVICES = ("cuda", "cpu", "mps")
"""``cuda``: an NVIDIA GPU, or an AMD one (ROCm: the ``gpu``'s target, ``GpuSpec.target``);
``mps``: Apple silicon (:func:`check_target`); ``cpu``."""
_DEFAULT_CC = (8, 0)  # SDPA routing when no GPU is named: an A100-class GPU


def _compute_capability(gpu: GpuSpec | None) -> tuple[int, int]:
    if gpu is None or not gpu.compute_capability:
        return _DEFAULT_CC
    major, _, minor = gpu.compute_capability.partition(".")
    return int(major), int(minor or 0)


def _resolve_gpu(gpu: str | GpuSpec | None) -> GpuSpec | None:
    if gpu is None or isinstance(gpu, GpuSpec):
        return gpu
    from memfit.gpus import get_gpu

    return get_gpu(gpu)


def _runtime(gpu: GpuSpec | None, num_gpus: int, training: bool
             ) -> tuple[dict[str, int], frozenset[str], str | None]:
    """Runtime parts by name and which of them the caching allocator holds, by the GPU's
    target: CUDA's context and cuBLAS workspaces, ROCm's HIP context and hipBLAS/hipBLASLt
    workspaces (:mod:`memfit.runtime.rocm`), none on MPS."""
    from memfit.runtime import ALLOCATOR_PARTS, compute_capability_for, target_runtime_bytes
    from memfit.runtime.targets import ROCM_NAMES

    target = gpu.target if gpu else "cuda"
    arch = None
    if gpu is not None and target != "mps":
        arch = gpu.compute_capability or compute_capability_for(gpu.name)
    # Matmuls run on the main thread (forward) and on autograd's device thread (backward), each
    # with its own cuBLAS (hipBLAS) handle and workspaces.
    parts = target_runtime_bytes(target, arch, num_gpus=num_gpus,
                                 matmul_threads=2 if training else 1)
    inside = {*ALLOCATOR_PARTS, *(ROCM_NAMES[p] for p in ALLOCATOR_PARTS)}
    return dict(parts), frozenset(inside) & set(parts), None


def check_target(device: str, gpu: str | GpuSpec | None, *, precision: str,
                 expandable_segments: bool, num_gpus: int) -> GpuSpec | None:
    """The GPU a trace on ``device`` models, checked against its target: an Apple GPU only
    with ``device="mps"``, ``device="mps"`` without CUDA's features (fp8, expandable
    segments, NCCL over several GPUs). One MemfitError line each."""
    if device == "cpu":
        if gpu is not None:  # it was dropped without a word: the trace models the host
            name = gpu.name if isinstance(gpu, GpuSpec) else gpu
            raise MemfitError(f"device='cpu' models this machine's host memory, not a GPU: drop "
                              f"gpu={name!r}, or use device='cuda' to model that GPU")
        return None
    spec = _resolve_gpu(gpu)
    if device == "cuda" and spec is not None and spec.target == "mps":
        raise MemfitError(f"{spec.label} is Apple silicon: trace it with device='mps' "
                          "(--gpu picks it in memfit plan)")
    if device != "mps":
        return spec
    if spec is not None and spec.target != "mps":
        raise MemfitError(f"device='mps' models Apple silicon; {spec.label} is a "
                          f"{spec.target.upper()} GPU: use device='cuda'")
    p = vocab.precision(precision)
    if p.needs == "fp8" or expandable_segments or num_gpus > 1:
        what = ("fp8" if p.needs == "fp8" else "expandable_segments" if expandable_segments
                else f"num_gpus={num_gpus} (NCCL)")
        raise MemfitError(f"{what} is CUDA-only; PyTorch's MPS backend has no such feature: "
                          "drop it for device='mps'")
    return spec


def _validate(optimizer: Any, precision: str, device: str, steps: int) -> None:
    vocab.check("precision", precision, "trace")
    if device not in DEVICES:
        raise MemfitError(f"unknown device {device!r}{suggest(device, DEVICES)}; valid: "
                          f"{', '.join(DEVICES)} (the device to model, not where to run)")
    if not isinstance(steps, int) or steps < 1:
        raise MemfitError(f"steps must be a positive integer, got {steps!r}; use steps=2 to "
                          f"cover optimizer-state creation and the steady state")


def check_request(model: Any, *, optimizer: str | OptimizerFactory | None, precision: str,
                  loss_fn: LossFn | None, device: str, steps: int) -> LossFn:
    """The checks :func:`estimate` makes before tracing (one MemfitError line each), and the
    loss it will compute; ``memfit.parallel`` makes them once before tracing each rank."""
    _validate(optimizer, precision, device, steps)
    compute_loss = check_loss_fn(loss_fn) or model_loss
    if not isinstance(model, nn.Module):
        raise MemfitError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        if t.layout in _COMPRESSED:
            raise MemfitError(
                f"{name} is a {str(t.layout).removeprefix('torch.')} tensor, which the trace "
                f"does not model: estimate the model before memfit.techniques.sparsify() (its "
                f"report gives the sparse weights' bytes)")
    return compute_loss


_COMPRESSED = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


class RankHooks(Protocol):
    """What one rank of a parallel layout changes in a trace (``memfit.parallel`` implements it,
    as PyTorch's ``FSDPMemTracker`` extends ``MemTracker``: the engine is extended, never calls
    up). Optional members, read with ``getattr``: ``local_model(model)`` (the part of the model
    this rank holds, e.g. a pipeline stage), ``runs_step`` and ``run_step(model, inputs,
    tracker, ...)`` (a rank whose schedule runs the forward and backward itself)."""

    def tracing(self, tracker: Any, fake_mode: Any) -> contextlib.AbstractContextManager[Any]:
        """Entered around the whole trace (the rank's fake process group, its streams)."""
        ...

    def wrap_model(self, model: nn.Module, tracker: Any, fake_mode: Any) -> nn.Module:
        """The fake model as this rank runs it (DDP, FSDP2, tensor-parallel shards)."""
        ...

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer as this rank steps it (ZeRO-1's partition, an offloaded step)."""
        ...
