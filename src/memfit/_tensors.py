"""Walking nested containers for the tensors inside, and calling a model on a batch (one helper
each for every part of memfit)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch


def tensor_leaves(obj: Any, *, objects: bool = False) -> Iterator[torch.Tensor]:
    """The tensors in ``obj``: a tensor, or mappings / lists / tuples of them, nested.

    ``objects=True`` also looks inside plain objects' attributes (e.g. a model's output
    dataclass), but never inside modules.
    """
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from tensor_leaves(v, objects=objects)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from tensor_leaves(v, objects=objects)
    elif objects and hasattr(obj, "__dict__") and not isinstance(obj, torch.nn.Module):
        for v in vars(obj).values():
            yield from tensor_leaves(v, objects=objects)


def call_model(model: torch.nn.Module, batch: Any) -> Any:
    """``model(**batch)`` for a mapping, ``model(*batch)`` for a tuple/list, else
    ``model(batch)``."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, list | tuple):
        return model(*batch)
    return model(batch)


def meta_batch(batch: Any, rows: int) -> Any:
    """Meta tensors like those in ``batch`` (nested mappings / lists / tuples) with ``rows`` in
    the first (batch) dimension; non-tensor leaves as they are."""
    if isinstance(batch, torch.Tensor):
        return torch.empty((rows, *batch.shape[1:]), dtype=batch.dtype, device="meta")
    if isinstance(batch, Mapping):
        return {k: meta_batch(v, rows) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(meta_batch(v, rows) for v in batch)
    return batch
