"""FSDP2's internals, patched for a per-rank trace on fake tensors.

FSDP2 frees and re-allocates its all-gather outputs through ``UntypedStorage.resize_`` (which no
dispatch mode sees), and splits every parameter into one chunk per rank, of which it reads two.
Each patch is a context manager that restores what it replaced on exit, and names the torch
source it mirrors and the version it was checked against. The private names are registered in
:data:`memfit._compat.torch_internals.PRIVATE_NAMES` and ``OPTIONAL_NAMES``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["fsdp_chunks_on_demand", "storage_resizes_reported"]


@contextlib.contextmanager
def storage_resizes_reported(on_resize: Callable[[torch.UntypedStorage, int], None]
                             ) -> Iterator[None]:
    """Inside the block, ``torch.UntypedStorage.resize_`` also calls ``on_resize(storage,
    size)`` after it resized; torch's own method again on exit.

    FSDP2 frees and re-allocates its all-gather outputs with ``UntypedStorage.resize_``
    (``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``: ``free_storage``,
    ``alloc_storage``), which no dispatch mode sees; PyTorch's own ``FSDPMemTracker`` patches
    the same method for the same reason (``torch/distributed/_tools/mem_tracker.py:
    MemTracker._track_resize``, torch 2.13.0)."""
    original = torch.UntypedStorage.resize_

    def resize_(st: torch.UntypedStorage, size: int) -> Any:
        out = original(st, size)
        on_resize(st, int(size))
        return out

    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original  # type: ignore[method-assign]


class _ChunksOnDemand:
    """``torch/distributed/fsdp/_fully_shard/_fsdp_common.py: _chunk_with_empty(tensor,
    num_chunks, dim)`` (``torch.chunk``, then ``chunks[0].new_empty(0)`` for each missing chunk)
    as a sequence whose chunks are made when first read: chunk ``i`` is ``tensor.narrow(dim,
    i * size, ...)`` with ``size = ceil(length / num_chunks)``, the view ``torch.chunk`` makes
    (``aten/src/ATen/native/TensorShape.cpp: chunk`` splits by that size)."""

    def __init__(self, tensor: torch.Tensor, num_chunks: int, dim: int) -> None:
        self._tensor, self._n, self._dim = tensor, num_chunks, dim
        self._length = tensor.size(dim)
        self._size = -(-self._length // num_chunks)
        self._count = -(-self._length // self._size)  # chunks torch.chunk returns
        self._made: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._n))]
        i = index + self._n if index < 0 else index
        if not 0 <= i < self._n:
            raise IndexError(index)
        made = self._made.get(i)
        if made is None:
            if i < self._count:
                start = i * self._size
                made = self._tensor.narrow(self._dim, start,
                                           min(self._size, self._length - start))
            else:
                made = self[0].new_empty(0)
            self._made[i] = made
        return made

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (self[i] for i in range(self._n))


@contextlib.contextmanager
def fsdp_chunks_on_demand() -> Iterator[None]:
    """Within the context, FSDP2 makes only the chunks of a parameter it reads.

    ``fully_shard`` splits each parameter into one chunk per rank and reads two of them
    (``torch/distributed/fsdp/_fully_shard/_fsdp_param.py: FSDPParam._init_sharded_param``:
    ``chunks[shard_rank]`` and ``chunks[0].size()``; ``_init_sharded_post_forward_param_
    metadata``: ``chunks[shard_mesh_rank]``), through ``_chunk_with_empty``. On fake tensors
    each of the 64 views of a 64-way split costs a fake tensor (about 1.5 CPU-s of a 70B
    per-rank trace over 64 ranks, torch 2.13.0); :class:`_ChunksOnDemand` makes the same
    views, those read. Patched on ``_fsdp_param`` (which imported the name), restored on exit;
    a no-op where torch lacks it.
    Anything but a positive count and a non-empty dimension goes to the original."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param
    except ImportError:
        yield
        return
    original = getattr(_fsdp_param, "_chunk_with_empty", None)
    if original is None:
        yield
        return

    def chunk_with_empty(tensor: Any, num_chunks: Any, dim: Any) -> Any:
        if (type(num_chunks) is not int or num_chunks < 1 or type(dim) is not int
                or not isinstance(tensor, torch.Tensor) or not 0 <= dim < tensor.dim()
                or tensor.size(dim) < 1):
            return original(tensor, num_chunks, dim)
        return _ChunksOnDemand(tensor, num_chunks, dim)

    _fsdp_param._chunk_with_empty = chunk_with_empty
    try:
        yield
    finally:
        _fsdp_param._chunk_with_empty = original
