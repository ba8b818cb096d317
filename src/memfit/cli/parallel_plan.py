"""``memfit plan --gpus N``: trace each rank role of the real parallel step (PyTorch's own FSDP2,
DDP, ZeRO-1, tensor parallelism over a fake process group: ``memfit/parallel/trace.py``) and
print one row per role, next to the analytic plan's per-GPU number.

The trace is the default whenever the model can be built (a preset or a config.json) and the
engine is one the trace runs (PyTorch FSDP2 / DDP); the formulas answer for ``--params``,
``--method analytic``, ``--engine deepspeed|megatron`` and any layout the trace refuses, with one
line saying why (:func:`formulas_reason`, and the trace's own refusal).

Pipeline, sequence and loss parallelism are traced on memfit's builtin decoders and on Hugging
Face's Llama, Mistral, Qwen2 and Qwen3 modules (``memfit.parallel.hf_pipeline``); expert
parallelism on the builtin decoders only (``expert.check_experts`` refuses Hugging Face
modules). A preset or config.json of another family is built with
``build_model(backend="builtin")`` for those layouts (:func:`builtin_needs`); ``build_model``
checks that its parameter count is the spec's, as it checks the transformers build's, so the
numbers count the same model.

``--engine fsdp2 --offload-params`` is traced too (FSDP2's ``CPUOffloadPolicy``): the rows are
the device's bytes, and each role's host bytes (offloaded parameters, gradients, optimizer
states) are printed apart and in ``--json`` as ``host_peak_bytes``.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from memfit.analytic.config import RunConfig
from memfit.analytic.planner import ENGINE_LABELS, MemoryPlan, plan
from memfit.analytic.traced import (
    AGREEMENT,
    COMPARED_CATEGORIES,
    comparable_run,
    comparison,
    live_bytes,
    parallel_layout,
    trace_parallel,
)
from memfit.categories import MemoryCategory
from memfit.cli._common import console, exit_status, print_fit_verdict, print_json, took
from memfit.errors import MemfitError
from memfit.gpus import GpuSpec
from memfit.models.hf_auto import HFModelSpec
from memfit.models.spec import ModelSpec, TransformerSpec
from memfit.progress import Progress
from memfit.units import format_bytes

# Nothing here imports torch at module level: `plan --params --gpus N` and the engines the trace
# does not run stay on the light analytic path (tests/cli/test_cli_no_torch.py).

TRACED_LAYOUTS = ("zero-paper", "fsdp2", "ddp")
"""``RunConfig.layout`` values the trace runs as PyTorch FSDP2 / DDP (``auto`` without offload
resolves to ``zero-paper``; the trace then runs the PyTorch engine the ZeRO stage names)."""

def formulas_reason(model: ModelSpec, run: RunConfig, ep: int = 1) -> str | None:
    """Why a multi-GPU plan comes from the formulas and not the trace, in one line; None when
    the trace can run it (it may still refuse the layout: :func:`run_parallel_plan`)."""
    if not isinstance(model, TransformerSpec | HFModelSpec):
        return "--params gives a parameter count, no architecture to trace"
    if run.layout not in TRACED_LAYOUTS:
        label = ENGINE_LABELS[run.layout]
        why = (f"--engine {run.engine}" if run.engine != "auto"
               else "offload under --engine auto is planned as DeepSpeed's ZeRO-Offload")
        return (f"{why}: the trace runs PyTorch FSDP2 / DDP, so {label}'s memory layout comes "
                "from the formulas")
    if not run.training and run.tp * run.pp == 1:
        return (f"inference on {run.gpus} GPUs runs {run.gpus} replicas and no collective: "
                "plan --gpus 1 to trace one")
    if run.offload_optimizer:
        return "--offload-optimizer over several GPUs is not traced yet"
    if run.weight_quant != "none" or run.kv_cache_dtype is not None or run.new_tokens:
        return "--quant / --kv-cache-dtype / --new-tokens are not traced yet"
    from memfit import vocab

    if "trace" not in vocab.precision(run.precision).layers:
        return f"--precision {run.precision} is not traced yet"
    try:
        vocab.check("checkpointing", run.checkpointing, "trace", what="checkpointing policy")
    except MemfitError:
        return f"--checkpointing {run.checkpointing} is an analytic variant (no trace policy)"
    return None


def trace_flags(args: argparse.Namespace, run: RunConfig) -> list[str]:
    """The options of ``args`` only the per-rank trace models (``--ep``, ``--loss-parallel``,
    ``--pp-schedule``, ``--microbatches``): the formulas would ignore them, so a plan that
    cannot trace them is an error, not a fallback. A pipeline option without ``--pp`` > 1 does
    nothing and is refused in one line."""
    flags = []
    ep = getattr(args, "ep", "1")
    if ep not in (None, "1", 1):
        flags.append(f"--ep {ep}")
    if getattr(args, "loss_parallel", False):
        flags.append("--loss-parallel")
    if getattr(args, "tp_plan", None) is not None:
        flags.append("--tp-plan")
    for flag, value in (("--pp-schedule", getattr(args, "pp_schedule", None)),
                        ("--pp-split", getattr(args, "pp_split", None)),
                        ("--microbatches", getattr(args, "microbatches", None))):
        if value is None:
            continue
        if run.pp == 1:
            raise MemfitError(f"{flag} {value} does nothing without pipeline stages; add "
                              "--pp N (N > 1) or drop it")
        flags.append(f"{flag} {value}")
    return flags


def builtin_needs(parallel: Any, model: Any = None) -> list[str]:
    """The options of ``parallel`` that only memfit's builtin decoders are traced with. For a
    ``model`` spec that transformers builds as one of the Hugging Face decoders the pipeline,
    sequence and loss parallel traces split themselves (Llama, Mistral, Qwen2, Qwen3:
    ``memfit/parallel/hf_pipeline.py``), only ``--ep`` (then every option, as the builtin
    decoder runs them all); for a mixture of experts transformers builds, ``--ep`` alone needs
    nothing (:func:`_hf_moe`)."""
    # a pipeline split at named modules splits the model transformers builds (pipeline_split)
    needs = [f"--pp {parallel.pp}"] if parallel.pp > 1 and not parallel.pp_split_points else []
    needs += ["--sp"] if parallel.sp else []
    needs += ["--loss-parallel"] if parallel.loss_parallel else []
    needs += [f"--ep {parallel.ep}"] if parallel.ep > 1 else []
    if needs and parallel.ep == 1 and _hf_splits(model):
        return []
    if needs == [f"--ep {parallel.ep}"] and _hf_moe(model):
        return []  # transformers' experts modules: memfit/parallel/hf_expert.py
    return needs


def _hf_moe(model: Any) -> bool:
    """Whether transformers builds ``model`` (a spec) as a mixture of experts, whose experts
    modules expert parallelism splits (``memfit/parallel/hf_expert.py``)."""
    from memfit.models.build import transformers_available

    if isinstance(model, HFModelSpec):
        return model.is_moe
    return (isinstance(model, TransformerSpec) and bool(getattr(model, "num_experts", 0))
            and transformers_available())


def _hf_splits(model: Any) -> bool:
    """Whether ``model`` (a spec) is built by transformers as a decoder whose module the
    pipeline and sequence-parallel traces split (``hf_pipeline.HF_DECODERS``)."""
    if not isinstance(model, TransformerSpec) or model.arch != "decoder":
        return False
    from memfit.models.build import transformers_available
    from memfit.parallel.hf_pipeline import HF_DECODERS

    return (model.family in HF_DECODERS and not getattr(model, "num_experts", 0)
            and transformers_available())


def engine_words(parallel: Any, run: RunConfig) -> str:
    """The PyTorch engine the trace ran, in words."""
    strategy = parallel.strategy
    if strategy in ("fsdp", "hsdp"):
        words = "PyTorch FSDP2 fully_shard" + (" (HSDP)" if strategy == "hsdp" else "")
        if parallel.param_dtype:
            words += (f", MixedPrecisionPolicy(param_dtype={parallel.param_dtype}, "
                      f"reduce_dtype={parallel.reduce_dtype})")
    elif strategy == "zero1":
        words = "PyTorch DDP + ZeroRedundancyOptimizer"
    elif strategy == "ddp":
        words = "PyTorch DDP"
    else:
        words = "PyTorch"
    if parallel.tp > 1:
        words += ", tensor parallel (parallelize_module)"
    if parallel.sp:
        words += ", sequence parallel"
    if parallel.loss_parallel:
        words += ", loss_parallel()"
    if parallel.pp > 1:
        words += f", torch.distributed.pipelining stages ({parallel.pp_schedule})"
    if parallel.ep > 1:
        words += ", expert parallel (all-to-all)"
    words += (", no autocast" if parallel.param_dtype
              else ", torch.autocast" if run.mixed else "")
    return words


def builtin_line(model: TransformerSpec, needs: list[str]) -> str:
    """The line saying the trace built memfit's builtin decoder, and why."""
    from memfit.analytic.table import format_params

    return (f"model: memfit's builtin {model.family} decoder (build_model(backend='builtin')): "
            f"{', '.join(needs)} {'is' if len(needs) == 1 else 'are'} traced on memfit's "
            f"decoders, not Hugging Face's; {format_params(model.param_count())} parameters, "
            "the count of the spec and of the Hugging Face build")


