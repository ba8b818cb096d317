"""Plan.apply under pipeline parallelism: this rank's stages of the model, their layout, the
optimizer over their parameters and the schedule's step (:func:`apply_pipeline`, run by
:func:`memfit.apply_recipe` for a layout with ``pp > 1``)."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from memfit import vocab
from memfit.errors import MemfitError
from memfit.fitting.config import FitConfig
from memfit.techniques.recipe import apply_techniques

__all__ = ["PipelineStep", "apply_pipeline", "check_world", "pipeline_refusal"]

log = logging.getLogger("memfit")


def pipeline_refusal(config: FitConfig) -> str | None:
    """Why Plan.apply's pipeline (:func:`apply_pipeline`) cannot run ``config``'s step, or
    None: the schedule's micro-batches are the plan's ``accumulation``."""
    par = config.parallel
    assert par is not None
    n = config.accumulation
    if vocab.precision(config.precision).grad_scaler:
        return (f"{config.precision} under a pipeline: GradScaler's skipped steps would differ "
                "between stages; use bf16-mixed")
    if config.chunked_loss:
        return "the chunked loss under a pipeline: the last stage computes the decoder's loss"
    if par.pp_schedule != "gpipe" and n < par.pp:
        return (f"{par.pp_schedule} needs at least pp={par.pp} micro-batches, the plan has "
                f"accumulation={n}")
    if par.pp_schedule == "interleaved-1f1b" and n % par.pp:
        return f"interleaved-1f1b needs accumulation ({n}) divisible by pp={par.pp}"
    return None

def check_world(config: FitConfig) -> None:
    """Refuse unless torch.distributed runs ``config.parallel.gpus`` ranks (one line, with the
    torchrun command)."""
    par = config.parallel
    assert par is not None
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        raise MemfitError(
            f"the plan runs {par.describe()}: start one process per GPU (torchrun "
            f"--nproc-per-node {par.gpus if par.gpus_per_node is None else par.gpus_per_node}"
            " train.py), call torch.distributed.init_process_group() and then "
            "plan.apply(model) in every rank")
    world = dist.get_world_size()
    if world != par.gpus:
        raise MemfitError(f"the plan was searched for {par.gpus} GPUs but torch.distributed "
                          f"has {world} ranks; re-run memfit fit with --gpus {world}")

# -- pipeline parallelism -------------------------------------------------------------------

class _WeightedStageLoss:
    """The last stage's loss of a micro-batch, weighted as :mod:`memfit.oom_guard` weighs one
    (Note: [mean weights] there): the builtin decoder's mean cross-entropy over the
    micro-batch's labelled tokens times their count, times ``scale`` (``dp / N``, ``N`` the
    labelled tokens of the global batch), so the micro-batches' backwards add up to the global
    batch's mean-loss gradient once FSDP2 averages it over the ``dp`` ranks."""

    def __init__(self) -> None:
        self.scale = 1.0

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from memfit.oom_guard import causal_lm_count
        from memfit.parallel.pipeline import stage_loss

        items = causal_lm_count({"labels": labels})
        if items == 0:  # a mean over no tokens is NaN; it weighs nothing
            return logits.float().sum() * 0.0
        return stage_loss(logits, labels) * (items * self.scale)


