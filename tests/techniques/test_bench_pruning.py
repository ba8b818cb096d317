"""Smoke test of ``bench/pruning.py`` on a tiny MLP: every variant runs, the bytes memfit reports
are the bytes the tensors hold, and pruning holds three times the dense weights."""

from __future__ import annotations

import json
from pathlib import Path

from _bench import load_bench


def test_pruning_bench_runs(tmp_path: Path) -> None:
    bench = load_bench("pruning")
    out = tmp_path / "pruning.json"
    result = bench.main(["--features", "64", "--hidden", "128", "--batch", "4", "--repeats", "1",
                         "--out", str(out)])
    assert json.loads(out.read_text())["results"] == result["results"]
    rows = {(r["kind"], r["density"]): r for r in result["results"]}
    dense = 4 * (64 * 128 + 128 * 64)  # two fp32 weights
    assert rows[("dense", 1.0)]["held_bytes"] == dense
    # weight_orig + weight_mask + the recomputed weight, whatever the amount
    pruned = rows[("pruned", 0.5)]
    assert pruned["held_bytes"] == pruned["reported_bytes"] == 3 * dense
    for r in result["results"]:
        assert r["held_bytes"] == r["reported_bytes"], r
        assert r["forward_seconds"] > 0
    # CSR at 50% (int32 indices) does not pay: kept dense; at 10% it does
    assert rows[("csr", 0.5)]["layouts"] == ["strided", "strided"]
    assert rows[("csr", 0.1)]["layouts"] == ["sparse_csr", "sparse_csr"]
    # 10% of 8192 entries = 819 kept in each: the 128 x 64 weight has 129 row pointers, the
    # 64 x 128 one 65 (int32 indices)
    assert rows[("csr", 0.1)]["held_bytes"] == 819 * 8 + 129 * 4 + 819 * 8 + 65 * 4
    assert rows[("bsr", 0.25)]["layouts"] == ["sparse_bsr", "sparse_bsr"]
