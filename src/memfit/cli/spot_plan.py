"""``memfit spot-plan``: the checkpoint interval (Young/Daly), lost work, restarts, and the
expected time and cost of a training job on spot instances, against on-demand."""

from __future__ import annotations

import argparse
import math
from typing import Any

from memfit.analytic.config import ENGINES, MODES, OPTIMIZERS, PRECISIONS, RunConfig
from memfit.cli._common import console, positive_int, print_json
from memfit.errors import MemfitError
from memfit.models.spec import ModelSpec, ParamCountSpec
from memfit.preempt.spot import (
    DEFAULT_BAND,
    DEFAULT_SPOT_DISCOUNT,
    INTERRUPTION_BANDS,
    band_mtbf_s,
    checkpoint_bytes,
    spot_plan,
)
from memfit.units import format_bytes, format_seconds, parse_bytes, parse_count, parse_rate

EPILOG = """examples:
  memfit spot-plan llama-3-8b --work-hours 100 --write-bandwidth 2GB/s --gpu h100-80gb --gpus 8
  memfit spot-plan --params 70e9 --work-hours 500 --write-bandwidth 10GB/s --instances 8 \\
      --interruption aws-5-10 --price-per-hour 98.32 --step-seconds 6
  memfit spot-plan --checkpoint-bytes 150GB --work-hours 24 --write-bandwidth 1GB/s \\
      --mtbf-hours 12 --json

interruption bands (per instance; sources in docs/spot.md):
""" + "\n".join(f"  {name:16} MTBF {mtbf:8.1f} h, notice {notice:.0f} s: {what}"
                for name, (mtbf, notice, what) in INTERRUPTION_BANDS.items()) + """

exit status: 0 when answered, 2 for bad input (one line on stderr)
"""


