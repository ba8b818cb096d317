"""``rightsize_serving`` and ``memfit rightsize --serve`` on a toy model and a toy GPU whose step
times are computable by hand: replica counts against an independent queue recursion, the price
override and the stale flag, the Pareto front, and bad input (one line, exit 2)."""

from __future__ import annotations

import datetime as dt
import json
import random
from pathlib import Path

import numpy as np
import pytest

from memfit.cli import main
from memfit.errors import MemfitError
from memfit.serving.prices import GpuPrice, load_prices, price_is_stale
from memfit.serving.rightsize import pareto_front, rightsize_serving

TOY = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
       "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
       "vocab_size": 256, "max_position_embeddings": 4096, "tie_word_embeddings": False,
       "torch_dtype": "bfloat16"}

# The toy GPU: 0.01 dense bf16 TFLOPS (1e10 FLOP/s, 0.8 of it reached: the roofline's default)
# and a bandwidth so high that every step is compute-bound.
TOY_GPU = {"name": "toy-gpu-8gb", "memory_bytes": 8 * 2**30, "bandwidth_gbps": 1e9,
           "tflops": {"fp32": 0.01, "tf32": None, "fp16": 0.01, "bf16": 0.01, "fp8": 0.01},
           "bf16": True, "fp8": True, "compute_capability": "9.0",
           "host_link": {"kind": "PCIe 5.0 x16", "gbps": 63.0},
           "price_per_hour": 2.0, "price_source": "test", "price_date": "2026-01-01"}
RATE = 1e10 * 0.8

