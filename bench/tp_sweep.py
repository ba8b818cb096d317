"""Trace every installed transformers decoder that ships a tensor-parallel plan under ``tp=2``.

Run: ``python bench/tp_sweep.py [--jobs 2] [--only llama,mixtral]``

For each causal-LM model type whose config has a ``base_model_tp_plan``, builds the tiny config
of ``bench/arch_sweep.py`` on meta weights and traces one fp32 AdamW step per rank with
``memfit.estimate(..., parallel=Parallel(gpus=2, tp=2))``: no ``tp_plan`` given, so the model's
own plan applies (``memfit.parallel.tp_plans.hf_plan``), as transformers applies it. An
architecture whose tiny model does not trace on one rank first (a config the sweep's sizes do not
fit) is listed with the reason and not counted. Prints one line per architecture and the count,
and writes ``bench/results/tp-sweep-cpu-<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import platform
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from arch_sweep import _model_class, _reason, inputs_for, tiny_config


def planned_types() -> list[str]:
    """The causal-LM model types whose default config ships a ``base_model_tp_plan``."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto import modeling_auto

    out = []
    for model_type in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        try:
            plan = getattr(CONFIG_MAPPING[model_type], "base_model_tp_plan", None)
        except KeyError:
            continue
        if plan:
            out.append(model_type)
    return sorted(out)


def run_one(model_type: str) -> dict[str, Any]:
    """One architecture's tp 2 trace: ``ok`` with each rank role's peak, or the reason."""
    import memfit
    from memfit.categories import MemoryCategory
    from memfit.parallel import Parallel

    warnings.simplefilter("ignore")
    row: dict[str, Any] = {"model_type": model_type}
    started = time.perf_counter()
    try:
        cls = _model_class("causal-lm", model_type)
        config = tiny_config(model_type)
        with torch.device("meta"):
            model = cls(config)
        batch = inputs_for(model, config, "causal-lm", device="meta")
        model.train()
        try:  # one rank first: a model the tiny config cannot run is not counted
            memfit.estimate(model, batch, device="cpu", steps=1)
        except Exception as exc:
            row["result"] = "one rank: " + _reason(exc)
            row["one_rank"] = False
            return row
        row["one_rank"] = True
        with torch.device("meta"):
            model = cls(config)
        model.train()
        est = memfit.estimate(model, batch, device="cpu", steps=1,
                              parallel=Parallel(gpus=2, tp=2))
        row["result"] = "ok"
        row["peaks"] = [e.peak_bytes for e in est.per_rank]
        row["weights"] = [e.breakdown[MemoryCategory.WEIGHTS] for e in est.per_rank]
        row["whole_weights"] = 4 * sum(p.numel() for p in model.parameters())  # fp32
    except Exception as exc:  # recorded with its reason
        row["result"] = _reason(exc)
    row["seconds"] = round(time.perf_counter() - started, 2)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--only", default="", help="comma-separated model types")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    import transformers

    only = {s for s in args.only.split(",") if s}
    todo = [t for t in planned_types() if not only or t in only]
    started = time.perf_counter()
    rows = []
    with multiprocessing.get_context("spawn").Pool(args.jobs, maxtasksperchild=8) as pool:
        for row in pool.imap_unordered(run_one, todo):
            rows.append(row)
            print(f"[{len(rows)}/{len(todo)}] {row['model_type']:<28} {row['result'][:150]}",
                  flush=True)
    rows.sort(key=lambda r: r["model_type"])
    ok = sum(r["result"] == "ok" for r in rows)
    one = sum(bool(r.get("one_rank")) for r in rows)
    print(f"\n{ok} of {one} causal-LM architectures with a base_model_tp_plan that trace on one "
          f"rank also trace under tp=2 ({len(rows)} have a plan; {len(rows) - one} do not run "
          "with the sweep's tiny config on one rank)")
    date = datetime.date.today().isoformat()
    out = Path(args.out or Path(__file__).parent / "results" / f"tp-sweep-cpu-{date}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(), "seconds": round(time.perf_counter() - started),
        "summary": {"traced_tp2": ok, "traced_one_rank": one, "with_plan": len(rows)},
        "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