def run_parallel_plan(args: argparse.Namespace, model: ModelSpec, run: RunConfig,
                      gpu: GpuSpec | None, *, explicit: str | None, ep: int = 1,
                      gpus_per_node: int | None = None, fsdp: int | None = None,
                      loss_parallel: bool = False, pp_schedule: str | None = None,
                      microbatches: int | None = None) -> int | str:
    """Trace the multi-GPU plan and print it; returns the exit code, or the one-line reason the
    formulas answer instead. ``explicit``: the option that asks for the trace (``--method
    trace``, ``--fsdp N`` for HSDP, the options only the trace models: :func:`trace_flags`),
    whose refusal is an error instead. A layout ``Parallel`` refuses is an error (exit 2)."""
    analytic_check = plan(model, run, gpu)  # bad input (tp vs heads, pp vs layers) first
    reason = formulas_reason(model, run, ep)
    parallel = None
    if reason is None:
        from memfit.analytic.checks import check_model_options

        assert isinstance(model, TransformerSpec | HFModelSpec)
        check_model_options(model, run)
        parallel = parallel_layout(run, ep, gpus_per_node, fsdp, loss_parallel=loss_parallel,
                                   pp_schedule=pp_schedule, microbatches=microbatches)
    backend, note = "auto", None
    if reason is None:
        assert parallel is not None and isinstance(model, TransformerSpec | HFModelSpec)
        needs = builtin_needs(parallel, model)
        if needs and isinstance(model, HFModelSpec):
            reason = (f"{', '.join(needs)} {'is' if len(needs) == 1 else 'are'} traced on "
                      f"memfit's builtin decoders; model_type {model.model_type!r} is built by "
                      "transformers' Auto classes")
        elif needs:
            assert isinstance(model, TransformerSpec)
            backend, note = "builtin", builtin_line(model, needs)
    if reason is None:
        assert parallel is not None and isinstance(model, TransformerSpec | HFModelSpec)
        try:
            with Progress(f"memfit plan: tracing {model.name} per rank", total=None):
                est = trace_parallel(model, run, gpu, parallel, backend)
        except MemfitError as exc:
            reason = f"the trace refused it: {exc}"
    if reason is not None:
        if explicit:
            raise MemfitError(f"{explicit} over {run.gpus} GPUs: {reason}")
        return reason
    # The formulas of the same engine, beside the trace: not for a model type they do not cover
    # (model states alone) nor for HSDP (they shard over every data-parallel rank).
    # Nor beside expert or loss parallelism, which they do not model.
    covered = (not isinstance(model, HFModelSpec) and parallel.strategy != "hsdp"
               and parallel.ep == 1 and not parallel.loss_parallel)
    analytic = plan(model, comparable_run(run, parallel), gpu) if covered else None
    seq = (model.sequence_length(run.seq) if isinstance(model, HFModelSpec)
           else analytic_check.seq)
    render_parallel(args, model, run, gpu, parallel, est, analytic, seq,
                    backend=_backend_name(model, backend), backend_note=note)
    from memfit.trace.estimate import TRACE_FITS_MARGIN

    return exit_status(args, gpu.usable_bytes if gpu else None, est.total_bytes,
                       TRACE_FITS_MARGIN)


