"""What the simulated caching allocator holds and reports: its pools, live blocks and
segments, the counters of ``torch.cuda.memory_stats()``, the peaks, ``memory_snapshot()``, and the
reserve accounting every allocation path shares (``_grow_reserved``, ``_fits``, ``_insert_free``).

:class:`memfit.trace.allocator.CachingAllocatorSim` builds on :class:`_AllocatorState` (through
:class:`memfit.trace.allocator_expandable._ExpandableSegments`) and sets every attribute
declared here in its ``__init__``.
"""

from __future__ import annotations

from bisect import insort
from typing import Any

from memfit.trace.allocator_model import _Block, _Pool, _Segment


class _AllocatorState:
    """The state of the simulator and its statistics (see the module docstring)."""

    capacity: int | None
    allowed_memory_maximum: int | None
    large_segment_size: int
    _free_calls: dict[bool, int]
    _pending: list[_Block]
    _pools: dict[tuple[int, bool], _Pool]
    _live: dict[int, _Block]
    _next_addr: int
    _allocated: int
    _requested: int
    _reserved: int
    _peak_allocated: int
    _peak_reserved: int
    _segments: int
    _expandable: set[_Segment]
    num_alloc_retries: int
    num_ooms: int
    num_device_alloc: int
    num_device_free: int

    # ----------------------------------------------------------------- public counters
    @property
    def allocated_bytes(self) -> int:
        """``torch.cuda.memory_allocated()``: sizes of live blocks (rounded, unsplit excess)."""
        return self._allocated

    @property
    def reserved_bytes(self) -> int:
        """``torch.cuda.memory_reserved()``: segments (or mapped pages) held."""
        return self._reserved

    @property
    def requested_bytes(self) -> int:
        """Bytes the live allocations asked for, before rounding (``requested_bytes``)."""
        return self._requested

    @property
    def peak_allocated_bytes(self) -> int:
        """``torch.cuda.max_memory_allocated()`` since construction or :meth:`reset_peak`."""
        return self._peak_allocated

    @property
    def peak_reserved_bytes(self) -> int:
        """``torch.cuda.max_memory_reserved()`` since construction or :meth:`reset_peak`."""
        return self._peak_reserved

    @property
    def num_segments(self) -> int:
        """Segments held: ``cudaMalloc`` segments, plus one per live expandable segment."""
        return self._segments + len(self._expandable)

    def reset_peak(self) -> None:
        """``torch.cuda.reset_peak_memory_stats()``: peaks restart from the current values."""
        self._peak_allocated = self._allocated
        self._peak_reserved = self._reserved

    def memory_stats(self) -> dict[str, int]:
        """A subset of ``torch.cuda.memory_stats()`` under the same keys."""
        return {
            "allocated_bytes.all.current": self._allocated,
            "allocated_bytes.all.peak": self._peak_allocated,
            "reserved_bytes.all.current": self._reserved,
            "reserved_bytes.all.peak": self._peak_reserved,
            "requested_bytes.all.current": self._requested,
            "segment.all.current": self._segments,
            "num_alloc_retries": self.num_alloc_retries,
            "num_ooms": self.num_ooms,
            "num_device_alloc": self.num_device_alloc,
            "num_device_free": self.num_device_free,
            "pending_free_bytes": self.pending_free_bytes,
        }

    @property
    def pending_free_bytes(self) -> int:
        """Bytes of freed blocks still waiting on another stream's event (not reusable)."""
        pending = self._pending
        return sum(b.size for b in pending) if pending else 0  # asked before every op

    def _insert_free(self, pool: _Pool, block: _Block) -> None:
        """``BlockPool::insert_into_blocks``: cache a free block, noting its gc age base."""
        block.gc_base = self._free_calls[pool.is_small]
        insort(pool.free, (block.size, block.addr, block))

    def _fits(self, nbytes: int) -> bool:
        """``alloc_block``: the device has room (``capacity``) and, after
        ``set_per_process_memory_fraction``, ``total_allocated_memory + size`` stays within
        ``allowed_memory_maximum``."""
        after = self._reserved + nbytes
        if self.capacity is not None and after > self.capacity:
            return False
        return self.allowed_memory_maximum is None or after <= self.allowed_memory_maximum

    def _grow_reserved(self, nbytes: int) -> None:
        self._reserved += nbytes
        if self._reserved > self._peak_reserved:
            self._peak_reserved = self._reserved

    # ----------------------------------------------------------------- reports
    def snapshot(self) -> list[dict[str, Any]]:
        """Segments and their blocks, like ``torch.cuda.memory_snapshot()`` (sorted by address).

        Each segment: ``address``, ``total_size``, ``allocated_size``, ``requested_size``,
        ``stream``, ``segment_type`` ("small"/"large"), ``is_expandable`` and ``blocks``
        (``address``, ``size``, ``requested_size``, ``state``: "active_allocated",
        "active_pending_free" (freed, waiting on another stream) or "inactive").
        An expandable segment is reported once per contiguous mapped range, as PyTorch does.
        """
        by_segment: dict[int, list[_Block]] = {}
        segments: dict[int, _Segment] = {}
        blocks = [b for pool in self._pools.values() for _, _, b in pool.free]
        blocks += [*self._live.values(), *self._pending]
        for block in blocks:
            key = id(block.segment)
            segments[key] = block.segment
            by_segment.setdefault(key, []).append(block)
        result: list[dict[str, Any]] = []
        for key, members in by_segment.items():
            members.sort(key=lambda b: b.addr)
            runs: list[list[_Block]] = [[members[0]]]
            for block in members[1:]:
                last = runs[-1][-1]
                if last.addr + last.size == block.addr:
                    runs[-1].append(block)
                else:
                    runs.append([block])
            for run in runs:
                result.append(_segment_info(run, segments[key]))
        result.sort(key=lambda s: s["address"])
        return result


def _segment_info(run: list[_Block], segment: _Segment) -> dict[str, Any]:
    pool = run[0].pool
    return {
        "address": run[0].addr,
        "total_size": sum(b.size for b in run),
        "allocated_size": sum(b.size for b in run if b.allocated and not b.pending),
        "requested_size": sum(b.requested for b in run if b.allocated),
        "stream": pool.stream,
        "segment_type": "small" if pool.is_small else "large",
        "is_expandable": segment.expandable,
        "blocks": [{"address": b.addr, "size": b.size, "requested_size": b.requested,
                    "state": ("active_pending_free" if b.pending else
                              "active_allocated" if b.allocated else "inactive")} for b in run],
    }
