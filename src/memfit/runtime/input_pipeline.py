"""Host and device memory of the input pipeline: a DataLoader's workers, prefetch and pinned
buffers, and :class:`memfit.data.DevicePrefetcher`'s batches on the GPU. Torch-free: the planner
and the CLI answer from it without importing torch.

>>> m = input_pipeline_memory(DataLoaderSpec(num_workers=8, prefetch_factor=4, pin_memory=True,
...                                          batch_bytes=64 << 20, depth=1, gpus_per_node=8))
>>> m.device_bytes == 64 << 20, m.in_flight_batches
(True, 32)

Where each number comes from (torch 2.13, ``torch/utils/data/dataloader.py`` and
``torch/utils/data/_utils/pin_memory.py``):

- **Batches in flight.** ``_MultiProcessingDataLoaderIter._reset`` primes the loop with
  ``for _ in range(self._prefetch_factor * self._num_workers): self._try_put_index()``
  (dataloader.py lines 1274-1276), and ``_next_data`` puts one new index for each batch it hands
  out (``_process_data`` -> ``_try_put_index``), so ``num_workers x prefetch_factor`` batches are
  always requested ahead of the one the step holds. A worker collates each batch straight into
  shared memory (``default_collate`` in a worker process allocates its output with
  ``_new_shared``) and sends a file descriptor (sharing strategy ``file_descriptor``), so a
  finished batch waiting in the queue lives in ``/dev/shm`` (the kernel's ``Shmem``), mapped by
  no process until the main process unpickles it: it is in no process's USS or PSS.
  ``prefetch_factor`` defaults to 2 with workers and must be None without (dataloader.py lines
  287-295).
- **The batch in use.** The step holds one batch (in shared memory when it came from a worker).
- **Pinned buffers.** With ``pin_memory=True`` a thread of the main process
  (``_pin_memory_loop``) takes every finished batch off the workers' queue as soon as it arrives,
  copies it into pinned memory (``pin_memory(data)``; the shared-memory copy is freed once the
  pinned copy exists) and puts it on an unbounded ``queue.Queue``: the ``num_workers x
  prefetch_factor`` batches in flight and the one in use are pinned, and one more batch is in
  shared memory while the thread pins it. PyTorch's pinned allocator rounds each tensor up to a
  power of two (``c10::llvm::PowerOf2Ceil(size)`` in ``ATen/core/CachingHostAllocator.h``,
  line 305 of the header shipped with torch 2.13) and caches freed blocks.
- **Workers' own memory.** Each worker's private memory (USS) at rest, :data:`DEFAULT_WORKER_RSS`
  unless measured, plus :data:`WORKER_BATCHES` batches: the samples of the batch it is collating,
  and the heap that the C allocator keeps after they are freed (measured, not derived).
- **Device.** :class:`memfit.data.DevicePrefetcher` holds ``depth`` batches on the GPU ahead of
  the one the step uses (that one is the step's input, counted with it); each tensor a block of
  the caching allocator, rounded up to 512 bytes.

Known limitations: the workers' at-rest memory depends on the dataset (copy-on-write of Python
objects touched in a forked worker, pytorch/pytorch#13246) and the start method (``spawn``
re-imports torch in each worker): measure it for your dataset (``worker_rss=``). Pinned blocks
cached by the allocator stay pinned after the loader stops.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from memfit.errors import MemfitError, suggest
from memfit.units import format_bytes, parse_bytes

__all__ = ["DEFAULT_WORKER_RSS", "WORKER_BATCHES", "DataLoaderSpec", "InputPipelineMemory",
           "fitting_settings", "input_pipeline_memory", "parse_dataloader", "tokens_sample_bytes"]

DEFAULT_WORKER_RSS = 10 << 20
"""Private memory (USS) of one idle DataLoader worker, 10 MiB: measured with psutil's
``memory_full_info().uss`` on forked workers of a synthetic dataset with tiny batches (torch
2.13 CPU, Linux; tests/data/test_input_pipeline.py measures it again and bench/input_pipeline.py
prints it). A forked worker shares the parent's pages until it writes them; a ``spawn`` worker
or a dataset of many Python objects costs far more: measure it (``worker_rss=``)."""

WORKER_BATCHES = 2
"""A worker's private memory above its at-rest USS, in batches: the samples it collates (one
batch), and what glibc's heap keeps of the previous batch's once freed (its mmap threshold rises
after the first large free, so later samples come from the heap, which is not returned).
Measured 1.9-2.4 batches on forked workers (bench/input_pipeline.py, batches of 8 MiB);
rounded up, so a host-memory check errs on the safe side."""

CUDA_BLOCK_ROUND = 512
"""The CUDA caching allocator rounds each request up to a multiple of 512 bytes
(``kMinBlockSize`` in ``c10/cuda/CUDACachingAllocator.cpp``)."""


def _pow2(n: int) -> int:
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def _round512(n: int) -> int:
    return -(-n // CUDA_BLOCK_ROUND) * CUDA_BLOCK_ROUND


@dataclass(frozen=True, kw_only=True)
class DataLoaderSpec:
    """The input pipeline of one training process (one per GPU)."""

    num_workers: int = 0
    """DataLoader worker processes; each holds its batches in flight and its own memory."""
    prefetch_factor: int | None = None
    """Batches requested ahead per worker (torch's default 2 with workers; None without)."""
    pin_memory: bool = False
    """Pin every batch in flight (page-locked host memory, rounded up to powers of two)."""
    batch_bytes: int = 0
    """Bytes of one batch's tensors (``memfit.data.batch_nbytes`` of a sample batch)."""
    tensor_bytes: tuple[int, ...] = ()
    """The bytes of each tensor of a batch, when known (pinned and device blocks are rounded per
    tensor); empty: the batch is rounded as one tensor."""
    worker_rss: int = DEFAULT_WORKER_RSS
    """Private memory of one idle worker (:data:`DEFAULT_WORKER_RSS`, or measured)."""
    depth: int = 0
    """Batches :class:`memfit.data.DevicePrefetcher` copies ahead onto the GPU (0: none)."""
    gpus_per_node: int = 1
    """Training processes (one DataLoader each) per node."""

    def __post_init__(self) -> None:
        for name in ("num_workers", "batch_bytes", "worker_rss", "depth"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise MemfitError(f"dataloader {name} must be an integer >= 0, not {value!r}")
        if self.gpus_per_node < 1:
            raise MemfitError(f"dataloader gpus_per_node must be >= 1, not {self.gpus_per_node}")
        if self.num_workers == 0 and self.prefetch_factor is not None:
            raise MemfitError(
                "dataloader prefetch_factor needs worker processes (torch refuses it with "
                "num_workers=0): give workers=N or drop prefetch")
        if self.prefetch_factor is not None and (
                isinstance(self.prefetch_factor, bool) or not isinstance(self.prefetch_factor, int)
                or self.prefetch_factor < 1):
            raise MemfitError(f"dataloader prefetch_factor must be an integer >= 1, not "
                              f"{self.prefetch_factor!r}")
        if any(b < 0 for b in self.tensor_bytes):
            raise MemfitError("dataloader tensor_bytes must be >= 0 each")
        if self.tensor_bytes and sum(self.tensor_bytes) != self.batch_bytes:
            object.__setattr__(self, "batch_bytes", sum(self.tensor_bytes))

    @property
    def prefetch(self) -> int:
        """The prefetch factor in effect: torch's default 2 with workers, 0 without."""
        if self.num_workers == 0:
            return 0
        return 2 if self.prefetch_factor is None else self.prefetch_factor

    def to_dict(self) -> dict[str, Any]:
        return {"num_workers": self.num_workers, "prefetch_factor": self.prefetch or None,
                "pin_memory": self.pin_memory, "batch_bytes": self.batch_bytes,
                "worker_rss_bytes": self.worker_rss, "depth": self.depth,
                "gpus_per_node": self.gpus_per_node}


@dataclass(frozen=True, kw_only=True)
class InputPipelineMemory:
    """The input pipeline's memory: host bytes per process (one per GPU) by part, per node, and
    device bytes per GPU."""

    spec: DataLoaderSpec
    in_flight_batches: int
    """Batches requested ahead of the step (``num_workers x prefetch_factor``)."""
    shared_bytes: int
    """Batches in shared memory (``/dev/shm``): in flight and in use without pinning; the one
    being pinned with it."""
    pinned_bytes: int
    """Pinned batches (in flight and in use), each tensor rounded up to a power of two."""
    private_bytes: int
    """Private memory of the process building batches: the main process's batch and its
    samples without workers; 0 with workers (they build them)."""
    worker_bytes: int
    """The workers' own memory: each its at-rest memory and :data:`WORKER_BATCHES` batches."""
    device_bytes: int
    """On each GPU: the DevicePrefetcher's ``depth`` batches (512-byte blocks)."""
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def host_bytes(self) -> int:
        """Host memory of one process's pipeline (per GPU)."""
        return self.shared_bytes + self.pinned_bytes + self.private_bytes + self.worker_bytes

    @property
    def host_node_bytes(self) -> int:
        """Host memory of the pipelines of a node's GPUs."""
        return self.host_bytes * self.spec.gpus_per_node

    def describe(self) -> str:
        """One line for a report."""
        s = self.spec
        how = (f"{s.num_workers} workers x prefetch {s.prefetch}" if s.num_workers
               else "no workers") + (", pinned" if s.pin_memory else "")
        node = (f", {format_bytes(self.host_node_bytes)} per node of {s.gpus_per_node} GPUs"
                if s.gpus_per_node > 1 else "")
        dev = (f"; {format_bytes(self.device_bytes)} per GPU for DevicePrefetcher depth "
               f"{s.depth}" if s.depth else "")
        return (f"input pipeline ({how}, batch {format_bytes(s.batch_bytes)}): host "
                f"{format_bytes(self.host_bytes)} per GPU{node}{dev}")

    def to_dict(self) -> dict[str, Any]:
        return {"spec": self.spec.to_dict(), "in_flight_batches": self.in_flight_batches,
                "host_bytes_per_gpu": self.host_bytes, "host_bytes_per_node": self.host_node_bytes,
                "device_bytes_per_gpu": self.device_bytes, "shared_bytes": self.shared_bytes,
                "pinned_bytes": self.pinned_bytes, "private_bytes": self.private_bytes,
                "worker_bytes": self.worker_bytes}


def input_pipeline_memory(spec: DataLoaderSpec, *, device: str = "cuda") -> InputPipelineMemory:
    """The memory of ``spec``'s pipeline (see the module docstring for each count's source);
    ``device``: the GPU's blocks are rounded up to 512 bytes; on ``"cpu"`` (the prefetcher passes
    batches through) the device bytes are the tensors' own.

    >>> m = input_pipeline_memory(DataLoaderSpec(num_workers=2, prefetch_factor=2,
    ...                                          batch_bytes=1000, worker_rss=0))
    >>> m.shared_bytes, m.worker_bytes  # (2 x 2 in flight + 1 in use) batches; 2 batches each
    (5000, 4000)
    """
    batch = spec.batch_bytes
    tensors = spec.tensor_bytes or (batch,)
    pinned_batch = sum(_pow2(t) for t in tensors)
    device_batch = sum(_round512(t) if device != "cpu" else t for t in tensors)
    in_flight = spec.num_workers * spec.prefetch
    shared = pinned = private = 0
    if spec.num_workers == 0:
        # the main process builds each batch while the step's batch is alive: the samples and
        # the collated batch (then, pinned, its pinned copy; the step's batch is pinned too)
        private = 2 * batch + (0 if spec.pin_memory else batch)
        pinned = 2 * pinned_batch if spec.pin_memory else 0
    elif spec.pin_memory:
        pinned = (in_flight + 1) * pinned_batch
        shared = batch  # the batch the pin thread is copying
    else:
        shared = (in_flight + 1) * batch
    workers = spec.num_workers * (spec.worker_rss + WORKER_BATCHES * batch)
    return InputPipelineMemory(
        spec=spec, in_flight_batches=in_flight, shared_bytes=shared, pinned_bytes=pinned,
        private_bytes=private, worker_bytes=workers, device_bytes=spec.depth * device_batch)


def fitting_settings(spec: DataLoaderSpec, budget_bytes: int) -> DataLoaderSpec | None:
    """The setting nearest ``spec`` whose node-wide host memory is at most ``budget_bytes``: the
    most batches in flight (workers x prefetch), then the most workers; pinning kept. None when
    even no workers do not fit.

    >>> s = DataLoaderSpec(num_workers=8, prefetch_factor=4, batch_bytes=1 << 30, worker_rss=0)
    >>> fitting_settings(s, 20 << 30).num_workers, fitting_settings(s, 20 << 30).prefetch
    (3, 4)
    """
    best: tuple[int, int, DataLoaderSpec] | None = None
    for workers in range(spec.num_workers, -1, -1):
        for prefetch in range(spec.prefetch, 0, -1) if workers else (None,):
            candidate = replace(spec, num_workers=workers,
                                prefetch_factor=prefetch if workers else None)
            if input_pipeline_memory(candidate).host_node_bytes <= budget_bytes:
                key = (workers * (prefetch or 0), workers)
                if best is None or key > best[:2]:
                    best = (*key, candidate)
                break
    return None if best is None else best[2]


# `key=value` list of the CLI's --dataloader: key -> (DataLoaderSpec field, parser)
_KEYS = ("workers", "prefetch", "pin", "batch-bytes", "sample-bytes", "worker-rss", "depth")


def _int(key: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise MemfitError(f"--dataloader {key}={text!r}: must be an integer >= 0")
    return value


def parse_dataloader(text: str, *, batch: int = 1, default_sample_bytes: int | None = None,
                     gpus_per_node: int = 1) -> DataLoaderSpec:
    """Parse the CLI's ``workers=8,prefetch=4,pin=1,sample-bytes=64KiB,depth=1``.

    ``sample-bytes`` times ``batch`` (the micro-batch) is the batch's bytes, or give
    ``batch-bytes``; without either, ``default_sample_bytes`` (the planner's for the model).

    >>> parse_dataloader("workers=4,pin=1,sample-bytes=1KiB", batch=8).batch_bytes
    8192
    """
    values: dict[str, str] = {}
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        key, eq, value = item.partition("=")
        key = key.strip().lower().replace("_", "-")
        if not eq or not value.strip():
            raise MemfitError(f"--dataloader {item!r}: write key=value, keys "
                              f"{', '.join(_KEYS)}")
        if key not in _KEYS:
            raise MemfitError(f"--dataloader: unknown key {key!r}{suggest(key, _KEYS)}; keys: "
                              f"{', '.join(_KEYS)}")
        if key in values:
            raise MemfitError(f"--dataloader: {key} given twice")
        values[key] = value.strip()
    if "batch-bytes" in values and "sample-bytes" in values:
        raise MemfitError("--dataloader: give sample-bytes or batch-bytes, not both")
    if "batch-bytes" in values:
        batch_bytes = parse_bytes(values["batch-bytes"], what="--dataloader batch-bytes")
    elif "sample-bytes" in values:
        batch_bytes = batch * parse_bytes(values["sample-bytes"], what="--dataloader sample-bytes")
    elif default_sample_bytes is not None:
        batch_bytes = batch * default_sample_bytes
    else:
        raise MemfitError("--dataloader: give sample-bytes=N (bytes of one sample's tensors) or "
                          "batch-bytes=N")
    pin = values.get("pin", "0").lower()
    if pin not in ("0", "1", "true", "false", "yes", "no"):
        raise MemfitError(f"--dataloader pin={pin!r}: write pin=1 or pin=0")
    prefetch = values.get("prefetch")
    return DataLoaderSpec(
        num_workers=_int("workers", values.get("workers", "0")),
        prefetch_factor=None if prefetch is None else _int("prefetch", prefetch),
        pin_memory=pin in ("1", "true", "yes"), batch_bytes=batch_bytes,
        worker_rss=(0 if values.get("worker-rss") == "0" else
                    parse_bytes(values["worker-rss"], what="--dataloader worker-rss")
                    if "worker-rss" in values else DEFAULT_WORKER_RSS),
        depth=_int("depth", values.get("depth", "0")), gpus_per_node=gpus_per_node)


def tokens_sample_bytes(seq: int) -> int:
    """A language model's sample: input ids and labels, int64 each (8 bytes a token)."""
    return 2 * 8 * seq

