"""The continuous-batching simulator: schedules worked out by hand from vLLM 0.33's rules
(``vllm/v1/core/sched/scheduler.py: Scheduler.schedule``), roofline step times computed by hand,
workload generation and trace files, and the CLI's one-line errors.

Every schedule test uses a toy roofline whose step takes exactly 1 s (the weights' bytes over
the bandwidth; KV bytes 0, FLOPs negligible), so a time is a step count.
"""

from __future__ import annotations

import itertools
import json
import math

import pytest

from memfit.cli import main
from memfit.errors import MemfitError
from memfit.serving import (
    Request,
    Roofline,
    model_flop_params,
    poisson_requests,
    read_trace,
    roofline_for,
    serve_plan,
    simulate,
)

LLAMA_KV_TOKEN = 32 * 8 * 2 * 128 * 2  # layers x kv heads x (K + V) x head_dim x bf16 bytes
ONE_SECOND = Roofline(peak_flops=1e15, bandwidth=1000.0, params=1, weights_bytes=1000,
                      kv_bytes_per_token=0, compute_efficiency=1.0, bandwidth_efficiency=1.0)


def plan(blocks: int, *, block_size: int = 4, budget: int = 64, max_model_len: int = 16,
         max_num_seqs: int | None = None):
    # vLLM refuses max_num_seqs above max_num_batched_tokens: at most 64, at most the budget
    p = serve_plan("llama-3-8b", kv_cache_memory=blocks * block_size * LLAMA_KV_TOKEN,
                   block_size=block_size, max_model_len=max_model_len,
                   max_num_batched_tokens=budget, max_num_seqs=max_num_seqs or min(64, budget))
    assert p.num_gpu_blocks == blocks
    return p


def reqs(*lengths: tuple[int, int], at: float = 0.0) -> list[Request]:
    return [Request(arrival_time=at, prompt_tokens=p, output_tokens=o) for p, o in lengths]


def test_chunked_prefill_schedule():
    # A(10 prompt, 3 out), B(6, 2), C(4, 1) at t=0; token budget 8, 4-token blocks.
    # step 1: A gets 8 of its 10 prompt tokens (chunked), budget spent.
    # step 2: A's last 2 (first token), B's 6 (first token).      blocks: A 3, B 2
    # step 3: A, B decode 1 each (B done), C's 4 (first = last).   blocks: 3 + 2 + 1 = 6
    # step 4: A decodes its 3rd token.
    sim = simulate(plan(64, budget=8, max_model_len=32), reqs((10, 3), (6, 2), (4, 1)),
                   roofline=ONE_SECOND)
    c = sim.continuous
    assert c.ttft_s == (2.0, 2.0, 3.0)
    assert c.finish_s == (4.0, 3.0, 3.0)
    assert c.tpot_s == (1.0, 1.0)  # A (4 - 2) / 2, B (3 - 2) / 1; C has one token
    assert (c.steps, c.duration_s, c.peak_kv_blocks, c.preemptions) == (4, 4.0, 6, 0)
    assert c.output_throughput == 6 / 4 and c.request_throughput == 3 / 4


def test_static_batching_waits_for_the_batch():
    # The same three as one batch: one padded prefill (t=1), then decode for the longest
    # output (2 more steps); C's only token at 1, B's last at 2, A's at 3.
    s = simulate(plan(64, budget=8, max_model_len=32), reqs((10, 3), (6, 2), (4, 1)),
                 roofline=ONE_SECOND).static
    assert s is not None
    assert s.ttft_s == (1.0, 1.0, 1.0) and s.finish_s == (3.0, 2.0, 1.0)
    assert s.peak_kv_blocks == 3 * math.ceil((10 + 3 - 1) / 4)


