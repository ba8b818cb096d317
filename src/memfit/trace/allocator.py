"""A simulator of PyTorch's CUDA caching allocator, to predict ``max_memory_reserved``.

The tracer replays a step's allocations and frees (storage sizes, in order) through
:class:`CachingAllocatorSim`; its ``peak_reserved_bytes`` is the prediction of
``torch.cuda.max_memory_reserved()`` and ``peak_allocated_bytes`` of
``torch.cuda.max_memory_allocated()``.

Every rule below is taken from ``c10/cuda/CUDACachingAllocator.cpp`` (class
``DeviceCachingAllocator``; since 2.9 partly in ``c10/core/CachingDeviceAllocator.h``) and the
config parser ``c10/core/AllocatorConfig.cpp``. The function named in each comment is the
PyTorch function the rule comes from; the code here is written from those rules, not copied.

Rules modelled
--------------
- ``round_size``: requests round up to a multiple of ``kMinBlockSize`` = 512 bytes (at least
  512); with ``roundup_power2_divisions`` a request above ``512 * divisions`` instead rounds up
  to the next of ``divisions`` equal steps between two powers of two
  (``roundup_power2_next_division``).
- ``get_pool``: a rounded size <= ``kSmallSize`` (1 MiB) uses the small pool, else the large
  pool; pools are per stream (``BlockComparatorSize`` orders by stream first, so a search never
  crosses streams).
- ``get_allocation_size``: a new segment (one ``cudaMalloc``) is ``kSmallBuffer`` (2 MiB) for
  the small pool, ``kLargeBuffer`` (20 MiB; ``large_segment_size_mb`` in the newest PyTorch) for
  sizes below ``kMinLargeAlloc`` (10 MiB), else the size rounded up to ``kRoundLarge`` (2 MiB).
- ``get_free_block``: best fit: the smallest cached free block with size >= request, ties by
  lowest address (``std::set::lower_bound`` on (size, ptr)). With ``max_split_size`` set, a
  request below it never takes a block >= it, and a request >= it only takes a block smaller than
  ``request + max_non_split_rounding_size`` (default ``kLargeBuffer``).
- ``should_split`` / ``alloc_found_block``: the found block is split, the front part handed out
  and the rest cached, when the rest is >= 512 bytes (small pool, or expandable segments) or,
  in the large pool, when the rest is > ``kSmallSize`` (1 MiB) and the request is below
  ``max_split_size``. An unsplit block is handed out whole and counts whole in
  ``allocated_bytes`` (an 11 MiB request gets a 12 MiB segment and 12 MiB allocated).
- ``free`` / ``free_block`` / ``try_merge_blocks``: a freed block merges with a free neighbour
  (previous and next block of the same segment) and goes back to its pool; nothing is returned
  to the device.
- ``malloc`` then ``alloc_block``: when no cached block fits, first
  ``garbage_collect_cached_blocks`` (only after ``set_per_process_memory_fraction``, here
  ``allowed_memory_maximum``, with ``garbage_collection_threshold`` set: above threshold x
  allowed bytes reserved, free whole cached large segments at least as old as the average,
  age = large-pool searches since cached), then a new segment is allocated. If the device is
  full (``reserved + segment > capacity``, or ``> allowed_memory_maximum``):
  ``release_available_cached_blocks`` (only with ``max_split_size``: free the oversize cached
  segment at the search point, else oversize segments from the largest down) and retry, then
  ``release_cached_blocks`` (complete deferred frees, free every wholly free segment, all
  streams) and retry, then raise (:class:`SimulatedOOM`, the simulated
  ``torch.OutOfMemoryError``). :meth:`CachingAllocatorSim.for_gpu` gives the capacity of a GPU.
- ``recordStream`` / ``free`` -> ``insert_events`` / ``process_events``: a block used on other
  streams leaves ``allocated_bytes`` when freed but is cached again only when those streams'
  events complete: here at :meth:`CachingAllocatorSim.process_events` (the trace calls it as
  each op starts) or at ``release_cached_blocks``.
- ``emptyCache`` -> ``release_cached_blocks``: frees only segments that are entirely free; a
  segment with any live block stays reserved.
- Expandable segments (``expandable_segments:True``; ``find_expandable_block``,
  ``try_allocate_expandable_block``, ``map_block``, ``unmap_block``): one virtual segment per
  stream and pool (reserving 1.125x device memory of address space), backed by physical pages
  of 2 MiB (small pool) or 20 MiB (large pool) mapped on demand at the lowest address where the
  request fits; reserved = pages mapped. Free pages stay mapped until ``empty_cache`` (or the
  out-of-memory retry) unmaps the whole pages inside free blocks. Best fit prefers a block that
  cannot grow over the growable block at the end of the mapped range (``get_free_block``'s
  ``expandable_size``).
- Zero-byte requests: ``NativeCachingAllocator::allocate`` skips ``malloc`` for size 0, so they
  allocate nothing; :meth:`CachingAllocatorSim.malloc` returns the null handle 0.

Known limitations
-----------------
- Addresses are simulated: new segments get increasing addresses. Real ``cudaMalloc`` may
  reuse a freed range at a lower address, which can change which of two equal-size free blocks
  best fit picks; sizes and counts are unaffected.
- Not modelled: CUDA graph private pools and ``MemPool``, the ``cudaMallocAsync`` backend, the
  device's own granularity beyond whole segments, when exactly a side stream's event
  completes (the caller decides, with :meth:`~CachingAllocatorSim.process_events`).
  ``capacity`` is the bytes the allocator may hold (device memory minus CUDA context and other
  processes); ``allowed_memory_maximum`` is a memory fraction's limit.
- ``release_available_cached_blocks`` frees only unsplit segments (PyTorch's also assumes
  oversize cached blocks are whole segments, which its split rule guarantees).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Sequence
from typing import Any

from memfit.errors import MemfitError

__all__ = [
    "LARGE_BUFFER",
    "MIN_BLOCK_SIZE",
    "MIN_LARGE_ALLOC",
    "ROUND_LARGE",
    "SMALL_BUFFER",
    "SMALL_SIZE",
    "CachingAllocatorSim",
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


class CachingAllocatorSim:
    """Replays allocations and frees through a model of PyTorch's CUDA caching allocator.

    >>> sim = CachingAllocatorSim()
    >>> h = sim.malloc(3 * 2**20)          # 3 MiB: a 20 MiB segment, split
    >>> sim.allocated_bytes >> 20, sim.reserved_bytes >> 20
    (3, 20)
    >>> sim.free(h); sim.allocated_bytes, sim.reserved_bytes >> 20
    (0, 20)

    Options mirror ``PYTORCH_CUDA_ALLOC_CONF`` (see ``memfit.runtime.allocator_options_from_env``):
    ``expandable_segments``, ``max_split_size`` (bytes; PyTorch's ``max_split_size_mb``, at
    least 20 MiB), ``max_non_split_rounding_size`` (bytes, at least 20 MiB),
    ``roundup_power2_divisions`` (one int for all sizes, or the 16-entry table) and
    ``large_segment_size`` (bytes; the newest PyTorch's ``large_segment_size_mb``, default 20 MiB:
    the segment for 1-10 MiB requests, and assumed here to be the large expandable page too).
    ``capacity`` is the bytes the allocator may reserve before ``cudaMalloc`` fails (None:
    unlimited).

    ``garbage_collection_threshold`` (0-1) acts only with ``allowed_memory_maximum`` (the bytes
    ``torch.cuda.set_per_process_memory_fraction`` allows), as in PyTorch.

    Known limitations: see the module docstring (simulated addresses, no CUDA graph pools,
    side-stream events complete at :meth:`process_events`).
    """

    def __init__(self, *, expandable_segments: bool = False, capacity: int | None = None,
                 max_split_size: int | None = None,
                 max_non_split_rounding_size: int | None = None,
                 roundup_power2_divisions: int | Sequence[int] | None = None,
                 large_segment_size: int | None = None,
                 garbage_collection_threshold: float | None = None,
                 allowed_memory_maximum: int | None = None) -> None:
        for name, value in (("capacity", capacity),
                            ("allowed_memory_maximum", allowed_memory_maximum)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value <= 0):
                raise MemfitError(f"{name} must be a positive number of bytes or None, got "
                                  f"{value!r}")
        if garbage_collection_threshold is not None and not (
                isinstance(garbage_collection_threshold, int | float)
                and 0.0 < garbage_collection_threshold < 1.0):
            # parseGarbageCollectionThreshold: "must be in (0.0, 1.0)"
            raise MemfitError(f"garbage_collection_threshold must be in (0.0, 1.0) or None, got "
                              f"{garbage_collection_threshold!r}; e.g. 0.8")
        for name, value in (("max_split_size", max_split_size),
                            ("max_non_split_rounding_size", max_non_split_rounding_size)):
            # parseMaxSplitSize / parseMaxNonSplitRoundingSize: "too small, must be >= 20"
            if value is not None and value < LARGE_BUFFER:
                raise MemfitError(
                    f"{name} must be at least {LARGE_BUFFER} bytes (20 MiB, as PyTorch requires "
                    f"of {name.removesuffix('_size')}_mb), got {value}; raise it or pass None")
        if large_segment_size is not None and (
                large_segment_size <= 0 or large_segment_size % ROUND_LARGE):
            raise MemfitError(f"large_segment_size must be a positive multiple of 2 MiB "
                              f"({ROUND_LARGE} bytes) or None for 20 MiB, got {large_segment_size}")
        self.expandable_segments = expandable_segments
        self.large_segment_size = large_segment_size or LARGE_BUFFER
        self.capacity = capacity
        self.max_split_size = _UNLIMITED if max_split_size is None else max_split_size
        self.max_non_split_rounding_size = (
            LARGE_BUFFER if max_non_split_rounding_size is None else max_non_split_rounding_size)
        self.roundup_power2_divisions = _divisions_table(roundup_power2_divisions)
        self.garbage_collection_threshold = garbage_collection_threshold or 0.0
        # setMemoryFraction: allowed_memory_maximum = fraction x total memory, set_fraction = true
        self.allowed_memory_maximum = allowed_memory_maximum
        self._gc_active = bool(allowed_memory_maximum and self.garbage_collection_threshold)
        self._free_calls = {True: 0, False: 0}  # BlockPool::get_free_blocks_call_count
        self._pending: list[_Block] = []  # freed, waiting on record_stream events
        self._pools: dict[tuple[int, bool], _Pool] = {}
        self._live: dict[int, _Block] = {}
        self._next_handle = 1
        self._next_addr = 1 << 32  # simulated device addresses, 2 MiB aligned
        self._allocated = 0
        self._requested = 0
        self._reserved = 0
        self._peak_allocated = 0
        self._peak_reserved = 0
        self._segments = 0  # cudaMalloc segments (stats "segment.all.current")
        self._expandable: set[_Segment] = set()
        self.num_alloc_retries = 0
        self.num_ooms = 0
        self.num_device_alloc = 0
        self.num_device_free = 0

    @classmethod
    def for_gpu(cls, gpu: Any = None, *, num_gpus: int = 1, conf: str | None = None,
                expandable_segments: bool = False) -> CachingAllocatorSim:
        """The simulator for a CUDA target: ``capacity`` from the GPU (``GpuSpec``; its
        ``usable_bytes`` minus the runtime outside the allocator,
        :func:`memfit.runtime.allocator_capacity`; None: unlimited) and the options of ``conf``,
        a ``PYTORCH_CUDA_ALLOC_CONF`` string (None: read from the environment, as torch does).
        ``expandable_segments=True`` turns expandable segments on whatever ``conf`` says.
        """
        from memfit.runtime import allocator_capacity, allocator_options

        options = allocator_options(conf)
        if expandable_segments:
            options["expandable_segments"] = True
        capacity = None
        if gpu is not None:
            capacity = allocator_capacity(gpu.usable_bytes, gpu.name, num_gpus=num_gpus)
        return cls(capacity=capacity, **options)

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

    # ----------------------------------------------------------------- malloc / free
    def malloc(self, nbytes: int, stream: int = 0) -> int:
        """Allocate ``nbytes`` on ``stream``; returns a handle for :meth:`free` (0 for 0 bytes).

        Raises :class:`SimulatedOOM` when ``capacity`` is exceeded even after freeing the cache.
        """
        if nbytes <= 0:
            if nbytes == 0:
                return 0  # NativeCachingAllocator::allocate: size 0 -> nullptr, no malloc
            raise MemfitError(f"allocation size must be >= 0 bytes, got {nbytes}")
        if nbytes < MIN_BLOCK_SIZE:
            size = MIN_BLOCK_SIZE
        elif self.roundup_power2_divisions is None:
            size = (nbytes + MIN_BLOCK_SIZE - 1) & ~(MIN_BLOCK_SIZE - 1)
        else:
            size = round_size(nbytes, self.roundup_power2_divisions)
        is_small = size <= SMALL_SIZE
        pool = self._pools.get((stream, is_small))
        if pool is None:
            pool = self._pools[(stream, is_small)] = _Pool(stream, is_small)
        block = self._get_free_block(pool, size)
        if block is None:
            block = self._alloc_after_miss(pool, size, nbytes)
        # should_split + alloc_found_block
        remaining = block.size - size
        if is_small or self.expandable_segments:
            split = remaining >= MIN_BLOCK_SIZE
        else:
            split = size < self.max_split_size and remaining > SMALL_SIZE
        if split:
            front = _Block(block.addr, size, pool, block.segment)
            prev = block.prev
            front.prev = prev
            if prev is not None:
                prev.next = front
            front.next = block
            block.prev = front
            block.addr += size
            block.size = remaining
            self._insert_free(pool, block)
            block = front
        block.allocated = True
        block.requested = nbytes
        self._allocated += block.size
        self._requested += nbytes
        if self._allocated > self._peak_allocated:
            self._peak_allocated = self._allocated
        handle = self._next_handle
        self._next_handle = handle + 1
        self._live[handle] = block
        return handle

    def record_stream(self, handle: int, stream: int) -> None:
        """``Tensor.record_stream``: the block is also used on ``stream`` (``recordStream``).

        Its free is then deferred (see :meth:`free`). The allocation's own stream is ignored.
        """
        block = self._live.get(handle)
        if block is None:
            raise MemfitError(f"record_stream of unknown or freed allocation handle {handle}; "
                              "pass a live handle returned by malloc")
        if stream != block.pool.stream:
            block.stream_uses.add(stream)

    def free(self, handle: int) -> None:
        """Free an allocation made by :meth:`malloc` (``free`` -> ``free_block``).

        ``allocated_bytes`` drops at once. A block used on other streams
        (:meth:`record_stream`) is not reusable until those streams' events complete
        (``free`` -> ``insert_events``); here that is the next :meth:`process_events`, or the
        ``synchronize_and_free_events`` that ``release_cached_blocks`` (empty_cache, the
        out-of-memory retry) starts with. Until then it stays reserved and cannot be reused.
        """
        if handle == 0:
            return  # free(nullptr) is a no-op
        block = self._live.pop(handle, None)
        if block is None:
            raise MemfitError(f"free of unknown or already freed allocation handle {handle}; "
                              "pass a handle returned by malloc, once")
        self._allocated -= block.size
        self._requested -= block.requested
        block.requested = 0
        if block.stream_uses:
            # insert_events: try_merge_blocks and the searches skip it until the events complete
            block.stream_uses.clear()
            block.pending = True
            self._pending.append(block)
            return
        block.allocated = False
        self._free_block(block)

    def process_events(self) -> None:
        """``process_events`` / ``synchronize_and_free_events``: the events recorded for
        deferred frees have completed; their blocks go back to their pools."""
        pending, self._pending = self._pending, []
        for block in pending:
            block.pending = block.allocated = False
            self._free_block(block)

    @property
    def pending_free_bytes(self) -> int:
        """Bytes of freed blocks still waiting on another stream's event (not reusable)."""
        pending = self._pending
        return sum(b.size for b in pending) if pending else 0  # asked before every op

    def _free_block(self, block: _Block) -> None:
        """``free_block``: merge with free neighbours and return the block to its pool."""
        pool = block.pool
        prev = block.prev
        if prev is not None and not prev.allocated and prev.mapped:
            _remove(pool.free, prev)
            block.addr = prev.addr
            block.size += prev.size
            block.prev = prev.prev
            if block.prev is not None:
                block.prev.next = block
        nxt = block.next
        if nxt is not None and not nxt.allocated and nxt.mapped:
            _remove(pool.free, nxt)
            block.size += nxt.size
            block.next = nxt.next
            if block.next is not None:
                block.next.prev = block
        self._insert_free(pool, block)

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: free every wholly free segment (unmap free pages)."""
        self._release_cached_blocks()

    def _insert_free(self, pool: _Pool, block: _Block) -> None:
        """``BlockPool::insert_into_blocks``: cache a free block, noting its gc age base."""
        block.gc_base = self._free_calls[pool.is_small]
        insort(pool.free, (block.size, block.addr, block))

    # ----------------------------------------------------------------- internals
    def _get_free_block(self, pool: _Pool, size: int) -> _Block | None:
        """``get_free_block``: best fit by (size, address), with the oversize rules."""
        if self._gc_active:
            self._free_calls[pool.is_small] += 1  # ++pool.get_free_blocks_call_count
        free = pool.free
        i = bisect_left(free, (size,))
        if i == len(free):
            return None
        block = free[i][2]
        if self.expandable_segments:
            # Prefer a block that cannot grow over the one in front of unmapped pages.
            best = _expandable_size(block)
            j = i + 1
            while j < len(free):
                candidate = _expandable_size(free[j][2])
                if candidate >= best:
                    break
                i, best = j, candidate
                j += 1
            block = free[i][2]
        max_split = self.max_split_size
        if size < max_split and block.size >= max_split:
            return None
        if size >= max_split and block.size >= size + self.max_non_split_rounding_size:
            return None
        del free[i]
        return block

    def _alloc_after_miss(self, pool: _Pool, size: int, nbytes: int) -> _Block:
        """``malloc``'s path when no cached block fits: allocate, release and retry, or OOM."""
        if self._gc_active:
            self._garbage_collect_cached_blocks()
        block = self._alloc_block(pool, size)
        if block is None and self._release_available_cached_blocks(pool, size):
            block = self._alloc_block(pool, size)
        if block is None:
            self._release_cached_blocks()
            self.num_alloc_retries += 1
            block = self._alloc_block(pool, size)
        if block is None:
            self.num_ooms += 1
            raise SimulatedOOM(requested=nbytes,
                               alloc_size=allocation_size(size, self.large_segment_size),
                               allocated=self._allocated, reserved=self._reserved,
                               capacity=self.capacity or 0, stream=pool.stream)
        return block

    def _alloc_block(self, pool: _Pool, size: int) -> _Block | None:
        """``alloc_block``: a new segment (or newly mapped pages); None when it does not fit."""
        if self.expandable_segments:
            return self._try_allocate_expandable_block(pool, size)
        alloc_size = allocation_size(size, self.large_segment_size)
        if not self._fits(alloc_size):
            return None
        addr = self._next_addr
        self._next_addr += alloc_size
        block = _Block(addr, alloc_size, pool, _Segment(addr, alloc_size, False, alloc_size))
        self._segments += 1
        self.num_device_alloc += 1
        self._grow_reserved(alloc_size)
        return block

    def _fits(self, nbytes: int) -> bool:
        """``alloc_block``: the device has room (``capacity``) and, after
        ``set_per_process_memory_fraction``, ``total_allocated_memory + size`` stays within
        ``allowed_memory_maximum``."""
        after = self._reserved + nbytes
        if self.capacity is not None and after > self.capacity:
            return False
        return self.allowed_memory_maximum is None or after <= self.allowed_memory_maximum

    def _garbage_collect_cached_blocks(self) -> None:
        """``garbage_collect_cached_blocks``: above ``threshold x allowed_memory_maximum``
        reserved, free whole cached large-pool segments whose age (``get_free_block`` calls on
        the large pool since they were cached) is at least the average, in passes, until the
        excess is reclaimed or a pass frees nothing."""
        assert self.allowed_memory_maximum is not None
        gc_threshold = int(self.garbage_collection_threshold * self.allowed_memory_maximum)
        if self._reserved <= gc_threshold:
            return
        target = self._reserved - gc_threshold
        now = self._free_calls[False]

        def freeable() -> list[_Block]:
            # large_blocks.blocks: every stream's large pool, in (stream, size, address) order
            return [b for key in sorted(k for k in self._pools if not k[1])
                    for _, _, b in self._pools[key].free
                    if b.prev is None and b.next is None and not b.segment.expandable]

        blocks = freeable()
        total_age = sum(now - b.gc_base for b in blocks)
        count = len(blocks)
        reclaimed = 0
        freed = True
        while reclaimed < target and freed and count > 0:
            age_threshold = total_age / count
            freed = False
            for block in freeable():
                age = now - block.gc_base
                if age >= age_threshold:
                    freed = True
                    reclaimed += block.size
                    total_age -= age
                    count -= 1
                    self._release_block(block)

    def _grow_reserved(self, nbytes: int) -> None:
        self._reserved += nbytes
        if self._reserved > self._peak_reserved:
            self._peak_reserved = self._reserved

    def _release_block(self, block: _Block) -> None:
        """``release_block``: ``cudaFree`` a wholly free segment."""
        _remove(block.pool.free, block)
        self._reserved -= block.size
        self._segments -= 1
        self.num_device_free += 1

    def _release_available_cached_blocks(self, pool: _Pool, size: int) -> bool:
        """``release_available_cached_blocks``: free oversize cached segments (max_split only)."""
        max_split = self.max_split_size
        if max_split == _UNLIMITED:
            return False
        key = max(size, max_split)
        free = pool.free
        i = bisect_left(free, (key,))
        if i < len(free) and not free[i][2].segment.expandable:
            # The block at the search point (lower_bound of max(size, max_split_size)) is
            # released as torch does, without a split check: a cached block >= max_split_size
            # is always a whole segment (should_split never splits one off).
            self._release_block(free[i][2])
            return True
        released = 0
        j = i - 1  # from the largest block downwards
        while released < key and j >= 0 and free[j][0] >= max_split:
            block = free[j][2]
            if not block.segment.expandable and block.prev is None and block.next is None:
                released += block.size
                self._release_block(block)
            j -= 1
        return released >= key

    def _release_cached_blocks(self) -> None:
        """``release_cached_blocks`` -> ``release_blocks``: all pools, all streams.

        Starts with ``synchronize_and_free_events``: deferred frees complete first."""
        self.process_events()
        for pool in self._pools.values():
            to_unmap = []
            for _, _, block in list(pool.free):
                if block.segment.expandable:
                    to_unmap.append(block)
                elif block.prev is None and block.next is None:
                    self._release_block(block)
            for block in to_unmap:
                self._unmap_block(block)
                if not block.mapped and block.prev is None and block.next is None:
                    # release_expandable_segment: the whole address range is unmapped
                    del pool.unmapped[bisect_left(pool.unmapped, (block.addr,))]
                    self._expandable.discard(block.segment)

    # ----------------------------------------------------------------- expandable segments
    def _find_expandable_block(self, pool: _Pool, size: int) -> _Block:
        """``find_expandable_block``: lowest address with ``size`` bytes of free/unmapped room."""
        for _, block in pool.unmapped:
            prev = block.prev
            if prev is not None and not prev.allocated:
                block = prev
            room = 0
            walk: _Block | None = block
            while room < size and walk is not None and not walk.allocated:
                room += walk.size
                walk = walk.next
            if room >= size:
                return block
        page = SMALL_BUFFER if pool.is_small else self.large_segment_size
        device_memory = self.capacity or _DEFAULT_DEVICE_MEMORY
        # ExpandableSegment: address space for 1 1/8 of the device memory, whole pages
        pages = -(-max(device_memory + device_memory // 8, size) // page)
        base = self._next_addr
        self._next_addr += pages * page
        segment = _Segment(base, pages * page, True, page)
        self._expandable.add(segment)
        block = _Block(base, pages * page, pool, segment, mapped=False)
        insort(pool.unmapped, (base, block))
        return block

    def _try_allocate_expandable_block(self, pool: _Pool, size: int) -> _Block | None:
        """``try_allocate_expandable_block``: map pages until a free block holds ``size``."""
        candidate = self._find_expandable_block(pool, size)
        if not candidate.mapped and not self._map_block(candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:
            nxt = candidate.next
            assert nxt is not None and not nxt.mapped
            if not self._map_block(nxt, min(size - candidate.size, nxt.size)):
                return None
            candidate = nxt  # map_block merged the old candidate into it
        _remove(pool.free, candidate)
        return candidate

    def _map_block(self, block: _Block, size: int) -> bool:
        """``map_block``: back the first ``size`` bytes (whole pages) of an unmapped block."""
        segment = block.segment
        page = segment.page
        offset = block.addr - segment.base
        mapped = -(-(offset + size) // page) * page - offset
        if not self._fits(mapped):
            return False  # cuMemCreate out of memory
        pool = block.pool
        del pool.unmapped[bisect_left(pool.unmapped, (block.addr,))]
        block.mapped = True
        if mapped < block.size:
            rest = _Block(block.addr + mapped, block.size - mapped, pool, segment, mapped=False)
            rest.prev = block
            rest.next = block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            insort(pool.unmapped, (rest.addr, rest))
            block.size = mapped
        self._try_merge(block, block.prev)
        self._try_merge(block, block.next)
        self._insert_free(pool, block)
        self.num_device_alloc += 1
        self._grow_reserved(mapped)
        return True

    def _unmap_block(self, block: _Block) -> None:
        """``unmap_block``: return the whole pages inside a free block to the device."""
        segment = block.segment
        page = segment.page
        begin = -(-(block.addr - segment.base) // page) * page + segment.base
        end = (block.addr + block.size - segment.base) // page * page + segment.base
        if begin >= end:
            return
        pool = block.pool
        _remove(pool.free, block)
        if begin > block.addr:
            before = _Block(block.addr, begin - block.addr, pool, segment)
            before.prev = block.prev
            if block.prev is not None:
                block.prev.next = before
            before.next = block
            block.prev = before
            self._insert_free(pool, before)
        block_end = block.addr + block.size
        if block_end > end:
            after = _Block(end, block_end - end, pool, segment)
            after.next = block.next
            if block.next is not None:
                block.next.prev = after
            after.prev = block
            block.next = after
            self._insert_free(pool, after)
        block.addr = begin
        block.size = end - begin
        block.mapped = False
        self._try_merge(block, block.prev)
        self._try_merge(block, block.next)
        insort(pool.unmapped, (block.addr, block))
        self._reserved -= end - begin
        self.num_device_free += 1

    @staticmethod
    def _try_merge(dst: _Block, src: _Block | None) -> None:
        """``try_merge_blocks``: absorb a free neighbour in the same mapped state."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return
        pool = src.pool
        if src.mapped:
            _remove(pool.free, src)
        else:
            del pool.unmapped[bisect_left(pool.unmapped, (src.addr,))]
        if dst.prev is src:
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size

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


def _expandable_size(block: _Block) -> int:
    """``get_free_block``'s ``expandable_size``: size plus unmapped room right after it."""
    nxt = block.next
    return block.size + (nxt.size if nxt is not None and not nxt.mapped else 0)


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