class PipelineStep:
    """One optimizer step of a pipeline plan on this rank's batch, run by the plan's schedule
    (``torch.distributed.pipelining``: GPipe, 1F1B or interleaved 1F1B).

    ``step(batch)`` takes the batch of this rank's data-parallel index, a dict with
    ``input_ids`` and ``labels`` (batch, seq), on every rank of that index: every pipeline
    stage and tensor-parallel rank (the first stage reads the ids, the last the labels, every
    rank counts the labelled tokens). The batch is split into the plan's
    ``accumulation`` micro-batches of ``micro_batch`` rows (the schedule's ``n_microbatches``:
    gradient accumulation under a pipeline is the schedule's micro-batches). The loss is the
    builtin decoder's own (next-token cross-entropy, ``-100`` ignored), a mean over the global
    batch's labelled tokens.

    Returns this rank's share of the global batch's mean loss, as the other layouts' steps do
    (:func:`memfit.oom_guard.guard` under torch.distributed), so that an all-reduce SUM of the
    returned values over every rank gives the mean loss: a rank of the last stage returns its
    data-parallel rows' part divided by ``tp``; the other stages hold no loss and return
    ``0.0``. To log the loss, read it on a last-stage rank, or sum the shares.

    Known limitations: no OOM guard (a pipeline's ranks cannot retry one micro-batch alone),
    no GradScaler (fp16-mixed), no custom ``loss_fn``."""

    def __init__(self, modules: list[nn.Module], optimizer: torch.optim.Optimizer,
                 parallel: Any, group: Any, device: torch.device, autocast: Any,
                 submods: list[nn.Module] | None = None) -> None:
        self.modules, self.optimizer, self.parallel = modules, optimizer, parallel
        self.submods = submods  # the stages' DDP wrappers (pp beside DDP / ZeRO-1), or None
        self.group, self.device, self.autocast = group, device, autocast
        self.loss = _WeightedStageLoss()
        self._pipelines: dict[tuple[int, int], Any] = {}
        self.steps = 0
        self.recoveries: list[Any] = []  # as GuardedStep's: a pipeline step never retries

    def _pipeline(self, rows: int, seq: int) -> Any:
        from memfit.parallel.pipeline import build_pipeline

        key = (rows, seq)
        if key not in self._pipelines:  # the stages are given static shapes: one per shape
            self._pipelines[key] = build_pipeline(
                self.modules, self.parallel, rows, seq, device=str(self.device),
                group=self.group, loss_fn=self.loss, scale_grads=False,
                submods=self.submods)
        return self._pipelines[key]

    def __call__(self, batch: Any) -> float:
        from memfit._guard_dist import global_item_count
        from memfit.oom_guard import causal_lm_count

        ids = batch.get("input_ids") if isinstance(batch, dict) else None
        if ids is None or ids.dim() != 2 or not isinstance(batch.get("labels"), torch.Tensor):
            raise MemfitError("a pipeline plan's step takes the batch as a dict with input_ids "
                              "and labels (batch, seq), on every rank of the data-parallel "
                              "index (every stage)")
        par = self.parallel
        rows, seq = int(ids.shape[0]), int(ids.shape[1])
        n = par.microbatches
        if rows % n:
            raise MemfitError(f"the step's batch of {rows} rows does not split into the plan's "
                              f"{n} micro-batches; feed plan.per_rank_batch rows per rank")
        # Every rank counts its data-parallel index's batch: pp * tp copies of each.
        total, _ = global_item_count(causal_lm_count(batch))
        tokens = total // (par.pp * par.tp)
        if tokens <= 0:
            raise MemfitError("the batch contains no labelled tokens to average over (all "
                              "labels -100?); check the labels")
        self.loss.scale = par.dp / tokens
        pipeline = self._pipeline(rows, seq)
        losses: list[torch.Tensor] = []
        self.optimizer.zero_grad(set_to_none=True)
        try:
            # Note: [autocast around the schedule] The schedule runs each stage's forward
            # inside step(), so autocast wraps the whole step; CUDA's backward runs on
            # autograd's device threads, where the (thread-local) autocast state is off.
            with self.autocast():
                pipeline.step({"input_ids": ids.to(self.device),
                               "labels": batch["labels"].to(self.device)}, losses=losses)
            self.optimizer.step()
        finally:
            self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        if not pipeline.last:
            return 0.0
        # The weighted losses add up to (this dp rank's token-loss sum) * dp / N; the tp ranks
        # of the stage hold the same value.
        return float(sum(float(x.detach()) for x in losses)) / (par.dp * par.tp)


def _pipeline_parallel(config: FitConfig, loss_fn: Any, count_fn: Any, reduction: str) -> Any:
    """``config.parallel`` with the schedule's micro-batches = ``config.accumulation``, or a
    one-line error for what Plan.apply does not run under a pipeline."""
    import dataclasses

    from memfit.fitting.layouts import pipeline_runs
    from memfit.oom_guard import causal_lm_count

    par = config.parallel
    assert par is not None
    if par.microbatches is not None and par.microbatches != config.accumulation:
        raise MemfitError(f"the plan's Parallel(microbatches={par.microbatches}) differs from "
                          f"its accumulation={config.accumulation}: under a pipeline they are "
                          "the same micro-batches; make them equal")
    why = None
    if not pipeline_runs(par):
        why = (f"{par.describe()}: a pipeline runs alone, with tp (and FSDP2 over the other "
               "ranks: torchtitan's (pp, dp, tp) mesh), with DDP, ZeRO-1, FSDP2 or HSDP "
               "without tp, and with ep beside DDP (ep = dp) or FSDP2 without tp, or beside "
               "tp (ep a multiple of tp, FSDP2 over dp); use "
               "fsdp = gpus / (pp * tp)")
    elif par.tp > 1 and par.loss_parallel:
        why = "loss parallelism on the last stage; use loss_parallel=False"
    elif loss_fn is not None:
        why = ("a custom loss_fn: the last stage computes the model's own loss (cross-entropy "
               "on the batch's labels); drop loss_fn")
    elif reduction != "mean" or count_fn not in (None, causal_lm_count):
        why = ("reduction='sum' or another count_fn: the last stage's loss is a mean over the "
               "labelled tokens (causal_lm_count); drop them")
    else:
        why = pipeline_refusal(config)
    if why:
        raise MemfitError(f"Plan.apply cannot run this pipeline plan: {why}")
    return dataclasses.replace(par, microbatches=config.accumulation)


