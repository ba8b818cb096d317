"""PyTorch on AMD GPUs (ROCm, HIP): the constants that differ from CUDA's, each with its source.

PyTorch builds its ROCm backend by hipifying the CUDA sources: ``c10/hip/HIPCachingAllocator.cpp``
is generated from ``c10/cuda/CUDACachingAllocator.cpp`` (``torch/utils/hipify``), so the caching
allocator's rounding (512 B), its 2 MiB small and 20 MiB large segments and its cache behave as
on CUDA (:mod:`memfit.trace.allocator` models both). The differences:

- The BLAS workspaces (``aten/src/ATen/cuda/CublasHandlePool.cpp`` under ``USE_ROCM``):
  hipBLAS (``parseChosenWorkspaceSize``) 32 MiB, 128 MiB on gfx94x/gfx95x (MI300, MI350); and a
  separate hipBLASLt workspace (``parseCUDABlasLtWorkspaceSize``: ``size_t workspace_size =
  76*1024; /* Use 76 MB for hipBLASLt */`` KiB, or ``HIPBLASLT_WORKSPACE_SIZE``), which CUDA
  builds from torch 2.11 no longer keep. Both are allocated through the caching allocator.
- The HIP runtime's own context: no published PyTorch measurement was found; the CUDA figure
  (:func:`memfit.runtime.cuda_context_bytes`) is used and said to be assumed.
- ``torch.cuda.memory_stats()`` on ROCm: the same keys, but memory that HIP's runtime and the
  ROCm libraries take themselves (code objects, rocBLAS/hipBLASLt/MIOpen handles, the
  scratch/private-segment memory a kernel gets at launch) is outside it and shows only in
  ``rocm-smi``/``amd-smi`` or ``torch.cuda.mem_get_info``; compare ``rocm-smi`` against
  reserved + the runtime part, as for ``nvidia-smi``.
"""

from __future__ import annotations

MiB = 1 << 20

HIPBLAS_WORKSPACE_BYTES = 32 * MiB
"""Default hipBLAS workspace per (handle, stream) on ROCm GPUs other than gfx94x/gfx95x."""
HIPBLAS_WORKSPACE_GFX94_95_BYTES = 128 * MiB
"""On gfx94x/gfx95x (MI300X, MI325X, MI350X, MI355X)."""
HIPBLASLT_WORKSPACE_BYTES = 76 * MiB
"""``parseCUDABlasLtWorkspaceSize`` under ``USE_ROCM``: 76 * 1024 KiB."""
HIPBLASLT_WORKSPACE_ENV = "HIPBLASLT_WORKSPACE_SIZE"


def hipblas_workspace_bytes(gfx_target: str) -> int:
    """hipBLAS workspace per (handle, stream) for a gfx target such as ``gfx942``.

    >>> hipblas_workspace_bytes("gfx942") >> 20, hipblas_workspace_bytes("gfx90a") >> 20
    (128, 32)
    """
    return (HIPBLAS_WORKSPACE_GFX94_95_BYTES if gfx_target[:5] in ("gfx94", "gfx95")
            else HIPBLAS_WORKSPACE_BYTES)
