"""What each technique would save when a plan does not fit.

A short, honest list: every entry is a re-plan with one option changed, so the saving shown is
what the planner predicts, not a rule of thumb. (The fit search of a later issue combines them.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memfit.analytic.planner import MemoryPlan, with_changes
from memfit.errors import MemfitError


@dataclass(frozen=True, kw_only=True)
class Suggestion:
    change: str
    """The option change, as a CLI flag."""
    plan: MemoryPlan
    saved_bytes: int


def _candidates(p: MemoryPlan) -> list[tuple[str, dict[str, Any]]]:
    run, gpu = p.run, p.gpu
    out: list[tuple[str, dict[str, Any]]] = []
    if run.training:
        if run.checkpointing != "full":
            out.append(("--checkpointing full", {"checkpointing": "full"}))
        if run.checkpointing == "none":  # op-level: keeps matmul outputs, any attention
            out.append(("--checkpointing selective", {"checkpointing": "selective"}))
        if run.attention == "eager":
            out.append(("--attention sdpa", {"attention": "sdpa"}))
        if run.precision == "fp32":
            bf16 = gpu is None or gpu.bf16
            out.append((f"--precision {'bf16' if bf16 else 'fp16'}-mixed",
                        {"precision": "bf16-mixed" if bf16 else "fp16-mixed"}))
        if run.optimizer in ("adam", "adamw"):
            out.append(("--optimizer adamw-8bit", {"optimizer": "adamw-8bit"}))
        if not run.offload_optimizer and run.optimizer not in ("sgd",):
            out.append(("--offload-optimizer", {"offload_optimizer": True}))
        if run.batch > 1:
            out.append((f"--batch {run.batch // 2} --grad-accum {run.grad_accum * 2}",
                        {"batch": run.batch // 2, "grad_accum": run.grad_accum * 2}))
        if run.parallel.dp > 1 and run.zero < 3:
            out.append((f"--zero {run.zero + 1}", {"zero": run.zero + 1}))
        if run.mode == "train":
            out.append(("--mode lora", {"mode": "lora"}))
        if run.mode in ("train", "lora") and run.precision != "fp32":
            out.append(("--mode qlora", {"mode": "qlora"}))
    else:
        for quant in ("int8", "int4"):
            if run.weight_quant != quant and not (run.weight_quant == "int4"):
                out.append((f"--quant {quant}", {"weight_quant": quant}))
        fp8 = gpu is not None and gpu.fp8
        kv = "fp8" if fp8 else "int8"
        if run.kv_cache_dtype not in ("fp8", "int8"):
            out.append((f"--kv-cache-dtype {kv}", {"kv_cache_dtype": kv}))
        if run.batch > 1:
            out.append((f"--batch {run.batch // 2}", {"batch": run.batch // 2}))
    return out


def suggest_changes(p: MemoryPlan, limit: int = 6) -> list[Suggestion]:
    """Single-option changes that shrink the plan, those that fit first, biggest saving first."""
    found: list[Suggestion] = []
    for label, changes in _candidates(p):
        try:
            alt = with_changes(p, **changes)
        except MemfitError:
            continue  # the change conflicts with another option (e.g. no bf16 on this GPU)
        saved = p.total_bytes - alt.total_bytes
        if saved > 0:
            found.append(Suggestion(change=label, plan=alt, saved_bytes=saved))
    found.sort(key=lambda s: (not s.plan.fits, -s.saved_bytes))
    return found[:limit]
