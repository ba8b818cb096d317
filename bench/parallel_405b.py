"""Llama-3.1-405B with TP 8 x PP 16 on 128 GPUs (H100, bf16-mixed AdamW, 1F1B, 16 micro-batches
of 1 x 4096): the per-rank trace of every pipeline stage, timed against issue 14's target (every
stage <= 60 s in total).

Run: ``python bench/parallel_405b.py [--seq 4096] [--microbatches 16] [--profile]
[--roles N]`` (``--roles``: only the first N stages, e.g. to profile one). The model is
built on the meta device (``build_model(spec, backend="builtin", device="meta")``); one
``memfit.estimate(..., parallel=Parallel(gpus=128, tp=8, pp=16))`` traces one rank per role (one
per stage: the 8 TP ranks of a stage hold the same shapes). Each role's trace is timed in process
CPU seconds (``time.process_time``) and wall seconds, around the fake world the trace of that role
runs in (``memfit.parallel.trace.fake_world``, wrapped here for the run and restored after).
``--profile`` runs the whole estimate under cProfile and writes its top entries (cumulative time)
into the JSON. ``--baseline`` then traces the same roles again with the replay of micro-batches
off (``memfit.trace.replay.disabled()``: every micro-batch traced for real, the code before the
replay), in the same process, and compares each stage's bytes (peak, reserved, breakdown) with
the replayed ones. Writes ``bench/results/parallel-405b-tp8pp16-cpu-<date>.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime
import io
import json
import os
import platform
import pstats
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

GIB = 2**30
ROOT = Path(__file__).resolve().parents[1]
TARGET_S = 60.0


@contextlib.contextmanager
def timed_roles(times: list[dict[str, Any]]) -> Iterator[None]:
    """Each role's trace timed around its fake world (restored on exit)."""
    from memfit.parallel import trace as trace_mod

    original = trace_mod.fake_world

    @contextlib.contextmanager
    def world(size: int, rank: int) -> Iterator[None]:
        cpu, wall = time.process_time(), time.perf_counter()
        with original(size, rank):
            yield
        times.append({"rank": rank, "cpu_seconds": round(time.process_time() - cpu, 2),
                      "wall_seconds": round(time.perf_counter() - wall, 2)})
        print(f"rank {rank}: {times[-1]['cpu_seconds']} CPU s", file=sys.stderr, flush=True)

    trace_mod.fake_world = world  # type: ignore[assignment]
    try:
        yield
    finally:
        trace_mod.fake_world = original  # type: ignore[assignment]


