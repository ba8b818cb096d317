"""The guard's predictive defence (see :mod:`memfit.oom_guard`): a micro-batch's predicted peak
(by default :func:`memfit.estimate` of one training step on meta tensors), what the cap it sets
is cached by, and the warning given when even a micro-batch of 1 is predicted over the budget.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memfit._loss import LossFn
from memfit._tensors import tensor_leaves

__all__ = ["BudgetWarning", "Predict", "default_predict"]

Predict = Callable[[Any], int]


class BudgetWarning(UserWarning):
    """Even a micro-batch of 1 is predicted over the guard's budget: the step runs at
    micro-batch 1 and may run out of memory."""


def _signature(batch: Any) -> tuple[Any, ...]:
    """What the predictive cap is cached by: every tensor's shape without the batch dimension,
    and its dtype."""
    return tuple((tuple(t.shape[1:]), t.dtype) for t in tensor_leaves(batch))


def default_predict(model: nn.Module, optimizer: torch.optim.Optimizer,
                    loss_fn: LossFn, device: torch.device) -> Predict:
    """``predict(meta_micro_batch) -> bytes``: :func:`memfit.estimate` of one training step of
    ``loss_fn(model, micro_batch)`` with an optimizer of ``optimizer``'s class and defaults.
    The CUDA prediction counts reserved bytes (the caching allocator's segments)."""
    from memfit.techniques.optim import constructor_settings
    from memfit.trace import estimate

    opt_class = type(optimizer)
    defaults = constructor_settings(optimizer)

    def make_opt(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return opt_class(params, **defaults)

    target = "cuda" if device.type == "cuda" else "cpu"

    def predict(micro: Any) -> int:
        est = estimate(model, micro, optimizer=make_opt, loss_fn=loss_fn, device=target)
        return est.peak_reserved_bytes if target == "cuda" else est.peak_bytes

    return predict
