"""Apply a fit configuration to a real model: techniques in the documented order, then a guarded
step (see Note: [composition order] in :mod:`memfit.techniques`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit.errors import MemfitError
from memfit.fit.config import FitConfig
from memfit.techniques.checkpointing import BlockProfile, Mode, Policy

__all__ = ["FixedModes", "apply_config", "call_model", "default_sum_loss"]

log = logging.getLogger("memfit")

SumLossFn = Callable[[nn.Module, Any], torch.Tensor]


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


def call_model(model: nn.Module, batch: Any) -> Any:
    """``model(**batch)`` for a dict, ``model(*batch)`` for a tuple/list, else ``model(batch)``."""
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, list | tuple):
        return model(*batch)
    return model(batch)


def default_sum_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The trace engine's default loss (the model's scalar output, ``.loss``...) times the
    micro-batch's item count: the sum over items when the model's loss is a mean over them."""
    from memfit.techniques.accumulation import _batch_size
    from memfit.trace import default_loss

    return default_loss(call_model(model, batch)) * _batch_size(batch)


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


def apply_config(model: nn.Module, config: FitConfig, *, loss_fn: SumLossFn | None = None,
                 budget_bytes: int | None = None, log_recoveries: bool = True
                 ) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """Apply ``config`` to ``model`` (in place) and return ``(model, optimizer, step)`` where
    ``step = memfit.guard.guard(...)`` runs one optimizer step on a global batch.

    ``loss_fn(model, micro_batch)`` must return the **sum** of per-item losses (the guard
    normalises over the whole batch); the default is the model's own loss times the micro-batch
    size (exact when the model's loss is a mean over the batch's items)."""
    from memfit.guard import guard
    from memfit.techniques import apply_precision, make_optimizer

    if config.sharding != "none":
        raise MemfitError(f"the plan shards ({config.sharding}); applying sharding needs "
                          "torch.distributed: wrap the model with FSDP2 yourself (memfit applies "
                          "single-process plans only)")
    apply_techniques(model, config)
    mp = apply_precision(model, config.precision if config.precision != "bf16" else "bf16")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(params, config.optimizer, offload_states=config.offload_states)
    base = loss_fn or default_sum_loss

    def loss_under_autocast(m: nn.Module, batch: Any) -> torch.Tensor:
        with mp.autocast():
            return base(m, batch)

    step = guard(model, optimizer, loss_under_autocast, micro_batch_size=config.micro_batch,
                 scaler=mp.scaler, budget_bytes=budget_bytes, log=log_recoveries)
    log.info("memfit: applied plan %s", config.label())
    return model, optimizer, step
