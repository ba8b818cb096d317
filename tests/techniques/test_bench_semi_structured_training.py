"""Smoke test of ``bench/semi_structured_training.py``: on CPU it writes the predictions alone
and says why nothing was measured."""

from __future__ import annotations

import json

import pytest
import torch

from _bench import load_bench


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path")
def test_quick_run_on_cpu_writes_the_prediction_and_why_not_measured(tmp_path) -> None:
    out = tmp_path / "train.json"
    returned = load_bench("semi_structured_training").main(["--quick", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report == returned
    assert report["not_measured"] == "no CUDA device" and report["dense"] is None
    # 2 x (up [1792, 512], down [512, 1792]): 19/8 bytes per weight (multiples of 128).
    assert report["shapes"] == [[1792, 512], [512, 1792]] * 2
    assert report["predicted_extra_held_bytes"] == 4 * 1792 * 512 * 19 // 8
    assert report["dense_weight_bytes"] == 4 * 1792 * 512 * 2
