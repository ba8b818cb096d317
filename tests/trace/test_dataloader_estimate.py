"""memfit.estimate(..., dataloader=): the DevicePrefetcher's depth batches on the device peak."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memfit
from memfit.categories import MemoryCategory
from memfit.errors import MemfitError
from memfit.runtime.input_pipeline import DataLoaderSpec


def _model_inputs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    x = torch.randn(8, 64)  # 2048 bytes
    y = torch.randint(0, 10, (8,))  # 64 bytes

    def loss_fn(m, batch):
        return nn.functional.cross_entropy(m(batch[0]), batch[1])

    return model, (x, y), loss_fn


@pytest.mark.parametrize(("device", "per_batch"), [
    ("cpu", 2048 + 64),           # the tensors' own bytes (the prefetcher passes them through)
    ("cuda", 2048 + 512),         # each tensor a caching-allocator block, rounded up to 512
])
def test_depth_batches_on_the_peak(device: str, per_batch: int) -> None:
    model, inputs, loss_fn = _model_inputs()
    plain = memfit.estimate(model, inputs, device=device, loss_fn=loss_fn)
    est = memfit.estimate(model, inputs, device=device, loss_fn=loss_fn,
                          dataloader={"num_workers": 2, "depth": 2})
    assert est.peak_bytes - plain.peak_bytes == 2 * per_batch
    assert est.peak_reserved_bytes - plain.peak_reserved_bytes == 2 * per_batch
    acts = MemoryCategory.ACTIVATIONS
    assert est.breakdown[acts] - plain.breakdown[acts] == 2 * per_batch
    assert est.input_pipeline.spec.batch_bytes == 2048 + 64
    assert est.input_pipeline.in_flight_batches == 4  # 2 workers x torch's default prefetch 2
    assert "DevicePrefetcher batches (depth 2)" in str(est)


def test_given_batch_bytes_and_depth_zero() -> None:
    model, inputs, loss_fn = _model_inputs()
    plain = memfit.estimate(model, inputs, device="cpu", loss_fn=loss_fn)
    est = memfit.estimate(model, inputs, device="cpu", loss_fn=loss_fn,
                          dataloader=DataLoaderSpec(num_workers=1, batch_bytes=1000))
    assert est.peak_bytes == plain.peak_bytes  # no prefetcher: nothing more on the device
    assert est.input_pipeline.shared_bytes == 3 * 1000  # 1 x 2 in flight + the one in use


def test_bad_dataloader_keys() -> None:
    model, inputs, loss_fn = _model_inputs()
    with pytest.raises(MemfitError, match="its keys are num_workers"):
        memfit.estimate(model, inputs, device="cpu", loss_fn=loss_fn, dataloader={"workers": 2})
    with pytest.raises(MemfitError, match="prefetch_factor needs worker processes"):
        memfit.estimate(model, inputs, device="cpu", loss_fn=loss_fn,
                        dataloader={"prefetch_factor": 2})
