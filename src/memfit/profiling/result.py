"""What a profiled run measured: peak, breakdown at the peak, timeline, modules, top tensors.

These are plain frozen dataclasses with integer bytes; units are formatted only by the reports.
``ProfileResult.to_dict()`` is the ``--json`` schema; its keys ``device``, ``peak_bytes``,
``peak_reserved_bytes``, ``breakdown`` and ``inside_kernels_bytes`` are stable, and
``sum(breakdown.values()) + inside_kernels_bytes == peak_bytes`` whenever
``inside_kernels_bytes`` is not null.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from memfit.categories import MemoryCategory
from memfit.ledger import STORAGE_CATEGORIES, ModuleMemory, TimelinePoint

if TYPE_CHECKING:
    from memfit.trace.estimate import Estimate

SCHEMA_VERSION = 1

TRACKED = STORAGE_CATEGORIES
"""Categories a live tensor can be in, in the order of ``MeasuredPoint.bytes``."""

MeasuredPoint = TimelinePoint
"""A measured run's timeline point: the trace's type (:class:`memfit.ledger.TimelinePoint`),
positionally ``(index, op, phase, module, bytes, allocated, reserved)``."""


@dataclass(frozen=True, kw_only=True)
class TensorRecord:
    """One storage live at the peak."""

    nbytes: int
    category: MemoryCategory
    module: str
    phase: str
    op: str
    """The op that allocated it (``baseline``: alive when profiling began)."""
    shape: tuple[int, ...]
    dtype: str
    stack: tuple[tuple[str, int, str], ...] = ()
    """Python frames (file, line, function), innermost first; empty unless ``stacks=True``."""


ModuleUsage = ModuleMemory
"""Bytes live at the peak attributed to one module: the trace's type
(:class:`memfit.ledger.ModuleMemory`; ``activation_bytes`` is 0, not measured)."""


@dataclass(frozen=True, kw_only=True)
class ProfileResult:
    """The measurement of one profiled run.

    ``peak_bytes`` is what the allocator held at its peak. On CPU (with allocator events, the
    default) it is the bytes alive at entry plus the peak of the running sum of the PyTorch
    profiler's allocator events; ``breakdown`` is the tensor storages the ledger saw alive at
    that moment, and ``inside_kernels_bytes`` the rest (scratch inside kernels, e.g. oneDNN's),
    so the two add up to ``peak_bytes``. ``peak_reserved_bytes`` is None (the CPU allocator keeps
    no cache). On CUDA, ``peak_bytes`` and ``peak_reserved_bytes`` are
    ``torch.cuda.max_memory_allocated/reserved`` over the run; ``breakdown`` is at the tracked
    peak (512-byte rounded storages) and ``inside_kernels_bytes`` what no tensor owned
    (library workspaces). ``tracked_peak_bytes`` is the ledger's own peak, which can come at
    another moment than the allocator's.
    """

    device: str
    peak_bytes: int
    peak_reserved_bytes: int | None
    breakdown: dict[MemoryCategory, int]
    """Live bytes per category at the peak (every category present)."""
    tracked_peak_bytes: int
    """The peak of the ledger's live tensor storages (kernel scratch not included)."""
    baseline_bytes: int
    """Bytes of the storages alive when profiling began."""
    peak_index: int
    """Index of the timeline point at the peak (-1: the peak is the baseline)."""
    peak_op: str
    peak_phase: str
    peak_module: str
    num_ops: int
    timeline: list[TimelinePoint] = field(repr=False)
    modules: list[ModuleMemory] = field(repr=False)
    top_tensors: list[TensorRecord] = field(repr=False)
    marks: list[tuple[int, str]] = field(default_factory=list)
    """``(timeline index, label)`` of each :meth:`Profiler.mark`."""
    cuda: dict[str, Any] | None = None
    """CUDA allocator facts: end-of-run stats and fragmentation (None on CPU)."""
    allocator_peak_bytes: int | None = None
    """CPU with allocator events: the peak they give (equal to ``peak_bytes``); else None."""
    inside_kernels_bytes: int | None = None
    """``peak_bytes`` minus ``breakdown``'s sum: memory the allocator held at the peak that no
    live tensor storage owned. None on CPU without allocator events (not measured)."""
    stacks: bool = False
    seconds: float = 0.0
    torch_version: str = ""

    def to_dict(self, *, estimate: Estimate | None = None,
                max_points: int = 1000) -> dict[str, Any]:
        """The ``--json`` document; ``estimate`` adds ``predicted`` next to the measurement."""
        from memfit._version import __version__

        points = downsample(self.timeline, max_points, keep=self.peak_index)
        doc: dict[str, Any] = {
            "schema": SCHEMA_VERSION,
            "memfit_version": __version__,
            "torch_version": self.torch_version,
            "device": self.device,
            "peak_bytes": self.peak_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "breakdown": {cat.value: self.breakdown.get(cat, 0) for cat in MemoryCategory},
            "tracked_peak_bytes": self.tracked_peak_bytes,
            "baseline_bytes": self.baseline_bytes,
            "allocator_peak_bytes": self.allocator_peak_bytes,
            "inside_kernels_bytes": self.inside_kernels_bytes,
            "peak": {"index": self.peak_index, "op": self.peak_op, "phase": self.peak_phase,
                     "module": self.peak_module},
            "num_ops": self.num_ops,
            "seconds": round(self.seconds, 6),
            "modules": [{"name": m.name, "total": m.total,
                         "at_peak": {c.value: v for c, v in m.at_peak.items()}}
                        for m in self.modules],
            "top_tensors": [{"nbytes": t.nbytes, "category": t.category.value,
                             "module": t.module, "phase": t.phase, "op": t.op,
                             "shape": list(t.shape), "dtype": t.dtype,
                             "stack": [list(f) for f in t.stack]} for t in self.top_tensors],
            "marks": [{"index": i, "label": label} for i, label in self.marks],
            "timeline": {"categories": [c.value for c in TRACKED],
                         "points": [point_dict(p) for p in points]},
            "cuda": self.cuda,
        }
        if estimate is not None:
            doc["predicted"] = {
                "device": estimate.device,
                "peak_bytes": estimate.peak_bytes,
                "peak_reserved_bytes": estimate.peak_reserved_bytes,
                "breakdown": {cat.value: estimate.breakdown.get(cat, 0)
                              for cat in MemoryCategory},
            }
        return doc


def point_dict(p: TimelinePoint) -> dict[str, Any]:
    d: dict[str, Any] = {"i": p.index, "op": p.op, "phase": p.phase, "module": p.module,
                         "bytes": list(p.bytes)}
    if p.allocated is not None:
        d["allocated"] = p.allocated
        d["reserved"] = p.reserved
    return d


def downsample(points: list[TimelinePoint], n: int, *, keep: int = -1) -> list[TimelinePoint]:
    """At most about ``n`` points: in each bucket the one with the most live bytes (so no peak is
    lost), always keeping the point at index ``keep``."""
    if len(points) <= n:
        return list(points)
    size = -(-len(points) // n)
    out: list[TimelinePoint] = []
    for start in range(0, len(points), size):
        bucket = points[start:start + size]
        best = max(bucket, key=lambda p: p.total)
        if 0 <= keep - start < len(bucket):
            best = bucket[keep - start]
        out.append(best)
    return out
