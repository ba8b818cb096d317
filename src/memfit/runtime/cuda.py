"""The CUDA runtime's device memory: the CUDA context, cuBLAS/cuBLASLt workspaces, NCCL buffers,
and what the caching allocator can reserve beside them (see the package's docstring for which
of them PyTorch's allocator holds)."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from memfit.errors import MemfitError, suggest
from memfit.runtime.rocm import HIPBLASLT_WORKSPACE_BYTES, hipblas_workspace_bytes

KiB = 1 << 10
MiB = 1 << 20

ALLOCATOR_PARTS = frozenset({"cublas_workspace", "cublaslt_workspace"})
"""Parts of :func:`cuda_runtime_bytes` that PyTorch allocates through its caching allocator."""



@dataclass(frozen=True)
class ContextMeasurement:
    """One published measurement of the device memory a PyTorch process holds outside its
    caching allocator (CUDA context + loaded kernels + library handles)."""

    source: str
    """Where it was published (URL)."""
    quote: str
    """The line quoted from it."""
    cuda: str
    """CUDA version of the PyTorch build (``"11.7"``), as stated there."""
    lazy: bool
    """Whether CUDA's lazy module loading was on."""
    gpu: str
    """The GPU, or ``"not stated"``."""
    context_bytes: int
    """The context: the figure minus what PyTorch's allocator held (derivation in ``how``)."""
    how: str


# The published figures, each with the allocator's part taken out (a tensor of n bytes reserves
# a 2 MiB small segment if n <= 1 MiB, else a 20 MiB segment below 10 MiB: allocator.py).
CONTEXT_MEASUREMENTS: tuple[ContextMeasurement, ...] = (
    ContextMeasurement(
        source="https://github.com/pytorch/pytorch/pull/86509",
        quote="which shows a memory usage of: 287,047,680 bytes",
        cuda="11.7", lazy=True, gpu="not stated",
        context_bytes=287_047_680 - 20 * MiB,
        how="cudaMemGetInfo total - free after torch.randn(20, 16, 50, 100).cuda() (6,400,000 B: "
            "one 20 MiB segment) with PyTorch's default CUDA_MODULE_LOADING=LAZY"),
    ContextMeasurement(
        source="https://github.com/pytorch/pytorch/pull/86509",
        quote="which shows 666,632,192 bytes",
        cuda="11.7", lazy=False, gpu="not stated",
        context_bytes=666_632_192 - 20 * MiB,
        how="the same with CUDA_MODULE_LOADING=DEFAULT (eager loading in CUDA 11.7)"),
    ContextMeasurement(
        source="https://github.com/pytorch/pytorch/issues/109888",
        quote="The first CUDA operation will create the CUDA context which uses around 400MB if "
              "CUDA >= 11.7 is used and lazy module loading enabled (default in PyTorch)",
        cuda="11.7", lazy=True, gpu="not stated",
        context_bytes=400 * MiB,
        how="a PyTorch maintainer's figure (ptrblck); MB read as MiB, the larger reading"),
    ContextMeasurement(
        source="https://github.com/pytorch/pytorch/issues/55277",
        quote="|1.8.2+cu111|0.9.2+cu111|3090|1687| 133% |",
        cuda="11.1", lazy=False, gpu="RTX 3090",
        context_bytes=(1687 - 2) * MiB,
        how="nvidia-smi MiB after torch.Tensor(1).cuda() (one 2 MiB small segment); CUDA 11.1 "
            "has no lazy loading"),
    ContextMeasurement(
        source="https://github.com/pytorch/pytorch/issues/55277",
        quote="|1.8.2+cu101|0.9.2+cu101|1080|721| 0 |",
        cuda="10.1", lazy=False, gpu="GTX 1080",
        context_bytes=(721 - 2) * MiB,
        how="nvidia-smi MiB after torch.Tensor(1).cuda() (one 2 MiB small segment)"),
    ContextMeasurement(
        source="https://huggingface.co/docs/transformers/model_memory_anatomy "
               "(huggingface/transformers docs/source/en/model_memory_anatomy.md @ 249ef816)",
        quote="GPU memory occupied: 1343 MB.",
        cuda="11.2", lazy=False, gpu="Tesla V100-SXM2 16GB",
        context_bytes=(1343 - 2) * MiB,
        how="pynvml used memory (MiB) after torch.ones((1, 1)).to('cuda') (one 2 MiB small "
            "segment); the page's runs are on CUDA 11.2, before lazy loading"),
    ContextMeasurement(
        source="memfit's own: bench/cuda_facts.py, bench/results/cuda-facts-h100-2026-11-27.json",
        quote="outside the allocator after an MLP training step (autocast bf16, AdamW): 758.0 MiB",
        cuda="13.0", lazy=True, gpu="H100 80GB HBM3",
        context_bytes=794_820_608,
        how="NVML's used memory of this process alone (nvmlDeviceGetComputeRunningProcesses) "
            "minus torch.cuda.memory_reserved(), torch 2.11.0+cu130, driver 580.159.04, lazy "
            "loading (PyTorch's default): 610 MiB after the first tensor, 676 MiB after fp32/"
            "bf16/fp16 GEMMs, 758 MiB once the four SDPA backends and an AdamW step had loaded "
            "their kernels; the figure after a training step is the one a training job holds"),
)
"""Published CUDA-context measurements the context model takes its constants from.

Also consistent with them, without a number to take: "Before CUDA 11.7, *all* kernels were
loaded into the context once the library was loaded, which took >1000MB"
(https://github.com/pytorch/pytorch/issues/107667, ptrblck)."""

