"""Apply a fit configuration to a real model: techniques in the documented order, then a guarded
step (see Note: [composition order] in :mod:`memfit.techniques`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit import vocab
from memfit._loss import LossFn, check_loss_fn, check_reduction, model_loss
from memfit._tensors import call_model
from memfit.errors import MemfitError
from memfit.fitting.config import FitConfig
from memfit.techniques.block_profile import BlockProfile, Mode
from memfit.techniques.checkpointing import Policy

__all__ = ["FixedModes", "LossParallelStep", "PipelineStep", "apply_config", "apply_pipeline",
           "call_model"]

log = logging.getLogger("memfit")



@dataclass(frozen=True)
class FixedModes(Policy):
    """Checkpoint exactly the modes the search chose (a ``Budget`` policy resolved once)."""

    modes: tuple[Mode | None, ...]

    def choose(self, blocks: Sequence[str], profile: Callable[[], list[BlockProfile]]
               ) -> list[Mode | None]:
        if len(blocks) != len(self.modes):
            raise MemfitError(f"the plan checkpoints {len(self.modes)} blocks but this model has "
                              f"{len(blocks)}; apply the plan to the model it was made for")
        return list(self.modes)


def checkpoint_policy(config: FitConfig) -> Policy | str | None:
    if config.checkpointing == "none":
        return None
    if config.checkpoint_modes is not None:
        return FixedModes(tuple(config.checkpoint_modes))  # type: ignore[arg-type]
    if config.checkpointing == "budget":
        raise MemfitError("plan config: checkpointing='budget' needs checkpoint_modes (the "
                          "per-block choice the search made); re-run memfit fit")
    return config.checkpointing


def apply_techniques(model: nn.Module, config: FitConfig) -> None:
    """The model-side techniques, in place, in the documented order: attention, chunked loss,
    checkpointing, activation offload."""
    from memfit.techniques import (
        apply_activation_checkpointing,
        apply_activation_offload,
        apply_chunked_loss,
        use_sdpa,
    )

    if config.attention == "sdpa":
        use_sdpa(model)
    if config.chunked_loss:
        apply_chunked_loss(model)
    policy = checkpoint_policy(config)
    if policy is not None:
        apply_activation_checkpointing(model, policy)
    if config.offload_activations:
        apply_activation_offload(model)


# Optimizers that ZeRO can shard: torch's own (ZeroRedundancyOptimizer and FSDP2 run them on
# shards); the 8-bit ones and the host-offloaded one need whole, single-device parameters.
SHARDABLE_OPTIMIZERS = ("adamw", "adam", "sgd", "adafactor")


def check_shardable(config: FitConfig) -> str | None:
    """Why ``config``'s sharding or layout cannot be applied with its optimizer, or None."""
    par = config.parallel
    if par is not None and par.gpus > 1 and (config.offload_states
                                             or config.offload_activations):
        return (f"offload under a multi-GPU layout ({par.describe()}) is FSDP2's "
                "CPUOffloadPolicy, which neither the per-rank trace nor Plan.apply runs yet")
    if par is not None and (par.tp > 1 or par.pp > 1) \
            and config.optimizer not in SHARDABLE_OPTIMIZERS:
        return (f"tensor/pipeline parallelism runs torch's optimizers on DTensor shards "
                f"({', '.join(SHARDABLE_OPTIMIZERS)}); {config.optimizer} needs whole parameters")
    if par is not None and par.pp > 1:
        why = _pipeline_refusal(config)
        if why:
            return why
    if config.sharding == "none":
        return None
    if config.offload_states or config.optimizer not in SHARDABLE_OPTIMIZERS:
        what = config.optimizer + ("+offload" if config.offload_states else "")
        return (f"{config.sharding} shards torch's optimizers ({', '.join(SHARDABLE_OPTIMIZERS)})"
                f"; {what} needs whole parameters on one device")
    return None


def _pipeline_refusal(config: FitConfig) -> str | None:
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


