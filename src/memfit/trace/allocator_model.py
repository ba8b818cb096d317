"""The caching allocator's records and size rules: the sizes PyTorch's
``CUDACachingAllocator.cpp`` rounds to (:func:`round_size`, :func:`allocation_size`), the
``roundup_power2_divisions`` table, the segment, pool and block records the simulator
(:class:`memfit.trace.allocator.CachingAllocatorSim`) keeps, and :class:`SimulatedOOM`.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

from memfit.errors import MemfitError

__all__ = [
    "LARGE_BUFFER",
    "MIN_BLOCK_SIZE",
    "MIN_LARGE_ALLOC",
    "ROUND_LARGE",
    "SMALL_BUFFER",
    "SMALL_SIZE",
    "SimulatedOOM",
    "allocation_size",
    "round_size",
]

MIN_BLOCK_SIZE = 512
"""``kMinBlockSize``: every request rounds up to a multiple of 512 bytes."""
SMALL_SIZE = 1 << 20
"""``kSmallSize``: the largest small-pool request (1 MiB)."""
SMALL_BUFFER = 2 << 20
"""``kSmallBuffer``: small-pool segment size (2 MiB); also the small expandable page size."""
LARGE_BUFFER = 20 << 20
"""``kLargeBuffer``: segment for 1-10 MiB requests (20 MiB); large expandable page size."""
MIN_LARGE_ALLOC = 10 << 20
"""``kMinLargeAlloc``: requests from here on get a segment of their own size."""
ROUND_LARGE = 2 << 20
"""``kRoundLarge``: large segments round up to 2 MiB."""

_UNLIMITED = 2**64 - 1  # SIZE_MAX: the default max_split_size ("unlimited")
_ROUNDUP_INTERVALS = 16  # kRoundUpPowerOfTwoIntervals: 1 MiB .. 64 GiB, one per power of two
_ROUNDUP_START_LOG2 = 20  # kRoundUpPowerOfTwoStart = 1 MiB
_DEFAULT_DEVICE_MEMORY = 1 << 40  # address space of an expandable segment when capacity unknown


def _roundup_power2_next_division(size: int, divisions: int) -> int:
    """``roundup_power2_next_division``: next of ``divisions`` steps between powers of two."""
    if size & (size - 1) == 0:
        return size
    power2_floor = 1 << (size.bit_length() - 1)
    step = power2_floor >> (divisions.bit_length() - 1)
    if step == 0:
        return power2_floor << 1
    floor = size & ~(step - 1)
    return size if floor == size else floor + step


def round_size(nbytes: int, divisions: Sequence[int] | None = None) -> int:
    """Bytes the allocator hands out for a request of ``nbytes`` (``round_size``).

    ``divisions`` is the ``roundup_power2_divisions`` table: 16 entries, one per power-of-two
    interval from 1 MiB (sizes below 2 MiB use entry 0, >= 32 GiB entry 15); 0 or 1 = off.

    >>> round_size(1), round_size(513), round_size(1200, [4] * 16)
    (512, 1024, 1536)
    """
    if nbytes < MIN_BLOCK_SIZE:
        return MIN_BLOCK_SIZE
    if divisions:
        index = min(max(nbytes.bit_length() - 1 - _ROUNDUP_START_LOG2, 0), _ROUNDUP_INTERVALS - 1)
        div = divisions[index]
        if div > 1 and nbytes > MIN_BLOCK_SIZE * div:
            return _roundup_power2_next_division(nbytes, div)
    return (nbytes + MIN_BLOCK_SIZE - 1) & ~(MIN_BLOCK_SIZE - 1)


def allocation_size(size: int, large_segment_size: int = LARGE_BUFFER) -> int:
    """Segment size ``cudaMalloc``-ed for a rounded request (``get_allocation_size``).

    ``large_segment_size`` is ``kLargeBuffer`` (20 MiB); the newest PyTorch makes it
    configurable (``large_segment_size_mb``).

    >>> [allocation_size(s) >> 20 for s in (512, 3 << 20, 11 << 20)]
    [2, 20, 12]
    """
    rounded = (size + ROUND_LARGE - 1) // ROUND_LARGE * ROUND_LARGE
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        # max(): a large_segment_size below the request would not hold it (memfit's guard)
        return max(large_segment_size, rounded)
    return rounded


class SimulatedOOM(Exception):
    """The simulated device ran out of memory (PyTorch would raise ``torch.OutOfMemoryError``).

    Raised after the allocator freed its cached segments and retried, as ``malloc`` does.
    """

    def __init__(self, *, requested: int, alloc_size: int, allocated: int, reserved: int,
                 capacity: int, stream: int) -> None:
        self.requested = requested
        self.alloc_size = alloc_size
        self.allocated = allocated
        self.reserved = reserved
        self.capacity = capacity
        self.stream = stream
        super().__init__(
            f"simulated CUDA out of memory: tried to allocate {alloc_size} bytes (request "
            f"{requested} bytes, stream {stream}) with capacity {capacity} bytes; {allocated} "
            f"bytes allocated, {reserved - allocated} reserved but unallocated")


def _divisions_table(value: int | Sequence[int] | None) -> list[int] | None:
    """The 16-entry ``roundup_power2_divisions`` table, or None when rounding is off."""
    if value is None:
        return None
    table = [value] * _ROUNDUP_INTERVALS if isinstance(value, int) else list(value)
    if len(table) != _ROUNDUP_INTERVALS or any(
            not isinstance(d, int) or d < 0 or (d & (d - 1)) for d in table):
        raise MemfitError(
            f"roundup_power2_divisions must be a power of two (or 0 = off), or a list of "
            f"{_ROUNDUP_INTERVALS} such values (1 MiB .. 32 GiB intervals), got {value!r}")
    return table if any(d > 1 for d in table) else None


class _Segment:
    """One ``cudaMalloc`` (``expandable`` False) or one expandable virtual segment."""

    __slots__ = ("base", "expandable", "page", "size")

    def __init__(self, base: int, size: int, expandable: bool, page: int) -> None:
        self.base = base
        self.size = size  # bytes of address space
        self.expandable = expandable
        self.page = page  # physical page size (expandable only)


class _Pool:
    """Cached free blocks of one stream and size class (``BlockPool``)."""

    __slots__ = ("free", "is_small", "stream", "unmapped")

    def __init__(self, stream: int, is_small: bool) -> None:
        self.stream = stream
        self.is_small = is_small
        # (size, addr, block) sorted: best fit is bisect_left((size,)). (size, addr) is unique.
        self.free: list[tuple[int, int, _Block]] = []
        # (addr, block) sorted, unmapped address ranges of expandable segments.
        self.unmapped: list[tuple[int, _Block]] = []


class _Block:
    __slots__ = ("addr", "allocated", "gc_base", "mapped", "next", "pending", "pool", "prev",
                 "requested", "segment", "size", "stream_uses")

    def __init__(self, addr: int, size: int, pool: _Pool, segment: _Segment,
                 mapped: bool = True) -> None:
        self.addr = addr
        self.size = size
        self.pool = pool
        self.segment = segment
        self.mapped = mapped
        self.allocated = False
        self.requested = 0
        self.gc_base = 0  # get_free_blocks_call_count when cached (Block::gc_count_base)
        self.stream_uses: set[int] = set()  # other streams recorded by record_stream
        # Freed but waiting on those streams' events (event_count > 0): still not free, so it
        # stays `allocated` for merging and searching, but no longer counts as allocated bytes.
        self.pending = False
        self.prev: _Block | None = None
        self.next: _Block | None = None


def _remove(blocks: list[tuple[int, int, _Block]], block: _Block) -> None:
    del blocks[bisect_left(blocks, (block.size, block.addr))]


def _expandable_size(block: _Block) -> int:
    """``get_free_block``'s ``expandable_size``: size plus unmapped room right after it."""
    nxt = block.next
    return block.size + (nxt.size if nxt is not None and not nxt.mapped else 0)
