"""Gradient accumulation that yields the gradients of the large batch, not an average of means.

Activation memory scales with the micro-batch, so ``k`` micro-batches of ``B/k`` cut the
activation part of the peak about ``k``-fold, while weights, gradients and optimizer states stay.

Exactness needs two things the usual ``(loss / k).backward()`` gets wrong:

1. Normalisation over the whole batch. A token-level loss averaged per micro-batch weights each
   micro-batch equally, whatever its number of non-ignored tokens; the large batch weights each
   token equally. Here every micro-batch contributes ``sum of its per-item losses / N`` where
   ``N`` counts the items (e.g. non-ignored tokens) of *all* micro-batches, counted before any
   forward pass. ``loss_fn(model, micro_batch)`` returns the micro-batch's mean over its items
   (``reduction="mean"``, default: the sum is that mean times ``count_fn(micro_batch)``, i.e. the
   mean is weighted by the micro-batch's share of the items) or their sum
   (``reduction="sum"``). Then the accumulated gradient is the large-batch gradient up to
   floating-point summation order (the per-micro-batch sums are added into ``.grad`` one after
   another).
2. One gradient all-reduce, not ``k``: under DDP every micro-batch but the last runs inside
   ``model.no_sync()`` (FSDP2: ``set_requires_gradient_sync(False)``). DDP averages gradients over
   ranks, so with ``torch.distributed`` initialised the count is all-reduced and the loss scaled by
   the world size: each rank divides by the global count, and DDP's mean gives the global sum.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit._loss import LossFn, check_loss_fn, check_reduction
from memfit.errors import MemfitError

__all__ = ["AccumulatedStep", "AccumulationResult", "accumulate", "count_tokens", "split_batch",
           "sync_gradients"]

CountFn = Callable[[Any], int | torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class AccumulationResult:
    """What :func:`accumulate` did."""

    loss: torch.Tensor
    """The large batch's mean loss (detached): sum of per-item losses / ``num_items``. Under
    ``torch.distributed`` it is this rank's share (all-reduce-sum it for the global mean)."""
    num_items: int
    """Items (e.g. non-ignored tokens) counted over all micro-batches (and ranks)."""
    micro_batches: int


def count_tokens(labels: torch.Tensor, *, ignore_index: int = -100, shift: bool = False) -> int:
    """Non-ignored label tokens; ``shift=True`` for causal LMs that shift labels inside the model
    (Hugging Face, memfit's builtin decoders: the first label of each row is never predicted).

    >>> count_tokens(torch.tensor([[1, 2, -100], [3, -100, -100]]))
    3
    """
    if shift:
        labels = labels[..., 1:]
    return int((labels != ignore_index).sum().item())


def _batch_size(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, Sequence):
        for item in batch:
            if isinstance(item, torch.Tensor) or isinstance(item, Mapping | Sequence):
                return _batch_size(item)
    raise MemfitError(f"cannot count the items of a micro-batch of type {type(batch).__name__}; "
                      "pass count_fn=... (e.g. lambda b: count_tokens(b['labels']))")


def split_batch(batch: Any, micro_batch_size: int) -> list[Any]:
    """Split a tensor, or a tuple/list/dict of tensors, along dim 0 into micro-batches.

    >>> [t.shape[0] for t in split_batch(torch.zeros(10, 3), 4)]
    [4, 4, 2]
    """
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or \
            micro_batch_size < 1:
        raise MemfitError(f"micro_batch_size must be a positive integer, got {micro_batch_size!r}")
    if isinstance(batch, torch.Tensor):
        return list(batch.split(micro_batch_size))
    if isinstance(batch, Mapping):
        parts = {k: split_batch(v, micro_batch_size) for k, v in batch.items()}
        n = {len(v) for v in parts.values()}
        if len(n) != 1:
            raise MemfitError("the batch's tensors have different first dimensions; every "
                              "tensor of a batch must have the batch size first")
        return [{k: v[i] for k, v in parts.items()} for i in range(n.pop())]
    if isinstance(batch, list | tuple):
        cols = [split_batch(v, micro_batch_size) for v in batch]
        n = {len(c) for c in cols}
        if len(n) != 1:
            raise MemfitError("the batch's tensors have different first dimensions; every "
                              "tensor of a batch must have the batch size first")
        return [type(batch)(c[i] for c in cols) for i in range(n.pop())]
    raise MemfitError(f"cannot split a batch of type {type(batch).__name__}; pass a tensor, or a "
                      "tuple/list/dict of tensors")


@contextlib.contextmanager
def sync_gradients(model: nn.Module, sync: bool) -> Iterator[None]:
    """Skip the gradient all-reduce for this backward when ``sync`` is False (DDP / FSDP2)."""
    if sync:
        yield
        return
    no_sync = getattr(model, "no_sync", None)
    set_sync = getattr(model, "set_requires_gradient_sync", None)
    if callable(no_sync):
        with no_sync():
            yield
    elif callable(set_sync):
        set_sync(False)
        try:
            yield
        finally:
            set_sync(True)
    else:
        yield


def _world() -> tuple[int, bool]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), True
    return 1, False


