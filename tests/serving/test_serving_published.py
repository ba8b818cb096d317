"""bench/serving_published.py against the public vLLM / SGLang startup logs it stores.

The expected figures are the engines' own logged lines (each log's quote at its source), never
memfit's output. What the issue asks (issue 22, section 4): KV tokens within 1 % (median) and
3 % (max); weights within 1 %; the profile run's activation peak within 10 %. Each target's
state is asserted as it stands, misses named with their cause, so a change in either direction
fails this test instead of hiding:

- KV tokens: the median is met; the max is not (a speculative-decoding draft layer that holds KV,
  which memfit does not model).
- weights: met on every log but two (a vision encoder that ``weights_from_config`` does not size;
  SGLang's free-memory drop during loading, which holds more than the weights).
- activation peak: within 10 % on 10 of the 11 logs that print it (8 within 1 %), each at its
  release's profile run (the sort-based sampler of V0 and 0.11.0); missed on one, a vLLM 0.11
  run of Mistral-Small-3.2 whose logged peak is below what that sampler alone holds. The
  forward's trace takes seconds a model (transformers' import first), so these tests read the
  stored run of the whole bench (``bench/results/``) and check its rows against the
  torch-free sampler arithmetic and by hand; the live bench here traces nothing.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from _bench import load_bench

GiB = 2**30

# Logs outside 3 % and why: the entry's own "note" says it; these names must match the run.
# (none: the EAGLE log, 3.12 % off while draft layers were not modelled, is now exact)
KNOWN_MISSES: set[str] = set()
# Weights outside 1 %, and why.
WEIGHT_MISSES = {
    # SGLang's "mem usage" is the free-memory drop over loading (rank 0), which holds more than
    # the weights' tensors; memfit sizes vLLM's layout of them
    "llms-in-clouds-qwq-32b-tp4-l4-sglang",
}
# Within 3 % but outside the log's own rounding, and why.
OUTSIDE_ROUNDING = KNOWN_MISSES | {
    # TP 4: one rank's "Available KV cache memory" is quoted; vLLM sizes every rank to the
    # smallest rank's blocks (the pool is 1.1 % under what the quoted rank's 8.11 GiB holds)
    "vllm21348-qwen3-235b-fp8-tp4-h100",
}


@pytest.fixture(scope="module")
def bench() -> Any:
    module = load_bench("serving_published")
    return module


# Activation peaks outside 10 %, and why: the other four vLLM 0.11 logs of the same document
# follow the sort-based sampler to 1 %; this one's 2.12 GiB is below what that sampler alone
# holds for 1,024 rows of 131,072 logits (4.6 GiB), so its run sampled another way (FlashInfer's
# top_k_top_p_sampling_from_logits, no sort, where FlashInfer is importable) or on fewer rows.
# memfit adds the Pixtral encoder's cached outputs of vLLM 0.33's multimodal profile run on top.
ACTIVATION_MISSES = {"llmd-planner-mistral-small-3.2-h100"}


@pytest.fixture(scope="module")
def result(bench: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    return bench.run(activation_in=[])  # no trace: the activation rows are the stored run's


@pytest.fixture(scope="module")
def stored(bench: Any) -> dict[str, Any]:
    """The newest stored run of the whole bench (every activation row)."""
    import json

    newest = sorted(bench.RESULTS_DIR.glob("serving-published-cpu-*.json"))[-1]
    return dict(json.loads(newest.read_text()))


def test_every_log_is_well_formed_and_cited(bench: Any) -> None:
    models, logs = bench.load()
    assert [p for log in logs for p in bench.validate(log, models)] == []
    # 29 logs from 21 public sources (20 print KV tokens); the issue asks for 20
    assert len(logs) >= 29
    assert len({log["id"] for log in logs}) == len(logs)
    for log in logs:
        assert all(line.strip() for line in log["quote"]), log["id"]
    engines = {log["engine"] for log in logs}
    assert engines == {"vllm", "sglang"}
    # at least five of the issue's layouts, each on a log that prints tokens or a request's bytes
    layouts = {la for log in logs for la in log["layouts"]}
    assert {"full_gqa", "explicit_head_dim", "sliding_window", "mla", "tp",
            "kv_head_replication"} <= layouts


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
    assert len(tokens) >= 20
    # median within 1 %: met
    assert summary["memfit"]["median_abs_error_pct"] <= bench.TARGET_MEDIAN
    assert summary["targets"]["median_le_1pct"]
    # max within 3 %: met by every log
    misses = {lid for lid, q in tokens.items() if abs(q["error_pct"]) > bench.TARGET_MAX}
    assert misses == KNOWN_MISSES
    assert summary["targets"]["max_le_3pct"] is True
    assert set(summary["misses"]) == KNOWN_MISSES
    # each other log lies inside its own rounding; the exceptions are named
    outside = {lid for lid, q in tokens.items() if not q["within_rounding"]}
    assert outside == OUTSIDE_ROUNDING
    # concurrency, request bytes and the longest max_model_len that fits: within 0.5 %
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
    assert bench.main(["--out", str(out), "--activation-in", ""]) == 0
    import json
    data = json.loads(out.read_text())
    assert data["summary"]["logs"] >= 29 and data["rows"]
    assert "0.005 GiB" in data["rounding"]
    assert data["device"].startswith("cpu")


def test_the_stored_budget_figures_are_the_quoted_lines(bench: Any) -> None:
    """Every weights / activation / CUDA-graph figure stored in a log entry is what memfit's own
    log reader (``parse_engine_log``) reads from that entry's quote, where it reads one; else
    (a restated table) the figure is printed in the quote, or derived as the entry says."""
    from memfit.errors import MemfitError
    from memfit.serving import parse_engine_log

    _, logs = bench.load()
    parsed_checks = 0
    for log in logs:
        text = "\n".join(log["quote"])
        try:
            parsed = parse_engine_log(text)
        except MemfitError:  # a refused start or a restated table: no startup lines to read
            parsed = None
        for key, attr in (("weights_gib", "weights_bytes"),
                          ("activation_gib", "activation_peak_bytes"),
                          ("cuda_graph_gib", "cuda_graph_bytes")):
            if key not in log["logged"]:
                continue
            read = getattr(parsed, attr) if parsed is not None else None
            if read is not None:
                assert abs(read / GiB - log["logged"][key]) < 6e-5, (log["id"], key)
                parsed_checks += 1
            else:
                assert (f"{log['logged'][key]:.2f}" in text or key in log.get(
                    "logged_derivation", {}) or "weights line is quoted in" in log.get(
                    "note", "")), (log["id"], key)
    assert parsed_checks >= 19


def test_weights_by_hand_and_the_target_as_it_stands(
        result: tuple[list[dict[str, Any]], dict[str, Any]], bench: Any) -> None:
    """Llama-3.1-8B in bf16 (vllm #10517, 'Loading model weights took 14.9888 GB'): 8,030,261,248
    parameters x 2 B + the RoPE cache, 131,072 positions x 128 x 2 B = 32 MiB:
    16,094,076,928 B = 14.98878 GiB. Qwen3-0.6B (vllm PR #24577, 1.1201 GiB), tied embeddings:
    596,049,920 parameters x 2 B + 40,960 x 128 x 2 B."""
    rows, summary = result
    by_id = {r["id"]: r["quantities"] for r in rows}
    llama = by_id["vllm10517-llama31-8b-3090-20k"]["weights_gib"]
    assert llama["predicted"] == (8_030_261_248 * 2 + 131072 * 128 * 2) / GiB
    assert abs(llama["error_pct"]) < 0.01
    qwen = by_id["pr24577-qwen3-0.6b-a100-bf16"]["weights_gib"]
    assert qwen["predicted"] == (596_049_920 * 2 + 40960 * 128 * 2) / GiB
    # llm-d-planner's rule on the same tensors: no RoPE cache (no vocabulary padding here)
    assert qwen["llm_d_planner"] == 596_049_920 * 2 / GiB
    # the target: every log within 1 % but the two named
    weights = {r["id"]: r["quantities"]["weights_gib"] for r in rows
               if "weights_gib" in r["quantities"]}
    assert len(weights) >= 19
    assert {lid for lid, q in weights.items()
            if abs(q["error_pct"]) > bench.TARGET_WEIGHTS} == WEIGHT_MISSES
    assert set(summary["weights"]["misses"]) == WEIGHT_MISSES
    assert summary["targets"]["weights_le_1pct"] is False
    assert all(abs(q["error_pct"]) <= 2.0 for q in weights.values())
    # gpt-oss's mxfp4 weights are printed but not predicted, with the reason
    assert "mxfp4" in summary["not_compared"]["dl22-gpt-oss-120b-tp4-a100"]["weights_gib"]


def test_each_log_is_predicted_at_its_release(bench: Any) -> None:
    """The release memfit models for each log's version: V0 (0.6, or not stated with V0's
    lines) and 0.11 exactly; 0.10.1.1 is not a modelled release (0.33's rules, said so)."""
    _, logs = bench.load()
    by_id = {log["id"]: log for log in logs}
    version = bench.modelled_engine_version
    assert version(by_id["vllm10517-llama31-8b-3090-20k"]) == "0.6.4.post1"
    assert version(by_id["discuss2724-llama32-3b-t4-8k"]) == "0.7.3"
    assert version(by_id["llmd-doc-llama31-8b-h100"]) == "0.11.0"
    assert version(by_id["arm-mistral-7b-gptq-dgx-spark"]) == "0.11.0"
    assert version(by_id["dl22-qwen2-7b-a100-0.25"]) is None
    assert version(by_id["llms-in-clouds-qwq-32b-tp4-l4-sglang"]) is None


def _sort_sampler_bytes(*, rows: int, vocab: int, hidden: int, tokens: int, v1: bool) -> int:
    """The sampler phase of the sort-based path, by hand (every size here is a multiple of
    512 B but V0's small tensors): the hidden states of every token (V1 also the rows and their
    rand_like), the 16-bit logits, their float32 copy, and inside logits.sort the values
    (4 B), indices (8 B), the source-index iota (8 B) and CUB's alternate keys + values
    (12 B); small: V1's dummy metadata (5 float32, top-k int64) and argmax ids (int64); V0's
    SamplingTensors (6 in fp16, each under 512 B here, and top-k int32)."""
    held = tokens * hidden * 2 + (2 * rows * hidden * 2 if v1 else 0)
    small = (5 * rows * 4 + 2 * rows * 8) if v1 else (6 * max(rows * 2, 512) + rows * 4)
    return held + rows * vocab * (2 + 4 + 4 + 8 + 8 + 12) + small


def test_the_activation_peak_by_hand_at_each_release(stored: dict[str, Any]) -> None:
    """Llama-3.2-3B on a T4 (V0, NIM; 8,192 tokens, 256 sequences, 'PyTorch activation peak
    memory takes 1.22GiB') and Qwen3-0.6B on an H100 (vLLM 0.11.0; 8,192 tokens, 1,024
    sequences, 'torch peak memory increase' 5.56 GiB): the sort-based sampler sets the peak,
    38 bytes a logit plus what is held; by hand, the stored run's figure, within 1 % of both
    logs. At 0.33's rules (Triton top-k/top-p, no sort) the same runs would be 60 % lower:
    the release matters. The 3090 log at 20,000 tokens: the forward sets the peak."""
    from memfit.serving.profile_run import sampler_peak

    rows = {r["id"]: r["quantities"] for r in stored["rows"]}
    t4 = rows["discuss2724-llama32-3b-t4-8k"]["activation_gib"]
    assert t4["engine_version"] == "0.7.3" and t4["source"] == "profile_run"
    hand = _sort_sampler_bytes(rows=256, vocab=128256, hidden=3072, tokens=8192, v1=False)
    assert hand == 1_298_010_112
    kw = {"max_num_batched_tokens": 8192}
    assert sampler_peak(vocab_size=128256, hidden_size=3072, max_num_seqs=256,
                        engine_version="0.7.3", **kw).peak_bytes == hand
    assert t4["predicted"] == hand / GiB
    assert abs(t4["error_pct"]) < 1.0
    qwen = rows["llmd-doc-qwen3-0.6b-h100"]["activation_gib"]
    assert qwen["engine_version"] == "0.11.0"
    hand = _sort_sampler_bytes(rows=1024, vocab=151936, hidden=1024, tokens=8192, v1=True)
    assert hand == 5_933_142_016
    assert sampler_peak(vocab_size=151936, hidden_size=1024, max_num_seqs=1024,
                        engine_version="0.11.0", **kw).peak_bytes == hand
    assert qwen["predicted"] == hand / GiB
    assert abs(qwen["error_pct"]) < 1.0
    at_033 = sampler_peak(vocab_size=151936, hidden_size=1024, max_num_seqs=1024, **kw)
    assert at_033.peak_bytes < 0.4 * 5.56 * GiB
    llama = rows["vllm10517-llama31-8b-3090-20k"]["activation_gib"]
    assert llama["engine_version"] == "0.6.4.post1"
    sampler = _sort_sampler_bytes(rows=256, vocab=128256, hidden=4096, tokens=20000, v1=False)
    assert llama["predicted"] > 1.4 * sampler / GiB
    assert abs(llama["error_pct"]) < 10.0


def test_the_activation_target_as_it_stands(
        result: tuple[list[dict[str, Any]], dict[str, Any]], stored: dict[str, Any],
        bench: Any) -> None:
    """Every log printing the activation peak, in the stored run of the whole bench: within
    10 % but the named miss, 8 of 11 within 1 %; each sampler-bound row is what the current
    sampler arithmetic gives (a stale results file fails here)."""
    from memfit.serving.profile_run import sampler_peak

    rows, summary = result
    assert not any("activation_gib" in r["quantities"] for r in rows)  # nothing traced live
    assert summary["activation"]["logs"] == []
    full = stored["summary"]["activation"]
    assert len(full["logs"]) == 11 and full["sources"] == ["profile_run"]
    assert set(full["misses"]) == ACTIVATION_MISSES and full["met"] is False
    assert stored["summary"]["targets"]["activation_le_10pct"] is False
    act = {r["id"]: r["quantities"]["activation_gib"] for r in stored["rows"]
           if "activation_gib" in r["quantities"]}
    assert {lid for lid, q in act.items()
            if abs(q["error_pct"]) > bench.TARGET_ACTIVATION} == ACTIVATION_MISSES
    assert act["llmd-planner-mistral-small-3.2-h100"]["error_pct"] > 100
    assert len({lid for lid, q in act.items() if abs(q["error_pct"]) <= 1.0}) == 8
    models, logs = bench.load()
    checked = 0
    for log in logs:
        if log["id"] not in act or log["id"].startswith("vllm10517"):  # forward-bound
            continue
        if "vision_config" in models[log["model"]]["config"]:  # the encoder's outputs on top
            continue
        config = models[log["model"]]["config"]
        text = config.get("text_config") or config
        s = log["settings"]
        peak = sampler_peak(vocab_size=text["vocab_size"], hidden_size=text["hidden_size"],
                            max_num_batched_tokens=s.get("max_num_batched_tokens", 8192),
                            max_num_seqs=s.get("max_num_seqs", 1024), tp=log["tp"],
                            engine_version=bench.modelled_engine_version(log))
        assert act[log["id"]]["engine_version"] == bench.modelled_engine_version(log)
        assert act[log["id"]]["predicted"] == peak.peak_bytes / GiB, log["id"]
        checked += 1
    assert checked == 8


def test_cuda_graph_memory_is_shown_with_its_version(
        result: tuple[list[dict[str, Any]], dict[str, Any]]) -> None:
    """vLLM 0.10.1.1 (dennislee22's logs) captures 67 PIECEWISE graphs and logs 0.50 GiB (TP 1)
    and 0.65 GiB (TP 2). memfit's estimate is vLLM 0.33's (FULL_AND_PIECEWISE, 51 + 35 graphs
    at 24 MiB each after the first): about 2 GiB, 3 to 4 times the logged figure; at the log's
    own 67 PIECEWISE sizes the same per-graph constant still gives 1.59 GiB. The graphs of
    0.10 cost 0.50 GiB / 67 = 7.6 MiB each: no target, the gap is stated."""
    rows, _ = result
    graphs = {r["id"]: r["quantities"]["cuda_graph_gib"] for r in rows
              if "cuda_graph_gib" in r["quantities"]}
    assert set(graphs) == {"dl22-qwen2-7b-a100-0.25", "dl22-qwen2-7b-a100-0.5",
                           "dl22-qwen2-7b-tp2-a100-0.5"}
    for q in graphs.values():
        assert q["graphs"] == {"PIECEWISE": 51, "FULL": 35}
        assert q["error_pct"] > 150
        assert q["at_log_sizes_error_pct"] > 100
    one = graphs["dl22-qwen2-7b-a100-0.25"]
    # 512 tokens x (3584 + 2 x 18944) x 2 B for the first capture, then 66 x 24 MiB
    assert one["at_log_sizes"] == (512 * (3584 + 2 * 18944) * 2 + 66 * 24 * 2**20) / GiB


def test_kv_head_replication_and_sglangs_pool_rule(
        result: tuple[list[dict[str, Any]], dict[str, Any]]) -> None:
    """Qwen3-Coder-30B-A3B at TP 8 over 4 KV heads (vllm #22177): each rank keeps one KV head,
    2 x 48 x 1 x 128 x 2 = 24,576 B a token; 12.22 GiB holds 33,368 blocks of 16 (533,888
    tokens) and the logged 534,064 (33,379 blocks, 12.2237 GiB) is inside the rounding. The
    peers split 4 heads 8 ways: llm-d-planner +100 %, the plain formula (head_dim 2048 / 32 = 64)
    +300 %. SGLang 0.4.3 on 4 x L4 (QwQ-32B): 'avail mem=6.09 GB' after 'mem usage=15.54 GB',
    --mem-fraction-static 0.85: (6.09 - 21.63 x 0.15) GiB / 262,144 B a token = 46,620 tokens,
    logged 46,611 (within the printed figures' rounding)."""
    rows, _ = result
    by_id = {r["id"]: r["quantities"] for r in rows}
    q = by_id["vllm22177-qwen3-coder-30b-a3b-tp8-24gb"]["kv_tokens"]
    assert q["predicted"] == (round(12.22 * GiB) // (16 * 24576)) * 16 == 533_888
    assert q["within_rounding"]
    assert 99 < q["llm_d_planner_error_pct"] < 101 and 299 < q["plain_error_pct"] < 301
    sgl = by_id["llms-in-clouds-qwq-32b-tp4-l4-sglang"]["kv_tokens_sglang_plan"]
    cell = 2 * 64 * 2 * 128 * 2  # 64 layers, 8 KV heads / TP 4, 128, bf16
    assert sgl["predicted"] == int(int((6.09 - 21.63 * 0.15) * GiB) // cell)
    assert sgl["within_rounding"]


def test_eagle_draft_layer_shares_the_pool(
        result: tuple[list[dict[str, Any]], dict[str, Any]]) -> None:
    """vllm #19996 (Llama-3.1-8B + EAGLE): 51.63 GiB / (33 layers x 64 KiB) = 25,633 blocks of
    16 tokens = 410,128, the logged figure (32 layers would give 26,434 blocks, +3.1 %)."""
    rows, _ = result
    row = next(r for r in rows if r["id"] == "vllm19996-llama31-8b-eagle-h100")
    assert int(51.63 * GiB) // (33 * 16 * 8 * 256 * 2) * 16 == 410_128
    assert row["quantities"]["kv_tokens"]["predicted"] == 410_128
