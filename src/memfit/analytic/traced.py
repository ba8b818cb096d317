"""The analytic plan's run traced: build the model of a :class:`RunConfig` on meta tensors and
trace its recipe (:func:`traced_estimate`, ``memfit plan --method trace``), each rank role of a
layout (:func:`parallel_layout`, :func:`trace_parallel`, ``memfit plan --gpus N``), and how the
formulas compare with the trace (:func:`comparable_run`, :func:`comparison`). The CLI renders
them; the benches import them from here."""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any

from memfit.analytic.config import RunConfig
from memfit.analytic.planner import MemoryPlan
from memfit.categories import MemoryCategory
from memfit.errors import MemfitError
from memfit.gpus import GpuSpec
from memfit.models.hf_auto import HFModelSpec
from memfit.models.spec import TransformerSpec
from memfit.parallel.recipe import trace_precision
from memfit.progress import phase
from memfit.units import format_bytes

__all__ = ["AGREEMENT", "COMPARED_CATEGORIES", "allocator_reserve", "comparable_run", "comparison",
           "disagreement_reason", "live_bytes", "parallel_layout", "per_gpu_breakdown",
           "pipeline_microbatches", "trace_parallel", "trace_precision", "traced_estimate"]

AGREEMENT = 0.05
"""The analytic plan agrees with the trace when within 5% of its live bytes at the peak (issue
14 §2); beyond it the plan prints why (:func:`disagreement_reason`)."""

COMPARED_CATEGORIES = (MemoryCategory.WEIGHTS, MemoryCategory.GRADIENTS,
                       MemoryCategory.OPTIMIZER_STATES, MemoryCategory.ACTIVATIONS,
                       MemoryCategory.TEMPORARIES, MemoryCategory.RUNTIME)


def pipeline_microbatches(run: RunConfig, microbatches: int | None) -> int | None:
    """Micro-batches of a pipeline step: ``--microbatches``, else ``--grad-accum`` when above
    1 (the formulas' micro-batches), else one per stage (``Parallel``'s default, torchtitan's
    minimum for 1F1B); None without pipeline stages."""
    if run.pp == 1:
        return None
    return microbatches or (run.grad_accum if run.grad_accum > 1 else run.pp)


def parallel_layout(run: RunConfig, ep: int = 1, gpus_per_node: int | None = None,
                    fsdp: int | None = None, *, loss_parallel: bool = False,
                    pp_schedule: str | None = None, microbatches: int | None = None) -> Any:
    """The :class:`memfit.Parallel` layout the plan's options name, as PyTorch runs it.

    Training: ``--zero 0`` is DDP over the data-parallel ranks, ``--zero 1`` DDP with
    ``ZeroRedundancyOptimizer``, ``--zero 2`` FSDP2 without resharding after forward, ``--zero
    3`` / ``--fsdp`` FSDP2 ``fully_shard`` (each block, then the root). Under mixed precision
    FSDP2 runs with ``MixedPrecisionPolicy(param_dtype=<16-bit>, reduce_dtype=fp32)``, as
    torchtitan does (fp32 sharded parameters and optimizer states, 16-bit all-gathers and
    compute); DDP and ZeRO-1 run under autocast. ``--offload-params`` is FSDP2's
    ``CPUOffloadPolicy``. ``fsdp``: the ranks that shard (``--fsdp N``; fewer than the
    data-parallel ranks is HSDP). Inference: the ranks of one model replica (``tp x pp``); the other
    data-parallel ranks hold the same. ``--sp`` (``run.sequence_parallel``), ``loss_parallel``,
    ``pp_schedule`` and ``microbatches`` (:func:`pipeline_microbatches`) are ``Parallel``'s own;
    its checks give the one-line errors. With ``ep`` > 1 FSDP2 runs under autocast, without
    ``MixedPrecisionPolicy`` (expert parallelism refuses FSDP2's dtype policies)."""
    from memfit.parallel import Parallel

    base = run.parallel  # the CLI's layout (cli/layout.py: parallel_from_args); args override
    ep, gpus_per_node = (ep if ep > 1 else base.ep), gpus_per_node or base.gpus_per_node
    fsdp = fsdp or (base.fsdp if base.strategy == "hsdp" else None)
    pipeline = {"pp_schedule": pp_schedule or base.pp_schedule,
                "microbatches": pipeline_microbatches(run, microbatches or base.microbatches),
                "pp_split_points": base.pp_split_points}
    tensor = {"sp": run.sequence_parallel, "loss_parallel": loss_parallel or base.loss_parallel,
              "tp_plan": base.tp_plan}
    if not run.training:
        return Parallel(gpus=run.tp * run.pp, tp=run.tp, pp=run.pp, ep=ep, **tensor, **pipeline)
    sharded = run.zero in (2, 3) and run.dp > 1
    mixed = sharded and run.mixed and ep == 1
    per_node = gpus_per_node if gpus_per_node and run.gpus % gpus_per_node == 0 else None
    return Parallel(gpus=run.gpus, gpus_per_node=per_node, tp=run.tp, pp=run.pp, ep=ep,
                    zero=run.zero or None, fsdp=fsdp if fsdp and sharded else 1,
                    param_dtype=run.compute_format if mixed else None,
                    reduce_dtype="fp32" if mixed else None,
                    cpu_offload=run.offload_params and sharded, **tensor, **pipeline)


