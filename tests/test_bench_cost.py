"""Smoke test of ``bench/cost.py``: its ``--quick`` run in-process, the JSON it writes, and the
stored full run. Each ratio is recomputed here from its parts (the catalog's price, the GPU
count, the step time and the step count, or the hours served), not read from the bench."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from _bench import load_bench
from memfit.gpus import get_gpu

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "cost.py"
NAMES = ["finetune-llama-3-8b", "pretrain-llama-3.2-1b", "serve-llama-3-8b",
         "serve-llama-3-70b", "train-resnet-50"]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    module = load_bench("cost")
    return module


@pytest.fixture(scope="module")
def quick(bench: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench") / "cost.json"
    started = time.perf_counter()
    returned = bench.main(["--quick", "--out", str(out)])
    seconds = time.perf_counter() - started
    written = json.loads(out.read_text())
    assert written["workloads"] == json.loads(json.dumps(returned["workloads"]))
    written["_wall"] = seconds
    return written


def _cost(side: dict[str, Any], kind: str, steps: float) -> float:
    """A side's dollars from its parts: the catalog price x GPUs x hours."""
    per_gpu_hour = get_gpu(side["gpu"]).price_per_hour
    assert per_gpu_hour == side["price_per_gpu_hour"]
    hours = side["step_seconds"] * steps / 3600 if kind == "training" else side["hours"]
    return per_gpu_hour * side["count"] * hours


def _check(report: dict[str, Any], quick: bool) -> None:
    for key in ("device", "torch", "command", "date", "workloads", "labels"):
        assert report[key], key
    assert report["quick"] is quick and ("--quick" in report["command"]) is quick
    # the catalog's most expensive GPU: b200 at $10.57/h (memfit/data/gpus.json)
    assert report["naive_gpu"] == "b200"
    rows = report["workloads"]
    assert [r["name"] for r in rows] == NAMES
    for r in rows:
        kind = r["kind"]
        assert kind == ("serving" if r["name"].startswith("serve") else "training")
        naive, mine = r["naive"], r["memfit"]
        assert naive["label"] == mine["label"] == "predicted"
        assert naive["gpu"] == "b200"
        if kind == "training":
            assert naive["config"].startswith("fp32") and "ckpt" not in naive["config"]
            assert "offload" not in naive["config"] and "8bit" not in naive["config"]
        else:
            # the checkpoint's dtype: vLLM serves a float32 checkpoint in 16 bits
            assert (naive["quant"], naive["batching"]) == ("none (16-bit)", "static")
            assert mine["batching"] == "continuous"
            assert naive["count"] == naive["tp"] * naive["replicas"]
        steps = r.get("steps", 0.0)
        naive_cost, memfit_cost = _cost(naive, kind, steps), _cost(mine, kind, steps)
        assert naive["cost_usd"] == pytest.approx(naive_cost, rel=1e-9)
        assert mine["cost_usd"] == pytest.approx(memfit_cost, rel=1e-9)
        assert r["ratio"] == pytest.approx(naive_cost / memfit_cost, rel=1e-9)
        if kind == "training":  # the same naive run with bf16 autocast, on as many GPUs
            bf16 = r["naive_bf16"]
            assert bf16["config"].startswith("bf16-mixed") and bf16["count"] == naive["count"]
            assert r["ratio_vs_naive_bf16"] == pytest.approx(
                _cost(bf16, kind, steps) / memfit_cost, rel=1e-9)
        lo, hi = report["claim"]
        expected = ("below 3x" if r["ratio"] < lo else
                    "within 3-5x" if r["ratio"] <= hi else "above 5x")
        assert r["verdict"] == expected
    assert report["summary"]["ratios"] == {r["name"]: r["ratio"] for r in rows}


def test_quick_run_writes_every_workload_with_its_ratio(quick: dict[str, Any]) -> None:
    _check(quick, quick=True)
    assert quick["torch"] == torch.__version__


def test_the_stored_full_run_has_the_same_shape() -> None:
    stored = sorted((SCRIPT.parent / "results").glob("cost-cpu-*.json"))
    assert stored, "run python bench/cost.py and commit its JSON"
    _check(json.loads(stored[-1].read_text()), quick=False)


def test_the_cnn_is_resnet_50(bench: ModuleType) -> None:
    # torchvision's resnet50(): 25,557,032 parameters (its weights table, ResNet50_Weights)
    with torch.device("meta"):
        model = bench.ResNet()
    assert sum(p.numel() for p in model.parameters()) == 25_557_032
