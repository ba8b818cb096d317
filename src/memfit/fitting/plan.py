"""The result of a fit search: the chosen configuration, runners-up and why others were rejected.

Known limitations: a plan is valid for the model, sample shapes, budget and global batch it was
searched with; ``apply`` does not re-check that the model is the same one.
"""

from __future__ import annotations

import dataclasses
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memfit.errors import MemfitError, read_json_file
from memfit.fitting.config import CHECKPOINTING, FitConfig
from memfit.fitting.cost import StepCost
from memfit.fitting.rates import Rates
from memfit.units import format_bytes, format_seconds

__all__ = ["Candidate", "Plan", "Rejected"]

FORMAT = "memfit-plan/1"

TIE_TOLERANCE = 0.01
"""Step times within 1% of the fastest are a tie (Note: [ties go to the simpler option])."""


TIE_DIGITS = 9
"""Significant digits of a step time that :func:`rank` compares (Note: [tie arithmetic])."""


def tie_time(seconds: float) -> float:
    """``seconds`` rounded to :data:`TIE_DIGITS` significant digits: the time :func:`rank`
    groups ties by.

    Note: [tie arithmetic] Predicted step times are sums of float terms, some from byte counts
    truncated to integers (``int(saved * m / ref_m)``), so one step costed at micro-batches 4
    and 8 can differ by 1e-11 relative; no measurement or rate tells those apart. Rounded to 9
    significant digits (a grid of 1e-9 to 1e-8 relative, far below TIE_TOLERANCE) they are one
    time. Rounding is monotone (``a <= b`` gives ``tie_time(a) <= tie_time(b)``), which the fit
    search's pruning relies on (Note: [pruning] in memfit/fitting/search_bounds.py)."""
    return float(f"{seconds:.{TIE_DIGITS}g}")


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """A configuration predicted to fit, with its predicted peak and step time."""

    config: FitConfig
    peak_bytes: int
    cost: StepCost
    traced: bool = True
    """Whether this micro-batch was traced (False: scaled from a traced one)."""
    measured_s: float | None = None
    """Seconds per optimizer step, measured (``measure=True``)."""
    host_bytes: int = 0
    """Host memory that offload holds at the step's peak (pinned on CUDA), from the trace with
    the offload applied; 0 without offload."""
    per_rank: bool = False
    """Whether ``peak_bytes`` is the worst rank of a per-rank trace of the layout
    (``memfit.estimate(..., parallel=...)``); False: derived from the one-GPU trace with the
    formulas (a layout the per-rank trace does not run, or one that did not reach the table)."""

    @property
    def step_s(self) -> float:
        return self.cost.total_s

    def with_measured(self, seconds: float) -> Candidate:
        return dataclasses.replace(self, measured_s=seconds)

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config.to_dict(), "peak_bytes": self.peak_bytes,
                "cost": self.cost.to_dict(), "traced": self.traced,
                "measured_s": self.measured_s, "host_bytes": self.host_bytes,
                "per_rank": self.per_rank}

    @classmethod
    def from_dict(cls, data: Any, *, gpus: int | None = None) -> Candidate:
        if not isinstance(data, dict):
            raise MemfitError("plan file: each candidate must be a JSON object")
        try:
            cost: dict[str, Any] = {k: float(v) for k, v in data["cost"].items()
                                    if k not in ("total_s", "async_launch")}
            cost["async_launch"] = bool(data["cost"].get("async_launch", True))
            return cls(config=FitConfig.from_dict(data["config"], gpus=gpus),
                       peak_bytes=int(data["peak_bytes"]), cost=StepCost(**cost),
                       traced=bool(data.get("traced", True)),
                       measured_s=(None if data.get("measured_s") is None
                                   else float(data["measured_s"])),
                       host_bytes=int(data.get("host_bytes", 0)),
                       per_rank=bool(data.get("per_rank", False)))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            if isinstance(exc, MemfitError):
                raise
            raise MemfitError(f"plan file: malformed candidate ({exc!s}); re-create it with "
                              "memfit fit --save") from None


