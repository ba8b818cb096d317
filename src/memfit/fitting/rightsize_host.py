"""Host memory in :func:`memfit.fitting.rightsize.rightsize_training`: each GPU's share of its
machine's RAM, which the offloaded states of a configuration (the plan's ``host_bytes``:
ZeRO-Offload's fp32 masters, optimizer states and gradients; ZeRO-Infinity's parameters) must
fit in, less :data:`HOST_MEMORY_MARGIN`.

Where the share comes from, first that applies:

- ``host_memory`` (``memfit rightsize --host-memory``): the RAM of one node, as ``memfit plan
  --host-memory`` means it; a job of ``count`` GPUs puts ``min(count, gpus_per_node)`` on a
  node (as the plan's host check does), so each GPU's share is ``host_memory / min(count,
  gpus_per_node)``;
- the catalog's ``host_memory_per_gpu_bytes`` (a named cloud machine's RAM over its GPUs, its
  source in ``host_memory_source``); a job's node is that machine or the same family's smaller
  size, which clouds give the same RAM per GPU (GCP's a2 and a3 sizes, AWS g4dn / g5
  ``.12xlarge`` against ``.48xlarge``);
- else :data:`DEFAULT_HOST_MEMORY_RATIO` x the GPU's memory: conservative, the 8-GPU training
  machines the catalog cites have 3-4x (p4d, p5, g6e), only the smallest one-GPU sizes less
  (AWS g5.xlarge: 16 GiB for a 24 GB A10G).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT_HOST_MEMORY_RATIO", "HOST_MEMORY_MARGIN", "HostLimit", "host_limit",
           "rejection"]

HOST_MEMORY_MARGIN = 0.10
"""The share of host RAM kept free for the OS, the training processes themselves, the
DataLoader's workers and pinned batches, and the page cache (an assumption: ``memfit plan
--dataloader`` sizes the input pipeline)."""

DEFAULT_HOST_MEMORY_RATIO = 1.0
"""Host RAM per GPU, as a multiple of the GPU's memory, for a GPU whose catalog entry names no
machine."""


@dataclass(frozen=True, kw_only=True)
class HostLimit:
    """The host memory one GPU of a ``count``-GPU job may fill with offloaded states."""

    ram_bytes: int
    """The GPU's share of the node's RAM."""
    limit_bytes: int
    """``ram_bytes`` less :data:`HOST_MEMORY_MARGIN`: the most ``host_bytes`` a plan may need."""
    source: str


def host_limit(gpu: Any, count: int, *, host_memory: int | None,
               gpus_per_node: int) -> HostLimit:
    """Each GPU's share of host RAM for ``count`` x ``gpu``, and the limit on offloaded
    states (the module docstring says where the share comes from).

    >>> from memfit.gpus import get_gpu
    >>> host_limit(get_gpu("h100-sxm-80gb"), 8, host_memory=None,
    ...            gpus_per_node=8).ram_bytes // 2**30
    256
    """
    if host_memory is not None:
        on_node = min(count, gpus_per_node)
        ram = host_memory // on_node
        source = f"--host-memory over {on_node} GPU{'s' if on_node > 1 else ''} a node"
    elif gpu.host_memory_per_gpu_bytes is not None:
        ram = gpu.host_memory_per_gpu_bytes
        source = gpu.host_memory_source or "the GPU catalog"
    else:
        ram = int(DEFAULT_HOST_MEMORY_RATIO * gpu.memory_bytes)
        source = (f"default: {DEFAULT_HOST_MEMORY_RATIO:g} x the GPU's memory (the catalog "
                  "names no machine)")
    return HostLimit(ram_bytes=ram, limit_bytes=int(ram * (1 - HOST_MEMORY_MARGIN)),
                     source=source)


def rejection(gpu: str, count: int, limit: HostLimit, needs: list[tuple[int, str]],
              dropped: bool) -> dict[str, Any]:
    """One GPU x count's entry in ``host_rejected``: the configurations that fit the GPU but
    not ``limit`` (``needs``: each one's host bytes per GPU and label), whether the row went."""
    from memfit.units import format_bytes

    least = min(b for b, _ in needs)
    return {"gpu": gpu, "count": count, "configurations": len(needs),
            "least_host_bytes_per_gpu": least, "limit_bytes_per_gpu": limit.limit_bytes,
            "row_dropped": dropped,
            "reason": f"offloaded states need {format_bytes(least)} of host memory a GPU or "
                      f"more, over {format_bytes(limit.limit_bytes)} "
                      f"({format_bytes(limit.ram_bytes)} a GPU less {HOST_MEMORY_MARGIN:.0%}; "
                      f"{limit.source})"}