def comparable_run(run: RunConfig, parallel: Any) -> RunConfig:
    """The analytic plan of the engine the trace ran (under ``--engine auto``: ``fsdp2`` for
    FSDP2 ``fully_shard``, ``ddp`` for DDP and ZeRO-1), so both numbers count one layout."""
    if run.engine != "auto" or not run.training:
        return run
    if parallel.pp > 1:  # the formulas' micro-batches in flight are --grad-accum's
        run = dataclasses.replace(run, grad_accum=parallel.microbatches or parallel.pp)
    if parallel.strategy in ("fsdp", "hsdp") and run.zero == 3:
        return dataclasses.replace(run, engine="fsdp2")
    if parallel.strategy in ("ddp", "zero1", "none") and run.zero in (0, 1):
        return dataclasses.replace(run, engine="ddp")
    return run


def live_bytes(est: Any) -> int:
    """The trace's live bytes at its peak, with the runtime outside the allocator: its total
    less the caching allocator's reserve, which the analytic plan does not model (its fit
    margin covers it)."""
    return int(est.total_bytes - (est.peak_reserved_bytes - est.peak_bytes))


def disagreement_reason(analytic: MemoryPlan, est: Any) -> str:
    """Why the analytic plan and the trace differ by more than :data:`AGREEMENT`, in one line:
    where each puts its peak, and the categories that differ (plan - trace, those over 1% of the
    trace's live bytes). The two known FSDP2 gaps this line used to name (unsharded gradients
    counted at the loss; the root unit gathering the embeddings and the head together) are in
    the formulas now (memfit/analytic/engine_buffers.py: fsdp2_buffers, fsdp_root_params)."""
    live = live_bytes(est)
    deltas = {c: analytic.breakdown.get(c, 0) - int(est.breakdown.get(c, 0))
              for c in COMPARED_CATEGORIES}
    reasons = []
    where = f"{est.peak_op} in {est.peak_module}" if est.peak_module else est.peak_op
    reasons.append(f"peaks: formulas in the {analytic.peak_phase}, trace at {where} "
                   f"({est.peak_phase})")
    big = [f"{c.value} {'+' if d > 0 else '-'}{format_bytes(abs(d))}"
           for c, d in sorted(deltas.items(), key=lambda kv: -abs(kv[1]))
           if abs(d) >= 0.01 * live]
    if big:
        reasons.append("plan - trace: " + ", ".join(big))
    return "; ".join(reasons)


def comparison(analytic: MemoryPlan, est: Any) -> dict[str, Any]:
    """The analytic plan's total against the trace's live bytes at its peak (worst rank)."""
    live = live_bytes(est)
    error = analytic.total_bytes / live - 1 if live else 0.0
    agrees = abs(error) <= AGREEMENT
    return {"total_bytes": analytic.total_bytes, "engine": analytic.run.layout,
            "trace_live_bytes": live, "error": error, "agrees": agrees,
            "why": "" if agrees else disagreement_reason(analytic, est)}


