"""measure_cpu_peak against hand-computed bytes."""

from __future__ import annotations

import gc

import torch

from memfit.profiling import live_bytes, measure_cpu_peak
from memfit.profiling.cpu import session_deltas


def test_one_known_allocation() -> None:
    def fn() -> None:
        a = torch.empty(1000, dtype=torch.float32)  # 4000 bytes
        del a

    peak = measure_cpu_peak(fn)
    assert peak.peak_delta_bytes == 4000
    assert peak.end_delta_bytes == 0
    assert peak.baseline_bytes == 0


def test_running_sum_peak_with_frees() -> None:
    def fn() -> torch.Tensor:
        a = torch.empty(1000, dtype=torch.float32)   # 4000
        b = torch.empty(250, dtype=torch.float64)    # 2000 -> 6000 live
        del a                                         # 2000 live
        c = torch.empty(500, dtype=torch.int16)       # 1000 -> 3000 live
        del b
        return c

    peak = measure_cpu_peak(fn)
    assert peak.peak_delta_bytes == 6000
    assert peak.end_delta_bytes == 1000  # c is returned, still alive


def test_baseline_counts_storages_once() -> None:
    x = torch.empty(100)                 # 400 bytes
    view = x[10:20]                      # same storage
    lin = torch.nn.Linear(4, 3)          # 12 + 3 floats = 60 bytes
    assert live_bytes(x, view) == 400
    assert live_bytes(lin, x, [x, view]) == 460
    peak = measure_cpu_peak(lambda: None, x, view, lin)
    assert peak.baseline_bytes == 460
    assert peak.peak_bytes == 460


def test_frees_of_blocks_allocated_before_the_run_are_not_seen() -> None:
    # Documented limitation: the profiler does not report freeing a block allocated before it
    # started, so the measurement keeps the baseline (an upper bound for such runs).
    holder = [torch.empty(256)]          # 1024 bytes alive before the run

    def fn() -> None:
        holder.clear()                   # frees it during the run: not reported
        torch.empty(64)                  # 256 bytes, freed at once

    peak = measure_cpu_peak(fn, holder)
    assert peak.baseline_bytes == 1024
    assert peak.peak_bytes == 1024 + 256


def test_frees_of_blocks_this_session_did_not_allocate_are_dropped() -> None:
    # PyTorch's CPU allocator keeps the size of a block allocated under a profiling session until
    # the block is freed under one. Freed outside, the entry goes stale; a new block at the same
    # address, allocated outside profiling and freed under a later session, is then reported
    # freed with the stale size. (Whether the C allocator hands the address back is up to it, so
    # the events are built by hand.) A 4 MiB stale free at address 0xB would take the running
    # sum to -4 MiB; it is dropped, and address 0xA's reuse within the session is kept.
    events = [(10, 0xA, 100), (20, 0xB, -(4 << 20)), (30, 0xA, -100), (40, 0xA, 60),
              (15, 0xC, 8), (50, 0xA, -60)]
    assert session_deltas(events) == [100, 8, -100, 60, -60]


def test_cycle_collection_does_not_move_the_peak() -> None:
    # Garbage in a reference cycle is freed whenever Python's collector happens to run. The
    # measurement pauses the collector, so here the cycle's 1 MiB stays until the run ends and the
    # peak is 1 MiB cycle + 1 MiB allocated after it, however eager the collector is set.
    def fn() -> None:
        cycle: list[object] = [torch.empty(1 << 18)]
        cycle.append(cycle)
        del cycle
        _ = [[] for _ in range(100)]  # container allocations: the collector's trigger
        torch.empty(1 << 18)

    threshold = gc.get_threshold()
    gc.set_threshold(1, 1, 1)  # collect at every container allocation
    try:
        peak = measure_cpu_peak(fn)
    finally:
        gc.set_threshold(*threshold)
    assert peak.peak_delta_bytes == 2 * (1 << 20)
    assert gc.isenabled()


def test_live_bytes_counts_a_sparse_gradient_by_its_indices_and_values() -> None:
    # 5 ids looked up in a 100 x 4 table: the gradient is 5 int64 indices (40 bytes) and 5 rows
    # of 4 fp32 values (80 bytes) next to the 1600-byte table. sum()'s gradient is an expanded
    # view, so AccumulateGrad copied both (accumulate_grad.h): the ids are not the indices.
    table = torch.nn.Embedding(100, 4, sparse=True)
    ids = torch.tensor([1, 2, 2, 7, 9])
    table(ids).sum().backward()
    assert live_bytes(table) == 1600 + 40 + 80
    assert live_bytes(table, ids) == 1600 + 40 + 80 + 40
