"""Find the largest batch that fits: seeded by the trace engine, settled by real trial steps.

>>> batch = memfit.find_batch_size(model, lambda b: make_inputs(b, seq=2048), budget_bytes=2**30,
...                                device="cpu")

1. **Seed**: :func:`memfit.estimate` predicts the peak of the step on meta tensors; a search over
   the predictions gives the largest batch predicted to fit (skipped when ``start`` is given).
2. **Verify both ways**: real trial steps from the seed. A batch fits if the trial finished
   without ``torch.OutOfMemoryError`` and its measured peak is within the budget (CPU: the
   profiler's allocator events, :func:`memfit.profiling.cpu.measure_cpu_peak`; CUDA:
   ``torch.cuda.max_memory_reserved``). From a seed that fits it grows (+1, +2, +4, ...) until a
   batch does not; from one that does not it shrinks the same way; a bisection between the last
   fit and the first miss ends at ``b`` with ``b`` fitting and ``b + 1`` not (or ``max_batch``).
   Once two trials have measured peaks, the next trials (four at most) go where the line
   through two of them meets the budget (``_Trials.guess``): a step's peak is piecewise linear
   in the batch, so on the tests' MLP the search ends after 6 trials from batch 1 and 4 from
   120, where galloping and bisecting alone take 12 and 14.
3. **Longest sequence**: ``make_batch(batch_size)`` should build a batch at the longest length the
   loader can emit (e.g. padding to ``max_length``): memory grows with the sequence, and padding
   semantics are model specific, so memfit does not invent them. A DataLoader-like iterable is
   also accepted: its first ``scan_batches`` batches are scanned, the one with the most elements
   per sample (the longest) is kept, and its rows are repeated to make any batch size.
4. **Train vs eval**: ``mode="train"`` runs two training steps (forward, ``loss_fn``, backward,
   a fresh optimizer's step, ``zero_grad``: the second step holds the optimizer states during
   the forward, the first creates them); ``mode="eval"`` runs one forward under
   ``torch.no_grad()`` in ``model.eval()``, with no optimizer. The weights, the gradients and the
   train/eval mode are restored afterwards.
5. **Distributed**: with ``torch.distributed`` initialised, rank 0 searches and broadcasts the
   result; the other ranks run no trial (ranks have the same memory in data parallelism).

Known limitations: the budget is for the step alone (a trial's peak counts the model, the
batch, and what the step allocates; on CUDA the caching allocator's reserved bytes, which
include other tensors already alive); trials assume memory grows with the batch size (the
bisection needs monotonic fits); FSDP/tensor-parallel ranks whose memory differs are not
modelled.
"""

from __future__ import annotations

import functools
import gc
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from memfit._loss import LossFn, check_loss_fn, model_loss
from memfit._tensors import call_model, tensor_leaves
from memfit.errors import MemfitError, suggest
from memfit.profiling.cpu import measure_cpu_peak
from memfit.progress import Progress, current, phase
from memfit.runtime.input_pipeline import DataLoaderSpec
from memfit.trace import estimate
from memfit.trace.dataloader import with_input_pipeline
from memfit.trace.optim import OptimizerFactory, make_optimizer

__all__ = ["MODES", "find_batch_size"]

log = logging.getLogger("memfit")

MODES = ("train", "eval")
_TRAIN_STEPS = 2  # the second step holds optimizer states while activations are alive
_GUESSES = 4
"""Trials placed by the measured peaks (:meth:`_Trials.guess`) before the galloping steps."""