# The toy's FLOPs by hand (memfit.serving.roofline's formula): per layer q/k/v/o
# 64 x (4 + 2 x 2) x 16 + 4 x 16 x 64 = 12,288 and a gated MLP 3 x 64 x 128 = 24,576: 2 layers
# 73,728 parameters; LM head 256 x 64 = 16,384; attention 4 x 2 layers x 4 heads x 16 = 512
# FLOPs a query-key pair.
PARAMS, LM_HEAD, PAIR = 73_728, 16_384, 512
PROMPT = 2048  # = the toy GPU's max_num_batched_tokens (vLLM's default under 70 GiB): one
# prompt per step
# A request of 2048 prompt tokens and 1 output token is one step of:
STEP_S = (2 * PARAMS * PROMPT + 2 * LM_HEAD * 1 + PAIR * PROMPT * (PROMPT + 1) // 2) / RATE


@pytest.fixture(autouse=True)
def toy_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "gpus.json"
    path.write_text(json.dumps({"gpus": [TOY_GPU]}))
    monkeypatch.setenv("MEMFIT_GPU_FILE", str(path))


def _size(**kw: object):  # type: ignore[no-untyped-def]
    args = dict(qps=30.0, prompt_tokens=PROMPT, output_tokens=1, gpus=["toy-gpu-8gb"], tp=[1],
                quant=["none"], activation_peak_bytes=0, num_requests=200)
    args.update(kw)
    return rightsize_serving(TOY, **args)  # type: ignore[arg-type]


def _lindley_p95(qps_per_replica: float, n: int = 200, seed: int = 0) -> float:
    """One server, one request a step of STEP_S, first come first served: the p95 TTFT of the
    seeded Poisson arrivals (poisson_requests' stream: the first at 0, then expovariate gaps)."""
    rng = random.Random(seed)
    t, arrivals = 0.0, []
    for _ in range(n):
        arrivals.append(t)
        t += rng.expovariate(qps_per_replica)
    finish, ttft = 0.0, []
    for a in arrivals:
        finish = max(a, finish) + STEP_S
        ttft.append(finish - a)
    return float(np.percentile(ttft, 95))


def test_replicas_are_the_fewest_that_meet_the_ttft_target() -> None:
    target = 0.5
    expected = next(r for r in range(1, 100) if _lindley_p95(30.0 / r) <= target)
    assert expected > 5  # 30 req/s x 0.172 s = 5.2 busy servers: the queue decides it
    result = _size(p95_ttft_s=target)
    (c,) = result.candidates
    assert c.replicas == expected
    assert c.p95_ttft_s == pytest.approx(_lindley_p95(30.0 / expected), rel=1e-9)
    assert c.p95_tpot_s is None  # one output token: no TPOT
    assert c.to_json()["cost_per_hour"] == pytest.approx(expected * 2.0)
    # $ per million output tokens: cost over 30 x 3600 tokens an hour
    assert c.to_json()["usd_per_million_tokens"] == pytest.approx(expected * 2.0 / 108_000 * 1e6)


def test_without_latency_targets_the_throughput_bound_decides() -> None:
    # a request's matmul FLOPs 2 x params x (P + O) + 2 x lm_head x O at 8e9 FLOP/s: 0.0378 s;
    # 30 req/s need floor(30 x 0.0378) + 1 = 2 replicas to keep up
    t_request = (2 * PARAMS * (PROMPT + 1) + 2 * LM_HEAD) / RATE
    assert int(30 * t_request) + 1 == 2
    (c,) = _size().candidates
    assert c.replicas == 2 and c.count == 2


def test_tp_multiplies_the_gpus_and_the_cost() -> None:
    out = _size(tp=[1, 2], p95_ttft_s=0.5).to_json()
    by_tp = {c["tp"]: c for c in out["candidates"]}
    assert by_tp[2]["count"] == 2 * by_tp[2]["replicas"]
    assert by_tp[2]["cost_per_hour"] == pytest.approx(by_tp[2]["count"] * 2.0)
    costs = [c["cost_per_hour"] for c in out["candidates"]]
    assert costs == sorted(costs)
    assert set(out["candidates"][0]) == {
        "gpu", "count", "tp", "quant", "replicas", "pricing", "price_per_gpu_hour",
        "price_date", "price_source", "stale_price", "cost_per_hour", "usd_per_million_tokens",
        "usd_per_million_total_tokens", "p95_ttft_s", "p95_tpot_s", "kv_cache_tokens"}


def test_a_price_override_and_the_stale_flag() -> None:
    prices = {"toy-gpu-8gb": {"price_per_hour": 1.5, "source": "my quote",
                              "date": "2025-01-01"}}
    (c,) = _size(prices=prices, today=dt.date(2026, 6, 1)).candidates
    out = c.to_json()
    assert (out["price_per_gpu_hour"], out["price_source"], out["price_date"]) == \
        (1.5, "my quote", "2025-01-01")
    assert out["stale_price"] is True  # 516 days > 365
    assert out["cost_per_hour"] == pytest.approx(2 * 1.5)
    (c,) = _size(prices=prices, today=dt.date(2025, 12, 31)).candidates
    assert c.stale_price is False  # 364 days
    (c,) = _size(today=dt.date(2026, 6, 1)).candidates  # the catalog's 2026-01-01
    assert (c.price.price_per_hour, c.stale_price) == (2.0, False)


def test_price_age_edges() -> None:
    p = GpuPrice(price_per_hour=1.0, source=None, date="2025-06")  # read as 2025-06-01
    assert price_is_stale(p, today=dt.date(2025, 7, 1), max_age_days=30) is False
    assert price_is_stale(p, today=dt.date(2025, 7, 2), max_age_days=30) is True
    assert price_is_stale(GpuPrice(price_per_hour=1.0, source=None, date=None),
                          today=dt.date(2025, 1, 1)) is True


def test_a_prices_file_in_yaml(tmp_path: Path) -> None:
    path = tmp_path / "prices.yaml"
    path.write_text("toy-gpu-8gb: {price_per_hour: 0.5, source: quote, date: 2026-11-01}\n")
    got = load_prices(path, today=dt.date(2026, 11, 1))["toy-gpu-8gb"]  # dated today: taken
    assert got == GpuPrice(price_per_hour=0.5, source="quote", date="2026-11-01")


@pytest.mark.parametrize("date", ["2026-11-02", "2026-12"])
def test_a_price_dated_after_today_is_refused(date: str) -> None:
    prices = {"toy-gpu-8gb": {"price_per_hour": 1.0, "date": date}}
    with pytest.raises(MemfitError, match=f"toy-gpu-8gb: price date {date} is after today "
                                          r"\(2026-11-01\)"):
        load_prices(prices, today=dt.date(2026, 11, 1))
    with pytest.raises(MemfitError, match="after today"):  # the search passes its today on
        _size(prices=prices, today=dt.date(2026, 11, 1))


def test_pareto_front_on_a_hand_made_list() -> None:
    points = [(1.0, 0.9, 0.05),   # cheapest: on the front
              (2.0, 0.5, 0.04),   # dearer, faster: on it
              (2.0, 0.6, 0.04),   # dominated by the one above
              (3.0, 0.5, 0.03),   # dearer, same TTFT, better TPOT: on it
              (3.0, 0.9, 0.05),   # dominated by the first
              (1.0, 0.9, 0.05)]   # equal to the first: kept
    assert pareto_front(points) == (0, 1, 3, 5)


def test_the_unmet_latency_target_names_the_closest() -> None:
    closest = r"closest is toy-gpu-8gb tp1 none \(one request alone.*p95 TTFT "
    with pytest.raises(MemfitError, match=closest + f"{STEP_S * 1e3:.1f} ms"):
        _size(p95_ttft_s=STEP_S / 2)


@pytest.mark.parametrize("qps", [0.0, -1.0, float("inf")])
def test_bad_qps(qps: float) -> None:
    with pytest.raises(MemfitError, match="--qps"):
        _size(qps=qps)


def _cli(capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str, str]:
    code = main(["rightsize", *extra])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def toy_config(tmp_path: Path) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TOY))
    return str(path)


