"""CachingAllocatorSim against hand-derived numbers from c10/cuda/CUDACachingAllocator.cpp rules.

Rule names in comments are the PyTorch functions they come from:
round_size (512-byte multiples), get_pool (<= 1 MiB small), get_allocation_size (2 MiB small
segment; 20 MiB for 1-10 MiB; else rounded up to 2 MiB), get_free_block (best fit by size then
address; oversize rules), should_split (small: rest >= 512; large: rest > 1 MiB and request <
max_split_size; expandable: rest >= 512), free_block (merge with free neighbours),
release_cached_blocks (only wholly free segments), expandable segments (2 MiB / 20 MiB pages).
"""

from __future__ import annotations

import random

import pytest

from memfit.errors import MemfitError
from memfit.trace.allocator import CachingAllocatorSim
from memfit.trace.allocator_model import SimulatedOOM, allocation_size, round_size

KiB = 2**10
MiB = 2**20


def blocks(sim: CachingAllocatorSim) -> list[tuple[int, int, str]]:
    """(offset from its segment start, size, state) of every block, by address."""
    out = []
    for seg in sim.snapshot():
        for b in seg["blocks"]:
            out.append((b["address"] - seg["address"], b["size"], b["state"]))
    return out


# ------------------------------------------------------------------ sizes
def test_round_size_rules() -> None:
    # round_size: < 512 -> 512; else next multiple of 512
    assert round_size(1) == 512
    assert round_size(512) == 512
    assert round_size(513) == 1024
    assert round_size(3 * MiB + 1) == 3 * MiB + 512
    # roundup_power2_divisions=4 applies above 512*4 = 2048 bytes only: 1200 -> 1536 (512-rule)
    assert round_size(1200, [4] * 16) == 1536
    # 5 MiB + 1 with 4 divisions: between 4 and 8 MiB the steps are 1 MiB -> 6 MiB
    assert round_size(5 * MiB + 1, [4] * 16) == 6 * MiB
    # a power of two stays as it is
    assert round_size(8 * MiB, [4] * 16) == 8 * MiB
    # 600 MiB: interval index 9 (512 MiB..1 GiB); 2 divisions there -> steps of 256 MiB -> 768
    table = [1] * 9 + [2] + [8] * 6
    assert round_size(600 * MiB, table) == 768 * MiB
    # 300 MiB: index 8 has 1 division -> plain 512-byte rounding
    assert round_size(300 * MiB + 1, table) == 300 * MiB + 512


def _power2_div(size: int, div_factor: int) -> int:
    """PyTorch's own expectation for roundup_power2_divisions (``power2_div`` in
    test/test_cuda.py ``test_allocator_settings``): a loop, unlike the bit arithmetic under test.
    """
    pow2 = 1
    while pow2 < size:
        pow2 *= 2
    if pow2 == size:
        return pow2
    step = pow2 // 2 // div_factor
    ret = pow2 // 2
    while ret < size:
        ret += step
    return ret


@pytest.mark.parametrize("divisions", [2, 4, 8, 16])
def test_round_size_matches_pytorch_tests_power2_div(divisions: int) -> None:
    rng = random.Random(divisions)
    sizes = [rng.randrange(512 * divisions + 1, 1 << 36) for _ in range(2000)]
    sizes += [21 * MiB * 4, 100 * MiB * 4, 3 << 30, (1 << 30) + 1]
    for size in sizes:
        assert round_size(size, [divisions] * 16) == _power2_div(size, divisions), size


def test_allocation_size_rules() -> None:
    assert allocation_size(512) == 2 * MiB  # small pool -> kSmallBuffer
    assert allocation_size(1 * MiB) == 2 * MiB  # exactly kSmallSize is still small
    assert allocation_size(1 * MiB + 512) == 20 * MiB  # large, < 10 MiB -> kLargeBuffer
    assert allocation_size(10 * MiB - 512) == 20 * MiB
    assert allocation_size(10 * MiB) == 10 * MiB  # >= kMinLargeAlloc: own size, 2 MiB multiple
    assert allocation_size(11 * MiB) == 12 * MiB


# ------------------------------------------------------------------ single allocations
def test_one_byte_allocates_512_in_a_2mib_segment() -> None:
    sim = CachingAllocatorSim()
    sim.malloc(1)
    assert sim.allocated_bytes == 512  # round_size
    assert sim.reserved_bytes == 2 * MiB  # small pool segment
    assert sim.num_segments == 1
    assert sim.requested_bytes == 1


def test_three_mib_gets_a_20mib_segment_split() -> None:
    sim = CachingAllocatorSim()
    sim.malloc(3 * MiB)
    # large pool, < 10 MiB -> 20 MiB; rest 17 MiB > 1 MiB -> split, 3 MiB allocated
    assert (sim.allocated_bytes, sim.reserved_bytes) == (3 * MiB, 20 * MiB)
    assert blocks(sim) == [(0, 3 * MiB, "active_allocated"), (3 * MiB, 17 * MiB, "inactive")]


