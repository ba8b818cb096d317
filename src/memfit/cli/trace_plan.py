"""``memfit plan --method trace``: build the model from its config on meta tensors and trace
one real step with the trace engine, next to the analytic plan."""

from __future__ import annotations

import argparse
import dataclasses
import os
import warnings
from typing import Any

from memfit.analytic.config import RunConfig
from memfit.analytic.planner import (
    FITS_MARGIN,
    GPUS_PER_NODE,
    MemoryPlan,
    check_model_options,
    gpus_needed,
    plan,
    scale_out_line,
)
from memfit.analytic.suggestions import suggest_changes
from memfit.analytic.table import (
    Column,
    Footnote,
    MemoryTable,
    SuggestionRow,
    format_params,
    reserve_not_modelled_note,
)
from memfit.categories import MemoryCategory
from memfit.cli._common import (
    console,
    exit_status,
    positive_int,
    print_fit_verdict,
    print_json,
    took,
)
from memfit.errors import MemfitError
from memfit.gpus import GpuSpec
from memfit.models.hf_auto import HFModelSpec
from memfit.models.spec import ModelSpec, TransformerSpec
from memfit.progress import Progress, phase
from memfit.trace.estimate import TRACE_FITS_MARGIN
from memfit.units import format_bytes


def _check_traceable(model: ModelSpec, run: RunConfig) -> TransformerSpec | HFModelSpec:
    if isinstance(model, HFModelSpec) and run.mode in ("lora", "qlora"):
        raise MemfitError(f"--mode {run.mode} needs a model family memfit's formulas cover "
                          f"(which layers get adapters); {model.model_type} is traced as "
                          "configured only: use --mode train or inference")
    if not isinstance(model, TransformerSpec | HFModelSpec):
        raise MemfitError("--method trace needs the model's architecture; give a preset or a "
                          "config.json instead of --params")
    unsupported = []
    if run.gpus > 1:
        unsupported.append("--gpus > 1 (sharding, tp, pp)")
    if run.offload_params:
        unsupported.append("--offload-params")
    if run.weight_quant != "none" or run.kv_cache_dtype is not None or run.new_tokens:
        unsupported.append("--quant / --kv-cache-dtype / --new-tokens")
    if run.precision == "fp8":
        unsupported.append("--precision fp8")
    if unsupported:
        raise MemfitError(f"--method trace does not model {', '.join(unsupported)} yet; use the "
                          "default analytic method for these")
    return model


def traced_estimate(spec: TransformerSpec | HFModelSpec, run: RunConfig,
                    gpu: GpuSpec | None, parallel: Any = None,
                    precision: str | None = None, backend: str = "auto") -> Any:
    """Build ``spec`` on meta (transformers when installed, else memfit's builtin modules; any
    other model type through transformers' Auto classes), apply the run's checkpointing, and
    trace one step on the CUDA target (each rank role of ``parallel``, a
    :class:`memfit.Parallel`, when given; ``precision`` overrides the run's for the trace, e.g.
    fp32 parameters without autocast under FSDP2's MixedPrecisionPolicy; ``backend``: the
    :func:`memfit.models.build_model` backend of a preset or config.json, ``"builtin"`` for
    the layouts only memfit's decoders take: pipeline, sequence and expert parallelism)."""
    from memfit.models.build import build_model, example_inputs
    from memfit.trace import estimate

    attn = "eager" if run.attention == "eager" else "sdpa"
    phase("building the model on meta")
    if isinstance(spec, HFModelSpec):
        model = spec.build(device="meta", attn_implementation=None if attn == "sdpa" else attn)
    else:
        model = build_model(spec, device="meta", attn_implementation=attn, backend=backend)
    if run.mode in ("lora", "qlora"):
        _apply_adapters(model, run)
    if run.checkpointing != "none":
        from memfit.techniques.checkpointing import apply_activation_checkpointing

        apply_activation_checkpointing(model, policy=run.checkpointing)
    training = run.mode in ("train", "lora", "qlora")
    if isinstance(spec, HFModelSpec):
        inputs = spec.example_inputs(run.batch, run.seq, device="meta", training=training)
    else:
        seq = None if spec.arch == "vision" else (run.seq or spec.default_seq_len)
        inputs = example_inputs(spec, batch=run.batch, seq=seq, device="meta")
    if not training:
        model.eval()
        inputs.pop("labels", None)
    optimizer: Any = run.optimizer if training else None
    if training and run.offload_optimizer:
        from memfit.trace.optim import offloaded

        optimizer = offloaded(run.optimizer)
    phase("tracing one step" if not training else "tracing two steps")
    return estimate(model, inputs, optimizer=optimizer, precision=precision or run.precision,
                    device="cuda", gpu=gpu, steps=2 if training else 1, parallel=parallel)


