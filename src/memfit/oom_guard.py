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

import copy
import gc
import logging
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit._compat.torch_internals import is_norm_layer
from memfit._guard_dist import ERROR, OK, OOM, RankAgreement, fsdp_ranks, global_item_count
from memfit._loss import LossFn, check_loss_fn, check_reduction
from memfit._tensors import meta_batch, tensor_leaves
from memfit.errors import MemfitError
from memfit.techniques.accumulation import count_tokens, split_batch, sync_gradients

__all__ = ["BudgetWarning", "GuardedStep", "Recovery", "causal_lm_count", "guard"]

log = logging.getLogger("memfit")

CountFn = Callable[[Any], int | torch.Tensor]
Predict = Callable[[Any], int]


class BudgetWarning(UserWarning):
    """Even a micro-batch of 1 is predicted over the guard's budget: the step runs at
    micro-batch 1 and may run out of memory."""


def causal_lm_count(batch: Any, *, ignore_index: int = -100) -> int:
    """Tokens a Hugging Face causal LM's ``.loss`` averages over: ``labels[..., 1:]`` not equal
    to ``ignore_index`` (the model shifts the labels left by one). ``count_fn`` for
    ``reduction="mean"`` with ``loss_fn=lambda m, b: m(**b).loss``.

    >>> causal_lm_count({"labels": torch.tensor([[5, 6, -100], [7, 8, 9]])})
    3
    """
    labels = batch["labels"] if isinstance(batch, Mapping) else None
    if not isinstance(labels, torch.Tensor) or labels.dim() < 2:
        raise MemfitError("causal_lm_count needs a dict micro-batch with a 2-D 'labels' tensor "
                          "(batch, sequence); pass your own count_fn for other batches")
    return count_tokens(labels, ignore_index=ignore_index, shift=True)


