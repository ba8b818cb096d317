"""Runtime constants (from PyTorch/NCCL source, or stated assumptions) and the
PYTORCH_CUDA_ALLOC_CONF parser."""

from __future__ import annotations

import re

import pytest

from memfit.errors import MemfitError
from memfit.runtime import (
    ALLOC_CONF_VARIABLES,
    ALLOCATOR_PARTS,
    CONTEXT_MEASUREMENTS,
    CUDA_CONTEXT_BYTES,
    allocator_capacity,
    allocator_options,
    allocator_options_from_env,
    compute_capability_for,
    cublas_workspace_bytes,
    cublaslt_workspace_bytes,
    cuda_context_bytes,
    cuda_runtime_bytes,
    lazy_module_loading,
    nccl_buffer_bytes,
)
from memfit.trace.allocator import CachingAllocatorSim

KiB = 2**10
MiB = 2**20


# ------------------------------------------------------------------ cuBLAS workspaces
def test_cublas_default_workspace_is_4096_2_16_8() -> None:
    # CublasHandlePool.cpp parseChosenWorkspaceSize: ":4096:2:16:8" = 2 x 4096 KiB + 8 x 16 KiB
    assert cublas_workspace_bytes("8.0") == 2 * 4096 * KiB + 8 * 16 * KiB == 8_519_680
    assert cublas_workspace_bytes(None) == 8_519_680
    assert cublas_workspace_bytes("7.0") == 8_519_680


def test_cublas_hopper_workspace_is_32mib() -> None:
    # same function: major == 9 -> 4096 KiB x 8 = 32 MiB (pytorch#89027)
    assert cublas_workspace_bytes("9.0") == 32 * MiB


def test_cublas_blackwell_depends_on_torch_version() -> None:
    # pytorch#175344 (Feb 2026) extended 32 MiB to majors 10 and 12
    assert cublas_workspace_bytes("10.0", "2.10.0+cu128") == 8_519_680
    assert cublas_workspace_bytes("10.0", "2.11.0+cu130") == 32 * MiB
    assert cublas_workspace_bytes("12.0", "2.12") == 32 * MiB
    with pytest.raises(MemfitError, match="torch_version"):
        cublas_workspace_bytes("10.0", "latest")


def test_rocm_workspaces() -> None:
    # ROCm branch: 128 MiB on gfx94x/gfx95x, else 32 MiB; hipBLASLt 76 MiB
    assert cublas_workspace_bytes(compute_capability_for("MI300X")) == 128 * MiB
    assert cublas_workspace_bytes("gfx90a") == 32 * MiB
    assert cublaslt_workspace_bytes("gfx942") == 76 * MiB


def test_cublaslt_workspace_by_torch_version() -> None:
    # Before 2.11, parseCUDABlasLtWorkspaceSize: CUBLASLT_WORKSPACE_SIZE default 1024 KiB. From
    # 2.11, cuBLASLt reuses the cuBLAS workspace by default (pytorch#168175;
    # torch/backends/cuda/__init__.py: blas_workspace_size, "the default on open-source CUDA
    # builds"): nothing beyond the cuBLAS workspace.
    assert cublaslt_workspace_bytes("9.0", "2.10.0+cu128") == 1024 * KiB
    assert cublaslt_workspace_bytes("9.0", "2.11.0+cu130") == 0
    assert cublaslt_workspace_bytes("8.0", "2.13") == 0


def test_torch_version_defaults_to_the_installed_one() -> None:
    from importlib.metadata import version

    installed = version("torch")
    assert cublaslt_workspace_bytes("9.0") == cublaslt_workspace_bytes("9.0", installed)
    assert cublas_workspace_bytes("10.0") == cublas_workspace_bytes("10.0", installed)


