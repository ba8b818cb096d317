"""What a plan may fill on its GPU, by target: a discrete GPU's memory, a unified-memory
device's memory less what the OS and the CPU side keep, or, on Apple silicon, the lesser of
that and the MPS allocator's hard limit. One budget for every verdict: the analytic plan, the
trace (its allocator's capacity, ``memfit plan --method trace``), ``memfit fit``, ``pack``
and ``serve-plan``'s startup check (:func:`budget_bytes`).

- Discrete (CUDA, ROCm): ``GpuSpec.usable_bytes`` (PyTorch's ``total_memory`` where measured).
- Unified memory, CUDA (Jetson): ``memory_bytes - host_reserve_bytes``. The GPU allocates from
  the same DRAM as the OS, the desktop and the CPU side of the program; the reserve is the
  catalog's documented default or ``memfit plan --host-reserve``.
- MPS (Apple silicon): ``min(ratio x recommendedMaxWorkingSetSize, memory_bytes -
  host_reserve)``. The first is PyTorch's hard limit, the "max allowed" of its OOM message
  (:mod:`memfit.runtime.mps`); the second is what the machine has without swapping. Without
  ``--host-reserve`` the reserve is what Metal's recommended working set leaves
  (``memory_bytes - recommendedMaxWorkingSetSize``): Apple's "how much memory ... this GPU
  device can allocate without affecting its runtime performance". With PyTorch's default
  ratio of 1.7 the limit is above that, so the recommended working set decides.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from memfit.errors import MemfitError
from memfit.gpus import GpuSpec
from memfit.runtime import (
    compute_capability_for,
    high_watermark_ratio,
    mps_max_allowed_bytes,
    target_runtime_bytes,
)
from memfit.units import format_bytes


@dataclass(frozen=True, kw_only=True)
class DeviceBudget:
    """The bytes a plan may fill on one GPU and how they were reached."""

    target: str
    """``cuda``, ``rocm`` or ``mps``."""
    total_bytes: int
    """The device's memory (``GpuSpec.memory_bytes``; ``usable_bytes`` when discrete)."""
    budget_bytes: int
    """What the plan's fit verdict compares against."""
    unified_memory: bool = False
    host_reserve_bytes: int | None = None
    """Unified memory: what the OS and the CPU side keep."""
    host_reserve_basis: str | None = None
    """Where the reserve comes from: ``catalog``, ``--host-reserve`` or ``recommended working
    set`` (Apple: what Metal's recommendation leaves)."""
    recommended_working_set_bytes: int | None = None
    high_watermark_ratio: float | None = None
    max_allowed_bytes: int | None = None
    """MPS: PyTorch's hard limit (None: no limit, ratio 0)."""

    def line(self) -> str | None:
        """One line saying how the budget was reached (None for a discrete GPU)."""
        if not self.unified_memory:
            return None
        reserve = self.host_reserve_bytes or 0
        left = (f"{format_bytes(self.total_bytes)} unified memory - "
                f"{format_bytes(reserve)} kept for the OS and CPU side ({self.host_reserve_basis})"
                f" = {format_bytes(self.total_bytes - reserve)}")
        if self.target != "mps":
            return f"unified memory: budget = {left}"
        assert self.recommended_working_set_bytes is not None
        limit = ("no limit (ratio 0)" if self.max_allowed_bytes is None else
                 f"{self.high_watermark_ratio:g} x recommendedMaxWorkingSetSize "
                 f"{format_bytes(self.recommended_working_set_bytes)} = "
                 f"{format_bytes(self.max_allowed_bytes)}")
        return (f"MPS: budget = {format_bytes(self.budget_bytes)}, the lesser of PyTorch's "
                f"max allowed ({limit}) and {left}")

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target, "total_bytes": self.total_bytes,
                "budget_bytes": self.budget_bytes, "unified_memory": self.unified_memory,
                "host_reserve_bytes": self.host_reserve_bytes,
                "host_reserve_basis": self.host_reserve_basis,
                "recommended_working_set_bytes": self.recommended_working_set_bytes,
                "high_watermark_ratio": self.high_watermark_ratio,
                "max_allowed_bytes": self.max_allowed_bytes}


