"""Copy the next batches to the GPU while the current step runs: :class:`DevicePrefetcher`.

>>> loader = torch.utils.data.DataLoader(dataset, batch_size=32, num_workers=4, pin_memory=True)
>>> for batch in DevicePrefetcher(loader, "cuda", depth=1):
...     loss = step(batch)          # batch is on the GPU; the next one is already being copied

How a batch reaches the GPU (CUDA):

1. Its tensors are in pinned (page-locked) host memory: the DataLoader's ``pin_memory=True``
   thread pinned them, or the prefetcher pins them (``Tensor.pin_memory()``, one more host copy).
   Only a copy from pinned memory can run asynchronously to the host ("Use pinned memory
   buffers", CUDA semantics notes of the PyTorch docs).
2. On a side stream (``torch.cuda.Stream``), each tensor is copied with
   ``.to(device, non_blocking=True)``: the copy overlaps the step running on the current stream.
   The pinned source may be dropped at once: PyTorch's pinned-memory allocator records an event
   on the copy's stream and reuses the block only after it (``CachingHostAllocator``).
3. When the batch is handed out, the current stream waits for the event recorded after its copy
   on the side stream (``Stream.wait_event``; ``wait_stream`` would also wait for the next
   batch's copy, queued behind it), so the step never reads a half-copied batch, and each
   tensor gets ``Tensor.record_stream(current_stream)``: its block was allocated on the side
   stream, and without it the caching allocator could hand the block to the side stream's next
   copy while the step still reads it (the ``record_stream`` documentation).

The device memory this costs: ``depth`` batches ahead of the one the step uses, each on the
device while the step runs (``memfit.estimate(..., dataloader=...)`` counts them; so do
``memfit plan --dataloader depth=N`` and the batch-size finder's ``prefetch_batches=``).

On a device that is not CUDA (the CPU), batches pass through unchanged, but ``depth`` of them are
still taken from the loader ahead of the step, so the memory held is the same shape as on the GPU
(tests/data/test_prefetch.py measures ``depth`` × the batch bytes with the profiler's allocator
events).

Known limitations: only tensors are moved (any nesting of dicts, lists and tuples, through
``torch.utils._pytree``); other leaves pass through. One side stream per prefetcher; the batch
being copied when the loop stops early is dropped with the iterator.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree

from memfit.errors import MemfitError

__all__ = ["DevicePrefetcher", "batch_nbytes"]


def batch_nbytes(batch: Any) -> int:
    """Bytes of the tensors in ``batch`` (any nesting of dicts, lists and tuples), each storage
    counted once.

    >>> batch_nbytes({"x": torch.zeros(4, 8), "y": (torch.zeros(4, dtype=torch.long),)})
    160
    """
    seen: dict[int, int] = {}
    for leaf in pytree.tree_leaves(batch):
        if isinstance(leaf, torch.Tensor):
            storage = leaf.untyped_storage()
            seen[storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(seen.values())


class DevicePrefetcher:
    """Iterate ``loader`` with its batches on ``device``, ``depth`` batches copied ahead on a side
    CUDA stream (see the module docstring for the stream semantics).

    ``pin_memory``: pin host tensors that are not pinned yet before the copy (default True; a
    DataLoader with ``pin_memory=True`` already pins them in its own thread). ``depth=0`` copies
    each batch when it is asked for, on the current stream (no overlap, no extra memory).

    Known limitations: see the module docstring.
    """

    def __init__(self, loader: Iterable[Any], device: str | torch.device, depth: int = 1, *,
                 pin_memory: bool = True) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise MemfitError(f"DevicePrefetcher depth must be an int >= 0 (batches copied "
                              f"ahead), not {depth!r}")
        self.loader = loader
        self.device = torch.device(device)
        self.depth = depth
        self.pin_memory = pin_memory
        self._cuda = self.device.type == "cuda"
        self._stream: Any = None
        if self._cuda:
            if not torch.cuda.is_available():
                raise MemfitError(f"DevicePrefetcher: device {self.device} asked for but CUDA is "
                                  "not available; pass device='cpu' to pass batches through")
            self._stream = torch.cuda.Stream(device=self.device)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def _copy(self, batch: Any) -> Any:
        """Start copying ``batch`` to the device on the side stream (CUDA) or pass it (CPU)."""
        if not self._cuda:
            return batch

        def move(t: torch.Tensor) -> torch.Tensor:
            if self.pin_memory and t.device.type == "cpu" and not t.is_pinned():
                t = t.pin_memory()
            return t.to(self.device, non_blocking=True)

        if self.depth == 0:
            return pytree.tree_map_only(torch.Tensor, move, batch)
        with torch.cuda.stream(self._stream):
            moved = pytree.tree_map_only(torch.Tensor, move, batch)
            done = torch.cuda.Event()
            done.record(self._stream)
        return moved, done

    def _ready(self, copied: Any) -> Any:
        """Make the current stream wait for the batch's copy and tie its blocks to that stream."""
        if not self._cuda or self.depth == 0:
            return copied
        batch, done = copied
        current = torch.cuda.current_stream(self.device)
        # The event of this batch's copy, not wait_stream: the side stream may already hold the
        # next batch's copy, which the step need not wait for.
        current.wait_event(done)
        for leaf in pytree.tree_leaves(batch):
            if isinstance(leaf, torch.Tensor) and leaf.device.type == "cuda":
                leaf.record_stream(current)
        return batch

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.loader)
        ahead: deque[Any] = deque()
        if self.depth == 0:
            for batch in it:
                yield self._copy(batch)
            return
        for batch in it:  # fill the queue: depth batches ahead
            ahead.append(self._copy(batch))
            if len(ahead) == self.depth:
                break
        while ahead:
            batch = ahead.popleft()
            # Start the next copy before handing this batch out, so it overlaps the step.
            nxt = next(it, _END)
            if nxt is not _END:
                ahead.append(self._copy(nxt))
            yield self._ready(batch)


_END = object()
