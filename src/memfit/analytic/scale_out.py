"""Scale-out: the fewest GPUs that hold a step that does not fit, or why no count does.

Training adds data-parallel ranks (a bisection: per-GPU bytes never grow with the ranks);
inference splits the model with tensor parallelism within a node, then pipeline stages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memfit.analytic.config import RunConfig
from memfit.analytic.planner import FITS_MARGIN, GPUS_PER_NODE, MemoryPlan, plan
from memfit.errors import MemfitError
from memfit.gpus import GpuSpec
from memfit.models.spec import ModelSpec, TransformerSpec
from memfit.units import format_bytes

MAX_GPUS = 4096
"""The largest GPU count :func:`gpus_needed` tries."""


@dataclass(frozen=True, kw_only=True)
class ScaleOut:
    """The fewest GPUs that hold a step that does not fit on the planned count."""

    plan: MemoryPlan
    """The plan on ``plan.run.parallel.gpus`` GPUs; it fits with :data:`FITS_MARGIN`."""
    strategy: str
    """How the GPUs split the work, in words (e.g. ``ZeRO-3 / FSDP``)."""
    gpus_per_node: int

    @property
    def gpus(self) -> int:
        return self.plan.run.parallel.gpus

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.gpus_per_node)

    @property
    def host_bytes_per_node(self) -> int:
        """Host memory of one full node for what the plan offloads: the per-GPU offloaded
        states times the GPUs on the node."""
        return self.plan.host_bytes * min(self.gpus, self.gpus_per_node)

    @property
    def flags(self) -> str:
        """The CLI options that give this plan."""
        r = self.plan.run
        out = [f"--gpus {r.gpus}"]
        if r.zero:
            out.append(f"--zero {r.zero}")
        if r.tp > 1:
            out.append(f"--tp {r.tp}")
        if r.pp > 1:
            out.append(f"--pp {r.pp}")
        return " ".join(out)

    def to_dict(self) -> dict[str, Any]:
        r = self.plan.run
        return {"gpus": r.gpus, "zero": r.zero, "tp": r.tp, "pp": r.pp, "flags": self.flags,
                "strategy": self.strategy, "per_gpu_total_bytes": self.plan.total_bytes,
                "headroom_bytes": self.plan.headroom_bytes, "gpus_per_node": self.gpus_per_node,
                "nodes": self.nodes, "host_bytes_per_gpu": self.plan.host_bytes,
                "host_bytes_per_node": self.host_bytes_per_node}


def _widest_zero(run: RunConfig) -> int:
    """The most sharding the run's engine offers when adding data-parallel ranks: ZeRO-3 (FSDP,
    DeepSpeed), the distributed optimizer (Megatron) or ZeroRedundancyOptimizer (DDP)."""
    return 1 if run.engine in ("megatron", "ddp") else 3


def _fits(model: ModelSpec, run: RunConfig, gpu: GpuSpec) -> MemoryPlan | None:
    try:
        p = plan(model, run, gpu)
    except MemfitError:
        return None  # e.g. a tp that does not divide the heads
    return p if p.fits else None


def gpus_needed(p: MemoryPlan, *, gpus_per_node: int = GPUS_PER_NODE,
                max_gpus: int = MAX_GPUS) -> ScaleOut | None:
    """The fewest GPUs on which ``p``'s step fits with :data:`FITS_MARGIN`, or None when none up
    to ``max_gpus`` does (or no GPU is named).

    Training keeps the given tensor and pipeline sizes and adds data-parallel ranks with the
    given ZeRO stage, ZeRO-3 / FSDP when none is given: the sharded model states shrink with
    the ranks, the activations of a micro-batch do not (ZeRO paper, Fig. 1). The per-GPU bytes
    never grow with the ranks, so a bisection finds the fewest. Inference splits the model with
    tensor parallelism within a node (a tp that divides the heads), then pipeline stages.

    >>> from memfit.gpus import get_gpu
    >>> from memfit.models import get_preset
    >>> one = plan(get_preset("llama-3-8b"), RunConfig(checkpointing="full"), get_gpu("a100-40gb"))
    >>> one.fits, gpus_needed(one).strategy
    (False, 'ZeRO-3 / FSDP')
    """
    if p.gpu is None or gpus_per_node < 1:
        return None
    model, run, gpu = p.model, p.run, p.gpu
    if run.training:
        zero = run.zero or _widest_zero(run)
        step = run.parallel.tp * run.parallel.pp

        def at(dp: int) -> MemoryPlan | None:
            return _fits(model, run.relayout(gpus=dp * step, zero=zero), gpu)

        lo, hi = run.parallel.dp + 1, max_gpus // step
        if hi < lo or at(hi) is None:
            return None
        while lo < hi:  # the fewest data-parallel ranks that fit
            mid = (lo + hi) // 2
            if at(mid) is None:
                lo = mid + 1
            else:
                hi = mid
        found = at(lo)
        assert found is not None
        strategy = {1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3 / FSDP"}[zero]
        if run.engine == "megatron":
            strategy = "Megatron distributed optimizer"
        if step > 1:
            strategy += f" with tp {run.parallel.tp} x pp {run.parallel.pp}"
        return ScaleOut(plan=found, strategy=strategy, gpus_per_node=gpus_per_node)
    heads = model.num_heads if isinstance(model, TransformerSpec) else 1
    layers = model.num_layers if isinstance(model, TransformerSpec) else 1
    tps = [t for t in range(1, min(heads, gpus_per_node) + 1) if heads % t == 0]
    options = sorted((t * pp, pp, t) for t in tps for pp in range(1, layers + 1)
                      if run.parallel.gpus < t * pp <= max_gpus)
    for _, pp, t in options:
        found = _fits(model, run.relayout(gpus=t * pp, tp=t, pp=pp), gpu)
        if found is not None:
            strategy = " x ".join(([f"tensor parallel {t}"] if t > 1 else [])
                                  + ([f"{pp} pipeline stages"] if pp > 1 else []))
            return ScaleOut(plan=found, strategy=strategy, gpus_per_node=gpus_per_node)
    return None


def unshrinkable(p: MemoryPlan) -> MemoryPlan:
    """``p``'s step with so many data-parallel ranks (one per parameter, and the ZeRO stage
    :func:`gpus_needed` adds ranks with) that every sharded state is down to a few bytes: the
    per-GPU bytes no number of GPUs removes (one micro-batch's activations and temporaries, the
    runtime, what the ZeRO stage does not shard)."""
    run = p.run
    step = run.parallel.tp * run.parallel.pp
    ranks = max(p.model.param_count(), MAX_GPUS)
    return plan(p.model, run.relayout(gpus=ranks * step, zero=run.zero or _widest_zero(run)),
                p.gpu)


def scale_out_line(p: MemoryPlan, scale: ScaleOut | None, *,
                   gpus_per_node: int = GPUS_PER_NODE) -> str:
    """The line ``memfit plan`` prints when ``p`` does not fit: how many GPUs it needs, or why
    no count up to :data:`MAX_GPUS` will do: what does not shrink with more GPUs is over the
    GPU's budget (:func:`unshrinkable`), or the sharded states still are at that count."""
    if scale is None:
        if p.run.training:
            zero = p.run.zero or _widest_zero(p.run)
            step = p.run.parallel.tp * p.run.parallel.pp
            # the largest count searched (or the one planned, past it): per-GPU bytes never grow
            # with the ranks, so none below it holds the step either
            top = max(MAX_GPUS // step * step, p.run.parallel.gpus)
            widest = plan(p.model, p.run.relayout(gpus=top, zero=zero), p.gpu)
            floor = unshrinkable(p)
            head = f"no number of GPUs up to {top} holds this step with ZeRO-{zero}"
            if zero < 3:
                head += f" ({widest.engine_label})"
            unknown = ("" if p.activations_known else
                       " (activations not counted: only the parameter count is given)")
            if floor.fits:  # what is left at MAX_GPUS is sharded: more GPUs would shrink it
                return (f"{head}: each of {top} GPUs still needs "
                        f"{format_bytes(widest.total_bytes)}, all but "
                        f"{format_bytes(floor.total_bytes)} of it sharded states, which more "
                        f"GPUs shrink{unknown}; plan a larger --gpus, or fewer bytes per "
                        "parameter (--offload-optimizer, --optimizer adamw-8bit)")
            budget = (p.capacity_bytes or 0) - int(FITS_MARGIN * (p.capacity_bytes or 0))
            # the sharded states are down to a few bytes each: name the parts of a MiB or more
            parts = ", ".join(f"{c.value} {format_bytes(b)}" for c, b in floor.breakdown.items()
                              if b >= 2**20)
            fix = ("try --tp, --pp or an engine that shards parameters (--engine fsdp2)"
                   if zero < 3 else "try --checkpointing full, a smaller --batch, or --tp")
            return (f"{head}: what more GPUs do not shrink is {format_bytes(floor.total_bytes)} "
                    f"per GPU ({parts}){unknown}, over the {format_bytes(budget)} the fit "
                    f"margin leaves; {fix}")
        return (f"no tensor/pipeline split up to {MAX_GPUS} GPUs holds this step; try --quant, "
                "--kv-cache-dtype or a smaller --batch")
    q = scale.plan
    line = (f"this needs {scale.gpus} GPUs ({scale.strategy}: {scale.flags}), "
            f"{format_bytes(q.total_bytes)} per GPU, {format_bytes(q.headroom_bytes)} headroom")
    if scale.gpus > gpus_per_node:
        line += f"; {scale.nodes} nodes of {gpus_per_node} GPUs"
    if q.host_bytes:
        # Note: the per-GPU share is of this count of GPUs, not of the plan above it.
        line += (f"; host memory for offloaded states on {scale.gpus} GPUs: "
                 f"{format_bytes(q.host_bytes)} per GPU, "
                 f"{format_bytes(scale.host_bytes_per_node)} per node of "
                 f"{min(scale.gpus, gpus_per_node)} GPUs")
    return line