def test_eleven_mib_gets_a_12mib_segment_unsplit() -> None:
    sim = CachingAllocatorSim()
    sim.malloc(11 * MiB)
    # >= 10 MiB -> segment rounded up to 2 MiB = 12 MiB; rest 1 MiB is not > 1 MiB -> no split,
    # so the whole 12 MiB block is handed out and counted as allocated
    assert (sim.allocated_bytes, sim.reserved_bytes) == (12 * MiB, 12 * MiB)


def test_large_split_threshold_is_strictly_more_than_1mib() -> None:
    sim = CachingAllocatorSim()
    sim.malloc(19 * MiB)  # 20 MiB segment, rest 1 MiB -> not split
    assert sim.allocated_bytes == 20 * MiB
    sim2 = CachingAllocatorSim()
    sim2.malloc(18 * MiB + 512 * KiB)  # rest 1.5 MiB > 1 MiB -> split
    assert sim2.allocated_bytes == 18 * MiB + 512 * KiB
    assert sim2.reserved_bytes == 20 * MiB


def test_one_mib_is_small_and_one_mib_plus_one_is_large() -> None:
    sim = CachingAllocatorSim()
    sim.malloc(1 * MiB)  # <= kSmallSize: 2 MiB small segment, rest 1 MiB >= 512 -> split
    assert (sim.allocated_bytes, sim.reserved_bytes) == (1 * MiB, 2 * MiB)
    sim.malloc(1 * MiB + 1)  # 1 MiB + 512 -> large pool -> 20 MiB segment
    assert sim.reserved_bytes == 22 * MiB
    assert sim.allocated_bytes == 2 * MiB + 512


def test_zero_bytes_allocate_nothing() -> None:
    sim = CachingAllocatorSim()
    handle = sim.malloc(0)  # NativeCachingAllocator::allocate skips malloc for size 0
    assert handle == 0
    assert (sim.allocated_bytes, sim.reserved_bytes, sim.num_segments) == (0, 0, 0)
    sim.free(handle)  # free(nullptr) is a no-op
    assert sim.allocated_bytes == 0


def test_bad_sizes_and_handles_raise() -> None:
    sim = CachingAllocatorSim()
    with pytest.raises(MemfitError, match=">= 0"):
        sim.malloc(-1)
    h = sim.malloc(100)
    sim.free(h)
    with pytest.raises(MemfitError, match="already freed"):
        sim.free(h)
    with pytest.raises(MemfitError, match="20 MiB"):
        CachingAllocatorSim(max_split_size=10 * MiB)
    with pytest.raises(MemfitError, match="power of two"):
        CachingAllocatorSim(roundup_power2_divisions=3)


# ------------------------------------------------------------------ reuse, split, merge
def test_free_then_smaller_request_reuses_the_cached_segment() -> None:
    sim = CachingAllocatorSim()
    h = sim.malloc(5 * MiB)
    sim.free(h)  # 5 MiB merges back with the 15 MiB rest: one free 20 MiB block
    assert blocks(sim) == [(0, 20 * MiB, "inactive")]
    sim.malloc(4 * MiB)  # best fit: the 20 MiB block, split 4 + 16
    assert (sim.allocated_bytes, sim.reserved_bytes, sim.num_segments) == (4 * MiB, 20 * MiB, 1)


def test_unsplit_block_is_reused_and_split_later() -> None:
    sim = CachingAllocatorSim()
    h = sim.malloc(19 * MiB)  # whole 20 MiB block (rest 1 MiB not split)
    sim.free(h)
    sim.malloc(2 * MiB)  # reuses the 20 MiB block; rest 18 MiB > 1 MiB -> split
    assert (sim.allocated_bytes, sim.reserved_bytes) == (2 * MiB, 20 * MiB)


def test_small_blocks_split_and_best_fit_reuse() -> None:
    sim = CachingAllocatorSim()
    a = sim.malloc(1000)  # 1024 at offset 0
    sim.malloc(1000)  # 1024 at offset 1024
    sim.free(a)  # a stays a separate free 1024 block: its neighbour is live
    sim.malloc(700)  # 1024: best fit is a's 1024 block, not the large tail -> offset 0
    assert blocks(sim) == [(0, 1024, "active_allocated"), (1024, 1024, "active_allocated"),
                           (2048, 2 * MiB - 2048, "inactive")]
    assert sim.reserved_bytes == 2 * MiB


def test_exact_fit_is_not_split_and_a_full_small_segment_forces_a_new_one() -> None:
    sim = CachingAllocatorSim()
    sim.malloc(1 * MiB)  # 2 MiB segment: 1 MiB used + 1 MiB free
    sim.malloc(1 * MiB)  # exact fit of the free 1 MiB (rest 0 -> no split)
    assert (sim.reserved_bytes, sim.num_segments) == (2 * MiB, 1)
    sim.malloc(1)  # nothing free in the small pool -> a second 2 MiB segment
    assert (sim.reserved_bytes, sim.num_segments) == (4 * MiB, 2)


