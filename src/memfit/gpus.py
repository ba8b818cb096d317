"""The GPU catalog: capacity, bandwidth, FLOPS, links and price, loaded from a data file.

The catalog ships as ``memfit/data/gpus.json`` (data, not code). Users add or override entries with
their own JSON file (``--gpu-file`` or ``$MEMFIT_GPU_FILE``) in the same format.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class Link:
    """A host or GPU-to-GPU interconnect."""

    kind: str
    """e.g. "PCIe 5.0 x16", "NVLink 4"."""
    gbps: float
    """Bandwidth in GB/s (1e9 bytes/s) per direction."""


@dataclass(frozen=True, kw_only=True)
class GpuSpec:
    """One GPU model.

    Known limitations: FLOPS are dense peak datasheet figures (no sparsity); real matmuls reach
    60-80% of them. Prices are typical on-demand cloud prices at the stated date.
    """

    name: str
    """Canonical catalog key, e.g. ``h100-sxm-80gb``."""
    label: str
    """Marketing name, e.g. ``NVIDIA H100 SXM5 80GB``."""
    vendor: str
    memory_label: str
    """Marketing capacity, e.g. ``80 GB HBM3``."""
    memory_bytes: int
    """Total device memory as the driver reports it (nvidia-smi's MiB x 2**20) where known."""
    usable_bytes: int
    """What a framework can allocate from: ``torch.cuda.get_device_properties().total_memory``
    where known, else ``memory_bytes``. ``fits`` compares against this."""
    bandwidth_gbps: float
    """Memory bandwidth in GB/s."""
    tflops: dict[str, float | None]
    """Dense peak TFLOPS by format: keys fp32, tf32, fp16, bf16, fp8 (None: unsupported)."""
    bf16: bool
    fp8: bool
    compute_capability: str | None
    host_link: Link
    gpu_link: Link | None
    price_per_hour: float | None
    price_source: str | None
    price_date: str | None
    sources: tuple[str, ...] = ()
    aliases: tuple[str, ...] = field(default=())
