"""``memfit plan --method trace``: build the model from its config on meta tensors and trace
one real step with the trace engine, next to the analytic plan."""

from __future__ import annotations

import argparse
import dataclasses
import os
import warnings
from typing import Any

from memfit import vocab
from memfit.analytic.checks import check_model_options
from memfit.analytic.config import RunConfig
from memfit.analytic.planner import FITS_MARGIN, GPUS_PER_NODE, MemoryPlan, describe_run, plan
from memfit.analytic.scale_out import MAX_GPUS, gpus_needed, scale_out_line
from memfit.analytic.suggestions import suggest_changes
from memfit.analytic.table import (
    Column,
    Footnote,
    MemoryTable,
    SuggestionRow,
    format_params,
    reserve_not_modelled_note,
)
from memfit.analytic.traced import allocator_reserve, traced_estimate
from memfit.analytic.traced_lora import lora_for
from memfit.budget import budget_bytes, device_budget
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
    if "trace" not in vocab.precision(run.precision).layers:
        unsupported.append(f"--precision {run.precision}")
    if unsupported:
        raise MemfitError(f"--method trace does not model {', '.join(unsupported)} yet; use the "
                          "default analytic method for these")
    return model


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
    if not run.training and run.mixed:
        notes.append(Footnote(rows=(MemoryCategory.WEIGHTS.value,), text=(
            f"the trace runs the model in fp32 under torch.autocast, as --precision "
            f"{run.precision} means, so it holds fp32 weights; the analytic plan counts a model "
            f"cast to {run.compute_format} (--precision {run.compute_format} traces that)")))
    traced_kv = int(est.breakdown.get(MemoryCategory.KV_CACHE, 0))
    planned_kv = analytic.breakdown[MemoryCategory.KV_CACHE]
    if traced_kv == 0 and planned_kv > 0:
        notes.append(Footnote(rows=(MemoryCategory.KV_CACHE.value,), text=(
            "the trace runs one forward of the whole sequence without a KV cache (the model is "
            "built with use_cache=False), so its total leaves out the cache that generation "
            f"keeps: the analytic plan's {format_bytes(planned_kv)} (seq + --new-tokens)")))
    if int(est.breakdown.get(MemoryCategory.RUNTIME, 0)) != analytic.breakdown[
            MemoryCategory.RUNTIME]:
        notes.append(Footnote(rows=("runtime",), text=(
            "the trace holds the cuBLAS workspaces in the caching allocator's blocks, rounded up "
            "to its block sizes, as torch.cuda.memory_reserved() counts them")))
    notes.append(reserve_not_modelled_note(FITS_MARGIN, "by the analytic plan"))
    return notes


def host_line(est: Any, run: RunConfig) -> str | None:
    """The trace's host memory, named for what holds it: without offloading it is only the
    Adam family's step counters (Note: [optimizer step counters on the host] in
    trace/step.py), not offloaded states."""
    if not est.host_peak_bytes:
        return None
    offloads = run.offload_optimizer or run.offload_params or run.offload_activations
    what = ("offloaded states" if offloads else
            "the optimizer's step counters, CPU tensors in torch's Adam family")
    return f"host memory for {what} (peak): {format_bytes(est.host_peak_bytes)}"


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


def retrace_candidates(run: RunConfig) -> list[tuple[str, dict[str, Any]]]:
    """The few single changes re-traced for a model type the formulas do not cover (no
    analytic plan to take savings from; each is one more trace of the real model, seconds to a
    minute): what shrinks activations (full checkpointing, half the micro-batch) and, in
    training, the optimizer states (``--offload-optimizer``)."""
    out: list[tuple[str, dict[str, Any]]] = []
    if run.training and run.checkpointing != "full":
        out.append(("--checkpointing full", {"checkpointing": "full"}))
    if run.batch > 1:
        half = run.batch // 2
        out.append((f"--batch {half} --grad-accum {run.grad_accum * 2}",
                    {"batch": half, "grad_accum": run.grad_accum * 2}) if run.training
                   else (f"--batch {half}", {"batch": half}))
    if run.training and not run.offload_optimizer:
        out.append(("--offload-optimizer", {"offload_optimizer": True}))
    return out


