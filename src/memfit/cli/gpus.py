"""``memfit gpus``: the GPU catalog."""

from __future__ import annotations

import argparse
import textwrap
from dataclasses import asdict
from typing import Any

from rich.table import Table

from memfit.cli._common import console, name_column, print_json, print_table
from memfit.units import format_bytes


def register(sub: Any) -> None:
    p = sub.add_parser("gpus", help="list the GPU catalog", description=__doc__)
    p.add_argument("--gpu-file", help="a JSON file adding or overriding catalog GPUs")
    p.add_argument("--json", action="store_true", help="print the catalog as JSON")
    p.set_defaults(func=run)


def _tf(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def run(args: argparse.Namespace) -> int:
    from memfit.gpus import list_gpus

    gpus = list_gpus(args.gpu_file)
    if args.json:
        print_json([asdict(g) for g in gpus])
        return 0
    table = Table(title="GPU catalog (dense TFLOPS; usable = what PyTorch can allocate)",
                  title_justify="left")
    name_column(table, "name")
    for col in ("memory", "usable", "GB/s", "bf16 TF", "fp8 TF", "host link", "$/h"):
        table.add_column(col, justify="left" if col in ("memory", "host link") else "right",
                         no_wrap=col == "usable")
    for g in gpus:
        price = "-" if g.price_per_hour is None else f"{g.price_per_hour:.2f}"
        usable = format_bytes(g.usable_bytes) + ("" if g.usable_measured else "*")
        table.add_row(g.name, g.memory_label, usable,
                      f"{g.bandwidth_gbps:,.0f}", _tf(g.tflops.get("bf16")),
                      _tf(g.tflops.get("fp8")), g.host_link.kind, price)
    print_table(table, drop=("$/h", "host link", "fp8 TF", "bf16 TF", "GB/s", "memory",
                             "usable"))
    if not all(g.usable_measured for g in gpus):
        out = console()  # wrapped at the table's width, also when piped (whole lines)
        out.print(textwrap.fill(
            "* not measured: PyTorch's total_memory for this GPU is not in the catalog; shown "
            "is the driver's total (PyTorch allocates 1-2% less), or the label's GB where no "
            "driver figure was found (--json: memory_basis, usable_measured)", width=out.width))
    return 0
