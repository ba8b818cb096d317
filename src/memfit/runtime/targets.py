"""One entry point for a GPU's runtime bytes, by PyTorch backend: ``cuda`` (NVIDIA, Jetson
included), ``rocm`` (AMD: HIP, :mod:`memfit.runtime.rocm`) and ``mps`` (Apple silicon,
:mod:`memfit.runtime.mps`). The planner picks the backend from the GPU's vendor
(``GpuSpec.target``)."""

from __future__ import annotations

import functools

from memfit.errors import MemfitError
from memfit.runtime.cuda import cuda_runtime_bytes
from memfit.runtime.mps import mps_runtime_bytes

TARGETS = ("cuda", "rocm", "mps")

ROCM_NAMES = {"cuda_context": "hip_context", "cublas_workspace": "hipblas_workspace",
              "cublaslt_workspace": "hipblaslt_workspace", "nccl": "rccl"}
"""CUDA's part names and ROCm's (the same roles; RCCL is NCCL's HIP port)."""


def target_runtime_bytes(target: str, arch: str | None = None, *, num_gpus: int = 1,
                         matmul_threads: int = 2) -> dict[str, int]:
    """Runtime bytes per GPU by part for ``target``. ``arch``: the compute capability (CUDA,
    ``"8.7"``) or gfx target (ROCm, ``"gfx942"``).

    CUDA: :func:`memfit.runtime.cuda_runtime_bytes`. ROCm: the same parts under HIP's names,
    with hipBLAS/hipBLASLt workspaces from PyTorch's ROCm source and the CUDA context and NCCL
    buffers assumed for HIP and RCCL (no published HIP measurement). MPS: none
    (:func:`memfit.runtime.mps.mps_runtime_bytes`).

    >>> target_runtime_bytes("rocm", "gfx942")["hipblaslt_workspace"] == 2 * 76 * 2**20
    True
    >>> target_runtime_bytes("mps")
    {}
    """
    return dict(_runtime_parts(target, arch, num_gpus, matmul_threads))


@functools.lru_cache(maxsize=256)
def _runtime_parts(target: str, arch: str | None, num_gpus: int,
                   matmul_threads: int) -> dict[str, int]:
    """:func:`target_runtime_bytes`, cached (callers get a copy): a pure function of its
    arguments and the installed torch's version (itself cached), asked by every plan."""
    if target == "mps":
        return mps_runtime_bytes()
    if target == "rocm":
        if arch is None or not arch.startswith("gfx"):
            raise MemfitError(f"a ROCm GPU needs its gfx target (e.g. gfx942), got {arch!r}")
        parts = cuda_runtime_bytes(compute_capability=arch, num_gpus=num_gpus,
                                   matmul_threads=matmul_threads)
        return {ROCM_NAMES[k]: v for k, v in parts.items()}
    if target == "cuda":
        return cuda_runtime_bytes(compute_capability=arch, num_gpus=num_gpus,
                                  matmul_threads=matmul_threads)
    raise MemfitError(f"unknown target {target!r}; valid: {', '.join(TARGETS)}")