def test_preemption_by_recompute():
    # 5 blocks (4 free: one is vLLM's null block) of 4 tokens; A(7, 4), B(5, 4) at t=0.
    # step 1: both prefilled (2 + 2 blocks, none free).  step 2: both decode in their blocks.
    # step 3: A's 9th token needs a 3rd block: B (the last running) is preempted, its blocks
    #         freed and its computed tokens reset; no admission in a step that preempted.
    # step 4: A decodes; B needs cdiv(5 + 2, 4) = 2 blocks for its tokens so far, 1 is free.
    #         A finishes (4 tokens).
    # step 5: B recomputes its prompt and 2 outputs (7 tokens), samples its 3rd.  step 6: 4th.
    sim = simulate(plan(5), reqs((7, 4), (5, 4)), roofline=ONE_SECOND)
    c = sim.continuous
    assert c.preemptions == 1
    assert c.ttft_s == (1.0, 1.0)  # B's first token was streamed before the preemption
    assert c.finish_s == (4.0, 6.0)
    assert c.tpot_s == (1.0, 5 / 3)
    assert (c.steps, c.peak_kv_blocks) == (6, 4)
    s = sim.static  # a padded batch of both needs 2 x cdiv(10, 4) = 6 blocks: one at a time
    assert s is not None and s.ttft_s == (1.0, 5.0) and s.finish_s == (4.0, 8.0)


def test_admission_needs_the_whole_prompt_free():
    # scheduler_reserve_full_isl: B's first 3-token chunk would fit a free block, but its 12
    # prompt tokens need 3 blocks and A holds 2 of the 4, so B waits for A to finish (t=8:
    # 1 prefill + 7 decodes) and then prefills in 3 chunks of the 4-token budget.
    sim = simulate(plan(5, budget=4), reqs((4, 8), (12, 1)), roofline=ONE_SECOND)
    c = sim.continuous
    assert c.finish_s == (8.0, 11.0) and c.ttft_s == (1.0, 11.0) and c.preemptions == 0


def test_max_num_seqs_and_client_concurrency():
    # max_num_seqs 1: B waits in the engine (TTFT from t=0); with one client slot instead B is
    # only sent when A finishes (TTFT from t=2), as vllm bench serve --max-concurrency 1.
    engine = simulate(plan(64, max_num_seqs=1), reqs((4, 2), (4, 2)), roofline=ONE_SECOND)
    assert engine.continuous.finish_s == (2.0, 4.0) and engine.continuous.ttft_s == (1.0, 3.0)
    client = simulate(plan(64), reqs((4, 2), (4, 2)), roofline=ONE_SECOND, max_concurrency=1)
    assert client.continuous.finish_s == (2.0, 4.0) and client.continuous.ttft_s == (1.0, 1.0)


def test_idle_engine_waits_for_arrivals():
    r = [Request(arrival_time=0.0, prompt_tokens=4, output_tokens=1),
         Request(arrival_time=10.5, prompt_tokens=4, output_tokens=1)]
    c = simulate(plan(64), r, roofline=ONE_SECOND).continuous
    assert c.finish_s == (1.0, 11.5) and c.ttft_s == (1.0, 1.0) and c.duration_s == 11.5


def test_roofline_step_times_by_hand():
    r = Roofline(peak_flops=1e8, bandwidth=1e9, params=1000, lm_head_params=100,
                 attention_flops_per_pair=10, weights_bytes=500_000, kv_bytes_per_token=100,
                 compute_efficiency=0.5, bandwidth_efficiency=0.5)
    # prefill of 100 tokens: FLOPs 2*1000*100 + 2*100*1 + 10*(100*101/2) = 250,700 at 5e7/s
    # = 5.014 ms; bytes 500,000 + 100*100 at 5e8/s = 1.02 ms -> compute-bound
    prefill = r.step_seconds(tokens=100, rows=1, context_tokens=100, attention_pairs=5050)
    assert prefill == pytest.approx(250_700 / 5e7, rel=1e-12)
    # decode at 100 cached: FLOPs 2000 + 200 + 10*101 = 3,210 (64.2 us); bytes 510,100
    # (1.0202 ms) -> bandwidth-bound
    decode = r.step_seconds(tokens=1, rows=1, context_tokens=101, attention_pairs=101)
    assert decode == pytest.approx(510_100 / 5e8, rel=1e-12)
    c = simulate(plan(64, budget=128, max_model_len=128), reqs((100, 2)), roofline=r).continuous
    assert c.ttft_s[0] == pytest.approx(250_700 / 5e7, rel=1e-12)
    assert c.tpot_s[0] == pytest.approx(510_100 / 5e8, rel=1e-12)


