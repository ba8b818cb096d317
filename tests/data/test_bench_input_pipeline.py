"""Smoke test of bench/input_pipeline.py: small batches, every row predicted and measured."""

from __future__ import annotations

import json
import sys

import pytest

from _bench import load_bench


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="reads Linux's Shmem; forks workers")
def test_bench_rows_table_and_json(tmp_path, capsys) -> None:
    pytest.importorskip("psutil")
    bench = load_bench("input_pipeline")
    out = tmp_path / "r.json"
    bench.main(["--sample-mib", "0.5", "--batch", "2", "--samples", "16", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r.get("workers", r.get("depth")) for r in rows] == [0, 2, 4, 1, 2]
    # the profiler rows are exact (allocator events of this process)
    for r in (rows[0], rows[3], rows[4]):
        assert r["measured_bytes"] == r["predicted_bytes"], r
    assert rows[1]["predicted_bytes"] == 5 * (2 * 512 * 1024 - 2 * 16)  # 2 x 2 + 1 batches
    printed = capsys.readouterr().out
    assert "DevicePrefetcher depth 2 (CPU)" in printed and "workers' USS" in printed
