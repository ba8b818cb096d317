"""``memfit rightsize MODEL --mode lora --train-tokens 2e9 --seq 4096 --global-batch 64``: every
priced GPU x count (1, 2, 4, ... up to ``--gpus-max``) x pricing (on-demand, and spot with
``--spot``) with the fastest training configuration that fits, its step time, the job's hours
and cost, ranked by cost, with the cost-vs-time Pareto front (memfit.fitting.rightsize).

``memfit rightsize MODEL --serve``: every GPU x TP size x quantization at the cheapest replica
count that serves ``--qps`` requests of ``--prompt-tokens`` + ``--output-tokens`` within the p95
TTFT / TPOT targets (vLLM's KV budget from ``serve-plan``, each replica count simulated by
``simulate``'s rules), ranked by cost with $ per million output tokens, the Pareto front of
cost against p95 latency, and the configurations skipped with their reasons.

Prices are the catalog's, each with its date and source (``--prices FILE`` overrides them, a
JSON or YAML ``{gpu: {price_per_hour, source, date}}``); one older than
``--max-price-age-days`` is flagged. See docs/rightsize.md.
"""

from __future__ import annotations

import argparse
import math
import re
from typing import Any

from memfit.cli._common import (
    console,
    fill_defaults,
    given_flags,
    name_column,
    positive_int,
    print_json,
    print_table,
)
from memfit.errors import MemfitError
from memfit.units import plural

_UNITS = {"ms": 1e-3, "s": 1.0, "": 1.0}