def _apply_adapters(model: Any, run: RunConfig) -> None:
    """``--mode lora``: the base frozen in bf16 (as the analytic plan counts it: 16-bit), fp32
    adapters of rank ``--lora-rank`` on the ``*_proj`` layers ``--lora-targets`` names.
    ``--mode qlora``: those layers' weights in NF4 (torchao's ``NF4Tensor``, which quantizes
    meta tensors: bitsandbytes needs real weights; both store 4.1 bits per weight) and fp32
    adapters; the rest of the base in bf16."""
    import torch

    from memfit.techniques.peft import apply_lora, apply_qlora

    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    targets = [f"{t}_proj" for t in run.lora_targets]
    missing = [t for t in targets if t not in names]
    if missing:
        raise MemfitError(f"--method trace --mode {run.mode}: this model has no "
                          f"{', '.join(missing)} layers (it names its projections differently); "
                          "use the default analytic method")
    model.to(torch.bfloat16)
    if run.mode == "qlora":
        # As a 4-bit load does (transformers' load_in_4bit): every linear layer but the head is
        # NF4, with or without an adapter.
        from torch import nn

        from memfit.techniques.peft import NF4Linear, _replace

        for name, mod in list(model.named_modules()):
            if (type(mod) is nn.Linear and name.rsplit(".", 1)[-1] not in targets
                    and not name.endswith("lm_head")):
                _replace(model, name, NF4Linear(mod))
        apply_qlora(model, rank=run.lora_rank, targets=targets, quant_backend="torchao")
    else:
        apply_lora(model, rank=run.lora_rank, targets=targets, backend="builtin")
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # adapters train in fp32 under autocast


def per_gpu_breakdown(est: Any) -> dict[MemoryCategory, int]:
    """The estimate's breakdown at the peak with the caching allocator's reserve beyond live
    bytes (peak reserved - peak allocated) added to ``runtime``: it sums to ``total_bytes``.
    (The table shows the reserve on its own row: :func:`trace_column`.)"""
    breakdown = {c: int(est.breakdown.get(c, 0)) for c in MemoryCategory}
    breakdown[MemoryCategory.RUNTIME] += allocator_reserve(est)
    return breakdown


def allocator_reserve(est: Any) -> int:
    """Bytes the caching allocator holds beyond live tensors at the peak."""
    return int(est.peak_reserved_bytes - est.peak_bytes)


def trace_column(est: Any) -> Column:
    """The trace as a column of the shared memory table: live bytes per category at the peak
    (``runtime``: the CUDA context and NCCL outside the allocator, the cuBLAS workspaces inside
    it) and the allocator's reserve on its own row; the column sums to ``est.total_bytes``."""
    breakdown = {c: int(est.breakdown.get(c, 0)) for c in MemoryCategory}
    return Column(name="trace", breakdown=breakdown, allocator_reserve=allocator_reserve(est))


