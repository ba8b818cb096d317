"""`memfit plan --method trace` next to the analytic planner on shared presets.

    python bench/trace_vs_analytic.py [--batch 1] [--seq 1024] [--gpu h100-sxm-80gb]

Prints a table and writes bench/results/trace-vs-analytic-cpu-<date>.json. The trace runs the
real module (transformers when installed, else memfit's builtin) on meta tensors for a CUDA
target; the analytic plan uses the formulas. Both are predictions: neither is a measurement.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from pathlib import Path

import torch

from memfit.analytic.config import RunConfig
from memfit.analytic.planner import plan
from memfit.analytic.traced import per_gpu_breakdown, traced_estimate
from memfit.categories import MemoryCategory
from memfit.gpus import get_gpu
from memfit.models import get_preset

PRESETS = ["gpt2", "gpt2-medium", "bert-base", "vit-b-16", "phi-3-mini", "llama-2-7b",
           "llama-3-8b", "mistral-7b", "qwen2.5-7b"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--gpu", default="h100-sxm-80gb")
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--checkpointing", default="none")
    args = ap.parse_args()
    gpu = get_gpu(args.gpu)
    rows = []
    print(f"{'preset':14} {'trace GiB':>10} {'analytic GiB':>13} {'ratio':>7}  "
          f"{'trace s':>7}  peak phase")
    for name in args.presets.split(","):
        spec = get_preset(name)
        run = RunConfig(precision="bf16-mixed", optimizer="adamw", batch=args.batch,
                        seq=None if spec.arch == "vision" else min(args.seq,
                                                                   spec.default_seq_len),
                        checkpointing=args.checkpointing)
        start = time.perf_counter()
        est = traced_estimate(spec, run, gpu)
        seconds = time.perf_counter() - start
        analytic = plan(spec, run, gpu)
        trace_cats = per_gpu_breakdown(est)
        ratio = est.total_bytes / analytic.total_bytes
        print(f"{name:14} {est.total_bytes / 2**30:10.2f} {analytic.total_bytes / 2**30:13.2f} "
              f"{ratio:7.3f}  {seconds:7.1f}  {est.peak_phase} ({est.peak_op})")
        rows.append({
            "preset": name, "seq": run.seq, "batch": run.batch,
            "trace_total_bytes": est.total_bytes, "analytic_total_bytes": analytic.total_bytes,
            "ratio": ratio, "trace_seconds": seconds, "peak_phase": est.peak_phase,
            "peak_op": est.peak_op,
            "trace_breakdown": {c.value: trace_cats[c] for c in MemoryCategory},
            "analytic_breakdown": {c.value: analytic.breakdown[c] for c in MemoryCategory},
        })
    out = Path(f"bench/results/trace-vs-analytic-cpu-{dt.date.today().isoformat()}.json")
    out.write_text(json.dumps({
        "what": "memfit plan --method trace vs analytic (both predictions), bf16-mixed AdamW",
        "gpu_target": gpu.name, "torch": torch.__version__,
        "command": " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]),
        "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