def test_best_fit_ties_go_to_the_lowest_address() -> None:
    sim = CachingAllocatorSim()
    hs = [sim.malloc(4096) for _ in range(5)]  # offsets 0, 4K, 8K, 12K, 16K
    sim.free(hs[3])
    sim.free(hs[1])  # two free 4 KiB holes: offsets 4K and 12K
    sim.malloc(4096)  # same size -> the lower address, offset 4K
    states = {off: state for off, _, state in blocks(sim)}
    assert states[4096] == "active_allocated"
    assert states[12288] == "inactive"


def test_fragmentation_grows_reserved_while_allocated_does_not() -> None:
    sim = CachingAllocatorSim()
    a = sim.malloc(6 * MiB)  # 20 MiB segment: 6 + 14 free
    b = sim.malloc(6 * MiB)  # best fit 14 -> 6 + 8 free
    c = sim.malloc(6 * MiB)  # best fit 8 -> 6 + 2 free (2 MiB > 1 MiB -> split)
    assert sim.peak_allocated_bytes == 18 * MiB
    sim.free(a)  # free 6 MiB hole at offset 0 (b is live next to it)
    sim.free(c)  # merges with the 2 MiB tail -> free 8 MiB at offset 12 MiB
    assert blocks(sim) == [(0, 6 * MiB, "inactive"), (6 * MiB, 6 * MiB, "active_allocated"),
                           (12 * MiB, 8 * MiB, "inactive")]
    # 14 MiB free in total, but no 9 MiB hole: a second 20 MiB segment
    sim.malloc(9 * MiB)
    assert sim.allocated_bytes == 15 * MiB < sim.peak_allocated_bytes
    assert sim.reserved_bytes == 40 * MiB
    # empty_cache frees only wholly free segments: both hold a live block -> nothing freed
    sim.empty_cache()
    assert sim.reserved_bytes == 40 * MiB
    sim.free(b)  # segment 1 is now entirely free (merged into one 20 MiB block)
    sim.empty_cache()
    assert (sim.reserved_bytes, sim.num_segments) == (20 * MiB, 1)
    assert sim.peak_reserved_bytes == 40 * MiB


def test_reset_peak_restarts_from_current() -> None:
    sim = CachingAllocatorSim()
    h = sim.malloc(30 * MiB)
    sim.free(h)
    sim.empty_cache()
    assert (sim.peak_allocated_bytes, sim.peak_reserved_bytes) == (30 * MiB, 30 * MiB)
    sim.reset_peak()
    assert (sim.peak_allocated_bytes, sim.peak_reserved_bytes) == (0, 0)
    sim.malloc(1)
    assert (sim.peak_allocated_bytes, sim.peak_reserved_bytes) == (512, 2 * MiB)


# ------------------------------------------------------------------ streams
def test_streams_have_separate_pools() -> None:
    sim = CachingAllocatorSim()
    h = sim.malloc(3 * MiB, stream=0)
    sim.free(h)  # cached for stream 0 only
    sim.malloc(3 * MiB, stream=1)  # cannot reuse stream 0's block -> new 20 MiB segment
    assert (sim.reserved_bytes, sim.num_segments) == (40 * MiB, 2)
    sim.malloc(3 * MiB, stream=0)  # reuses stream 0's cached segment
    assert sim.reserved_bytes == 40 * MiB
    assert {s["stream"] for s in sim.snapshot()} == {0, 1}


# ------------------------------------------------------------------ max_split_size
def test_max_split_size_keeps_oversize_blocks_for_large_requests() -> None:
    sim = CachingAllocatorSim(max_split_size=32 * MiB)
    h = sim.malloc(64 * MiB)  # 64 MiB segment, >= max_split: never split
    sim.free(h)
    sim.malloc(8 * MiB)  # 8 < 32 must not take the 64 MiB oversize block -> new 20 MiB
    assert sim.reserved_bytes == 84 * MiB
    sim.malloc(40 * MiB)  # >= 32 but 64 >= 40 + 20 (max_non_split_rounding) -> new 40 MiB
    assert sim.reserved_bytes == 124 * MiB
    sim.malloc(50 * MiB)  # 64 < 50 + 20 -> takes the 64 MiB block whole (no split)
    assert sim.reserved_bytes == 124 * MiB
    assert sim.allocated_bytes == 8 * MiB + 40 * MiB + 64 * MiB


def test_without_max_split_size_the_big_block_is_split() -> None:
    sim = CachingAllocatorSim()
    h = sim.malloc(64 * MiB)
    sim.free(h)
    sim.malloc(8 * MiB)  # best fit 64 MiB block, split 8 + 56
    assert (sim.reserved_bytes, sim.allocated_bytes) == (64 * MiB, 8 * MiB)


