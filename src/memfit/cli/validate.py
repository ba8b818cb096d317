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

EXIT_FAILED = 1
"""A config could not be run or traced (skipped configs, which this machine cannot run at all,
do not count)."""

def register(sub: Any) -> None:
    p = sub.add_parser("validate", help="compare trace predictions with real runs",
                       description=__doc__, epilog="exit status: 0 when every config ran (or "
                       "was skipped: this machine cannot run it, with the reason), 1 when a "
                       "config failed, 2 on bad input, 130 when interrupted")
    p.add_argument("--device", default=None, choices=["cuda", "cpu"],
                   help="where the real runs go (default: cuda when a CUDA device is "
                   "available, else cpu; the first line says which)")
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

    from memfit.validate import Result, Skipped, matrix, run_matrix, summarize, zoo

    out = console()
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
        out.print(f"memfit validate: on {args.device} (no --device given; "
                  + ("a CUDA device is available)" if args.device == "cuda"
                     else "no CUDA device here)"))
    if args.device == "cuda" and not torch.cuda.is_available():
        raise MemfitError("no CUDA device here: run `memfit validate --device cpu`, or run on a "
                          "GPU machine")
    if args.limit is not None and args.limit <= 0:
        raise MemfitError(f"--limit must be a positive integer, got {args.limit}; leave it out "
                          "to run every config")
    if args.gpu and args.device == "cpu":
        raise MemfitError(f"--gpu {args.gpu} names the CUDA GPU the prediction is for; "
                          "--device cpu runs and predicts this machine's CPU: drop --gpu, or "
                          "use --device cuda on a GPU machine")
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
    results: list[Result] = []
    failures: list[dict[str, str]] = []
    skipped: list[dict[str, str]] = []
    done: list[Any] = []  # every item in the order it finished: the table's rows
    doc = _document(args, gpu, size, len(configs))
    doc["started"] = time.perf_counter()
    interrupted = False
    # Note: [partial results] The JSON file is rewritten (temp file + os.replace, atomic on
    # POSIX and Windows) after every config, so Ctrl-C, a kill or a crash leaves a valid file
    # with every config finished so far ("complete": false until the last one).
    with Progress(f"memfit validate ({args.device}, {size})", total=len(configs),
                  unit="configs", progress=False if args.quiet else None) as bar:
        if args.json_path:
            _write_json(args.json_path, doc, results, failures, skipped, complete=False)
        try:
            for item in run_matrix(configs, size=size, device=args.device, gpu=gpu):
                if isinstance(item, Result):
                    results.append(item)
                elif isinstance(item, Skipped):
                    skipped.append({"config": item.config.name, "reason": item.reason})
                else:
                    config, message = item
                    failures.append({"config": config.name, "error": message})
                done.append(item)
                bar.advance()
                bar.phase("")
                bar.set_note(f"{len(failures)} failed" if failures else "")
                if bar.shown:
                    bar.show(ResultsView(args.device, size, done,
                                         last=max(3, bar.console_height() - 8)))
                if args.json_path:
                    _write_json(args.json_path, doc, results, failures, skipped,
                                complete=False)
        except KeyboardInterrupt:
            interrupted = True
    out.print(ResultsView(args.device, size, done))
    out.print(summary_line(summarize(results), len(skipped), len(failures)))
    if args.json_path:
        _write_json(args.json_path, doc, results, failures, skipped,
                    complete=not interrupted)
        if not interrupted:
            out.print(f"wrote {args.json_path}")
    if interrupted:
        finished = len(done)
        where = f"; results so far in {args.json_path}" if args.json_path else ""
        print(f"memfit validate: interrupted after {finished} of {len(configs)} configs{where}",
              file=sys.stderr)
        return 130  # the shell's code for a run stopped by SIGINT
    return EXIT_FAILED if failures else 0


def summary_line(summary: dict[str, Any], skipped: int, failed: int) -> str:
    """One line: how many configs ran and their errors (the JSON file has the same numbers)."""
    alloc = summary["allocated"]
    text = f"{summary['configs']} configs compared"
    if alloc["median_abs"] is not None:
        text += (f"; allocated error: median {100 * alloc['median_abs']:.2f}%, "
                 f"max {100 * alloc['max_abs']:.2f}%, worst under "
                 f"{100 * alloc['worst_under']:+.2f}%")
    res = summary["reserved"]
    if res["median_abs"] is not None:
        text += (f"; reserved: median {100 * res['median_abs']:.2f}%, max "
                 f"{100 * res['max_abs']:.2f}%")
    if skipped:
        text += f"; {skipped} skipped"
    if failed:
        text += f"; [red]{failed} failed[/red]"
    return text