@dataclass(frozen=True, kw_only=True)
class Recovery:
    """One change of micro-batch size made by the guard."""

    step: int
    """Index of the step (0-based count of :class:`GuardedStep` calls) it happened in."""
    reason: str
    """``"oom"`` (a ``torch.OutOfMemoryError`` was caught), ``"oom-other-rank"`` (another DDP
    rank ran out of memory), ``"predicted"`` (the prediction exceeded the budget) or ``"grow"``
    (grown back after clean steps)."""
    batch_size: int
    """Samples in the batch being run."""
    old_micro_batch_size: int
    new_micro_batch_size: int
    predicted_bytes: int | None = None
    """For ``"predicted"``: the predicted peak at the old micro-batch size."""

    def __str__(self) -> str:
        what = {"oom": "out of memory", "oom-other-rank": "out of memory on another rank",
                "grow": "clean steps, growing back",
                "predicted": f"predicted peak {self.predicted_bytes} B over the budget"}
        accum = -(-self.batch_size // self.new_micro_batch_size)
        return (f"memfit guard: step {self.step}: {what[self.reason]} at micro-batch "
                f"{self.old_micro_batch_size}; micro-batch {self.new_micro_batch_size} "
                f"({accum} accumulation steps for batch {self.batch_size})")


def _batch_size(batch: Any) -> int:
    leaves = list(tensor_leaves(batch))
    if not leaves or leaves[0].dim() == 0:
        raise MemfitError(f"cannot find the batch dimension of a {type(batch).__name__}; pass a "
                          "tensor, or a tuple/list/dict of tensors with the batch size first")
    return int(leaves[0].shape[0])


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


class GuardedStep:
    """A training step over a whole batch that survives running out of memory.

    ``step(batch)`` splits ``batch`` into micro-batches of :attr:`micro_batch_size` (fewer where
    a prediction capped that shape), accumulates exact large-batch gradients, steps the optimizer
    (through ``scaler`` when given), sets the gradients to ``None``, and returns the batch's mean
    loss as a float (the batch's mean over its items, ``count_fn``; under
    ``torch.distributed`` this rank's share of the global mean). ``reduction`` says whether
    ``loss_fn`` returns a micro-batch's mean (default) or sum. See :mod:`memfit.oom_guard` for
    both and for what happens on OOM.

    Known limitations: see :mod:`memfit.oom_guard`; the guard owns ``.grad``: gradients present
    before a step are discarded.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn, *,
                 micro_batch_size: int | None = None, scaler: Any = None,
                 budget_bytes: int | None = None, predict: Predict | None = None,
                 count_fn: CountFn | None = None, reduction: str = "mean",
                 grow_after: int | None = None, log: bool = True) -> None:
        if not isinstance(model, nn.Module):
            raise MemfitError(f"model must be a torch.nn.Module, not {type(model).__name__}")
        if loss_fn is None:
            raise MemfitError("loss_fn must be a callable (model, micro_batch) -> the "
                              "micro-batch's loss (its mean, or its sum with reduction='sum')")
        check_loss_fn(loss_fn)
        self.reduction = check_reduction(reduction)
        for name, value in (("micro_batch_size", micro_batch_size),
                            ("budget_bytes", budget_bytes), ("grow_after", grow_after)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise MemfitError(f"{name} must be a positive integer or None, got {value!r}")
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.scaler = scaler
        self.count_fn = count_fn or _batch_size
        self._count_given = count_fn is not None
        self.micro_batch_size: int | None = micro_batch_size
        """Current micro-batch size; ``None`` until the first batch when not given (then the
        first batch's size: no split until memory says otherwise)."""
        self.budget_bytes = budget_bytes
        self.grow_after = grow_after
        """Double the micro-batch back (up to its first value) after this many consecutive
        steps without an OOM; ``None`` (default) never grows: an OOM usually comes back."""
        self.log = log
        self.recoveries: list[Recovery] = []
        self.history: list[int] = []
        """The micro-batch size each completed step ended with (retries included)."""
        self.steps = 0
        self._initial: int | None = micro_batch_size
        self._clean = 0
        self._caps: dict[tuple[Any, ...], int] = {}
        self._predicted: dict[tuple[tuple[Any, ...], int], int] = {}
        self._device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self._predict = predict
        self._predict_given = predict is not None
        self._scaler_ready = False
        self._predict_failed = False
        self._warned_over_budget = False

    # -- budget and prediction -------------------------------------------------------------------

    def _budget(self) -> int | None:
        if self._predict_failed:
            return None
        if self.budget_bytes is not None:
            return self.budget_bytes
        if self._device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self._device)
            return int(free + torch.cuda.memory_reserved(self._device))
        return None

    def _predicted_bytes(self, sig: tuple[Any, ...], batch: Any, rows: int) -> int:
        key = (sig, rows)
        if key not in self._predicted:
            if self._predict is None:
                self._predict = default_predict(self.model, self.optimizer, self.loss_fn,
                                                self._device)
            try:
                self._predicted[key] = int(self._predict(meta_batch(batch, rows)))
            except Exception as exc:  # the engine's failure must not stop training
                if self._predict_given:
                    raise
                # The engine cannot trace this step: say so once and rely on recovery alone.
                if self.log:
                    log.warning("memfit guard: cannot predict the step's peak (%s); splitting "
                                "only on out-of-memory errors", exc)
                self._predict_failed = True
                self._predicted[key] = 0
        return self._predicted[key]

    def _micro_for(self, batch: Any, size: int) -> int:
        assert self.micro_batch_size is not None
        micro = min(self.micro_batch_size, size)
        sig = _signature(batch)
        if sig in self._caps:
            return min(micro, self._caps[sig])
        budget = self._budget()
        if budget is None:
            return micro
        cap = micro
        while True:
            predicted = self._predicted_bytes(sig, batch, cap)
            if predicted <= budget or cap == 1:
                break
            new = cap // 2
            self._record(Recovery(step=self.steps, reason="predicted", batch_size=size,
                                  old_micro_batch_size=cap, new_micro_batch_size=new,
                                  predicted_bytes=predicted))
            cap = new
        if cap == 1 and predicted > budget and not self._warned_over_budget:
            # Splitting cannot go further: say so once (once per guard, not per shape).
            self._warned_over_budget = True
            warnings.warn(
                f"memfit guard: even micro-batch 1 is predicted at {predicted:,} B, over the "
                f"budget of {budget:,} B; running at micro-batch 1 ({size} accumulation steps "
                f"for batch {size}), which may run out of memory: enable activation "
                "checkpointing, a smaller optimizer state or lower precision (memfit.fit "
                "searches these), or raise the budget", BudgetWarning, stacklevel=3)
        self._caps[sig] = cap
        return cap

    # -- the step ---------------------------------------------------------------------------------

    def _record(self, event: Recovery) -> None:
        self.recoveries.append(event)
        if self.log:
            log.warning("%s", event)

    def _drop_grads(self) -> None:
        for p in self.model.parameters():
            p.grad = None

    def _release(self) -> None:
        gc.collect()
        if self._device.type == "cuda":
            torch.cuda.empty_cache()

    def _snapshot(self) -> tuple[Any, ...]:
        norms = [(m, {k: copy.deepcopy(v) for k, v in m._buffers.items()})
                 for m in self.model.modules()
                 if is_norm_layer(m) and m.training]
        cuda = (torch.cuda.get_rng_state(self._device) if self._device.type == "cuda"
                else None)
        return torch.get_rng_state(), cuda, norms

    def _restore(self, snapshot: tuple[Any, ...]) -> None:
        cpu, cuda, norms = snapshot
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, self._device)
        with torch.no_grad():
            for mod, buffers in norms:
                for k, v in buffers.items():
                    if v is not None:
                        mod._buffers[k].copy_(v)  # type: ignore[union-attr]

    def _count(self, batch: Any) -> tuple[int, float]:
        if self.reduction == "mean" and not self._count_given and isinstance(batch, Mapping) \
                and isinstance(batch.get("labels"), torch.Tensor) and batch["labels"].dim() >= 2:
            raise MemfitError("reduction='mean' with a 2-D 'labels' batch needs count_fn: the "
                              "loss averages over tokens, not rows; for a Hugging Face causal "
                              "LM's .loss pass count_fn=causal_lm_count (from memfit.oom_guard "
                              "import causal_lm_count)")
        num_items, world = global_item_count(int(self.count_fn(batch)))
        if num_items <= 0:
            raise MemfitError("the batch contains no items to average over (all labels "
                              "ignored?); check count_fn and the labels")
        return num_items, world / num_items

    def _attempt(self, batch: Any, micro: int, num_items_scale: float,
                 sync_last: bool = True) -> torch.Tensor:
        """Forward and backward over the micro-batches; returns the sum of per-item losses."""
        parts = split_batch(batch, micro)
        mean = self.reduction == "mean"
        loss_sum: torch.Tensor | None = None
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            # Note: [mean weights] A mean loss times the micro-batch's item count is its sum, so
            # both reductions become sum / (the batch's items) and the gradient is the batch's.
            items = int(self.count_fn(part)) if mean else 1
            if items == 0:
                # A mean over no items is NaN; it weighs nothing, so it is skipped, unless this
                # backward is the one that synchronises a sharded model's gradients.
                if last and sync_last and (hasattr(self.model, "no_sync")
                                           or hasattr(self.model, "set_requires_gradient_sync")):
                    raise MemfitError("the last micro-batch has no items to average over "
                                      "(all labels ignored?); use reduction='sum'")
                continue
            with sync_gradients(self.model, sync=sync_last and last):
                loss = self.loss_fn(self.model, part)
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise MemfitError(f"loss_fn must return a scalar tensor: the micro-batch's "
                                      f"{'mean loss' if mean else 'sum of per-item losses'} "
                                      f"(reduction={self.reduction!r})")
                scaled = self.scaler.scale(loss) if self.scaler is not None else loss
                (scaled * (num_items_scale * items)).backward()
            detached = loss.detach().float() * items
            loss_sum = detached if loss_sum is None else loss_sum + detached
            del loss, scaled
        # None: every micro-batch of this rank was empty (other DDP ranks hold the items)
        return loss_sum if loss_sum is not None else torch.zeros(())

    def __call__(self, batch: Any) -> float:
        size = _batch_size(batch)
        if self.micro_batch_size is None:
            self.micro_batch_size = self._initial = size
        # Counting once per batch (not per attempt) keeps collectives in step across retries.
        num_items, scale = self._count(batch)
        if self.scaler is not None and not self._scaler_ready:
            # GradScaler creates its scale and growth tracker at the first scale(); an OOM
            # between the two would leave it half made, so make them before any attempt.
            self.scaler.scale(torch.ones((), device=self._device))
            self._scaler_ready = True
        ranks = RankAgreement(self.model, self._device)  # Note: [OOM agreement under DDP]
        ddp = ranks.active
        if ddp:
            ranks.begin_batch()
        snapshot = self._snapshot()
        self._drop_grads()
        micro = self._micro_for(batch, size)
        if ddp:
            micro = ranks.micro_batch(micro)
        retried = False
        while True:
            outcome = OK
            try:
                loss_sum = self._attempt(batch, micro, scale, sync_last=not ddp)
            except torch.OutOfMemoryError:
                outcome = OOM  # recover below, once the exception and its frames are released
            except BaseException:
                self._drop_grads()
                self._restore(snapshot)
                if ddp:  # the other ranks must not wait for this one
                    ranks.raise_elsewhere()
                raise
            if outcome == OOM:
                self._drop_grads()
                self._release()
                sharded = fsdp_ranks(self.model)
                if sharded > 1:
                    self._restore(snapshot)
                    raise torch.OutOfMemoryError(
                        f"memfit guard: out of memory under FSDP with {sharded} ranks (step "
                        f"{self.steps}, micro-batch {micro}); a retry on this rank alone would "
                        "desynchronise the ranks' all-gathers, so the guard does not retry; "
                        "lower the micro-batch (memfit fit with a smaller budget) and restart")
            agreed = ranks.outcome(outcome) if ddp else outcome
            if agreed == ERROR:
                self._drop_grads()
                self._restore(snapshot)
                raise RuntimeError(f"memfit guard: another rank raised an error in step "
                                   f"{self.steps}; see its log")
            if agreed == OK:
                break
            self._drop_grads()
            self._restore(snapshot)
            self._release()
            if micro == 1:
                raise torch.OutOfMemoryError(
                    f"memfit guard: out of memory at micro-batch 1 (step {self.steps}, batch "
                    f"{size}); one sample does not fit: enable activation checkpointing, a "
                    f"smaller optimizer state or lower precision (memfit.fit searches these)")
            new = micro // 2
            self._record(Recovery(step=self.steps,
                                  reason="oom" if outcome == OOM else "oom-other-rank",
                                  batch_size=size, old_micro_batch_size=micro,
                                  new_micro_batch_size=new))
            micro = new
            self.micro_batch_size = min(self.micro_batch_size, micro)
            self._caps = {k: min(v, micro) for k, v in self._caps.items()}
            retried = True
        if ddp:
            ranks.average_gradients()
        try:
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
        except torch.OutOfMemoryError as exc:
            raise torch.OutOfMemoryError(
                f"memfit guard: out of memory in the optimizer step "
                f"({type(self.optimizer).__name__}, step {self.steps}); weights may be partly "
                f"updated, so the guard does not "
                f"retry; use a smaller optimizer state (8-bit, offload) or fewer parameters"
            ) from exc
        finally:
            self.optimizer.zero_grad(set_to_none=True)
            self._drop_grads()
        self.history.append(micro)
        self._clean = 0 if retried else self._clean + 1
        self._maybe_grow(size)
        self.steps += 1
        return float(loss_sum.item()) / num_items

    def _maybe_grow(self, size: int) -> None:
        assert self.micro_batch_size is not None and self._initial is not None
        if (self.grow_after is None or self._clean < self.grow_after
                or self.micro_batch_size >= self._initial):
            return
        new = min(self._initial, self.micro_batch_size * 2)
        self._record(Recovery(step=self.steps, reason="grow", batch_size=size,
                              old_micro_batch_size=self.micro_batch_size,
                              new_micro_batch_size=new))
        self.micro_batch_size = new
        self._caps.clear()
        self._clean = 0


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