def shard(model: nn.Module, config: FitConfig, num_gpus: int) -> nn.Module:
    """Apply the plan's ZeRO stage with torch.distributed (Note: [sharded plans]): ``zero1``
    wraps the model in DDP (the optimizer is then a ``ZeroRedundancyOptimizer``); ``zero2`` and
    ``zero3`` shard each block and the root with FSDP2's ``fully_shard``, keeping the gathered
    parameters from forward to backward (``reshard_after_forward=False``, FSDP's SHARD_GRAD_OP)
    or freeing them after each block's forward (full sharding)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        raise MemfitError(
            f"the plan shards ({config.sharding}) over {num_gpus} GPUs: start one process per "
            f"GPU (torchrun --nproc-per-node {num_gpus} train.py), call "
            "torch.distributed.init_process_group() and then plan.apply(model) in every rank")
    world = dist.get_world_size()
    if world != num_gpus:
        raise MemfitError(f"the plan was searched for {num_gpus} GPUs but torch.distributed "
                          f"has {world} ranks; re-run memfit fit with --gpus {world}")
    device = next(model.parameters()).device
    if config.sharding == "zero1":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None)
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        raise MemfitError(f"{config.sharding} needs FSDP2 (torch.distributed.fsdp.fully_shard, "
                          "torch >= 2.6); upgrade torch") from None
    from torch.distributed.device_mesh import init_device_mesh

    from memfit.models.anatomy import find_blocks

    mesh = init_device_mesh(device.type, (world,))
    reshard = config.sharding == "zero3"
    for name in find_blocks(model):
        fully_shard(model.get_submodule(name), mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model


def _check_world(config: FitConfig) -> None:
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


def apply_layout(model: nn.Module, config: FitConfig) -> nn.Module:
    """This rank's model under ``config.parallel`` without tensor parallelism (Note: [sharded
    plans]), with the function the per-rank trace runs
    (:func:`memfit.parallel.apply.apply_model`); torch.distributed must be initialised with
    ``parallel.gpus`` ranks."""
    from memfit.parallel.apply import apply_model

    par = config.parallel
    assert par is not None
    _check_world(config)
    device = next(model.parameters()).device
    try:
        return apply_model(model, par, device.type)
    except MemfitError as exc:
        if "traced so far" not in str(exc):
            raise
        raise MemfitError(
            f"Plan.apply cannot run {par.describe()} yet: it runs the data-parallel family "
            "(DDP, ZeRO-1, FSDP2, HSDP), tensor parallelism, tp x FSDP / HSDP, ep without tp "
            "(memfit.parallel.apply.apply_model) and pipelines alone, with tp and with DDP, "
            "ZeRO-1 or FSDP2 (apply_pipeline); export the plan (memfit export plan.json "
            "--to torchtitan) or choose one of these layouts") from None


def expert_gradients_as_dense(model: nn.Module, parallel: Any,
                              optimizer: torch.optim.Optimizer) -> None:
    """Divide the expert gradients of an expert-parallel ``model`` as the dense ones are, before
    each ``optimizer`` step (a step pre-hook).

    Note: [expert gradients] Each rank's loss is scaled for an average over the ``dp``
    data-parallel ranks (the guard's ``world / items``, :mod:`memfit.oom_guard`), and the dense
    gradients are averaged over them (DDP, FSDP2). An expert's gradient holds every token routed
    to it from its whole expert group (the backward's reverse all-to-all brings them home), so
    it must be divided by ``dp`` in all, not by the ranks that hold the same expert: torchtitan
    sets the experts' FSDP2 divide factor to the data-parallel degree ("the gradient division
    factor should be consistent with data parallelism": ``torchtitan/models/llama4/infra/
    parallelize.py: apply_fsdp``, ``moe.experts.set_gradient_divide_factor``). That factor
    reduce-scatters with ``ReduceOp.PREMUL_SUM``, which gloo refuses ("Cannot use
    ReduceOp.PREMUL_SUM with Gloo"), so the same division is done here on the reduced
    gradients, on any backend: experts sharded by FSDP2 over the ``dp / ep`` ranks that hold
    them were averaged over those, and are divided by ``ep`` more; experts outside DDP / FSDP2
    (``ep = dp``, each on one rank) by ``dp``. A division of the gradients commutes with the
    GradScaler's unscaling; a gradient clipping placed before the step sees them undivided."""
    from memfit.parallel.expert import moe_layers

    grads: list[tuple[nn.Parameter, float]] = []
    for _, moe in moe_layers(getattr(model, "module", model)):
        sharded = hasattr(moe.experts, "set_gradient_divide_factor")  # an FSDPModule
        factor = float(parallel.ep if sharded else parallel.dp)
        grads += [(p, factor) for p in moe.experts.parameters() if p.requires_grad]

    def divide(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
        with torch.no_grad():
            for p, factor in grads:
                if p.grad is not None:
                    p.grad.div_(factor)

    optimizer.register_step_pre_hook(divide)


def apply_tensor_parallel(model: nn.Module, config: FitConfig) -> Any:
    """Tensor parallelism of ``config.parallel`` (tp > 1, no pipeline), in place: ``apply_tp``
    on the tp dimension of ``tp_device_mesh`` (the first half of ``apply_tp_dp``); returns the
    mesh, whose data-parallel dimensions :func:`apply_fsdp_beside_tp` shards over."""
    from memfit.parallel.apply import apply_tp, tp_device_mesh

    par = config.parallel
    assert par is not None
    _check_world(config)
    if par.pp > 1 or par.ep > 1:
        return apply_layout(model, config)  # raises: not applied yet
    if par.dp > 1 and par.strategy not in ("fsdp", "hsdp"):
        raise MemfitError(f"Plan.apply: {par.describe()} puts {par.strategy} beside tensor "
                          "parallelism, which apply_model (and torchtitan) refuse; use FSDP "
                          f"(fsdp={par.dp}) or HSDP beside tp")
    device = next(model.parameters()).device
    mesh = tp_device_mesh(par, device.type)
    apply_tp(model, par, mesh["tp"] if mesh.ndim > 1 else mesh)
    return mesh


def apply_fsdp_beside_tp(model: nn.Module, config: FitConfig, mesh: Any) -> nn.Module:
    """FSDP2 over the data-parallel dimensions of ``mesh`` (the second half of
    ``apply_tp_dp``)."""
    from memfit.parallel.apply import apply_fsdp

    par = config.parallel
    assert par is not None
    return apply_fsdp(model, par, mesh["replicate", "shard"] if par.strategy == "hsdp"
                      else mesh["dp"])


def _optimizer(model: nn.Module, config: FitConfig) -> torch.optim.Optimizer:
    from memfit.techniques import make_optimizer

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(params, config.optimizer, offload_states=config.offload_states)
    if config.parallel is not None:
        from memfit.parallel.apply import apply_optimizer

        return apply_optimizer(optimizer, config.parallel)
    if config.sharding != "zero1":
        return optimizer
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from memfit.techniques.optim import constructor_settings

    # The same optimizer class and settings, each rank holding the states of its share.
    return ZeroRedundancyOptimizer(  # type: ignore[return-value]
        params, optimizer_class=type(optimizer), **constructor_settings(optimizer))


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

    from memfit.oom_guard import causal_lm_count

    par = config.parallel
    assert par is not None
    if par.microbatches is not None and par.microbatches != config.accumulation:
        raise MemfitError(f"the plan's Parallel(microbatches={par.microbatches}) differs from "
                          f"its accumulation={config.accumulation}: under a pipeline they are "
                          "the same micro-batches; make them equal")
    why = None
    if par.ep > 1 or par.strategy == "hsdp" or (par.tp > 1 and par.strategy != "fsdp"
                                                 and par.dp > 1):
        why = (f"{par.describe()}: a pipeline runs alone, with tp (and FSDP2 over the other "
               "ranks: torchtitan's (pp, dp, tp) mesh) and with DDP, ZeRO-1 or FSDP2 without "
               "tp; use fsdp = gpus / (pp * tp)")
    elif par.tp > 1 and par.loss_parallel:
        why = "loss parallelism on the last stage; use loss_parallel=False"
    elif loss_fn is not None:
        why = ("a custom loss_fn: the last stage computes the model's own loss (cross-entropy "
               "on the batch's labels); drop loss_fn")
    elif reduction != "mean" or count_fn not in (None, causal_lm_count):
        why = ("reduction='sum' or another count_fn: the last stage's loss is a mean over the "
               "labelled tokens (causal_lm_count); drop them")
    else:
        why = _pipeline_refusal(config)
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
    over the data-parallel ranks (:func:`~memfit.parallel.pipeline.apply_tp_stages`,
    :func:`~memfit.parallel.pipeline.shard_stages`: torchtitan's order), or without tp the
    layout's data parallelism on each stage (:func:`~memfit.parallel.pipeline.apply_dp_stages`,
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
    from memfit.parallel.pipeline import check_pipeline, decoder_parts, stage_modules
    from memfit.parallel.pipeline_parallelize import (
        apply_dp_stages,
        apply_tp_stages,
        pipeline_mesh,
    )
    from memfit.techniques import apply_precision, make_optimizer

    _check_world(config)
    par = _pipeline_parallel(config, loss_fn, count_fn, reduction)
    decoder, head = decoder_parts(model)
    if head.weight is decoder.embed_tokens.weight:
        raise MemfitError("Plan.apply cannot run this pipeline plan: the model ties its head "
                          "to its embedding, which sit on the first and the last stage; untie "
                          "them (tie_word_embeddings=False) or use pp=1")
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
    step = PipelineStep(modules, optimizer, par, group, device, mp.autocast, submods)
    log.info("memfit: applied plan %s (pipeline stage%s %s of rank %d)", config.label(),
             "s" if len(modules) > 1 else "", ", ".join(str(m.index) for m in modules), rank)
    return stage, optimizer, step


def apply_config(model: nn.Module, config: FitConfig, *, loss_fn: LossFn | None = None,
                 reduction: str = "mean", count_fn: Callable[[Any], Any] | None = None,
                 budget_bytes: int | None = None, log_recoveries: bool = True,
                 num_gpus: int = 1) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """Apply ``config`` to ``model`` (in place) and return ``(model, optimizer, step)`` where
    ``step = memfit.oom_guard.guard(...)`` runs one optimizer step on a global batch. A sharded
    ``config`` needs torch.distributed initialised with ``num_gpus`` ranks (see :func:`shard`);
    the returned model is then the DDP/FSDP2 one.

    ``loss_fn(model, micro_batch)`` returns the micro-batch's mean loss (``reduction="mean"``,
    default) or the sum of its per-item losses (``reduction="sum"``); ``count_fn`` counts the
    items (see :func:`memfit.oom_guard.guard`). The default is the model's own loss
    (:func:`memfit.trace.default_loss` of its output), a mean."""
    from memfit.oom_guard import guard
    from memfit.techniques import apply_precision

    check_loss_fn(loss_fn)
    check_reduction(reduction)

    why = check_shardable(config)
    if why:
        raise MemfitError(f"cannot apply this plan: {why}; re-run memfit fit")
    par = config.parallel
    multi = par is not None and par.gpus > 1
    if multi and par is not None and par.pp > 1:
        return apply_pipeline(model, config, loss_fn=loss_fn, reduction=reduction,
                              count_fn=count_fn)
    # Note: [layout order] Tensor parallelism first, on the plain blocks (parallelize_module
    # finds the projections by name), then the techniques (checkpointing wraps the blocks), then
    # precision, then data-parallel sharding (FSDP2 after checkpointing: torchtitan's order in
    # parallelize_llama: TP, activation checkpointing, compile, FSDP).
    tp_first = multi and par is not None and par.tp > 1
    mesh = apply_tensor_parallel(model, config) if tp_first else None
    apply_techniques(model, config)
    mp = apply_precision(model, config.precision if config.precision != "bf16" else "bf16")
    if multi and not tp_first:
        model = apply_layout(model, config)
    elif tp_first and par is not None and par.dp > 1:
        model = apply_fsdp_beside_tp(model, config, mesh)
    elif par is None and config.sharding != "none":
        model = shard(model, config, num_gpus)
    optimizer = _optimizer(model, config)
    if multi and par is not None and par.ep > 1:
        expert_gradients_as_dense(model, par, optimizer)
    base = loss_fn or model_loss

    def loss_under_autocast(m: nn.Module, batch: Any) -> torch.Tensor:
        with mp.autocast():
            return base(m, batch)

    step: Any = guard(model, optimizer, loss_under_autocast,
                      micro_batch_size=config.micro_batch, scaler=mp.scaler,
                      budget_bytes=budget_bytes, reduction=reduction, count_fn=count_fn,
                      log=log_recoveries)
    if multi and par is not None and par.loss_parallel:
        step = LossParallelStep(step, par)
    log.info("memfit: applied plan %s", config.label())
    return model, optimizer, step


class LossParallelStep:
    """A guarded step run inside torch's ``loss_parallel()`` (a layout with
    ``loss_parallel=True``): the head's logits stay a vocabulary-split DTensor
    (``memfit/parallel/apply.py: tp_plan``, Note: [loss parallelism]) and the model's own
    cross-entropy runs on the shards. ``torch/distributed/tensor/parallel/loss.py:
    loss_parallel``: "The corresponding backward() call, if any, also needs to happen under this
    context manager"; torchtitan enters it around its whole forward-backward
    (``torchtitan/distributed/utils.py: get_train_context``, ``enable_loss_parallel``), and so
    does this step around the guard's micro-batches and their backwards (the optimizer's
    step inside it is unchanged: the context only swaps the softmax / nll kernels on DTensors).
    Every other attribute is the guarded step's."""

    def __init__(self, step: Any, parallel: Any) -> None:
        self.step, self.parallel = step, parallel

    def __call__(self, batch: Any) -> float:
        from memfit.parallel.apply import loss_context

        with loss_context(self.parallel):
            return self.step(batch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.step, name)
