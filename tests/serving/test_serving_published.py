"""bench/serving_published.py against the public vLLM / SGLang startup logs it stores.

The expected figures are the engines' own logged lines (each log's quote at its source), never
memfit's output. What the issue asks (issue 22, section 4): KV tokens within 1 % (median) and
3 % (max). The median is met; the max is not, and the one log that misses it is named here, with
its cause (a speculative-decoding draft layer that holds KV, which memfit does not model), so a
change in either direction fails this test instead of hiding.
"""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "serving_published.py"
GiB = 2**30

# Logs outside 3 % and why: the entry's own "note" says it; these names must match the run.
KNOWN_MISSES = {"vllm19996-llama31-8b-eagle-h100"}  # EAGLE draft layer's KV: not modelled
# Within 3 % but outside the log's own rounding, and why.
OUTSIDE_ROUNDING = KNOWN_MISSES | {
    # TP 4: one rank's "Available KV cache memory" is quoted; vLLM sizes every rank to the
    # smallest rank's blocks (the pool is 1.1 % under what the quoted rank's 8.11 GiB holds)
    "vllm21348-qwen3-235b-fp8-tp4-h100",
}


@pytest.fixture(scope="module")
def bench() -> Any:
    spec = importlib.util.spec_from_file_location("bench_serving_published", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_serving_published"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def result(bench: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    return bench.run()


def test_every_log_is_well_formed_and_cited(bench: Any) -> None:
    models, logs = bench.load()
    assert [p for log in logs for p in bench.validate(log, models)] == []
    # 19 logs from 17 public sources; the issue asks for 20 (one short, said in the docs)
    assert len(logs) >= 19
    assert len({log["id"] for log in logs}) == len(logs)
    for log in logs:
        assert all(line.strip() for line in log["quote"]), log["id"]
    engines = {log["engine"] for log in logs}
    assert engines == {"vllm", "sglang"}
    # at least five of the issue's layouts, each on a log that prints tokens or a request's bytes
    layouts = {la for log in logs for la in log["layouts"]}
    assert {"full_gqa", "explicit_head_dim", "sliding_window", "mla", "tp"} <= layouts


def test_the_engine_version_picks_the_log_semantics(bench: Any) -> None:
    log = {"engine_version": "0.6.4"}
    assert bench.engine_rule(log) == "v0"
    assert bench.engine_rule({"engine_version": "0.10.1.1"}) == "v1_groups"
    assert bench.engine_rule({"engine_version": "0.19.0"}) == "v1_groups"
    assert bench.engine_rule({"engine_version": "0.20.2"}) == "v1_capacity"
    assert bench.engine_rule({"engine_version": "0.33.0"}) == "v1_capacity"
    # a stated rule wins over the version string (versions not stated in the log)
    assert bench.engine_rule({"engine_version": "not stated", "engine_rule": "v0"}) == "v0"


def test_a_full_attention_log_by_hand(bench: Any) -> None:
    """Qwen2-7B on one A100, vLLM 0.10.1.1: 'Available KV cache memory: 5.01 GiB',
    'GPU KV cache size: 93,872 tokens'. By hand: 2 x 28 layers x 4 KV heads x 128 x 2 B =
    57,344 B a token, a block of 16 is 917,504 B; 5.01 GiB // 917,504 = 5,863 blocks =
    93,808 tokens, and 5.015 GiB (the top of the rounding) holds 5,868 blocks = 93,888: the
    logged 93,872 (5,867 blocks) lies inside."""
    models, logs = bench.load()
    row = bench.compare(next(lg for lg in logs if lg["id"] == "dl22-qwen2-7b-a100-0.25"), models)
    q = row["quantities"]["kv_tokens"]
    assert q["predicted"] == (round(5.01 * GiB) // (16 * 57344)) * 16 == 93_808
    assert q["interval"] == [(round(5.005 * GiB) // 917504) * 16,
                             (round((5.015 - 1e-12) * GiB) // 917504) * 16]
    assert q["within_rounding"]


def test_a_sliding_window_log_needs_its_versions_rule(bench: Any) -> None:
    """gpt-oss-120b at TP 4 on vLLM 0.10.1.1 logs 2,640,144 tokens and 284.25x at 16,384:
    blocks per group x 16 and one batch of 2,048 tokens in flight (0.10's rules). Read with
    0.20's rule (int(concurrency x max_model_len), two batches in flight) the same budget would
    print another figure entirely: the rule is doing the work."""
    models, logs = bench.load()
    log = next(lg for lg in logs if lg["id"] == "dl22-gpt-oss-120b-tp4-a100")
    row = bench.compare(log, models)
    assert row["rule"] == "v1_groups"
    assert row["quantities"]["kv_tokens"]["within_rounding"]
    assert row["quantities"]["max_concurrency"]["within_rounding"]
    wrong = copy.deepcopy(log)
    wrong["engine_rule"] = "v1_capacity"
    other = bench.compare(wrong, models)["quantities"]
    assert abs(other["kv_tokens"]["error_pct"]) > 50
    assert abs(other["max_concurrency"]["error_pct"]) > 5
    # the plain formula (hidden / heads = 45, not the config's head_dim 64) is 42 % over
    assert row["quantities"]["kv_tokens"]["plain_error_pct"] > 40


def test_peer_formulas_restated(bench: Any) -> None:
    """llm-d-planner (capacity_planner.py: KVCacheDetail) and the plain formula, by hand on
    Qwen3-235B (94 layers, 4 KV heads, head_dim 128, hidden 4096 / 64 heads) at TP 4."""
    models, _ = bench.load()
    config = models["Qwen/Qwen3-235B-A22B-FP8"]["config"]
    assert bench.llmd_bytes_per_token(config, 4) == 94 * 2 * 128 * 4 * 2 / 4 == 48128
    assert bench.plain_bytes_per_token(config, 4, "auto") == 2 * 94 * 4 / 4 * 64 * 2 == 24064
    # MLA: llm-d-planner splits the latent by TP (vLLM does not)
    mla = models["deepseek-ai/DeepSeek-V2-Lite-Chat"]["config"]
    assert bench.llmd_bytes_per_token(mla, 2) == 27 * (512 + 64) * 2 / 2


def test_the_issues_targets_as_they_stand(result: tuple[list[dict[str, Any]], dict[str, Any]],
                                          bench: Any) -> None:
    rows, summary = result
    tokens = {r["id"]: r["quantities"]["kv_tokens"] for r in rows
              if "kv_tokens" in r["quantities"]}
    assert len(tokens) >= 15
    # median within 1 %: met
    assert summary["memfit"]["median_abs_error_pct"] <= bench.TARGET_MEDIAN
    assert summary["targets"]["median_le_1pct"]
    # max within 3 %: met by every log but the listed misses
    misses = {lid for lid, q in tokens.items() if abs(q["error_pct"]) > bench.TARGET_MAX}
    assert misses == KNOWN_MISSES
    assert summary["targets"]["max_le_3pct"] is False
    assert set(summary["misses"]) == KNOWN_MISSES
    # each other log lies inside its own rounding; the exceptions are named
    outside = {lid for lid, q in tokens.items() if not q["within_rounding"]}
    assert outside == OUTSIDE_ROUNDING
    # concurrency, request bytes and the longest max_model_len that fits: within 0.5 % apart
    # from the same EAGLE miss
    for r in rows:
        for key in ("max_concurrency", "request_kv_gib", "max_model_len_fit"):
            if key in r["quantities"] and r["id"] not in KNOWN_MISSES:
                assert abs(r["quantities"][key]["error_pct"]) <= 0.5, (r["id"], key)


def test_memfit_beats_the_plain_formula_where_the_layout_differs(
        result: tuple[list[dict[str, Any]], dict[str, Any]]) -> None:
    """Explicit head_dim (Qwen3-235B, Mistral-Small-3.2), sliding windows (gpt-oss) and MLA
    (DeepSeek-V2-Lite): the plain formula is off by 20 % or more; memfit within 1.2 %."""
    rows, _ = result
    by_id = {r["id"]: r for r in rows}
    for lid, key in (("vllm21348-qwen3-235b-fp8-tp4-h100", "kv_tokens"),
                     ("vllm21348-qwen3-235b-fp8-tp4-h100-sglang", "kv_tokens"),
                     ("llmd-planner-mistral-small-3.2-h100", "kv_tokens"),
                     ("dl22-gpt-oss-120b-tp4-a100", "kv_tokens"),
                     ("vllm15871-deepseek-v2-lite-chat-request", "request_kv_gib")):
        q = by_id[lid]["quantities"][key]
        assert abs(q["plain_error_pct"]) >= 20, lid
        assert abs(q["error_pct"]) <= 1.2, lid


def test_the_run_writes_its_json(bench: Any, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    assert bench.main(["--out", str(out)]) == 0
    import json
    data = json.loads(out.read_text())
    assert data["summary"]["logs"] >= 19 and data["rows"]
    assert "0.005 GiB" in data["rounding"]
