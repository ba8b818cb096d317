"""The per-rank trace of FSDP2, DDP and ZeRO-1 against a real run on one CUDA GPU over NCCL.

    python bench/parallel_cuda.py --out bench/results/parallel-cuda-<gpu>-<date>.json
    python bench/parallel_cuda.py --device cpu      # the same flow over gloo (checks the script)

One GPU holds one NCCL rank (NCCL refuses two ranks on one device), so this is world size 1:
what it checks is the CUDA side of each wrapper that the gloo runs cannot: FSDP2's all-gather
and reduce-scatter buffers and its side streams (``record_stream``-delayed frees), DDP's
gradient buckets, ZeRO-1's flat state, in the CUDA caching allocator, with NCCL's own buffers
outside it. Each case builds memfit's builtin Llama-like decoder on the device, applies the
layout as ``Plan.apply`` does (``memfit.parallel.apply``), runs two AdamW steps and reads
``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``; the trace is
``memfit.estimate(..., parallel=...)`` of a meta copy at world size 1. Prints a table and writes
JSON (device, torch, command)."""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import memfit
from memfit._compat import torch_internals
from memfit._loss import model_loss
from memfit.layout import Parallel
from memfit.models import TransformerSpec
from memfit.models.build import build_model, example_inputs
from memfit.parallel.apply import apply_model, apply_optimizer
from memfit.trace.optim import make_optimizer

SPEC = TransformerSpec(
    name="bench-llama", family="llama", arch="decoder", hidden_size=1024, num_layers=8,
    num_heads=16, num_kv_heads=8, head_dim=64, intermediate_size=2816, vocab_size=32000,
    max_position_embeddings=2048)