def trace_footnotes(est: Any, analytic: MemoryPlan, run: RunConfig) -> list[Footnote]:
    """Where the trace and the analytic plan count a category differently, and why."""
    notes = [Footnote(rows=("activations", "temporaries"), text=(
        f"each column is what is live at its own peak: the trace's is in the {est.peak_phase} "
        f"({est.peak_op}), the analytic plan's in the {analytic.peak_phase}"))]
    if run.training and run.mixed:
        states = (MemoryCategory.WEIGHTS, MemoryCategory.GRADIENTS,
                  MemoryCategory.OPTIMIZER_STATES)
        traced = sum(int(est.breakdown.get(c, 0)) for c in states)
        planned = sum(analytic.breakdown[c] for c in states)
        notes.append(Footnote(rows=tuple(c.value for c in states), text=(
            "the trace holds fp32 parameters and fp32 gradients, as torch.autocast training "
            "does; the analytic plan counts 16-bit weights and gradients and puts the fp32 "
            "master copies under optimizer_states, as the ZeRO paper does: the same bytes in "
            "different rows when every state is live at the peak (weights + gradients + "
            f"optimizer_states: trace {format_bytes(traced)}, analytic "
            f"{format_bytes(planned)})")))
    if int(est.breakdown.get(MemoryCategory.RUNTIME, 0)) != analytic.breakdown[
            MemoryCategory.RUNTIME]:
        notes.append(Footnote(rows=("runtime",), text=(
            "the trace holds the cuBLAS workspaces in the caching allocator's blocks, rounded up "
            "to its block sizes, as torch.cuda.memory_reserved() counts them")))
    notes.append(reserve_not_modelled_note(FITS_MARGIN, "by the analytic plan"))
    return notes


def trace_suggestions(est: Any, analytic: MemoryPlan, capacity: int | None,
                      limit: int = 6) -> list[SuggestionRow]:
    """The analytic plan's single-option changes with their saving applied to the trace's total
    (no re-trace: a re-trace per change would take seconds to minutes each), judged with the
    trace's fit margin. Empty when the trace fits or no GPU is given."""
    if capacity is None or capacity - est.total_bytes >= TRACE_FITS_MARGIN * capacity:
        return []
    rows = []
    for s in suggest_changes(analytic, limit=50):
        total = est.total_bytes - s.saved_bytes
        rows.append(SuggestionRow(change=s.change, saved_bytes=s.saved_bytes, total_bytes=total,
                                  fits=capacity - total >= TRACE_FITS_MARGIN * capacity))
    rows.sort(key=lambda r: (not r.fits, -r.saved_bytes))
    return rows[:limit]


