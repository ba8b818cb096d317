"""The bounds that prune the fit search: the least time any candidate of a technique combination
can take, known before it is traced (Note: [traffic bound], Note: [model-state bound]), and the
rule that leaves a combination untraced when ``top`` settled candidates are ranked ahead of all
it could give (Note: [pruning])."""

from __future__ import annotations

from memfit.fitting.config import FitConfig
from memfit.fitting.plan import TIE_TOLERANCE, Rejected, simplicity, tie_time
from memfit.fitting.search_state import Combo, SearchState, unverified
from memfit.units import format_seconds

__all__ = ["Pruning"]


class Pruning(SearchState):
    """The search's bounds (``lower_bound``, ``tighter_bound``) and its pruning (``pruned``)."""

    def tighter_bound(self, combo: Combo, flop_bound: float) -> float:
        """``flop_bound``, raised by the activation traffic once the combination's plain
        sibling is traced (Note: [traffic bound]) and by the optimizer step, transfers and
        communication of the model states once a sibling with the same precision and optimizer
        is traced (Note: [model-state bound]).

        Note: [traffic bound] A candidate's step time is at least its compute plus its
        activation traffic (``step_cost``: every other term is >= 0, dispatch overlaps or adds).
        Both are known before ``combo`` is traced: the FLOPs are counted once per policy, and
        the traffic comes from the plain sibling's trace (:meth:`activation_traffic`), which the
        search has traced by then (same FLOP bound or lower, earlier in the product order), so
        the bound is the same arithmetic as the cost, minimised over the micro-batches. A
        checkpointing budget recomputes at least nothing, so its bound takes no-checkpointing
        FLOPs (FLOPs and traffic only grow with recompute). Where activations dominate (GPT-2
        at 1024 tokens: eager attention's s x s scores), this prunes the combinations whose
        traffic alone is slower than the table, without tracing them.

        Note: [model-state bound] The weights, gradients and optimizer states a trace reports
        depend on the precision and the optimizer only (the same parameters, the same optimizer
        state per parameter; checkpointing, chunked loss and the attention kernel change
        activations), so a traced sibling with the same precision and optimizer gives them
        before ``combo`` is traced (``tests/fitting/test_fit_search.py`` checks that siblings
        agree). The bound is then ``step_cost`` itself with no activation transfer (>= 0) and the
        plain sibling's ops per micro-batch for the dispatch (checkpointing only adds ops: the
        recompute; none before the plain sibling is traced), minimised over the offload and
        sharding variants: a candidate that ties with it differs from it only by those terms."""
        by_m = self.bounds(combo)
        return max(flop_bound, min(by_m.values())) if by_m else flop_bound

    def bounds(self, combo: Combo) -> dict[int, float]:
        """By micro-batch: seconds no candidate of ``combo`` at that micro-batch can beat
        (``step_cost``'s own arithmetic, Note: [traffic bound], Note: [model-state bound]);
        empty when the precision has no rate. Per micro-batch, so that a candidate tying a
        simpler one to the last bit is seen to tie (Note: [pruning])."""
        precision, ckpt, opt, chunked, attention = combo
        if precision not in self.rates.flops:
            return {}
        sibling = self.plain_sibling(combo) if self.options.traffic_bound else None
        states = self.model_states(precision, opt) if self.options.traffic_bound else None
        weights, grads, state_bytes = states or (0, 0, 0)
        policy = "none" if ckpt == "budget" else ckpt
        out: dict[int, float] = {}
        for m in self.micro_batches:
            micro_flops = self.flops(policy, None, chunked, attention, m)
            traffic = 0
            if sibling is not None:
                plain, plain_m = sibling
                plain_flops = self.flops("none", None, chunked, attention, m)
                traffic = int(plain.saved_activations * m / plain_m * micro_flops
                              / max(plain_flops, 1.0))
            costs = [self.cost(
                precision=precision, micro_flops=micro_flops, m=m, traffic=traffic,
                offloaded=0, ops=sibling[0].ops_per_micro if sibling else 0, weights=weights,
                grads=grads, states=state_bytes, off_s=off_s, off_a=off_a, shard=shard, par=par,
                per_rank=per_rank, attention=attention).total_s
                for off_s, off_a, shard, par, per_rank in self.variants(m)]
            if costs:
                out[m] = min(costs)
        return out

    def model_states(self, precision: str, opt: str) -> tuple[int, int, int] | None:
        """Weights, gradients and optimizer-state bytes of any traced combination with this
        precision and optimizer (Note: [model-state bound]); None before one is traced."""
        found = [(v.weights, v.grads, v.states) for k, v in self.traces.items()
                 if k[0] == precision and k[2] == opt and not isinstance(v, str)]
        if not found:
            return None
        return min(w for w, _, _ in found), min(g for _, g, _ in found), \
            min(s for _, _, s in found)

    def lower_bound(self, combo: Combo) -> float:
        """Seconds no configuration of ``combo`` can beat: its FLOPs at the achievable rate
        (every other term of the cost model is >= 0; budget checkpointing recomputes >= 0)."""
        precision, ckpt, _, chunked, attention = combo
        if precision not in self.rates.flops:
            return 0.0
        plain = "none" if ckpt == "budget" else ckpt
        if self.layouts is not None:
            # Every rank computes at least its 1/gpus of the global batch's FLOPs.
            return (self.flops(plain, None, chunked, attention, 1) * self.global_batch
                    / self.num_gpus / self.rates.flops[precision])
        return (self.flops(plain, None, chunked, attention, self.per_gpu)
                / self.rates.flops[precision])

    def pruned(self, combo: Combo, flop_bound: float) -> bool:
        """Whether ``combo`` cannot enter the table (Note: [pruning]) or cannot run here (its
        precision has no rate); rejected with why.

        Note: [pruning] ``bound`` is at most the step time of every candidate ``combo`` could
        give (Note: [traffic bound], Note: [model-state bound]). A settled candidate ``B`` (one
        no later trace can reject: not an offload candidate awaiting its trace, Note: [offload
        is verified by a trace]) is ranked ahead of every candidate ``X`` of ``combo`` by
        :func:`memfit.fitting.plan.rank`, whatever else the search finds, when

        1. ``B``'s time times ``1 + TIE_TOLERANCE`` is below ``bound``: ``X`` is too slow to tie
           with ``B``, so ``B``'s tie group comes first; or
        2. ``B``'s time is at most ``bound`` and ``B`` is simpler than the simplest candidate
           ``combo`` can give (:meth:`simplest`): any tie group that holds ``X`` holds ``B``
           (groups are runs of the candidates sorted by time) or comes after ``B``'s, and
           within a group the simpler goes first.

        "Time" in both rules is :func:`memfit.fitting.plan.tie_time` (9 significant digits),
        the time ``rank`` groups by (Note: [tie arithmetic]); it is monotone, so the bound's
        ``tie_time`` is at most every candidate's, and the argument above holds with it word
        for word (rank sorts by time, so also by ``tie_time``, and a group's limit is its
        head's ``tie_time`` times ``1 + TIE_TOLERANCE``). Raw floats would not do: plain
        8-bit AdamW costed at micro-batch 8 is 6e-11 s slower than at 4 (``int`` truncation of
        the scaled traffic bytes), so rule 2 counted too few simpler candidates at 4 and the
        README's GPT-2 search traced selective and budget checkpointing with 8-bit AdamW (8
        traces) that then tied with plain 8-bit to the last bit.

        With ``top`` such candidates, no candidate of ``combo`` enters the table, and leaving
        them out changes nothing in it either: a left-out ``X`` could only matter as the
        fastest of a tie group (which sets where the group ends), but every ``B`` is at least
        as fast, so when ``X`` would head a group either all ``B`` are placed already (the
        table is full) or one heads it at the same time. ``tests/fitting/test_fit_search.py``
        compares the search with the exhaustive one (``SearchOptions(prune=False)``) and checks
        every pruned combination's candidates against its bound."""
        precision, ckpt, opt, chunked, _ = combo
        top = self.top
        by_m = self.bounds(combo) if self.options.prune else {}
        if by_m:
            bound = max(flop_bound, min(by_m.values()))
            settled = [c for c in self.candidates if not unverified(c)]
            floor = self.simplest(combo)

            tt = tie_time if self.options.tie_arithmetic else float
            times = [tt(c.cost.total_s) for c in settled]

            def ahead(m_bound: float) -> tuple[int, int]:
                """Settled candidates ranked ahead of one at ``m_bound`` or slower, by rule
                (in ``tie_time``, as ``rank`` compares)."""
                at_least = tt(max(m_bound, bound))
                at_m = tt(m_bound)
                slower = sum(1 for t in times if t * (1 + TIE_TOLERANCE) < at_least)
                simpler = sum(1 for t, c in zip(times, settled, strict=True)
                              if t * (1 + TIE_TOLERANCE) >= at_least
                              and t <= at_m and self.options.simpler_first
                              and simplicity(c.config) < floor)
                return slower, simpler

            counts = [ahead(b) for b in by_m.values()]
            if all(a + b >= top for a, b in counts):
                self.skipped[combo] = by_m
                kth = sorted(c.cost.total_s for c in settled)[top - 1]
                why = (f"its compute alone ({format_seconds(bound)}) is slower than the {top} "
                       f"fastest found ({format_seconds(kth)})"
                       if all(a >= top for a, _ in counts) else
                       f"at best ({format_seconds(bound)}) it ties with {top} simpler "
                       "configurations found, and a tie goes to the simpler")
                self.rejected.append(Rejected(
                    what=f"{precision}, ckpt={ckpt}, {opt}"
                         + (", chunked-loss" if chunked else ""),
                    reason=f"not traced: {why}"))
                return True
        if precision not in self.rates.flops:
            self.rejected.append(Rejected(what=f"precision {precision}", reason=(
                f"{precision} is not supported on "
                f"{self.spec.name if self.spec else self.device}")))
            return True
        return False

    def simplest(self, combo: Combo) -> tuple[int, int]:
        """The :func:`memfit.fitting.plan.simplicity` of the simplest candidate ``combo`` can
        give: no offload, no sharding, and for a checkpointing budget the simplest plain policy
        it may resolve to that is not searched on its own (``candidates_at``)."""
        precision, ckpt, opt, chunked, attention = combo
        policies = [ckpt]
        if ckpt == "budget":
            policies += [p for p in ("none", "selective", "full")
                         if p not in self.dims["checkpointing"]]
        return min(simplicity(FitConfig(
            precision=precision, checkpointing=p, optimizer=opt, chunked_loss=chunked,
            attention=attention, checkpoint_budget_bytes=1 if p == "budget" else None))
            for p in policies)