_LAZY_FROM = (11, 7)  # CUDA 11.7 added lazy loading; PyTorch sets it (CUDAHooks::init, 1.13)

CUDA_CONTEXT_BYTES = max(m.context_bytes for m in CONTEXT_MEASUREMENTS if m.lazy)
"""CUDA context per GPU with lazy module loading (PyTorch's default since 1.13 on CUDA >= 11.7),
outside PyTorch's allocator: the largest lazy-loading figure, 758 MiB, memfit's own on an H100
with CUDA 13 (the published figures for CUDA 11.7 are 254-400 MiB: :data:`CONTEXT_MEASUREMENTS`).
See :func:`cuda_context_bytes` for other CUDA versions and eager loading."""


def _cuda_version(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    match = re.match(r"^\s*(?:(\d+)\.(\d+)|cu(\d+)(\d))\b", text)  # "12.8" or "cu128"
    if not match:
        raise MemfitError(f"cuda_version {text!r} is not a CUDA version; write e.g. '12.8' "
                          "(torch.version.cuda) or 'cu128'")
    major, minor = (match.group(1), match.group(2)) if match.group(1) else (
        match.group(3), match.group(4))
    return int(major), int(minor)


def lazy_module_loading(cuda_version: str | None = None, env: str | None = None) -> bool:
    """Whether CUDA loads kernels lazily in a PyTorch process.

    PyTorch sets ``CUDA_MODULE_LOADING=LAZY`` when the user has not set it
    (``aten/src/ATen/cuda/detail/CUDAHooks.cpp: CUDAHooks::init``, ``c10::utils::set_env(
    "CUDA_MODULE_LOADING", "LAZY", false)``, since pytorch#86509 in 1.13); CUDA honours it from
    11.7. ``env``: the variable's value (``EAGER`` turns it off); ``cuda_version`` None: a
    current build (>= 11.7).

    >>> lazy_module_loading("12.8"), lazy_module_loading("11.2"), lazy_module_loading(env="EAGER")
    (True, False, False)
    """
    version = _cuda_version(cuda_version)
    if version is not None and version < _LAZY_FROM:
        return False
    return (env or "LAZY").strip().upper() != "EAGER"


def cuda_context_bytes(cuda_version: str | None = None, *, lazy: bool | None = None) -> int:
    """CUDA context per GPU outside PyTorch's allocator, from :data:`CONTEXT_MEASUREMENTS`.

    Lazy loading (:func:`lazy_module_loading`): the largest lazy figure (758 MiB, measured by
    memfit on an H100 with CUDA 13; the published CUDA 11.7 figures are lower). Eager: the
    largest eager figure for the same CUDA major version (11.x: 1,685 MiB on an RTX 3090, CUDA
    11.1; 10.x: 719 MiB), else the largest of all. The GPU is not a parameter: the figures do not
    cover enough GPUs to model it, and the largest figure is taken so that the context is not
    under-counted on a GPU with more SMs (their local-memory reservation grows with the SM count).

    >>> cuda_context_bytes() >> 20, cuda_context_bytes("11.2") >> 20
    (758, 1685)
    """
    if lazy is None:
        lazy = lazy_module_loading(cuda_version)
    version = _cuda_version(cuda_version)
    same = [m for m in CONTEXT_MEASUREMENTS if m.lazy == lazy]
    if not lazy and version is not None:
        major = [m for m in same if _cuda_version(m.cuda)[0] == version[0]]  # type: ignore[index]
        same = major or same
    return max(m.context_bytes for m in same)


# CublasHandlePool.cpp, parseChosenWorkspaceSize: default CUBLAS_WORKSPACE_CONFIG ":4096:2:16:8"
# (two 4096 KiB + eight 16 KiB chunks) on CUDA, 32 MiB (":4096:8") on Hopper (major 9, since
# pytorch#89027, torch 2.0) and, from pytorch#175344 (merged 2026-02-19; assumed first released
# in torch 2.11), also Blackwell (major 10 and 12).
_CUBLAS_DEFAULT = 4096 * KiB * 2 + 16 * KiB * 8  # 8,519,680 bytes
_CUBLAS_32MIB = 4096 * KiB * 8  # 33,554,432 bytes
# ROCm's workspaces (hipBLAS 32/128 MiB, hipBLASLt 76 MiB): memfit.runtime.rocm.
# parseCUDABlasLtWorkspaceSize: CUBLASLT_WORKSPACE_SIZE default 1024 KiB ("according to #73328").
_CUBLASLT_DEFAULT = 1024 * KiB

# NCCL src/init.cc: DEFAULT_BUFFSIZE (Simple) = 4 MiB; DEFAULT_LL128_BUFFSIZE =
# 120 elems x 640 threads x 8 steps x 8 B = 4,915,200; DEFAULT_LL_BUFFSIZE =
# 8 lines x 512 threads x 8 steps x 16 B = 524,288. One set per connection.
_NCCL_CONNECTION_BYTES = (1 << 22) + 120 * 640 * 8 * 8 + 8 * 512 * 8 * 16  # 9,633,792
_NCCL_CHANNELS = 16  # assumed; NCCL picks 2-32 by topology (NVLink H100 nodes use up to 32)
_NCCL_CONNECTIONS_PER_CHANNEL = 2  # assumed: the ring's incoming link + one tree link

# GPU name fragments -> compute capability (CUDA) or gfx target (ROCm). Most specific first.
_ARCHITECTURES: tuple[tuple[str, str], ...] = (
    ("gh200", "9.0"), ("gb200", "10.0"), ("gb300", "10.3"),
    ("h100", "9.0"), ("h200", "9.0"), ("h800", "9.0"), ("h20", "9.0"),
    ("b200", "10.0"), ("b100", "10.0"), ("b300", "10.3"),
    ("rtxpro6000", "12.0"), ("rtx5090", "12.0"), ("rtx5080", "12.0"), ("5090", "12.0"),
    ("a100", "8.0"), ("a800", "8.0"), ("a30", "8.0"),
    ("a10g", "8.6"), ("a10", "8.6"), ("a40", "8.6"), ("a6000", "8.6"), ("3090", "8.6"),
    ("l40", "8.9"), ("l4", "8.9"), ("4090", "8.9"), ("6000ada", "8.9"),
    ("4070", "8.9"), ("4060", "8.9"), ("3060", "8.6"), ("orin", "8.7"),
    ("v100", "7.0"), ("t4", "7.5"),
    ("mi300", "gfx942"), ("mi325", "gfx942"), ("mi350", "gfx950"), ("mi355", "gfx950"),
    ("mi250", "gfx90a"), ("mi210", "gfx90a"),
)


def compute_capability_for(gpu_name: str) -> str:
    """Compute capability (``"9.0"``) or ROCm gfx target of a GPU name such as ``h100-sxm-80gb``.

    >>> compute_capability_for("NVIDIA H100 80GB HBM3"), compute_capability_for("a100-80gb")
    ('9.0', '8.0')
    """
    key = re.sub(r"[^a-z0-9]", "", gpu_name.lower())
    for fragment, arch in _ARCHITECTURES:
        if fragment in key:
            return arch
    names = sorted({fragment for fragment, _ in _ARCHITECTURES})
    raise MemfitError(
        f"unknown GPU {gpu_name!r}{suggest(key, names)}; known families: {', '.join(names)}; "
        "pass compute_capability='8.0' (or the GPU's value) instead")


@functools.cache
def _installed_torch() -> str | None:
    """The installed torch's version, read without importing torch (the analytic path must stay
    fast): the GPU job is assumed to run the same release as this environment. Cached: each
    lookup scans the installed distributions (~10 ms), and one plan asks once per stage and
    per candidate GPU count."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return None


def _torch_version(text: str | None) -> tuple[int, int] | None:
    if text is None:
        text = _installed_torch()
    if text is None:
        return None
    match = re.match(r"^\s*(\d+)\.(\d+)", text)
    if not match:
        raise MemfitError(f"torch_version {text!r} is not a version; write e.g. '2.11' or "
                          "'2.11.0+cu130' (torch.__version__)")
    return int(match.group(1)), int(match.group(2))


def _major(arch: str) -> int | None:
    return int(arch.split(".")[0]) if arch[0].isdigit() else None


def cublas_workspace_bytes(compute_capability: str | None = None,
                           torch_version: str | None = None) -> int:
    """Default cuBLAS workspace PyTorch allocates per (cuBLAS handle, stream). From source.

    ``CUBLAS_WORKSPACE_CONFIG`` unset: 8,519,680 bytes (``:4096:2:16:8``), 32 MiB on Hopper
    (compute capability 9.x) and, from torch 2.11 (assumed release of pytorch#175344), on
    Blackwell (10.x, 12.x). ROCm: 32 MiB, 128 MiB on gfx94x/gfx95x. ``compute_capability``
    None: an unknown CUDA GPU gets the non-Hopper default. ``torch_version`` None: the installed
    torch's version; with no torch installed, Blackwell gets the larger (2.11+) workspace, so
    that the runtime is not under-counted.

    >>> cublas_workspace_bytes("8.0"), cublas_workspace_bytes("9.0")
    (8519680, 33554432)
    """
    if compute_capability is None:
        return _CUBLAS_DEFAULT
    if compute_capability.startswith("gfx"):
        return hipblas_workspace_bytes(compute_capability)
    major = _major(compute_capability)
    if major == 9:
        return _CUBLAS_32MIB
    version = _torch_version(torch_version)
    if major in (10, 12) and (version is None or version >= (2, 11)):
        return _CUBLAS_32MIB
    return _CUBLAS_DEFAULT


def cublaslt_workspace_bytes(compute_capability: str | None = None,
                             torch_version: str | None = None) -> int:
    """cuBLASLt workspace per (handle, stream) beyond the cuBLAS one, through the caching
    allocator. From source.

    From torch 2.11 on CUDA: 0. cuBLASLt reuses the cuBLAS workspace
    (``TORCH_CUBLASLT_UNIFIED_WORKSPACE`` on by default in open-source builds: pytorch#168175,
    merged January 2026, assumed first released in 2.11; the installed 2.13's
    ``torch/backends/cuda/__init__.py: blas_workspace_size`` says "the default on open-source
    CUDA builds"). Before: ``CUBLASLT_WORKSPACE_SIZE``'s default 1024 KiB (pytorch#73439), and
    before persistent workspaces (pytorch#156495) the same 1 MiB per cuBLASLt call, freed after
    it: same peak, so the same number is used. ROCm keeps a separate 76 MiB hipBLASLt workspace.
    ``torch_version`` None: the installed torch's version.
    """
    if compute_capability is not None and compute_capability.startswith("gfx"):
        return HIPBLASLT_WORKSPACE_BYTES
    version = _torch_version(torch_version)
    if version is not None and version >= (2, 11):
        return 0
    return _CUBLASLT_DEFAULT


def nccl_buffer_bytes(num_gpus: int) -> int:
    """Assumed NCCL communication buffers per GPU for one process group; 0 for one GPU.

    Assumption (unmeasured): one communicator (the default process group), 16 channels, 2
    connections per channel (ring + tree), each holding NCCL's default Simple (4 MiB), LL128
    (4,915,200 B) and LL (524,288 B) buffers: 16 x 2 x 9,633,792 B = about 294 MiB. More
    process groups (tensor + data parallel) multiply it; NVLink SHARP (NVLS, on NVSwitch
    H100/H200 systems) adds more, and ``NCCL_NVLS_ENABLE=0`` / ``NCCL_BUFFSIZE`` reduce it.
    """
    if num_gpus <= 1:
        return 0
    return _NCCL_CHANNELS * _NCCL_CONNECTIONS_PER_CHANNEL * _NCCL_CONNECTION_BYTES


def cuda_runtime_bytes(gpu_name: str | None = None, *, num_gpus: int = 1,
                       torch_version: str | None = None, compute_capability: str | None = None,
                       matmul_threads: int = 2, cuda_version: str | None = None,
                       lazy_loading: bool | None = None) -> dict[str, int]:
    """Runtime bytes per GPU, by part: ``cuda_context``, ``cublas_workspace``,
    ``cublaslt_workspace``, ``nccl``.

    ``cuda_context`` (published measurements: :func:`cuda_context_bytes` of ``cuda_version``
    and ``lazy_loading``, default a current lazy-loading build) and ``nccl`` (an assumption:
    :func:`nccl_buffer_bytes`) lie outside PyTorch's allocator. The workspaces come from
    PyTorch's source and lie inside it (:data:`ALLOCATOR_PARTS`). PyTorch keeps one workspace
    per (cuBLAS handle, stream) and one handle per thread, so a training step that runs matmuls
    on the main thread (forward) and on autograd's device thread (backward) holds two of each:
    ``matmul_threads=2`` (use 1 for inference). ``compute_capability`` overrides the lookup of
    ``gpu_name``. Nothing here has been measured on a GPU yet.

    >>> cuda_runtime_bytes("a100-80gb")["cublas_workspace"]
    17039360
    """
    if num_gpus < 1:
        raise MemfitError(f"num_gpus must be >= 1, got {num_gpus}")
    if matmul_threads < 0:
        raise MemfitError(f"matmul_threads must be >= 0, got {matmul_threads}")
    arch = compute_capability
    if arch is None and gpu_name is not None:
        arch = compute_capability_for(gpu_name)
    return {
        "cuda_context": cuda_context_bytes(cuda_version, lazy=lazy_loading),
        "cublas_workspace": matmul_threads * cublas_workspace_bytes(arch, torch_version),
        "cublaslt_workspace": matmul_threads * cublaslt_workspace_bytes(arch, torch_version),
        "nccl": nccl_buffer_bytes(num_gpus),
    }


def allocator_capacity(usable_bytes: int, gpu_name: str | None = None, *, num_gpus: int = 1,
                       cuda_version: str | None = None, lazy_loading: bool | None = None,
                       compute_capability: str | None = None) -> int:
    """Bytes PyTorch's caching allocator can reserve before ``cudaMalloc`` fails: the device's
    ``total_memory`` (``GpuSpec.usable_bytes``) minus what :func:`cuda_runtime_bytes` puts
    outside the allocator (CUDA context, NCCL). The capacity for
    :class:`memfit.trace.allocator.CachingAllocatorSim`. ``compute_capability`` (a GPU file's
    entry's) overrides the lookup of ``gpu_name``, as in :func:`cuda_runtime_bytes`.

    >>> allocator_capacity(80 * 2**30) == 80 * 2**30 - CUDA_CONTEXT_BYTES
    True
    """
    parts = cuda_runtime_bytes(gpu_name, num_gpus=num_gpus, cuda_version=cuda_version,
                               lazy_loading=lazy_loading, compute_capability=compute_capability)
    outside = sum(v for k, v in parts.items() if k not in ALLOCATOR_PARTS)
    if usable_bytes <= outside:
        raise MemfitError(f"a GPU of {usable_bytes} bytes cannot hold its CUDA runtime "
                          f"({outside} bytes outside the allocator); check the GPU's memory")
    return usable_bytes - outside