def register(sub: Any) -> None:
    p = sub.add_parser("spot-plan", help="checkpoint interval, expected time and cost on spot "
                       "instances", description=__doc__, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", help="a preset name (`memfit models`) or a config.json: "
                   "its checkpoint is its weights and optimizer states")
    p.add_argument("--params", help="a parameter count instead of a model, e.g. 7e9")
    p.add_argument("--checkpoint-bytes", help="the checkpoint's size instead of a model, "
                   "e.g. 150GB")
    p.add_argument("--mode", help=f"one of {', '.join(MODES)} (default train)")
    p.add_argument("--precision",
                   help=f"one of {', '.join(PRECISIONS)} (default bf16-mixed)")
    p.add_argument("--optimizer",
                   help=f"one of {', '.join(OPTIMIZERS)} (default adamw)")
    p.add_argument("--engine", help=f"one of {', '.join(ENGINES)} (default "
                   "auto): which copies of the weights the optimizer keeps")
    p.add_argument("--work-hours", required=True,
                   help="hours of computing the job needs without preemptions")
    p.add_argument("--write-bandwidth", required=True,
                   help="aggregate checkpoint write bandwidth, e.g. 2GB/s")
    p.add_argument("--read-bandwidth", help="read bandwidth on restart (default: the write one)")
    p.add_argument("--interruption", default=None, choices=list(INTERRUPTION_BANDS),
                   metavar="BAND", help=f"a published preemption rate (default {DEFAULT_BAND}; "
                   "the bands are listed below)")
    p.add_argument("--mtbf-hours", help="mean hours between preemptions of one instance "
                   "(instead of --interruption)")
    p.add_argument("--instances", default="1",
                   help="instances (nodes) the job runs on; any one preempted stops it")
    p.add_argument("--provision-minutes", default="0",
                   help="minutes to get a new instance after a preemption (default 0)")
    p.add_argument("--step-seconds", help="one training step's time: with the band's notice, "
                   "says whether a checkpoint on notice (memfit.preemptible) saves the work")
    p.add_argument("--gpu", help="a catalog GPU: its on-demand price (`memfit gpus`)")
    p.add_argument("--gpus", help="GPUs the job runs on, with --gpu (for the price; default 1)")
    p.add_argument("--price-per-hour", help="the whole job's on-demand $/hour (instead of --gpu)")
    p.add_argument("--discount", default=str(DEFAULT_SPOT_DISCOUNT),
                   help="spot discount off on-demand, 0-1 (default 0.6: the low end of Google "
                   "Cloud's published 60-91%%)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run)


def _number(text: str | None, flag: str, *, zero_ok: bool = False) -> float | None:
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        raise MemfitError(f"{flag} must be a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        raise MemfitError(f"{flag} must be a {'non-negative' if zero_ok else 'positive'} "
                          f"number, got {text!r}")
    return value


def _checkpoint_bytes(args: argparse.Namespace) -> tuple[int, str]:
    given = [f for f, v in (("a model", args.model), ("--params", args.params),
                            ("--checkpoint-bytes", args.checkpoint_bytes)) if v]
    if len(given) != 1:
        raise MemfitError("give exactly one of a model, --params or --checkpoint-bytes"
                          + (f" (got {', '.join(given)})" if given else ""))
    sizing = [f for f, v in (("--mode", args.mode), ("--precision", args.precision),
                             ("--optimizer", args.optimizer), ("--engine", args.engine))
              if v is not None]
    if args.checkpoint_bytes:
        if sizing:
            raise MemfitError(f"{', '.join(sizing)}: only a model or --params is sized by "
                              "them; --checkpoint-bytes gives the size itself (drop one)")
        return parse_bytes(args.checkpoint_bytes, what="--checkpoint-bytes"), "given"
    # RunConfig checks the names (one line on a bad one)
    mode: Any = args.mode or "train"
    precision: Any = args.precision or "bf16-mixed"
    optimizer: Any = args.optimizer or "adamw"
    model: ModelSpec
    if args.params:
        params = parse_count(args.params, what="--params")
        model = ParamCountSpec(name=f"{params:,} parameters", params=params)
    else:
        from memfit.models import resolve_model

        model = resolve_model(args.model)
    run = RunConfig(mode=mode, precision=precision, optimizer=optimizer,
                    engine=args.engine or "auto")
    return checkpoint_bytes(model, run), (f"{model.name}: weights + optimizer states, "
                                          f"{mode} {precision} {optimizer}")


def run(args: argparse.Namespace) -> int:
    size, basis = _checkpoint_bytes(args)
    write = parse_rate(args.write_bandwidth, what="--write-bandwidth", unit="B/s")
    read = (None if args.read_bandwidth is None
            else parse_rate(args.read_bandwidth, what="--read-bandwidth", unit="B/s"))
    instances = positive_int(args.instances, "--instances") or 1
    if args.mtbf_hours is not None and args.interruption is not None:
        raise MemfitError("give --interruption or --mtbf-hours, not both")
    band = args.interruption or DEFAULT_BAND
    if args.mtbf_hours is not None:
        mtbf_s = (_number(args.mtbf_hours, "--mtbf-hours") or 0) * 3600 / instances
        notice = None
        source = f"{args.mtbf_hours} h per instance (given)"
    else:
        mtbf_s = band_mtbf_s(band, instances)
        notice = INTERRUPTION_BANDS[band][1]
        source = INTERRUPTION_BANDS[band][2]
    price = _number(args.price_per_hour, "--price-per-hour", zero_ok=True)
    if args.gpus is not None and not args.gpu:
        raise MemfitError("--gpus multiplies --gpu's catalog price; pass --gpu NAME, or give "
                          "the whole job's --price-per-hour without --gpus")
    if args.gpu:
        if price is not None:
            raise MemfitError("give --gpu or --price-per-hour, not both")
        from memfit.gpus import get_gpu

        gpu = get_gpu(args.gpu)
        if gpu.price_per_hour is None:
            raise MemfitError(f"the catalog has no price for {gpu.name}; give --price-per-hour")
        price = gpu.price_per_hour * (positive_int(args.gpus, "--gpus") or 1)
    discount = _number(args.discount, "--discount", zero_ok=True)
    discount_used = DEFAULT_SPOT_DISCOUNT if discount is None else discount
    plan = spot_plan(checkpoint_bytes=size, write_bandwidth=write, read_bandwidth=read,
                     mtbf_s=mtbf_s, work_s=(_number(args.work_hours, "--work-hours") or 0) * 3600,
                     provision_s=(_number(args.provision_minutes, "--provision-minutes",
                                          zero_ok=True) or 0) * 60,
                     price_per_hour=price,
                     spot_discount=discount_used,
                     notice_s=notice, step_s=_number(args.step_seconds, "--step-seconds"))
    if args.json:
        print_json({**plan.to_dict(), "preemption_source": source,
                    "checkpoint_basis": basis})
        return 0
    out = console()
    out.print(f"checkpoint      {format_bytes(plan.checkpoint_bytes, binary=False)} ({basis}); "
              f"written in {format_seconds(plan.checkpoint_s)}")
    out.print(f"preemptions     every {format_seconds(plan.mtbf_s)} on average for the job "
              f"({instances} instance{'s' if instances > 1 else ''}; {source})")
    out.print(f"checkpoint every {format_seconds(plan.interval_s)} of work (Young: "
              f"√(2·C·MTBF); Daly: {format_seconds(plan.interval_daly_s)})")
    lost = ("none: the step and a checkpoint fit in the notice" if plan.saved_on_notice
            else format_seconds(plan.lost_per_preemption_s) + " on average (half an interval)")
    out.print(f"lost work       {lost}; restart {format_seconds(plan.restart_s)}")
    out.print(f"expected        {plan.expected_preemptions:.1f} preemptions; "
              f"{format_seconds(plan.wall_s)} wall time for {format_seconds(plan.work_s)} "
              f"of work")
    if plan.spot_cost is not None and plan.on_demand_cost is not None:
        out.print(f"cost            spot ${plan.spot_cost:,.2f} ({discount_used:.0%} off "
                  f"on-demand, over the longer wall time) against on-demand "
                  f"${plan.on_demand_cost:,.2f}")
    return 0
