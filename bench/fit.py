"""The fit search against an exhaustive measured grid (issue 5's targets).

    python bench/fit.py [--device cpu|cuda] [--model gpt2] [--seq 512] [--global-batch 32]
                        [--budget 12GB] [--steps 3] [--out PATH]

For one model and memory budget:

1. ``memfit.fit`` searches (timed: target <= 60 s) and, on CUDA, measures its top candidates
   (``measure=True``; OOM trials counted: target 0).
2. The exhaustive grid: every precision x checkpointing (none/selective/full) x micro-batch
   (divisors of the global batch) with the user's optimizer, each applied with
   ``memfit.fitting.apply`` and timed for real. A config "fits" if it ran without the OOM guard
   splitting its micro-batch (CUDA: with ``torch.cuda.set_per_process_memory_fraction`` at the
   budget) and, on the CPU, if its measured peak (profiler allocator events) is within budget.
3. "Turn everything on": full checkpointing, micro-batch 1, optimizer states offloaded (CUDA),
   bf16-mixed where supported.

Reports throughput (samples/s) of the chosen config over the best of the grid (target >= 0.95)
and over everything-on (target >= 1.3). On CPU a small model runs so the script is exercised;
the targets are for a GPU. Writes ``bench/results/fit-<device>-<date>.json``.

    python bench/fit.py --search [--baseline]

times the search alone for the README's command, ``memfit fit gpt2 --gpu a100-40gb
--global-batch 256 --seq 1024`` (a CUDA target, traced on this machine: target <= 60 s), and
with ``--baseline`` the search of commit BASELINE_REF (loaded from git), in the same run, so
the ratio holds on a shared machine; the table (configurations, peaks, step times) must be the
same. Writes ``bench/results/fit-search-<date>.json``.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memfit.fitting import FitConfig, fit
from memfit.fitting.apply import apply_config
from memfit.fitting.measure import real_batch, time_steps
from memfit.profiling.cpu import measure_cpu_peak
from memfit.units import parse_bytes


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class SmallNet(nn.Module):
    """CPU stand-in: activations dominate the parameters, so budgets force trade-offs."""

    def __init__(self, d: int = 64, n: int = 6, classes: int = 16) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[_Block(d) for _ in range(n)])
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.blocks(x))
        return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def _model(args: argparse.Namespace) -> tuple[nn.Module, Any]:
    if args.device == "cpu":
        torch.manual_seed(0)
        return SmallNet(), (torch.randn(2, 128, 64), torch.randint(0, 16, (2, 128)))
    from memfit.models import resolve_model
    from memfit.models.build import build_model, example_inputs

    spec = resolve_model(args.model)
    model = build_model(spec, device="cpu")
    return model, example_inputs(spec, batch=1, seq=args.seq, device="cpu")


def _count_fn(sample: Any) -> Any:
    """A Hugging Face causal LM's ``.loss`` averages over its label tokens: the OOM guard must
    count those, not rows, to split a micro-batch exactly (``memfit.oom_guard``)."""
    from memfit.oom_guard import causal_lm_count

    return causal_lm_count if isinstance(sample, dict) and "labels" in sample else None


def _time_config(model: nn.Module, sample: Any, cfg: FitConfig, global_batch: int,
                 device: str, budget: int, steps: int) -> dict[str, Any]:
    trial = copy.deepcopy(model).to(device)
    batch = real_batch(sample, global_batch, device)
    row: dict[str, Any] = {"config": cfg.label()}
    try:
        _, opt, step = apply_config(trial, cfg, log_recoveries=False, count_fn=_count_fn(sample))
        step(batch)  # warm-up (optimizer state created)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            peak = None
        else:
            peak = measure_cpu_peak(lambda: step(batch), trial, opt, batch).peak_bytes
        times = time_steps(step, batch, device=device, steps=steps)
        if device == "cuda":
            peak = torch.cuda.max_memory_reserved()
        split = len(getattr(step, "recoveries", ()))
        row.update(step_s=statistics.median(times), peak_bytes=peak, recoveries=split,
                   fits=split == 0 and peak is not None and peak <= budget)
    except torch.OutOfMemoryError:
        row.update(step_s=None, peak_bytes=None, recoveries=None, fits=False, error="OOM")
    finally:
        del trial
        if device == "cuda":
            torch.cuda.empty_cache()
    if row.get("step_s"):
        row["samples_per_s"] = global_batch / row["step_s"]
    return row


SEARCH_COMMAND = ["gpt2", "--gpu", "a100-40gb", "--global-batch", "256", "--seq", "1024"]


BASELINE_REF = "e7c8995"
"""The commit whose search ``--baseline`` runs: main after round 1 (trace sharing, simpler-first
pruning by raw float times: 22 traces). Round 1 compared with ``0fcdf59`` (60 traces). The
baseline's search.py runs with this checkout's plan.py (``rank`` by ``tie_time``)."""


def _baseline_search() -> Any:
    """``memfit.fitting.search`` as it was at BASELINE_REF, loaded from git beside the current
    one (same trace engine, so the rows differ by the search alone)."""
    import subprocess
    import types

    source = subprocess.run(["git", "show", f"{BASELINE_REF}:src/memfit/fitting/search.py"],
                            capture_output=True, text=True, check=True,
                            cwd=Path(__file__).resolve().parent.parent).stdout
    module = types.ModuleType("memfit.fitting._search_baseline")
    sys.modules[module.__name__] = module
    exec(compile(source, f"{BASELINE_REF}:search.py", "exec"), module.__dict__)
    return module


def _search_row(baseline: bool) -> dict[str, Any]:
    """Time ``memfit fit`` of SEARCH_COMMAND as the CLI runs it (preset on the meta device)."""
    from memfit.cli.fit import _load_preset
    from memfit.fitting import search

    module = _baseline_search() if baseline else search
    model, sample = _load_preset("gpt2", 1024)
    started, cpu_started = time.perf_counter(), time.process_time()
    plan = module.fit(model, sample, global_batch=256, gpu="a100-40gb", device="cuda",
                      progress=False)
    seconds = time.perf_counter() - started
    cpu_seconds = time.process_time() - cpu_started
    return {"search": f"{BASELINE_REF} (before)" if baseline else "this commit",
            "seconds": seconds, "cpu_seconds": cpu_seconds, "traces": plan.traces,
            "candidates_considered": plan.candidates_considered,
            "chosen": plan.config.label(), "peak_bytes": plan.peak_bytes,
            "step_seconds": plan.step_seconds,
            "table": [[c.config.label(), c.peak_bytes, c.step_s]
                      for c in (plan.chosen, *plan.runners_up)]}


def search_main(baseline: bool, out: str | None) -> int:
    rows = [_search_row(False)] + ([_search_row(True)] if baseline else [])
    print(f"memfit fit {' '.join(SEARCH_COMMAND)}  (target <= 60 s)")
    print(f"  {'search':<24} {'seconds':>8} {'CPU s':>8} {'traces':>7}  chosen")
    for r in rows:
        print(f"  {r['search']:<24} {r['seconds']:>8.1f} {r['cpu_seconds']:>8.1f} "
              f"{r['traces']:>7}  {r['chosen']}")
    if baseline:
        print(f"  ratio (after / before): {rows[0]['seconds'] / rows[1]['seconds']:.2f}; "
              f"same plan: {rows[0]['table'] == rows[1]['table']}")
    result = {"device": platform.processor() or platform.machine(),
              "cpu_count": os.cpu_count(), "torch": torch.__version__,
              "python": platform.python_version(),
              "command": "memfit fit " + " ".join(SEARCH_COMMAND),
              "bench": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
              "date": dt.date.today().isoformat(), "target_seconds": 60, "rows": rows,
              "note": "shared machine: compare rows of one run, not runs"}
    path = Path(out or f"bench/results/fit-search-{result['date']}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--global-batch", type=int, default=None)
    parser.add_argument("--budget", default=None, help="default: CPU 12MB, CUDA 12GB")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--search", action="store_true",
                        help="time the search of `memfit fit gpt2 --gpu a100-40gb "
                        "--global-batch 256 --seq 1024` only")
    parser.add_argument("--baseline", action="store_true",
                        help="with --search: also the search of commit BASELINE_REF, in the "
                        "same run")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    if args.search:
        return search_main(args.baseline, args.out)
    cpu = args.device == "cpu"
    global_batch = args.global_batch or (16 if cpu else 32)
    budget = parse_bytes(args.budget or ("12MB" if cpu else "12GB"), what="--budget")
    model, sample = _model(args)
    gpu = None
    if not cpu:
        from memfit.gpus import list_gpus

        name = torch.cuda.get_device_name()
        gpu = next((g.name for g in list_gpus() if g.label.lower() in name.lower()
                    or name.lower() in g.label.lower()), "h100-sxm-80gb")
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total))

    started = time.perf_counter()
    plan = fit(model, sample, global_batch=global_batch, budget_bytes=budget, gpu=gpu,
               device=args.device, measure=not cpu, progress=False, count_fn=_count_fn(sample))
    search_s = time.perf_counter() - started
    print(plan)

    precisions = ["fp32", "bf16-mixed"]
    per = [m for m in range(1, global_batch + 1) if global_batch % m == 0]
    grid = [FitConfig(precision=p, checkpointing=c, micro_batch=m, accumulation=global_batch // m)
            for p in precisions for c in ("none", "selective", "full") for m in per]
    rows = [_time_config(model, sample, cfg, global_batch, args.device, budget, args.steps)
            for cfg in grid]
    for r in rows:
        print(f"  {r['config']:<48} fits={r['fits']!s:<5} step={r.get('step_s')}")
    chosen = _time_config(model, sample, plan.config, global_batch, args.device, budget,
                          args.steps)
    everything = FitConfig(precision="bf16-mixed", checkpointing="full", micro_batch=1,
                           accumulation=global_batch, offload_states=not cpu)
    on = _time_config(model, sample, everything, global_batch, args.device, budget, args.steps)
    fitting = [r for r in rows if r["fits"]]
    best = max(fitting, key=lambda r: r["samples_per_s"]) if fitting else None
    result = {
        "device": torch.cuda.get_device_name() if not cpu else platform.processor() or "cpu",
        "torch": torch.__version__, "python": platform.python_version(),
        "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "date": dt.date.today().isoformat(), "budget_bytes": budget,
        "global_batch": global_batch, "search_seconds": search_s, "plan": plan.to_dict(),
        "chosen_measured": chosen, "grid": rows, "best_of_grid": best,
        "everything_on": on,
        "ratio_vs_best": (chosen["samples_per_s"] / best["samples_per_s"]
                          if best and chosen.get("samples_per_s") else None),
        "ratio_vs_everything_on": (chosen["samples_per_s"] / on["samples_per_s"]
                                   if on.get("samples_per_s") and chosen.get("samples_per_s")
                                   else None),
        "oom_trials": plan.oom_trials, "chosen_fits_measured": chosen["fits"],
        "targets": {"ratio_vs_best": 0.95, "ratio_vs_everything_on": 1.3,
                    "search_seconds": 60, "oom_trials": 0},
    }
    print(f"search {search_s:.1f} s; chosen {plan.config.label()}; vs best of grid "
          f"{result['ratio_vs_best']}; vs everything on {result['ratio_vs_everything_on']}; "
          f"OOM trials {plan.oom_trials}; chosen fits (measured) {chosen['fits']}")
    out = Path(args.out or f"bench/results/fit-{args.device}-{result['date']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