def test_large_segment_size_option() -> None:
    # newest PyTorch's large_segment_size_mb replaces the 20 MiB segment of 1-10 MiB requests
    sim = CachingAllocatorSim(large_segment_size=64 * MiB)
    sim.malloc(3 * MiB)
    assert sim.reserved_bytes == 64 * MiB
    sim.malloc(12 * MiB)  # >= 10 MiB: fits in the 61 MiB rest of the 64 MiB segment
    assert sim.reserved_bytes == 64 * MiB
    expandable = CachingAllocatorSim(expandable_segments=True, large_segment_size=64 * MiB)
    expandable.malloc(3 * MiB)  # assumed: also the large expandable page size
    assert expandable.reserved_bytes == 64 * MiB
    with pytest.raises(MemfitError, match="multiple of 2 MiB"):
        CachingAllocatorSim(large_segment_size=3 * MiB)


# ------------------------------------------------------------------ out of memory
def test_capacity_triggers_release_and_retry_then_oom() -> None:
    sim = CachingAllocatorSim(capacity=40 * MiB)
    a = sim.malloc(3 * MiB)  # 20 MiB segment
    sim.free(a)  # cached, wholly free
    # 30 MiB needs a 30 MiB segment: 20 + 30 > 40 -> release_cached_blocks frees the cached
    # 20 MiB segment, and the retry fits
    sim.malloc(30 * MiB)
    assert sim.reserved_bytes == 30 * MiB
    assert sim.num_alloc_retries == 1
    assert sim.peak_reserved_bytes == 30 * MiB
    # 12 MiB needs a 12 MiB segment: 30 + 12 > 40, nothing cached to free -> OOM
    with pytest.raises(SimulatedOOM) as info:
        sim.malloc(12 * MiB)
    err = info.value
    assert (err.alloc_size, err.allocated, err.reserved, err.capacity) == (
        12 * MiB, 30 * MiB, 30 * MiB, 40 * MiB)
    assert sim.num_ooms == 1
    assert (sim.allocated_bytes, sim.reserved_bytes) == (30 * MiB, 30 * MiB)  # unchanged


def test_oom_frees_oversize_blocks_first_with_max_split_size() -> None:
    sim = CachingAllocatorSim(capacity=100 * MiB, max_split_size=32 * MiB)
    h = sim.malloc(64 * MiB)
    sim.free(h)
    # 40 MiB: the cached 64 MiB block is refused (64 >= 40 + 20); a new 40 MiB segment does not
    # fit (64 + 40 > 100) -> release_available_cached_blocks frees the 64 MiB oversize block
    # (the smallest cached block >= max(40, 32)), then the first retry fits: no full-cache retry
    sim.malloc(40 * MiB)
    assert sim.reserved_bytes == 40 * MiB
    assert sim.num_alloc_retries == 0


# ------------------------------------------------------------------ expandable segments
def test_expandable_segment_grows_by_20mib_pages() -> None:
    sim = CachingAllocatorSim(expandable_segments=True)
    a = sim.malloc(3 * MiB)  # large pool page 20 MiB: 1 page mapped
    assert (sim.reserved_bytes, sim.allocated_bytes) == (20 * MiB, 3 * MiB)
    b = sim.malloc(30 * MiB)  # 17 MiB free at the end + 1 more page -> 37 MiB, split 30 + 7
    assert (sim.reserved_bytes, sim.allocated_bytes) == (40 * MiB, 33 * MiB)
    assert sim.num_segments == 1
    # the same two requests without expandable segments: 20 MiB + 30 MiB segments
    plain = CachingAllocatorSim()
    plain.malloc(3 * MiB)
    plain.malloc(30 * MiB)
    assert plain.reserved_bytes == 50 * MiB
    # frees keep the pages mapped; everything merges into one free 40 MiB block
    sim.free(a)
    sim.free(b)
    assert sim.reserved_bytes == 40 * MiB
    sim.malloc(35 * MiB)  # fits in the mapped 40 MiB block: no new page
    assert sim.reserved_bytes == 40 * MiB


def test_expandable_small_pool_uses_2mib_pages_and_splits_from_512() -> None:
    sim = CachingAllocatorSim(expandable_segments=True)
    sim.malloc(1)
    assert sim.reserved_bytes == 2 * MiB
    sim.malloc(11 * MiB)  # 1 page of 20 MiB; expandable split rule: rest 9 MiB >= 512 -> split
    assert sim.allocated_bytes == 512 + 11 * MiB  # not 12 MiB as with cudaMalloc segments
    assert sim.reserved_bytes == 22 * MiB
    assert sim.num_segments == 2  # one virtual segment per pool


def test_expandable_empty_cache_unmaps_only_whole_free_pages() -> None:
    sim = CachingAllocatorSim(expandable_segments=True)
    sim.malloc(3 * MiB)  # [0, 3) live
    b = sim.malloc(30 * MiB)  # [3, 33) live, [33, 40) free; 2 pages mapped
    sim.free(b)  # [3, 40) free, still mapped
    sim.empty_cache()  # page [20, 40) is wholly free -> unmapped; page [0, 20) holds [0, 3)
    assert sim.reserved_bytes == 20 * MiB
    assert blocks(sim) == [(0, 3 * MiB, "active_allocated"), (3 * MiB, 17 * MiB, "inactive")]
    sim.malloc(17 * MiB)  # exactly the free remainder of the first page: no new page
    assert sim.reserved_bytes == 20 * MiB


