"""``memfit rightsize MODEL --serve``: every GPU x TP size x quantization at the cheapest replica
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

from memfit.cli._common import console, name_column, positive_int, print_json, print_table
from memfit.errors import MemfitError

_UNITS = {"ms": 1e-3, "s": 1.0, "": 1.0}


def register(sub: Any) -> None:
    p = sub.add_parser("rightsize", help="the cheapest GPUs, TP size, quantization and "
                       "replicas that serve a load within p95 latency targets",
                       description=__doc__)
    p.add_argument("model", help="a preset name (`memfit models`), a config.json or its folder, "
                   "or a hub id in the local cache")
    p.add_argument("--serve", action="store_true", required=True,
                   help="size a serving deployment (training sizing is not there yet)")
    p.add_argument("--qps", required=True, help="requests per second to serve (> 0)")
    p.add_argument("--prompt-tokens", required=True, help="prompt tokens per request")
    p.add_argument("--output-tokens", required=True, help="output tokens per request")
    p.add_argument("--p95-ttft", help="p95 time to first token target (2s, 500ms)")
    p.add_argument("--p95-tpot", help="p95 time per output token target (50ms)")
    p.add_argument("--gpus", help="comma-separated catalog GPUs (default: every priced one)")
    p.add_argument("--tp", default="1,2,4,8", help="TP sizes to try (default 1,2,4,8)")
    p.add_argument("--quant", default="none,fp8",
                   help="quantizations to try: none, fp8, awq, gptq, ... (default none,fp8)")
    p.add_argument("--max-model-len", help="vLLM's --max-model-len (default: the model's "
                   "context)")
    p.add_argument("--activation-peak", metavar="BYTES",
                   help="the profile run's activation peak, given instead of traced (as "
                   "serve-plan's; the same on every GPU)")
    p.add_argument("--prices", metavar="FILE", help="JSON or YAML prices overriding the "
                   "catalog's: {gpu: {price_per_hour, source, date}}")
    p.add_argument("--max-price-age-days", default="365",
                   help="flag prices older than this (default 365)")
    p.add_argument("--num-requests", default="200",
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


def run(args: argparse.Namespace) -> int:
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
