"""Batches of variable-length samples under a token or memory budget, with DDP's semantics.

>>> sampler = TokenBudgetBatchSampler([5, 3, 8, 2, 7], max_tokens=16, shuffle=False)
>>> list(sampler)  # lengths 2, 3, 5 padded to 3 x 5 = 15 tokens; 7, 8 to 2 x 8 = 16
[[3, 1, 0], [4, 2]]
>>> loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=pad)

How an epoch's batches are made (every rank computes the same list from ``seed + epoch``):

1. The sample indices, shuffled by a ``torch.Generator`` seeded ``seed + epoch`` (or in order
   with ``shuffle=False``), are cut into buckets of ``bucket_size`` samples.
2. Within a bucket the samples are sorted by length (shortest first, stable) and packed greedily:
   a sample joins the open batch while ``len(batch) + 1 <= capacity(its length)``, the most
   samples of that padded length the budget allows: ``max_tokens // length`` for a token budget
   (a batch costs ``batch_size x longest``), or the largest ``b`` with ``cost(b, length) <=
   max_bytes`` for a memory budget (found by doubling then bisection, cached per length).
3. The batches are shuffled (same generator), so long batches do not all come last.
4. DDP (as ``torch.utils.data.DistributedSampler``, on batches instead of samples): rank ``r``
   of ``R`` takes batches ``r, r + R, r + 2R, ...``. With ``drop_last=False`` the list is padded
   by repeating its first batches until its length divides by ``R`` (those samples are seen twice
   in the epoch); with ``drop_last=True`` the tail that does not divide is dropped. Every rank
   gets ``len(sampler)`` batches, and the shares are disjoint but for that padding.

Known limitations: the capacity of a memory budget assumes the cost grows with the batch size
and the length (the search needs monotonic fits); the memory budget is only as good as the cost
function (:func:`traced_cost` predicts with the trace engine, which the tests hold to the
profiler-measured CPU peak); the batch count of an epoch depends on its shuffle, so ``len()``
can change with ``set_epoch`` (the same on every rank).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Sampler

from memfit.errors import MemfitError

__all__ = ["CostFn", "PaddingStats", "TokenBudgetBatchSampler", "traced_cost"]

CostFn = Callable[[int, int], int]
"""``cost(batch_size, seq_len) -> bytes``: the peak memory of a step on such a batch."""

_MAX_BATCH = 1 << 20
"""The capacity search stops here (a cost that never exceeds the budget)."""


@dataclass(frozen=True, kw_only=True)
class PaddingStats:
    """The tokens of one epoch's batches (all ranks, before DDP's padding or dropping) against
    naive fixed-size batching of the same samples in the same shuffled order."""

    num_batches: int
    real_tokens: int
    """The sum of the samples' lengths."""
    padded_tokens: int
    """``sum(batch_size x longest in the batch)``: what the model computes on."""
    baseline_batch_size: int
    """The fixed batch size compared with: the largest safe for any batch under the budget (the
    capacity at the longest sample), unless given."""
    baseline_num_batches: int
    baseline_padded_tokens: int
    """Consecutive samples of the shuffled order in batches of ``baseline_batch_size``, each
    padded to its longest."""

    @property
    def padding_fraction(self) -> float:
        return 1 - self.real_tokens / self.padded_tokens if self.padded_tokens else 0.0

    @property
    def baseline_padding_fraction(self) -> float:
        return (1 - self.real_tokens / self.baseline_padded_tokens
                if self.baseline_padded_tokens else 0.0)

    @property
    def saved_tokens(self) -> int:
        """Padded tokens the budgeted batches save against the fixed-size baseline."""
        return self.baseline_padded_tokens - self.padded_tokens