def apply_pipeline(model: nn.Module, config: FitConfig, *, loss_fn: Any = None,
                   reduction: str = "mean", count_fn: Any = None
                   ) -> tuple[nn.Module, torch.optim.Optimizer, PipelineStep]:
    """Run ``config``'s pipeline layout (``parallel.pp > 1``) on this rank: the techniques and
    precision on the whole model, then this rank's stages of it
    (:func:`memfit.parallel.pipeline.stage_modules`, torchtitan's manual split, the one the
    per-rank trace and the gloo measurement run), tensor parallelism on each stage and FSDP2
    over the data-parallel ranks
    (:func:`~memfit.parallel.pipeline_parallelize.apply_tp_stages`,
    :func:`~memfit.parallel.pipeline_parallelize.shard_stages`: torchtitan's order), or
    without tp the layout's data parallelism on each stage
    (:func:`~memfit.parallel.pipeline_parallelize.apply_dp_stages`,
    the trace's and the measurement's: FSDP2 / HSDP in place, or a DDP wrapper per stage over
    the stage's data-parallel group, which the schedule runs; torch's pipelining drives its
    ``no_sync``: ``torch/distributed/pipelining/stage.py:
    _PipelineStageBase.backward_maybe_with_nosync`` skips the all-reduce for every micro-batch
    but the last), the optimizer over the stages' parameters (ZeRO-1: a
    ``ZeroRedundancyOptimizer`` over the stage's data-parallel group, as the measurement's), and
    a :class:`PipelineStep`.

    Returns ``(stage, optimizer, step)``: ``stage`` is this rank's
    :class:`~memfit.parallel.pipeline.StageModule` (a ``ModuleList`` of two with the
    interleaved schedule), holding ``model``'s own submodules; the parameters of the other
    stages are freed on this rank (zero elements), as torchtitan's ``pipeline_module_split``
    keeps only a stage's modules."""
    from memfit.parallel.apply import apply_optimizer
    from memfit.parallel.pipeline import check_pipeline, decoder_parts, split_of, stage_modules
    from memfit.parallel.pipeline_parallelize import (
        apply_dp_stages,
        apply_tp_stages,
        pipeline_mesh,
    )
    from memfit.parallel.pipeline_split import check_untied_stages
    from memfit.techniques import apply_precision, make_optimizer

    check_world(config)
    par = _pipeline_parallel(config, loss_fn, count_fn, reduction)
    if split_of(model, par) is None:
        decoder, head = decoder_parts(model)
        if head.weight is decoder.embed_tokens.weight:
            raise MemfitError("Plan.apply cannot run this pipeline plan: the model ties its "
                              "head to its embedding, which sit on the first and the last "
                              "stage; untie them (tie_word_embeddings=False) or use pp=1")
    else:
        check_untied_stages(model, par)
    check_pipeline(model, par, config.micro_batch * config.accumulation)
    device = next(model.parameters()).device
    apply_techniques(model, config)
    mp = apply_precision(model, config.precision if config.precision != "bf16" else "bf16")
    rank = torch.distributed.get_rank()
    modules = stage_modules(model, par, rank)
    held = {id(p) for m in modules for p in m.parameters()}
    with torch.no_grad():
        for p in model.parameters():
            if id(p) not in held:  # another stage's: freed on this rank
                p.data = p.data.new_empty(0)
                p.requires_grad_(False)
    group = dp_group = submods = None
    if par.tp > 1:
        mesh = pipeline_mesh(par, device.type)
        apply_tp_stages(modules, par, mesh)  # TP on each stage, then FSDP2 over dp
        group = mesh["pp"].get_group()
    elif par.dp > 1:  # FSDP2 / HSDP in place, or DDP wrappers (ddp, zero1) the stages run
        mesh = pipeline_mesh(par, device.type)
        submods = apply_dp_stages(modules, par, mesh)
        group = mesh["pp"].get_group()
        if "dp" in (mesh.mesh_dim_names or ()):
            dp_group = mesh["dp"].get_group()
    stage: nn.Module = modules[0] if len(modules) == 1 else nn.ModuleList(modules)
    params = [p for p in stage.parameters() if p.requires_grad]
    optimizer = apply_optimizer(make_optimizer(params, config.optimizer,
                                               offload_states=config.offload_states),
                                par, process_group=dp_group)
    if par.ep > 1:  # Note: [expert gradients] in memfit/fitting/apply.py
        from memfit.fitting.apply import expert_gradients_as_dense

        expert_gradients_as_dense(stage, par, optimizer)
    step = PipelineStep(modules, optimizer, par, group, device, mp.autocast, submods)
    log.info("memfit: applied plan %s (pipeline stage%s %s of rank %d)", config.label(),
             "s" if len(modules) > 1 else "", ", ".join(str(m.index) for m in modules), rank)
    return stage, optimizer, step
