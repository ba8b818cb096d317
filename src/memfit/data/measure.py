"""Measure a DataLoader's host memory with psutil, to check
:func:`memfit.runtime.input_pipeline.input_pipeline_memory` against.

What is measured, and why each number:

- ``shared_bytes``: the growth of the kernel's shared memory (``Shmem`` in ``/proc/meminfo``,
  ``psutil.virtual_memory().shared``) from before the loader started to a quiet point after it
  handed out its first batch. A worker collates each batch into shared memory and sends a file
  descriptor; a finished batch waiting in the queue is mapped by no process, so no process's USS
  or PSS shows it, but ``Shmem`` does. It is machine-wide: another process making shared memory
  at the same time would be counted too (the tests retry once).
- ``main`` and ``workers``: psutil's ``memory_full_info()`` (USS: pages only that process maps;
  PSS: its share of the pages it shares) of this process and of each worker process, at the same
  quiet point.

The quiet point: after the first batch, the workers fill their ``prefetch_factor`` batches
each; the measurement waits until the workers' CPU time has not moved for ``settle_s`` seconds
(each then waits on its index queue), which no other process on the machine can disturb.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from memfit.errors import MemfitError

__all__ = ["LoaderMemory", "measure_loader_memory"]


def _psutil() -> Any:
    try:
        import psutil
    except ImportError as exc:  # optional: the monitor and test extras install it
        raise MemfitError("measuring a DataLoader's memory needs psutil: "
                          "pip install 'memfit[monitor]'") from exc
    return psutil


@dataclass(frozen=True, kw_only=True)
class LoaderMemory:
    """One measurement of a DataLoader at rest with its queue full (bytes)."""

    shared_bytes: int
    """Growth of the machine's shared memory (``Shmem``) since before the loader started."""
    main_uss: int
    main_pss: int
    worker_uss: tuple[int, ...]
    worker_pss: tuple[int, ...]
    batch_bytes: int
    """Bytes of the first batch's tensors."""


def measure_loader_memory(loader: Iterable[Any], *, settle_s: float = 0.4,
                          timeout_s: float = 10.0) -> LoaderMemory:
    """Start iterating ``loader``, take its first batch (held, as a step would), wait until its
    workers are done prefetching, and measure (see the module docstring)."""
    psutil = _psutil()
    from memfit.data.prefetch import batch_nbytes

    me = psutil.Process()
    before_children = {p.pid for p in me.children()}
    shm0 = psutil.virtual_memory().shared
    it = iter(loader)
    batch = next(it)
    workers = [p for p in me.children() if p.pid not in before_children]

    def busy() -> float:
        total = 0.0
        for w in workers:
            t = w.cpu_times()
            total += t.user + t.system
        return total

    last, still_since, start = busy(), time.monotonic(), time.monotonic()
    while time.monotonic() - start < timeout_s:
        time.sleep(0.05)
        now = busy()
        if now != last:
            last, still_since = now, time.monotonic()
        elif time.monotonic() - still_since >= settle_s:
            break
    main = me.memory_full_info()
    infos = [w.memory_full_info() for w in workers]
    result = LoaderMemory(
        shared_bytes=psutil.virtual_memory().shared - shm0, main_uss=main.uss, main_pss=main.pss,
        worker_uss=tuple(i.uss for i in infos), worker_pss=tuple(i.pss for i in infos),
        batch_bytes=batch_nbytes(batch))
    del batch, it  # shuts the workers down
    return result