def test_workspaces_through_the_allocator() -> None:
    # Two cuBLAS workspaces (forward + autograd thread) of 8,519,680 B and two 1 MiB cuBLASLt
    # workspaces, fed through the caching allocator:
    # - 8,519,680 is a 512 multiple, > 1 MiB and < 10 MiB -> 20 MiB segment, split
    #   (rest 12,451,840 > 1 MiB); the second fits in that rest, split again (rest 3,932,160)
    # - 1 MiB is small-pool -> one 2 MiB segment holds both
    parts = cuda_runtime_bytes("A100-SXM4-80GB", torch_version="2.10")
    sim = CachingAllocatorSim()
    for _ in range(2):
        sim.malloc(parts["cublas_workspace"] // 2)
        sim.malloc(parts["cublaslt_workspace"] // 2)
    assert sim.allocated_bytes == 2 * 8_519_680 + 2 * MiB
    assert sim.reserved_bytes == 20 * MiB + 2 * MiB


# ------------------------------------------------------------------ whole runtime
def test_runtime_parts_for_one_a100() -> None:
    parts = cuda_runtime_bytes("a100-80gb", torch_version="2.10")
    assert set(parts) == {"cuda_context", "cublas_workspace", "cublaslt_workspace", "nccl"}
    assert parts["cublas_workspace"] == 2 * 8_519_680  # matmul_threads=2
    assert parts["cublaslt_workspace"] == 2 * MiB
    assert parts["nccl"] == 0  # one GPU: no communicator
    assert ALLOCATOR_PARTS == {"cublas_workspace", "cublaslt_workspace"}


def test_runtime_for_inference_on_h100() -> None:
    parts = cuda_runtime_bytes("NVIDIA H100 80GB HBM3", matmul_threads=1, torch_version="2.10")
    assert parts["cublas_workspace"] == 32 * MiB
    assert parts["cublaslt_workspace"] == 1 * MiB
    unified = cuda_runtime_bytes("NVIDIA H100 80GB HBM3", matmul_threads=1, torch_version="2.11")
    assert unified["cublas_workspace"] == 32 * MiB and unified["cublaslt_workspace"] == 0


def test_compute_capability_override() -> None:
    assert cuda_runtime_bytes(compute_capability="9.0")["cublas_workspace"] == 2 * 32 * MiB


def test_cuda_context_is_the_measured_one() -> None:
    """facts.md: the CUDA context costs about 300-600 MB outside PyTorch's allocator (published
    CUDA 11.7 figures); memfit's own H100 run (CUDA 13, torch 2.11) measured more once a
    training step had loaded its kernels, and the larger figure is the one used."""
    import json
    from pathlib import Path

    facts = json.loads((Path(__file__).resolve().parents[1] / "bench" / "results"
                        / "cuda-facts-h100-2026-11-27.json").read_text())
    after_step = facts["context"][-1]
    assert after_step["after"].startswith("an MLP training step")
    assert CUDA_CONTEXT_BYTES == after_step["outside_allocator"] == 794_820_608
    assert all(CUDA_CONTEXT_BYTES >= m.context_bytes for m in CONTEXT_MEASUREMENTS if m.lazy)
    assert cuda_runtime_bytes()["cuda_context"] == CUDA_CONTEXT_BYTES


def test_context_measurements_are_derived_from_their_quotes() -> None:
    """Each constant is the quoted figure minus the allocator's segment for the tensor the
    measurement made (allocator.py: a 6,400,000 B tensor reserves a 20 MiB segment, a 4 B one
    a 2 MiB segment)."""
    root = __import__("pathlib").Path(__file__).resolve().parents[1]
    for m in CONTEXT_MEASUREMENTS:
        if m.source.startswith("memfit's own: "):  # a measurement committed under bench/results
            assert all((root / path.strip()).exists()
                       for path in m.source.removeprefix("memfit's own: ").split(","))
            continue
        assert m.source.startswith(("https://github.com/pytorch/pytorch/",
                                    "https://huggingface.co/docs/transformers/"))
        figures = [int(f.replace(",", "")) for f in re.findall(r"\d[\d,]*", m.quote)]
        assert any(f in (m.context_bytes + 20 * MiB, m.context_bytes // MiB + 2,
                         m.context_bytes // MiB) for f in figures), m
    assert 20 * 16 * 50 * 100 * 4 == 6_400_000  # torch.randn(20, 16, 50, 100): 1-10 MiB


def test_context_depends_on_cuda_version_and_lazy_loading() -> None:
    """PyTorch sets CUDA_MODULE_LOADING=LAZY unless the user set it
    (``aten/src/ATen/cuda/detail/CUDAHooks.cpp: CUDAHooks::init``); CUDA honours it from 11.7.
    Lazy: the largest lazy figure, 758 MiB (memfit's own, an H100 with CUDA 13 after a training
    step: bench/results/cuda-facts-h100-2026-11-27.json; pytorch#109888 says 400 MiB). Eager:
    CUDA 11.1 on an RTX 3090
    measured 1,687 MiB with a 2 MiB segment (pytorch#55277); CUDA 10.1: 721 - 2 MiB."""
    assert lazy_module_loading() and lazy_module_loading("12.8") and lazy_module_loading("11.7")
    assert not lazy_module_loading("11.6") and not lazy_module_loading("12.4", env="EAGER")
    assert cuda_context_bytes() == cuda_context_bytes("12.8") == 758 * MiB
    assert cuda_context_bytes("11.2") == 1685 * MiB  # no lazy loading before 11.7
    assert cuda_context_bytes("cu112") == 1685 * MiB and cuda_context_bytes("cu128") == 758 * MiB
    assert cuda_context_bytes("10.1") == 719 * MiB
    # no CUDA 12 eager figure: the largest eager figure of all (documented fallback)
    assert cuda_context_bytes("12.8", lazy=False) == 1685 * MiB
    assert cuda_context_bytes("11.7", lazy=True) == 758 * MiB
    assert cuda_runtime_bytes(cuda_version="11.2")["cuda_context"] == 1685 * MiB
    with pytest.raises(MemfitError, match="CUDA version"):
        cuda_context_bytes("twelve")


def test_allocator_capacity_is_total_memory_minus_the_runtime_outside() -> None:
    """The allocator can reserve ``total_memory`` minus the CUDA context and NCCL buffers; the
    cuBLAS workspaces are inside it (``getNewWorkspace`` allocates through the allocator)."""
    total = 80 * 2**30
    assert allocator_capacity(total) == total - 758 * MiB
    assert allocator_capacity(total, "h100", num_gpus=8) == total - 758 * MiB - 308_281_344
    with pytest.raises(MemfitError, match="cannot hold"):
        allocator_capacity(100 * MiB)


def test_nccl_buffers() -> None:
    # NCCL init.cc defaults per connection: Simple 4 MiB + LL128 120*640*8*8 + LL 8*512*8*16;
    # assumed 16 channels x 2 connections
    per_connection = 4 * MiB + 120 * 640 * 8 * 8 + 8 * 512 * 8 * 16
    assert per_connection == 9_633_792
    assert nccl_buffer_bytes(1) == 0
    assert nccl_buffer_bytes(8) == 16 * 2 * per_connection
    assert cuda_runtime_bytes("h100", num_gpus=8)["nccl"] == 308_281_344


def test_gpu_names() -> None:
    assert compute_capability_for("h100-sxm-80gb") == "9.0"
    assert compute_capability_for("GH200") == "9.0"
    assert compute_capability_for("a10g") == "8.6"
    assert compute_capability_for("A100 40GB") == "8.0"  # not the A10 entry
    assert compute_capability_for("L40S") == "8.9"
    assert compute_capability_for("b200") == "10.0"
    assert compute_capability_for("Tesla V100-SXM2-32GB") == "7.0"


def test_bad_runtime_inputs() -> None:
    with pytest.raises(MemfitError, match=r"unknown GPU 'h10' \(did you mean 'h100'"):
        compute_capability_for("h10")
    with pytest.raises(MemfitError, match=r"known families: .*pass compute_capability"):
        compute_capability_for("Quadro K9000")
    with pytest.raises(MemfitError, match="num_gpus"):
        cuda_runtime_bytes(num_gpus=0)


# ------------------------------------------------------------------ PYTORCH_CUDA_ALLOC_CONF
def test_parse_the_common_options() -> None:
    opts = allocator_options_from_env(
        "expandable_segments:True,max_split_size_mb:128,roundup_power2_divisions:4")
    assert opts == {"expandable_segments": True, "max_split_size": 128 * MiB,
                    "roundup_power2_divisions": [4] * 16}
    sim = CachingAllocatorSim(**opts)
    sim.malloc(5 * MiB + 1)  # 4 divisions: 5 MiB + 1 -> 6 MiB; expandable: one 20 MiB page
    assert (sim.allocated_bytes, sim.reserved_bytes) == (6 * MiB, 20 * MiB)


def test_parse_spaces_false_and_empty() -> None:
    assert allocator_options_from_env("") == {}
    assert allocator_options_from_env(" expandable_segments : False ") == {
        "expandable_segments": False}
    assert allocator_options_from_env("max_non_split_rounding_mb:40") == {
        "max_non_split_rounding_size": 40 * MiB}
    assert allocator_options_from_env("expandable_segments:True,large_segment_size_mb:64") == {
        "expandable_segments": True, "large_segment_size": 64 * MiB}


def test_parse_divisions_list() -> None:
    # parseRoundUpPower2Divisions: 256 MiB -> index 8 (first value also fills 0..7),
    # 512 -> 9, 1024 -> 10, '>' fills from last index + 1 = 11 on
    opts = allocator_options_from_env("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]")
    assert opts["roundup_power2_divisions"] == [1] * 9 + [2, 4] + [8] * 5
    sim = CachingAllocatorSim(**opts)
    sim.malloc(600 * MiB)  # index 9 -> 2 divisions between 512 MiB and 1 GiB -> 768 MiB
    assert sim.allocated_bytes == 768 * MiB


def _allocated_delta(conf: str, nbytes: int) -> int:
    sim = CachingAllocatorSim(**allocator_options_from_env(conf))
    sim.malloc(nbytes)
    return sim.allocated_bytes


def test_pytorch_allocator_settings_expectations() -> None:
    # The scenarios of PyTorch's test/test_cuda.py test_allocator_settings and
    # test_roundup_power2_divisions_0/1 (there: active_bytes growth on a real GPU).
    nbytes = 4 * 21 * MiB  # torch.rand(21 Mi floats)
    nbytes_big = 4 * 100 * MiB
    assert _allocated_delta("", nbytes) == nbytes
    assert _allocated_delta("roundup_power2_divisions:4", nbytes) == 96 * MiB  # power2_div(., 4)
    array = "roundup_power2_divisions:[64:8,128:2,256:2,512:2,1024:1,>:1]"
    assert _allocated_delta(array, nbytes) == 88 * MiB  # 64..128 MiB in 8 steps
    assert _allocated_delta(array, nbytes_big) == 512 * MiB  # 256..512 MiB in 2 steps
    zero = "roundup_power2_divisions:[128:1,256:0,512:4]"
    assert _allocated_delta(zero, 4 * 67 * MiB) == 4 * 67 * MiB  # divisions 0: no roundup
    assert _allocated_delta(zero, 4 * 130 * MiB) == 640 * MiB  # 512..1024 MiB in 4 steps
    small = 4 * 21 * 125 * 125  # 1,312,500 bytes -> 512-byte multiple either way
    assert _allocated_delta("roundup_power2_divisions:1", small) == 1_312_768
    assert _allocated_delta("", small) == 1_312_768
    for bad in ("foo:1,bar:2", "garbage_collection_threshold:1.2", "max_split_size_mb:2"):
        with pytest.raises(MemfitError):
            allocator_options_from_env(bad)


def test_parse_accepts_but_drops_unmodelled_options() -> None:
    assert allocator_options_from_env(
        "backend:native,pinned_use_cuda_host_register:True,pinned_num_register_threads:8") == {}


def test_parse_garbage_collection_threshold() -> None:
    """``parseGarbageCollectionThreshold``: a double in (0.0, 1.0), kept for the simulator
    (which acts on it only with a memory fraction, as ``garbage_collect_cached_blocks``)."""
    opts = allocator_options_from_env("garbage_collection_threshold:0.6,max_split_size_mb:64")
    assert opts == {"garbage_collection_threshold": 0.6, "max_split_size": 64 * MiB}
    sim = CachingAllocatorSim(**opts, allowed_memory_maximum=100 * MiB)
    assert sim.garbage_collection_threshold == 0.6


def test_booleans_are_exactly_true_or_false() -> None:
    """``c10/core/AllocatorConfig.h: ConfigTokenizer::toBool`` accepts "True" or "False"
    only (case-sensitive); memfit rejects "true" as PyTorch does."""
    assert allocator_options_from_env("expandable_segments:True") == {
        "expandable_segments": True}
    with pytest.raises(MemfitError, match="True or False"):
        allocator_options_from_env("expandable_segments:true")


def test_the_environment_is_read_like_pytorch(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch >= 2.9 reads PYTORCH_ALLOC_CONF first, then PYTORCH_CUDA_ALLOC_CONF
    (``c10/core/AllocatorConfig.cpp``); an explicit string wins over both."""
    for name in ALLOC_CONF_VARIABLES:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    assert allocator_options() == {}
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
    assert allocator_options() == {"max_split_size": 64 * MiB}
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    assert allocator_options() == {"expandable_segments": True}
    assert allocator_options("roundup_power2_divisions:4") == {
        "roundup_power2_divisions": [4] * 16}
    sim = CachingAllocatorSim.for_gpu(None)
    assert sim.expandable_segments and sim.capacity is None


@pytest.mark.parametrize(("conf", "message"), [
    ("expandable_segmnts:True", "did you mean 'expandable_segments'"),
    ("max_split_size_mb:10", ">= 20"),
    ("large_segment_size_mb:5", "multiple of 2"),
    ("max_split_size_mb:abc", "whole number"),
    ("expandable_segments:yes", "True or False"),
    ("expandable_segments", "expected ':'"),
    ("expandable_segments:", "expected a value"),
    ("expandable_segments:True,", "trailing ','"),
    ("max_split_size_mb:128:5", "expected ','"),
    # spaces are dropped, as PyTorch's tokenizer does: "True max..." reads as one word
    ("expandable_segments:True max_split_size_mb:128", "True or False"),
    ("roundup_power2_divisions:3", "power of two"),
    ("roundup_power2_divisions:[256:3]", "powers of two"),
    ("roundup_power2_divisions:[300:2]", "intervals must be powers of two"),
    ("roundup_power2_divisions:[256:2", "closing"),
    ("garbage_collection_threshold:1.5", r"\(0.0, 1.0\)"),
    ("backend:cudaMallocAsync", "not modelled"),
    (":True", "option name"),
])
def test_parse_errors_are_one_line_memfit_errors(conf: str, message: str) -> None:
    with pytest.raises(MemfitError, match=message) as info:
        allocator_options_from_env(conf)
    assert "\n" not in str(info.value)