def test_expandable_empty_cache_releases_a_wholly_free_segment() -> None:
    sim = CachingAllocatorSim(expandable_segments=True)
    h = sim.malloc(50 * MiB)  # 3 pages = 60 MiB
    assert sim.reserved_bytes == 60 * MiB
    sim.free(h)
    sim.empty_cache()
    assert (sim.reserved_bytes, sim.num_segments, sim.snapshot()) == (0, 0, [])
    sim.malloc(3 * MiB)  # a fresh segment, one page
    assert sim.reserved_bytes == 20 * MiB


def test_expandable_best_fit_prefers_blocks_that_cannot_grow() -> None:
    sim = CachingAllocatorSim(expandable_segments=True)
    a = sim.malloc(5 * MiB)  # [0, 5)
    sim.malloc(11 * MiB)  # [5, 16); free tail [16, 20) is followed by unmapped pages
    sim.free(a)  # free [0, 5): 5 MiB, cannot grow
    # 4 MiB: the smallest fit is the 4 MiB tail, but get_free_block skips to the 5 MiB hole
    # because the tail's expandable size (4 MiB + unmapped space) is larger
    sim.malloc(4 * MiB)
    assert (0, 4 * MiB, "active_allocated") in blocks(sim)
    assert sim.reserved_bytes == 20 * MiB


def test_expandable_oom_unmaps_free_pages_and_retries() -> None:
    sim = CachingAllocatorSim(expandable_segments=True, capacity=60 * MiB)
    h = sim.malloc(50 * MiB)  # 3 pages
    sim.free(h)
    sim.malloc(1)  # small pool: a 2 MiB page -> 62 MiB would exceed 60: retry after unmapping
    assert sim.reserved_bytes == 2 * MiB
    assert sim.num_alloc_retries == 1
    with pytest.raises(SimulatedOOM):
        sim.malloc(59 * MiB)  # 3 pages = 60 MiB + the 2 MiB page > 60


# ------------------------------------------------------------------ consistency and speed
@pytest.mark.parametrize(("expandable", "capacity"),
                         [(False, None), (True, None), (False, 600 * MiB), (True, 600 * MiB)])
def test_random_workload_keeps_accounting_consistent(expandable: bool,
                                                     capacity: int | None) -> None:
    rng = random.Random(1234)
    sim = CachingAllocatorSim(expandable_segments=expandable, capacity=capacity)
    live: dict[int, int] = {}
    sizes = [1, 700, 4096, 100_000, 1 * MiB, 1 * MiB + 1, 3 * MiB, 9 * MiB, 11 * MiB, 40 * MiB]
    ooms = 0
    for step in range(3000):
        if live and (len(live) > 200 or rng.random() < 0.45):
            handle = rng.choice(list(live))
            del live[handle]
            sim.free(handle)
        else:
            n = rng.choice(sizes)
            try:
                live[sim.malloc(n, stream=rng.randrange(2))] = n
            except SimulatedOOM:
                ooms += 1
        if capacity is not None:
            assert sim.reserved_bytes <= capacity
        if step % 500 == 499:
            sim.empty_cache()
        if step % 100 == 0:
            segments = sim.snapshot()
            assert sum(s["total_size"] for s in segments) == sim.reserved_bytes
            assert sum(s["allocated_size"] for s in segments) == sim.allocated_bytes
            assert sum(s["requested_size"] for s in segments) == sum(live.values())
            for seg in segments:
                offset = seg["address"]
                previous_free = False
                for block in seg["blocks"]:
                    assert block["address"] == offset  # blocks tile the segment
                    offset += block["size"]
                    is_free = block["state"] == "inactive"
                    assert not (is_free and previous_free)  # free neighbours always merged
                    previous_free = is_free
            assert sim.allocated_bytes >= sum(round_size(n) for n in live.values())
    assert (ooms > 0) == (capacity is not None)  # the capacity runs do reach the OOM path
    assert sim.num_ooms == ooms
    for handle in list(live):
        sim.free(handle)
    assert sim.allocated_bytes == 0
    sim.empty_cache()
    assert sim.reserved_bytes == 0


def test_malloc_free_pairs_leak_nothing() -> None:
    # (Their speed, a target, is timed in bench/speed_targets.py.)
    sim = CachingAllocatorSim()
    sizes = [512, 4096, 65536, 1 * MiB + 1, 3 * MiB, 12 * MiB, 64 * MiB]
    held = [sim.malloc(s) for s in sizes * 20]  # a realistic live set to search through
    allocated, reserved = sim.allocated_bytes, sim.reserved_bytes
    for i in range(10_000):
        sim.free(sim.malloc(sizes[i % len(sizes)]))
    assert sim.allocated_bytes == allocated
    assert sim.reserved_bytes - reserved <= 64 * MiB + 20 * MiB  # at most one more segment
    assert len(held) == 140