def accumulate(model: nn.Module, micro_batches: Sequence[Any], loss_fn: LossFn, *,
               count_fn: CountFn | None = None,
               optimizer: torch.optim.Optimizer | None = None,
               reduction: str = "mean") -> AccumulationResult:
    """Forward and backward every micro-batch, accumulating the large batch's exact gradients.

    ``loss_fn(model, micro_batch)`` returns the micro-batch's **mean** loss over its items
    (``reduction="mean"``, default: ``F.cross_entropy(logits, y)``, a Hugging Face ``.loss``) or
    the **sum** of its per-item losses (``reduction="sum"``: ``F.cross_entropy(...,
    reduction="sum")``). ``count_fn(micro_batch)`` counts the items the loss covers (default:
    the first dimension of the micro-batch; for a causal LM's token loss pass ``lambda b:
    count_tokens(b["labels"], shift=True)``). A mean is weighted by the micro-batch's share of
    the items, so either way the gradient is that of the whole batch's mean loss. With
    ``optimizer``, it steps and zeroes the gradients (``set_to_none=True``) after the last
    micro-batch.

    >>> result = accumulate(model, split_batch(batch, 4), lambda m, b: F.mse_loss(m(b[0]), b[1]),
    ...                     optimizer=opt)
    >>> result.loss  # the large batch's mean loss
    """
    check_loss_fn(loss_fn)
    mean = check_reduction(reduction) == "mean"
    batches = list(micro_batches)
    if not batches:
        raise MemfitError("accumulate got no micro-batches; pass e.g. split_batch(batch, 4)")
    counter = count_fn or _batch_size
    counts = [counter(b) for b in batches]
    num_items = sum(int(c) for c in counts)
    world, distributed = _world()
    if distributed:
        total = torch.tensor(num_items, dtype=torch.long)
        if torch.distributed.get_backend() == "nccl":
            total = total.cuda()
        torch.distributed.all_reduce(total)
        num_items = int(total.item())
    if num_items <= 0:
        raise MemfitError("the micro-batches contain no items to average over (all labels "
                          "ignored?); check count_fn and the labels")
    # DDP averages gradients over ranks: multiply by the world size so that the mean of
    # rank-local (sum / global count * world) is the global sum / global count.
    scale = world / num_items
    loss_sum: torch.Tensor | None = None
    for i, batch in enumerate(batches):
        last = i == len(batches) - 1
        # A mean times the micro-batch's items is its sum: both reductions become sum / N.
        items = int(counts[i]) if mean else 1
        if items == 0:
            # A mean over no items is NaN and weighs nothing: skipped, unless this backward is
            # the one that synchronises a distributed model's gradients.
            if last and (hasattr(model, "no_sync") or hasattr(model, "set_requires_gradient_sync")):
                raise MemfitError("the last micro-batch has no items to average over (all "
                                  "labels ignored?); use reduction='sum'")
            continue
        with sync_gradients(model, sync=last):
            loss = loss_fn(model, batch)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise MemfitError(f"loss_fn must return a scalar tensor: the micro-batch's "
                                  f"{'mean loss' if mean else 'sum of per-item losses'} "
                                  f"(reduction={reduction!r})")
            (loss * (scale * items)).backward()
        detached = loss.detach().float() * items
        loss_sum = detached if loss_sum is None else loss_sum + detached
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if loss_sum is None:  # every micro-batch of this rank was empty (other ranks hold the items)
        loss_sum = torch.zeros(())
    return AccumulationResult(loss=loss_sum / num_items, num_items=num_items,
                              micro_batches=len(batches))


class AccumulatedStep(nn.Module):
    """A module whose forward runs one whole accumulation step over a large batch, so that
    :func:`memfit.estimate` can predict the peak of gradient accumulation.

    ``forward(*batch)`` splits the batch into ``micro_batches`` (:func:`split_batch`), runs
    forward + backward of all but the last micro-batch itself (normalised over the whole batch,
    as :func:`accumulate` does) and returns the last micro-batch's normalised loss for the caller
    to backpropagate, so gradients accumulate exactly as in training.

    >>> est = memfit.estimate(AccumulatedStep(model, 4, lambda m, b: crit(m(b[0]), b[1])),
    ...                       (x, y), device="cpu")

    Known limitations: meant for estimation and tests; no ``no_sync`` (a single process).
    """

    def __init__(self, model: nn.Module, micro_batches: int, loss_fn: LossFn, *,
                 count_fn: CountFn | None = None, reduction: str = "mean") -> None:
        super().__init__()
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or \
                micro_batches < 1:
            raise MemfitError(f"micro_batches must be a positive integer, got {micro_batches!r}")
        self.model = model
        self.micro_batches = micro_batches
        self.loss_fn = check_loss_fn(loss_fn)
        self.count_fn = count_fn or _batch_size
        self.mean = check_reduction(reduction) == "mean"

    def forward(self, *batch: Any) -> torch.Tensor:
        whole = batch[0] if len(batch) == 1 else batch
        size = _batch_size(whole)
        if size % self.micro_batches:
            raise MemfitError(f"batch size {size} is not divisible by {self.micro_batches} "
                              "micro-batches; pick a divisor")
        parts = split_batch(whole, size // self.micro_batches)
        counts = [int(self.count_fn(p)) for p in parts]
        weights = [c if self.mean else 1 for c in counts]
        num_items = sum(counts)
        for part, weight in zip(parts[:-1], weights[:-1], strict=True):
            (self.loss_fn(self.model, part) * (weight / num_items)).backward()
        return self.loss_fn(self.model, parts[-1]) * (weights[-1] / num_items)