def test_cli_json_and_table(capsys: pytest.CaptureFixture[str], toy_config: str) -> None:
    args = [toy_config, "--serve", "--qps", "30", "--prompt-tokens", str(PROMPT),
            "--output-tokens", "1", "--gpus", "toy-gpu-8gb", "--tp", "1", "--quant", "none",
            "--p95-ttft", "500ms", "--num-requests", "200", "--activation-peak", "0"]
    code, out, err = _cli(capsys, *args, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert set(data) >= {"candidates", "skipped", "pareto"}
    assert data["candidates"][0]["replicas"] == \
        next(r for r in range(1, 100) if _lindley_p95(30.0 / r) <= 0.5)
    assert data["pareto"] == [0]
    code, out, err = _cli(capsys, *args)
    assert code == 0 and "toy-gpu-8gb" in out


@pytest.mark.parametrize(("extra", "message"), [
    (["--qps", "0"], "--qps must be a finite rate > 0"),
    (["--qps", "-3"], "--qps must be a finite rate > 0"),
    (["--qps", "5", "--gpus", "no-such-gpu"], "unknown GPU 'no-such-gpu'"),
    (["--qps", "5", "--p95-ttft", "fast"], "--p95-ttft must be a time > 0"),
    (["--qps", "30", "--p95-ttft", "1ms"], "closest is toy-gpu-8gb tp1 none"),
    # training options were ignored with --serve
    (["--qps", "5", "--train-tokens", "1e9"], "--train-tokens: training options, not read"),
    (["--qps", "5", "--mode", "lora", "--spot"], "--mode, --spot: training options"),
    (["--qps", "5", "--gpus-max", "4"], "--gpus-max: training options"),
    # names that hold on every GPU are refused before the search (each GPU skipped them)
    (["--qps", "5", "--quant", "foo"], "error: unknown --quant 'foo'"),
    (["--qps", "5", "--quant", "none,bnb-4bit"],
     "error: --quant bnb-4bit: vLLM 0.33.0 has no bitsandbytes"),
    (["--qps", "5", "--tp", "3"], "error: --tp 3 does not divide num_attention_heads (4)"),
    (["--qps", "5", "--tp", "3,6"], "no --tp size fits the model: --tp 3 does not divide"),
])
def test_cli_bad_input_is_one_line(capsys: pytest.CaptureFixture[str], toy_config: str,
                                   extra: list[str], message: str) -> None:
    gpus = [] if "--gpus" in extra else ["--gpus", "toy-gpu-8gb"]
    code, _, err = _cli(capsys, toy_config, "--serve", "--prompt-tokens", str(PROMPT),
                        "--output-tokens", "1", "--tp", "1", "--quant", "none",
                        "--activation-peak", "0", *gpus, *extra)
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_a_tp_the_heads_cannot_take_beside_one_they_can_is_skipped() -> None:
    """tp 1 and 3 on 4 heads: the search runs tp 1 and lists tp 3 with vLLM's refusal."""
    result = _size(tp=[1, 3])
    assert {c.tp for c in result.candidates} == {1}
    assert [s.reason for s in result.skipped if s.tp == 3] == [
        "--tp 3 does not divide num_attention_heads (4); vLLM refuses it (vllm/config/model.py: "
        "verify_with_parallel_config); pick a --tp that divides it"]


def test_cli_unknown_gpu_in_the_prices_file(capsys: pytest.CaptureFixture[str],
                                            toy_config: str, tmp_path: Path) -> None:
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps({"h999": {"price_per_hour": 1.0}}))
    code, _, err = _cli(capsys, toy_config, "--serve", "--qps", "5", "--prompt-tokens", "16",
                        "--output-tokens", "4", "--prices", str(prices))
    assert code == 2 and "unknown GPU 'h999'" in err and err.count("\n") == 1, err