# ------------------------------------------------------------------ release under pressure
def test_oom_release_frees_several_oversize_blocks_largest_first() -> None:
    """``CUDACachingAllocator.cpp: release_available_cached_blocks``: no cached block >=
    max(request, max_split_size) -> free oversize blocks from the largest down until their
    sizes reach that key, then ``alloc_block`` again (no full ``release_cached_blocks``)."""
    sim = CachingAllocatorSim(capacity=100 * MiB, max_split_size=32 * MiB)
    h1, h2 = sim.malloc(40 * MiB), sim.malloc(40 * MiB)
    sim.free(h1)
    sim.free(h2)
    # 60 MiB: no cached block fits; 80 + 60 > 100 -> key max(60, 32) = 60: free 40 (40 < 60),
    # then the other 40 (80 >= 60); the 60 MiB segment fits
    sim.malloc(60 * MiB)
    assert (sim.reserved_bytes, sim.peak_reserved_bytes) == (60 * MiB, 80 * MiB)
    assert (sim.num_alloc_retries, sim.num_device_free) == (0, 2)


# ------------------------------------------------------------------ garbage collection
def _aged_cache(**options: object) -> CachingAllocatorSim:
    """a (12 MiB) cached after the first large-pool search, b and c (20 MiB each) after the
    third: at the fourth search a is 3 searches old, b and c 1."""
    sim = CachingAllocatorSim(**options)  # type: ignore[arg-type]
    a = sim.malloc(12 * MiB)  # search 1, segment 12
    sim.free(a)
    b = sim.malloc(20 * MiB)  # search 2: 12 < 20, new segment
    c = sim.malloc(20 * MiB)  # search 3: new segment; reserved 52 MiB
    sim.free(b)
    sim.free(c)
    sim.malloc(24 * MiB)  # search 4: nothing cached fits
    return sim


def test_garbage_collection_frees_the_oldest_cached_segments() -> None:
    """``CUDACachingAllocator.cpp: garbage_collect_cached_blocks`` (run by ``malloc`` on a
    cache miss when ``set_fraction`` and ``garbage_collection_threshold() > 0``): reserved 52 MiB
    > 0.5 x 100 MiB -> reclaim 2 MiB, freeing unsplit large blocks whose age
    (``Block::gc_count``: large-pool ``get_free_block`` calls since cached) is >= the mean:
    ages 3, 1, 1 (mean 5/3) -> only a's 12 MiB segment goes. 52 - 12 + 24 = 64 MiB."""
    sim = _aged_cache(garbage_collection_threshold=0.5, allowed_memory_maximum=100 * MiB)
    assert sim.reserved_bytes == 64 * MiB
    assert sorted(s["total_size"] for s in sim.snapshot()) == [20 * MiB, 20 * MiB, 24 * MiB]


def test_garbage_collection_needs_a_memory_fraction() -> None:
    """``garbage_collect_cached_blocks`` runs only under ``set_fraction``
    (``torch.cuda.set_per_process_memory_fraction``, here ``allowed_memory_maximum``); a
    threshold alone changes nothing: 52 + 24 = 76 MiB."""
    assert _aged_cache(garbage_collection_threshold=0.5).reserved_bytes == 76 * MiB
    assert _aged_cache(allowed_memory_maximum=100 * MiB).reserved_bytes == 76 * MiB
    # the fraction is a hard limit too (alloc_block: total + size > allowed_memory_maximum)
    with pytest.raises(SimulatedOOM):
        _aged_cache(allowed_memory_maximum=60 * MiB).malloc(40 * MiB)
    with pytest.raises(MemfitError, match=r"\(0.0, 1.0\)"):
        CachingAllocatorSim(garbage_collection_threshold=1.0)


# ------------------------------------------------------------------ streams
def test_each_stream_has_its_own_pools() -> None:
    """``get_free_block``: ``BlockComparatorSize`` orders by stream first and the found block
    must be on the request's stream, so a block cached by stream 1 never serves stream 0."""
    sim = CachingAllocatorSim()
    sim.free(sim.malloc(12 * MiB, stream=1))
    sim.malloc(12 * MiB, stream=0)
    assert sim.reserved_bytes == 24 * MiB
    assert sorted(s["stream"] for s in sim.snapshot()) == [0, 1]


def test_record_stream_defers_the_free_until_events_complete() -> None:
    """``free``: a block with ``stream_uses`` (``recordStream``) leaves allocated_bytes at
    once but is cached only when its events complete (``insert_events`` then
    ``process_events``); ``release_cached_blocks`` starts with
    ``synchronize_and_free_events``."""
    sim = CachingAllocatorSim()
    a = sim.malloc(12 * MiB)
    sim.record_stream(a, 1)
    sim.free(a)
    assert (sim.allocated_bytes, sim.pending_free_bytes) == (0, 12 * MiB)
    b = sim.malloc(12 * MiB)  # a's block is not reusable yet: a second segment
    assert sim.reserved_bytes == 24 * MiB
    assert [blk["state"] for seg in sim.snapshot() for blk in seg["blocks"]] == [
        "active_pending_free", "active_allocated"]
    sim.process_events()
    sim.malloc(12 * MiB)  # now a's block serves it
    assert sim.reserved_bytes == 24 * MiB
    sim.record_stream(b, 0)  # its own stream: nothing to wait for
    sim.free(b)
    assert sim.pending_free_bytes == 0
    c = sim.malloc(12 * MiB)
    sim.record_stream(c, 2)
    sim.free(c)
    sim.empty_cache()  # synchronizes: c's segment is freed too
    assert (sim.reserved_bytes, sim.pending_free_bytes) == (12 * MiB, 0)


