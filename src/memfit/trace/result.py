"""The :class:`~memfit.trace.estimate.Estimate` of a finished trace: the tracker's ledger
replayed into the timeline, the peak and its breakdown by category and module, and the notes
the trace adds (:data:`CONV_NOTE`, :func:`retries_note`).
"""

from __future__ import annotations

from typing import Any

import torch

from memfit.categories import MemoryCategory
from memfit.ledger import replay
from memfit.trace.estimate import TRACKED, Estimate, ModuleMemory, TimelinePoint
from memfit.trace.tracker import Tracker

_CONVOLUTIONS = frozenset({torch.ops.aten.convolution.default,
                           torch.ops.aten.convolution_backward.default})
CONV_NOTE = (
    "convolutions on CUDA: cuDNN's workspaces (and, for some fp32 nets, more) are not modelled; "
    "memfit validate on an H100 (torch 2.11) measured convolutional nets 4-16% above this "
    "trace's allocated peak and up to 33% above its reserved peak "
    "(bench/results/validate-h100-2026-11-27.json): leave that much room")


def retries_note(retries: int) -> str:
    """What an estimate says when the simulated caching allocator ran out of device memory
    ``retries`` times and went on: PyTorch's ``malloc`` then frees every cached segment of every
    stream and tries again (``c10/cuda/CUDACachingAllocator.cpp``: ``release_cached_blocks``;
    ``torch.cuda.memory_stats()['num_alloc_retries']``: "number of failed cudaMalloc calls that
    result in a cache flush and retry"). The step fits, but its reserved peak is this GPU's: on
    a GPU with more memory the same step reserves more (torchtitan's Llama 3.1 8B run: 72.7 GiB
    on an 80 GB H100, 79.4 GiB on its 96 GB one; docs/evidence.md)."""
    times = "once" if retries == 1 else f"{retries} times"
    return (f"the caching allocator filled the GPU {times} in the traced steps and freed its "
            f"cache to go on (num_alloc_retries {retries}: a cache flush and retry, each a "
            f"cudaFree of every unused cached segment); the reserved peak is bounded by this "
            f"GPU's memory, and a GPU with more memory reserves more for the same step")


def _result(tracker: Tracker, allocator: Any, runtime: dict[str, int],
            in_allocator: frozenset[str], *, device: str,
            precision: str, optimizer: Any, steps: int, notes: list[str],
            elapsed: float) -> Estimate:
    activation: dict[str, int] = {}
    for info in tracker.infos:
        if info.saved and info.step == 0 and info.role is None:
            activation[info.module] = activation.get(info.module, 0) + info.nbytes
    ops = tracker.ops
    run = replay(tracker, [op[4] for op in ops], tracker.peak_events, TRACKED)
    names: dict[Any, str] = {}  # str(OpOverload) is Python code: once per op kind
    timeline = [TimelinePoint(index=i, op=names.get(op[0]) or names.setdefault(op[0], str(op[0])),
                              phase=op[1], step=op[2], module=op[3], bytes=after)
                for i, (op, after) in enumerate(zip(ops, run.after, strict=True))]
    breakdown = run.peak.by_category(TRACKED)
    if run.peak_op < len(ops):  # else the peak is the baseline (nothing allocated by any op)
        breakdown[MemoryCategory.TEMPORARIES] += tracker.peak_extra
    at_peak = tracker.by_module(run.peak.live)
    breakdown[MemoryCategory.RUNTIME] += sum(v for k, v in runtime.items()
                                             if k not in in_allocator)
    peak_bytes = tracker.peak
    peak_reserved = peak_bytes
    if allocator is not None:
        peak_reserved = max(allocator.peak_reserved_bytes, peak_bytes)
    if 0 <= tracker.peak_op < len(tracker.ops):
        func, phase, step, module, _ = tracker.ops[tracker.peak_op]
        peak_op, peak_phase, peak_step, peak_module = str(func), phase, step, module
    else:
        peak_op, peak_phase, peak_step, peak_module = "(before the first op)", "setup", 0, ""
    names = set(at_peak) | set(activation)
    modules = {name: ModuleMemory(name=name, at_peak=at_peak.get(name, {}),
                                  activation_bytes=activation.get(name, 0)) for name in names}
    opt_name = optimizer if isinstance(optimizer, str) or optimizer is None else getattr(
        optimizer, "__name__", "custom")
    if device == "cuda" and any(op[0] in _CONVOLUTIONS for op in ops):
        notes = [*notes, CONV_NOTE]
    if allocator is not None and allocator.num_alloc_retries:
        notes = [*notes, retries_note(allocator.num_alloc_retries)]
    return Estimate(peak_bytes=peak_bytes, peak_reserved_bytes=peak_reserved, breakdown=breakdown,
                    runtime=runtime, device=device, precision=precision, optimizer=opt_name,
                    steps=steps, peak_op=peak_op, peak_phase=peak_phase, peak_step=peak_step,
                    peak_module=peak_module, timeline=timeline, modules=modules,
                    num_ops=len(tracker.ops), trace_seconds=elapsed, assumptions=tuple(notes),
                    runtime_in_allocator=in_allocator, host_peak_bytes=tracker.host_peak,
                    phase_peaks=dict(tracker.phase_peaks),
                    op_peaks=dict(tracker.op_peaks))