@contextlib.contextmanager
def first_roles(count: int | None) -> Iterator[None]:
    """Only the first ``count`` rank roles traced (None: all), for profiling one stage."""
    from memfit.parallel import trace as trace_mod

    original = trace_mod.rank_roles
    if count is not None:
        trace_mod.rank_roles = lambda *a, **k: original(*a, **k)[:count]  # type: ignore
    try:
        yield
    finally:
        trace_mod.rank_roles = original  # type: ignore[assignment]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--roles", type=int, default=None,
                        help="trace only the first N rank roles (stages); default all")
    parser.add_argument("--baseline", action="store_true",
                        help="also trace with the micro-batch replay off, and compare")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / (
        f"parallel-405b-tp8pp16-cpu-{datetime.date.today().isoformat()}.json"))
    args = parser.parse_args()

    import torch

    import memfit
    from memfit.models.build import build_model, example_inputs

    spec = memfit.resolve_model("llama-3.1-405b")
    parallel = memfit.Parallel(gpus=128, tp=8, pp=16, microbatches=args.microbatches)
    build_cpu = time.process_time()
    model = build_model(spec, backend="builtin", device="meta")
    inputs = example_inputs(spec, batch=args.microbatches, seq=args.seq, device="meta")
    build_cpu = round(time.process_time() - build_cpu, 2)
    times: list[dict[str, Any]] = []
    profiler = cProfile.Profile() if args.profile else None
    started, wall = time.process_time(), time.perf_counter()
    with timed_roles(times), first_roles(args.roles):
        if profiler is not None:
            profiler.enable()
        est = memfit.estimate(model, inputs, optimizer="adamw", precision="bf16-mixed",
                              device="cuda", gpu="h100-80gb", parallel=parallel)
        if profiler is not None:
            profiler.disable()
    total_cpu = round(time.process_time() - started, 2)
    total_wall = round(time.perf_counter() - wall, 2)
    load_after_new = os.getloadavg()
    from memfit.trace import replay

    counts = dict(replay.counts)
    rows = _rows(est, times, spec, parallel)
    _print(rows, total_cpu, total_wall)
    baseline: dict[str, Any] | None = None
    if args.baseline:
        base_times: list[dict[str, Any]] = []
        started, wall = time.process_time(), time.perf_counter()
        with timed_roles(base_times), first_roles(args.roles), replay.disabled():
            base_est = memfit.estimate(model, inputs, optimizer="adamw", precision="bf16-mixed",
                                       device="cuda", gpu="h100-80gb", parallel=parallel)
        base_cpu = round(time.process_time() - started, 2)
        base_rows = _rows(base_est, base_times, spec, parallel)
        print("baseline (replay off, every micro-batch traced):")
        _print(base_rows, base_cpu, round(time.perf_counter() - wall, 2))
        keys = ("stage", "peak_bytes", "peak_reserved_bytes", "breakdown")
        identical = [{k: r[k] for k in keys} for r in rows] == [
            {k: r[k] for k in keys} for r in base_rows]
        print(f"bytes identical to the baseline: {identical}; CPU s {total_cpu} against "
              f"{base_cpu} ({total_cpu / base_cpu:.3f} of it)")
        baseline = {"total_cpu_seconds": base_cpu,
                    "total_wall_seconds": round(time.perf_counter() - wall, 2),
                    "stages": base_rows, "bytes_identical": identical,
                    "cpu_ratio": round(total_cpu / base_cpu, 4),
                    "load_average_after": os.getloadavg()}
    result: dict[str, Any] = {
        "model": spec.name, "layout": parallel.describe(), "seq": args.seq,
        "microbatches": args.microbatches, "micro_batch": 1, "precision": "bf16-mixed",
        "optimizer": "adamw", "gpu": "h100-80gb", "build_cpu_seconds": build_cpu,
        "total_cpu_seconds": total_cpu, "total_wall_seconds": total_wall,
        "target_seconds": TARGET_S, "target_met": total_cpu <= TARGET_S, "stages": rows,
        "torch": torch.__version__, "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared with other jobs)",
        "load_average": load_after_new, "replay_counts": counts, "baseline": baseline,
        "command": " ".join(sys.argv),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    if profiler is not None:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(40)
        result["profile_top_cumulative"] = text.getvalue().splitlines()[:80]
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
        result["profile_top_tottime"] = text.getvalue().splitlines()[:60]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


def _rows(est: Any, times: list[dict[str, Any]], spec: Any, parallel: Any
          ) -> list[dict[str, Any]]:
    """One row per stage: its ranks, blocks, CPU and wall seconds (summed over the traces of
    its rank: a trace redone without replay counts both), bytes."""
    from memfit.parallel.pipeline import stage_layers, stages_per_rank

    layers = stage_layers(spec.num_layers, parallel.pp * stages_per_rank(parallel))
    by_rank: dict[int, dict[str, float]] = {}
    for t in times:
        acc = by_rank.setdefault(t["rank"], {"cpu_seconds": 0.0, "wall_seconds": 0.0})
        acc["cpu_seconds"] = round(acc["cpu_seconds"] + t["cpu_seconds"], 2)
        acc["wall_seconds"] = round(acc["wall_seconds"] + t["wall_seconds"], 2)
    rows = []
    for role in est.per_rank:
        stage = role.ranks[0] // (parallel.dp * parallel.tp)
        t = by_rank.get(role.ranks[0], {})
        rows.append({"stage": stage, "ranks": list(role.ranks), "blocks": len(layers[stage]),
                     "cpu_seconds": t.get("cpu_seconds"), "wall_seconds": t.get("wall_seconds"),
                     "peak_bytes": role.peak_bytes,
                     "peak_reserved_bytes": role.peak_reserved_bytes,
                     "breakdown": {getattr(k, "value", str(k)): v
                                   for k, v in role.breakdown.items()}})
    return rows


def _print(rows: list[dict[str, Any]], total_cpu: float, total_wall: float) -> None:
    print(f"{'stage':>5} {'blocks':>6} {'CPU s':>7} {'wall s':>7} {'peak GiB':>9} "
          f"{'reserved GiB':>12}")
    for r in rows:
        print(f"{r['stage']:>5} {r['blocks']:>6} {r['cpu_seconds']:>7} {r['wall_seconds']:>7} "
              f"{r['peak_bytes'] / GIB:>9.2f} {r['peak_reserved_bytes'] / GIB:>12.2f}")
    print(f"total: {total_cpu} CPU s ({total_wall} wall s) for {len(rows)} stages; target "
          f"{TARGET_S} s: {'met' if total_cpu <= TARGET_S else 'NOT met'}; slowest stage "
          f"{max(r['cpu_seconds'] or 0 for r in rows)} CPU s")


if __name__ == "__main__":
    main()
