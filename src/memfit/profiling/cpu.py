"""Peak CPU memory of a real run: :mod:`memfit.cpu_peak`, which lives below the trace engine
(its CPU-kernel measurements read the same allocator events) and is re-exported here."""

from memfit.cpu_peak import (
    OP_MARKER,
    CpuPeak,
    allocator_deltas,
    live_bytes,
    marked_allocator_events,
    measure_cpu_peak,
    running_peak,
    session_deltas,
    session_events,
)

__all__ = [
    "OP_MARKER",
    "CpuPeak",
    "allocator_deltas",
    "live_bytes",
    "marked_allocator_events",
    "measure_cpu_peak",
    "running_peak",
    "session_deltas",
    "session_events",
]