def trace_parallel(spec: TransformerSpec | HFModelSpec, run: RunConfig, gpu: GpuSpec | None,
                   parallel: Any, backend: str = "auto") -> Any:
    """Each rank role of ``parallel`` traced (:func:`traced_estimate`);
    the model's own code failing on this config is said in one line. A pipeline step's batch
    is ``microbatches`` micro-batches of ``--batch`` rows each (the plan's ``--batch`` is the
    micro-batch; ``Parallel`` splits the batch it is given)."""
    if parallel.pp > 1:
        run = dataclasses.replace(run, batch=run.batch * (parallel.microbatches or parallel.pp))
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="memfit: assumed")
            return traced_estimate(spec, run, gpu, parallel=parallel,
                                   precision=trace_precision(run, parallel), backend=backend)
    except (MemfitError, KeyboardInterrupt):
        raise
    except Exception as exc:
        if os.environ.get("MEMFIT_DEBUG"):
            raise
        detail = _first_line(exc)
        cause = exc.__cause__
        if cause is not None:  # e.g. the pipeline's "Failed to run stage backward" wraps it
            detail += f" ({type(cause).__name__}: {_first_line(cause)})"
        raise MemfitError(
            f"tracing {spec.name} over {parallel.describe()} failed: {type(exc).__name__}: "
            f"{detail} (set MEMFIT_DEBUG=1 for the traceback)") from None


def _first_line(exc: BaseException) -> str:
    """The first non-blank line of an exception's message."""
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), "")


def traced_estimate(spec: TransformerSpec | HFModelSpec, run: RunConfig,
                    gpu: GpuSpec | None, parallel: Any = None,
                    precision: str | None = None, backend: str = "auto",
                    device: str = "cuda") -> Any:
    """Build ``spec`` on meta (transformers when installed, else memfit's builtin modules; any
    other model type through transformers' Auto classes) and trace the run's recipe
    (:attr:`RunConfig.recipe`, by :func:`memfit.trace_recipe`: its LoRA, checkpointing and
    offload) for one step on the CUDA target (each rank role of ``parallel``, a
    :class:`memfit.Parallel`, when given; ``precision`` overrides the run's for the trace, e.g.
    fp32 parameters without autocast under FSDP2's MixedPrecisionPolicy, which
    :func:`trace_precision` gives; ``backend``: the :func:`memfit.models.build_model` backend
    of a preset or config.json, ``"builtin"`` for the layouts only memfit's decoders take:
    pipeline, sequence and expert parallelism; ``device="cpu"``: traced for the CPU, as the
    tests compare it with a real CPU step)."""
    from memfit.models.build import build_model, example_inputs
    from memfit.parallel.recipe import trace_recipe

    attn = "eager" if run.attention == "eager" else "sdpa"
    phase("building the model on meta")
    if isinstance(spec, HFModelSpec):
        model = spec.build(device="meta", attn_implementation=None if attn == "sdpa" else attn)
    else:
        model = build_model(spec, device="meta", attn_implementation=attn, backend=backend)
    training = run.mode in ("train", "lora", "qlora")
    if isinstance(spec, HFModelSpec):
        inputs = spec.example_inputs(run.batch, run.seq, device="meta", training=training)
    else:
        seq = None if spec.arch == "vision" else (run.seq or spec.default_seq_len)
        inputs = example_inputs(spec, batch=run.batch, seq=seq, device="meta")
    if not training:
        inputs.pop("labels", None)
    # The model is built with its attention kernels; the layout carries FSDP2's offload; the
    # inference formats are the formulas' (the trace runs the model's own dtypes).
    recipe = dataclasses.replace(
        run.recipe, attention="model", weight_quant="none", kv_cache_dtype=None,
        offload_params=bool(parallel is not None and parallel.cpu_offload), parallel=parallel,
        precision=precision or run.precision)
    phase("tracing one step" if not training else "tracing two steps")
    if device == "cuda" and gpu is not None and gpu.target == "mps":
        device = "mps"  # ROCm traces as "cuda", with its own runtime constants
    return trace_recipe(model, inputs, recipe, device=device, gpu=gpu,
                        steps=2 if training else 1, train=training)


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
