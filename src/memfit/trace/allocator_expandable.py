"""Expandable segments (``expandable_segments:True``) of the simulated caching allocator.

One virtual segment per stream and pool, backed by physical pages mapped on demand and unmapped
by ``empty_cache``: PyTorch's ``find_expandable_block``, ``try_allocate_expandable_block``,
``map_block``, ``unmap_block`` and ``try_merge_blocks`` (the rules are listed in
:mod:`memfit.trace.allocator`'s docstring).
"""

from __future__ import annotations

from bisect import bisect_left, insort

from memfit.trace.allocator_model import (
    _DEFAULT_DEVICE_MEMORY,
    SMALL_BUFFER,
    _Block,
    _Pool,
    _remove,
    _Segment,
)
from memfit.trace.allocator_state import _AllocatorState


class _ExpandableSegments(_AllocatorState):
    """Mapping and unmapping the pages of expandable segments."""

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