def _positive_int(value: Any, name: str, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise MemfitError(f"{name} must be a positive integer, got {value!r}; {fix}")
    return value


class TokenBudgetBatchSampler(Sampler[list[int]]):
    """Yields lists of sample indices whose padded size fits a token or memory budget.

    Args:
        lengths: each sample's length (tokens), or, with ``dataset``, a function of one sample
            returning its length (called once per sample, at construction).
        max_tokens: token budget: ``batch_size x longest length <= max_tokens`` for every batch.
        max_bytes: memory budget instead: ``cost(batch_size, longest length) <= max_bytes``.
        cost: ``cost(batch_size, seq_len) -> bytes``, required with ``max_bytes``; e.g.
            :func:`traced_cost` (the trace engine's predicted peak of a step).
        max_batch_size: an upper bound on any batch's size, whatever the budget allows.
        bucket_size: samples sorted together; larger buckets pad less but mix lengths less
            across batches. Default: ``100 x`` the capacity at the median length, at least 1.
        num_replicas: the DDP world size (default: ``torch.distributed``'s when initialised,
            else 1).
        rank: this rank (default: ``torch.distributed``'s when initialised, else 0).
        shuffle: shuffle the samples (then the batches) each epoch, as DistributedSampler.
        seed: the epoch's generator is seeded ``seed + epoch``; the same on every rank.
        drop_last: drop the tail of batches that does not divide by ``num_replicas`` instead of
            padding it by repeating the first batches (as DistributedSampler, on batches).
        baseline_batch_size: the fixed batch size :meth:`stats` compares with.

    Known limitations: see the module docstring.
    """

    def __init__(self, lengths: Sequence[int] | Callable[[Any], int], *,
                 max_tokens: int | None = None, max_bytes: int | None = None,
                 cost: CostFn | None = None, dataset: Any = None,
                 max_batch_size: int | None = None, bucket_size: int | None = None,
                 num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 baseline_batch_size: int | None = None) -> None:
        self.lengths = self._lengths(lengths, dataset)
        if (max_tokens is None) == (max_bytes is None):
            raise MemfitError("give exactly one budget: max_tokens=N (batch_size x longest "
                              "length) or max_bytes=N with cost=fn(batch_size, seq_len)")
        if max_tokens is not None:
            self.max_tokens: int | None = _positive_int(
                max_tokens, "max_tokens", "e.g. max_tokens=8192")
            self.max_bytes: int | None = None
        else:
            self.max_tokens = None
            self.max_bytes = _positive_int(max_bytes, "max_bytes", "e.g. max_bytes=8 * 2**30")
            if cost is None or not callable(cost):
                raise MemfitError("max_bytes needs cost=fn(batch_size, seq_len) -> bytes, e.g. "
                                  "memfit.data.traced_cost(model, make_batch)")
        self.cost = cost
        self.max_batch_size = (None if max_batch_size is None else _positive_int(
            max_batch_size, "max_batch_size", "or leave it None (the budget alone decides)"))
        if num_replicas is None or rank is None:
            dist = torch.distributed
            ready = dist.is_available() and dist.is_initialized()
            if num_replicas is None:
                num_replicas = dist.get_world_size() if ready else 1
            if rank is None:
                rank = dist.get_rank() if ready else 0
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas <= 0:
            raise MemfitError(f"num_replicas must be a positive integer (the DDP world size), "
                              f"got {num_replicas!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_replicas:
            raise MemfitError(f"rank must be in [0, {num_replicas - 1}] for num_replicas="
                              f"{num_replicas}, got {rank!r}")
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.drop_last = bool(shuffle), int(seed), bool(drop_last)
        self.epoch = 0
        self._capacities: dict[int, int] = {}
        self._check_longest()
        if bucket_size is None:
            median = sorted(self.lengths)[len(self.lengths) // 2]
            bucket_size = 100 * self.capacity(median)
        self.bucket_size = _positive_int(bucket_size, "bucket_size", "e.g. bucket_size=1000")
        self.baseline_batch_size = (
            self.capacity(max(self.lengths)) if baseline_batch_size is None else _positive_int(
                baseline_batch_size, "baseline_batch_size", "or leave it None"))
        self._cached: tuple[int, list[list[int]], list[int]] | None = None

    @staticmethod
    def _lengths(lengths: Any, dataset: Any) -> list[int]:
        if dataset is not None:
            if not callable(lengths):
                raise MemfitError("with dataset=..., lengths must be a function of one sample "
                                  "returning its length, e.g. lambda s: len(s['input_ids'])")
            lengths = [lengths(dataset[i]) for i in range(len(dataset))]
        elif callable(lengths):
            raise MemfitError("lengths is a function: pass dataset=... too, or give the list of "
                              "the samples' lengths")
        try:
            out = list(lengths)
        except TypeError:
            raise MemfitError(f"lengths must be a list of ints (one per sample), not "
                              f"{type(lengths).__name__}") from None
        if not out:
            raise MemfitError("lengths is empty: the dataset has no samples")
        for i, n in enumerate(out):
            if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
                raise MemfitError(f"sample {i} has length {n!r}; every length must be a "
                                  f"positive int (drop empty samples before batching)")
        return out

    def _check_longest(self) -> None:
        longest = max(self.lengths)
        if self.capacity(longest) >= 1:
            return
        i = self.lengths.index(longest)
        if self.max_tokens is not None:
            raise MemfitError(
                f"sample {i} has {longest} tokens, more than max_tokens={self.max_tokens}: raise "
                f"max_tokens to at least {longest}, or truncate (or drop) the samples longer "
                f"than {self.max_tokens}")
        raise MemfitError(
            f"sample {i} ({longest} tokens) does not fit max_bytes={self.max_bytes} even alone "
            f"(cost(1, {longest}) = {self._cost(1, longest)} bytes): raise max_bytes, or "
            f"truncate (or drop) the longest samples")

    def _cost(self, batch: int, seq: int) -> int:
        assert self.cost is not None
        return int(self.cost(batch, seq))

    def capacity(self, length: int) -> int:
        """The most samples of padded length ``length`` one batch may hold under the budget
        (0 if not even one fits), capped by ``max_batch_size``."""
        if length not in self._capacities:
            self._capacities[length] = self._capacity(length)
        return self._capacities[length]

    def _capacity(self, length: int) -> int:
        cap = self.max_batch_size or _MAX_BATCH
        if self.max_tokens is not None:
            return min(cap, self.max_tokens // length)
        assert self.max_bytes is not None
        if self._cost(1, length) > self.max_bytes:
            return 0
        good, bad = 1, 2  # cost(good) fits; find a bad by doubling, then bisect
        while bad <= cap and self._cost(bad, length) <= self.max_bytes:
            good, bad = bad, bad * 2
        if bad > cap:
            if self._cost(cap, length) <= self.max_bytes:
                return cap
            bad = cap
        while bad - good > 1:
            mid = (good + bad) // 2
            if self._cost(mid, length) <= self.max_bytes:
                good = mid
            else:
                bad = mid
        return good

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch`` (call before each epoch's iteration, on every rank, as with
        DistributedSampler); the batches are a function of ``seed + epoch`` alone."""
        self.epoch = int(epoch)

    def _epoch(self) -> tuple[list[list[int]], list[int]]:
        """``(batches, order)`` of the current epoch, all ranks, before DDP's padding."""
        if self._cached is not None and self._cached[0] == self.epoch:
            return self._cached[1], self._cached[2]
        n = len(self.lengths)
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        order = torch.randperm(n, generator=g).tolist() if self.shuffle else list(range(n))
        batches: list[list[int]] = []
        for start in range(0, n, self.bucket_size):
            bucket = sorted(order[start:start + self.bucket_size], key=self.lengths.__getitem__)
            batch: list[int] = []
            for i in bucket:  # shortest first: the newcomer is the longest of its batch
                if batch and len(batch) + 1 > self.capacity(self.lengths[i]):
                    batches.append(batch)
                    batch = []
                batch.append(i)
            batches.append(batch)
        if self.shuffle:
            batches = [batches[k] for k in torch.randperm(len(batches), generator=g).tolist()]
        self._cached = (self.epoch, batches, order)
        return batches, order

    def __len__(self) -> int:
        total = len(self._epoch()[0])
        if self.drop_last:
            return total // self.num_replicas
        return math.ceil(total / self.num_replicas)

    def __iter__(self) -> Iterator[list[int]]:
        batches = self._epoch()[0]
        per_rank = len(self)
        wanted = per_rank * self.num_replicas
        if wanted > len(batches):  # pad as DistributedSampler: repeat from the start
            batches = batches + (batches * math.ceil(wanted / len(batches)))[
                :wanted - len(batches)]
        else:
            batches = batches[:wanted]
        for batch in batches[self.rank:wanted:self.num_replicas]:
            yield list(batch)

    def stats(self) -> PaddingStats:
        """Real and padded tokens of the current epoch's batches, and of fixed-size batching."""
        batches, order = self._epoch()
        lengths = self.lengths
        padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
        size = self.baseline_batch_size
        fixed = [order[k:k + size] for k in range(0, len(order), size)]
        return PaddingStats(
            num_batches=len(batches), real_tokens=sum(lengths), padded_tokens=padded,
            baseline_batch_size=size, baseline_num_batches=len(fixed),
            baseline_padded_tokens=sum(len(b) * max(lengths[i] for i in b) for b in fixed))


def traced_cost(model: torch.nn.Module, make_batch: Callable[[int, int], Any], *,
                seq_multiple: int = 1, **estimate_kwargs: Any) -> CostFn:
    """A cost function for ``TokenBudgetBatchSampler(max_bytes=...)``: the peak bytes
    :func:`memfit.trace.estimate` predicts for a step of ``model`` on ``make_batch(b, s)``.

    ``make_batch(batch_size, seq_len)`` returns the inputs of one step (tensors on the meta device
    are enough, e.g. ``torch.empty(b, s, dtype=torch.long, device="meta")``); ``estimate_kwargs``
    go to the engine (``device``, ``optimizer``, ``precision``, ``loss_fn``, ``steps``...).
    Each ``(b, s)`` is traced once (cached). ``seq_multiple`` rounds ``s`` up to a multiple
    (predicting the cost of the longer, dearer batch) so fewer points are traced: the sampler asks
    for about ``2 log2(capacity)`` batch sizes per distinct (rounded) length.

    >>> cost = traced_cost(model, lambda b, s: torch.empty(b, s, dtype=torch.long,
    ...                    device="meta"), device="cpu", seq_multiple=64)
    """
    from memfit.trace import estimate

    seq_multiple = _positive_int(seq_multiple, "seq_multiple", "e.g. seq_multiple=64")

    @functools.cache
    def traced(batch: int, seq: int) -> int:
        return int(estimate(model, make_batch(batch, seq), **estimate_kwargs).peak_bytes)

    def cost(batch: int, seq: int) -> int:
        return traced(batch, -(-seq // seq_multiple) * seq_multiple)

    return cost
