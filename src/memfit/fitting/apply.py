"""Apply a :class:`memfit.Recipe` (a fit plan's config is one) to a real model: the techniques in
the documented order, the layout, the optimizer, then a guarded step (see Note: [composition
order] in :mod:`memfit.techniques`)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memfit._loss import LossFn, check_loss_fn, check_reduction, model_loss
from memfit._tensors import call_model
from memfit.errors import MemfitError
from memfit.fitting.apply_pipeline import (
    PipelineStep,
    apply_pipeline,
    check_world,
    pipeline_refusal,
)
from memfit.fitting.config import FitConfig, sharding_of
from memfit.recipe import Recipe
from memfit.techniques.recipe import FixedModes, apply_techniques

__all__ = ["FixedModes", "LossParallelStep", "PipelineStep", "apply_config", "apply_pipeline",
           "apply_recipe", "as_fit_config", "call_model", "unapplied"]

log = logging.getLogger("memfit")



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
        why = pipeline_refusal(config)
        if why:
            return why
    if config.sharding == "none":
        return None
    if config.offload_states or config.optimizer not in SHARDABLE_OPTIMIZERS:
        what = config.optimizer + ("+offload" if config.offload_states else "")
        return (f"{config.sharding} shards torch's optimizers ({', '.join(SHARDABLE_OPTIMIZERS)})"
                f"; {what} needs whole parameters on one device")
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

def apply_layout(model: nn.Module, config: FitConfig) -> nn.Module:
    """This rank's model under ``config.parallel`` without tensor parallelism (Note: [sharded
    plans]), with the function the per-rank trace runs
    (:func:`memfit.parallel.apply.apply_model`); torch.distributed must be initialised with
    ``parallel.gpus`` ranks."""
    from memfit.parallel.apply import apply_model

    par = config.parallel
    assert par is not None
    check_world(config)
    device = next(model.parameters()).device
    try:
        return apply_model(model, par, device.type)
    except MemfitError as exc:
        if "traced so far" not in str(exc):
            raise
        raise MemfitError(
            f"Plan.apply cannot run {par.describe()} yet: it runs the data-parallel family "
            "(DDP, ZeRO-1, FSDP2, HSDP), tensor parallelism, tp x FSDP / HSDP, ep alone and "
            "beside tp (memfit.parallel.apply.apply_model) and pipelines alone, with tp and with "
            "DDP, "
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
    gradients, on any backend: experts sharded by FSDP2 over the ``dp * tp / ep`` ranks that
    hold them were averaged over those, and are divided by ``ep / tp`` more (the data-parallel
    ranks whose tokens one expert group routes: beside tp, each tp rank routes its share of its
    data-parallel rank's tokens); experts outside DDP / FSDP2 (``ep = dp * tp``, each on one
    rank) by ``dp``. A division of the gradients commutes with the
    GradScaler's unscaling; a gradient clipping placed before the step sees them undivided."""
    from memfit.parallel.expert import moe_layers

    grads: list[tuple[nn.Parameter, float]] = []
    for _, moe in moe_layers(getattr(model, "module", model)):
        sharded = hasattr(moe.experts, "set_gradient_divide_factor")  # an FSDPModule
        factor = float(parallel.ep // parallel.tp if sharded else parallel.dp)
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
    check_world(config)
    if par.pp > 1:
        return apply_layout(model, config)  # raises: not applied yet
    if par.dp > 1 and par.strategy not in ("fsdp", "hsdp"):
        raise MemfitError(f"Plan.apply: {par.describe()} puts {par.strategy} beside tensor "
                          "parallelism, which apply_model (and torchtitan) refuse; use FSDP "
                          f"(fsdp={par.dp}) or HSDP beside tp")
    device = next(model.parameters()).device
    mesh = tp_device_mesh(par, device.type)
    if par.ep > 1:  # the experts first, left out of tensor parallelism
        from memfit.parallel.apply import apply_tp_beside_ep

        apply_tp_beside_ep(model, par, device.type, mesh)
        return mesh
    apply_tp(model, par, mesh["tp"] if mesh.ndim > 1 else mesh)
    return mesh


def apply_fsdp_beside_tp(model: nn.Module, config: FitConfig, mesh: Any) -> nn.Module:
    """FSDP2 over the data-parallel dimensions of ``mesh`` (the second half of
    ``apply_tp_dp``)."""
    from memfit.parallel.apply import apply_fsdp

    par = config.parallel
    assert par is not None
    if par.ep > 1:
        from memfit.parallel.apply import apply_fsdp_beside_ep

        return apply_fsdp_beside_ep(model, par, mesh)
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

def apply_recipe(model: nn.Module, recipe: Recipe, *, loss_fn: LossFn | None = None,
                 reduction: str = "mean", count_fn: Callable[[Any], Any] | None = None,
                 budget_bytes: int | None = None, log_recoveries: bool = True,
                 num_gpus: int = 1) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """Apply ``recipe`` (a :class:`memfit.Recipe`, or a fit plan's
    :class:`~memfit.fitting.FitConfig`) to ``model`` (in place) and return ``(model, optimizer,
    step)`` where ``step = memfit.oom_guard.guard(...)`` runs one optimizer step on a global
    batch, ``recipe.micro_batch`` samples at a time. A multi-GPU ``recipe`` needs
    torch.distributed initialised with its ranks (``num_gpus`` for a legacy ``sharding``
    without a layout); the returned model is then the DDP/FSDP2 one.

    The order (Note: [layout order] below; Note: [composition order] in
    :mod:`memfit.techniques`): tensor parallelism, the model-side techniques
    (:func:`memfit.techniques.recipe.apply_techniques`: attention, chunked loss, checkpointing,
    activation offload), precision, data-parallel sharding, the optimizer, the guard.

    ``loss_fn(model, micro_batch)`` returns the micro-batch's mean loss (``reduction="mean"``,
    default) or the sum of its per-item losses (``reduction="sum"``); ``count_fn`` counts the
    items (see :func:`memfit.oom_guard.guard`). The default is the model's own loss
    (:func:`memfit.trace.default_loss` of its output), a mean.

    >>> model, optimizer, step = apply_recipe(model, Recipe(precision="bf16-mixed",
    ...                                       checkpointing="full", micro_batch=4))
    >>> loss = step(batch)  # doctest: +SKIP
    """
    from memfit.oom_guard import guard
    from memfit.techniques import apply_precision

    config = as_fit_config(recipe)
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


apply_config = apply_recipe
"""The name :func:`apply_recipe` had while only a fit plan's config was applied."""

_UNAPPLIED = (("offload_params", "parameter offload (FSDP2's CPUOffloadPolicy, ZeRO-Infinity: "
               "export the plan)"),
              ("offload_gradients", "gradient offload (export the plan to DeepSpeed)"),
              ("kv_cache_dtype", "a KV-cache format (an inference deployment)"))


def unapplied(recipe: Recipe) -> str | None:
    """What in ``recipe`` :func:`apply_recipe` does not apply to a training step, or None."""
    for name, what in _UNAPPLIED:
        if getattr(recipe, name):
            return f"{name}: {what}"
    if recipe.weight_quant != "none":
        return (f"weight_quant={recipe.weight_quant!r}: weight-only quantization is for "
                "inference (memfit.techniques.quantize_weights on the eval model)")
    if recipe.offload_to != "cpu":
        return f"offload_to={recipe.offload_to!r}: NVMe offload is DeepSpeed's (export the plan)"
    if recipe.engine != "auto":
        return f"engine={recipe.engine!r}: memfit applies PyTorch's own (export the plan)"
    return None


def as_fit_config(recipe: Recipe) -> FitConfig:
    """``recipe`` as the fit plan's config that the functions of this module read (itself if it
    is one; its ``sharding`` the layout's strategy); a one-line MemfitError for what
    :func:`apply_recipe` does not apply."""
    why = unapplied(recipe)
    if why:
        raise MemfitError(f"apply_recipe cannot apply {why}")
    if isinstance(recipe, FitConfig):
        return recipe
    fields = {f.name: getattr(recipe, f.name) for f in dataclasses.fields(Recipe)}
    shard = sharding_of(recipe.parallel) if recipe.parallel is not None else "none"
    return FitConfig(**fields, sharding=shard)


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
