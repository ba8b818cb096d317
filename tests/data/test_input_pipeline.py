"""The input pipeline's memory model (memfit.runtime.input_pipeline): bytes by hand, bad input,
and the batches in flight against a real DataLoader measured with psutil."""

from __future__ import annotations

import sys

import pytest

from memfit.errors import MemfitError
from memfit.runtime.input_pipeline import (
    DataLoaderSpec,
    fitting_settings,
    input_pipeline_memory,
    parse_dataloader,
)

MiB = 1 << 20


def test_bytes_by_hand_workers_prefetch_pinned() -> None:
    # 8 workers x prefetch 4 = 32 batches in flight, pinned with the one in use: 33 pinned batches
    # of a 3 MiB tensor rounded up to 4 MiB; 1 batch (3 MiB) in shared memory being pinned; each
    # worker 10 MiB at rest + 2 batches (WORKER_BATCHES); depth 2 on the GPU (3 MiB is a multiple
    # of 512).
    m = input_pipeline_memory(DataLoaderSpec(num_workers=8, prefetch_factor=4, pin_memory=True,
                                             batch_bytes=3 * MiB, worker_rss=10 * MiB, depth=2,
                                             gpus_per_node=8))
    assert m.in_flight_batches == 32
    assert m.pinned_bytes == 33 * 4 * MiB
    assert m.shared_bytes == 3 * MiB
    assert m.worker_bytes == 8 * (10 + 2 * 3) * MiB
    assert m.host_bytes == 33 * 4 * MiB + 3 * MiB + 8 * 16 * MiB
    assert m.host_node_bytes == 8 * m.host_bytes
    assert m.device_bytes == 2 * 3 * MiB


def test_bytes_by_hand_no_pin_and_no_workers() -> None:
    m = input_pipeline_memory(DataLoaderSpec(num_workers=2, batch_bytes=1000, worker_rss=0))
    assert (m.in_flight_batches, m.shared_bytes, m.pinned_bytes) == (4, 5000, 0)  # default 2
    m0 = input_pipeline_memory(DataLoaderSpec(batch_bytes=1000, worker_rss=0))
    assert (m0.shared_bytes, m0.private_bytes, m0.worker_bytes) == (0, 3000, 0)
    # per tensor: pinned blocks are powers of two, device blocks multiples of 512
    m2 = input_pipeline_memory(DataLoaderSpec(num_workers=1, prefetch_factor=1, pin_memory=True,
                                              tensor_bytes=(600, 5), depth=1, worker_rss=0))
    assert m2.spec.batch_bytes == 605
    assert m2.pinned_bytes == 2 * (1024 + 8)
    assert m2.device_bytes == 1024 + 512


def test_fitting_settings_fit_the_budget() -> None:
    s = DataLoaderSpec(num_workers=8, prefetch_factor=4, batch_bytes=MiB << 10, worker_rss=0)
    fit = fitting_settings(s, 20 << 30)
    # host = (w p + 1 + 2 w) GiB: 3 x 4 -> 19 GiB (12 in flight); 4 x 3 -> 21 GiB; 6 x 1 -> 19 GiB
    # (6 in flight); 4 x 2 -> 17 GiB (8 in flight)
    assert (fit.num_workers, fit.prefetch) == (3, 4)
    assert input_pipeline_memory(fit).host_node_bytes <= 20 << 30
    assert fitting_settings(s, 1) is None


@pytest.mark.parametrize(("text", "message"), [
    ("prefetch=2,sample-bytes=1", "prefetch_factor needs worker processes"),
    ("workers=-1,sample-bytes=1", "workers='-1': must be an integer >= 0"),
    ("workers=2,prefetch=0,sample-bytes=1", "prefetch_factor must be an integer >= 1"),
    ("workers=2,prefech=2,sample-bytes=1", "unknown key 'prefech' (did you mean 'prefetch'?)"),
    ("workers=2", "give sample-bytes=N"),
    ("workers=2,pin=maybe,sample-bytes=1", "pin='maybe'"),
    ("workers", "write key=value"),
    ("sample-bytes=1,batch-bytes=2", "not both"),
])
def test_bad_settings_are_one_line_errors(text: str, message: str) -> None:
    with pytest.raises(MemfitError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("?", r"\?")):
        parse_dataloader(text)


def test_parse_sample_bytes_times_batch() -> None:
    s = parse_dataloader("workers=8,prefetch=4,pin=1,sample-bytes=64KiB,depth=1", batch=16,
                         gpus_per_node=8)
    assert (s.num_workers, s.prefetch, s.pin_memory, s.batch_bytes, s.depth, s.gpus_per_node) == (
        8, 4, True, 16 * 64 * 1024, 1, 8)


@pytest.mark.skipif(sys.platform != "linux", reason="reads Linux's Shmem; forks workers")
@pytest.mark.parametrize(("workers", "prefetch"), [(2, 2), (2, 3)])
def test_batches_in_flight_match_psutil_measurement(workers: int, prefetch: int) -> None:
    """A real DataLoader (forked workers), batches of 4 x 2 MiB float32 samples: the growth of
    the machine's shared memory (psutil) is the predicted batches in flight + the one in use,
    within 5%, after subtracting the same loader's with tiny batches (the baseline). The batches
    live in /dev/shm, mapped by no process while queued: no process's USS or PSS shows them
    (memfit.data.measure)."""
    pytest.importorskip("psutil")
    from memfit.data.measure import measure_loader_memory

    for attempt in range(2):  # Shmem is machine-wide: retry once if another process moved it
        tiny = measure_loader_memory(_loader(workers, prefetch, 4))
        big = measure_loader_memory(_loader(workers, prefetch, 512 * 1024))
        assert big.batch_bytes == 4 * 2 * MiB and len(big.worker_uss) == workers
        predicted = input_pipeline_memory(DataLoaderSpec(
            num_workers=workers, prefetch_factor=prefetch, batch_bytes=big.batch_bytes)
        ).shared_bytes - input_pipeline_memory(DataLoaderSpec(
            num_workers=workers, prefetch_factor=prefetch, batch_bytes=tiny.batch_bytes)
        ).shared_bytes
        measured = big.shared_bytes - tiny.shared_bytes
        assert predicted == (workers * prefetch + 1) * 8 * MiB - (workers * prefetch + 1) * 64
        if abs(measured - predicted) <= 0.05 * predicted or attempt:
            break
    assert abs(measured - predicted) <= 0.05 * predicted, (measured, predicted)


def _loader(workers: int, prefetch: int, sample_floats: int):
    import torch
    from torch.utils.data import DataLoader, Dataset

    class Synthetic(Dataset):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int):
            return torch.full((sample_floats,), float(i))

    return DataLoader(Synthetic(), batch_size=4, num_workers=workers, prefetch_factor=prefetch,
                      multiprocessing_context="fork")