def simplicity(config: FitConfig) -> tuple[int, int]:
    """Sort key, simplest first: the number of techniques beyond a plain step (mixed precision,
    checkpointing, an 8-bit optimizer, offload, chunked loss, switched attention, sharding,
    tensor, sequence, loss, pipeline and expert parallelism), then the checkpointing policy,
    none < selective < full < budget."""
    par = config.parallel
    techniques = (config.precision != "fp32", config.checkpointing != "none",
                  config.optimizer.endswith("-8bit"), config.offload_states,
                  config.offload_activations, config.chunked_loss, config.attention != "model",
                  config.sharding != "none", par is not None and par.tp > 1,
                  par is not None and par.pp > 1, par is not None and par.sp,
                  par is not None and par.loss_parallel, par is not None and par.ep > 1)
    return sum(techniques), CHECKPOINTING.index(config.checkpointing)


def rank(candidates: Any, *, seconds: Any = None, tolerance: float = TIE_TOLERANCE
         ) -> list[Candidate]:
    """Candidates in the order the plan shows them: fastest first, where every candidate within
    ``tolerance`` of the fastest remaining one ties with it and the tie goes to the simpler
    option (:func:`simplicity`), then the lower peak, then fewer micro-batches.

    Note: [ties go to the simpler option] The cost model cannot tell 1% apart (its rates are
    measured or catalog figures, its traffic an estimate), so a checkpointing budget that keeps
    a few more blocks than plain selective checkpointing and "wins" by 0.001% is noise: the
    simpler configuration, with fewer ways to go wrong, is the better answer.
    """
    time_of = seconds or (lambda c: c.step_s)
    rest = sorted(candidates, key=time_of)
    out: list[Candidate] = []
    while rest:  # groups by tie_time (Note: [tie arithmetic]); sorted by time, so is tie_time
        limit = tie_time(time_of(rest[0])) * (1 + tolerance)
        n = next((i for i, c in enumerate(rest) if tie_time(time_of(c)) > limit), len(rest))
        group, rest = rest[:n], rest[n:]
        out += sorted(group, key=lambda c: (simplicity(c.config), c.peak_bytes,
                                            c.config.accumulation, time_of(c)))
    return out


def _derived_layout(c: Candidate) -> bool:
    """A multi-GPU candidate whose peak comes from the formulas, not a per-rank trace."""
    par = c.config.parallel
    return par is not None and par.gpus > 1 and not c.per_rank