def test_llama_3_8b_on_h100_roofline():
    cfg = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256}
    # per layer: q,k,v 4096 x (4096 + 2 x 1024), o 4096 x 4096, gate/up/down 3 x 4096 x 14336
    layer = 4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336
    assert model_flop_params(cfg) == (32 * layer, 128256 * 4096, 4 * 32 * 32 * 128)
    p = serve_plan("llama-3-8b", kv_cache_memory=2**30, max_model_len=2048)
    r = roofline_for(p, gpu="h100-sxm-80gb")
    assert r.kv_bytes_per_token == LLAMA_KV_TOKEN
    assert (r.peak_flops, r.bandwidth) == (989.4e12, 3350e9)  # the catalog's bf16 and HBM3
    # a lone decode at 1,000 cached tokens: (weights + 1,001 tokens of KV) at 0.9 x 3.35 TB/s
    want = (r.weights_bytes + 1001 * LLAMA_KV_TOKEN) / (0.9 * 3350e9)
    assert r.step_seconds(tokens=1, rows=1, context_tokens=1001,
                          attention_pairs=1001) == pytest.approx(want, rel=1e-12)


def test_bad_plans_and_requests():
    with pytest.raises(MemfitError, match="max_model_len"):
        simulate(plan(64), reqs((10, 7)), roofline=ONE_SECOND)
    with pytest.raises(MemfitError, match="no requests"):
        simulate(plan(64), [], roofline=ONE_SECOND)
    with pytest.raises(MemfitError, match="sliding"):
        simulate(serve_plan("mistral-7b", kv_cache_memory=2**30, max_model_len=4096),
                 reqs((4, 4)), roofline=ONE_SECOND)


def test_poisson_requests_seeded():
    a = poisson_requests(200, 4.0, prompt_tokens=100, output_tokens=50, lengths="lognormal",
                         spread=0.5, seed=3)
    assert a == poisson_requests(200, 4.0, prompt_tokens=100, output_tokens=50,
                                 lengths="lognormal", spread=0.5, seed=3)
    assert a != poisson_requests(200, 4.0, prompt_tokens=100, output_tokens=50,
                                 lengths="lognormal", spread=0.5, seed=4)
    gaps = [b.arrival_time - x.arrival_time for x, b in itertools.pairwise(a)]
    assert 0.15 < sum(gaps) / len(gaps) < 0.35  # mean gap 1 / qps = 0.25 s
    assert 80 < sum(r.prompt_tokens for r in a) / len(a) < 120
    u = poisson_requests(50, math.inf, prompt_tokens=100, output_tokens=10, lengths="uniform",
                         spread=0.2)
    assert all(r.arrival_time == 0 and 80 <= r.prompt_tokens <= 120 for r in u)
    for bad in (0, -1.0):
        with pytest.raises(MemfitError, match="qps"):
            poisson_requests(5, bad, prompt_tokens=1, output_tokens=1)


