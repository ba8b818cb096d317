"""Walking nested containers for the tensors inside (one helper for every part of memfit)."""

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
