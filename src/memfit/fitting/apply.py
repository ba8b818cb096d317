"""Apply a fit configuration to a real model: techniques in the documented order, then a guarded
step (see Note: [composition order] in :mod:`memfit.techniques`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit._loss import LossFn, check_loss_fn, check_reduction, model_loss
from memfit._tensors import call_model
from memfit.errors import MemfitError
from memfit.fitting.config import FitConfig
from memfit.techniques.checkpointing import BlockProfile, Mode, Policy

__all__ = ["FixedModes", "apply_config", "call_model"]

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

    from memfit.techniques.checkpointing import find_blocks

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
            f"Plan.apply cannot run {par.describe()} yet: memfit.parallel.apply.apply_model "
            "applies the data-parallel family (DDP, ZeRO-1, FSDP2, HSDP), tensor parallelism "
            "and tp x FSDP / HSDP; export the plan (plan.export('torchtitan')) or re-run memfit "
            "fit with space={'pp': [1]} (CLI: --pp 1)") from None


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
    base = loss_fn or model_loss

    def loss_under_autocast(m: nn.Module, batch: Any) -> torch.Tensor:
        with mp.autocast():
            return base(m, batch)

    step = guard(model, optimizer, loss_under_autocast, micro_batch_size=config.micro_batch,
                 scaler=mp.scaler, budget_bytes=budget_bytes, reduction=reduction,
                 count_fn=count_fn, log=log_recoveries)
    log.info("memfit: applied plan %s", config.label())
    return model, optimizer, step