def test_read_trace(tmp_path):
    jl = tmp_path / "t.jsonl"
    jl.write_text('{"arrival_time": 1.5, "prompt_tokens": 10, "output_tokens": 2}\n\n'
                  '{"arrival_time": 0, "prompt_tokens": 3, "output_tokens": 1}\n')
    assert read_trace(jl) == reqs((3, 1)) + reqs((10, 2), at=1.5)
    cs = tmp_path / "t.csv"
    cs.write_text("arrival_time,prompt_tokens,output_tokens\n0.25,8,4\n")
    assert read_trace(cs) == reqs((8, 4), at=0.25)
    (tmp_path / "e.jsonl").write_text("")
    with pytest.raises(MemfitError, match="empty"):
        read_trace(tmp_path / "e.jsonl")
    (tmp_path / "m.jsonl").write_text('{"arrival_time": 0, "prompt_tokens": 3}\n')
    with pytest.raises(MemfitError, match=r"m.jsonl:1: missing output_tokens"):
        read_trace(tmp_path / "m.jsonl")
    (tmp_path / "x.csv").write_text("arrival_time,prompt_tokens,output_tokens\n0,ten,1\n")
    with pytest.raises(MemfitError, match=r"x.csv:2"):
        read_trace(tmp_path / "x.csv")


def test_cli_json(capsys):
    assert main(["simulate", "llama-3-8b", "--gpu", "h100-sxm-80gb", "--kv-cache-memory",
                 "1GiB", "--max-model-len", "2048", "--qps", "4", "--num-requests", "8",
                 "--prompt-tokens", "128", "--output-tokens", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["continuous"]["num_requests"] == 8 and out["static"]["num_requests"] == 8
    assert set(out["continuous"]["ttft_s"]) == {"mean", "p50", "p90", "p95", "p99"}
    assert out["num_gpu_blocks"] == 512 and out["prefix_caching"] is False


@pytest.mark.parametrize("args, message", [
    (["--qps", "0"], "--qps"),
    (["--qps", "-2"], "--qps"),
    (["--trace", "EMPTY"], "empty trace"),
    (["--trace", "BAD"], "not JSON"),
    ([], "--qps"),
    # the trace's rows set each request: the generator's flags were ignored
    (["--trace", "GOOD", "--num-requests", "50"], "--num-requests shape generated requests"),
    (["--trace", "GOOD", "--prompt-tokens", "9", "--seed", "1"], "--prompt-tokens, --seed"),
    # fixed lengths (the default) have no spread
    (["--qps", "2", "--spread", "0.3"], "--spread varies the lengths"),
])
def test_cli_bad_input_is_one_line(tmp_path, capsys, args, message):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "bad.jsonl").write_text("{arrival_time: 0}\n")
    (tmp_path / "good.jsonl").write_text(
        '{"arrival_time": 0, "prompt_tokens": 10, "output_tokens": 5}\n')
    args = [{"EMPTY": str(tmp_path / "empty.jsonl"), "BAD": str(tmp_path / "bad.jsonl"),
             "GOOD": str(tmp_path / "good.jsonl")}.get(a, a) for a in args]
    code = main(["simulate", "llama-3-8b", "--gpu", "h100-sxm-80gb", "--kv-cache-memory",
                 "1GiB", "--max-model-len", "2048", *args])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1


def test_fp8_roofline_reads_fp8_weights_at_the_fp8_peak():
    from memfit.gpus import get_gpu

    p = serve_plan("llama-3-8b", kv_cache_memory=2**30, max_model_len=2048)
    bf16 = roofline_for(p, gpu="h100-sxm-80gb")
    fp8 = roofline_for(p, gpu="h100-sxm-80gb", quant="fp8")
    assert fp8.peak_flops == get_gpu("h100-sxm-80gb").tflops["fp8"] * 1e12 > bf16.peak_flops
    # the linear layers' weights go from 2 bytes to 1 (plus per-tensor fp32 scales); embedding
    # and LM head stay bf16: 2 x 525,336,576 x 2 bytes
    heads = 2 * 128256 * 4096 * 2
    assert fp8.weights_bytes - heads == pytest.approx((bf16.weights_bytes - heads) / 2, rel=2e-3)
