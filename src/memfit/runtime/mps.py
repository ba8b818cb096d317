"""PyTorch's MPS backend (Apple silicon): the allocator's hard limit and its heap sizes.

From source: ``aten/src/ATen/mps/MPSAllocator.h`` and ``MPSAllocator.mm`` (pytorch/pytorch,
read at commit 01f98b3e for the header). Nothing here was measured by memfit (no Mac in the
sessions that wrote it).

- The hard limit ("max allowed" in ``MPS backend out of memory (MPS allocated: ..., other
  allocations: ..., max allowed: ...)``) is ``m_max_total_allowed_size = ratio x
  max_device_size()`` (``setHighWatermarkRatio``), where ``max_device_size()`` is Metal's
  ``[MTLDevice recommendedMaxWorkingSetSize]`` and ``ratio`` is
  ``PYTORCH_MPS_HIGH_WATERMARK_RATIO`` (default :data:`DEFAULT_HIGH_WATERMARK_RATIO` 1.7,
  at most :data:`HIGH_WATERMARK_UPPER_BOUND` 2.0; 0 turns the limit off). The check
  (``alloc_buffer``: ``current_allocated_size() + size > m_max_total_allowed_size``) counts
  ``[MTLDevice currentAllocatedSize]``: every Metal allocation of the process, MPSGraph's own
  included, not only PyTorch's tensors.
- There is no CUDA context and no cuBLAS workspace: :func:`mps_runtime_bytes` is empty. The
  "other allocations" of the OOM message (MPSGraph's implicit buffers) are not modelled.
- Allocations round up: small (<= 1 MiB) come from 8 MiB heaps, 1-10 MiB from 32 MiB heaps,
  larger ones from 1 GiB heaps or a heap of the size rounded up to 2 MiB
  (:data:`HEAP_SIZES`, ``HeapBlock::createHeapBlock``).
"""

from __future__ import annotations

from memfit.errors import MemfitError

MiB = 1 << 20

DEFAULT_HIGH_WATERMARK_RATIO = 1.7
"""``MPSHeapAllocatorImpl::default_high_watermark_ratio`` (MPSAllocator.h)."""
HIGH_WATERMARK_UPPER_BOUND = 2.0
"""``default_high_watermark_upper_bound``: ``setHighWatermarkRatio`` refuses a larger ratio
("invalid high watermark ratio")."""
DEFAULT_LOW_WATERMARK_RATIO = 1.4
"""``default_low_watermark_ratio`` (unified memory): above it the allocator garbage-collects
cached buffers first; a soft limit, not an OOM."""
HIGH_WATERMARK_ENV = "PYTORCH_MPS_HIGH_WATERMARK_RATIO"

HEAP_SIZES = {"small_max": 1 * MiB, "small_heap": 8 * MiB, "large_min": 10 * MiB,
              "large_heap": 32 * MiB, "xlarge_heap": 1024 * MiB, "round_large": 2 * MiB}
"""MPSAllocator.h: ``kMaxSmallAlloc``, ``kSmallHeap``, ``kMinLargeAlloc``, ``kLargeHeap``,
``kXLargeHeap``, ``kRoundLarge``."""


def high_watermark_ratio(value: str | float | None = None) -> float:
    """The ``PYTORCH_MPS_HIGH_WATERMARK_RATIO`` in effect: ``value`` (the variable's text or a
    number), None: PyTorch's default 1.7. Refused as PyTorch refuses it: below 0 or above 2.

    >>> high_watermark_ratio(), high_watermark_ratio("1.0")
    (1.7, 1.0)
    """
    if value is None or value == "":
        return DEFAULT_HIGH_WATERMARK_RATIO
    try:
        ratio = float(value)
    except ValueError:
        raise MemfitError(f"{HIGH_WATERMARK_ENV} {value!r} is not a number; give a ratio "
                          f"between 0 (no limit) and {HIGH_WATERMARK_UPPER_BOUND}") from None
    if not 0.0 <= ratio <= HIGH_WATERMARK_UPPER_BOUND:
        raise MemfitError(f"{HIGH_WATERMARK_ENV} {ratio:g} is outside 0..2 (PyTorch refuses "
                          "it: 'invalid high watermark ratio'); give 0 (no limit) up to 2")
    return ratio


def mps_max_allowed_bytes(recommended_bytes: int, ratio: float | None = None) -> int | None:
    """PyTorch's hard limit on a Mac: ``int(ratio x recommendedMaxWorkingSetSize)``
    (``static_cast<size_t>(ratio * (double)max_device_size())``); None when ``ratio`` is 0 (no
    limit: the allocator runs until macOS swaps or kills the process).

    >>> mps_max_allowed_bytes(72 * 2**30) == int(1.7 * 72 * 2**30)
    True
    """
    ratio = high_watermark_ratio(ratio)
    if ratio == 0.0:
        return None
    return int(ratio * float(recommended_bytes))


def mps_runtime_bytes() -> dict[str, int]:
    """Runtime bytes outside the model's tensors on MPS: none modelled (no CUDA context, no
    cuBLAS/cuBLASLt workspace; MPSGraph's implicit buffers are not modelled)."""
    return {}
