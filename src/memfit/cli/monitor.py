"""``memfit monitor``: live GPU and host memory, with an alert threshold before OOM."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from rich.live import Live
from rich.table import Table
from rich.text import Text

from memfit.cli._common import console, positive_int
from memfit.errors import MemfitError
from memfit.units import format_bytes

EPILOG = """examples:
  memfit monitor                        # live view, refreshing every second
  memfit monitor --threshold 0.85       # highlight and ring the bell at 85% of a GPU
  memfit monitor --once --json          # one reading for scripts
  memfit monitor --prometheus 9400      # serve /metrics on 127.0.0.1:9400

GPUs are read through NVML (`pip install 'memfit[monitor]'`), else torch.cuda; with no GPU only
host memory is shown.
"""


def register(sub: Any) -> None:
    p = sub.add_parser("monitor", help="live GPU and host memory with an OOM alert threshold",
                       description=__doc__, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--interval", default="1.0", help="seconds between refreshes (default 1)")
    p.add_argument("--threshold", default="0.9", help="fraction of a device's memory that "
                   "highlights it and rings the bell (default 0.9)")
    p.add_argument("--once", action="store_true", help="print one reading and exit")
    p.add_argument("--json", action="store_true", help="print readings as JSON (with --once: "
                   "one object; else one object per line)")
    p.add_argument("--count", help="stop after this many refreshes (default: until Ctrl-C)")
    p.add_argument("--prometheus", metavar="PORT", help="serve Prometheus metrics on PORT")
    p.add_argument("--bind", default="127.0.0.1", help="address for --prometheus (default "
                   "127.0.0.1; 0.0.0.0 exposes it to the network)")
    p.set_defaults(func=run)


def _float(text: str, flag: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise MemfitError(f"{flag} must be a number, got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    from memfit.monitor import (
        PrometheusExporter,
        check_threshold,
        read_memory,
    )

    threshold = check_threshold(_float(args.threshold, "--threshold"), "--threshold")
    interval = _float(args.interval, "--interval")
    if interval <= 0:
        raise MemfitError(f"--interval must be a positive number of seconds, got {args.interval!r}")
    count = positive_int(args.count, "--count")
    if args.once:
        count = 1
    if args.prometheus is not None:
        port = positive_int(args.prometheus, "--prometheus")
        assert port is not None
        exporter = PrometheusExporter(port, bind=args.bind).start()
        print(f"memfit: serving Prometheus metrics at http://{args.bind}:{exporter.port}/metrics "
              "(Ctrl-C to stop)", file=sys.stderr)
        try:
            n = 0
            while count is None or n < count:
                time.sleep(interval)
                n += 1
        except KeyboardInterrupt:
            pass
        finally:
            exporter.close()
        return 0
    if args.json:
        n = 0
        while True:
            reading = read_memory()
            print(json.dumps(reading.to_dict(), indent=2 if args.once else None), flush=True)
            n += 1
            if count is not None and n >= count:
                return 0
            time.sleep(interval)
    out = console()
    reading = read_memory()
    if reading.note:
        out.print(f"[yellow]{reading.note}[/yellow]")
    if args.once:
        out.print(render(reading, threshold))
        return 0
    over: set[str] = set()
    n = 0
    try:
        with Live(render(reading, threshold), console=out, auto_refresh=False) as live:
            while True:
                for name in _crossed(reading, threshold, over):
                    out.bell()
                    live.console.print(f"[bold red]memfit: {name} above "
                                       f"{100 * threshold:.0f}% of its memory[/bold red]")
                live.update(render(reading, threshold), refresh=True)
                n += 1
                if count is not None and n >= count:
                    return 0
                time.sleep(interval)
                reading = read_memory()
    except KeyboardInterrupt:
        return 0


def _crossed(reading: Any, threshold: float, over: set[str]) -> list[str]:
    """Devices that just went over the threshold (each rings once until it falls back)."""
    devices = [(f"GPU {g.index}", g.fraction) for g in reading.gpus]
    devices.append(("host", reading.host.fraction))
    crossed = []
    for name, fraction in devices:
        if fraction >= threshold and name not in over:
            over.add(name)
            crossed.append(name)
        elif fraction < threshold:
            over.discard(name)
    return crossed


def _bar(fraction: float, threshold: float, width: int = 16) -> Text:
    filled = min(width, round(fraction * width))
    style = "bold red" if fraction >= threshold else "yellow" if fraction >= 0.75 else "green"
    return Text("█" * filled + "░" * (width - filled), style=style)


def render(reading: Any, threshold: float) -> Table:
    """The live view's table for one reading."""
    table = Table(title=f"memfit monitor (alert at {100 * threshold:.0f}%, "
                  f"GPUs via {reading.gpu_source})")
    for col, justify in (("device", "left"), ("used", "right"), ("this process", "right"),
                         ("total", "right"), ("", "left"), ("%", "right")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for g in reading.gpus:
        style = "bold red" if g.fraction >= threshold else ""
        table.add_row(f"GPU {g.index} {g.name}", format_bytes(g.used_bytes),
                      format_bytes(g.process_bytes) if g.process_bytes is not None else "-",
                      format_bytes(g.total_bytes), _bar(g.fraction, threshold),
                      f"{100 * g.fraction:.1f}", style=style)
    h = reading.host
    table.add_row("host", format_bytes(h.used_bytes), "-", format_bytes(h.total_bytes),
                  _bar(h.fraction, threshold), f"{100 * h.fraction:.1f}",
                  style="bold red" if h.fraction >= threshold else "")
    return table
