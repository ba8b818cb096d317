"""The analytic formulas against the trace (issue 14 §2): every preset x {train, lora} x
{none, selective, full} at two batch/seq points, on one GPU and on 8 GPUs with FSDP.

    python bench/formulas_vs_trace.py [--presets gpt2,llama-3.2-1b] [--gpu h100-sxm-80gb]
        [--gpus 1,8] [--out bench/results/NAME.json] [--reuse-trace OLD.json [--trace-missing]]

Prints a table and writes bench/results/formulas-vs-trace-cpu-<date>.json (with ``--gpus 8``
alone: formulas-vs-trace-fsdp8-cpu-<date>.json). Both columns are
predictions for a CUDA target: the trace runs the real module on meta tensors; the formulas are
``memfit.analytic``. What is compared: the plan's total against the trace's live bytes at its
peak (its total less the caching allocator's reserve, which the plan does not model: the fit
margin covers it). The plan is run with ``engine="ddp"``: plain PyTorch under autocast, as the
trace runs it (fp32 parameters and gradients). Agreement is within 5% or the row says why not.

8 GPUs with FSDP: the plan is ``engine="fsdp2", zero=3`` (PyTorch FSDP2 with a bf16
``MixedPrecisionPolicy``), the trace is the per-rank trace of that layout, as ``memfit plan
--gpus 8 --fsdp`` runs it (``memfit.analytic.traced.parallel_layout``: ``fully_shard`` per
block then the root, ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``), and the
number compared is its most loaded rank's; the reason string is the one the plan prints
(``memfit.analytic.traced.disagreement_reason``). The formulas model FSDP2's buffers moment by
moment (Note: [FSDP2 buffers by moment] in memfit/analytic/engine_buffers.py).

``--reuse-trace OLD.json`` takes the trace's numbers from an earlier results file instead of
tracing again: the trace does not depend on ``memfit.analytic``, so a change to the formulas is
checked over the whole matrix in seconds (the file records where its trace numbers came from);
``--trace-missing`` traces the cells that file has no trace for.

Cells the transformers build cannot run as the formulas assume them (LoRA on ``q/k/v/o_proj``
for GPT-2, BERT and Phi-3, which name or fuse their projections otherwise; Gemma-2, which
transformers 5 runs only with eager attention) are traced on memfit's builtin modules of the
same preset (``trace_backend`` says so and why) and compared with the formulas of those
Llama-style blocks (:data:`BUILTIN_FAMILY`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from memfit.analytic.config import RunConfig
from memfit.analytic.planner import plan
from memfit.errors import MemfitError
from memfit.gpus import GpuSpec, get_gpu
from memfit.models import get_preset, list_presets
from memfit.parallel import Parallel

TOLERANCE = 0.05
POINTS = ((1, 512), (4, 1024))
"""(batch, seq) points; vision models see their fixed token count."""
MODES = ("train", "lora")
CHECKPOINTING = ("none", "selective", "full")


BUILTIN_WHEN = ("names its projections differently", "has no SDPA attention")
"""The trace's errors on the transformers build that the builtin build (memfit.models, the
same preset's shapes) does not have: LoRA on ``q/k/v/o_proj`` (transformers' GPT-2 has a fused
``c_attn`` Conv1D, BERT ``query/key/value``, Phi-3 a fused ``qkv_proj``; the formulas count
one adapter per q, k, v, o projection, as the builtin modules name them) and SDPA attention
(transformers 5.x's Gemma-2 is eager-only, for its attention-logit soft-capping; the formulas
assume fused attention, ``RunConfig.attention="sdpa"``)."""


BUILTIN_FAMILY = "llama"
"""The Hugging Face family whose blocks memfit's builtin modules
(memfit/models/builtin_layers.py) are: none of block_activations.py's family sets but the eager
softmax's (the trace runs SDPA)."""


