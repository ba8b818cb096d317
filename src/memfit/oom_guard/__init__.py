"""An OOM guard for training steps: split the micro-batch before or after running out of memory.

>>> step = memfit.guard(model, optimizer, lambda m, b: F.cross_entropy(m(b[0]), b[1]),
...                      micro_batch_size=32, budget_bytes=8 * 2**30)
>>> for batch in loader:
...     loss = step(batch)            # fwd/bwd over micro-batches, optimizer step, zero_grad

``loss_fn(model, micro_batch)`` returns a scalar loss, reduced as ``reduction`` says, so that the
accumulated gradient is the whole batch's gradient whatever the micro-batch size:

- ``reduction="mean"`` (default): the loss is the **mean** over the micro-batch's items
  (``F.cross_entropy(logits, y)``, a Hugging Face model's ``.loss``). Each micro-batch's loss is
  weighted by its share of the batch's items, ``count_fn(micro) / count_fn(batch)``, so the
  gradient and the returned loss are those of the full batch's mean loss. ``count_fn`` must
  count the items the loss averages over; the default counts rows (the batch dimension), exact
  for per-sample losses. A Hugging Face causal LM's ``.loss`` averages over *tokens* whose
  shifted label is not -100: pass ``count_fn=causal_lm_count`` (``from memfit.oom_guard import
  causal_lm_count``). A dict batch with 2-D ``labels`` and no ``count_fn`` is refused: counting
  rows would weight padded micro-batches wrongly, and the guard cannot tell which tokens the
  model's loss counts. A micro-batch with no items (all labels ignored) is skipped.
- ``reduction="sum"``: the loss is the **sum** of per-item losses
  (``F.cross_entropy(..., reduction="sum")``), the contract of
  :func:`memfit.techniques.accumulation.accumulate`; each micro-batch's sum is divided by the
  batch's item count (``count_fn``).

The guard cannot see how a returned scalar was reduced, so ``reduction`` is never inferred.
Put ``torch.autocast`` inside ``loss_fn`` for mixed precision; with ``scaler`` (a
``torch.amp.GradScaler``) the losses are scaled before backward and the optimizer steps through
``scaler.step`` / ``scaler.update``.

Two defences, both keeping the effective batch:

- **Predictive**: with a budget (``budget_bytes``, or on CUDA the device's free memory plus what
  PyTorch's allocator already reserved), a batch whose micro-batch shapes were not seen yet is
  first predicted (``predict``; default :func:`memfit.estimate` of a training step of one
  micro-batch on meta tensors, cached by shape) and its micro-batch halved until it is predicted
  to fit. This cap holds for that shape only: short sequences keep the large micro-batch. When
  even a micro-batch of 1 is predicted over the budget, the guard still runs at micro-batch 1
  (the least memory it can give; recovery stays behind it) and says so once, with a
  :class:`BudgetWarning`: refusing would stop a run the prediction may overrate, and a run
  that must not continue turns it into an error (``warnings.simplefilter("error",
  BudgetWarning)``).
- **Recovery**: on ``torch.OutOfMemoryError`` during a forward or backward, the attempt's
  gradients are dropped (``.grad = None``: nothing is counted twice), normalisation buffers
  (BatchNorm running statistics) and the RNG are restored to their state at the start of the
  step, memory is released (``gc.collect()``, ``torch.cuda.empty_cache()``), the micro-batch is
  halved and the *same* batch is run again from its first sample. The optimizer and the loss
  scaler only act once the whole batch succeeded: no sample is skipped, no step doubled or lost,
  no ``scaler.update()`` for a failed attempt. At micro-batch 1 the guard gives up with a
  ``torch.OutOfMemoryError`` saying so. Any other exception propagates untouched (after dropping
  the partial gradients and restoring the RNG and normalisation buffers), leaving weights and
  optimizer as they were.

Note: [exactness] A retried batch's weights equal those of an uninterrupted run that used the
micro-batch size the retry ended with, bit for bit: the retry starts from ``.grad = None``, the
same RNG state and the same normalisation buffers. Compared with the original micro-batch size
they agree only to floating-point summation order (a matmul over 8 rows and two over 4 rows
added together round differently): a few fp32 ulps per step (tests use rtol=1e-5).

Known limitations: an OOM inside ``optimizer.step()`` is not retried (the step may have updated
part of the weights and states; splitting the micro-batch would not reduce its memory anyway):
it is re-raised as ``torch.OutOfMemoryError`` naming the optimizer. Buffers other than
normalisation statistics are not restored. Under FSDP with several ranks an OOM is not retried
(each block's forward and backward all-gather its parameters, so one rank cannot rerun a batch
alone): it is re-raised saying so, and only the predictive defence splits batches there.

Note: [OOM agreement under DDP] With a ``DistributedDataParallel`` model, an OOM on one rank must
not leave the others blocked in a gradient all-reduce it never joins. So the ranks agree on the
micro-batch size at the start of each batch (the smallest any rank wants), run every micro-batch
under ``no_sync``, and then agree on the outcome (one small all-reduce): if any rank ran out of
memory, every rank drops its gradients, restores its state and retries the same batch at half
the micro-batch; if any rank raised another error, the others raise too instead of waiting.
Once all succeeded, the gradients are all-reduced in one flat buffer per dtype and averaged, as
DDP would (DDP's communication hooks are bypassed, and the all-reduce no longer overlaps the
backward). Parameters without a gradient on a rank contribute zeros. DDP's buffer broadcast
(``broadcast_buffers``) is done by the guard before each batch, where every rank reaches it.
The collectives live in :mod:`memfit._guard_dist` (:class:`~memfit._guard_dist.RankAgreement`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from memfit._loss import LossFn
from memfit.oom_guard.budget import BudgetWarning, Predict
from memfit.oom_guard.step import CountFn, GuardedStep, Recovery, causal_lm_count

__all__ = ["BudgetWarning", "GuardedStep", "Recovery", "causal_lm_count", "guard"]


def guard(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn, *,
          micro_batch_size: int | None = None, scaler: Any = None,
          budget_bytes: int | None = None, predict: Predict | None = None,
          count_fn: CountFn | None = None, reduction: str = "mean",
          grow_after: int | None = None, log: bool = True) -> GuardedStep:
    """Wrap a training step so that running out of memory splits the micro-batch instead of
    crashing (see :mod:`memfit.oom_guard`).

    ``loss_fn(model, micro_batch) -> scalar loss``: with ``reduction="mean"`` (default) the
    micro-batch's mean over its items, weighted by ``count_fn(micro) / count_fn(batch)``; with
    ``reduction="sum"`` the sum of its per-item losses, divided by ``count_fn(batch)``. Either
    way the step's gradient is the whole batch's mean-loss gradient. ``count_fn(micro_batch)``
    counts the items (default: the batch dimension; a Hugging Face causal LM's ``.loss``
    averages over tokens: pass ``count_fn=causal_lm_count``). ``predict(meta_micro_batch) ->
    bytes`` gets a meta-device copy of a micro-batch (same structure, shapes and dtypes) and
    returns its predicted peak; it is called only when a budget is known (``budget_bytes``, or
    CUDA).

    >>> step = guard(model, torch.optim.AdamW(model.parameters()),
    ...              lambda m, b: F.cross_entropy(m(b[0]), b[1]), micro_batch_size=8)
    >>> loss = step((x, y))          # the batch's mean loss; step.recoveries lists any splits
    >>> hf = guard(gpt2, opt, lambda m, b: m(**b).loss, count_fn=causal_lm_count)
    """
    return GuardedStep(model, optimizer, loss_fn, micro_batch_size=micro_batch_size,
                       scaler=scaler, budget_bytes=budget_bytes, predict=predict,
                       count_fn=count_fn, reduction=reduction, grow_after=grow_after,
                       log=log)