def planned_on(gpu: GpuSpec, *, host_reserve_bytes: int | None = None,
               mps_high_watermark_ratio: str | float | None = None) -> GpuSpec:
    """``gpu`` with a plan's own host reserve (``--host-reserve``) and MPS high-watermark ratio
    (``PYTORCH_MPS_HIGH_WATERMARK_RATIO``); each refused where it cannot apply.

    >>> from memfit.gpus import get_gpu
    >>> planned_on(get_gpu("orin-nano-8gb"), host_reserve_bytes=2**30).host_reserve_bytes
    1073741824
    """
    if host_reserve_bytes is not None:
        if not gpu.unified_memory:
            raise MemfitError(f"--host-reserve applies to unified-memory devices (Jetson, Apple "
                              f"silicon); {gpu.label} has its own memory: drop --host-reserve")
        if not 0 <= host_reserve_bytes < gpu.memory_bytes:
            raise MemfitError(f"--host-reserve {format_bytes(host_reserve_bytes)} leaves nothing "
                              f"of {gpu.label}'s {format_bytes(gpu.memory_bytes)}; give less than "
                              "the device's memory")
        gpu = replace(gpu, host_reserve_bytes=host_reserve_bytes,
                      host_reserve_source="--host-reserve")
    if mps_high_watermark_ratio is not None:
        if gpu.target != "mps":
            raise MemfitError(f"--mps-high-watermark applies to Apple silicon (MPS); {gpu.label} "
                              "is not one: drop it")
        gpu = replace(gpu, mps_high_watermark_ratio=high_watermark_ratio(
            mps_high_watermark_ratio))
    return gpu


def device_budget(gpu: GpuSpec) -> DeviceBudget:
    """The bytes a plan may fill on ``gpu`` (see the module's docstring; :func:`planned_on`
    sets a plan's own host reserve and MPS ratio).

    >>> from memfit.gpus import get_gpu
    >>> b = device_budget(get_gpu("jetson-orin-nano-8gb"))
    >>> b.budget_bytes == 8 * 10**9 - 1536 * 2**20
    True
    """
    if not gpu.unified_memory:
        return DeviceBudget(target=gpu.target, total_bytes=gpu.usable_bytes,
                            budget_bytes=gpu.usable_bytes)
    total = gpu.memory_bytes
    recommended = gpu.recommended_working_set_bytes
    if gpu.target == "mps" and recommended is None:
        raise MemfitError(f"{gpu.label}: an MPS target needs recommended_working_set_bytes "
                          "(Metal's recommendedMaxWorkingSetSize: run python -c \"import torch; "
                          "print(torch.mps.recommended_max_memory())\" on the Mac) in the "
                          "--gpu-file entry")
    if gpu.host_reserve_bytes is not None:
        reserve, basis = gpu.host_reserve_bytes, gpu.host_reserve_source
    elif recommended is not None:
        reserve, basis = total - recommended, "what Metal's recommended working set leaves"
    else:
        raise MemfitError(f"{gpu.label} shares memory with the CPU but gives no "
                          "host_reserve_bytes: pass --host-reserve (e.g. 2GiB) for what the OS "
                          "and the CPU side keep")
    left = total - reserve
    if gpu.target != "mps":
        return DeviceBudget(target=gpu.target, total_bytes=total, budget_bytes=left,
                            unified_memory=True, host_reserve_bytes=reserve,
                            host_reserve_basis=basis)
    assert recommended is not None
    ratio = high_watermark_ratio(gpu.mps_high_watermark_ratio)
    allowed = mps_max_allowed_bytes(recommended, ratio)
    budget = left if allowed is None else min(left, allowed)
    return DeviceBudget(target="mps", total_bytes=total, budget_bytes=budget,
                        unified_memory=True, host_reserve_bytes=reserve,
                        host_reserve_basis=basis, recommended_working_set_bytes=recommended,
                        high_watermark_ratio=ratio, max_allowed_bytes=allowed)


def budget_bytes(gpu: GpuSpec | None) -> int | None:
    """:func:`device_budget`'s bytes for ``gpu``; None without a GPU (no limit).

    >>> from memfit.gpus import get_gpu
    >>> budget_bytes(get_gpu("m2-max-96gb")) == 72 * 2**30  # Metal's recommended working set
    True
    """
    return None if gpu is None else device_budget(gpu).budget_bytes


def device_runtime_bytes(gpu: GpuSpec | None, *, num_gpus: int = 1) -> dict[str, int]:
    """The runtime parts for ``gpu``'s target (:func:`memfit.runtime.target_runtime_bytes`);
    the architecture is the catalog's compute capability, else looked up by name (a ROCm
    GPU's gfx target, a user GPU)."""
    if gpu is None:
        return target_runtime_bytes("cuda", None, num_gpus=num_gpus)
    if gpu.target == "mps":
        return target_runtime_bytes("mps")
    arch = gpu.compute_capability or compute_capability_for(gpu.name)
    return target_runtime_bytes(gpu.target, arch, num_gpus=num_gpus)