def _with_builtin_fallback(trace: Callable[[str], Any]) -> Any:
    """``trace(backend)`` on the transformers build, or on memfit's builtin modules when the
    transformers build cannot run the cell as the formulas assume it (:data:`BUILTIN_WHEN`);
    the estimate records the backend used (``trace_backend``)."""
    try:
        est = trace("auto")
        backend = "auto"
    except MemfitError as exc:
        if not any(m in str(exc) for m in BUILTIN_WHEN):
            raise
        est = trace("builtin")
        backend = f"builtin ({str(exc).split(';')[0]})"
    object.__setattr__(est, "trace_backend", backend)  # Estimate is a frozen dataclass
    return est


def _single_gpu(spec: Any, run: RunConfig, gpu: GpuSpec) -> Any:
    from memfit.analytic.traced import traced_estimate

    return _with_builtin_fallback(lambda backend: traced_estimate(spec, run, gpu,
                                                                  backend=backend))


def _fsdp(spec: Any, run: RunConfig, gpu: GpuSpec) -> Any:
    from memfit.analytic.traced import parallel_layout, trace_parallel

    return _with_builtin_fallback(lambda backend: trace_parallel(
        spec, run, gpu, parallel_layout(run), backend=backend))


TRACERS: dict[int, Callable[[Any, RunConfig, GpuSpec], Any] | None] = {
    1: _single_gpu,
    8: _fsdp,  # the per-rank trace of FSDP2 over 8 ranks (memfit/parallel/trace.py)
}


@dataclass(frozen=True)
class Row:
    preset: str
    mode: str
    checkpointing: str
    batch: int
    seq: int | None
    gpus: int
    plan_bytes: int | None = None
    trace_live_bytes: int | None = None
    error: float | None = None
    """plan / trace - 1."""
    agrees: bool | None = None
    why: str = ""
    """Why a row is not compared, or why it disagrees (the plan's note)."""
    trace_seconds: float = 0.0
    plan_peak: str = ""
    trace_peak: str = ""
    error_without_unsharded_grads: float | None = None
    """8 GPUs: plan / trace - 1 with the plan's "unsharded gradients" buffer (a block's, with
    its fp32 reduce-scatter input, and the root's; only when the plan's peak is in a block's
    backward) left out of its peak: how much of the disagreement that buffer explains."""
    trace_backend: str = "auto"
    """The build the trace ran: ``auto`` (transformers) or ``builtin (why)``; a builtin row's
    plan is the formulas of the builtin's Llama-style blocks (:data:`BUILTIN_FAMILY`)."""


def run_config(spec: Any, mode: str, checkpointing: str, batch: int, seq: int,
               gpus: int = 1) -> RunConfig:
    seq_used = None if spec.arch == "vision" else min(seq, spec.default_seq_len)
    extra = ({"engine": "ddp"} if gpus == 1
             else {"engine": "fsdp2", "parallel": Parallel(gpus=gpus, zero=3)})
    return RunConfig(mode=mode, checkpointing=checkpointing, batch=batch, seq=seq_used,
                     precision="bf16-mixed", optimizer="adamw", **extra)


def _stored_tracer(rows: dict[tuple, dict[str, Any]],
                   missing: Callable[..., Any] | None = None) -> Callable[..., Any]:
    """A tracer that answers from a stored results file (``--reuse-trace``): the trace side does
    not depend on memfit.analytic, so a change to the formulas is checked against the stored
    trace numbers in seconds instead of the half-hour trace of the whole matrix."""
    from types import SimpleNamespace

    def tracer(spec: Any, run: RunConfig, gpu: GpuSpec) -> Any:
        key = (spec.name, run.mode, run.checkpointing, run.batch, run.seq, run.gpus)
        row = rows.get(key)
        if row is None or row.get("trace_live_bytes") is None:
            if missing is not None:  # --trace-missing
                return missing(spec, run, gpu)
            raise MemfitError(f"no stored trace for {key}")
        return SimpleNamespace(trace_backend=row.get("trace_backend", "auto"),
                               total_bytes=row["trace_live_bytes"], peak_reserved_bytes=0,
                               peak_bytes=0, peak_phase=row.get("trace_peak", ""),
                               peak_op="(stored)", stored_seconds=row.get("trace_seconds", 0.0))

    return tracer


