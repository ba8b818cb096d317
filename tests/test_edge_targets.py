"""One budget for every verdict on edge devices (issue 24, part 3): the traced plan, the trace's
allocator, ``fit``, ``pack`` and vLLM's startup check use :func:`memfit.budget.budget_bytes`, and
the trace models Apple silicon (``device="mps"``) and AMD (ROCm runtime parts) as targets.

Expected bytes are computed here by hand from the catalog's cited figures (8 GB Orin Nano, 1.5
GiB OS reserve; the M2 Max's recommendedMaxWorkingSetSize, 21845.34 MiB = 2/3 x 32 GiB), the CUDA
context's 758 MiB measurement and PyTorch's ROCm workspace sizes, never read from the output
under test.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memfit
from memfit.cli import main
from memfit.errors import MemfitError
from memfit.gpus import get_gpu
from memfit.trace.estimate import TRACE_FITS_MARGIN

MiB, GiB = 2**20, 2**30
ORIN_BUDGET = 8 * 10**9 - 1536 * MiB  # 8 GB LPDDR5 less the catalog's 1.5 GiB for Linux
M2_BUDGET = 2 * 32 * GiB // 3  # Metal's recommended working set (ollama/ollama#434)
CUDA_CONTEXT = 758 * MiB  # CUDA 13, lazy loading (memfit.runtime.CONTEXT_MEASUREMENTS)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.delenv("MEMFIT_GPU_FILE", raising=False)
    monkeypatch.delenv("PYTORCH_MPS_HIGH_WATERMARK_RATIO", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg-empty"))


def _json(capsys, argv: list[str]) -> dict:
    assert main([*argv, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


# ---------------------------------------------------------------------------------------------
# plan --method trace


@pytest.mark.parametrize(("gpu", "budget", "runtime_outside"), [
    ("jetson-orin-nano-8gb", ORIN_BUDGET, CUDA_CONTEXT),
    ("m2-max-32gb", M2_BUDGET, 0),
])
def test_traced_plan_judges_against_the_device_budget(capsys, gpu: str, budget: int,
                                                      runtime_outside: int) -> None:
    out = _json(capsys, ["plan", "gpt2", "--method", "trace", "--gpu", gpu, "--seq", "64"])
    assert out["gpu"]["capacity_bytes"] == budget  # not the whole 8 GB / 32 GiB
    assert out["gpu"]["budget"]["budget_bytes"] == budget
    total = out["per_gpu"]["total_bytes"]
    assert out["headroom_bytes"] == budget - total
    assert out["fits"] is (budget - total >= TRACE_FITS_MARGIN * budget)
    # The Mac has no CUDA context or cuBLAS workspace; the Jetson holds CUDA's context.
    assert (out["per_gpu"]["breakdown"]["runtime"] >= runtime_outside) is True
    if runtime_outside == 0:
        assert out["per_gpu"]["breakdown"]["runtime"] == 0


def test_traced_plan_on_a_jetson_suggests_changes_not_more_gpus(capsys) -> None:
    """gpt2, batch 4, seq 512: 5.53 GiB traced, under the module's 7.45 GiB but over the 5.95 GiB
    budget with the trace's margin: it does not fit, and the way out is a change of options."""
    out = _json(capsys, ["plan", "gpt2", "--method", "trace", "--gpu", "jetson-orin-nano-8gb",
                         "--seq", "512", "--batch", "4"])
    total = out["per_gpu"]["total_bytes"]
    assert total < 8 * 10**9 * (1 - TRACE_FITS_MARGIN)  # the whole memory would have held it
    assert out["fits"] is False and out["headroom_bytes"] == ORIN_BUDGET - total
    assert out["suggestions"] and out.get("scale_out") is None


def test_traced_plan_takes_the_host_reserve(capsys) -> None:
    out = _json(capsys, ["plan", "gpt2", "--method", "trace", "--gpu", "jetson-orin-nano-8gb",
                         "--seq", "64", "--host-reserve", "600MiB"])
    assert out["gpu"]["capacity_bytes"] == 8 * 10**9 - 600 * MiB


def test_trace_allocator_capacity_is_the_budget_less_the_context() -> None:
    from memfit.trace.allocator import CachingAllocatorSim

    sim = CachingAllocatorSim.for_gpu(get_gpu("jetson-orin-nano-8gb"))
    assert sim.capacity == ORIN_BUDGET - CUDA_CONTEXT  # 5,594,566,656 B


# ---------------------------------------------------------------------------------------------
# fit


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def _loss(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(m(b[0]), b[1])


@pytest.mark.parametrize(("gpu", "device", "budget"), [
    ("jetson-orin-nano-8gb", "cuda", ORIN_BUDGET),
    ("m2-max-32gb", "mps", M2_BUDGET),
])
def test_fit_fits_to_the_device_budget(gpu: str, device: str, budget: int) -> None:
    batch = (torch.randn(8, 64), torch.randint(0, 4, (8,)))
    plan = memfit.fit(_mlp(), batch, global_batch=8, gpu=gpu, device=device, loss_fn=_loss,
                      progress=False)
    assert plan.budget_bytes == budget


FACTORY = """
import torch
from torch import nn

def make():
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)), torch.randn(8, 64)
"""


def test_fit_cli_picks_mps_for_a_mac(capsys, tmp_path, monkeypatch) -> None:
    (tmp_path / "edge_factory.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = _json(capsys, ["fit", "edge_factory:make", "--gpu", "m2-max-32gb",
                         "--global-batch", "8", "--quiet"])
    assert out["budget_bytes"] == M2_BUDGET


