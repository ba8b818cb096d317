"""The one set of memory categories shared by the planner, the tracer, the profiler and reports.

Predicted and measured numbers line up column for column because every part of memfit speaks in
these categories (PyTorch's MemTracker has ``_MemRefType`` for the same reason).
"""

from __future__ import annotations

from enum import StrEnum


class MemoryCategory(StrEnum):
    """Where device memory goes during a step.

    Conventions:
    - Master fp32 weights kept by the optimizer under mixed precision count as ``OPTIMIZER_STATES``
      (as in the ZeRO paper's K = 12 bytes per parameter).
    - The batch fed to the model counts as ``ACTIVATIONS``.
    - ``RUNTIME`` is everything outside the tensors of the step: the CUDA context, library
      workspaces (cuBLAS, NCCL) and the caching allocator's reserve beyond live bytes.
    """

    WEIGHTS = "weights"
    GRADIENTS = "gradients"
    OPTIMIZER_STATES = "optimizer_states"
    ACTIVATIONS = "activations"
    KV_CACHE = "kv_cache"
    TEMPORARIES = "temporaries"
    RUNTIME = "runtime"


def empty_breakdown() -> dict[MemoryCategory, int]:
    """A breakdown with every category present and zero bytes."""
    return {category: 0 for category in MemoryCategory}
