"""The guarded training step (see :mod:`memfit.oom_guard`): micro-batches whose losses are
weighted to the whole batch's, the cap the prediction sets per shape, and the recovery that
drops a failed attempt's gradients, restores the RNG and normalisation buffers and runs the same
batch again at half the micro-batch.
"""

from __future__ import annotations

import copy
import dataclasses
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
from memfit.oom_guard.budget import BudgetWarning, Predict, _signature, default_predict
from memfit.techniques.accumulation import count_tokens, split_batch, sync_gradients

__all__ = ["CountFn", "GuardedStep", "Recovery", "causal_lm_count"]

log = logging.getLogger("memfit")

CountFn = Callable[[Any], int | torch.Tensor]


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

    # -- state across steps: what a resumed run needs ------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What the guard learned across steps and what changes its later steps: the current
        micro-batch size (backed off after an OOM), the size it grows back to, the consecutive
        clean steps counted towards ``grow_after``, the step count, the history and the
        recoveries. Plain Python values (``torch.save``-able, no tensors).

        The per-shape caps the prediction set are not in it: they depend on the budget, which
        on CUDA is the device's free memory, so a resumed run (perhaps on another machine)
        predicts them again; the micro-batch size already bounds them from above.

        >>> resumed = memfit.guard(model, opt, loss_fn)
        >>> resumed.load_state_dict(step.state_dict())   # memfit.preemptible(guard=) does this
        """
        return {"micro_batch_size": self.micro_batch_size,
                "initial_micro_batch_size": self._initial,
                "clean_steps": self._clean,
                "steps": self.steps,
                "history": list(self.history),
                "recoveries": [dataclasses.asdict(r) for r in self.recoveries]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s state: the next step runs at the micro-batch size the
        saved guard had backed off to, and grows back (``grow_after``) when it would have."""
        missing = sorted({"micro_batch_size", "initial_micro_batch_size", "clean_steps",
                          "steps", "history", "recoveries"} - set(state))
        if missing:
            raise MemfitError(f"not a GuardedStep state_dict: it lacks {', '.join(missing)}; "
                              "pass what GuardedStep.state_dict() returned")
        self.micro_batch_size = state["micro_batch_size"]
        self._initial = state["initial_micro_batch_size"]
        self._clean = int(state["clean_steps"])
        self.steps = int(state["steps"])
        self.history = list(state["history"])
        self.recoveries = [Recovery(**r) for r in state["recoveries"]]
        # caps predicted for the old micro-batch size would not be capped by the restored one
        self._caps.clear()

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
