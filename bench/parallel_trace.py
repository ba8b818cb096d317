"""Per-rank peaks of parallel steps: memfit's trace, PyTorch's FSDPMemTracker, real gloo ranks.

Run: ``python bench/parallel_trace.py [--skip-measured] [--gpt2]``

For each layout of a tiny Llama-like decoder (hidden 64, 2 layers, vocab 250; batch 2 x seq 64;
fp32, AdamW, 2 steps; CPU; the expert-parallel row: its MLPs as 4 builtin MoE experts, top 2;
the pipeline layouts: 4 layers, batch 8 in 4 micro-batches):

- ``measured``: one process per rank over gloo (``memfit.parallel.measure``): the profiler's
  allocator events of the step's own blocks, lowest of 3 runs; ``gloo scratch``: gloo's own
  blocks beside them (see Note: [gloo's own buffers] in memfit/parallel/measure.py);
- ``memfit``: ``memfit.estimate(..., device="cpu", parallel=memfit.Parallel(...))``, which traces
  one rank per role over a fake process group;
- ``FSDPMemTracker``: ``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker`` (FSDP2 only),
  run the way its docstring shows, on the same fake-tensor model, FSDP2-sharded over the same
  fake process group (rank 0), for the same 2 steps; its peak is ``get_tracker_snapshot("peak")``.

``--gpt2`` adds GPT-2 (124M, transformers) FSDP over 8 fake ranks, batch 8 x 1024, memfit and
FSDPMemTracker only (8 real ranks do not fit this machine). Writes
``bench/results/parallel-trace-cpu-<date>.json`` with the torch version and the command.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

import memfit
from memfit.parallel import Parallel
from memfit.parallel.measure import Case, build, measure, tiny_moe_spec, tiny_spec
from memfit.recipe import Recipe

P = Parallel
LAYOUTS: dict[str, tuple[int, Parallel]] = {  # name -> (world, layout)
    "fsdp2 (reshard)": (2, P(gpus=2, fsdp=2)),
    "fsdp2 (no reshard)": (2, P(gpus=2, fsdp=2, reshard_after_forward=False)),
    "ddp": (2, P(gpus=2)),
    "zero1": (2, P(gpus=2, zero=1)),
    "tp 2": (2, P(gpus=2, tp=2)),
    "tp 2 + sp": (2, P(gpus=2, tp=2, sp=True)),
    "tp 2 + sp + loss par.": (2, P(gpus=2, tp=2, sp=True, loss_parallel=True)),
    "hsdp 2x2": (4, P(gpus=4, fsdp=2)),
    "fsdp2 x4 (reshard)": (4, P(gpus=4, fsdp=4)),
    "fsdp2 x4 bf16 params": (4, P(gpus=4, fsdp=4, param_dtype="bf16", reduce_dtype="fp32")),
    "tp 2 x fsdp 2": (4, P(gpus=4, tp=2, fsdp=2)),
    "tp 2 + sp x fsdp 2": (4, P(gpus=4, tp=2, fsdp=2, sp=True)),
    "tp 2 + sp x hsdp 2x2": (8, P(gpus=8, tp=2, fsdp=2, sp=True)),
}
MOE_LAYOUTS: dict[str, tuple[int, Parallel]] = {  # the same decoder, MLPs as 4 MoE experts (top 2)
    "ep 2 (moe)": (2, P(gpus=2, ep=2)),
    "ep 2 + fsdp2 (moe)": (2, P(gpus=2, fsdp=2, ep=2)),
    "ep 2 + fsdp2 x4 (moe)": (4, P(gpus=4, fsdp=4, ep=2)),
}
PIPELINE_LAYOUTS: dict[str, tuple[int, Parallel]] = {  # 4 layers, batch 8 in 4 micro-batches
    "pp 2 (1f1b)": (2, P(gpus=2, pp=2, microbatches=4)),
    "pp 2 (gpipe)": (2, P(gpus=2, pp=2, microbatches=4, pp_schedule="gpipe")),
    "pp 2 (interleaved 1f1b)": (2, P(gpus=2, pp=2, microbatches=4,
                                     pp_schedule="interleaved-1f1b")),
    "pp 4 (1f1b)": (4, P(gpus=4, pp=4, microbatches=4)),
    "pp 2 x fsdp 2 (1f1b)": (4, P(gpus=4, pp=2, fsdp=2, microbatches=4,
                                  reshard_after_forward=False)),
}


def fsdp_mem_tracker_peak(make: Any, parallel: Parallel, steps: int = 2) -> int | None:
    """FSDPMemTracker's peak for rank 0 of ``parallel`` (None: not an FSDP layout, or FSDP
    beside tensor, pipeline or expert parallelism, which it does not apply: it would run the
    whole model on every rank). ``make()`` builds ``(model, inputs)``; it runs inside a
    FakeTensorMode."""
    if parallel.strategy not in ("fsdp", "hsdp") or max(parallel.tp, parallel.pp,
                                                          parallel.ep) > 1:
        return None
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from memfit._loss import model_loss
    from memfit.parallel.apply import apply_fsdp, device_mesh
    from memfit.parallel.trace import fake_world

    with fake_world(parallel.gpus, 0):
        mesh = device_mesh(parallel, "cpu")
        with FakeTensorMode(allow_non_fake_inputs=True):
            model, inputs = make()
            apply_fsdp(model, parallel, mesh)
            opt = torch.optim.AdamW(model.parameters())
            fmt = FSDPMemTracker(model, opt)
            fmt.track_inputs((inputs,))
            with fmt:
                for _ in range(steps):
                    model_loss(model, inputs).backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    fmt.reset_mod_stats()  # its per-module stats allow one iteration each
            snap = fmt.get_tracker_snapshot("peak")
    return max(per["Total"] for per in snap.values())


def memfit_peaks(model: Any, inputs: Any, parallel: Parallel) -> tuple[list[int], float]:
    started = time.perf_counter()
    est = memfit.estimate(model, inputs, device="cpu", parallel=parallel)
    by_rank = {r: e.peak_bytes for e in est.per_rank for r in e.ranks}
    return [by_rank[r] for r in range(parallel.gpus)], time.perf_counter() - started


def pct(pred: float | None, real: float) -> str:
    return "" if pred is None else f"{100 * (pred - real) / real:+.2f}%"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-measured", action="store_true", help="no gloo runs")
    ap.add_argument("--gpt2", action="store_true", help="add GPT-2 FSDP x 8 (no measurement)")
    args = ap.parse_args()
    spec = dataclasses.replace(tiny_spec(), vocab_size=250)
    cases = {name: Case(spec=spec, batch=2, seq=64,
                        recipe=Recipe(parallel=p)) for name, (_, p) in LAYOUTS.items()}
    moe_spec = dataclasses.replace(tiny_moe_spec(), vocab_size=250)
    cases.update({name: Case(spec=moe_spec, batch=2, seq=64, recipe=Recipe(parallel=p))
                  for name, (_, p) in MOE_LAYOUTS.items()})
    cases.update({name: Case(spec=dataclasses.replace(spec, num_layers=4), batch=8, seq=64,
                             recipe=Recipe(parallel=p))
                  for name, (_, p) in PIPELINE_LAYOUTS.items()})
    worlds = {**LAYOUTS, **MOE_LAYOUTS, **PIPELINE_LAYOUTS}
    measured: dict[str, list[dict[str, int]]] = {}
    if not args.skip_measured:
        for world in sorted({w for w, _ in worlds.values()}):
            names = [n for n, (w, _) in worlds.items() if w == world]
            started = time.perf_counter()
            for name, peaks in zip(names, measure([cases[n] for n in names], world), strict=True):
                measured[name] = peaks
            print(f"measured {len(names)} layouts on {world} gloo ranks in "
                  f"{time.perf_counter() - started:.0f} s", file=sys.stderr)
    rows = []
    header = (f"{'layout':24} {'rank':>4} {'measured':>10} {'gloo scratch':>12} {'memfit':>10} "
              f"{'err':>7} {'FSDPMemTracker':>14} {'err':>7}")
    print(header)
    for name, case in cases.items():
        model, inputs = build(case)
        pred, seconds = memfit_peaks(model, inputs, case.parallel)
        fmt = fsdp_mem_tracker_peak(lambda case=case: build(case),  # type: ignore[misc]
                                    case.parallel)
        for rank in range(case.parallel.gpus):
            real = measured.get(name, [{}] * case.parallel.gpus)[rank]
            truth = real.get("peak")
            row = {"layout": name, "parallel": case.parallel.describe(), "rank": rank,
                   "measured": truth, "measured_highest": real.get("peak_highest"),
                   "gloo_scratch": real.get("backend"), "memfit": pred[rank],
                   "memfit_seconds": round(seconds, 2),
                   "fsdp_mem_tracker": fmt if rank == 0 else None}
            rows.append(row)
            print(f"{name:24} {rank:>4} {truth or '':>10} {real.get('backend', ''):>12} "
                  f"{pred[rank]:>10} {pct(pred[rank], truth) if truth else '':>7} "
                  f"{fmt if rank == 0 and fmt else '':>14} "
                  f"{pct(fmt, truth) if rank == 0 and fmt and truth else '':>7}")
    results: dict[str, Any] = {
        "what": "per-rank peak bytes of parallel steps (CPU target): gloo ranks measured "
                "with the profiler, memfit's per-rank trace, FSDPMemTracker",
        "model": dataclasses.asdict(spec), "batch": 2, "seq": 64, "precision": "fp32",
        "optimizer": "adamw", "steps": 2,
        "moe_model": dataclasses.asdict(moe_spec),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "torch": torch.__version__, "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared with other jobs)",
        "device": "cpu", "rows": rows,
    }
    if args.gpt2:
        results["gpt2"] = gpt2_row()
    out = Path(__file__).parent / "results" / (
        f"parallel-trace-cpu-{datetime.date.today().isoformat()}.json")
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)


def gpt2_row(batch: int = 8, seq: int = 1024) -> dict[str, Any]:
    """GPT-2 FSDP over 8 fake ranks: memfit's trace and FSDPMemTracker (GiB)."""
    from memfit.models import resolve_model
    from memfit.models.build import build_model, example_inputs

    spec = resolve_model("gpt2")
    parallel = P(gpus=8, fsdp=8)

    def make() -> tuple[Any, Any]:
        torch.manual_seed(0)
        return (build_model(spec, backend="transformers", device="cpu"),
                example_inputs(spec, batch=batch, seq=seq, device="cpu"))

    model, inputs = build_model(spec, backend="transformers"), example_inputs(spec, batch, seq)
    pred, seconds = memfit_peaks(model, inputs, parallel)
    started = time.perf_counter()
    fmt = fsdp_mem_tracker_peak(make, parallel)
    fmt_seconds = time.perf_counter() - started
    gib = 2 ** 30
    row = {"model": "gpt2", "batch": batch, "seq": seq, "parallel": parallel.describe(),
           "memfit_gib": round(max(pred) / gib, 3), "memfit_seconds": round(seconds, 1),
           "fsdp_mem_tracker_gib": round((fmt or 0) / gib, 3),
           "fsdp_mem_tracker_seconds": round(fmt_seconds, 1)}
    print(f"gpt2 fsdp x8 b{batch} s{seq}: memfit {row['memfit_gib']} GiB "
          f"({row['memfit_seconds']} s), FSDPMemTracker {row['fsdp_mem_tracker_gib']} GiB "
          f"({row['fsdp_mem_tracker_seconds']} s)")
    return row


if __name__ == "__main__":
    main()
