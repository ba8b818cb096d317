"""The fit search's verification: the candidates that reach the table with a derived peak (a
smaller micro-batch, an offload, a multi-GPU layout) are traced as ``Plan.apply`` runs them, and
that peak replaces the derived one or rejects them; with ``measure=True`` the top ones are timed
on this device."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from memfit.errors import MemfitError
from memfit.fitting.config import FitConfig
from memfit.fitting.derive import rest_of_batch
from memfit.fitting.layouts import traced_step
from memfit.fitting.plan import Candidate, Rejected, rank
from memfit.fitting.search_state import SearchState, unverified
from memfit.fitting.traced import Traced, per_rank_traced, trace_one
from memfit.progress import Progress
from memfit.units import format_bytes

__all__ = ["Verification", "over"]


class Verification(SearchState):
    """The search's verification steps, run in this order once the table is ranked:
    ``verify_micro_batches``, ``verify_offload``, ``verify_layouts``, then ``measure_top``."""

    def verify_micro_batches(self) -> None:
        """Note: [derived micro-batches are verified by a trace] A micro-batch below the
        largest one traced is costed from that trace (``derive``), which is cheap enough for
        every micro-batch but over-states it (by 3 to 29% in 12 fp32 and bf16-mixed cases of
        ``tests/fitting/test_fit.py``'s classifier): it takes the traced step's accumulating peak
        less the activations alive at its one-step peak, and that peak is often the optimizer's
        step, where the input is the only activation. Issue 20's classifier (3 MLP blocks of
        width 2048) at micro-batch 128 of 4096 was given micro-batch 256's peak, 7.7% over its
        measured step; GPT-2's micro-batch 4 of 256 was given 22.84 GB for a traced 8.80 GB.
        Scaling the activations at the accumulating peak's own moment instead is no fix: the
        high point moves with the micro-batch, and under autocast the weights' half copies are
        activations that do not scale (tried: 7% under for a bf16-mixed step). So the
        candidates that reach the table are traced at their own micro-batch, as ``Plan.apply``
        runs them (a checkpointing budget's per-block modes fixed), and that peak replaces the
        derived one, or rejects them. Offload and multi-GPU layouts have their own verification
        (``verify_offload``, ``verify_layouts``).

        Known limitation: as for layouts, the branch and bound counts derived micro-batches as
        settled, so a table that loses one to its trace can hold fewer than ``top``."""

        def pending(c: Candidate) -> bool:
            par = c.config.parallel
            return not c.traced and not unverified(c) and (par is None or par.gpus == 1)

        def traced(cfg: FitConfig) -> tuple[Any, int] | str:
            precision = self.traced_precision(cfg.precision)
            # One trace per step (the sharding variants of a micro-batch share it), counted
            # with the search's.
            run = (precision, cfg.checkpointing, cfg.checkpoint_modes, cfg.optimizer,
                   cfg.chunked_loss, cfg.attention, cfg.micro_batch)
            if run not in self.runs:
                self.runs[run] = trace_one(
                    self.base, self.sample_batch, precision=precision,
                    ckpt=cfg.checkpointing, optimizer=cfg.optimizer, chunked=cfg.chunked_loss,
                    attention=cfg.attention, m=cfg.micro_batch, per_gpu=self.per_gpu,
                    device=self.device, gpu=self.spec, loss_fn=self.loss_fn,
                    num_gpus=self.num_gpus, modes=cfg.checkpoint_modes,
                    device_budget=self.budget)
            t = self.runs[run]
            if isinstance(t, str):
                return t
            return t, self.derive(t, cfg.micro_batch, cfg.micro_batch, False, False,
                                  cfg.sharding)

        self._verify("memfit fit: tracing the derived micro-batches that can win", pending,
                     traced, "traced at its micro-batch: peak", lambda _t: {},
                     f"no configuration fits the budget of {self.budget:,} bytes once each "
                     "micro-batch is traced; raise the budget, shorten the sequence, or shrink "
                     "the model")

    def verify_offload(self) -> None:
        """Note: [offload is verified by a trace] The search derives offload variants from the
        trace without offload (``derive``); the ones that reach the table are traced with the
        offload applied (the engine keeps host copies out of the device peak), and their traced
        peak replaces the derived one, or rejects them."""
        per_gpu = self.per_gpu

        def traced(cfg: FitConfig) -> tuple[Any, int] | str:
            t = trace_one(self.base, self.sample_batch, precision=cfg.precision,
                          ckpt=cfg.checkpointing, optimizer=cfg.optimizer,
                          chunked=cfg.chunked_loss, attention=cfg.attention,
                          m=cfg.micro_batch, per_gpu=per_gpu, device=self.device,
                          gpu=self.spec, loss_fn=self.loss_fn, num_gpus=self.num_gpus,
                          offload_activations=cfg.offload_activations,
                          offload_states=cfg.offload_states)
            if isinstance(t, str):
                return t
            return t, self.prefetch_bytes(cfg.micro_batch) + (
                t.peak_accum + rest_of_batch(t, cfg.micro_batch, per_gpu)
                if cfg.accumulation > 1 else t.peak)

        self._verify("memfit fit: tracing the offload candidates", unverified, traced,
                     "traced with offload: peak", lambda t: {"host_bytes": t.host_peak},
                     f"no configuration fits the budget of {self.budget:,} bytes once "
                     "offload is traced; raise the budget, shorten the sequence, or shrink "
                     "the model")

    def _verify(self, title: str, pending: Callable[[Candidate], bool],
                traced: Callable[[FitConfig], tuple[Any, int] | str | None], what: str,
                extra: Callable[[Any], dict[str, Any]], empty: str) -> None:
        """Trace the candidates of the table that ``pending`` marks, best first, one at a
        time: ``traced(cfg)`` gives the trace and its peak (which replaces the derived one, or
        rejects the candidate as ``what`` over the budget), a reason it cannot be traced (the
        candidate is rejected), or None (it keeps its derived peak). The table is ranked again
        after each; ``empty`` is the error when nothing is left."""
        done: set[int] = set()
        with Progress(title, total=None, progress=self.progress, delay=0.5) as verifying:
            while True:
                todo = [i for i, c in enumerate(self.candidates[:self.top])
                        if id(c) not in done and pending(c)]
                if not todo:
                    break
                i = todo[0]
                c = self.candidates[i]
                cfg = c.config
                verifying.phase(cfg.label())
                got = traced(cfg)
                if got is None:
                    done.add(id(c))
                    continue
                if isinstance(got, str):
                    self.rejected.append(Rejected(what=cfg.label(), reason=got))
                    del self.candidates[i]
                    continue
                t, peak = got
                if peak > self.budget:
                    self.rejected.append(Rejected(what=cfg.label(), reason=(
                        f"{what} {over(peak, self.budget)} (after {self.headroom:.0%} "
                        "headroom)"), peak_bytes=peak))
                    del self.candidates[i]
                    continue
                self.candidates[i] = dataclasses.replace(c, peak_bytes=peak, traced=True,
                                                         **extra(t))
                done.add(id(self.candidates[i]))
                self.candidates = rank(self.candidates)
        if not self.candidates:
            raise MemfitError(empty)

    def verify_layouts(self) -> None:
        """Note: [layouts are derived, then traced] Every layout's peak is first derived from
        the one-GPU trace with the formulas (``derive_layout``), which is cheap enough to cost
        every layout of every micro-batch; the multi-GPU candidates that reach the table are
        then traced rank by rank (``memfit.estimate(..., parallel=...)``: PyTorch's own FSDP2 /
        DDP / ZeroRedundancyOptimizer / parallelize_module on the fake model, every distinct
        rank), and the worst rank's peak replaces the derived one, or rejects the candidate.
        A layout the per-rank trace does not run yet keeps its derived peak
        (``Candidate.per_rank`` is False; the plan marks it).

        Known limitation: the branch and bound (Note: [pruning]) counts derived layout
        candidates as settled, so a table that loses candidates to their per-rank traces can
        hold fewer than ``top``; the combinations pruned against them are not revisited."""
        if self.layouts is None:
            return

        def traced(cfg: FitConfig) -> tuple[Any, int] | str | None:
            t = self.rank_trace(cfg)
            if t is None or isinstance(t, str):
                return t
            assert cfg.parallel is not None
            per_rank = self.global_batch // cfg.parallel.dp
            # A pipeline's trace ran the whole step, every micro-batch (layouts.traced_step).
            return t, self.prefetch_bytes(cfg.micro_batch) + (
                t.peak_accum + rest_of_batch(t, cfg.micro_batch, per_rank)
                if cfg.accumulation > 1 and cfg.parallel.pp == 1 else t.peak)

        self._verify("memfit fit: tracing each rank of the layouts that can win",
                     lambda c: not c.per_rank, traced, "traced per rank: worst rank's peak",
                     lambda _t: {"per_rank": True},
                     f"no layout fits the budget of {self.budget:,} bytes once each rank is "
                     "traced; raise the budget, add GPUs, or shorten the sequence")

    def rank_trace(self, cfg: FitConfig) -> Traced | str | None:
        """The per-rank trace of ``cfg``'s step under its layout (cached), the worst rank's;
        None when the layout is one GPU or one the per-rank trace does not run yet."""
        par = cfg.parallel
        if par is None or par.gpus == 1 or not per_rank_traced(par):
            return None
        # fp16-mixed shares bf16-mixed's trace on a GPU that runs both (Note: [fp16 is traced as
        # bf16]), per rank as on one GPU.
        precision = self.traced_precision(cfg.precision)
        rows, traced = traced_step(cfg)
        key = (precision, cfg.checkpointing, cfg.checkpoint_modes, cfg.optimizer,
               cfg.chunked_loss, cfg.attention, rows, traced)
        if key not in self.per_rank_traces:
            t = trace_one(self.base, self.sample_batch, precision=precision,
                          ckpt=cfg.checkpointing, optimizer=cfg.optimizer,
                          chunked=cfg.chunked_loss, attention=cfg.attention,
                          m=rows, per_gpu=self.global_batch // par.dp,
                          device=self.device, gpu=self.spec, loss_fn=self.loss_fn,
                          num_gpus=par.gpus, modes=cfg.checkpoint_modes, parallel=traced)
            # memfit/parallel/apply.py: apply_model refuses the layouts it does not apply yet
            # ("... are traced so far"): those keep the formulas' peak.
            self.per_rank_traces[key] = "" if isinstance(t, str) and "traced so far" in t else t
        found = self.per_rank_traces[key]
        return None if found == "" else found

    def measure_top(self) -> int:
        """Time real steps of the ``top`` candidates and re-rank them by the measured times;
        returns how many times the OOM guard split a micro-batch."""
        from memfit.fitting.measure import measure_candidates

        top = self.candidates[:self.top]
        measured = measure_candidates(self.model, self.sample_batch, top, device=self.device,
                                      global_batch=self.per_gpu, loss_fn=self.loss_fn,
                                      reduction=self.reduction, count_fn=self.count_fn)
        oom_trials = 0
        for i, (seconds, recoveries) in measured.items():
            self.candidates[i] = self.candidates[i].with_measured(seconds)
            oom_trials += recoveries
        head = rank([c for c in self.candidates[:self.top] if c.measured_s is not None],
                    seconds=lambda c: c.measured_s)
        self.candidates = head + [c for c in self.candidates if c not in head]
        return oom_trials


def over(peak: int, budget: int) -> str:
    """``7.86 GiB > budget 7.08 GiB``, in bytes where two decimals cannot tell them apart."""
    shown = format_bytes(peak), format_bytes(budget)
    if shown[0] == shown[1]:
        shown = f"{peak:,} B", f"{budget:,} B"
    return f"{shown[0]} > budget {shown[1]}"