def test_cli_a_price_dated_in_2062_is_one_line(capsys: pytest.CaptureFixture[str],
                                               toy_config: str, tmp_path: Path) -> None:
    prices = tmp_path / "prices.yaml"  # 2062 for 2026; YAML reads it as a date
    prices.write_text("toy-gpu-8gb: {price_per_hour: 1.0, date: 2062-11-01}\n")
    code, _, err = _cli(capsys, toy_config, "--serve", "--qps", "5", "--prompt-tokens", "16",
                        "--output-tokens", "4", "--prices", str(prices))
    assert code == 2 and err.count("\n") == 1, err
    assert "toy-gpu-8gb: price date 2062-11-01 is after today" in err, err


def test_a_gpu_without_a_price_is_skipped_with_the_reason() -> None:
    result = _size(gpus=["toy-gpu-8gb", "v100-sxm2-16gb"])  # the catalog has no V100 price
    assert [c.gpu for c in result.candidates] == ["toy-gpu-8gb"]
    (s,) = result.skipped
    assert (s.gpu, s.reason) == ("v100-sxm2-16gb", "no price (pass --prices FILE)")


def test_the_search_stops_at_max_replicas() -> None:
    # 0.5 s needs more than 5 replicas (the Lindley recursion above): at most 4 it misses
    with pytest.raises(MemfitError, match=r"misses the latency target at 4 replicas"):
        _size(p95_ttft_s=0.5, max_replicas=4)


# A llama of six alike layers, traced (no activation_peak_bytes) on the toy GPU and on one too
# small for any KV pool (its 1 GiB, x 0.9, is below the non-torch memory and the CUDA graphs).
DEEP = {**TOY, "num_hidden_layers": 6}
TINY_GPU = {**TOY_GPU, "name": "toy-gpu-1gb", "memory_bytes": 2**30, "price_per_hour": 0.5}


def test_the_pruned_search_is_the_full_one(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """prune=True (no trace where the pool is empty at a 0 peak; the peak traced on three
    layers) gives every row, skip and the front of prune=False, and takes both shortcuts."""
    import memfit.serving.profile_run as profile_run

    path = tmp_path / "two.json"
    path.write_text(json.dumps({"gpus": [TOY_GPU, TINY_GPU]}))
    monkeypatch.setenv("MEMFIT_GPU_FILE", str(path))
    traced: list[int] = []
    real = profile_run.profile_activation_peak

    def counting(config, **kw):  # type: ignore[no-untyped-def]
        traced.append(int(config["num_hidden_layers"]))
        return real(config, **kw)

    monkeypatch.setattr(profile_run, "profile_activation_peak", counting)
    args = dict(qps=5.0, prompt_tokens=512, output_tokens=4, p95_ttft_s=1.0,
                gpus=["toy-gpu-8gb", "toy-gpu-1gb"], tp=[1, 2], quant=["none"],
                num_requests=50)
    full = rightsize_serving(DEEP, prune=False, **args).to_json()  # type: ignore[arg-type]
    assert traced == [6, 6, 6, 6]  # every (gpu, tp) traced on all six layers
    traced.clear()
    pruned = rightsize_serving(DEEP, **args).to_json()  # type: ignore[arg-type]
    assert traced == [3, 3]  # the 8 GiB GPU's two TP sizes only, on three layers
    assert [s["gpu"] for s in full["skipped"]] == ["toy-gpu-1gb"] * 2
    assert "holds no request" in full["skipped"][0]["reason"]
    assert len(full["candidates"]) == 2
    assert pruned == full


def test_three_layers_trace_the_peak_of_llama_3_8b() -> None:
    """The profile run's peak of llama-3-8b's 32 layers is the one of its first three."""
    from memfit.serving.plan import load_config
    from memfit.serving.profile_run import profile_activation_peak
    from memfit.serving.rightsize import _sampled_config

    _, config = load_config("llama-3-8b")
    sampled = _sampled_config(config)
    assert sampled is not None and sampled["num_hidden_layers"] == 3
    for tp in (1, 2):
        kw = dict(max_num_batched_tokens=512, max_num_seqs=256, tp=tp)
        whole = profile_activation_peak(config, **kw)  # type: ignore[arg-type]
        cut = profile_activation_peak(sampled, **kw)  # type: ignore[arg-type]
        assert (cut.total_bytes, cut.block_bytes) == (whole.total_bytes, whole.block_bytes)
    assert _sampled_config({**config, "layer_types": ["full_attention"] * 32}) is None
    assert _sampled_config({**config, "model_type": "qwen2"}) is None
