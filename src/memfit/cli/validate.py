"""``memfit validate``: the trace engine's predictions against real runs on this machine."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
import time
from typing import Any

from rich.table import Table

from memfit._files import write_atomic
from memfit.cli._common import console
from memfit.errors import MemfitError
from memfit.progress import Progress


def register(sub: Any) -> None:
    p = sub.add_parser("validate", help="compare trace predictions with real runs",
                       description=__doc__)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--size", default=None, choices=["tiny", "small", "medium"],
                   help="model sizes (default: medium on cuda, tiny on cpu)")
    p.add_argument("--full", action="store_true",
                   help="the whole matrix (the default on cuda, and for the families named by "
                   "--families); on cpu the default is the quick matrix: one config per family "
                   "and per offload kind, every axis covered")
    p.add_argument("--families", help="comma list of zoo families (default: all)")
    p.add_argument("--limit", type=int, default=None, help="run only the first N configs")
    p.add_argument("--gpu", help="catalog GPU for the prediction (default: detected)")
    p.add_argument("--json", dest="json_path", help="write results to this JSON file (rewritten "
                   "after every config, so a stopped run keeps the results so far)")
    p.add_argument("--quiet", action="store_true", help="no progress display on stderr")
    p.set_defaults(func=run)


def _detect_gpu() -> str | None:
    """The catalog entry whose label matches this CUDA device, if any."""
    import torch

    from memfit.gpus import list_gpus

    name = torch.cuda.get_device_name().lower()
    total = torch.cuda.get_device_properties(0).total_memory
    candidates = [g for g in list_gpus() if all(
        word in name for word in g.label.lower().replace("nvidia", "").split()[:1])]
    if not candidates:
        return None
    return min(candidates, key=lambda g: abs(g.memory_bytes - total)).name


def run(args: argparse.Namespace) -> int:
    import torch

    from memfit.validate import Result, matrix, run_matrix, summarize, zoo

    if args.device == "cuda" and not torch.cuda.is_available():
        raise MemfitError("no CUDA device here: run `memfit validate --device cpu`, or run on a "
                          "GPU machine")
    size = args.size or ("medium" if args.device == "cuda" else "tiny")
    # The quick matrix is the CPU default for the whole zoo; named families run their whole
    # matrix (a user who narrows to a family wants all of it).
    quick = args.device == "cpu" and not args.full and not args.families
    families = [f.strip() for f in args.families.split(",")] if args.families else None
    if families:
        unknown = sorted(set(families) - set(zoo(size)))
        if unknown:
            raise MemfitError(f"unknown families {', '.join(unknown)}; valid: "
                              f"{', '.join(zoo(size))}")
    configs = matrix(size, families=families, quick=quick)[: args.limit]
    gpu = args.gpu or (_detect_gpu() if args.device == "cuda" else None)
    out = console()
    results: list[Result] = []
    failures: list[dict[str, str]] = []
    doc = _document(args, gpu, size, len(configs))
    doc["started"] = time.perf_counter()
    interrupted = False
    # Note: [partial results] The JSON file is rewritten (temp file + os.replace, atomic on
    # POSIX and Windows) after every config, so Ctrl-C, a kill or a crash leaves a valid file
    # with every config finished so far ("complete": false until the last one).
    with Progress(f"memfit validate ({args.device}, {size})", total=len(configs),
                  unit="configs", progress=False if args.quiet else None) as bar:
        if args.json_path:
            _write_json(args.json_path, doc, results, failures, complete=False)
        try:
            for item in run_matrix(configs, size=size, device=args.device, gpu=gpu):
                if isinstance(item, Result):
                    results.append(item)
                else:
                    config, message = item
                    failures.append({"config": config.name, "error": message})
                bar.advance()
                bar.phase("")
                bar.set_note(f"{len(failures)} failed" if failures else "")
                if bar.shown:
                    bar.show(_table(args.device, size, results, failures,
                                    last=max(3, bar.console_height() - 8)))
                if args.json_path:
                    _write_json(args.json_path, doc, results, failures, complete=False)
        except KeyboardInterrupt:
            interrupted = True
    out.print(_table(args.device, size, results, failures))
    summary = summarize(results)
    out.print(json.dumps(summary, indent=2))
    if args.json_path:
        _write_json(args.json_path, doc, results, failures, complete=not interrupted)
        if not interrupted:
            out.print(f"wrote {args.json_path}")
    if interrupted:
        done = len(results) + len(failures)
        where = f"; results so far in {args.json_path}" if args.json_path else ""
        print(f"memfit validate: interrupted after {done} of {len(configs)} configs{where}",
              file=sys.stderr)
        return 130  # the shell's code for a run stopped by SIGINT
    return 0


def _table(device: str, size: str, results: list[Any], failures: list[dict[str, str]], *,
           last: int | None = None) -> Table:
    """The results table; ``last``: only the last rows (the live view on a short terminal)."""
    table = Table(title=f"trace vs real ({device}, {size})", title_justify="left")
    rows = [_row(r) for r in results] + [
        (f"{f['config']}", f"[red]failed[/red]: {f['error']}", "", "", "", "", "")
        for f in failures]
    names = max((len(row[0]) for row in rows), default=6)
    for col in ("config", "measured alloc", "predicted", "error", "measured reserved",
                "predicted", "error"):
        # Names never break (a user copies them); numbers fold rather than lose digits.
        table.add_column(col, justify="left" if col == "config" else "right", overflow="fold",
                         min_width=names if col == "config" else None,
                         no_wrap=col == "config")
    if last is not None and len(rows) > last:
        table.caption = f"(the last {last} of {len(rows)} rows; all of them at the end)"
        rows = rows[-last:]
    for row in rows:
        table.add_row(*row)
    return table


def _row(item: Any) -> tuple[str, ...]:
    res = item.error_reserved
    return (item.config, f"{item.measured_allocated:,}", f"{item.predicted_allocated:,}",
            f"{100 * item.error_allocated:+.2f}%",
            "-" if item.measured_reserved is None else f"{item.measured_reserved:,}",
            f"{item.predicted_reserved:,}", "-" if res is None else f"{100 * res:+.2f}%")


def _document(args: argparse.Namespace, gpu: str | None, size: str, total: int
              ) -> dict[str, Any]:
    import torch

    return {
        "what": "memfit trace engine vs real runs",
        "date": dt.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else
        platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu_catalog_entry": gpu,
        "command": " ".join(["memfit", *sys.argv[1:]]) if sys.argv else "memfit validate",
        "size": size,
        "matrix": "quick" if args.device == "cpu" and not (args.full or args.families)
        else "full",
        "configs_total": total,
    }


def _write_json(path: str, doc: dict[str, Any], results: list[Any],
                failures: list[dict[str, str]], *, complete: bool) -> None:
    """Write the document atomically: a stopped run never leaves a half-written file."""
    from memfit.validate import summarize

    body = {**{k: v for k, v in doc.items() if k != "started"}, "complete": complete,
            "wall_seconds": time.perf_counter() - doc.get("started", time.perf_counter()),
            "configs_done": len(results) + len(failures),
            "summary": summarize(results), "results": [r.to_dict() for r in results],
            "failures": failures}
    write_atomic(path, json.dumps(body, indent=2))
