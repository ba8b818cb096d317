"""``memfit profile``: run a training script with memory instrumentation and report it."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from rich.table import Table

from memfit.categories import MemoryCategory
from memfit.cli._common import console
from memfit.errors import MemfitError
from memfit.units import format_bytes

EPILOG = """examples:
  memfit profile --html report.html -- python train.py --epochs 1
  memfit profile --json report.json --predict -- python train.py
  memfit profile --stacks --snapshot snap.pickle -- python -m mypkg.train

The script runs in this process (as __main__, with its own sys.argv). On CUDA, --snapshot writes
an allocator history you can drag onto https://pytorch.org/memory_viz.
"""


def register(sub: Any) -> None:
    p = sub.add_parser("profile", help="measure a real run's memory by category, module and "
                       "tensor", description=__doc__, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--html", metavar="PATH", help="write the offline HTML report")
    p.add_argument("--json", metavar="PATH", help="write the measurement as JSON")
    p.add_argument("--png", metavar="PATH", help="write the timeline as PNG "
                   "(needs `pip install 'memfit[report]'`)")
    p.add_argument("--snapshot", metavar="PATH", help="CUDA: write the allocator history "
                   "snapshot (pickle) for pytorch.org/memory_viz")
    p.add_argument("--predict", action="store_true", help="also trace the first model the "
                   "script calls with memfit.estimate and show predicted vs measured")
    p.add_argument("--stacks", action="store_true", help="record the Python stack of every "
                   "allocation (slower)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto (default), cpu or cuda")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="-- python train.py ARGS (or -- python -m module ARGS)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from memfit.profiling.script import parse_command, predict, run_script
    from memfit.profiling.session import Profiler

    command = parse_command(args.command)
    import torch

    # Checked here, up front and in flags; the Profiler says the same in API terms.
    if args.device == "cuda" and not torch.cuda.is_available():
        raise MemfitError("--device cuda: CUDA is not available here; use --device cpu "
                          "(or leave --device auto)")
    on_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if args.snapshot and not on_cuda:
        raise MemfitError("--snapshot records the CUDA caching allocator's history and this run "
                          "is on the CPU; drop --snapshot, or run on a GPU")
    for path in (args.html, args.json, args.png, args.snapshot):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise MemfitError(f"cannot write {path!r}: its folder does not exist; create it or "
                              "choose another path")
    # The script has created nothing yet: count its tensors as they appear, not this process's.
    prof = Profiler(device=args.device, stacks=args.stacks, record_history=bool(args.snapshot),
                    baseline=())
    code = run_script(command, prof)
    assert prof.result is not None
    est = predict(prof) if args.predict else None
    if args.json:
        prof.save_json(args.json, estimate=est)
    if args.html:
        prof.report(args.html, estimate=est, title=f"memfit profile: {command.target}")
    if args.png:
        prof.save_png(args.png)
    if args.snapshot:
        prof.save_snapshot(args.snapshot)
    _print_summary(prof.result, est)
    if code:
        print(f"memfit: the profiled script exited with code {code}", file=sys.stderr)
    return code


def _print_summary(result: Any, est: Any) -> None:
    out = console()
    table = Table(title=f"memfit profile: {result.device}, peak {format_bytes(result.peak_bytes)}"
                  f" at {result.peak_op} ({result.peak_phase}"
                  + (f", module {result.peak_module}" if result.peak_module else "") + ")")
    table.add_column("category")
    table.add_column("measured", justify="right")
    if est is not None:
        table.add_column("predicted", justify="right")
    for cat in MemoryCategory:
        measured = result.breakdown.get(cat, 0)
        predicted = est.breakdown.get(cat, 0) if est is not None else 0
        if measured or predicted:
            row = [cat.value, format_bytes(measured)]
            if est is not None:
                row.append(format_bytes(predicted))
            table.add_row(*row)
    if result.inside_kernels_bytes is not None:
        # What the allocator held at the peak beyond the tensors above (kernel scratch); the
        # prediction counts its scratch within its categories.
        row = ["inside kernels", format_bytes(result.inside_kernels_bytes)]
        if est is not None:
            row.append("")
        table.add_row(*row)
    row = ["peak allocated", format_bytes(result.peak_bytes)]
    if est is not None:
        row.append(format_bytes(est.peak_bytes))
    table.add_row(*row)
    if result.peak_reserved_bytes is not None:
        row = ["peak reserved", format_bytes(result.peak_reserved_bytes)]
        if est is not None:
            row.append(format_bytes(est.peak_reserved_bytes))
        table.add_row(*row)
    out.print(table)
