"""FSDP2's CUDA streams in the per-rank trace of a CUDA target: each stream's own allocator pools.

Note: [FSDP2's streams] FSDP2 runs its collectives' copies on side streams of its own
(``torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py: FSDPCommContext.lazy_init``:
``all_gather_copy_in_stream``, ``all_gather_stream``, ``reduce_scatter_stream``,
``all_reduce_stream``) and allocates its communication buffers inside ``with
device_handle.stream(...)``:

- the all-gather's input and output (``_fsdp_collectives.py: foreach_all_gather``:
  ``all_gather_copy_in`` under ``all_gather_copy_in_stream``; the output is allocated there
  too, the collective itself then runs on ``all_gather_stream``). In forward and pre-backward
  without ``async_op`` these are the side streams (``FSDPCommContext.get_all_gather_streams``);
  otherwise the current stream;
- the reduce-scatter's output (``foreach_reduce``: ``with
  device_handle.stream(reduce_scatter_stream)``), of which the new sharded gradients are views
  ("the GPU sharded gradient is allocated in the RS stream"), and the post-reduce work; HSDP's
  all-reduce on ``all_reduce_stream``. The reduce-scatter's input is made on the current
  stream, before the side stream is entered.

CUDA's caching allocator keeps one pool per stream and never hands a block cached for one stream
to another (``c10/cuda/CUDACachingAllocator.cpp``: ``BlockComparatorSize`` orders by stream
first, and ``get_free_block`` searches from ``(stream, size)``), so these buffers reserve
segments of their own: the "inter-stream fragmentation" that FSDP2's own comments name
(``FSDPParamGroup.__init__``, ``_fsdp_param_group.py``). Allocated bytes do not change, only
how many are reserved. FSDP2 frees its buffers by dropping its references after waiting on
the stream's event (``AllGatherState``, ``ReduceScatterState``), not by ``record_stream``, so
a free returns the block to its stream's pool at once, in program order, which the trace keeps.

The trace applies FSDP2 over a CPU mesh, whose device handle is ``torch.cpu``: its ``Stream``
objects and ``stream(...)`` context are the device-agnostic stand-ins
(``torch/cpu/__init__.py: StreamContext``), run by the same FSDP2 code. While a CUDA target is
traced, :func:`fsdp_streams` makes ``torch.cpu.stream(s)`` also allocate on ``s``'s pool in the
allocator model (the default stream is stream 0; every other stream object gets a number of
its own from :data:`FIRST_STREAM`). ``torch.cpu.stream`` is patched for the trace only, and
restored.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

FIRST_STREAM = 16
"""The allocator model's number for the first side stream seen (memfit's own offload uses
1 and 2: ``techniques/offload.py``)."""


@contextlib.contextmanager
def fsdp_streams(tracker: Any) -> Iterator[None]:
    """Inside: ``torch.cpu.stream(s)`` allocates the traced CUDA target's new device storages on
    ``s``'s own pools (Note: [FSDP2's streams]); nothing when the target is not CUDA."""
    if not getattr(tracker, "host_split", False):
        yield
        return
    import torch.cpu as cpu

    original = cpu.stream
    default = cpu.current_stream()
    seen: list[Any] = []  # kept alive, so that an id() is never reused for another stream

    def number(stream: Any) -> int:
        if stream is default:
            return 0
        for i, s in enumerate(seen):
            if s is stream:
                return FIRST_STREAM + i
        seen.append(stream)
        return FIRST_STREAM + len(seen) - 1

    @contextlib.contextmanager
    def stream(s: Any) -> Iterator[None]:
        with original(s):
            if s is None:
                yield
                return
            with tracker.on_stream(number(s)):
                yield

    cpu.stream = stream  # type: ignore[assignment]
    try:
        yield
    finally:
        cpu.stream = original  # type: ignore[assignment]