def run_trace(args: argparse.Namespace, model: ModelSpec, run: RunConfig,
              gpu: GpuSpec | None) -> int:
    spec = _check_traceable(model, run)
    check_model_options(spec, run)  # before the trace, not after it
    with Progress(f"memfit plan: tracing {spec.name}", total=None):
        try:
            with warnings.catch_warnings():
                # The table prints each assumption as an "assumed:" line; not twice on stderr.
                warnings.filterwarnings("ignore", message="memfit: assumed")
                est = traced_estimate(spec, run, gpu)
        except (MemfitError, KeyboardInterrupt):
            raise
        except Exception as exc:
            # The model's own code failed on this config (a key transformers needs is missing, a
            # shape does not divide): the config's problem, said in one line, as for bad input.
            if os.environ.get("MEMFIT_DEBUG"):
                raise
            detail = str(exc).splitlines()[0] if str(exc) else ""
            raise MemfitError(
                f"tracing {spec.name} failed in the model's own code: {type(exc).__name__}: "
                f"{detail}; check the config (set MEMFIT_DEBUG=1 for the traceback)") from None
    column = trace_column(est)
    analytic = plan(spec, run, gpu)
    capacity = gpu.usable_bytes if gpu else None
    headroom = None if capacity is None else capacity - est.total_bytes
    # A model type the formulas do not cover has no analytic column: its "analytic plan" would
    # be model states alone, and single-change savings taken from it would mislead.
    covered = not isinstance(spec, HFModelSpec)
    suggestions = trace_suggestions(est, analytic, capacity) if covered else []
    if args.json:
        print_json({
            "method": "trace",
            "model": {"name": spec.name, "params": spec.param_count()},
            "gpu": None if gpu is None else {"name": gpu.name, "capacity_bytes": capacity,
                                             "capacity_measured": gpu.usable_measured},
            "per_gpu": {"total_bytes": est.total_bytes,
                        "breakdown": {c.value: b for c, b in column.breakdown.items()},
                        "allocator_reserve_bytes": column.allocator_reserve},
            "peak_bytes": est.peak_bytes,
            "peak_reserved_bytes": est.peak_reserved_bytes,
            "host_peak_bytes": est.host_peak_bytes,
            "fits": None if headroom is None else headroom >= TRACE_FITS_MARGIN * capacity,
            "headroom_bytes": headroom,
            "peak": {"op": est.peak_op, "phase": est.peak_phase, "module": est.peak_module},
            "analytic_total_bytes": analytic.total_bytes if covered else None,
            "trace_seconds": est.trace_seconds,
            "assumptions": list(est.assumptions),
            "notes": [args.precision_note] if getattr(args, "precision_note", None) else [],
            **({"checkpoint": args.checkpoint_json}
               if getattr(args, "checkpoint_json", None) else {}),
            "suggestions": [
                {"change": s.change, "saved_bytes": s.saved_bytes, "total_bytes": s.total_bytes,
                 "fits": s.fits, "saving_from": "analytic"} for s in suggestions],
            "run": {**{k: (list(v) if isinstance(v, tuple) else v)
                       for k, v in dataclasses.asdict(run).items()}, "seq": analytic.seq},
        })
        return exit_status(args, capacity, est.total_bytes, TRACE_FITS_MARGIN)
    after = []
    if covered and suggestions and analytic.fits is False:
        # The trace models one GPU; how many it needs comes from the analytic plan.
        per_node = positive_int(getattr(args, "gpus_per_node", None),
                                "--gpus-per-node") or GPUS_PER_NODE
        scale = gpus_needed(analytic, gpus_per_node=per_node)
        after.append("analytic plan: " + scale_out_line(analytic, scale, gpus_per_node=per_node))
    if est.host_peak_bytes:
        after.append(f"host memory for offloaded states (peak): "
                     f"{format_bytes(est.host_peak_bytes)}")
    after += [f"assumed: {note}" for note in est.assumptions]
    table = MemoryTable(
        title="Memory per GPU: trace vs analytic" if covered else "Memory per GPU (trace)",
        capacity=capacity,
        capacity_is_driver_total=gpu is not None and not gpu.usable_measured,
        columns=(column, analytic.column("analytic")) if covered else (column,),
        footnotes=tuple(trace_footnotes(est, analytic, run)) if covered else (),
        lines_before=(
            f"[bold]{spec.name}[/bold] ({format_params(spec.param_count())} params) traced on meta "
            f"tensors{f' for {gpu.label}' if gpu else ' for CUDA'} {took(args, est.trace_seconds)}",
            analytic.describe(),
            *([args.precision_note] if getattr(args, "precision_note", None) else []),
            f"peak at {est.peak_op} in {est.peak_module or 'the model'} "
            f"({est.peak_phase}, step {est.peak_step})"),
        lines_after=tuple(after), suggestions=tuple(suggestions),
        suggestions_title="What would save memory (one change each; the saving is the analytic "
                          "re-plan's, applied to the trace's total)")
    table.print(console(), verdict=lambda out: print_fit_verdict(
        out, capacity, est.total_bytes, TRACE_FITS_MARGIN, "trace"))
    return exit_status(args, capacity, est.total_bytes, TRACE_FITS_MARGIN)
