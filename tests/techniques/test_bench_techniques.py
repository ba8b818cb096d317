"""Smoke test of ``bench/techniques.py``: run its main with ``--quick`` in-process and check the
JSON it writes."""

from __future__ import annotations

import json
from types import ModuleType
from typing import Any

import pytest
import torch

from _bench import load_bench
from memfit.errors import MemfitError

# Rows the issue asks for (issue 4, "A benchmark"), by the keys the script gives them.
EXPECTED_ROWS = [
    "baseline", "bf16-mixed", "fp16-mixed", "bf16", "bf16-master", "ckpt-full",
    "ckpt-selective", "ckpt-budget", "act-offload", "adamw-8bit", "adafactor", "optim-offload",
    "adamw-foreach", "adamw-fused", "grad-accum", "chunked-ce", "eager-attn", "lora", "qlora",
    "composed",
]


def _load() -> ModuleType:
    module = load_bench("techniques")
    return module


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return _load()


@pytest.fixture(scope="module")
def report(bench: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench") / "techniques.json"
    threads = torch.get_num_threads()
    returned = bench.main(["--quick", "--steps", "1", "--out", str(out)])
    assert torch.get_num_threads() == threads  # main restores the thread count it changed
    written = json.loads(out.read_text())
    assert written["rows"] == returned["rows"]
    return written


def test_every_row_is_there_with_numbers_or_a_reason(report: dict[str, Any]) -> None:
    rows = {r["key"]: r for r in report["rows"]}
    assert list(rows) == EXPECTED_ROWS
    for key, r in rows.items():
        if r["status"] == "ok":
            assert r["peak_bytes"] > 0 and r["step_seconds"] > 0, key
            assert r["peak_rel"] > 0 and r["time_rel"] > 0, key
            # A prediction, or the engine's reason for not giving one.
            assert (r["predicted_bytes"] is None) != (r["predicted_na_reason"] is None), key
            if r["predicted_bytes"] is not None:
                assert r["pred_over_measured"] == r["predicted_bytes"] / r["peak_bytes"], key
        else:
            assert r["status"] == "n/a", key
            assert r["na_reason"].strip(), key
    for key in ("device", "device_name", "torch", "command", "rows"):
        assert report[key], key
    assert report["torch"] == torch.__version__
    assert "--quick" in report["command"]


def test_baseline_is_the_reference(report: dict[str, Any]) -> None:
    base = report["rows"][0]
    assert base["key"] == "baseline" and base["status"] == "ok"
    assert base["peak_rel"] == 1.0 and base["time_rel"] == 1.0 and base["cpu_time_rel"] == 1.0
    for r in report["rows"]:
        if r["status"] == "ok":
            assert r["peak_rel"] == pytest.approx(r["peak_bytes"] / base["peak_bytes"])


def test_baseline_peak_covers_model_states(bench: ModuleType, report: dict[str, Any]) -> None:
    # First principles: fp32 AdamW holds weights, gradients and two states, 16 bytes a
    # parameter, all alive during the step; the measured peak can only be above that.
    params = bench.SIZES["quick"].spec().param_count()
    assert report["rows"][0]["peak_bytes"] > 16 * params


def test_bytes_alive_before_the_step(bench: ModuleType, report: dict[str, Any]) -> None:
    # The bench counts what the setup left allocated by its allocator events; the storage walk
    # of model + inputs + optimizer is an independent count. They agree where the walk sees
    # everything, and differ by exactly the copies it cannot see.
    params = bench.SIZES["quick"].spec().param_count()
    rows = {r["key"]: r for r in report["rows"]}
    for key in ("baseline", "ckpt-full", "chunked-ce", "composed"):
        assert rows[key]["alive_bytes"] == rows[key]["alive_walk_bytes"], key
    # After zero_grad(set_to_none=True): fp32 weights and AdamW's two states, 12 bytes/param.
    assert rows["baseline"]["alive_bytes"] >= 12 * params
    # fp32 master copies of the bf16 parameters (4 bytes/param) live in the MasterWeights
    # wrapper; host copies of parameters and gradients (8 bytes/param) in the offloaded optimizer.
    master = rows["bf16-master"]
    assert master["alive_bytes"] - master["alive_walk_bytes"] == 4 * params
    offload = rows["optim-offload"]
    assert offload["alive_bytes"] - offload["alive_walk_bytes"] == 8 * params
    for r in report["rows"]:
        if r["status"] == "ok":
            assert r["peak_bytes"] > r["alive_bytes"], r["key"]


def test_checkpointing_lowers_the_measured_peak(report: dict[str, Any]) -> None:
    rows = {r["key"]: r for r in report["rows"]}
    base = rows["baseline"]["peak_bytes"]
    for key in ("ckpt-full", "ckpt-selective", "ckpt-budget"):
        assert rows[key]["status"] == "ok", rows[key]
        assert rows[key]["peak_bytes"] < base, key
    # Full checkpointing keeps only block inputs: below selective, which keeps matmul outputs.
    assert rows["ckpt-full"]["peak_bytes"] < rows["ckpt-selective"]["peak_bytes"]


def test_cpu_only_rows_say_why(report: dict[str, Any]) -> None:
    rows = {r["key"]: r for r in report["rows"]}
    assert rows["act-offload"]["status"] == "n/a"
    assert "host is the device" in rows["act-offload"]["na_reason"]


def test_bad_arguments(bench: ModuleType) -> None:
    with pytest.raises(MemfitError, match="--steps"):
        bench.parse_args(["--steps", "0"])
    with pytest.raises(MemfitError, match=r"unknown row 'lorra'.*lora"):
        bench.main(["--quick", "--rows", "lorra"])
    if not torch.cuda.is_available():
        with pytest.raises(MemfitError, match="--device cpu"):
            bench.parse_args(["--device", "cuda"])
