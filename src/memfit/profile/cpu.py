"""Peak CPU memory of a real run, from the PyTorch profiler's allocator events.

The profiler (``profile_memory=True``) records one ``[memory]`` event per allocation (positive
bytes) and per free (negative bytes) made by PyTorch's CPU allocator while it is active. The peak
of their running sum is the most the run had allocated on top of what was alive before it; adding
the bytes alive before the run (parameters, buffers, inputs, optimizer state: counted by storage)
gives the absolute peak, the number a memory estimate of the whole step predicts.

This is deliberately independent of :mod:`memfit.trace`: it runs real kernels on real tensors and
reads the allocator, so it measures what the engine only models.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile


@dataclass(frozen=True, kw_only=True)
class CpuPeak:
    """What one measured run allocated on the CPU.

    Known limitations: only allocations made through PyTorch's CPU allocator are seen (oneDNN or
    OpenMP scratch memory that bypasses it is not); allocations of size zero are not reported; and
    freeing a block allocated before profiling started is not reported, so a run that frees part
    of its baseline and then allocates is over-measured by up to the bytes it freed.
    """

    peak_bytes: int
    """``baseline_bytes`` plus the peak of the running sum of allocator events."""
    baseline_bytes: int
    """Bytes alive before the run, counted by storage from the objects passed as ``alive``."""
    peak_delta_bytes: int
    """The peak of the running sum of allocator events (bytes above the baseline)."""
    end_delta_bytes: int
    """The running sum at the end of the run: bytes the run left allocated (or freed, if < 0)."""
    num_events: int
    """Allocator events recorded (allocations and frees)."""
    result: Any = None
    """What ``fn`` returned."""


def _storages(obj: object, seen: dict[int, int]) -> None:
    """Record ``{storage data_ptr: nbytes}`` for every CPU tensor reachable from ``obj``."""
    if isinstance(obj, torch.Tensor):
        tensors: Iterable[torch.Tensor] = [obj]
        if obj.grad is not None:
            tensors = [obj, obj.grad]
        for t in tensors:
            if t.device.type != "cpu":
                continue
            st = t.untyped_storage()
            if st.nbytes() > 0:
                seen[st.data_ptr()] = st.nbytes()
    elif isinstance(obj, torch.nn.Module):
        for t in obj.parameters():
            _storages(t, seen)
        for t in obj.buffers():
            _storages(t, seen)
    elif isinstance(obj, torch.optim.Optimizer):
        for state in obj.state.values():
            _storages(state, seen)
    elif isinstance(obj, dict):
        for v in obj.values():
            _storages(v, seen)
    elif isinstance(obj, list | tuple | set):
        for v in obj:
            _storages(v, seen)


def live_bytes(*alive: object) -> int:
    """Bytes of the distinct CPU storages reachable from ``alive`` (tensors, modules, optimizers,
    and dicts/lists/tuples of them). Views and tied tensors share a storage and count once.

    >>> live_bytes(torch.empty(10), torch.empty(3, dtype=torch.float64))
    64
    """
    seen: dict[int, int] = {}
    for obj in alive:
        _storages(obj, seen)
    return sum(seen.values())


def measure_cpu_peak(fn: Callable[[], Any], *alive: object) -> CpuPeak:
    """Run ``fn()`` under the profiler and return its peak CPU memory.

    ``alive`` are the objects holding memory before the run that the peak should include
    (the model, the inputs, an optimizer with state); their bytes are counted by storage.

    >>> peak = measure_cpu_peak(lambda: torch.empty(1000).sum())
    >>> peak.peak_delta_bytes  # the 4000-byte tensor and the 4-byte sum it returns
    4004
    """
    baseline = live_bytes(*alive)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    deltas: list[tuple[int, int]] = []
    for event in prof.profiler.kineto_results.events():  # type: ignore[union-attr]
        if event.name() == "[memory]" and event.device_type() == torch.autograd.DeviceType.CPU:
            deltas.append((event.start_ns(), event.nbytes()))
    deltas.sort(key=lambda d: d[0])  # stable: simultaneous events keep their recorded order
    running = peak = 0
    for _, nbytes in deltas:
        running += nbytes
        peak = max(peak, running)
    return CpuPeak(peak_bytes=baseline + peak, baseline_bytes=baseline, peak_delta_bytes=peak,
                   end_delta_bytes=running, num_events=len(deltas), result=result)
