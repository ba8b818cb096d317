"""What each technique would save when a plan does not fit.

A short, honest list: every entry is a re-plan with one option changed, so the saving shown is
what the planner predicts, not a rule of thumb. (The fit search of a later issue combines them.)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from memfit.analytic.model_states import model_states
from memfit.analytic.planner import MemoryPlan, with_changes
from memfit.errors import MemfitError
from memfit.models.spec import TransformerSpec
from memfit.units import format_bytes

SPARSE_EMBEDDING_SHARE = 0.5
"""``memfit.techniques.sparse.DOMINANT_SHARE`` (that module imports torch, which the analytic
CLI never does; tests/analytic/test_sparse_embedding_note.py keeps the two equal)."""


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


def sparse_gradient_note(p: MemoryPlan) -> str | None:
    """The note offering sparse embedding gradients when a fully trained model's embedding
    tables that could take them hold at least :data:`SPARSE_EMBEDDING_SHARE` of its parameters
    (the traced ``fit`` says the same from the module: ``sparse_gradient_hint``), else None.

    Not a re-plan: the analytic plan does not model sparse gradients. A decoder's token table
    never qualifies: tied, the LM head's dense gradient flows into it; untied, the head is as
    large as the table, so the table is at most half. Encoders with large vocabularies do
    (XLM-R base: 69%).
    """
    m, run = p.model, p.run
    if not (isinstance(m, TransformerSpec) and run.training and run.mode == "train"
            and m.arch != "vision"):
        return None
    h = m.hidden_size
    tied = m.arch == "decoder" and m.tie_embeddings
    tables = {"token": 0 if tied else m.vocab_size * h,
              "position": m.max_position_embeddings * h if m.position == "learned" else 0,
              "token-type": m.type_vocab_size * h}
    size, total = sum(tables.values()), m.param_count()
    if size < SPARSE_EMBEDDING_SHARE * total:
        return None
    dense_grads = model_states(m, run, stage=p.stage).gradients * size // total
    names = ", ".join(name for name, n in tables.items() if n)
    return (f"embedding tables ({names}) hold {size / total:.0%} of the trainable parameters: "
            f"sparse gradients keep only the rows a batch looks up instead of "
            f"{format_bytes(dense_grads)} of dense gradients per GPU: "
            f"memfit.techniques.apply_sparse_embeddings(model) with SGD, Adagrad or "
            f"SparseAdamWithDense, not AdamW (docs/sparse.md); not modelled here: memfit fit "
            f"traces it")


def with_hints(p: MemoryPlan) -> MemoryPlan:
    """``p`` with the notes that point to a technique the plan does not model."""
    note = sparse_gradient_note(p)
    return p if note is None else replace(p, notes=(*p.notes, note))