def retraced_suggestions(spec: TransformerSpec | HFModelSpec, run: RunConfig,
                         gpu: GpuSpec | None, est: Any) -> list[SuggestionRow]:
    """Each of :func:`retrace_candidates` traced again, those that fit first, biggest saving
    first; empty when the trace fits or no GPU is named. A change the trace refuses is left
    out."""
    capacity = budget_bytes(gpu)
    if capacity is None or capacity - est.total_bytes >= TRACE_FITS_MARGIN * capacity:
        return []
    rows = []
    for change, fields in retrace_candidates(run):
        phase(f"re-tracing with {change}")
        try:
            alt = _trace(spec, dataclasses.replace(run, **fields), gpu)
        except MemfitError:
            continue
        saved = est.total_bytes - alt.total_bytes
        if saved > 0:
            rows.append(SuggestionRow(
                change=change, saved_bytes=saved, total_bytes=alt.total_bytes,
                fits=capacity - alt.total_bytes >= TRACE_FITS_MARGIN * capacity))
    rows.sort(key=lambda r: (not r.fits, -r.saved_bytes))
    return rows


_SHARDED = (MemoryCategory.WEIGHTS, MemoryCategory.GRADIENTS, MemoryCategory.OPTIMIZER_STATES)


def sharded_total(est: Any, gpus: int) -> int:
    """A floor for the one-GPU trace's total under ZeRO-3 / FSDP over ``gpus`` GPUs, op by op
    from its timeline: the model states (weights, gradients, optimizer states) live after each
    op, and the optimizer step's temporaries (made from the states, shard by shard), divided by
    ``gpus``; the rest (activations, other temporaries, runtime), the allocator's reserve and
    the runtime outside it as traced, plus NCCL's buffers. Not counted: the layers FSDP gathers
    one at a time and its communication buffers (``--gpus N --fsdp`` traces them). ``gpus=1``
    gives ``est.total_bytes``."""
    from memfit.ledger import CATEGORIES
    from memfit.runtime import nccl_buffer_bytes

    sharded = [CATEGORIES.index(c) for c in _SHARDED]
    temporaries = CATEGORIES.index(MemoryCategory.TEMPORARIES)
    live_peak, peak = 0, 0
    for point in est.timeline:
        states = sum(point.bytes[i] for i in sharded)
        if point.phase == "optimizer":
            states += point.bytes[temporaries]
        live = sum(point.bytes)
        live_peak = max(live_peak, live)
        peak = max(peak, live - states + -(-states // gpus))
    return peak + est.total_bytes - live_peak + nccl_buffer_bytes(gpus)


def traced_scale_out(est: Any, capacity: int | None,
                     gpus_per_node: int = GPUS_PER_NODE) -> tuple[str, dict[str, Any] | None]:
    """For a model type the formulas do not cover (no analytic plan to scale): the fewest GPUs
    on which :func:`sharded_total`, a floor, keeps the trace's fit margin free: fewer GPUs
    cannot hold the step. Returns the line and its JSON (None when no count up to
    :data:`MAX_GPUS` does)."""
    limit = int(capacity * (1 - TRACE_FITS_MARGIN)) if capacity else 0
    rest = sharded_total(est, MAX_GPUS)
    if rest > limit:
        return (f"no number of GPUs up to {MAX_GPUS} holds this step with ZeRO-3 / FSDP: what "
                f"one micro-batch holds besides the model states ({format_bytes(rest)} per GPU "
                "in the trace) does not shrink with more GPUs; try --checkpointing full or a "
                "smaller --batch"), None
    lo, hi = 2, MAX_GPUS
    while lo < hi:  # the per-GPU bytes never grow with the GPUs: bisect for the fewest
        mid = (lo + hi) // 2
        if sharded_total(est, mid) <= limit:
            hi = mid
        else:
            lo = mid + 1
    per_gpu = sharded_total(est, lo)
    nodes = -(-lo // gpus_per_node)
    line = (f"this needs at least {lo} GPUs (ZeRO-3 / FSDP: --gpus {lo} --fsdp), at least "
            f"{format_bytes(per_gpu)} per GPU: the trace with its model states sharded {lo} "
            f"ways at every op, without the layers FSDP gathers; --gpus {lo} --fsdp traces "
            "each rank")
    if lo > gpus_per_node:
        line += f"; {nodes} nodes of {gpus_per_node} GPUs"
    return line, {"gpus": lo, "zero": 3, "tp": 1, "pp": 1, "flags": f"--gpus {lo} --fsdp",
                  "strategy": "ZeRO-3 / FSDP", "per_gpu_total_bytes": per_gpu,
                  "headroom_bytes": (capacity or 0) - per_gpu, "gpus_per_node": gpus_per_node,
                  "nodes": nodes, "lower_bound": True}


def _trace(spec: TransformerSpec | HFModelSpec, run: RunConfig, gpu: GpuSpec | None) -> Any:
    """:func:`traced_estimate`, its failures in the model's own code said in one line."""
    try:
        with warnings.catch_warnings():
            # The table prints each assumption as an "assumed:" line; not twice on stderr.
            warnings.filterwarnings("ignore", message="memfit: assumed")
            return traced_estimate(spec, run, gpu)
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


def _json(args: argparse.Namespace, spec: Any, run: RunConfig, gpu: GpuSpec | None, est: Any,
          analytic: Any, lora: Any, suggestions: list[Any], scale_json: Any, seq: int,
          capacity: int | None, fits: bool | None, headroom: int | None) -> dict[str, Any]:
    """The traced plan as ``--json`` prints it."""
    covered = analytic is not None
    return {
        "method": "trace",
        "model": {"name": spec.name, "params": spec.param_count()},
        "gpu": None if gpu is None else {"name": gpu.name, "capacity_bytes": capacity,
                                         "capacity_measured": gpu.usable_measured,
                                         "budget": device_budget(gpu).to_dict()},
        "per_gpu": {"total_bytes": est.total_bytes,
                    "breakdown": {c.value: b for c, b in trace_column(est).breakdown.items()},
                    "allocator_reserve_bytes": allocator_reserve(est)},
        "peak_bytes": est.peak_bytes,
        "peak_reserved_bytes": est.peak_reserved_bytes,
        "host_peak_bytes": est.host_peak_bytes,
        "fits": fits,
        "headroom_bytes": headroom,
        "peak": {"op": est.peak_op, "phase": est.peak_phase, "module": est.peak_module},
        "analytic_total_bytes": None if analytic is None else analytic.total_bytes,
        "trace_seconds": est.trace_seconds,
        "assumptions": list(est.assumptions),
        **({"lora": lora.to_dict()} if lora is not None else {}),
        "notes": [args.precision_note] if getattr(args, "precision_note", None) else [],
        **({"checkpoint": args.checkpoint_json}
           if getattr(args, "checkpoint_json", None) else {}),
        "scale_out": scale_json,
        "suggestions": [
            {"change": s.change, "saved_bytes": s.saved_bytes, "total_bytes": s.total_bytes,
             "fits": s.fits, "saving_from": "analytic" if covered else "trace"}
            for s in suggestions],
        "run": {**{k: (list(v) if isinstance(v, tuple) else v)
                   for k, v in dataclasses.asdict(run).items()}, "seq": seq},
    }


def run_trace(args: argparse.Namespace, model: ModelSpec, run: RunConfig,
              gpu: GpuSpec | None) -> int:
    spec = _check_traceable(model, run)
    check_model_options(spec, run)  # before the trace, not after it
    # A model type the formulas do not cover has no analytic column: its "analytic plan" would
    # be model states alone, and single-change savings taken from it would mislead; its
    # suggestions are re-traced instead, and it needs no analytic plan (none for LoRA).
    covered = not isinstance(spec, HFModelSpec)
    capacity = budget_bytes(gpu)
    per_node = positive_int(getattr(args, "gpus_per_node", None),
                            "--gpus-per-node") or GPUS_PER_NODE
    lora = None
    with Progress(f"memfit plan: tracing {spec.name}", total=None):
        if not covered and run.mode in ("lora", "qlora"):
            # Its own layer names, or peft's defaults for its type (analytic/traced_lora.py).
            phase("choosing the LoRA targets")
            given = getattr(args, "lora_targets", None)
            if given is not None and given.strip() == "all":
                run = dataclasses.replace(run, lora_targets=("all-linear",))
            run, lora = lora_for(spec, run, targets_given=given is not None)
        est = _trace(spec, run, gpu)
        analytic = plan(spec, run, gpu) if covered else None
        if analytic is not None:
            seq = analytic.seq
            suggestions = trace_suggestions(est, analytic, capacity)
        else:
            assert isinstance(spec, HFModelSpec)
            seq = spec.sequence_length(run.seq)
            suggestions = retraced_suggestions(spec, run, gpu, est)
    headroom = None if capacity is None else capacity - est.total_bytes
    fits = None if headroom is None else headroom >= TRACE_FITS_MARGIN * capacity
    scale_line, scale_json = None, None
    if gpu is not None and gpu.unified_memory:
        pass  # a Jetson or a Mac is one machine: no "more GPUs" (as memfit plan)
    elif analytic is not None and suggestions and analytic.fits is False:
        # The trace models one GPU; how many it needs comes from the analytic plan.
        scale = gpus_needed(analytic, gpus_per_node=per_node)
        scale_line = "analytic plan: " + scale_out_line(analytic, scale, gpus_per_node=per_node)
        scale_json = None if scale is None else scale.to_dict()
    elif analytic is None and fits is False and run.training:
        scale_line, scale_json = traced_scale_out(est, capacity, per_node)
    if args.json:
        print_json(_json(args, spec, run, gpu, est, analytic, lora, suggestions, scale_json,
                         seq, capacity, fits, headroom))
        return exit_status(args, capacity, est.total_bytes, TRACE_FITS_MARGIN)
    after: list[str] = []
    closing: tuple[str, ...] = ()
    if scale_line:  # a change of options comes before more hardware (as in ``plan.render``)
        closing = ((f"or, with none of these changes: {scale_line}"
                    if any(s.fits for s in suggestions) else scale_line),)
    if (host := host_line(est, run)) is not None:
        after.append(host)
    after += [f"assumed: {note}" for note in est.assumptions]
    column = trace_column(est)
    table = MemoryTable(
        title="Memory per GPU: trace vs analytic" if covered else "Memory per GPU (trace)",
        capacity=capacity,
        capacity_is_driver_total=(gpu is not None and not gpu.usable_measured
                                  and not gpu.unified_memory),
        columns=(column, analytic.column("analytic")) if analytic is not None else (column,),
        footnotes=(tuple(trace_footnotes(est, analytic, run)) if analytic is not None
                   else ()),
        lines_before=(
            f"[bold]{spec.name}[/bold] ({format_params(spec.param_count())} params) traced on meta "
            f"tensors{f' for {gpu.label}' if gpu else ' for CUDA'} {took(args, est.trace_seconds)}",
            describe_run(run, seq),
            *([lora.describe()] if lora is not None else []),
            *([line] if gpu and (line := device_budget(gpu).line()) else []),
            *([args.precision_note] if getattr(args, "precision_note", None) else []),
            f"peak at {est.peak_op} in {est.peak_module or 'the model'} "
            f"({est.peak_phase}, step {est.peak_step})"),
        lines_after=tuple(after), suggestions=tuple(suggestions), closing=closing,
        suggestions_title=(
            "What would save memory (one change each; the saving is the analytic re-plan's, "
            "applied to the trace's total)" if covered else
            "What would save memory (one change each, re-traced: these few only, as each is "
            "one more trace)"))
    table.print(console(), verdict=lambda out: print_fit_verdict(
        out, capacity, est.total_bytes, TRACE_FITS_MARGIN, "trace"))
    return exit_status(args, capacity, est.total_bytes, TRACE_FITS_MARGIN)