def test_a_pending_free_block_does_not_merge_with_its_neighbours() -> None:
    """``try_merge_blocks`` refuses a block with ``event_count > 0`` (freed after
    ``record_stream``, events outstanding): 3 MiB blocks a, b, c split off one 20 MiB segment;
    a and c freed while b waits on stream 1 -> three free blocks (a, c + the 11 MiB rest) around
    b; once the events complete, all merge back into the 20 MiB segment."""
    sim = CachingAllocatorSim()
    a, b, c = (sim.malloc(3 * MiB) for _ in range(3))
    sim.record_stream(b, 1)
    sim.free(b)
    sim.free(a)
    sim.free(c)
    assert [(off // MiB, size // MiB, state) for off, size, state in blocks(sim)] == [
        (0, 3, "inactive"), (3, 3, "active_pending_free"), (6, 14, "inactive")]
    sim.process_events()
    assert blocks(sim) == [(0, 20 * MiB, "inactive")]


# ------------------------------------------------------------------ the trace's peak
def test_trace_peak_counts_whole_unsplit_blocks() -> None:
    """``max_memory_allocated`` counts block sizes (``alloc_found_block``), and ``should_split``
    keeps a large block whole when the rest is <= 1 MiB. Forward of Linear(1024, 9088) on
    (256, 1024) fp32, hand-computed:
    weight 35.5 MiB -> 36 MiB segment, rest 0.5 MiB: unsplit, 36 MiB allocated;
    input 1 MiB -> small pool (2 MiB segment); at the first matmul the cuBLAS workspace
    8,519,680 B -> new 20 MiB segment, split; the cuBLASLt workspace (1 MiB before torch 2.11,
    none after: runtime.cublaslt_workspace_bytes) -> the small segment's rest;
    output 256 x 9088 x 4 = 8.875 MiB -> the workspace segment's 11.875 MiB rest, split.
    Allocated 36 + 1 + 8.125 + 8.875 = 54 MiB, + 1 MiB with a cuBLASLt workspace (the
    512-rounded sizes sum to 0.5 MiB less); reserved 36 + 2 + 20 = 58 MiB either way."""
    import torch
    from torch import nn

    from memfit.trace import estimate

    with torch.device("meta"):
        model = nn.Linear(1024, 9088, bias=False)
    x = torch.empty(256, 1024, device="meta")
    from memfit.runtime import cublaslt_workspace_bytes

    lt = cublaslt_workspace_bytes("8.0")  # the installed torch's release decides
    assert lt in (0, MiB)
    est = estimate(model, x, device="cuda", gpu="a100-80gb", optimizer=None, steps=1)
    assert (est.peak_bytes, est.peak_reserved_bytes) == (54 * MiB + lt, 58 * MiB)
    # the breakdown adds up to the peak (the whole-block excess counts as temporaries)
    assert sum(est.breakdown.values()) - est.runtime_outside_allocator_bytes == 54 * MiB + lt


def test_trace_runs_with_the_gpus_capacity() -> None:
    """``malloc``: with the GPU's capacity the trace frees cached blocks and retries
    (``release_cached_blocks``) before it would run out of memory, so the predicted reserved
    stays within the capacity when the step fits; when it does not, the estimate says so (a
    warning and an assumption) and goes on as on an unlimited GPU."""
    import dataclasses
    import warnings

    import torch
    from torch import nn

    from memfit.gpus import get_gpu
    from memfit.runtime import CUDA_CONTEXT_BYTES
    from memfit.trace import estimate

    with torch.device("meta"):
        model = nn.Sequential(*(m for i in range(6) for m in (
            nn.Linear(1024 + 96 * i, 1024 + 96 * (i + 1)), nn.ReLU())))
    x = torch.empty(3000, 1024, device="meta")
    a100 = get_gpu("a100-80gb")
    free = estimate(model, x, device="cuda", gpu=a100)
    capacity = free.peak_reserved_bytes - 18 * MiB
    small = dataclasses.replace(a100, usable_bytes=CUDA_CONTEXT_BYTES + capacity)
    tight = estimate(model, x, device="cuda", gpu=small)
    assert tight.peak_reserved_bytes <= capacity < free.peak_reserved_bytes
    assert not any("does not fit" in a for a in tight.assumptions)
    tiny = dataclasses.replace(a100, usable_bytes=CUDA_CONTEXT_BYTES + 100 * MiB)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        oom = estimate(model, x, device="cuda", gpu=tiny)
    assert any("does not fit" in a for a in oom.assumptions)
    assert oom.peak_reserved_bytes > 100 * MiB


def test_offload_prefetch_uses_the_side_streams_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """memfit's activation offload copies back ahead of need on a side stream
    (``torch.cuda.stream(self._h2d)``) and hands the copy to the compute stream with
    ``record_stream``: the copies come from that stream's own pool (``get_free_block`` matches
    the stream) and return to it once the compute stream is done (``free`` ->
    ``insert_events``). 8 x (Linear(64, 64) -> ReLU) on (4096, 64) fp32: every offloaded
    activation is 1 MiB (small pool). At most two are on the side stream at once (the one in
    use and the next, prefetched), so that stream holds exactly one 2 MiB small segment."""
    import warnings

    import torch
    from torch import nn

    from memfit.techniques.offload import apply_activation_offload
    from memfit.trace import estimate

    made: list[CachingAllocatorSim] = []
    for_gpu = CachingAllocatorSim.for_gpu.__func__  # type: ignore[attr-defined]

    def keep(cls: type[CachingAllocatorSim], *args: object, **kwargs: object
             ) -> CachingAllocatorSim:
        made.append(for_gpu(cls, *args, **kwargs))
        return made[-1]

    monkeypatch.setattr(CachingAllocatorSim, "for_gpu", classmethod(keep))
    model = nn.Sequential(*(m for _ in range(8) for m in (nn.Linear(64, 64, bias=False),
                                                          nn.ReLU())))
    apply_activation_offload(model, min_bytes=2**16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        estimate(model, (torch.randn(4096, 64),), optimizer="sgd", device="cuda", steps=2)
    side = [s for s in made[-1].snapshot() if s["stream"] != 0]
    assert [(s["stream"], s["segment_type"], s["total_size"]) for s in side] == [
        (2, "small", 2 * MiB)]


def test_pytorch_max_split_expandable() -> None:
    """PyTorch's ``test/test_cuda.py: test_max_split_expandable``: a 120 MiB memory fraction,
    ``max_split_size_mb:40``; 40 MiB blocks alternately in plain and expandable segments fit
    three times, the fourth raises OutOfMemoryError; after freeing them, 120 MiB fits
    (``release_cached_blocks`` with expandable segments in the free list)."""
    sim = CachingAllocatorSim(max_split_size=40 * MiB, allowed_memory_maximum=120 * MiB)
    a = sim.malloc(40 * MiB)
    sim.expandable_segments = True  # _set_allocator_settings("expandable_segments:True,...")
    b = sim.malloc(40 * MiB)
    sim.expandable_segments = False
    c = sim.malloc(40 * MiB)
    assert sim.reserved_bytes == 120 * MiB
    with pytest.raises(SimulatedOOM):
        sim.malloc(40 * MiB)
    for h in (a, b, c):
        sim.free(h)
    sim.malloc(120 * MiB)
    assert (sim.allocated_bytes, sim.reserved_bytes) == (120 * MiB, 120 * MiB)


def test_pytorch_set_per_process_memory_fraction() -> None:
    """PyTorch's ``test/test_cuda.py: test_set_per_process_memory_fraction`` on an 80 GiB
    device with fraction 0.5 (``alloc_block``: ``total_allocated_memory + size >
    allowed_memory_maximum`` fails): with a 4 KiB tensor alive (a 2 MiB small segment),
    int(0.499 x total) - max_memory_reserved bytes fit; int(0.5 x total) bytes do not."""
    total = 80 * 2**30
    sim = CachingAllocatorSim(allowed_memory_maximum=int(total * 0.5))
    sim.malloc(1024 * 4)
    sim.empty_cache()
    sim.free(sim.malloc(int(total * 0.499) - sim.peak_reserved_bytes))
    sim.empty_cache()
    with pytest.raises(SimulatedOOM):
        sim.malloc(int(total * 0.5))


def test_a_step_that_does_not_fit_counts_the_same_bytes() -> None:
    """Past a simulated out-of-memory the trace goes on as on an unlimited GPU: the allocated
    bytes and their categories are those of the unlimited trace. (The OOM record once kept its
    traceback, whose optimizer frames held the first step's gradients alive after zero_grad:
    gradients counted twice.)"""
    import dataclasses
    import warnings

    import torch
    from torch import nn

    from memfit.gpus import get_gpu
    from memfit.trace import estimate

    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])
    x = torch.empty(64, 1024, device="meta")
    from memfit.runtime import cuda_context_bytes

    roomy = get_gpu("a100-80gb")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fits = estimate(model, x, optimizer="adamw", device="cuda", gpu=roomy)
        # room for the CUDA context outside the allocator and half the step
        small = cuda_context_bytes() + fits.peak_bytes // 2
        tiny = dataclasses.replace(roomy, memory_bytes=small, usable_bytes=small)
        over = estimate(model, x, optimizer="adamw", device="cuda", gpu=tiny)
    assert any("does not fit" in note for note in over.assumptions)
    assert not any("does not fit" in note for note in fits.assumptions)
    assert over.peak_bytes == fits.peak_bytes
    assert over.breakdown == fits.breakdown
