"""``memfit simulate``: serve a workload under vLLM's KV budget for a model on a GPU, by vLLM 0.33's
scheduling rules (token budget per step, chunked prefill, preemption by recompute), with step
times from a roofline; continuous batching and static batching side by side.

The workload is generated (``--qps`` Poisson arrivals, ``--num-requests``, ``--prompt-tokens`` /
``--output-tokens`` fixed, uniform or lognormal, ``--seed``) or read from ``--trace FILE``
(JSONL or CSV with ``arrival_time``, ``prompt_tokens``, ``output_tokens``). The KV budget is
``serve-plan``'s (``--gpu`` with ``--gpu-memory-utilization``, or ``--kv-cache-memory``).
Prefix caching is off in the simulator. See docs/simulate.md.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from memfit.cli._common import console, fill_defaults, given_flags, positive_int, print_json
from memfit.errors import MemfitError


def register(sub: Any) -> None:
    p = sub.add_parser("simulate", help="simulate vLLM's continuous batching (throughput, TTFT, "
                       "TPOT, preemptions) against static batching", description=__doc__)
    p.add_argument("model", help="a preset name (`memfit models`), a config.json or its folder, "
                   "or a hub id in the local cache")
    p.add_argument("--gpu", required=True, help="the GPU (`memfit gpus`): its FLOPS and HBM "
                   "bandwidth time each step; without --kv-cache-memory also the KV budget")
    p.add_argument("--gpu-memory-utilization", default="0.9",
                   help="vLLM's fraction of the GPU's memory, in (0, 1] (default 0.9)")
    p.add_argument("--kv-cache-memory", metavar="BYTES",
                   help="the KV budget per GPU (bytes, or 20GiB), as vLLM's --kv-cache-memory")
    p.add_argument("--tp", help="tensor-parallel size (default 1)")
    p.add_argument("--quant", help="awq, gptq, fp8, nvfp4 or bnb-4bit (the weights read a step)")
    p.add_argument("--max-model-len", help="tokens per request (default: the model's context)")
    p.add_argument("--max-num-seqs", help="vLLM's running-request limit (default: vLLM's)")
    p.add_argument("--max-num-batched-tokens", help="vLLM's token budget per step "
                   "(default: vLLM's for the GPU)")
    p.add_argument("--block-size", help="tokens per KV block (default: vLLM's)")
    src = p.add_argument_group("workload")
    src.add_argument("--qps", help="Poisson arrival rate, requests per second (inf: all at once)")
    src.add_argument("--trace", metavar="FILE", help="requests from a .jsonl or .csv file")
    src.add_argument("--num-requests", help="requests to generate (default 200)")
    src.add_argument("--prompt-tokens", help="mean prompt tokens (default 1000)")
    src.add_argument("--output-tokens", help="mean output tokens (default 300)")
    src.add_argument("--lengths", choices=("fixed", "uniform", "lognormal"),
                     help="length distribution (default fixed)")
    src.add_argument("--spread", help="uniform: range ratio; lognormal: sigma "
                     "(default 0.5)")
    src.add_argument("--seed", help="random seed (default 0)")
    src.add_argument("--max-concurrency", help="client-side limit on requests in flight (as "
                     "vllm bench serve --max-concurrency)")
    rf = p.add_argument_group("roofline")
    rf.add_argument("--compute-efficiency", default="0.8",
                    help="share of the peak FLOPS reached (default 0.8)")
    rf.add_argument("--bandwidth-efficiency", default="0.9",
                    help="share of the HBM bandwidth reached (default 0.9)")
    rf.add_argument("--step-overhead", default="0", metavar="SECONDS",
                    help="seconds added to every step (default 0)")
    p.add_argument("--no-static", action="store_true", help="skip the static-batching run")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)


def _number(text: str, flag: str, *, low: float = 0.0, inf: bool = False) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if math.isnan(value) or value <= low or (math.isinf(value) and not inf):
        raise MemfitError(f"{flag} must be a number > {low:g}{' (or inf)' if inf else ''}, "
                          f"got {text!r}")
    return value


def _overhead(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise MemfitError(f"--step-overhead must be seconds >= 0, got {text!r}")
    return value


# the generator's flags and their defaults: None on the command line, so that one given with
# --trace (whose rows set them) is refused rather than ignored
_GENERATOR_DEFAULTS = {"num_requests": "200", "prompt_tokens": "1000", "output_tokens": "300",
                       "lengths": "fixed", "spread": "0.5", "seed": "0"}


def _workload_flags(args: argparse.Namespace) -> None:
    given = given_flags(args, _GENERATOR_DEFAULTS)
    if args.trace is not None and given:
        raise MemfitError(f"{', '.join(given)} shape generated requests; the --trace file's "
                          "rows give each request: drop them (or --trace for --qps)")
    if args.spread is not None and (args.lengths or "fixed") == "fixed":
        raise MemfitError("--spread varies the lengths: add --lengths uniform or lognormal "
                          "(fixed lengths have none)")
    fill_defaults(args, _GENERATOR_DEFAULTS)


def run(args: argparse.Namespace) -> int:
    from memfit.cli.serve_plan import _budget, _utilization, block_size_flag
    from memfit.serving import poisson_requests, read_trace, serve_plan, simulate

    if (args.qps is None) == (args.trace is None):
        raise MemfitError("pass one workload: --qps RATE (generated requests) or --trace FILE")
    qps = None if args.qps is None else _number(args.qps, "--qps", inf=True)
    _workload_flags(args)
    plan = serve_plan(
        args.model, gpu=args.gpu,
        kv_cache_memory=None if args.kv_cache_memory is None else _budget(args.kv_cache_memory),
        gpu_memory_utilization=_utilization(args.gpu_memory_utilization),
        tp=positive_int(args.tp, "--tp") or 1, quant=args.quant,
        block_size=block_size_flag(args.block_size),
        max_model_len=positive_int(args.max_model_len, "--max-model-len"),
        max_num_seqs=positive_int(args.max_num_seqs, "--max-num-seqs"),
        max_num_batched_tokens=positive_int(args.max_num_batched_tokens,
                                            "--max-num-batched-tokens"))
    if qps is not None:
        try:
            spread, seed = float(args.spread), int(args.seed)
        except ValueError:
            raise MemfitError(f"--spread must be a number and --seed an integer, got "
                              f"{args.spread!r}, {args.seed!r}") from None
        requests = poisson_requests(
            positive_int(args.num_requests, "--num-requests") or 1, qps,
            prompt_tokens=positive_int(args.prompt_tokens, "--prompt-tokens") or 1,
            output_tokens=positive_int(args.output_tokens, "--output-tokens") or 1,
            lengths=args.lengths, spread=spread, seed=seed, max_total_tokens=plan.max_model_len)
    else:
        requests = read_trace(args.trace)
    sim = simulate(plan, requests, gpu=args.gpu, quant=args.quant, static=not args.no_static,
                   max_concurrency=positive_int(args.max_concurrency, "--max-concurrency"),
                   compute_efficiency=_number(args.compute_efficiency, "--compute-efficiency"),
                   bandwidth_efficiency=_number(args.bandwidth_efficiency,
                                                "--bandwidth-efficiency"),
                   step_overhead_s=_overhead(args.step_overhead))
    if args.json:
        print_json({"model": plan.model, "gpu": args.gpu, **sim.to_json()})
        return 0
    render(sim.to_json(), plan.model, args.gpu)
    return 0


def render(out: dict[str, Any], model: str, gpu: str) -> None:
    from rich.table import Table

    con = console()
    con.print(f"{model} on {gpu}: {out['num_gpu_blocks']:,} KV blocks of {out['block_size']} "
              f"tokens, max_num_seqs {out['max_num_seqs']}, max_num_batched_tokens "
              f"{out['max_num_batched_tokens']:,} (rules: {out['rules']}; prefix caching off)")
    runs = [r for r in (out["continuous"], out["static"]) if r is not None]
    table = Table(title="simulated serving (roofline step times)")
    table.add_column("")
    for r in runs:
        table.add_column(r["policy"], justify="right")

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:,.1f}"

    rows: list[tuple[str, list[str]]] = [
        ("duration (s)", [f"{r['duration_s']:,.2f}" for r in runs]),
        ("requests/s", [f"{r['request_throughput']:,.2f}" for r in runs]),
        ("output tokens/s", [f"{r['output_token_throughput']:,.0f}" for r in runs]),
        ("total tokens/s", [f"{r['total_token_throughput']:,.0f}" for r in runs])]
    for metric in ("ttft_s", "tpot_s"):
        for q in ("p50", "p90", "p95", "p99"):
            rows.append((f"{metric[:4].upper()} {q} (ms)", [ms(r[metric][q]) for r in runs]))
    for label, key in (("preemptions", "preemptions"), ("peak KV blocks", "peak_kv_blocks"),
                       ("engine steps", "steps")):
        rows.append((label, [f"{r[key]:,}" for r in runs]))
    for label, cells in rows:
        table.add_row(label, *cells)
    con.print(table)
    rf = out["roofline"]
    con.print(f"roofline: compute efficiency {rf['compute_efficiency']}, bandwidth efficiency "
              f"{rf['bandwidth_efficiency']}, step overhead {rf['step_overhead_s']} s; "
              f"{rf['weights_bytes']:,} B of weights read a step")