class ResultsView:
    """The results as a table when it fits the width drawn at; else one config a line with its
    numbers on the next (a name is never broken: a user copies it). Skipped and failed configs
    show in their row, their reasons under it. ``last``: only the last rows (the live view on a
    short terminal)."""

    def __init__(self, device: str, size: str, items: list[Any], *,
                 last: int | None = None) -> None:
        self.title = f"trace vs real ({device}, {size})"
        self.items, self.total = (items[-last:] if last is not None else items), len(items)
        self.last = last
        self.reserved = any(getattr(i, "measured_reserved", None) is not None
                            for i in self.items)

    def _cells(self, item: Any) -> tuple[str, list[str]]:
        from memfit.validate import Result, Skipped

        if isinstance(item, Result):
            cells = [f"{item.measured_allocated:,}", f"{item.predicted_allocated:,}",
                     f"{100 * item.error_allocated:+.2f}%"]
            if self.reserved:
                res = item.error_reserved
                cells += ["-" if item.measured_reserved is None else f"{item.measured_reserved:,}",
                          f"{item.predicted_reserved:,}",
                          "-" if res is None else f"{100 * res:+.2f}%"]
            return item.config, cells
        name = item.config.name if isinstance(item, Skipped) else item[0].name
        status = ("[yellow]skipped[/yellow]" if isinstance(item, Skipped)
                  else "[red]failed[/red]")
        return name, [status] + [""] * (5 if self.reserved else 2)

    @staticmethod
    def _reason(item: Any) -> str:
        """Why a skipped or failed config has no numbers ("" for a result)."""
        from memfit.validate import Skipped

        return item.reason if isinstance(item, Skipped) else (
            item[1] if isinstance(item, tuple) else "")

    def _notes(self) -> list[Any]:
        """Under the table: each skipped or failed config's status and reason."""
        from rich.text import Text

        notes = []
        for item in self.items:
            if reason := self._reason(item):
                name, cells = self._cells(item)
                notes.append(Text(name + ": ") + Text.from_markup(cells[0])
                             + Text(": " + reason))
        return notes

    def _caption(self) -> str | None:
        if self.last is not None and self.total > self.last:
            return f"(the last {self.last} of {self.total} rows; all of them at the end)"
        return None

    def table(self) -> Table:
        table = Table(title=self.title, title_justify="left", caption=self._caption())
        table.add_column("config", no_wrap=True)
        heads = ["measured alloc", "predicted", "error"]
        if self.reserved:
            heads += ["measured reserved", "predicted", "error"]
        for head in heads:
            table.add_column(head, justify="right", no_wrap=True)
        for item in self.items:
            name, cells = self._cells(item)
            table.add_row(name, *cells)
        return table

    def compact(self) -> Any:
        """One config a line, its numbers on the next, aligned: fits 80 columns."""
        from rich.console import Group
        from rich.text import Text

        rows = [self._cells(item) for item in self.items]
        numbers = [cells for _, cells in rows if cells[1]]  # skipped/failed rows have none
        # measured, predicted, error: one width each for the allocated and reserved lines
        widths = [max((len(cells[k]) for cells in numbers for k in (i, i + 3)
                       if k < len(cells)), default=1) for i in range(3)]
        lines: list[Any] = [Text(self.title + ": bytes measured / predicted, error",
                                 style="italic")]
        for item, (name, cells) in zip(self.items, rows, strict=True):
            lines.append(Text(name, style="bold", no_wrap=True, overflow="ignore"))
            if not cells[1]:  # skipped or failed: the status and its reason
                lines.append(Text.from_markup("    " + cells[0] + ": ")
                             + Text(self._reason(item)))
                continue
            parts = [("allocated", cells[:3])]
            if self.reserved:
                parts.append(("reserved", cells[3:]))
            for label, (measured, predicted, error) in parts:
                lines.append(Text(f"    {label:<9} {measured:>{widths[0]}} / "
                                  f"{predicted:>{widths[1]}}  {error:>{widths[2]}}"))
        if (caption := self._caption()) is not None:
            lines.append(Text(caption, style="dim"))
        return Group(*lines)

    def __rich_console__(self, console: Any, options: Any) -> Any:
        from rich.measure import Measurement

        table = self.table()
        # Measured unbounded: a measurement is clamped to the width it is given.
        needed = Measurement.get(console, options.update_width(10**6), table).maximum
        if needed > options.max_width:
            yield self.compact()
            return
        yield table
        yield from self._notes()


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
                failures: list[dict[str, str]], skipped: list[dict[str, str]], *,
                complete: bool) -> None:
    """Write the document atomically: a stopped run never leaves a half-written file."""
    from memfit.validate import summarize

    body = {**{k: v for k, v in doc.items() if k != "started"}, "complete": complete,
            "wall_seconds": time.perf_counter() - doc.get("started", time.perf_counter()),
            "configs_done": len(results) + len(failures) + len(skipped),
            "summary": summarize(results), "results": [r.to_dict() for r in results],
            "failures": failures, "skipped": skipped}
    write_atomic(path, json.dumps(body, indent=2))
