"""Edge and small GPUs (issue 24, part 3): the 8-16 GB cards and the Jetson Orin family in the
catalog, the unified-memory budget, Apple silicon (MPS) and AMD (ROCm) as targets, and 4-bit
inference of an 8B model on an 8 GB card.

Expected bytes are computed here by hand from the cited sources (datasheets, PyTorch's
MPSAllocator.h/CublasHandlePool.cpp, the llama-3-8b config), never read from the code under test.
"""

from __future__ import annotations

import json
import math

import pytest

from memfit.analytic.config import RunConfig
from memfit.analytic.planner import plan
from memfit.cli import main
from memfit.gpus import get_gpu
from memfit.models import resolve_model

KiB, MiB, GiB = 2**10, 2**20, 2**30


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.delenv("MEMFIT_GPU_FILE", raising=False)
    monkeypatch.delenv("PYTORCH_MPS_HIGH_WATERMARK_RATIO", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg-empty"))


def _json(capsys, argv: list[str]) -> dict:
    assert main([*argv, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def _refused(capsys, argv: list[str], *words: str) -> None:
    assert main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "Traceback" not in err[0], err
    for word in words:
        assert word in err[0], err[0]


# ---------------------------------------------------------------------------------------------
# Catalog: bandwidth = bus width x data rate / 8; fp32 = CUDA cores x 2 x clock (datasheets)

CARDS = {  # name: (GB, bus bits, Gbps per pin, CUDA cores, boost MHz, cc, PCIe lanes)
    "rtx-3060-12gb": (12, 192, 15, 3584, 1777, "8.6", 16),
    "rtx-4060-8gb": (8, 128, 17, 3072, 2460, "8.9", 8),
    "rtx-4060-ti-16gb": (16, 128, 18, 4352, 2535, "8.9", 8),
    "rtx-4070-12gb": (12, 192, 21, 5888, 2475, "8.9", 16),
}
JETSONS = {  # name: (GB, bus bits, MT/s, CUDA cores, SMs, GPU MHz, sparse INT8 TOPS of the GPU)
    "jetson-agx-orin-64gb": (64, 256, 6400, 2048, 16, 1300, 170),
    "jetson-agx-orin-32gb": (32, 256, 6400, 1792, 14, 930, 108),
    "jetson-orin-nx-16gb": (16, 128, 6400, 1024, 8, 918, 60),
    "jetson-orin-nx-8gb": (8, 128, 6400, 1024, 8, 765, 50),
    "jetson-orin-nano-8gb": (8, 128, 4266, 1024, 8, 625, 40),
    "jetson-orin-nano-4gb": (4, 64, 4266, 512, 4, 625, 20),
}


@pytest.mark.parametrize("name", sorted(CARDS))
def test_consumer_cards_from_their_datasheets(name: str) -> None:
    gb, bus, gbps, cores, mhz, cc, lanes = CARDS[name]
    gpu = get_gpu(name)
    assert gpu.memory_bytes == gb * 10**9 and gpu.memory_basis == "marketing"
    assert gpu.bandwidth_gbps == bus * gbps / 8
    assert gpu.tflops["fp32"] == pytest.approx(cores * 2 * mhz / 1e6, abs=0.05)
    assert gpu.compute_capability == cc and gpu.bf16 and gpu.fp8 == (cc == "8.9")
    assert gpu.host_link.kind == f"PCIe 4.0 x{lanes}"
    assert gpu.price_per_hour is None and not gpu.unified_memory and gpu.target == "cuda"


@pytest.mark.parametrize("name", sorted(JETSONS))
def test_jetson_orin_from_the_module_table(name: str) -> None:
    gb, bus, mts, cores, sms, mhz, tops = JETSONS[name]
    gpu = get_gpu(name)
    assert gpu.memory_bytes == gb * 10**9
    assert gpu.bandwidth_gbps == pytest.approx(bus * mts / 8 / 1000, rel=0.01)
    assert gpu.tflops["fp32"] == pytest.approx(cores * 2 * mhz / 1e6, abs=0.01)
    # dense fp16 tensor = SMs x 2048 FLOP/clk x clock, which is the GPU's sparse INT8 TOPS / 4
    assert gpu.tflops["fp16"] == pytest.approx(sms * 2048 * mhz / 1e6, abs=0.05)
    assert gpu.tflops["fp16"] == pytest.approx(tops / 4, rel=0.07)
    assert gpu.compute_capability == "8.7" and gpu.bf16 and not gpu.fp8
    assert gpu.unified_memory and gpu.host_reserve_bytes == 1536 * MiB


def test_memfit_gpus_lists_them(capsys) -> None:
    assert main(["gpus", "--json"]) == 0
    names = {g["name"] for g in json.loads(capsys.readouterr().out)}
    assert {*CARDS, *JETSONS, "m2-max-32gb", "m2-max-96gb"} <= names


def test_targets_by_vendor() -> None:
    assert get_gpu("mi300x").target == "rocm"
    assert get_gpu("m2-max-96gb").target == "mps"
    assert get_gpu("jetson-orin-nano-8gb").target == "cuda"


# ---------------------------------------------------------------------------------------------
# Unified memory (Jetson): budget = total - what the OS and CPU side keep


def test_jetson_budget_is_total_less_host_reserve(capsys) -> None:
    out = _json(capsys, ["plan", "llama-3.2-1b", "--gpu", "jetson-orin-nano-8gb", "--mode",
                         "inference", "--seq", "1024"])
    budget = 8 * 10**9 - 1536 * MiB  # 6,389,387,264
    assert out["gpu"]["capacity_bytes"] == budget
    assert out["gpu"]["budget"]["host_reserve_bytes"] == 1536 * MiB
    assert out["gpu"]["budget"]["unified_memory"] is True
    assert out["headroom_bytes"] == budget - out["per_gpu"]["total_bytes"]
    out = _json(capsys, ["plan", "llama-3.2-1b", "--gpu", "jetson-orin-nano-8gb", "--mode",
                         "inference", "--seq", "1024", "--host-reserve", "1GiB"])
    assert out["gpu"]["capacity_bytes"] == 8 * 10**9 - GiB
    assert out["gpu"]["budget"]["host_reserve_basis"] == "--host-reserve"


def test_jetson_plan_says_so_in_text(capsys) -> None:
    assert main(["plan", "llama-3.2-1b", "--gpu", "orin-nano-8gb", "--mode", "inference"]) == 0
    text = capsys.readouterr().out
    assert "unified memory: budget = 7.45 GiB unified memory - 1.50 GiB kept for the OS" in text
    assert "= 5.95 GiB" in text  # 6,389,387,264 B


def test_user_file_sets_a_jetsons_reserve_and_says_so(capsys, tmp_path) -> None:
    path = tmp_path / "gpus.json"
    path.write_text(json.dumps({"gpus": [{"name": "orin-nano-8gb",
                                          "host_reserve_bytes": 512 * MiB}]}))
    out = _json(capsys, ["plan", "llama-3.2-1b", "--gpu", "jetson-orin-nano-8gb", "--gpu-file",
                         str(path), "--mode", "inference"])
    assert out["gpu"]["capacity_bytes"] == 8 * 10**9 - 512 * MiB
    assert out["gpu"]["budget"]["host_reserve_basis"] == f"user file {path}"
    other = get_gpu("jetson-agx-orin-64gb", path)  # untouched entries keep the catalog's
    assert other.host_reserve_source == "catalog default"


def test_user_file_reserve_needs_unified_memory(capsys, tmp_path) -> None:
    path = tmp_path / "gpus.json"
    path.write_text(json.dumps({"gpus": [{"name": "rtx-4060-8gb", "host_reserve_bytes": 1}]}))
    _refused(capsys, ["plan", "llama-3.2-1b", "--gpu", "rtx-4060-8gb", "--gpu-file", str(path)],
             "unified_memory")


# ---------------------------------------------------------------------------------------------
# Apple silicon (MPS): min(ratio x recommendedMaxWorkingSetSize, RAM - host reserve)

R_96 = 73728 * MiB  # llama.cpp#3213: recommendedMaxWorkingSetSize = 73728,00 MB on a 96 GB M2 Max


def test_mps_budget_defaults_to_metals_recommended_working_set(capsys) -> None:
    out = _json(capsys, ["plan", "llama-3-8b", "--gpu", "m2-max-96gb", "--mode", "inference"])
    b = out["gpu"]["budget"]
    assert b["target"] == "mps" and b["recommended_working_set_bytes"] == R_96
    assert b["high_watermark_ratio"] == 1.7  # MPSAllocator.h default_high_watermark_ratio
    assert b["max_allowed_bytes"] == int(1.7 * R_96)  # setHighWatermarkRatio
    assert b["host_reserve_bytes"] == 96 * GiB - R_96  # what Metal's recommendation leaves
    assert out["gpu"]["capacity_bytes"] == R_96 == min(int(1.7 * R_96), R_96)
    assert out["per_gpu"]["breakdown"]["runtime"] == 0  # no CUDA context, no cuBLAS workspace
    assert out["runtime_parts"] == {}


def test_mps_budget_with_host_reserve_and_watermark(capsys, monkeypatch) -> None:
    base = ["plan", "llama-3-8b", "--gpu", "m2-max-96gb", "--mode", "inference"]
    out = _json(capsys, [*base, "--host-reserve", "8GiB"])
    assert out["gpu"]["capacity_bytes"] == 88 * GiB  # 1.7 x 72 GiB = 122.4 GiB is above it
    out = _json(capsys, [*base, "--host-reserve", "8GiB", "--mps-high-watermark", "1.0"])
    assert out["gpu"]["capacity_bytes"] == R_96  # the limit binds: 72 GiB < 88 GiB
    monkeypatch.setenv("PYTORCH_MPS_HIGH_WATERMARK_RATIO", "1.1")
    out = _json(capsys, [*base, "--host-reserve", "8GiB"])
    assert out["gpu"]["capacity_bytes"] == int(1.1 * R_96) == 85_040_352_460
    monkeypatch.setenv("PYTORCH_MPS_HIGH_WATERMARK_RATIO", "0")  # no limit
    out = _json(capsys, [*base, "--host-reserve", "8GiB"])
    assert out["gpu"]["capacity_bytes"] == 88 * GiB
    assert out["gpu"]["budget"]["max_allowed_bytes"] is None


def test_mps_plan_says_budget_in_text(capsys) -> None:
    assert main(["plan", "llama-3-8b", "--gpu", "m2-max-32gb", "--mode", "inference"]) == 0
    text = capsys.readouterr().out
    # ollama#434: 21845.34 MB = 2/3 of 32 GiB; 1.7 x that = 36.27 GiB
    assert "MPS: budget = 21.33 GiB" in text and "1.7 x recommendedMaxWorkingSetSize" in text
    assert "36.27 GiB" in text


def test_mps_user_mac_needs_its_recommended_working_set(capsys, tmp_path) -> None:
    path = tmp_path / "gpus.json"
    path.write_text(json.dumps({"gpus": [{
        "name": "my-m3-max-128gb", "vendor": "apple", "memory_bytes": 128 * GiB,
        "bandwidth_gbps": 400, "tflops": {"fp32": 14}, "bf16": False, "fp8": False,
        "host_link": {"kind": "unified memory", "gbps": 400}, "unified_memory": True}]}))
    _refused(capsys, ["plan", "llama-3-8b", "--gpu", "my-m3-max-128gb", "--gpu-file", str(path),
                      "--mode", "inference"], "recommended_max_memory")


# ---------------------------------------------------------------------------------------------
# ROCm: hipBLAS/hipBLASLt workspaces by the GPU's vendor


def test_mi300x_plans_with_rocm_runtime() -> None:
    p = plan(resolve_model("llama-3-8b"), RunConfig(mode="inference", seq=1024),
             get_gpu("mi300x"))
    # CublasHandlePool.cpp (USE_ROCM): hipBLAS 128 MiB on gfx94x, hipBLASLt 76*1024 KiB; one per
    # matmul thread (2: forward and autograd's thread, as for CUDA)
    assert p.runtime_parts["hipblas_workspace"] == 2 * 128 * MiB
    assert p.runtime_parts["hipblaslt_workspace"] == 2 * 76 * 1024 * KiB
    assert set(p.runtime_parts) == {"hip_context", "hipblas_workspace", "hipblaslt_workspace",
                                    "rccl"}
    assert p.capacity_bytes == get_gpu("mi300x").usable_bytes


# ---------------------------------------------------------------------------------------------
# 4-bit inference of Llama-3-8B on an 8 GB card (docs/edge.md compares published figures)

# llama-3-8b config: hidden 4096, intermediate 14336, 32 layers, 32 heads, 8 KV heads x 128,
# vocab 128256 (untied); facts.md: 8,030,261,248 parameters.
H, F, L, KV, V = 4096, 14336, 32, 8 * 128, 128256
LINEAR = L * (2 * H * H + 2 * H * KV + 3 * H * F)  # q,o + k,v + gate,up,down
PARAMS = 8_030_261_248


def _int4_weights() -> int:
    # torchao int4 weight-only: 4 bits + a 16-bit scale and zero point per group of 128;
    # embeddings, head and norms stay bf16
    return math.ceil(LINEAR * (0.5 + 4 / 128)) + (PARAMS - LINEAR) * 2


def test_llama3_8b_int4_on_rtx_4060_8gb(capsys) -> None:
    out = _json(capsys, ["plan", "llama-3-8b", "--gpu", "rtx-4060-8gb", "--mode", "inference",
                         "--quant", "int4", "--seq", "4096"])
    parts = out["per_gpu"]["breakdown"]
    kv = 2 * L * KV * 2 * 4096  # K and V, bf16, 4096 tokens: facts.md's 128 KiB/token
    assert kv == 512 * MiB
    assert parts["kv_cache"] == kv
    assert parts["weights"] == _int4_weights() == 5_809_643_520
    # prefill peak: residual + normed copy, the MLP's gate/up/act (> q,k,v + attention out),
    # last-position logits in bf16 + fp32, int64 token ids
    acts = 2 * 2 * 4096 * H + 3 * 2 * 4096 * F + (2 + 4) * V + 8 * 4096
    assert parts["activations"] == acts == 420_232_704
    runtime = 794_820_608 + 2 * (4096 * KiB * 2 + 16 * KiB * 8)  # CUDA 13 context + cuBLAS x2
    assert parts["runtime"] == runtime
    total = _int4_weights() + kv + acts + runtime
    assert out["per_gpu"]["total_bytes"] == total == 7_578_607_104
    capacity = 8 * 10**9
    assert out["gpu"]["capacity_bytes"] == capacity
    # Under the card's 8 GB, but inside the 19% margin memfit keeps: a tight fit, not a fit.
    assert total < capacity and out["headroom_bytes"] == capacity - total
    assert out["fits"] is False and capacity - total < 0.19 * capacity


def test_llama3_8b_int4_at_2048_tokens_fits_8gb(capsys) -> None:
    out = _json(capsys, ["plan", "llama-3-8b", "--gpu", "rtx-4060-8gb", "--mode", "inference",
                         "--quant", "int4", "--seq", "2048", "--kv-cache-dtype", "fp8"])
    assert out["per_gpu"]["breakdown"]["kv_cache"] == 2 * L * KV * 1 * 2048  # 128 MiB
    assert out["fits"] is False  # still inside the margin: the 16-bit embedding and head


def test_llama31_8b_int4_at_its_full_context_does_not_fit_12gb(capsys) -> None:
    # llama.cpp#9517: Llama-3.1-8B Q4_K_M fails to load on a 12 GB card at the model's context
    out = _json(capsys, ["plan", "llama-3.1-8b", "--gpu", "rtx-3060-12gb", "--mode",
                         "inference", "--quant", "int4", "--seq", "131072"])
    assert out["per_gpu"]["breakdown"]["kv_cache"] == 2 * L * KV * 2 * 131072 == 16 * GiB
    assert out["fits"] is False and out["headroom_bytes"] < 0


# ---------------------------------------------------------------------------------------------
# Bad input: one line, exit 2


def test_fp8_on_a_jetson_is_refused(capsys) -> None:
    _refused(capsys, ["plan", "llama-3-8b", "--gpu", "jetson-agx-orin-64gb", "--mode",
                      "inference", "--precision", "fp8"], "no fp8")
    _refused(capsys, ["plan", "llama-3-8b", "--gpu", "jetson-agx-orin-64gb", "--mode",
                      "inference", "--kv-cache-dtype", "fp8"], "no fp8")


@pytest.mark.parametrize(("argv", "words"), [
    (["--gpu", "rtx-4060-8gb", "--host-reserve", "1GiB"], ("--host-reserve", "own memory")),
    (["--gpu", "orin-nano-8gb", "--host-reserve", "9GB"], ("--host-reserve", "leaves nothing")),
    (["--host-reserve", "1GiB"], ("--gpu",)),
    (["--gpu", "orin-nano-8gb", "--mps-high-watermark", "1.2"], ("Apple silicon",)),
    (["--gpu", "m2-max-32gb", "--mps-high-watermark", "2.5"], ("outside 0..2",)),
    (["--gpu", "m2-max-32gb", "--mps-high-watermark", "lots"], ("not a number",)),
    # a Mac has no compute capability: the message said "(compute capability None)"
    (["--gpu", "m2-max-32gb", "--precision", "bf16"], ("no bf16 support (not in its catalog",)),
])
def test_edge_options_refused(capsys, argv: list[str], words: tuple[str, ...]) -> None:
    _refused(capsys, ["plan", "llama-3.2-1b", "--mode", "inference", *argv], *words)