@dataclass(frozen=True, kw_only=True)
class Rejected:
    """A configuration (or a family of them) that was not chosen, and why."""

    what: str
    reason: str
    peak_bytes: int | None = None


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What :func:`memfit.fit` chose.

    >>> plan = memfit.fit(model, batch, global_batch=64, budget_bytes=2**30, device="cpu")
    >>> print(plan)
    >>> model, optimizer, step = plan.apply(model)
    >>> plan.save("plan.json"); memfit.Plan.load("plan.json") == plan
    True
    """

    chosen: Candidate
    runners_up: tuple[Candidate, ...]
    rejected: tuple[Rejected, ...]
    budget_bytes: int
    global_batch: int
    num_gpus: int
    device: str
    gpu: str | None
    rates_source: str
    headroom: float = 0.0
    """Share of ``budget_bytes`` the search kept free (a candidate fits if its predicted peak is
    at most ``budget_bytes * (1 - headroom)``)."""
    oom_trials: int = 0
    """With ``measure=True``: times the OOM guard split a measured candidate's micro-batch."""
    search_seconds: float = 0.0
    traces: int = 0
    candidates_considered: int = 0
    rates: Rates | None = None
    """The rates the step times were costed at (``rates_source`` says where they came from);
    ``memfit fit --rates plan.json`` and ``fit(..., rates=...)`` pin them for another search.
    None in a plan saved before memfit recorded them."""
    suggestions: tuple[str, ...] = ()
    """Changes outside the searched space that would save memory (one line each): sparse
    gradients where embedding tables dominate the model."""

    @property
    def config(self) -> FitConfig:
        return self.chosen.config

    @property
    def peak_bytes(self) -> int:
        return self.chosen.peak_bytes

    @property
    def step_seconds(self) -> float:
        return self.chosen.step_s

    @property
    def parallel(self) -> Any:
        """The chosen layout as a :class:`memfit.Parallel` (the house's one layout type): the
        one a plan searched with ``gpus=`` chose, or, for a ``num_gpus`` plan, the ZeRO stage
        over every GPU it chose; ``Parallel(gpus=1)`` on one GPU."""
        from memfit.parallel.config import Parallel

        if self.config.parallel is not None:
            return self.config.parallel
        zero = {"zero1": 1, "zero2": 2, "zero3": 3}.get(self.config.sharding)
        return Parallel(gpus=self.num_gpus, zero=zero)

    # -- applying ---------------------------------------------------------------------------

    def apply(self, model: nn.Module, *, loss_fn: Any = None, reduction: str = "mean",
              count_fn: Any = None, log: bool = True
              ) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
        """Apply the chosen configuration to ``model`` (in place) and return ``(model,
        optimizer, step)``; ``step(batch) -> loss`` runs one optimizer step on a global batch
        (split into the plan's micro-batches, OOM-guarded by :func:`memfit.oom_guard.guard`).

        ``loss_fn(model, micro_batch) -> scalar`` returns the micro-batch's mean loss
        (``reduction="mean"``, default; weighted by the micro-batch's share of the items that
        ``count_fn`` counts, default its rows) or the sum of its per-item losses
        (``reduction="sum"``); default: the model's own loss, a mean. A Hugging Face causal LM's
        ``.loss`` averages over tokens: pass ``count_fn=memfit.oom_guard.causal_lm_count``.

        A multi-GPU plan (``memfit.fit(..., gpus=N)``) runs under torchrun: every rank calls
        ``torch.distributed.init_process_group()`` and then ``plan.apply(model)``, gets this
        rank's model and optimizer (:func:`memfit.parallel.apply.apply_model` /
        ``apply_optimizer``, the functions the per-rank trace runs) and feeds ``step`` this
        rank's batch: ``global_batch / dp`` samples, the same ones on the ranks of one
        tensor-parallel group."""
        from memfit.fitting.apply import apply_config

        return apply_config(model, self.config, loss_fn=loss_fn, reduction=reduction,
                            count_fn=count_fn, budget_bytes=self.budget_bytes,
                            log_recoveries=log, num_gpus=self.num_gpus)

    @property
    def per_rank_batch(self) -> int:
        """Samples each data-parallel rank's ``step`` takes: ``global_batch / dp``."""
        par = self.config.parallel
        return self.global_batch // (par.dp if par is not None else self.num_gpus)

    # -- rendering --------------------------------------------------------------------------

    def __str__(self) -> str:
        return self.render()

    def render(self, width: int = 120) -> str:
        """The plan as text tables, ``width`` columns wide (``str(plan)``: 120)."""
        from rich.console import Console
        from rich.table import Table

        buf = io.StringIO()
        console = Console(file=buf, width=width, force_terminal=False, color_system=None)
        where = self.gpu or self.device
        console.print(f"memfit fit: {where}, budget {format_bytes(self.budget_bytes)} "
                      f"({self.headroom:.0%} kept free), global "
                      f"batch {self.global_batch}"
                      + (f" on {self.num_gpus} GPUs" if self.num_gpus > 1 else "")
                      + f"  (searched {self.candidates_considered} configurations, "
                        f"{self.traces} traces, {format_seconds(self.search_seconds)})")
        table = Table(title="fastest configurations that fit", caption=(
            f"predicted steps within {TIE_TOLERANCE:.0%} of each other tie; a tie goes to the "
            "simpler configuration, then the lower peak"))
        shown = (self.chosen, *self.runners_up)
        host = any(c.host_bytes for c in shown)
        measured = any(c.measured_s is not None for c in shown)
        for col in ("", "configuration", "peak", "headroom", "step (pred.)", "vs chosen",
                    *(("measured",) if measured else ()),
                    *(("host (offload)",) if host else ())):
            # Numbers never wrap or get cut; the configuration wraps at its commas.
            table.add_column(col, justify="left" if col in ("", "configuration") else "right",
                             no_wrap=col != "configuration")
        best = self.chosen.step_s
        derived = any(_derived_layout(c) for c in shown)
        if derived:
            table.caption += ("; * a layout the per-rank trace does not run yet: its peak is "
                              "derived with the formulas")
        for i, cand in enumerate(shown):
            table.add_row("chosen" if i == 0 else f"#{i + 1}", cand.config.label(),
                          format_bytes(cand.peak_bytes) + ("*" if _derived_layout(cand) else ""),
                          f"{100 * (1 - cand.peak_bytes / self.budget_bytes):.0f}%",
                          format_seconds(cand.step_s),
                          "" if i == 0 else f"{cand.step_s / best:.2f}x",
                          *(("" if cand.measured_s is None else format_seconds(cand.measured_s),)
                            if measured else ()),
                          *((format_bytes(cand.host_bytes) if cand.host_bytes else "",)
                            if host else ()))
        from memfit._tables import drop_until_whole

        # Narrow terminals: the least useful columns go, then the configurations move under
        # the table (one line each), so that nothing is cut.
        dropped = drop_until_whole(table, console, ("vs chosen", "headroom", "configuration",
                                                    "measured"))
        hidden = [d for d in dropped if d != "configuration"]
        if hidden:
            table.caption += f" (hidden at {width} columns: {', '.join(hidden)})"
        console.print(table)
        if "configuration" in dropped:
            for i, cand in enumerate(shown):
                console.print(f"{'chosen' if i == 0 else f'#{i + 1}'}: {cand.config.label()}")
        c = self.chosen.cost
        parts = ", ".join(f"{name} {format_seconds(v)}" for name, v in (
            ("compute", c.compute_s), ("memory traffic", c.traffic_s),
            ("transfers", c.transfer_s), ("communication", c.comm_s),
            ("optimizer", c.optimizer_s)))
        console.print(f"predicted step of the chosen config: {parts} (dispatch floor "
                      f"{format_seconds(c.dispatch_s)})")
        par = self.config.parallel
        if par is not None and par.gpus > 1:
            how = ("the worst rank of a per-rank trace" if self.chosen.per_rank else
                   "derived with the formulas (the per-rank trace does not run this layout yet)")
            console.print(f"layout: {par.describe()}; peak: {how}")
        console.print(f"rates: {self.rates_source}")
        for line in self.suggestions:
            console.print(f"suggestion: {line}")
        if self.rejected:
            rej = Table(title=f"rejected ({len(self.rejected)}; first 12)")
            rej.add_column("configuration")
            rej.add_column("why")
            for r in self.rejected[:12]:
                rej.add_row(r.what, r.reason)
            console.print(rej)
        return buf.getvalue().rstrip() + "\n"

    # -- persistence ------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "chosen": self.chosen.to_dict(),
                "runners_up": [c.to_dict() for c in self.runners_up],
                "rejected": [dataclasses.asdict(r) for r in self.rejected],
                "budget_bytes": self.budget_bytes, "global_batch": self.global_batch,
                "num_gpus": self.num_gpus, "device": self.device, "gpu": self.gpu,
                "rates_source": self.rates_source,
                "rates": self.rates.to_dict() if self.rates is not None else None,
                "headroom": self.headroom,
                "oom_trials": self.oom_trials,
                "search_seconds": self.search_seconds,
                "traces": self.traces, "candidates_considered": self.candidates_considered,
                "suggestions": list(self.suggestions)}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def from_dict(cls, data: Any, source: str = "plan") -> Plan:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise MemfitError(f"{source}: not a memfit plan (expected a JSON object with "
                              f"\"format\": \"{FORMAT}\"); create one with memfit fit --save")
        try:
            rejected = tuple(Rejected(what=str(r["what"]), reason=str(r["reason"]),
                                      peak_bytes=r.get("peak_bytes"))
                             for r in data.get("rejected", []))
            gpus = int(data["num_gpus"])
            return cls(chosen=Candidate.from_dict(data["chosen"], gpus=gpus),
                       runners_up=tuple(Candidate.from_dict(c, gpus=gpus)
                                        for c in data.get("runners_up", [])),
                       rejected=rejected, budget_bytes=int(data["budget_bytes"]),
                       global_batch=int(data["global_batch"]), num_gpus=int(data["num_gpus"]),
                       device=str(data["device"]), gpu=data.get("gpu"),
                       rates_source=str(data.get("rates_source", "")),
                       rates=Rates.from_dict(data["rates"]) if data.get("rates") else None,
                       headroom=float(data.get("headroom", 0.0)),
                       oom_trials=int(data.get("oom_trials", 0)),
                       search_seconds=float(data.get("search_seconds", 0.0)),
                       traces=int(data.get("traces", 0)),
                       candidates_considered=int(data.get("candidates_considered", 0)),
                       suggestions=tuple(str(x) for x in data.get("suggestions", [])))
        except MemfitError as exc:
            raise MemfitError(f"{source}: {exc}") from None
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise MemfitError(f"{source}: malformed plan ({type(exc).__name__}: {exc}); "
                              "re-create it with memfit fit --save") from None

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a plan saved by :meth:`save` (JSON only, validated)."""
        data = read_json_file(path, what="plan file",
                              fix="re-create it with memfit fit --save")
        return cls.from_dict(data, source=f"plan file {path}")