# ---------------------------------------------------------------------------------------------
# pack and serve-plan


def test_pack_device_memory_is_the_budget() -> None:
    from memfit.serving.pack_need import device

    assert device(get_gpu("jetson-orin-nano-8gb")).memory_bytes == ORIN_BUDGET
    assert device(get_gpu("h100-80gb")).memory_bytes == get_gpu("h100-80gb").usable_bytes


def test_vllm_on_a_jetson_requests_a_share_of_the_whole_ram(capsys) -> None:
    """vLLM's MemorySnapshot keeps cudaMemGetInfo's total (the whole shared RAM) and, on an
    integrated GPU, takes psutil's available memory as free: 0.9 x 8 GB = 7.2 GB is more than
    the 6.39 GB Linux leaves less the CUDA context, so vLLM refuses to start; 0.6 x 8 GB =
    4.8 GB is not."""
    out = _json(capsys, ["serve-plan", "qwen3-0.6b", "--gpu", "jetson-orin-nano-8gb",
                         "--max-model-len", "4096"])
    assert out["gpu_total_bytes"] == 8 * 10**9 and out["gpu_free_bytes"] == ORIN_BUDGET
    assert out["requested_bytes"] == 7_200_000_000
    assert "unified memory" in out["startup_oom"]
    low = _json(capsys, ["serve-plan", "qwen3-0.6b", "--gpu", "jetson-orin-nano-8gb",
                         "--max-model-len", "4096", "--gpu-memory-utilization", "0.6"])
    assert low["requested_bytes"] == 4_800_000_000
    assert low["startup_oom"] is None or "unified memory" not in low["startup_oom"]


# ---------------------------------------------------------------------------------------------
# memfit.estimate on MPS and ROCm


def _linear() -> tuple[nn.Module, torch.Tensor]:
    with torch.device("meta"):
        model = nn.Linear(100, 30)
    return model, torch.empty(3, 100, device="meta")


def test_estimate_on_mps_counts_bytes_as_requested_with_no_runtime() -> None:
    model, x = _linear()
    est = memfit.estimate(model, x, optimizer=None, device="mps", gpu="m2-max-32gb")
    weights = 4 * (100 * 30 + 30)  # 12,120 B
    inp, out = 4 * 3 * 100, 4 * 3 * 30  # 1,200 B and 360 B
    assert est.device == "mps" and est.runtime == {}
    assert est.peak_bytes == est.total_bytes == weights + inp + out  # no 512 B rounding
    assert any("MPS target" in a for a in est.assumptions)


def test_estimate_on_cuda_rounds_the_same_model_to_512_bytes() -> None:
    model, x = _linear()
    est = memfit.estimate(model, x, optimizer=None, device="cuda")
    # weight 12,000 -> 12,288; bias 120 -> 512; input 1,200 -> 1,536; output 360 -> 512; the
    # cuBLAS workspace of one matmul thread before Hopper (":4096:2:16:8": 2 x 4 MiB + 8 x 16 KiB)
    assert est.peak_bytes == 12_288 + 512 + 1_536 + 512 + 2 * 4 * MiB + 8 * 16 * 1024


def test_estimate_on_mi300x_holds_rocm_workspaces() -> None:
    with torch.device("meta"):
        model = nn.Linear(64, 64)
    est = memfit.estimate(model, torch.empty(8, 64, device="meta"), optimizer="sgd",
                          gpu="mi300x")
    # Training: two matmul threads, each with a 128 MiB hipBLAS (gfx942) and a 76 MiB
    # hipBLASLt workspace (CublasHandlePool.cpp under USE_ROCM); HIP context as CUDA's.
    assert est.runtime == {"hip_context": CUDA_CONTEXT, "hipblas_workspace": 256 * MiB,
                           "hipblaslt_workspace": 152 * MiB, "rccl": 0}
    assert set(est.runtime_in_allocator) == {"hipblas_workspace", "hipblaslt_workspace"}
    assert est.peak_reserved_bytes >= 408 * MiB  # both workspaces live in the allocator


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"device": "mps", "gpu": "h100-80gb"}, ("device='mps' models Apple silicon",)),
    ({"device": "cuda", "gpu": "m2-max-32gb"}, ("Apple silicon", "device='mps'")),
    ({"device": "mps", "expandable_segments": True}, ("expandable_segments", "CUDA-only")),
    ({"device": "mps", "precision": "fp8"}, ("fp8",)),
    ({"device": "tpu"}, ("unknown device 'tpu'", "mps")),
])
def test_bad_targets_are_one_line(kwargs: dict, words: tuple[str, ...]) -> None:
    model, x = _linear()
    with pytest.raises(MemfitError) as info:
        memfit.estimate(model, x, optimizer=None, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message


def test_fit_cli_refuses_cuda_on_a_mac(capsys) -> None:
    assert main(["fit", "gpt2", "--gpu", "m2-max-32gb", "--device", "cuda",
                 "--global-batch", "1", "--seq", "32"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "device='mps'" in err[0], err
