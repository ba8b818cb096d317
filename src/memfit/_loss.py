"""The one loss signature of memfit: ``loss_fn(model, batch) -> scalar tensor``.

:func:`memfit.estimate`, :func:`memfit.fit`, :func:`memfit.guard`, ``Plan.apply``,
:func:`memfit.batch_size.find_batch_size` and :func:`memfit.techniques.accumulation.accumulate`
all call ``loss_fn(model, batch)``, as Hugging Face Trainer's ``compute_loss(model, inputs)``
does: the function runs the model itself, so labels can travel in the batch. Where a batch is
split into micro-batches (guard, ``Plan.apply``, fit's measured steps, accumulate), ``reduction``
says whether the returned scalar is the micro-batch's **mean** over its items (default) or their
**sum**; a scalar does not say how it was reduced, so it is never guessed.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from memfit._tensors import call_model, tensor_leaves
from memfit.errors import MemfitError

LossFn = Callable[[nn.Module, Any], torch.Tensor]
REDUCTIONS = ("mean", "sum")

_REWRITE = "loss_fn=lambda model, batch: my_loss(model(batch))"


def check_loss_fn(loss_fn: Any, *, name: str = "loss_fn") -> LossFn | None:
    """``loss_fn`` itself when it takes ``(model, batch)`` (or ``None``); otherwise a one-line
    :class:`MemfitError` showing the rewrite.

    The shape is read from ``inspect.signature``: a callable that cannot be bound to two
    positional arguments (the old ``loss_fn(output)``) is refused, never adapted, because a
    one-argument function could take a model output or a batch and memfit cannot tell which.

    >>> check_loss_fn(lambda out: out.sum())
    Traceback (most recent call last):
    ...
    memfit.errors.MemfitError: loss_fn takes one argument (the old loss_fn(output) shape); ...
    """
    if loss_fn is None:
        return None
    if isinstance(loss_fn, nn.Module):
        raise MemfitError(f"{name} is a loss module ({type(loss_fn).__name__}), which takes "
                          f"(output, target); memfit calls {name}(model, batch): pass e.g. "
                          f"{name}=lambda model, batch: loss(model(batch[0]), batch[1])")
    if not callable(loss_fn):
        raise MemfitError(f"{name} must be a callable (model, batch) -> scalar loss tensor, "
                          f"not {type(loss_fn).__name__}")
    try:
        sig = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # a builtin without a signature: called as it is
        return loss_fn
    try:
        sig.bind(None, None)
    except TypeError:
        try:
            sig.bind(None)
        except TypeError:
            raise MemfitError(f"{name} must take two positional arguments (model, batch), "
                              f"got the signature {sig}; e.g. {_REWRITE}") from None
        raise MemfitError(f"{name} takes one argument (the old loss_fn(output) shape); memfit "
                          f"now calls {name}(model, batch) and your function runs the model: "
                          f"{_REWRITE}") from None
    return loss_fn


def check_reduction(reduction: Any) -> str:
    """``reduction`` itself when it is ``"mean"`` or ``"sum"``, else a one-line error."""
    if reduction not in REDUCTIONS:
        raise MemfitError(f"reduction must be 'mean' (loss_fn returns the micro-batch's mean loss) "
                          f"or 'sum' (the sum of its per-item losses), got {reduction!r}")
    return reduction


def model_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The loss when none is given: the model's own loss on ``batch`` (``model(**batch)`` for a
    dict, ``model(*batch)`` for a tuple, else ``model(batch)``), read from its output by
    :func:`memfit.trace.default_loss` (a scalar output, ``.loss``, or the sum of the output)."""
    return default_loss(call_model(model, batch))


def default_loss(output: Any) -> torch.Tensor:
    """The loss when none is given: a scalar output itself, else ``.loss`` / ``["loss"]`` when
    present, else a scalar first element of a tuple (the ``return_dict=False`` convention), else
    the sum of every floating-point tensor in the output."""
    if isinstance(output, torch.Tensor) and output.numel() == 1:
        return output
    if (isinstance(output, list | tuple) and output and isinstance(output[0], torch.Tensor)
            and output[0].numel() == 1 and output[0].requires_grad):
        return output[0]
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss
    leaves = [t for t in tensor_leaves(output, objects=True)
              if t.is_floating_point() and t.requires_grad]
    if not leaves:
        raise MemfitError("the model output has no floating-point tensor that requires grad to "
                          "backpropagate; pass loss_fn=... or optimizer=None for inference")
    total = leaves[0].sum()
    for t in leaves[1:]:
        total = total + t.sum()
    return total