CASES = [
    ("fsdp2", "fsdp", dict(), "fp32"),
    ("fsdp2-no-reshard", "fsdp", dict(reshard_after_forward=False), "fp32"),
    ("fsdp2-bf16-params", "fsdp", dict(param_dtype="bf16"), "fp32"),
    ("ddp", "ddp", dict(), "fp32"),
    ("zero1", "zero1", dict(), "fp32"),
    ("fsdp2-bf16-mixed", "fsdp", dict(), "bf16-mixed"),
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class OneRank(Parallel):
    """A layout at world size 1 that still applies its wrapper (``Parallel`` calls every
    one-rank layout ``none``, since nothing is sharded or reduced): FSDP2's ``fully_shard`` over
    a mesh of one, DDP, ``ZeroRedundancyOptimizer``, as they run on one GPU."""

    wrapper: str = "fsdp"

    def __post_init__(self) -> None:
        policies = (self.param_dtype, self.reduce_dtype)
        object.__setattr__(self, "param_dtype", None)
        object.__setattr__(self, "reduce_dtype", None)
        super().__post_init__()
        object.__setattr__(self, "param_dtype", policies[0])
        object.__setattr__(self, "reduce_dtype", policies[1])

    @property
    def strategy(self) -> str:
        return self.wrapper


def _reset(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch_internals.clear_cublas_workspaces()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


SETTLE = 0.0
"""--settle: seconds to wait (device synchronized) after each step, so that NCCL's watchdog
has released the finished collectives' stashed tensors before the next step."""


def _steps(model: torch.nn.Module, inputs: dict, opt: torch.optim.Optimizer, precision: str,
           device: str, steps: int) -> None:
    for _ in range(steps):
        with torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            loss = model_loss(model, inputs)
        loss.backward()
        del loss
        opt.step()
        opt.zero_grad(set_to_none=True)
        if SETTLE and device == "cuda":
            torch.cuda.synchronize()
            time.sleep(SETTLE)


def measure(parallel: Parallel, precision: str, device: str, batch: int, seq: int,
            steps: int, anatomy: dict | None = None) -> tuple[int, int | None]:
    from memfit.cpu_peak import measure_cpu_peak

    def run() -> None:
        torch.manual_seed(0)
        model = build_model(SPEC, backend="builtin", device=device)
        inputs = example_inputs(SPEC, batch=batch, seq=seq, device=device)
        model = apply_model(model, parallel, device)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = apply_optimizer(make_optimizer("adamw", params, cuda_target=device == "cuda"),
                              parallel)
        _steps(model, inputs, opt, precision, device, steps)

    _reset(device)
    if device == "cuda":
        if anatomy is not None:  # what is alive at the real peak (bench/cuda_peak_anatomy.py)
            torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
        run()
        torch.cuda.synchronize()
        if anatomy is not None:
            from cuda_peak_anatomy import _where, replay_peak

            events = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
            torch.cuda.memory._record_memory_history(enabled=None)
            peak, top, at = replay_peak(events)
            anatomy.update(
                replayed_peak=peak, events=len(events), peak_event_index=at,
                allocation_at_peak={"size": events[at]["size"],
                                    "where": _where(events[at].get("frames", []))},
                alive_at_peak=[{"where": w, "bytes": b, "blocks": n} for w, (b, n) in top])
        return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    # On the CPU (a check of the script) the model is built inside the measurement too: FSDP2's
    # resharded parameters have no storage to count from outside.
    return measure_cpu_peak(run).peak_bytes, None


def predict(parallel: Parallel, precision: str, device: str, batch: int, seq: int,
            steps: int, gpu: str | None, anatomy: dict | None = None) -> tuple[int, int | None]:
    torch.manual_seed(0)
    model = build_model(SPEC, backend="builtin", device="meta")
    inputs = example_inputs(SPEC, batch=batch, seq=seq, device="meta")
    est = memfit.estimate(model, inputs, optimizer="adamw", precision=precision, device=device,
                          gpu=gpu, steps=steps, parallel=parallel)
    if anatomy is not None:
        anatomy.update(
            predicted_peak_at=(f"{est.peak_op} ({est.peak_phase}, step {est.peak_step}, "
                               f"{est.peak_module})"),
            predicted_phase_peaks={f"{s}/{p}": b for (s, p), b in est.phase_peaks.items()},
            predicted_breakdown={str(k.value): v for k, v in est.breakdown.items()})
    return est.peak_bytes, est.peak_reserved_bytes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--only", nargs="*", help="case names (default: all)")
    ap.add_argument("--settle", type=float, default=0.0,
                    help="seconds to wait after each step (the device synchronized)")
    ap.add_argument("--anatomy", action="store_true",
                    help="CUDA: record the allocator's history and list what is alive at the "
                         "peak, beside the trace's peak op and categories")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    global SETTLE
    SETTLE = args.settle
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench/parallel_cuda.py: no CUDA GPU here; run with --device cpu", file=sys.stderr)
        return 2
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=0, world_size=1)
    gpu = None
    if args.device == "cuda":
        torch.cuda.set_device(0)
        gpu = ("h100-sxm-80gb" if "H100" in torch.cuda.get_device_name()
               else "h200-141gb" if "H200" in torch.cuda.get_device_name() else None)
    rows = []
    try:
        for name, wrapper, kw, precision in CASES:
            if args.only and name not in args.only:
                continue
            parallel = OneRank(gpus=1, wrapper=wrapper, **kw)  # type: ignore[arg-type]
            row: dict = {"case": name, "parallel": repr(parallel), "precision": precision}
            anatomy: dict | None = {} if args.anatomy else None
            try:
                t = time.perf_counter()
                row["measured_allocated"], row["measured_reserved"] = measure(
                    parallel, precision, args.device, args.batch, args.seq, args.steps,
                    anatomy if args.device == "cuda" else None)
                row["seconds_real"] = round(time.perf_counter() - t, 2)
                # The trace runs in its own fake world: leave NCCL's group for it, then rejoin.
                dist.destroy_process_group()
                t = time.perf_counter()
                row["predicted_allocated"], row["predicted_reserved"] = predict(
                    parallel, precision, args.device, args.batch, args.seq, args.steps, gpu,
                    anatomy)
                row["seconds_trace"] = round(time.perf_counter() - t, 2)
                row["error_allocated"] = (row["predicted_allocated"]
                                          / row["measured_allocated"] - 1)
                if row["measured_reserved"] and row["predicted_reserved"]:
                    row["error_reserved"] = (row["predicted_reserved"]
                                             / row["measured_reserved"] - 1)
            except Exception as e:  # a bench row records what broke
                if os.environ.get("BENCH_RAISE"):
                    raise
                row["error"] = f"{type(e).__name__}: {e}"[:500]
            finally:
                if not dist.is_initialized():
                    dist.init_process_group("nccl" if args.device == "cuda" else "gloo",
                                            rank=0, world_size=1)
            if anatomy:
                row["anatomy"] = anatomy
                print(json.dumps(anatomy, indent=1), flush=True)
            rows.append(row)
            err = row.get("error") or (
                f"measured {row['measured_allocated']:>14,} predicted "
                f"{row['predicted_allocated']:>14,} ({100 * row['error_allocated']:+.2f}%)"
                + (f" reserved {100 * row['error_reserved']:+.2f}%"
                   if "error_reserved" in row else ""))
            print(f"{name:20s} {precision:10s} {err}", flush=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    doc = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
           "torch": torch.__version__, "cuda": torch.version.cuda,
           "date": dt.date.today().isoformat(),
           "command": "python bench/parallel_cuda.py " + " ".join(argv or sys.argv[1:]),
           "spec": SPEC.name, "batch": args.batch, "seq": args.seq, "steps": args.steps,
           "results": rows}
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
