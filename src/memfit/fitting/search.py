"""The fit search: every technique combination x micro-batch, memory from the trace engine, time
from the cost model (:mod:`memfit.fitting.cost`).

Per technique combination, memory falls as the micro-batch shrinks and (in the cost model) time
never rises as it grows, so the search binary-searches the largest micro-batch that fits (a
micro-batch that does not fit rules out every larger one: monotonicity) and costs the smaller
ones from the traced ones (FLOPs and saved activations scale linearly with the micro-batch).
Traces are cached per (precision, checkpointing, optimizer, loss, attention, micro-batch).

Activation offload, optimizer-state offload and ZeRO sharding are first derived analytically
from the trace's timeline (see ``derive``); the offload configurations that reach the table are
then traced with the offload applied, and that peak replaces the derived one (Note: [offload is
verified by a trace]). ZeRO sharding stays analytic.

Most of the search's time is its traces (97% of the README's GPT-2 search, cProfile). It runs
fewer of them without changing the answer: fp16-mixed shares bf16-mixed's traces on a CUDA
target (Note: [fp16 is traced as bf16]), and a combination is not traced when ``top`` settled
candidates are ranked ahead of anything it could give (Note: [pruning]), by a bound that is the
cost model's own arithmetic (Note: [traffic bound], Note: [model-state bound]).
cost model's own arithmetic (Note: [traffic bound], Note: [model-state bound]).
``SearchOptions(prune=False, share_traces=False)`` is the exhaustive search the tests compare
with (``tests/fitting/test_fit_prune.py``).

The search in parts: the request checks and the space (:mod:`memfit.fitting.search_space`), a
traced step (:mod:`memfit.fitting.traced`), the variants derived from it
(:mod:`memfit.fitting.derive`), the search's state and the cost of a candidate
(:mod:`memfit.fitting.search_state`), the bounds that prune (:mod:`memfit.fitting.search_bounds`),
the verification of the table (:mod:`memfit.fitting.search_verify`), and here the search loop.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from memfit._loss import LossFn
from memfit.errors import MemfitError
from memfit.fitting.apply import check_shardable
from memfit.fitting.config import FitConfig
from memfit.fitting.derive import plain_policy, scaled_budget
from memfit.fitting.plan import Candidate, Plan, Rejected, rank
from memfit.fitting.rates import Rates
from memfit.fitting.search_bounds import Pruning
from memfit.fitting.search_space import SPACE_KEYS
from memfit.fitting.search_state import Combo, SearchOptions
from memfit.fitting.search_verify import Verification, over
from memfit.fitting.traced import ENGINE_FAILED, Traced, per_rank_traced, trace_one
from memfit.gpus import GpuSpec
from memfit.progress import Progress
from memfit.techniques.sparse import sparse_gradient_hint
from memfit.techniques.sparse_weights import pruning_hint

__all__ = ["ENGINE_FAILED", "SPACE_KEYS", "Search", "SearchOptions", "Traced", "fit",
           "per_rank_traced", "trace_one"]


def fit(model: nn.Module, sample_batch: Any, *, optimizer: str = "adamw", global_batch: int,
        gpu: str | GpuSpec | None = None, budget_bytes: int | None = None,
        device: str = "cuda", loss_fn: LossFn | None = None, reduction: str = "mean",
        count_fn: Callable[[Any], Any] | None = None,
        num_gpus: int = 1, measure: bool = False, space: dict[str, Any] | None = None,
        progress: bool | None = None, top: int = 5, headroom: float | None = None,
        gpus: int | None = None, gpus_per_node: int | None = None,
        rates: Rates | Mapping[str, Any] | str | os.PathLike[str] | None = None,
        options: SearchOptions | None = None, prefetch_batches: int = 0,
        tp_plan: Mapping[str, Any] | None = None,
        pp_split_points: list[str] | tuple[str, ...] | None = None) -> Plan:
    """Find the fastest training configuration of ``model`` that fits.

    ``sample_batch``: one batch as the model takes it (tensor, tuple -> ``model(*b)``, dict ->
    ``model(**b)``), any batch size: only shapes after the first dimension and dtypes are used.
    ``global_batch``: samples per optimizer step (kept fixed: micro-batch x accumulation x GPUs).
    The budget is ``budget_bytes``, else the GPU's usable memory (both: the smaller).
    ``loss_fn(model, batch) -> scalar`` as in :func:`memfit.estimate` (default: the model's own
    loss); with ``measure=True`` the timed steps split the batch as ``Plan.apply`` does, so
    ``reduction`` ("mean", default, or "sum") and ``count_fn`` say what the loss is, as for
    :func:`memfit.oom_guard.guard`. ``space`` narrows or widens a
    dimension, e.g. ``{"precision": ["fp32"], "micro_batch": [4, 8]}``. ``measure=True`` times
    real steps of the top candidates (only those predicted to fit) and picks the fastest.
    ``headroom``: the share of the budget kept free for what the prediction misses (see Note:
    [headroom]); default 5% on CPU, :data:`memfit.trace.estimate.TRACE_FITS_MARGIN` on CUDA.

    ``gpus=N`` (with ``gpus_per_node``, default: all on one node) searches the multi-GPU layout
    too: data-parallel sharding (DDP, ZeRO-1, ZeRO-2, FSDP, HSDP) x tensor parallelism (within
    a node, also with sequence parallelism and with sequence + loss parallelism) x pipeline
    stages, and expert parallelism for memfit's MoE models (:mod:`memfit.fitting.layouts`),
    each a :class:`memfit.Parallel` that the plan records (``plan.parallel``) and
    ``Plan.apply`` runs under torchrun; ``space`` takes ``"tp"`` and ``"pp"`` lists. The budget
    is per GPU. ``tp_plan``: the user's tensor-parallel plan (``Parallel.tp_plan``: module-name
    patterns to torch ``ParallelStyle`` s or their names), which every tp > 1 layout the search
    considers splits the model with (not under a pipeline), the plan records and
    ``Plan.apply`` applies with ``parallelize_module``; a plan of names is saved with the plan,
    one of style objects is not (``Plan.save`` says so in one line). ``pp_split_points``:
    where the user's pipeline splits the model (``Parallel.pp_split_points``: names of elements
    of one ``ModuleList`` / ``Sequential``, torchtitan's ``pipeline_parallel_split_points``),
    so that any module gets pipeline layouts: the search's pipelines are those of
    ``len(pp_split_points) + 1`` stages split there (1F1B and GPipe one a rank, interleaved
    1F1B two a rank over half as many ranks), beside data parallelism and ep, with ``tp_plan``
    in each stage where given (tp x pp);
    the plan records them and ``Plan.apply`` splits there.
    ``num_gpus=N`` is the older search: ZeRO over every GPU, no tp or pp.

    ``rates``: what the step times are costed at (:func:`memfit.fitting.rates.target_rates`):
    default the catalog's for a GPU and, on ``device="cpu"``, this machine's, measured once and
    kept on disk; a :class:`memfit.fitting.Rates`, a dict such as ``{"flops": 113e9,
    "bandwidth": 20e9, "launch_s": 4e-6}`` or a rates file's path pins them (Note: [rates do
    not move with the load]). ``plan.rates`` holds those used, ``plan.rates_source`` where
    they came from.

    ``options``: how the search prunes and shares traces (:class:`SearchOptions`; default: all
    on). They change the time the search takes, not its answer.

    ``prefetch_batches``: micro-batches a :class:`memfit.data.DevicePrefetcher` (``depth``)
    holds on the device through the step; each candidate's peak counts them (default 0: a
    plain DataLoader builds the next batch on the host).

    >>> plan = fit(model, (x, y), global_batch=64, budget_bytes=2**30, device="cpu")
    >>> model, optimizer, step = plan.apply(model)
    """
    return Search(model, sample_batch, optimizer=optimizer, global_batch=global_batch, gpu=gpu,
                  budget_bytes=budget_bytes, device=device, loss_fn=loss_fn,
                  reduction=reduction, count_fn=count_fn, num_gpus=num_gpus, measure=measure,
                  space=space, progress=progress, top=top, headroom=headroom, gpus=gpus,
                  gpus_per_node=gpus_per_node, rates=rates, options=options,
                  prefetch_batches=prefetch_batches, tp_plan=tp_plan,
                  pp_split_points=pp_split_points).run()


class Search(Pruning, Verification):
    """One :func:`fit` call: the checked inputs, the caches, and the search's steps (its
    arguments are :func:`fit`'s).

    ``run`` orders the combinations by their lower bound (``lower_bound``), explores each one
    (``explore``: the largest micro-batch that fits, by ``trace``; every fitting micro-batch and
    variant costed by ``candidates_at``), ranks (``memfit.fitting.plan.rank``), traces the offload
    candidates that reach the table (``verify_offload``) and, with ``measure=True``, times them
    (``measure_top``).

    >>> s = Search(model, (x, y), global_batch=64, budget_bytes=2**30, device="cpu")
    >>> plan = s.run()  # s.candidates, s.rejected, s.skipped: what the search saw
    """

    def run(self) -> Plan:
        combos: list[Combo] = list(itertools.product(
            self.dims["precision"], self.dims["checkpointing"], self.dims["optimizer"],
            self.dims["chunked_loss"], self.dims["attention"]))
        # Progress: a combination counts as done when its micro-batches are traced and costed
        # (not when it starts); the ETA, the average time per finished combination times those
        # left, is an upper bound: the branch and bound below skips combinations without
        # tracing them.
        with Progress("memfit fit: searching", total=len(combos), unit="combinations",
                      progress=self.progress, eta_is_bound=True) as bar:
            # Branch and bound: combinations in order of their lower bound; once ``top``
            # candidates are faster than the next bound, the rest cannot enter the table and
            # are not traced.
            bar.phase("counting FLOPs (fake tensors, one sample)")
            bounds = {combo: self.lower_bound(combo) for combo in combos}
            # Simpler first among equal bounds, so that rule 2 of Note: [pruning] finds the
            # simpler candidates before the combinations they rule out.
            combos.sort(key=lambda c: (bounds[c], self.simplest(c)))
            for combo in bar.track(combos):
                bar.set_note(f"{sum(not isinstance(v, str) for v in self.runs.values())} "
                             f"traced, {len(self.candidates)} fit")
                if not self.pruned(combo, bounds[combo]):
                    self.explore(combo)
        if not self.candidates:
            smallest = min((r.peak_bytes for r in self.rejected if r.peak_bytes), default=None)
            need = f"; the smallest predicted peak is {smallest:,} bytes" if smallest else ""
            raise MemfitError(f"no configuration fits the budget of {self.budget:,} bytes"
                              f"{need}; raise the budget (a bigger GPU, more GPUs), shorten the "
                              "sequence, or shrink the model")
        # Ties (predicted times within TIE_TOLERANCE) go to the simpler option, then the smaller
        # peak (Note: [ties go to the simpler option] in memfit/fitting/plan.py).
        self.candidates = rank(self.candidates)
        self.verify_micro_batches()
        self.verify_offload()
        self.verify_layouts()
        oom_trials = self.measure_top() if self.measure else 0
        cands = self.candidates
        spec = self.spec
        return Plan(chosen=cands[0], runners_up=tuple(cands[1:self.top]),
                    rejected=tuple(self.rejected), budget_bytes=self.full_budget,
                    headroom=self.headroom, oom_trials=oom_trials,
                    global_batch=self.global_batch, num_gpus=self.num_gpus,
                    device=self.device, gpu=spec.name if spec else None,
                    rates_source=self.rates.source, rates=self.rates,
                    search_seconds=time.perf_counter() - self.started,
                    traces=sum(1 for v in self.runs.values() if not isinstance(v, str)),
                    candidates_considered=len(cands) + len(self.rejected),
                    suggestions=tuple(h for h in (sparse_gradient_hint(self.model),
                                                      pruning_hint(self.model)) if h))

    def explore(self, combo: Combo) -> None:
        """Find the combination's largest fitting micro-batch and cost every micro-batch and
        variant of it that fits (rejections recorded)."""
        precision, ckpt, opt, chunked, attention = combo
        micro_batches = self.micro_batches
        largest = largest_fitting(micro_batches, lambda m: self.trace(combo, m), self.budget,
                                  lambda t, m: self.lowest_variant(t, m, attention))
        for m in micro_batches:
            t = self.traced(combo, m)
            what = FitConfig(precision=precision, checkpointing=ckpt if ckpt != "budget"
                             else "none", micro_batch=m, accumulation=self.per_gpu // m,
                             optimizer=opt, chunked_loss=chunked, attention=attention).label()
            if isinstance(t, str):
                self.rejected.append(Rejected(what=what if ckpt != "budget"
                                              else what + ", ckpt=budget", reason=t))
                continue
            if (largest is None or m > largest[0]) and t is None:
                continue  # pruned by monotonicity: reported once below
            ref = t if t is not None else (largest[1] if largest else None)
            if ref is None:
                continue
            ref_m = m if t is not None else largest[0]  # type: ignore[index]
            self.candidates_at(combo, m, ref, ref_m, what, traced=t is not None)
        if largest is not None and largest[0] < micro_batches[-1]:
            self.rejected.append(Rejected(
                what=f"{precision}, ckpt={ckpt}, {opt}, micro-batch > {largest[0]}",
                reason=f"micro-batch {_next(micro_batches, largest[0])} is predicted over "
                       "budget; larger ones use more memory (monotonicity: not traced)"))
        elif largest is None and not isinstance(self.traced(combo, micro_batches[0]), str):
            first = self.traced(combo, micro_batches[0])
            smallest = None if first is None or isinstance(first, str) else \
                self.lowest_variant(first, micro_batches[0], attention)
            self.rejected.append(Rejected(
                what=f"{precision}, ckpt={ckpt}, {opt}, any micro-batch",
                reason=f"micro-batch {micro_batches[0]} is predicted over the budget of "
                       f"{self.budget:,} bytes even with every offload/sharding option",
                peak_bytes=smallest))

    def candidates_at(self, combo: Combo, m: int, ref: Traced, ref_m: int, what: str, *,
                      traced: bool) -> None:
        """Cost each offload/sharding variant of ``combo`` at micro-batch ``m`` from the trace
        ``ref`` at ``ref_m``: those that fit become candidates, the others are rejected."""
        precision, ckpt, opt, chunked, attention = combo
        plain = plain_policy(ckpt, ref.checkpoint_modes)
        if plain is not None and plain in self.dims["checkpointing"]:
            self.rejected.append(Rejected(what=f"{what}, ckpt=budget", reason=(
                f"the budget resolves to ckpt={plain} for every block: the same as "
                f"ckpt={plain}, searched on its own")))
            return
        for off_s, off_a, shard, par, per_rank in self.variants(m):
            cfg = FitConfig(precision=precision, checkpointing=plain or ckpt,
                            checkpoint_budget_bytes=scaled_budget(ref.checkpoint_budget, m, ref_m,
                                                            plain),
                            checkpoint_modes=None if plain == "none" else ref.checkpoint_modes,
                            micro_batch=m, accumulation=per_rank // m, optimizer=opt,
                            offload_states=off_s, offload_activations=off_a,
                            chunked_loss=chunked, attention=attention, sharding=shard,
                            parallel=par)
            why = check_shardable(cfg)
            if why:
                self.rejected.append(Rejected(what=cfg.label(), reason=why))
                continue
            peak = self.derive(ref, ref_m, m, off_s, off_a, shard, par, per_rank, attention)
            if peak > self.budget:
                self.rejected.append(Rejected(what=cfg.label(), reason=(
                    f"predicted peak {over(peak, self.budget)} (after {self.headroom:.0%} "
                    "headroom)"), peak_bytes=peak))
                continue
            micro_flops = self.flops(plain or ckpt, None if plain else ref.checkpoint_modes,
                                     chunked, attention, m)
            cost = self.cost(
                precision=precision, micro_flops=micro_flops, m=m,
                traffic=self.activation_traffic(combo, ref, ref_m, m, micro_flops),
                offloaded=int(ref.saved_activations * m / ref_m), ops=ref.ops_per_micro,
                weights=ref.weights, grads=ref.grads, states=ref.states, off_s=off_s,
                off_a=off_a, shard=shard, par=par, per_rank=per_rank, attention=attention,
                sac_ops=ref.sac_ops_per_micro)
            self.candidates.append(Candidate(config=cfg, peak_bytes=peak, cost=cost,
                                             traced=traced))


def _next(values: list[int], after: int) -> int:
    return next(v for v in values if v > after)


def largest_fitting(micro_batches: list[int], trace: Callable[[int], Traced | str],
                    budget: int, lowest: Callable[[Traced, int], int]
                    ) -> tuple[int, Traced] | None:
    """Binary search over the sorted micro-batches for the largest whose most memory-saving
    derived variant (``lowest(trace, m)``) fits (memory grows with the micro-batch)."""
    failed = False

    def fits(m: int) -> Traced | None:
        nonlocal failed
        t = trace(m)
        if isinstance(t, str):
            # A failure unrelated to size would fail at every micro-batch: stop searching.
            failed = t.startswith(ENGINE_FAILED)
            return None
        return t if lowest(t, m) <= budget else None

    # The largest first: it usually fits, and then one trace settles the combination.
    top = fits(micro_batches[-1])
    if top is not None:
        return micro_batches[-1], top
    lo, hi = 0, len(micro_batches) - 2
    best: tuple[int, Traced] | None = None
    while lo <= hi and not failed:
        mid = (lo + hi) // 2
        t = fits(micro_batches[mid])
        if t is not None:
            best = (micro_batches[mid], t)
            lo = mid + 1
        else:
            hi = mid - 1
    return best
