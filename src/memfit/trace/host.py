"""Host memory in a traced step: the copies that offload techniques keep off the device.

Note: [host memory in a CUDA trace] On a CPU-only torch a CUDA target is traced on fake *CPU*
tensors (see engine.py), so a tensor's ``.device`` cannot say whether it stands for device memory
or for the host memory an offload copies it to. The techniques that move tensors to the host
(activation offload, optimizer-state offload) ask :func:`stands_for_device` whether a tensor would
be on the GPU, and make their host copies with :func:`copy_to_host` (or inside
:func:`host_memory`). The tracker records every storage created there as host memory: it is left
out of the device peak and the caching-allocator model, and its own peak is reported as
``Estimate.host_peak_bytes``. The copy back (:func:`copy_to_device`) is a new device allocation,
as on the GPU.

On a CPU target host memory *is* the device memory, so nothing changes: these helpers then copy
as the real run would, and every byte counts. Outside a trace they are plain tensor operations.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from memfit.trace.tracker import Tracker

__all__ = ["copy_to_device", "copy_to_host", "host_memory", "is_fake", "record_stream",
           "side_stream", "stands_for_device", "traced_save_on_cpu"]

_ACTIVE: list[Tracker] = []  # the tracker of the trace running now (the engine is not reentrant)


@contextlib.contextmanager
def tracing(tracker: Tracker) -> Iterator[None]:
    """Make ``tracker`` the one these helpers report to, for the duration of a trace."""
    _ACTIVE.append(tracker)
    try:
        yield
    finally:
        _ACTIVE.remove(tracker)


def _tracker() -> Tracker | None:
    return _ACTIVE[-1] if _ACTIVE else None


def is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` is a fake tensor (the trace's), not a real one."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def stands_for_device(t: torch.Tensor) -> bool:
    """Whether ``t`` is in accelerator memory, i.e. moving it to the host frees device memory: a
    CUDA (or other accelerator) tensor, or, in a trace of a CUDA target on a CPU-only torch, a
    fake CPU tensor standing for CUDA memory that is not itself a host copy."""
    if t.device.type not in ("cpu", "meta"):
        return True
    tracker = _tracker()
    return (tracker is not None and tracker.host_split and t.device.type == "cpu"
            and is_fake(t) and not tracker.is_host(t))


@contextlib.contextmanager
def host_memory() -> Iterator[None]:
    """Tensors created inside are host memory in a trace of a CUDA target (see the module note);
    outside a trace, and for a CPU target, this does nothing."""
    tracker = _tracker()
    if tracker is None or not tracker.host_split:
        yield
        return
    tracker.host_depth += 1
    try:
        yield
    finally:
        tracker.host_depth -= 1


def copy_to_host(t: torch.Tensor, *, pin_memory: bool = False) -> torch.Tensor:
    """A host (CPU) copy of ``t`` with the same strides when dense; pinned if asked and ``t`` is
    on CUDA (pinned memory makes the copies asynchronous)."""
    pin = pin_memory and t.is_cuda and not is_fake(t)
    with host_memory():
        host = torch.empty_like(t, device="cpu", pin_memory=pin)
    host.copy_(t, non_blocking=pin)
    return host


def copy_to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``host`` back on ``device``: a new device allocation (also in a trace, where a CUDA target's
    device tensors are fake CPU tensors and ``.to`` would return ``host`` itself)."""
    tracker = _tracker()
    if (tracker is not None and tracker.host_split and is_fake(host)
            and torch.device(device).type == "cpu"):
        return host.clone()
    return host.to(device, non_blocking=host.is_pinned() if not is_fake(host) else False)


def record_stream(t: torch.Tensor, stream: int) -> None:
    """In a trace of a CUDA target: ``t.record_stream(stream)`` for the caching-allocator model
    (its free waits for ``stream``; Note: [record_stream in a trace] in tracker.py)."""
    tracker = _tracker()
    if tracker is not None and tracker.host_split:
        tracker.record_stream(t, stream)


@contextlib.contextmanager
def side_stream(stream: int) -> Iterator[None]:
    """In a trace of a CUDA target: device tensors made inside come from CUDA stream
    ``stream``'s own allocator pools (``torch.cuda.stream(s)``); else nothing."""
    tracker = _tracker()
    if tracker is None or not tracker.host_split:
        yield
        return
    with tracker.on_stream(stream):
        yield


@contextlib.contextmanager
def traced_save_on_cpu() -> Iterator[None]:
    """Make the ``torch.autograd.graph.save_on_cpu`` contexts created inside (during a trace of a
    CUDA target) keep their copies as host memory, as on the GPU. On the fake CPU tensors that
    stand for CUDA memory, its ``tensor.cpu()`` returns the tensor itself and would move
    nothing. torch's class is patched for the duration only, and restored on exit.

    Known limitation: a ``save_on_cpu`` made before the trace started keeps torch's hooks.
    """
    cls = torch.autograd.graph.save_on_cpu
    original = cls.__init__

    def __init__(self: torch.autograd.graph.save_on_cpu, pin_memory: bool = False,
                 device_type: str = "cuda") -> None:
        def pack(t: torch.Tensor) -> tuple[torch.device | None, torch.Tensor]:
            if not stands_for_device(t):
                return (None, t)
            return (t.device, copy_to_host(t, pin_memory=pin_memory))

        def unpack(packed: tuple[torch.device | None, torch.Tensor]) -> torch.Tensor:
            device, t = packed
            return t if device is None else copy_to_device(t, device)

        torch.autograd.graph.saved_tensors_hooks.__init__(self, pack, unpack)

    cls.__init__ = __init__  # type: ignore[method-assign]
    try:
        yield
    finally:
        cls.__init__ = original  # type: ignore[method-assign]
