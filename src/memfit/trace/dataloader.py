"""The input pipeline's device memory on a traced step: ``memfit.estimate(..., dataloader=)``.

:class:`memfit.data.DevicePrefetcher` keeps ``depth`` batches on the device, copied ahead, for the
whole step: the peak grows by their bytes, counted in ``ACTIVATIONS`` (where the step's own batch
is: :class:`memfit.MemoryCategory`) and named in :attr:`Estimate.input_pipeline`. The host side
(workers, batches in flight, pinned buffers) is reported there too; it is not device memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils import _pytree as pytree

from memfit.categories import MemoryCategory
from memfit.errors import MemfitError
from memfit.runtime.input_pipeline import DataLoaderSpec, input_pipeline_memory
from memfit.trace.estimate import Estimate


def tensor_bytes(inputs: Any) -> tuple[int, ...]:
    """The bytes of each distinct tensor in ``inputs`` (meta tensors too: their shapes')."""
    seen: dict[int, int] = {}
    for leaf in pytree.tree_leaves(inputs):
        if isinstance(leaf, torch.Tensor):
            base = leaf if leaf._base is None else leaf._base
            seen[id(base)] = base.untyped_storage().nbytes()
    return tuple(seen.values())


def dataloader_spec(dataloader: DataLoaderSpec | Mapping[str, Any], inputs: Any) -> DataLoaderSpec:
    """``dataloader`` as a spec, its batch measured from ``inputs`` when it gives no bytes."""
    if isinstance(dataloader, Mapping):
        given = dict(dataloader)
        try:
            dataloader = DataLoaderSpec(**given)
        except TypeError as exc:
            fields = ", ".join(f.name for f in dataclasses.fields(DataLoaderSpec))
            raise MemfitError(f"dataloader={given!r}: {exc}; its keys are {fields}") from None
    if not isinstance(dataloader, DataLoaderSpec):
        raise MemfitError("dataloader= takes a memfit.runtime.input_pipeline.DataLoaderSpec or a "
                          f"dict of its fields, not {type(dataloader).__name__}")
    if not dataloader.batch_bytes and not dataloader.tensor_bytes:
        dataloader = dataclasses.replace(dataloader, tensor_bytes=tensor_bytes(inputs))
    return dataloader


def with_input_pipeline(est: Estimate, dataloader: DataLoaderSpec | Mapping[str, Any],
                        inputs: Any) -> Estimate:
    """``est`` with the pipeline's device bytes (``depth`` prefetched batches) on its peak."""
    spec = dataloader_spec(dataloader, inputs)
    memory = input_pipeline_memory(spec, device="cpu" if est.device == "cpu" else "cuda")
    extra = memory.device_bytes
    breakdown = dict(est.breakdown)
    breakdown[MemoryCategory.ACTIVATIONS] += extra
    per_rank = tuple(with_input_pipeline(r, spec, inputs) for r in est.per_rank)
    return dataclasses.replace(est, peak_bytes=est.peak_bytes + extra,
                               peak_reserved_bytes=est.peak_reserved_bytes + extra,
                               breakdown=breakdown, input_pipeline=memory, per_rank=per_rank)
