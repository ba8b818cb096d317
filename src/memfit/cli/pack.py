"""``memfit pack``: place several served models (tenants), each with its traffic, on a GPU pool.

Each tenant (a model, its QPS and prompt/output tokens, optional tp, quant, KV dtype, TPOT/TTFT
hints, MIG profile) needs the memory of its vLLM engine (weights, activation peak, CUDA graphs,
memory outside torch, the CUDA context, and the KV cache for the concurrency its traffic needs
by Little's law) and the HBM bandwidth its decode steps stream. Both constrain the packing.
Tenants share whole GPUs, or each takes a MIG instance (A100, H100). Small cases are solved
exactly (exhaustive search), larger ones by first-fit decreasing. The request-time model is an
estimate (docs/pack.md). Exit 0: every tenant placed; 1: some left out (each said, with why);
2: bad input, or no tenant fits anywhere.
"""

from __future__ import annotations

import argparse
from typing import Any

from memfit.cli._common import console, name_column, print_json

EXIT_SOME_UNPLACED = 1


def register(sub: Any) -> None:
    p = sub.add_parser("pack", help="place several served models on a GPU pool (memory, "
                       "bandwidth, MIG)", description=__doc__)
    p.add_argument("tenants", help="a YAML (safe loader) or JSON file of tenants (docs/pack.md)")
    p.add_argument("--gpus", required=True, metavar="POOL",
                   help="the pool: COUNTxGPU, e.g. 4xh100-sxm-80gb (several joined by commas)")
    p.add_argument("--mig", default="off", choices=("off", "auto"),
                   help="tenants without a `mig:` key share whole GPUs (off, default) or take "
                   "the smallest MIG profile that fits (auto)")
    p.add_argument("--json", action="store_true", help="print the packing as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from memfit.serving.pack import pack

    result = pack(args.tenants, gpus=args.gpus, mig=args.mig)
    if args.json:
        print_json(result.to_json())
    else:
        render(result)
    return EXIT_SOME_UNPLACED if result.packing.unplaced else 0


def render(result: Any) -> None:
    from rich.table import Table

    from memfit.units import format_bytes, plural

    out = console()
    how = ("optimal (exhaustive search)" if result.packing.method == "exhaustive"
           else "first-fit decreasing (too large to search exhaustively)")
    out.print(f"{result.gpus_used} of {plural(len(result.pool), 'GPU')} used, {how}")
    table = Table(title="Assignment", title_justify="left")
    for col in ("gpu", "type", "tenants", "memory used", "TB/s used"):
        table.add_column(col, justify="left" if col in ("type", "tenants") else "right")
    for row in result.gpu_rows():
        if not row["tenants"]:
            continue
        names = ", ".join(t["name"] + (f" ({t['mig_profile']})" if t["mig_profile"] else "")
                          for t in row["tenants"])
        table.add_row(str(row["gpu"]), row["type"], names,
                      f"{format_bytes(row['memory_used_bytes'])} of "
                      f"{format_bytes(row['memory_capacity_bytes'])}",
                      f"{row['bandwidth_used_bytes_per_s'] / 1e12:.2f} of "
                      f"{row['bandwidth_capacity_bytes_per_s'] / 1e12:.2f}")
    out.print(table)
    tenants = Table(title="Tenants (per GPU of each one's TP group)", title_justify="left")
    name_column(tenants, "tenant")
    for col in ("device", "conc.", "memory (free)", "TB/s (free)", "util"):
        tenants.add_column(col, justify="left" if col == "device" else "right")
    for row in result.tenant_rows():
        if not row["placed"]:
            continue
        device = row["device"].replace(" MIG ", "\nMIG ")
        tenants.add_row(row["name"], device, str(row["concurrency"]),
                        f"{format_bytes(row['memory_bytes'])} "
                        f"({format_bytes(row['memory_headroom_bytes'])})",
                        f"{row['bandwidth_bytes_per_s'] / 1e12:.2f} "
                        f"({row['bandwidth_headroom_bytes_per_s'] / 1e12:.2f})",
                        f"{row['gpu_memory_utilization']:.3f}")
    out.print(tenants)
    for row in result.tenant_rows():
        if not row["placed"]:
            out.print(f"NOT PLACED: {row['name']}: {row['reason']}")
    out.print("util: the tenant's --gpu-memory-utilization on its device. Estimates: "
              "concurrency by Little's law on a roofline request time (prefill on FLOPS, "
              "decode on HBM bandwidth at 80%); see docs/pack.md")