def compare(name: str, mode: str, checkpointing: str, batch: int, seq: int,
            gpu: GpuSpec, gpus: int = 1, tracer: Callable[..., Any] | None = None) -> Row:
    """One cell of the matrix (``tracer``: the trace to compare with, by default TRACERS')."""
    spec = get_preset(name)
    run = run_config(spec, mode, checkpointing, batch, seq, gpus)
    base = Row(preset=name, mode=mode, checkpointing=checkpointing, batch=batch, seq=run.seq,
               gpus=gpus)
    tracer = tracer or TRACERS.get(gpus)
    if tracer is None:
        return Row(**{**asdict(base), "why": f"no tracer for {gpus} GPUs in this bench "
                      f"(TRACERS: {', '.join(map(str, sorted(TRACERS)))} GPUs)"})
    start = time.perf_counter()
    try:
        est = tracer(spec, run, gpu)
    except MemfitError as exc:  # e.g. a model the per-rank trace cannot run
        return Row(**{**asdict(base), "plan_bytes": plan(spec, run, gpu).total_bytes,
                      "why": f"not traced: {exc}"})
    backend = getattr(est, "trace_backend", "auto")
    # The builtin build's blocks are Llama's (separate q/k/v/o and gate/up projections, the
    # RMSNorm that casts before its weight, the fused F.gelu): the formulas of that module
    # (the family-specific terms of memfit/analytic/block_activations.py left out) are the ones to
    # check against its trace.
    planned = plan(dataclasses.replace(spec, family=BUILTIN_FAMILY)
                   if backend != "auto" else spec, run, gpu)
    seconds = getattr(est, "stored_seconds", time.perf_counter() - start)
    live = int(est.total_bytes - (est.peak_reserved_bytes - est.peak_bytes))
    error = planned.total_bytes / live - 1
    agrees = abs(error) <= TOLERANCE
    why = ""
    if not agrees and gpus > 1 and hasattr(est, "stored_seconds"):
        why = "; ".join(planned.notes)
    elif not agrees and gpus > 1:
        from memfit.analytic.traced import disagreement_reason

        why = disagreement_reason(planned, est)
    elif not agrees:
        peaks = ("" if planned.peak_phase == est.peak_phase else
                 f"peaks differ (plan: {planned.peak_phase}, trace: {est.peak_phase} at "
                 f"{est.peak_op}); ")
        why = peaks + "; ".join(planned.notes)
    return Row(**{**asdict(base), "plan_bytes": planned.total_bytes, "trace_live_bytes": live,
                  "error": error, "agrees": agrees, "why": why, "trace_seconds": seconds,
                  "plan_peak": planned.peak_phase, "trace_peak": est.peak_phase,
                  "error_without_unsharded_grads": _without_unsharded(planned, live),
                  "trace_backend": getattr(est, "trace_backend", "auto")})


def _without_unsharded(planned: Any, live: int) -> float | None:
    unsharded = planned.engine_buffers.get("unsharded gradients", 0)
    return (planned.total_bytes - unsharded) / live - 1 if unsharded and live else None


def _summary(rows: list[Row]) -> dict[str, Any]:
    compared = [r for r in rows if r.error is not None]
    return {
        "compared": len(compared),
        "within_tolerance": sum(1 for r in compared if r.agrees),
        "worst_error": max((r.error for r in compared), key=abs, default=None),
        "pending_or_not_traced": len(rows) - len(compared),
    }


