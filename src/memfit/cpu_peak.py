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

import bisect
import gc
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from memfit._noise import quiet_profile


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
            if t.layout is torch.sparse_coo:  # a sparse gradient: its indices and values
                _storages((t._indices(), t._values()), seen)
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


OP_MARKER = "memfit::op"
"""Name of the profiler range :class:`memfit.profiling.Profiler` opens around each op it records,
so the allocator's events can be placed on its timeline (see :func:`marked_allocator_events`)."""


def _raw_events(prof: profile, device: str,
                marker: str | None = None) -> tuple[list[tuple[int, int, int, Any]], list[Any]]:
    """``(time_ns, address, ±bytes, enclosing marker event or None)`` of every allocator event
    on ``device``, and the ``marker`` range events (unordered)."""
    events: list[tuple[int, int, int, Any]] = []
    markers: list[Any] = []
    tree = prof.profiler.kineto_results.experimental_event_tree()  # type: ignore[union-attr]
    stack: list[tuple[Any, Any]] = [(e, None) for e in tree]
    while stack:
        event, inside = stack.pop()
        if event.tag == _EventType.Allocation:
            fields = event.extra_fields
            if fields.device.type == device and fields.alloc_size != 0:
                events.append((event.start_time_ns, fields.ptr, fields.alloc_size, inside))
            continue
        if inside is None and marker is not None and event.name == marker:
            inside = event
            markers.append(event)
        stack.extend((c, inside) for c in event.children)
    return events, markers


def allocator_deltas(prof: profile, device: str = "cpu") -> list[int]:
    """The allocator's ``+bytes`` / ``-bytes`` events on ``device`` from a finished
    ``profile(profile_memory=True)``, in time order.

    A free is kept only if its block was allocated while ``prof`` ran. PyTorch's CPU allocator
    remembers the size of every block allocated under *any* profiling session and forgets it only
    when the block is freed *during* one; a block allocated under an earlier session and freed
    outside any leaves a stale entry, and a later block at the same address that is freed under
    this session is then reported with the stale size. Keeping only this session's blocks makes
    the running sum exact for them and the same from run to run (without this, a QAT step measured
    2% lower in one CI run out of several: 32 KiB frees of scales allocated before the run).
    """
    return session_deltas(_raw_events(prof, device)[0])


def marked_allocator_events(prof: profile, marker: str = OP_MARKER,
                            device: str = "cpu") -> list[tuple[int, int]]:
    """``(slot, ±bytes)`` of this session's allocator events (as :func:`allocator_deltas`), in
    time order, each placed relative to the ``marker`` ranges (ordered by start): slot ``2k + 1``
    is inside the ``k``-th range, slot ``2k`` between the ``(k-1)``-th and the ``k``-th (so slot
    ``2n``, for ``n`` ranges, is after the last). Inside a range is decided by the event tree
    (exact); between ranges by the events' times."""
    raw, markers = _raw_events(prof, device, marker)
    markers.sort(key=lambda m: m.start_time_ns)
    index = {id(m): k for k, m in enumerate(markers)}
    starts = [m.start_time_ns for m in markers]
    out: list[tuple[int, int]] = []
    for time_ns, _, nbytes, inside in session_events(raw):
        if inside is not None:
            out.append((2 * index[id(inside)] + 1, nbytes))
        else:
            out.append((2 * bisect.bisect_right(starts, time_ns), nbytes))
    return out


def session_events(events: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """``(time_ns, address, ±bytes, ...)`` allocator events -> the same in time order, without
    frees of blocks that no event here allocated (see :func:`allocator_deltas`)."""
    events = sorted(events, key=lambda e: e[0])  # stable: simultaneous events keep their order
    alive: dict[int, int] = {}
    kept: list[tuple[Any, ...]] = []
    for event in events:
        ptr, nbytes = event[1], event[2]
        if nbytes > 0:
            alive[ptr] = nbytes
        elif alive.pop(ptr, None) is None:
            continue  # allocated before this session: not counted on either side
        kept.append(event)
    return kept


def session_deltas(events: list[tuple[int, int, int]]) -> list[int]:
    """``(time_ns, address, ±bytes)`` allocator events -> the ``±bytes`` in time order, without
    frees of blocks that no event here allocated (see :func:`allocator_deltas`)."""
    return [e[2] for e in session_events(events)]


def running_peak(deltas: Iterable[int]) -> tuple[int, int]:
    """``(peak, end)`` of the running sum of ``deltas``."""
    running = peak = 0
    for nbytes in deltas:
        running += nbytes
        peak = max(peak, running)
    return peak, running


def measure_cpu_peak(fn: Callable[[], Any], *alive: object) -> CpuPeak:
    """Run ``fn()`` under the profiler and return its peak CPU memory.

    ``alive`` are the objects holding memory before the run that the peak should include
    (the model, the inputs, an optimizer with state); their bytes are counted by storage.

    Python's cycle collector is collected before the run and paused during it, so the peak does
    not depend on when the collector happens to run: garbage in reference cycles made by the run
    (some libraries' autograd functions make it) lives until the run ends, an upper bound.

    >>> peak = measure_cpu_peak(lambda: torch.empty(1000).sum())
    >>> peak.peak_delta_bytes  # the 4000-byte tensor and the 4-byte sum it returns
    4004
    """
    gc.collect()
    baseline = live_bytes(*alive)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        # quiet_profile: without kineto's profiler_start/stop lines (see memfit._noise)
        with quiet_profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            result = fn()
    finally:
        if was_enabled:
            gc.enable()
    deltas = allocator_deltas(prof)
    peak, end = running_peak(deltas)
    return CpuPeak(peak_bytes=baseline + peak, baseline_bytes=baseline, peak_delta_bytes=peak,
                   end_delta_bytes=end, num_events=len(deltas), result=result)