_SHORT = {MemoryCategory.WEIGHTS: "weights", MemoryCategory.GRADIENTS: "grads",
          MemoryCategory.OPTIMIZER_STATES: "optim", MemoryCategory.ACTIVATIONS: "acts",
          MemoryCategory.TEMPORARIES: "temps", MemoryCategory.RUNTIME: "runtime"}


def _unit(largest: int) -> tuple[str, int]:
    """The unit a table of byte counts up to ``largest`` is printed in."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if largest >= scale:
            return unit, scale
    return "B", 1


def _role_stages(est: Any, parallel: Any) -> list[int]:
    """The pipeline stages a role's ranks run (``memfit/parallel/pipeline.py: pp_rank``, the
    ``(pp, dp, tp)`` mesh; two per rank, ``pp_rank`` and ``pp_rank + pp``, when interleaved)."""
    if parallel is None or parallel.pp == 1 or not est.ranks:
        return []
    first = est.ranks[0] // (parallel.dp * parallel.tp)
    return [first, first + parallel.pp] if parallel.pp_schedule == "interleaved-1f1b" else [first]


def _role_label(est: Any, parallel: Any = None) -> str:
    from memfit.trace.estimate import ranks_text

    label = ranks_text(est.ranks) if est.ranks else "0"
    stages = _role_stages(est, parallel)
    if stages:
        return f"{label} (stage{'s' if len(stages) > 1 else ''} " + \
            f"{', '.join(map(str, stages))})"
    return label


def _role_dict(est: Any, parallel: Any = None) -> dict[str, Any]:
    return {"ranks": list(est.ranks), "stages": _role_stages(est, parallel),
            "total_bytes": est.total_bytes,
            "peak_bytes": est.peak_bytes, "peak_reserved_bytes": est.peak_reserved_bytes,
            "live_bytes": live_bytes(est),
            "breakdown": {c.value: int(est.breakdown.get(c, 0)) for c in MemoryCategory},
            "allocator_reserve_bytes": int(est.peak_reserved_bytes - est.peak_bytes),
            "host_peak_bytes": int(est.host_peak_bytes),
            "peak": {"op": est.peak_op, "phase": est.peak_phase, "module": est.peak_module,
                     "step": est.peak_step},
            "trace_seconds": est.trace_seconds}


def _backend_name(model: ModelSpec, backend: str) -> str:
    """The builder that made the traced model: ``builtin`` or ``transformers``."""
    if backend != "auto":
        return backend
    from memfit.models.build import transformers_available

    return ("transformers" if isinstance(model, HFModelSpec) or transformers_available()
            else "builtin")


def render_parallel(args: argparse.Namespace, spec: ModelSpec, run: RunConfig,
                    gpu: GpuSpec | None, parallel: Any, est: Any,
                    analytic: MemoryPlan | None, seq: int | None, *,
                    backend: str = "transformers", backend_note: str | None = None) -> None:
    """One row per rank role (its ranks, total, categories, where its peak is), the method and
    engine, the analytic plan's number next to it, and the fit verdict of the worst rank."""
    from memfit.analytic.table import format_params
    from memfit.trace.estimate import TRACE_FITS_MARGIN

    roles = est.per_rank or (est,)
    capacity = gpu.usable_bytes if gpu else None
    headroom = None if capacity is None else capacity - est.total_bytes
    fits = None if headroom is None or capacity is None else (
        headroom >= TRACE_FITS_MARGIN * capacity)
    seconds = sum(r.trace_seconds for r in roles)
    compared = None if analytic is None else comparison(analytic, est)
    engine = engine_words(parallel, run)
    notes = [args.precision_note] if getattr(args, "precision_note", None) else []
    notes += [backend_note] if backend_note else []
    if args.json:
        print_json({
            "method": "trace",
            "model": {"name": spec.name, "params": spec.param_count(), "backend": backend},
            "gpu": None if gpu is None else {"name": gpu.name, "capacity_bytes": capacity,
                                             "capacity_measured": gpu.usable_measured},
            "parallel": {"describe": parallel.describe(), "strategy": parallel.strategy,
                         "gpus": parallel.gpus, "fsdp": parallel.fsdp, "tp": parallel.tp,
                         "pp": parallel.pp, "ep": parallel.ep, "zero": parallel.zero,
                         "sp": parallel.sp, "loss_parallel": parallel.loss_parallel,
                         "pp_schedule": parallel.pp_schedule if parallel.pp > 1 else None,
                         "microbatches": parallel.microbatches,
                         "reshard_after_forward": parallel.reshard_after_forward,
                         "param_dtype": parallel.param_dtype,
                         "reduce_dtype": parallel.reduce_dtype},
            "engine": ("fsdp2" if parallel.strategy in ("fsdp", "hsdp")
                       else "pytorch" if parallel.strategy == "none" else "ddp"),
            "engine_description": engine,
            "per_gpu": {"total_bytes": est.total_bytes,
                        "breakdown": {c.value: int(est.breakdown.get(c, 0))
                                      for c in MemoryCategory},
                        "allocator_reserve_bytes": int(est.peak_reserved_bytes - est.peak_bytes),
                        "ranks": list(est.ranks)},
            "per_rank": [_role_dict(r, parallel) for r in roles],
            "fits": fits, "headroom_bytes": headroom,
            "analytic": compared,
            "trace_seconds": seconds,
            "assumptions": list(est.assumptions),
            "notes": notes,
            "run": {**{k: (list(v) if isinstance(v, tuple) else v)
                       for k, v in dataclasses.asdict(run).items()},
                    "seq": seq},
        })
        return
    from rich import box
    from rich.table import Table

    out = console()
    out.print(f"[bold]{spec.name}[/bold] ({format_params(spec.param_count())} params): each rank "
              f"role traced on meta tensors{f' for {gpu.label}' if gpu else ' for CUDA'} "
              f"{took(args, seconds)}", soft_wrap=True)
    out.print(f"layout: {parallel.describe()}; engine: {engine}", soft_wrap=True)
    for note in notes:
        out.print(note, soft_wrap=True)
    shown = [c for c in COMPARED_CATEGORIES if any(int(r.breakdown.get(c, 0)) for r in roles)]
    unit, scale = _unit(max(r.total_bytes for r in roles))
    table = Table(title=f"Memory per GPU by rank role, {unit} (method: per-rank trace)",
                  title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    cells = [[_role_label(r, parallel), f"{r.total_bytes / scale:.2f}",
              *[f"{int(r.breakdown.get(c, 0)) / scale:.2f}" for c in shown],
              f"{int(r.peak_reserved_bytes - r.peak_bytes) / scale:.2f}", r.peak_phase]
             for r in roles]
    headers = ["ranks", "total", *[_SHORT[c] for c in shown], "reserve", "peak"]
    for i, header in enumerate(headers):
        fixed = i < len(headers) - 1
        # Ranks and numbers never shrink into an ellipsis at a narrow width: "peak" gives way.
        table.add_column(header, justify="right" if 0 < i < len(headers) - 1 else "left",
                         no_wrap=fixed, min_width=max(len(header), *(len(row[i]) for row in cells))
                         if fixed else None)
    for row in cells:
        table.add_row(*row)
    out.print(table)
    out.print(f"peak of the most loaded rank ({_role_label(est, parallel)}): {est.peak_op} in "
              f"{est.peak_module or 'the model'} ({est.peak_phase}, step {est.peak_step}); "
              "reserve: the caching allocator's, beyond live tensors", soft_wrap=True)
    if any(r.host_peak_bytes for r in roles):  # FSDP2's CPUOffloadPolicy: model states on host
        out.print("host memory (offloaded parameters, gradients, optimizer states) per rank: "
                  + ", ".join(f"{_role_label(r, parallel)} {format_bytes(r.host_peak_bytes)}"
                              for r in roles), soft_wrap=True)
    if capacity is not None:
        out.print(f"usable on GPU: {format_bytes(capacity)}")
    if compared is not None and analytic is not None:
        line = (f"formulas ({analytic.engine_label}): {format_bytes(compared['total_bytes'])} "
                f"per GPU, {100 * compared['error']:+.1f}% against the trace's live bytes at "
                f"its peak ({format_bytes(compared['trace_live_bytes'])})")
        if not compared["agrees"]:
            line += f"; more than {100 * AGREEMENT:.0f}% apart: {compared['why']}"
        out.print(line, soft_wrap=True)
    for note in est.assumptions:
        out.print(f"assumed: {note}", soft_wrap=True)
    print_fit_verdict(out, capacity, est.total_bytes, TRACE_FITS_MARGIN, "trace")
