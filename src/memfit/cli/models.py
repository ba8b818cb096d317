"""``memfit models``: the built-in model presets."""

from __future__ import annotations

import argparse
from typing import Any

from rich.table import Table

from memfit.cli._common import name_column, print_json, print_table


def register(sub: Any) -> None:
    p = sub.add_parser("models", help="list the model presets", description=__doc__)
    p.add_argument("--json", action="store_true", help="print the presets as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from memfit.models.presets import list_presets

    presets = list_presets(include_trace_only=True)
    if args.json:
        print_json([{"name": m.name, "family": m.family, "params": m.param_count(),
                     "layers": m.num_layers, "hidden_size": m.hidden_size,
                     "source": m.source} for m in presets])
        return 0
    table = Table(title="Model presets (architecture configs, no weights)", title_justify="left")
    name_column(table, "name")
    for col in ("family", "params", "layers", "hidden", "heads (kv)", "experts"):
        table.add_column(col, justify="left" if col == "family" else "right")
    for m in presets:
        experts = f"{m.num_experts} (top-{m.experts_per_token})" if m.is_moe else "-"
        table.add_row(m.name, m.family, f"{m.param_count():,}", str(m.num_layers),
                      str(m.hidden_size), f"{m.num_heads} ({m.num_kv_heads})", experts)
    print_table(table, drop=("experts", "heads (kv)", "hidden", "layers", "family", "params"))
    return 0
