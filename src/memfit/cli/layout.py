"""The one place the CLI turns its layout flags into a :class:`memfit.Parallel`.

``memfit plan`` and ``memfit fit`` read ``--gpus --gpus-per-node --fsdp --zero --tp --pp --ep
--sp --loss-parallel --pp-schedule --microbatches --tp-plan --pp-split`` here (a command
without a flag gets its default), so a flag means the same in each, and the layout they build
is the one the Python API takes (``memfit.RunConfig(parallel=...)``, ``memfit.estimate(...,
parallel=...)``, ``Plan.parallel``); ``memfit export`` reads it back from the plan file
(``memfit.export.PlanSettings.parallel``). Pure data: no torch import.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from memfit.analytic.config import check_flat_layout
from memfit.cli._common import nonneg_int, positive_int
from memfit.errors import MemfitError
from memfit.parallel.config import Parallel

__all__ = ["parallel_from_args", "pp_split_from_arg", "tp_plan_from_arg"]


def parallel_from_args(args: argparse.Namespace) -> Parallel:
    """The layout the flags name.

    ``--zero N`` is ``Parallel.zero`` (0: None); ``--fsdp`` is ZeRO-3 over every data-parallel
    rank, ``--fsdp N`` over N of them (HSDP when fewer); ``--gpus-per-node`` is kept when it
    divides ``--gpus``, dropped when all the GPUs fit on one node (``Parallel``'s None), and an
    error otherwise (a partial node). ``--microbatches`` stays None when not given (the plan
    derives it: ``cli/parallel_plan.py: pipeline_microbatches``). Errors are one line naming
    the flag, or ``Parallel``'s own.
    """
    gpus = positive_int(getattr(args, "gpus", None), "--gpus") or 1
    zero = nonneg_int(getattr(args, "zero", None), "--zero") or 0
    fsdp = getattr(args, "fsdp", None)
    shard = 1
    if fsdp is not None:
        if zero not in (0, 3):
            raise MemfitError(f"--fsdp means ZeRO-3; it conflicts with --zero {zero}")
        zero = 3
        shard = 1 if fsdp == "all" else positive_int(fsdp, "--fsdp") or 1
    tp = positive_int(getattr(args, "tp", None), "--tp") or 1
    pp = positive_int(getattr(args, "pp", None), "--pp") or 1
    check_flat_layout(gpus=gpus, zero=zero, tp=tp, pp=pp)
    per_node = positive_int(getattr(args, "gpus_per_node", None), "--gpus-per-node")
    if per_node is not None and gpus % per_node:
        if gpus > per_node:
            raise MemfitError(f"--gpus-per-node {per_node} does not divide --gpus {gpus} "
                              f"(gpus_per_node={per_node} leaves a partial node); use a --gpus "
                              "that is a multiple of it")
        per_node = None  # every GPU on one node
    return Parallel(gpus=gpus, gpus_per_node=per_node, zero=zero or None, fsdp=shard, tp=tp,
                    pp=pp, ep=positive_int(getattr(args, "ep", None), "--ep") or 1,
                    sp=bool(getattr(args, "sequence_parallel", False)),
                    loss_parallel=bool(getattr(args, "loss_parallel", False)),
                    pp_schedule=getattr(args, "pp_schedule", None) or "1f1b",
                    microbatches=positive_int(getattr(args, "microbatches", None),
                                              "--microbatches"),
                    tp_plan=tp_plan_from_arg(getattr(args, "tp_plan", None)),
                    pp_split_points=pp_split_from_arg(getattr(args, "pp_split", None), pp,
                                                      getattr(args, "pp_schedule", None)))


def pp_split_from_arg(value: str | None, pp: int, schedule: str | None) -> tuple[str, ...] | None:
    """``--pp-split``: module names separated by commas, each the first module of a stage
    (``Parallel.pp_split_points``); one fewer than the stages. A bad value is one line."""
    if value is None:
        return None
    names = tuple(n.strip() for n in value.split(","))
    example = "e.g. --pp 2 --pp-split model.layers.2"
    if not all(names):
        raise MemfitError(f"--pp-split {value!r}: an empty name; give module names separated by "
                          f"commas, {example}")
    if pp == 1:
        raise MemfitError(f"--pp-split {value} does nothing without pipeline stages; add --pp N "
                          f"(N > 1), {example}")
    stages = pp * (2 if schedule == "interleaved-1f1b" else 1)
    if len(names) != stages - 1:
        raise MemfitError(f"--pp-split names {len(names)} split point(s); --pp {pp} "
                          f"({schedule or '1f1b'}) runs {stages} stages, which need "
                          f"{stages - 1} (each the first module of a stage after the first)")
    return names


def tp_plan_from_arg(value: str | None) -> dict[str, Any] | None:
    """``--tp-plan``: a JSON object, or the path of a file holding one (``Parallel.tp_plan``
    checks its styles); a bad value is one line."""
    if value is None:
        return None
    text = value
    if not value.lstrip().startswith("{"):
        try:
            text = Path(value).read_text()
        except OSError as exc:
            raise MemfitError(f"--tp-plan {value}: cannot read it ({exc.strerror}); give a JSON "
                              "object or the path of a file holding one") from None
    try:
        plan = json.loads(text)
    except json.JSONDecodeError as exc:
        raise MemfitError(f"--tp-plan: not JSON ({exc.msg} at line {exc.lineno}); give an "
                          'object such as {"blocks.*.q": "colwise"}') from None
    if not isinstance(plan, dict):
        raise MemfitError("--tp-plan: must be a JSON object of module-name patterns to styles, "
                          'such as {"blocks.*.q": "colwise"}')
    return plan
