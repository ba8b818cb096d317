"""memfit.data.DevicePrefetcher: the same batches in the same order as the plain loader, and on
the CPU depth x the batch bytes more memory, measured with the profiler's allocator events."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from memfit.data import DevicePrefetcher, batch_nbytes
from memfit.errors import MemfitError
from memfit.profiling import measure_cpu_peak

SAMPLE = 4096  # floats per sample: 16 KiB


class Nested(Dataset):
    """Each sample a dict holding a tensor and a tuple of tensors, made fresh on each access."""

    def __len__(self) -> int:
        return 30

    def __getitem__(self, i: int) -> dict:
        return {"x": torch.full((SAMPLE,), float(i)),
                "pair": (torch.full((3,), i, dtype=torch.long), torch.full((2, 2), -float(i)))}


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return torch.equal(a, b)


@pytest.mark.parametrize("depth", [0, 1, 2, 5])
def test_same_batches_in_the_same_order(depth: int) -> None:
    loader = DataLoader(Nested(), batch_size=3, shuffle=False)
    plain = list(loader)
    got = list(DevicePrefetcher(loader, "cpu", depth=depth))
    assert len(got) == len(plain) == 10  # 30 samples in batches of 3
    assert all(_same(a, b) for a, b in zip(plain, got, strict=True))
    assert got[0]["x"].shape == (3, SAMPLE) and isinstance(got[0]["pair"], list)


def test_it_reads_depth_batches_ahead() -> None:
    fetched: list[int] = []

    def counting():
        for i in range(6):
            fetched.append(i)
            yield torch.tensor([i])

    it = iter(DevicePrefetcher(counting(), "cpu", depth=2))
    assert next(it).item() == 0
    # handed out batch 0; batches 1 and 2 were fetched ahead (3 is fetched with the next call)
    assert fetched == [0, 1, 2]


def test_batch_nbytes_counts_each_storage_once() -> None:
    t = torch.zeros(10)
    assert batch_nbytes({"a": t, "b": [t, t[:5]], "c": torch.zeros(2, dtype=torch.int8)}) == 42


@pytest.mark.parametrize("depth", [1, 2])
def test_cpu_extra_memory_is_depth_batches(depth: int) -> None:
    """The loop's peak over the profiler's allocator events, with the prefetcher minus without,
    is depth x the batch's bytes (the samples and batches are made fresh by the dataset and the
    collate, through torch's CPU allocator)."""
    loader = DataLoader(Nested(), batch_size=3, shuffle=False)
    batch_bytes = 3 * (SAMPLE * 4 + 3 * 8 + 4 * 4)  # by hand: 3 samples of 16384 + 24 + 16 bytes

    def loop(batches) -> None:
        for batch in batches:
            batch["x"].sum()

    plain = measure_cpu_peak(lambda: loop(loader)).peak_delta_bytes
    ahead = measure_cpu_peak(lambda: loop(DevicePrefetcher(loader, "cpu", depth=depth)))
    extra = ahead.peak_delta_bytes - plain
    assert abs(extra - depth * batch_bytes) <= 0.01 * depth * batch_bytes, (extra, batch_bytes)


def test_bad_depth_is_refused() -> None:
    with pytest.raises(MemfitError, match="depth must be an int >= 0"):
        DevicePrefetcher([], "cpu", depth=-1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_batches_equal_and_on_device() -> None:
    loader = DataLoader(Nested(), batch_size=3, shuffle=False, pin_memory=True)
    plain = list(loader)
    got = list(DevicePrefetcher(loader, "cuda", depth=2))
    assert all(_same(a, _to_cpu(b)) for a, b in zip(plain, got, strict=True))
    assert got[0]["x"].is_cuda


def _to_cpu(batch):
    from torch.utils import _pytree as pytree

    return pytree.tree_map_only(torch.Tensor, lambda t: t.cpu(), batch)
