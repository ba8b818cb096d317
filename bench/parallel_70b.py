"""Llama-3-70B, FSDP over 64 GPUs (H100, bf16-mixed AdamW, batch 1 x 4096, 2 steps): one rank's
trace with and without FSDP2's bf16 parameters, against the analytic ``--engine fsdp2`` plan.

Run: ``python bench/parallel_70b.py``. Writes ``bench/results/parallel-70b-fsdp64-cpu-<date>.json``
(peak and categories per run, trace CPU seconds, the plan's total, torch version, command).
"""

from __future__ import annotations

import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch

import memfit
from memfit.models.build import build_model, example_inputs

GIB = 2**30


def trace(param_dtype: str | None) -> dict[str, object]:
    spec = memfit.resolve_model("llama-3-70b")
    with torch.device("meta"):
        model = build_model(spec)
    inputs = example_inputs(spec, batch=1, seq=4096, device="meta")
    started = time.process_time()
    est = memfit.estimate(model, inputs, optimizer="adamw", precision="bf16-mixed",
                          device="cuda", gpu="h100-80gb",
                          parallel=memfit.Parallel(gpus=64, fsdp=64, param_dtype=param_dtype,
                                                   reduce_dtype="fp32" if param_dtype else None))
    return {"param_dtype": param_dtype, "cpu_seconds": round(time.process_time() - started, 2),
            "peak_bytes": est.peak_bytes,
            "breakdown": {getattr(k, "value", str(k)): v for k, v in est.breakdown.items()}}


def main() -> None:
    spec = memfit.resolve_model("llama-3-70b")
    run = memfit.RunConfig(mode="train", precision="bf16-mixed", batch=1, seq=4096, gpus=64,
                           zero=3, engine="fsdp2")
    plan = memfit.plan(spec, run, memfit.get_gpu("h100-80gb"))
    rows = [trace("bf16"), trace(None)]
    print(f"{'param_dtype':>12} {'trace CPU-s':>12} {'peak GiB':>10} {'activations GiB':>16}")
    for r in rows:
        acts = r["breakdown"].get("activations", 0)  # type: ignore[union-attr]
        print(f"{r['param_dtype']!s:>12} {r['cpu_seconds']:>12} {r['peak_bytes'] / GIB:>10.2f} "
              f"{acts / GIB:>16.2f}")
    print(f"analytic plan (--engine fsdp2): {plan.total_bytes / GIB:.2f} GiB")
    date = datetime.date.today().isoformat()
    out = Path(__file__).parent / "results" / f"parallel-70b-fsdp64-cpu-{date}.json"
    out.write_text(json.dumps({
        "what": __doc__.splitlines()[0] + " " + __doc__.splitlines()[1],
        "torch": torch.__version__, "python": platform.python_version(),
        "machine": f"{platform.machine()}, CUDA target traced on this CPU", "date": date,
        "note": "the runs are in one process: the second trace reuses warm caches",
        "command": "python " + " ".join(sys.argv), "plan_total_bytes": plan.total_bytes,
        "runs": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
