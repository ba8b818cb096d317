"""Llama-3-70B, FSDP over 64 GPUs (H100, bf16-mixed AdamW, batch 1 x 4096, 2 steps): one rank's
trace with and without FSDP2's bf16 parameters, against the analytic ``--engine fsdp2`` plan.

Run: ``python bench/parallel_70b.py [--baseline REF] [--repeat N]``. Each trace runs in a fresh
process (the first trace of a process is what a user's ``memfit plan`` pays: DTensor's sharding
caches and the fake-tensor cache start empty) and is timed in process CPU seconds
(``time.process_time``; wall time too, which other processes on a shared machine inflate).
``--baseline REF`` also traces with the ``src/`` of git commit ``REF`` (extracted to a temporary
directory), alternating with this tree's runs, and reports this tree's CPU time over the
baseline's (medians of ``--repeat`` runs each) and whether the predicted bytes are identical.
Writes ``bench/results/parallel-70b-fsdp64-cpu-<date>.json`` (``--out``): peak and categories per
run, the CPU seconds, the plan's total, torch version, load average, command.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GIB = 2**30
ROOT = Path(__file__).resolve().parents[1]


def trace(param_dtype: str | None) -> dict[str, object]:
    """One rank's trace in this process (the child's work)."""
    import torch

    import memfit
    from memfit.models.build import build_model, example_inputs

    spec = memfit.resolve_model("llama-3-70b")
    with torch.device("meta"):
        model = build_model(spec)
    inputs = example_inputs(spec, batch=1, seq=4096, device="meta")
    started, wall = time.process_time(), time.perf_counter()
    est = memfit.estimate(model, inputs, optimizer="adamw", precision="bf16-mixed",
                          device="cuda", gpu="h100-80gb",
                          parallel=memfit.Parallel(gpus=64, fsdp=64, param_dtype=param_dtype,
                                                   reduce_dtype="fp32" if param_dtype else None))
    return {"param_dtype": param_dtype, "cpu_seconds": round(time.process_time() - started, 2),
            "wall_seconds": round(time.perf_counter() - wall, 2),
            "peak_bytes": est.peak_bytes, "peak_reserved_bytes": est.peak_reserved_bytes,
            "breakdown": {getattr(k, "value", str(k)): v for k, v in est.breakdown.items()}}


def run_child(src: Path, param_dtype: str | None) -> dict[str, object]:
    """A fresh process tracing with memfit from ``src``."""
    env = dict(os.environ, PYTHONPATH=str(src))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child",
           "--param-dtype", param_dtype or "none"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"child failed ({src}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def extract(ref: str, into: Path) -> Path:
    """``src/`` of git commit ``ref`` under ``into``."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "src"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "src"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="git commit whose src/ is the baseline")
    parser.add_argument("--repeat", type=int, default=1, help="runs per configuration")
    parser.add_argument("--dtypes", default="bf16,none", help="param_dtype values to trace")
    parser.add_argument("--out", help="results file")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--param-dtype", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(trace(None if args.param_dtype == "none" else args.param_dtype)))
        return

    import torch

    import memfit

    spec = memfit.resolve_model("llama-3-70b")
    run = memfit.RunConfig(mode="train", precision="bf16-mixed", batch=1, seq=4096,
                           parallel=memfit.Parallel(gpus=64, zero=3), engine="fsdp2")
    plan = memfit.plan(spec, run, memfit.get_gpu("h100-80gb"))
    load = os.getloadavg()
    sources = {"this": ROOT / "src"}
    with tempfile.TemporaryDirectory() as tmp:
        if args.baseline:
            sources["baseline"] = extract(args.baseline, Path(tmp))
        rows = []
        for dtype in args.dtypes.split(","):
            param_dtype = None if dtype == "none" else dtype
            runs: dict[str, list[dict[str, object]]] = {name: [] for name in sources}
            for _ in range(args.repeat):
                for name, src in sources.items():  # alternating, so load hits both alike
                    runs[name].append(run_child(src, param_dtype))
            row: dict[str, object] = {"param_dtype": param_dtype}
            for name, got in runs.items():
                row[name] = {
                    "cpu_seconds": round(statistics.median(  # type: ignore[type-var]
                        r["cpu_seconds"] for r in got), 2),
                    "cpu_seconds_each": [r["cpu_seconds"] for r in got],
                    "wall_seconds_each": [r["wall_seconds"] for r in got],
                    **{k: got[0][k] for k in ("peak_bytes", "peak_reserved_bytes", "breakdown")}}
            if "baseline" in runs:
                this, base = row["this"], row["baseline"]
                row["cpu_ratio"] = round(this["cpu_seconds"] / base["cpu_seconds"], 3)  # type: ignore[index]
                row["same_bytes"] = all(this[k] == base[k] for k in  # type: ignore[index]
                                        ("peak_bytes", "peak_reserved_bytes", "breakdown"))
            rows.append(row)
    print(f"{'param_dtype':>12} {'CPU-s':>8} {'baseline CPU-s':>15} {'ratio':>6} "
          f"{'same bytes':>10} {'peak GiB':>9} {'activations GiB':>16}")
    for r in rows:
        this = r["this"]
        base = r.get("baseline", {})
        acts = this["breakdown"].get("activations", 0)  # type: ignore[index, union-attr]
        print(f"{r['param_dtype']!s:>12} {this['cpu_seconds']:>8} "  # type: ignore[index]
              f"{base.get('cpu_seconds', '-')!s:>15} {r.get('cpu_ratio', '-')!s:>6} "  # type: ignore[union-attr]
              f"{r.get('same_bytes', '-')!s:>10} {this['peak_bytes'] / GIB:>9.2f} "  # type: ignore[index, operator]
              f"{acts / GIB:>16.2f}")
    print(f"analytic plan (--engine fsdp2): {plan.total_bytes / GIB:.2f} GiB")
    print(f"load average at start {load[0]:.1f} on {os.cpu_count()} CPUs (shared machine)")
    date = datetime.date.today().isoformat()
    out = Path(args.out) if args.out else (
        Path(__file__).parent / "results" / f"parallel-70b-fsdp64-cpu-{date}.json")
    out.write_text(json.dumps({
        "what": __doc__.splitlines()[0] + " " + __doc__.splitlines()[1],
        "torch": torch.__version__, "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs shared with other jobs, "
                   "CUDA target traced on this CPU",
        "load_average_at_start": [round(v, 2) for v in load], "date": date,
        "note": "each trace in a fresh process (cold caches); cpu_seconds: median of "
                "time.process_time over the runs",
        "baseline": args.baseline, "command": "python " + " ".join(sys.argv),
        "plan_total_bytes": plan.total_bytes, "runs": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
