"""``memfit validate``: the trace engine's predictions against real runs on this machine."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
from pathlib import Path
from typing import Any

import torch
from rich.table import Table

from memfit.cli._common import console
from memfit.errors import MemfitError


def register(sub: Any) -> None:
    p = sub.add_parser("validate", help="compare trace predictions with real runs",
                       description=__doc__)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--size", default=None, choices=["small", "medium"],
                   help="model sizes (default: medium on cuda, small on cpu)")
    p.add_argument("--families", help="comma list of zoo families (default: all)")
    p.add_argument("--limit", type=int, default=None, help="run only the first N configs")
    p.add_argument("--gpu", help="catalog GPU for the prediction (default: detected)")
    p.add_argument("--json", dest="json_path", help="write results to this JSON file")
    p.set_defaults(func=run)


def _detect_gpu() -> str | None:
    """The catalog entry whose label matches this CUDA device, if any."""
    from memfit.gpus import list_gpus

    name = torch.cuda.get_device_name().lower()
    total = torch.cuda.get_device_properties(0).total_memory
    candidates = [g for g in list_gpus() if all(
        word in name for word in g.label.lower().replace("nvidia", "").split()[:1])]
    if not candidates:
        return None
    return min(candidates, key=lambda g: abs(g.memory_bytes - total)).name


def run(args: argparse.Namespace) -> int:
    from memfit.validate import Result, matrix, run_matrix, summarize, zoo

    if args.device == "cuda" and not torch.cuda.is_available():
        raise MemfitError("no CUDA device here: run `memfit validate --device cpu`, or run on a "
                          "GPU machine")
    size = args.size or ("medium" if args.device == "cuda" else "small")
    families = [f.strip() for f in args.families.split(",")] if args.families else None
    if families:
        unknown = sorted(set(families) - set(zoo(size)))
        if unknown:
            raise MemfitError(f"unknown families {', '.join(unknown)}; valid: "
                              f"{', '.join(zoo(size))}")
    configs = matrix(size, families=families)[: args.limit]
    gpu = args.gpu or (_detect_gpu() if args.device == "cuda" else None)
    out = console()
    table = Table(title=f"trace vs real ({args.device}, {size})", title_justify="left")
    for col in ("config", "measured alloc", "predicted", "error", "measured reserved",
                "predicted", "error"):
        table.add_column(col, justify="left" if col == "config" else "right",
                         no_wrap=col == "config")  # the name a user looks up: never cut
    results: list[Result] = []
    failures: list[dict[str, str]] = []
    for item in run_matrix(configs, size=size, device=args.device, gpu=gpu):
        if isinstance(item, Result):
            results.append(item)
            res = item.error_reserved
            table.add_row(item.config, f"{item.measured_allocated:,}",
                          f"{item.predicted_allocated:,}", f"{100 * item.error_allocated:+.2f}%",
                          "-" if item.measured_reserved is None else f"{item.measured_reserved:,}",
                          f"{item.predicted_reserved:,}",
                          "-" if res is None else f"{100 * res:+.2f}%")
        else:
            config, message = item
            failures.append({"config": config.name, "error": message})
            out.print(f"[red]failed[/red] {config.name}: {message}")
    out.print(table)
    summary = summarize(results)
    out.print(json.dumps(summary, indent=2))
    if args.json_path:
        doc = {
            "what": "memfit trace engine vs real runs",
            "date": dt.date.today().isoformat(),
            "device": torch.cuda.get_device_name() if args.device == "cuda" else
            platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "gpu_catalog_entry": gpu,
            "command": " ".join(["memfit", *sys.argv[1:]]) if sys.argv else "memfit validate",
            "size": size,
            "summary": summary,
            "results": [r.to_dict() for r in results],
            "failures": failures,
        }
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(doc, indent=2))
        out.print(f"wrote {args.json_path}")
    return 0