def _map(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        return {k: _map(v, fn) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_map(v, fn) for v in obj)
    return obj


def _rows(batch: Any) -> int:
    leaves = [t for t in tensor_leaves(batch) if t.dim() > 0]
    if not leaves:
        raise MemfitError("a batch must hold tensors with the batch size first; make_batch "
                          "returned none")
    return int(leaves[0].shape[0])


class _Source:
    """Batches of any size at the longest length: from ``make_batch(b)`` or a loader's longest
    batch with its rows repeated."""

    def __init__(self, make_batch: Any, device: torch.device, scan_batches: int) -> None:
        self.device = device
        self.make: Callable[[int], Any] | None = None
        self.longest: Any = None
        if callable(make_batch):
            self.make = make_batch
            self.template = self._to_device(make_batch(1))
        elif isinstance(make_batch, Iterable):
            best, best_len = None, -1
            for i, batch in enumerate(make_batch):
                if i >= scan_batches:
                    break
                length = max((t.numel() // max(1, t.shape[0]) for t in tensor_leaves(batch)
                              if t.dim() > 0), default=0)
                if length > best_len:
                    best, best_len = batch, length
            if best is None:
                raise MemfitError("the loader passed as make_batch yielded no batch; pass a "
                                  "non-empty DataLoader or a callable make_batch(batch_size)")
            self.longest = self._to_device(best)
            self.template = self.longest
        else:
            raise MemfitError(f"make_batch must be a callable batch_size -> batch or a "
                              f"DataLoader-like iterable, not {type(make_batch).__name__}")
        _rows(self.template)

    def _to_device(self, batch: Any) -> Any:
        return _map(batch, lambda t: t.to(self.device))

    def real(self, rows: int) -> Any:
        if self.make is not None:
            batch = self._to_device(self.make(rows))
            if _rows(batch) != rows:
                raise MemfitError(f"make_batch({rows}) returned a batch of {_rows(batch)}; it "
                                  "must return exactly the batch size it is asked for")
            return batch
        n = _rows(self.longest)
        index = torch.arange(rows, device=self.device) % n
        return _map(self.longest, lambda t: t.index_select(0, index) if t.dim() > 0 else t)

    def meta(self, rows: int) -> Any:
        return _map(self.template, lambda t: torch.empty(
            (rows, *t.shape[1:]) if t.dim() > 0 else (), dtype=t.dtype, device="meta"))


class _Trials:
    """Real trial steps, each answering "does this batch size fit?" once."""

    def __init__(self, model: nn.Module, source: _Source, *, budget: int, train: bool,
                 optimizer: str | OptimizerFactory, loss_fn: LossFn,
                 log_trials: bool, prefetch: int = 0) -> None:
        self.model = model
        self.prefetch = prefetch
        self.source = source
        self.budget = budget
        self.train = train
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.log = log_trials
        self.cuda = source.device.type == "cuda"
        self.results: dict[int, bool] = {}
        self.peaks: dict[int, int | None] = {}

    def _step(self, batch: Any) -> None:
        if not self.train:
            with torch.no_grad():
                call_model(self.model, batch)
            return
        params = [p for p in self.model.parameters() if p.requires_grad]
        opt = make_optimizer(self.optimizer, params, cuda_target=self.cuda)
        for _ in range(_TRAIN_STEPS):
            self.loss_fn(self.model, batch).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    def _measure(self, rows: int) -> int | None:
        """The trial's peak bytes, or None when it ran out of memory."""
        batch = None
        ahead: list[Any] = []
        try:
            batch = self.source.real(rows)
            # the DevicePrefetcher's batches, alive on the device through the step
            ahead = [_map(batch, torch.clone) for _ in range(self.prefetch)]
            if self.cuda:
                torch.cuda.synchronize(self.source.device)
                torch.cuda.reset_peak_memory_stats(self.source.device)
                self._step(batch)
                torch.cuda.synchronize(self.source.device)
                return int(torch.cuda.max_memory_reserved(self.source.device))
            return measure_cpu_peak(functools.partial(self._step, batch), self.model,
                                    batch, *ahead).peak_bytes
        except torch.OutOfMemoryError:
            return None
        finally:
            batch = None
            ahead.clear()
            for p in self.model.parameters():
                p.grad = None
            gc.collect()
            if self.cuda:
                torch.cuda.empty_cache()

    def fits(self, rows: int) -> bool:
        if rows not in self.results:
            phase(f"trial: batch {rows}, real {'training steps' if self.train else 'forward'}")
            peak = self._measure(rows)
            self.peaks[rows] = peak
            self.results[rows] = peak is not None and peak <= self.budget
            self._report()
            if self.log:
                what = "out of memory" if peak is None else f"peak {peak} B"
                log.info("memfit batch-size: batch %d: %s, budget %d B: %s", rows, what,
                         self.budget, "fits" if self.results[rows] else "does not fit")
        return self.results[rows]


    def guess(self, lo: int, hi: int) -> int | None:
        """The next trial placed by the measured peaks: where the line through the two
        smallest batches that did not fit meets the budget; with one such batch, the size just
        below it (the second point of that line); before any, where the line through the two
        largest that fit meets it (None before two peaks, or when they do not grow).

        A step's peak is the highest of a few phases' bytes, each affine in the batch size (a
        dense model's tensors are): a convex, piecewise-linear curve, whose steepest piece
        (activations) holds the answer once the batch is large. Two misses lie on it near the
        answer; two small fits often lie on the flatter piece (model states) and aim too far,
        which only costs the trial that finds the first miss."""
        fits = sorted(b for b, ok in self.results.items() if ok and self.peaks[b] is not None)
        misses = sorted(b for b, ok in self.results.items()
                        if not ok and self.peaks[b] is not None)
        if len(misses) >= 2:
            b1, b2 = misses[:2]
        elif misses:
            return misses[0] - 1 if misses[0] - 1 > lo else None
        elif len(fits) >= 2:
            b1, b2 = fits[-2:]
        else:
            return None
        p1, p2 = self.peaks[b1], self.peaks[b2]
        assert p1 is not None and p2 is not None
        if p2 <= p1:
            return None
        return b1 + (self.budget - p1) * (b2 - b1) // (p2 - p1)

    def _report(self) -> None:
        """Trials done, the bracket so far, and (once bisecting) at most how many are left."""
        active = current()
        if active is None:
            return
        fit = [b for b, ok in self.results.items() if ok]
        miss = [b for b, ok in self.results.items() if not ok]
        lo = max(fit, default=None)
        hi = min((b for b in miss if lo is None or b > lo), default=None)
        parts = [f"{len(self.results)} trials"]
        if lo is not None:
            parts.append(f"{lo} fits")
        if hi is not None:
            parts.append(f"{hi} does not")
        if lo is not None and hi is not None:
            # Bisection halves hi - lo per trial: ceil(log2(hi - lo)) trials at most.
            parts.append(f"≤ {max(0, (hi - lo - 1).bit_length())} left")
        active.set_note(", ".join(parts))


def _largest(fits: Callable[[int], bool], seed: int, max_batch: int,
             guess: Callable[[int, int], int | None] | None = None) -> int | None:
    """The largest ``b`` in [1, max_batch] with ``fits(b)`` and not ``fits(b + 1)``, searching
    from ``seed`` with steps 1, 2, 4, ... then bisecting; None when ``fits(1)`` is False.

    ``guess(lo, hi)``, when given, proposes the next size inside the bracket (``lo`` fits or is
    0, ``hi`` does not or is ``max_batch + 1``) from what the trials measured; the first
    ``_GUESSES`` proposals are tried before the steps above: wrong ones cost at most that many
    trials, plus one bisection of [1, max_batch] where they leave a wider bracket."""
    seed = min(max(seed, 1), max_batch)
    lo, hi = 0, max_batch + 1  # fits(lo) (0: none known), not fits(hi) (max_batch + 1: none)
    step, guesses = 1, _GUESSES if guess is not None else 0
    while hi - lo > 1:
        probe = None
        if guesses and (lo, hi) != (0, max_batch + 1):
            proposed = guess(lo, hi) if guess is not None else None
            if proposed is not None:
                guesses -= 1
                probe = min(max(proposed, lo + 1), hi - 1)
        if probe is None:
            if (lo, hi) == (0, max_batch + 1):
                probe = seed
            elif hi == max_batch + 1:  # all fit so far: grow
                probe, step = min(max_batch, lo + step), step * 2
            elif lo == 0:  # none fit so far: shrink
                probe, step = max(1, hi - step), step * 2
            else:  # fits(lo), not fits(hi)
                probe = (lo + hi) // 2
        if fits(probe):
            lo = probe
        else:
            hi = probe
    return lo or None


def _predicted_seed(model: nn.Module, source: _Source, *, budget: int, train: bool,
                    optimizer: str | OptimizerFactory, loss_fn: LossFn,
                    max_batch: int, prefetch: int = 0) -> int:
    target = "cuda" if source.device.type == "cuda" else "cpu"
    cache: dict[int, bool] = {}

    def predicted_fits(rows: int) -> bool:
        if rows not in cache:
            phase(f"seed: tracing batch {rows} on meta tensors")
            est = estimate(model, source.meta(rows), optimizer=optimizer if train else None,
                           loss_fn=loss_fn, device=target, steps=_TRAIN_STEPS if train else 1)
            if prefetch:
                est = with_input_pipeline(est, DataLoaderSpec(depth=prefetch), source.meta(rows))
            peak = est.peak_reserved_bytes if target == "cuda" else est.peak_bytes
            cache[rows] = peak <= budget
        return cache[rows]

    if not predicted_fits(1):
        return 1
    lo = 1
    while lo < max_batch and predicted_fits(min(max_batch, lo * 2)):
        lo = min(max_batch, lo * 2)
    if lo == max_batch:
        return lo
    hi = min(max_batch, lo * 2)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if predicted_fits(mid) else (lo, mid)
    return lo


def _validate(model: Any, mode: str, budget_bytes: Any, start: Any, max_batch: Any,
              optimizer: Any) -> None:
    if not isinstance(model, nn.Module):
        raise MemfitError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    if mode not in MODES:
        raise MemfitError(f"unknown mode {mode!r}{suggest(str(mode), MODES)}; valid: "
                          f"{', '.join(MODES)}")
    for name, value in (("budget_bytes", budget_bytes), ("start", start),
                        ("max_batch", max_batch)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise MemfitError(f"{name} must be a positive integer or None, got {value!r}")
    if isinstance(optimizer, torch.optim.Optimizer):
        raise MemfitError("optimizer must be a name (e.g. 'adamw') or a callable params -> "
                          "Optimizer: trial steps build a fresh one so yours keeps its state")


def find_batch_size(model: nn.Module, make_batch: Callable[[int], Any] | Iterable[Any], *,
                    budget_bytes: int | None = None, device: str | torch.device | None = None,
                    optimizer: str | OptimizerFactory = "adamw",
                    loss_fn: LossFn | None = None, mode: str = "train",
                    start: int | None = None, max_batch: int = 4096, scan_batches: int = 64,
                    log: bool = True, progress: bool | None = None,
                    prefetch_batches: int = 0) -> int:
    """The largest batch size whose step fits in ``budget_bytes`` (see :mod:`memfit.batch_size`).

    ``make_batch(batch_size)`` returns a batch (a tensor, or a tuple/list/dict of tensors with
    the batch size first; called with the model's inputs as ``model(*batch)`` / ``model(**batch)``)
    at the longest sequence length, or pass a DataLoader-like iterable. ``loss_fn(model, batch)``
    runs the model and returns the loss (default: the model's own loss, read by
    :func:`memfit.trace.default_loss`). ``optimizer`` is a name
    (``"adamw"``, ``"sgd"``, ...) or a callable ``params -> Optimizer``. ``device`` must be where
    the model is (default: there); batches are moved to it. ``budget_bytes`` is required on CPU;
    on CUDA it defaults to the free memory plus what PyTorch already reserved. ``progress``:
    a line on stderr with the trial running and the bracket so far (default: only when stderr
    is a terminal; see :mod:`memfit.progress`). ``prefetch_batches``: batches of the same size
    held on the device during the step, as :class:`memfit.data.DevicePrefetcher` ``depth`` does
    (default 0: a plain DataLoader builds the next batch on the host); the trials hold that many
    copies of the batch and the seed adds their bytes to the prediction.

    >>> find_batch_size(model, lambda b: torch.randn(b, 512), budget_bytes=64 * 2**20,
    ...                 device="cpu")
    37
    """
    _validate(model, mode, budget_bytes, start, max_batch, optimizer)
    if isinstance(prefetch_batches, bool) or not isinstance(prefetch_batches, int) \
            or prefetch_batches < 0:
        raise MemfitError(f"prefetch_batches must be an int >= 0 (DevicePrefetcher's depth), "
                          f"not {prefetch_batches!r}")
    check_loss_fn(loss_fn)
    model_device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if model_device.type == "meta":
        raise MemfitError("find_batch_size runs real trial steps; materialise the model on its "
                          "device first (memfit.estimate predicts meta models)")
    dev = torch.device(device) if device is not None else model_device
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev != model_device:
        raise MemfitError(f"the model is on {model_device} but device={dev}; move the model "
                          f"(model.to({str(dev)!r})) or pass device={str(model_device)!r}")
    dist = torch.distributed
    distributed = dist.is_available() and dist.is_initialized()
    result = 0
    error: BaseException | None = None
    if not distributed or dist.get_rank() == 0:
        try:
            with Progress("memfit.find_batch_size", total=None, progress=progress):
                result = _search(model, make_batch, dev, budget_bytes=budget_bytes,
                                 optimizer=optimizer, loss_fn=loss_fn or model_loss,
                                 train=mode == "train", start=start, max_batch=max_batch,
                                 scan_batches=scan_batches, log_trials=log,
                                 prefetch=prefetch_batches)
        except BaseException as exc:  # re-raised below, after the other ranks are told
            if not distributed:
                raise
            error = exc
    if distributed:
        # Rank 0 decides (0 means it failed) so every rank uses the same batch size.
        value = torch.tensor([result], dtype=torch.long,
                             device=dev if dist.get_backend() == "nccl" else "cpu")
        dist.broadcast(value, src=0)
        if error is not None:
            raise error
        result = int(value.item())
        if result < 1:
            raise MemfitError("rank 0 could not find a batch size that fits (see its error); "
                              "lower the budget's demands on rank 0 and retry")
    return result


def _search(model: nn.Module, make_batch: Any, dev: torch.device, *, budget_bytes: int | None,
            optimizer: str | OptimizerFactory, loss_fn: LossFn,
            train: bool, start: int | None, max_batch: int, scan_batches: int,
            log_trials: bool, prefetch: int = 0) -> int:
    if budget_bytes is None:
        if dev.type != "cuda":
            raise MemfitError(f"budget_bytes is required on {dev.type}: there is no device "
                              f"memory to read; pass e.g. budget_bytes=8 * 2**30")
        free, _ = torch.cuda.mem_get_info(dev)
        budget_bytes = int(free + torch.cuda.memory_reserved(dev))
    was_training = model.training
    saved = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()} \
        if train else None
    model.train(train)
    try:
        source = _Source(make_batch, dev, scan_batches)
        seed = start if start is not None else _predicted_seed(
            model, source, budget=budget_bytes, train=train, optimizer=optimizer,
            loss_fn=loss_fn, max_batch=max_batch, prefetch=prefetch)
        trials = _Trials(model, source, budget=budget_bytes, train=train, optimizer=optimizer,
                         loss_fn=loss_fn, log_trials=log_trials, prefetch=prefetch)
        found = _largest(trials.fits, seed, max_batch, trials.guess)
        if found is None:
            peak = trials.peaks.get(1)
            what = "runs out of memory" if peak is None else f"peaks at {peak} B"
            raise MemfitError(f"even batch size 1 {what}, over the budget of {budget_bytes} B; "
                              f"raise budget_bytes, or reduce memory (activation checkpointing, "
                              f"a smaller optimizer, lower precision)")
        if log_trials:
            log.info("memfit batch-size: %s batch %d fits %d B (seed %d, %d trials)",
                     "train" if train else "eval", found, budget_bytes, seed,
                     len(trials.results))
        return found
    finally:
        if saved is not None:
            with torch.no_grad():
                model.load_state_dict(saved)
        for p in model.parameters():
            p.grad = None
        model.train(was_training)
