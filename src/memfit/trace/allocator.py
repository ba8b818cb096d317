"""A simulator of PyTorch's CUDA caching allocator, to predict ``max_memory_reserved``.

The tracer replays a step's allocations and frees (storage sizes, in order) through
:class:`CachingAllocatorSim`; its ``peak_reserved_bytes`` is the prediction of
``torch.cuda.max_memory_reserved()`` and ``peak_allocated_bytes`` of
``torch.cuda.max_memory_allocated()``.

The simulator is built in layers, one module each: the size rules and the block, segment and
pool records (``allocator_model.py``), the state and statistics it reports
(``allocator_state.py``), expandable segments (``allocator_expandable.py``), and here the
options, ``malloc``/``free`` and the out-of-memory retries.

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

from bisect import bisect_left
from collections.abc import Sequence
from typing import Any

from memfit.errors import MemfitError
from memfit.trace.allocator_expandable import _ExpandableSegments
from memfit.trace.allocator_model import (
    _UNLIMITED,
    LARGE_BUFFER,
    MIN_BLOCK_SIZE,
    ROUND_LARGE,
    SMALL_SIZE,
    SimulatedOOM,
    _Block,
    _divisions_table,
    _expandable_size,
    _Pool,
    _remove,
    _Segment,
    allocation_size,
    round_size,
)

__all__ = ["CachingAllocatorSim"]


class CachingAllocatorSim(_ExpandableSegments):
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
        budget, :func:`memfit.budget.budget_bytes`, minus the runtime outside the allocator,
        :func:`memfit.runtime.allocator_capacity`; None: unlimited) and the options of ``conf``,
        a ``PYTORCH_CUDA_ALLOC_CONF`` string (None: read from the environment, as torch does).
        ``expandable_segments=True`` turns expandable segments on whatever ``conf`` says.
        """
        from memfit.budget import device_budget
        from memfit.runtime import allocator_capacity, allocator_options

        options = allocator_options(conf)
        if expandable_segments:
            options["expandable_segments"] = True
        capacity = None
        if gpu is not None:
            capacity = allocator_capacity(device_budget(gpu).budget_bytes, gpu.name,
                                          num_gpus=num_gpus,
                                          compute_capability=gpu.compute_capability)
        return cls(capacity=capacity, **options)

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
