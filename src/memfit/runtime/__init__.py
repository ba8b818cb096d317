"""Device memory outside the model's tensors: CUDA context, cuBLAS workspaces, NCCL buffers.

Nothing here was measured in this project yet (no GPU in the sessions that wrote it): every
number is read from PyTorch's / NCCL's source (marked "from source"), taken from a published
measurement (the CUDA context: :data:`CONTEXT_MEASUREMENTS`, each with its URL and quoted line),
or an assumption (marked "assumed"), and each says which. Two kinds of bytes must not be mixed
up:

- Outside PyTorch's caching allocator (``cuda_context``, ``nccl``): the driver and libraries
  allocate them themselves. ``torch.cuda.memory_reserved()`` does not count them, ``nvidia-smi``
  does, and they reduce what the allocator can get before it runs out of memory.
- Inside PyTorch's caching allocator (:data:`ALLOCATOR_PARTS`: ``cublas_workspace``,
  ``cublaslt_workspace``): PyTorch allocates these workspaces through its own allocator
  (``getNewWorkspace`` in ``aten/src/ATen/cuda/CublasHandlePool.cpp``), so they are part of
  ``memory_allocated``/``max_memory_reserved``. A tracer should ``malloc`` them into
  :class:`memfit.trace.allocator.CachingAllocatorSim` at the first matmul instead of adding
  them on top.

The parts: ``cuda.py`` (the context, the workspaces, NCCL, the allocator's capacity),
``rocm.py`` (AMD: what HIP does differently), ``mps.py`` (Apple silicon: the MPS allocator's
hard limit), ``targets.py`` (one entry point by backend) and ``alloc_conf.py`` (the
allocator's options from ``PYTORCH_ALLOC_CONF``); every name is imported from here.
"""

from memfit.runtime.alloc_conf import (
    ALLOC_CONF_VARIABLES,
    allocator_options,
    allocator_options_from_env,
)
from memfit.runtime.cuda import (
    ALLOCATOR_PARTS,
    CONTEXT_MEASUREMENTS,
    CUDA_CONTEXT_BYTES,
    ContextMeasurement,
    allocator_capacity,
    compute_capability_for,
    cublas_workspace_bytes,
    cublaslt_workspace_bytes,
    cuda_context_bytes,
    cuda_runtime_bytes,
    lazy_module_loading,
    nccl_buffer_bytes,
)
from memfit.runtime.mps import (
    DEFAULT_HIGH_WATERMARK_RATIO,
    high_watermark_ratio,
    mps_max_allowed_bytes,
    mps_runtime_bytes,
)
from memfit.runtime.rocm import HIPBLASLT_WORKSPACE_BYTES, hipblas_workspace_bytes
from memfit.runtime.targets import TARGETS, target_runtime_bytes

__all__ = [
    "ALLOCATOR_PARTS",
    "ALLOC_CONF_VARIABLES",
    "CONTEXT_MEASUREMENTS",
    "CUDA_CONTEXT_BYTES",
    "DEFAULT_HIGH_WATERMARK_RATIO",
    "HIPBLASLT_WORKSPACE_BYTES",
    "TARGETS",
    "ContextMeasurement",
    "allocator_capacity",
    "allocator_options",
    "allocator_options_from_env",
    "compute_capability_for",
    "cublas_workspace_bytes",
    "cublaslt_workspace_bytes",
    "cuda_context_bytes",
    "cuda_runtime_bytes",
    "high_watermark_ratio",
    "hipblas_workspace_bytes",
    "lazy_module_loading",
    "mps_max_allowed_bytes",
    "mps_runtime_bytes",
    "nccl_buffer_bytes",
    "target_runtime_bytes",
]
