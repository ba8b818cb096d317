"""Smoke test of ``bench/semi_structured.py``: run its main with ``--quick`` in-process and check
the JSON it writes."""

from __future__ import annotations

import json

from _bench import load_bench


def test_quick_run_writes_every_projection_with_its_baseline(tmp_path) -> None:
    out = tmp_path / "semi.json"
    returned = load_bench("semi_structured").main(["--quick", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["rows"] == returned["rows"]
    assert [r["role"] for r in report["rows"]] == ["q", "k", "v", "o", "gate", "up", "down"]
    for r in report["rows"]:
        m, k = r["shape"]
        assert r["dense_bytes"] == m * k * 2  # bf16 baseline, measured on the real tensor
        # torch's CUTLASS conversion (run on CPU) keeps m*k/2 values and m*k/16 int16 codes
        assert r["cutlass_bytes"] == r["cutlass_predicted_bytes"] == m * k + m * k // 8
        assert r["cusparselt_predicted_bytes"] == m * k * 9 // 16 * 2
    assert report["plan_weights_2_4_bytes"] < report["plan_weights_dense_bytes"]
    assert report["projections_2_4_bytes"] * 16 == report["projections_dense_bytes"] * 9