def register(sub: Any) -> None:
    p = sub.add_parser("rightsize", help="the cheapest GPUs and counts for a training job "
                       "(--train-tokens), or GPUs, TP size, quantization and replicas that serve "
                       "a load within p95 latency targets (--serve)", description=__doc__)
    p.add_argument("model", help="a preset name (`memfit models`), a config.json or its folder, "
                   "or a hub id in the local cache")
    p.add_argument("--serve", action="store_true",
                   help="size a serving deployment (default: a training job)")
    t = p.add_argument_group("training (without --serve)")
    t.add_argument("--mode", help="train, lora or qlora (default train)")
    t.add_argument("--train-tokens", help="tokens the job trains on, e.g. 2e9 or 2B")
    t.add_argument("--seq", help="tokens per sample")
    t.add_argument("--global-batch", help="samples per optimizer step")
    t.add_argument("--gpus-max", help="the most GPUs tried: 1, 2, 4, ... up to "
                   "it (default 16)")
    t.add_argument("--optimizer", help="optimizer (default adamw)")
    t.add_argument("--top", help="rows shown, cheapest first, plus every row of "
                   "the Pareto front (default 20; --json has all)")
    t.add_argument("--host-memory", metavar="SIZE",
                   help="the RAM of one node (8 GPUs), e.g. 1TiB, as memfit plan's: "
                   "configurations whose offloaded states need more than each GPU's share, "
                   "less 10%%, are dropped (default: the catalog's machine for each GPU, else "
                   "1 x the GPU's memory a GPU)")
    t.add_argument("--spot", action="store_true",
                   help="price each configuration on spot too (memfit spot-plan's model)")
    t.add_argument("--interruption", metavar="BAND", help="with --spot: a published "
                   "preemption rate (memfit spot-plan --help lists them; default "
                   "gcp-preemptible)")
    t.add_argument("--mtbf-hours", help="with --spot: mean hours between preemptions of one "
                   "instance (instead of --interruption)")
    t.add_argument("--write-bandwidth",
                   help="with --spot: checkpoint write bandwidth (default 1GB/s)")
    t.add_argument("--discount", help="with --spot: spot discount off on-demand, 0-1 "
                   "(default 0.6)")
    s = p.add_argument_group("serving (--serve)")
    s.add_argument("--qps", help="requests per second to serve (> 0)")
    s.add_argument("--prompt-tokens", help="prompt tokens per request")
    s.add_argument("--output-tokens", help="output tokens per request")
    s.add_argument("--p95-ttft", help="p95 time to first token target (2s, 500ms)")
    s.add_argument("--p95-tpot", help="p95 time per output token target (50ms)")
    p.add_argument("--gpus", help="comma-separated catalog GPUs (default: every priced one)")
    s.add_argument("--tp", help="TP sizes to try (default 1,2,4,8)")
    s.add_argument("--quant",
                   help="quantizations to try: none, fp8, awq, gptq, ... (default none,fp8)")
    s.add_argument("--max-model-len", help="vLLM's --max-model-len (default: the model's "
                   "context)")
    s.add_argument("--activation-peak", metavar="BYTES",
                   help="the profile run's activation peak, given instead of traced (as "
                   "serve-plan's; the same on every GPU)")
    p.add_argument("--prices", metavar="FILE", help="JSON or YAML prices overriding the "
                   "catalog's: {gpu: {price_per_hour, source, date}}")
    p.add_argument("--max-price-age-days", default="365",
                   help="flag prices older than this (default 365)")
    s.add_argument("--num-requests",
                   help="requests simulated per replica count (default 200)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)


def duration(text: str | None, flag: str) -> float | None:
    """``2s``, ``500ms`` or ``0.5`` (seconds) -> seconds; anything else a MemfitError."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*(ms|s)?\s*", text)
    try:
        value = float(m.group(1)) * _UNITS[m.group(2) or ""] if m else math.nan
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise MemfitError(f"{flag} must be a time > 0 such as 2s or 50ms, got {text!r}")
    return value


def _list(text: str, flag: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise MemfitError(f"{flag} needs a comma-separated list, got {text!r}")
    return items


# the defaults of the flags one side only reads: None on the command line, so that a flag given
# to the other side is refused rather than ignored
_TRAINING_DEFAULTS = {"mode": "train", "gpus_max": "16", "optimizer": "adamw", "top": "20",
                      "write_bandwidth": "1GB/s"}
_SERVING_DEFAULTS = {"tp": "1,2,4,8", "quant": "none,fp8", "num_requests": "200"}


def run(args: argparse.Namespace) -> int:
    if not args.serve:
        return run_training(args)
    if args.host_memory is not None:
        raise MemfitError("--host-memory checks a training job's offloaded states: drop it "
                          "with --serve")
    training = given_flags(args, (*_TRAINING_DEFAULTS, "train_tokens", "seq", "global_batch",
                                  "interruption", "mtbf_hours", "discount")
                           ) + (["--spot"] if args.spot else [])
    if training:
        raise MemfitError(f"{', '.join(training)}: training options, not read with --serve; "
                          "drop them (or drop --serve to size a training job)")
    fill_defaults(args, _SERVING_DEFAULTS)
    missing = [f for f, v in (("--qps", args.qps), ("--prompt-tokens", args.prompt_tokens),
                              ("--output-tokens", args.output_tokens)) if v is None]
    if missing:
        raise MemfitError(f"--serve needs {', '.join(missing)}")
    return run_serving(args)


def _training_flags(args: argparse.Namespace) -> None:
    serving = given_flags(args, ("qps", "prompt_tokens", "output_tokens", "p95_ttft",
                                 "p95_tpot", "max_model_len", "activation_peak",
                                 *_SERVING_DEFAULTS))
    if serving:
        raise MemfitError(f"{', '.join(serving)} size a serving deployment: add --serve")
    missing = [f for f, v in (("--train-tokens", args.train_tokens), ("--seq", args.seq),
                              ("--global-batch", args.global_batch)) if v is None]
    if missing:
        raise MemfitError(f"a training job needs {', '.join(missing)} (or --serve to size "
                          "serving)")
    if not args.spot and any(v is not None for v in (args.interruption, args.mtbf_hours,
                                                     args.discount, args.write_bandwidth)):
        raise MemfitError("--interruption, --mtbf-hours, --discount and --write-bandwidth "
                          "price spot: add --spot")
    fill_defaults(args, _TRAINING_DEFAULTS)


def _fraction(text: str | None, flag: str) -> float | None:
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise MemfitError(f"{flag} must be a non-negative number, got {text!r}")
    return value


def run_training(args: argparse.Namespace) -> int:
    from memfit.fitting.rightsize import rightsize_training
    from memfit.units import parse_bytes, parse_rate

    _training_flags(args)
    try:
        tokens = float(str(args.train_tokens).replace("_", ""))
    except ValueError:
        from memfit.units import parse_count

        tokens = float(parse_count(args.train_tokens, what="--train-tokens"))
    result = rightsize_training(
        args.model, mode=args.mode, train_tokens=tokens,
        seq=positive_int(args.seq, "--seq") or 1,
        global_batch=positive_int(args.global_batch, "--global-batch") or 1,
        gpus_max=positive_int(args.gpus_max, "--gpus-max") or 16,
        gpus=None if args.gpus is None else _list(args.gpus, "--gpus"),
        optimizer=args.optimizer, spot=args.spot, interruption=args.interruption,
        mtbf_hours=_fraction(args.mtbf_hours, "--mtbf-hours"),
        write_bandwidth=parse_rate(args.write_bandwidth, what="--write-bandwidth", unit="B/s"),
        spot_discount=_fraction(args.discount, "--discount"), prices=args.prices,
        max_price_age_days=positive_int(args.max_price_age_days, "--max-price-age-days"),
        host_memory=None if args.host_memory is None else
        parse_bytes(args.host_memory, what="--host-memory"))
    if args.json:
        print_json(result.to_json())
        return 0
    render_training(result, args)
    return 0


def render_training(result: Any, args: argparse.Namespace) -> None:
    from rich.table import Table

    con = console()
    front = set(result.pareto)
    table = Table(title=f"{args.model} {args.mode}: {float(args.train_tokens):,.0f} tokens = "
                  f"{result.steps:,} steps of {args.global_batch} x {args.seq}, ranked by cost "
                  "(* Pareto: cost vs job time)")
    table.add_column("")
    name_column(table, "GPU")
    for header in ("n", "pricing", "$/GPU-h", "step s", "job h", "cost $", "configuration",
                   "price date"):
        table.add_column(header, justify="left" if header in ("pricing", "configuration",
                                                              "price date") else "right")
    top = positive_int(args.top, "--top") or 20
    hidden = 0
    for i, c in enumerate(result.candidates):
        if i >= top and i not in front:
            hidden += 1
            continue
        date = (c.price_date or "undated") + (" (stale)" if c.stale_price else "")
        label = c.config["label"]
        if c.pricing == "spot":
            label += (f"; save every {c.config['checkpoint_every_s'] / 60:,.0f} min, "
                      f"{c.config['expected_preemptions']:.1f} preemptions")
        table.add_row("*" if i in front else "", c.gpu, str(c.count), c.pricing,
                      f"{c.price_per_gpu_hour:,.2f}", f"{c.step_seconds:,.2f}",
                      f"{c.job_hours:,.1f}", f"{c.cost_usd:,.0f}", label, date)
    print_table(table, drop=("price date", "$/GPU-h", "step s"), out=con)
    if hidden:
        con.print(f"{hidden} more rows off the Pareto front (--top N, or --json for all)")
    for s in result.skipped:
        con.print(f"skipped {s}")
    if result.host_rejected:
        con.print(host_line(result))
    if result.spot:
        sp = result.spot
        con.print(f"spot: preemptions every {sp['mtbf_hours_per_instance']:,.1f} h per "
                  f"instance of {plural(sp['gpus_per_instance'], 'GPU')} ({sp['source']}), "
                  f"a job of n "
                  f"instances every 1/n of it; checkpoints (weights + optimizer states) written "
                  f"at {sp['write_bandwidth'] / 1e9:g} GB/s; {sp['discount']:.0%} off on-demand")
    con.print("configuration: fit's cost model at the catalog's rates, memory from memfit "
              f"plan's formulas; searched in {result.seconds:.1f} s")


def host_line(result: Any) -> str:
    """One line on the configurations dropped for host memory."""
    rows = result.host_rejected
    gone = [f"{r['count']} x {r['gpu']}" for r in rows if r["row_dropped"]]
    worst = min(rows, key=lambda r: r["limit_bytes_per_gpu"] / r["least_host_bytes_per_gpu"])
    where = ("--host-memory" if result.host_memory.get("node_bytes") is not None
             else "the catalog's machines; --host-memory SIZE gives a node's RAM")
    return (f"host memory: {plural(sum(r['configurations'] for r in rows), 'configuration')} "
            f"on {plural(len(rows), 'GPU x count')} dropped, their offloaded states over each "
            f"GPU's share of host RAM less {result.host_memory['margin']:.0%} ({where}); "
            + (f"{len(gone)} with none left ({', '.join(gone[:4])}"
               f"{', ...' if len(gone) > 4 else ''}); " if gone else "")
            + f"e.g. {worst['count']} x {worst['gpu']}: {worst['reason'].split(' (')[0]}")


def run_serving(args: argparse.Namespace) -> int:
    from memfit.cli.serve_plan import _budget
    from memfit.serving.rightsize import rightsize_serving

    try:
        qps = float(args.qps)
    except ValueError:
        qps = math.nan
    if not (math.isfinite(qps) and qps > 0):
        raise MemfitError(f"--qps must be a finite rate > 0 requests per second, got "
                          f"{args.qps!r}")
    tps = [positive_int(t, "--tp") or 1 for t in _list(args.tp, "--tp")]
    age = positive_int(args.max_price_age_days, "--max-price-age-days") or 365
    result = rightsize_serving(
        args.model, qps=qps,
        prompt_tokens=positive_int(args.prompt_tokens, "--prompt-tokens") or 1,
        output_tokens=positive_int(args.output_tokens, "--output-tokens") or 1,
        p95_ttft_s=duration(args.p95_ttft, "--p95-ttft"),
        p95_tpot_s=duration(args.p95_tpot, "--p95-tpot"),
        gpus=None if args.gpus is None else _list(args.gpus, "--gpus"), tp=tps,
        quant=[q.lower() for q in _list(args.quant, "--quant")], prices=args.prices,
        max_price_age_days=age,
        max_model_len=positive_int(args.max_model_len, "--max-model-len"),
        num_requests=positive_int(args.num_requests, "--num-requests") or 200,
        activation_peak_bytes=None if args.activation_peak is None else _budget(
            args.activation_peak, "--activation-peak"))
    if args.json:
        print_json(result.to_json())
        return 0
    render(result.to_json(), args, result.seconds)
    return 0


def render(out: dict[str, Any], args: argparse.Namespace, seconds: float) -> None:
    from rich.table import Table

    con = console()
    front = set(out["pareto"])
    table = Table(title=f"{args.model}: {args.qps} req/s of {args.prompt_tokens} + "
                  f"{args.output_tokens} tokens, ranked by cost (* Pareto: cost vs p95 latency)")
    table.add_column("")
    name_column(table, "GPU")
    for header in ("TP", "quant", "reps", "$/h", "$/M out", "$/M all", "TTFT ms",
                   "TPOT ms", "KV tokens", "price date"):
        table.add_column(header, justify="left" if header in ("quant", "price date")
                         else "right")

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:,.1f}"

    for i, c in enumerate(out["candidates"]):
        date = (c["price_date"] or "undated") + (" (stale)" if c["stale_price"] else "")
        table.add_row("*" if i in front else "", c["gpu"], str(c["tp"]), c["quant"],
                      str(c["replicas"]), f"{c['cost_per_hour']:,.2f}",
                      f"{c['usd_per_million_tokens']:,.3f}",
                      f"{c['usd_per_million_total_tokens']:,.3f}", ms(c["p95_ttft_s"]),
                      ms(c["p95_tpot_s"]), f"{c['kv_cache_tokens']:,}", date)
    print_table(table, drop=("price date", "KV tokens", "$/M all"), out=con)
    if out["skipped"]:
        con.print(f"skipped ({len(out['skipped'])}):")
        for s in out["skipped"]:
            p95 = "" if s["p95_ttft_s"] is None else \
                f" (best p95 TTFT {ms(s['p95_ttft_s'])} ms, TPOT {ms(s['p95_tpot_s'])} ms)"
            con.print(f"  {s['gpu']} tp{s['tp']} {s['quant']}: {s['reason']}{p95}")
    con.print("reps: replicas of TP GPUs each; TTFT, TPOT: p95 of the simulated requests; $/M: "
              "per million output tokens (out) or prompt + output tokens (all)")
    con.print(f"{out['num_requests']} seeded Poisson requests simulated per replica count; "
              f"roofline step times (no TP all-reduce); prices: each row's date; searched in "
              f"{seconds:.1f} s")