def _write(rows: list[Row], gpu: GpuSpec, *, partial: bool, out: Path,
           trace_from: str | None = None) -> Path:
    import torch

    out.write_text(json.dumps({
        "what": "analytic plan total vs trace live bytes at its peak, bf16-mixed AdamW, CUDA "
                "target; 1 GPU: plan engine ddp vs the single-GPU trace; 8 GPUs: plan engine "
                "fsdp2 zero 3 vs the per-rank trace of FSDP2 (bf16 MixedPrecisionPolicy), most "
                "loaded rank",
        "gpu_target": gpu.name, "torch": torch.__version__, "tolerance": TOLERANCE,
        "device": "cpu (meta tensors), machine shared with other jobs",
        "command": " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]),
        "partial": partial, "summary": _summary(rows),
        **({"trace_from": f"trace numbers (trace_live_bytes, trace_peak, trace_seconds) taken "
                          f"from {trace_from} (--reuse-trace)"} if trace_from else {}),
        "rows": [asdict(r) for r in rows]},
        indent=2))
    return out


def _gib(b: int | None) -> str:
    return "" if b is None else f"{b / 2**30:9.2f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default=",".join(s.name for s in list_presets()))
    ap.add_argument("--gpu", default="h100-sxm-80gb")
    ap.add_argument("--gpus", default="1,8", help="GPU counts (8: FSDP over 8 ranks)")
    ap.add_argument("--points", default=",".join(f"{b}x{s}" for b, s in POINTS),
                    help="batch x seq points, e.g. 1x512,4x1024")
    ap.add_argument("--out", help="results file (default: bench/results/formulas-vs-trace-"
                    "cpu-<date>.json; with --gpus 8 alone, formulas-vs-trace-fsdp8-cpu-<date>)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--checkpointing", default=",".join(CHECKPOINTING))
    ap.add_argument("--reuse-trace", metavar="JSON",
                    help="take the trace's numbers from this earlier results file instead of "
                    "tracing again (the trace does not depend on the formulas)")
    ap.add_argument("--trace-missing", action="store_true",
                    help="with --reuse-trace: trace the cells the stored file has no trace for")
    args = ap.parse_args()
    stored = None
    if args.reuse_trace:
        old = json.loads(Path(args.reuse_trace).read_text())["rows"]

        def fresh(spec: Any, run: RunConfig, gpu: GpuSpec) -> Any:
            return TRACERS[run.gpus](spec, run, gpu)  # type: ignore[misc]

        stored = _stored_tracer({(r["preset"], r["mode"], r["checkpointing"], r["batch"],
                                  r["seq"], r["gpus"]): r for r in old},
                                fresh if args.trace_missing else None)
    gpu = get_gpu(args.gpu)
    points = [tuple(int(v) for v in p.split("x")) for p in args.points.split(",")]
    kind = "fsdp8-" if args.gpus == "8" else ""
    out = Path(args.out or f"bench/results/formulas-vs-trace-{kind}cpu-"
               f"{dt.date.today().isoformat()}.json")
    rows: list[Row] = []
    print(f"{'preset':15} {'mode':5} {'ckpt':9} {'b x s':>9} {'gpus':>4} {'plan GiB':>9} "
          f"{'trace GiB':>9} {'error':>7}  note", flush=True)
    for name in args.presets.split(","):
        for gpus in (int(g) for g in args.gpus.split(",")):
            for mode in args.modes.split(","):
                for ckpt in args.checkpointing.split(","):
                    for batch, seq in points:
                        r = compare(name, mode, ckpt, batch, seq, gpu, gpus, stored)
                        rows.append(r)
                        err = "" if r.error is None else f"{100 * r.error:+6.1f}%"
                        print(f"{name:15} {mode:5} {ckpt:9} {f'{batch}x{r.seq}':>9} {gpus:>4} "
                              f"{_gib(r.plan_bytes):>9} {_gib(r.trace_live_bytes):>9} {err:>7}  "
                              f"{'' if r.agrees else r.why[:90]}", flush=True)
        # after each preset: a cut-off run keeps rows
        _write(rows, gpu, partial=True, out=out, trace_from=args.reuse_trace)
    _write(rows, gpu, partial=False, out=out, trace_from=args.reuse_trace)
    print(_summary(rows))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
