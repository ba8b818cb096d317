"""The fit search: every technique combination x micro-batch, memory from the trace engine, time
from the cost model (:mod:`memfit.fitting.cost`).

Per technique combination, memory falls as the micro-batch shrinks and (in the cost model) time
never rises as it grows, so the search binary-searches the largest micro-batch that fits (a
micro-batch that does not fit rules out every larger one: monotonicity) and costs the smaller
ones from the traced ones (FLOPs and saved activations scale linearly with the micro-batch).
Traces are cached per (precision, checkpointing, optimizer, loss, attention, micro-batch).

Activation offload, optimizer-state offload and ZeRO sharding are first derived analytically
from the trace's timeline (see ``_derive``); the offload configurations that reach the table are
then traced with the offload applied, and that peak replaces the derived one (Note: [offload is
verified by a trace]). ZeRO sharding stays analytic.

Most of the search's time is its traces (97% of the README's GPT-2 search, cProfile). It runs
fewer of them without changing the answer: fp16-mixed shares bf16-mixed's traces on a CUDA
target (Note: [fp16 is traced as bf16]), and a combination is not traced when ``top`` settled
candidates are ranked ahead of anything it could give (Note: [pruning]), by a bound that is the
cost model's own arithmetic (Note: [traffic bound], Note: [model-state bound]).
``_Search.prune = False`` with ``share_traces = False`` is the exhaustive search the tests
compare with (``tests/test_fit_prune.py``).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import itertools
import os
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from memfit import vocab
from memfit._loss import LossFn, check_loss_fn, check_reduction, model_loss
from memfit._tensors import meta_batch, tensor_leaves
from memfit.categories import MemoryCategory
from memfit.errors import MemfitError, suggest
from memfit.fitting.apply import apply_techniques, check_shardable
from memfit.fitting.config import (
    CHECKPOINTING,
    LAYOUT_SHARDING,
    PRECISIONS,
    SHARDING,
    FitConfig,
    sharding_of,
)
from memfit.fitting.cost import StepCost, step_cost
from memfit.fitting.layouts import (
    ModelShape,
    activation_factor,
    check_gpus,
    layouts,
    model_shape,
    pipeline_in_flight,
    pipeline_runs,
    root_split,
    schedule_searched,
    traced_step,
)
from memfit.fitting.plan import (
    TIE_TOLERANCE,
    Candidate,
    Plan,
    Rejected,
    rank,
    simplicity,
    tie_time,
)
from memfit.fitting.rates import Rates, target_rates
from memfit.gpus import GpuSpec, get_gpu
from memfit.parallel.config import Parallel
from memfit.progress import Progress, phase
from memfit.trace.allocator import round_size
from memfit.trace.estimate import TRACE_FITS_MARGIN, TRACKED
from memfit.units import format_bytes, format_seconds

TRACKED_INDEX = {cat: i for i, cat in enumerate(TRACKED)}

__all__ = ["SPACE_KEYS", "fit"]

SPACE_KEYS = ("precision", "checkpointing", "micro_batch", "optimizer", "offload_states",
              "offload_activations", "chunked_loss", "attention", "sharding", "tp", "pp")
_EIGHT_BIT = {"adamw": "adamw-8bit", "adam": "adamw-8bit"}
ENGINE_FAILED = "the trace engine could not run this combination"


@dataclass(frozen=True)
class _Traced:
    peak: int
    """Bytes compared to the budget (total on CUDA, peak on CPU)."""
    weights: int
    grads: int
    states: int
    peak_wo_states: int
    """The step's peak with the optimizer's states and step on the host."""
    peak_accum: int
    """The peak when gradients of earlier micro-batches are alive during forward and backward
    (accumulation > 1)."""
    peak_accum_wo_states: int
    activations_at_peak: int
    largest_module_activations: int
    saved_activations: int
    ops_per_micro: int
    checkpoint_modes: tuple[str | None, ...] | None
    checkpoint_budget: int | None
    host_peak: int = 0
    """Host memory the step's offload holds at its peak (traced with offload only)."""
    input_bytes: int = 0
    """Bytes of the traced micro-batch's tensors (the step holds the whole per-GPU batch)."""


def _meta_copy(model: nn.Module) -> nn.Module:
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"),
                                   requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def _leading(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            raise MemfitError("sample_batch tensors need a batch dimension first")
        return int(batch.shape[0])
    values = list(batch.values()) if isinstance(batch, dict) else batch
    if isinstance(values, list | tuple):
        for v in values:
            if isinstance(v, torch.Tensor | dict | list | tuple):
                return _leading(v)
    raise MemfitError(f"sample_batch must be a tensor or a tuple/list/dict of tensors, not "
                      f"{type(batch).__name__}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _space(space: dict[str, Any] | None, defaults: dict[str, list[Any]]) -> dict[str, list[Any]]:
    out = dict(defaults)
    for key, values in (space or {}).items():
        if key not in SPACE_KEYS:
            raise MemfitError(f"unknown search-space key {key!r}{suggest(key, SPACE_KEYS)}; "
                              f"valid: {', '.join(SPACE_KEYS)}")
        if not isinstance(values, list | tuple) or not values:
            raise MemfitError(f"space[{key!r}] must be a non-empty list of values")
        out[key] = list(values)
    return out


def fit(model: nn.Module, sample_batch: Any, *, optimizer: str = "adamw", global_batch: int,
        gpu: str | GpuSpec | None = None, budget_bytes: int | None = None,
        device: str = "cuda", loss_fn: LossFn | None = None, reduction: str = "mean",
        count_fn: Callable[[Any], Any] | None = None,
        num_gpus: int = 1, measure: bool = False, space: dict[str, Any] | None = None,
        progress: bool | None = None, top: int = 5, headroom: float | None = None,
        gpus: int | None = None, gpus_per_node: int | None = None,
        rates: Rates | Mapping[str, Any] | str | os.PathLike[str] | None = None) -> Plan:
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
    is per GPU. ``num_gpus=N`` is the older search: ZeRO over every GPU, no tp or pp.

    ``rates``: what the step times are costed at (:func:`memfit.fitting.rates.target_rates`):
    default the catalog's for a GPU and, on ``device="cpu"``, this machine's, measured once and
    kept on disk; a :class:`memfit.fitting.Rates`, a dict such as ``{"flops": 113e9,
    "bandwidth": 20e9, "launch_s": 4e-6}`` or a rates file's path pins them (Note: [rates do
    not move with the load]). ``plan.rates`` holds those used, ``plan.rates_source`` where
    they came from.

    >>> plan = fit(model, (x, y), global_batch=64, budget_bytes=2**30, device="cpu")
    >>> model, optimizer, step = plan.apply(model)
    """
    return _Search(model, sample_batch, optimizer=optimizer, global_batch=global_batch, gpu=gpu,
                   budget_bytes=budget_bytes, device=device, loss_fn=loss_fn,
                   reduction=reduction, count_fn=count_fn, num_gpus=num_gpus, measure=measure,
                   space=space, progress=progress, top=top, headroom=headroom, gpus=gpus,
                   gpus_per_node=gpus_per_node, pinned=rates).run()


Combo = tuple[str, str, str, bool, str]
"""(precision, checkpointing, optimizer, chunked loss, attention): a technique combination, the
search's unit of work (its micro-batches, offload and sharding variants follow from its
traces)."""


class _Search:
    """One :func:`fit` call: the checked inputs, the caches, and the search's steps.

    ``run`` orders the combinations by their lower bound (``lower_bound``), explores each one
    (``explore``: the largest micro-batch that fits, by ``trace``; every fitting micro-batch and
    variant costed by ``candidates_at``), ranks (``memfit.fitting.plan.rank``), traces the offload
    candidates that reach the table (``verify_offload``) and, with ``measure=True``, times them
    (``measure_top``).
    """

    traffic_bound = True
    """Prune by compute + activation traffic (Note: [traffic bound]); False: by FLOPs alone
    (``bench/fit.py --search --baseline`` times both in one run)."""
    prune = True
    """Branch and bound (Note: [pruning]); False: every combination is explored, the exhaustive
    search the tests compare the pruned one with."""
    simpler_first = True
    """Prune what can at best tie with ``top`` simpler candidates (Note: [pruning], rule 2)."""
    tie_arithmetic = True
    """Prune by :func:`memfit.fitting.plan.tie_time`, the time ``rank`` groups by (Note:
    [pruning]); False: by raw float times, as before (prunes less; kept so that the tests
    show what the raw comparison kept)."""
    share_traces = True
    """Trace fp16-mixed as bf16-mixed on a CUDA target that runs both (Note: [fp16 is traced as
    bf16])."""

    def __init__(self, model: nn.Module, sample_batch: Any, *, optimizer: str,
                 global_batch: int, gpu: str | GpuSpec | None, budget_bytes: int | None,
                 device: str, loss_fn: LossFn | None, reduction: str,
                 count_fn: Callable[[Any], Any] | None, num_gpus: int, measure: bool,
                 space: dict[str, Any] | None, progress: bool | None, top: int,
                 headroom: float | None, gpus: int | None = None,
                 gpus_per_node: int | None = None,
                 pinned: Rates | Mapping[str, Any] | str | os.PathLike[str] | None = None
                 ) -> None:
        self.started = time.perf_counter()
        self.layouts: list[Parallel] | None = None
        """With ``gpus=``: the layouts searched (Note: [layouts are derived, then traced])."""
        if gpus is not None or gpus_per_node is not None:
            if num_gpus != 1 and gpus is not None:
                raise MemfitError("give gpus= (layouts searched) or num_gpus= (ZeRO only), not "
                                  "both")
            if gpus is None:
                raise MemfitError("gpus_per_node needs gpus=N (the GPUs in all)")
            check_gpus(gpus, gpus_per_node)
            if measure and gpus > 1:
                raise MemfitError("measure=True times steps on this one device; with gpus > 1 "
                                  "drop measure (time the plan under torchrun instead)")
            num_gpus = gpus
        if not isinstance(model, nn.Module):
            raise MemfitError(f"model must be a torch.nn.Module, not {type(model).__name__}")
        check_loss_fn(loss_fn)
        check_reduction(reduction)
        if device not in ("cuda", "cpu"):
            raise MemfitError(f"device must be 'cuda' or 'cpu', got {device!r}")
        if isinstance(global_batch, bool) or not isinstance(global_batch, int) \
                or global_batch < 1:
            raise MemfitError(f"global_batch must be a positive integer, got {global_batch!r}")
        if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 1:
            raise MemfitError(f"num_gpus must be a positive integer, got {num_gpus!r}")
        if global_batch % num_gpus and gpus is None:
            raise MemfitError(f"global_batch {global_batch} is not divisible by num_gpus "
                              f"{num_gpus}; pick a multiple")
        spec = get_gpu(gpu) if isinstance(gpu, str) else gpu
        if device == "cpu" and spec is not None:
            raise MemfitError("device='cpu' takes budget_bytes, not gpu=; drop gpu or use "
                              "device='cuda'")
        if budget_bytes is not None and (isinstance(budget_bytes, bool)
                                         or not isinstance(budget_bytes, int)
                                         or budget_bytes <= 0):
            raise MemfitError(f"budget_bytes must be a positive integer, got {budget_bytes!r}")
        if spec is None and budget_bytes is None:
            raise MemfitError("give a budget: gpu='a100-40gb' (see `memfit gpus`) or "
                              "budget_bytes=...")
        if headroom is None:
            headroom = TRACE_FITS_MARGIN if device == "cuda" else 0.05
        if isinstance(headroom, bool) or not isinstance(headroom, int | float) \
                or not 0 <= headroom < 1:
            raise MemfitError(f"headroom must be a fraction in [0, 1), got {headroom!r}")
        self.full_budget = min(b for b in (budget_bytes, spec.usable_bytes if spec else None)
                               if b)
        # Note: [headroom] A candidate must fit in the budget less the headroom. On the CPU the
        # applied step measures within 0.5% of the plan (tests/test_fit.py), so 5% is ample. On
        # CUDA the default is the trace's margin, derived from its worst under-prediction of a
        # published GPU measurement (TRACE_FITS_MARGIN); the OOM guard, not a crash, handles
        # what is still missed.
        self.budget = int(self.full_budget * (1 - headroom))
        # Note: [rates do not move with the load] (fitting/rates.py): the catalog's, this
        # CPU's measured once and kept on disk, or the caller's.
        rates = target_rates(device, spec, pinned)
        self.model, self.sample_batch, self.loss_fn = model, sample_batch, loss_fn
        self.reduction, self.count_fn, self.measure = reduction, count_fn, measure
        self.device, self.spec, self.rates, self.headroom = device, spec, rates, headroom
        self.global_batch, self.num_gpus, self.top = global_batch, num_gpus, top
        self.progress = progress
        self.per_gpu = global_batch // num_gpus
        _leading(sample_batch)
        self.base = _meta_copy(model)
        self.rejected: list[Rejected] = []
        self.shape: ModelShape | None = None
        self.gpus_per_node = gpus_per_node
        layout_space: dict[str, list[Any]] = {}
        if gpus is not None:
            layout_space = {k: list(v) for k, v in _space(
                {k: v for k, v in (space or {}).items() if k in ("tp", "pp", "sharding")},
                {}).items()}
            for value in layout_space.get("sharding", []):
                if value not in LAYOUT_SHARDING:
                    raise MemfitError(f"space sharding {value!r} is not one of "
                                      f"{', '.join(LAYOUT_SHARDING)}")
            self.shape = model_shape(self.base, _seq_of(sample_batch))
            found = layouts(gpus=gpus, gpus_per_node=gpus_per_node, global_batch=global_batch,
                            shape=self.shape, space=layout_space, rejected=self.rejected)
            if gpus > 1:
                self.layouts = found
                # Micro-batches divide the largest per-rank batch (the fewest data-parallel
                # ranks).
                self.per_gpu = global_batch // min(p.dp for p in self.layouts)
                self.rejected.append(Rejected(what="offload with a multi-GPU layout", reason=(
                    "not searched: FSDP2's CPUOffloadPolicy, which neither the per-rank trace "
                    "nor Plan.apply runs yet")))
        elif space and ("tp" in space or "pp" in space):
            raise MemfitError("space tp/pp need gpus=N (the layout search)")
        defaults = _default_space(self.base, optimizer, device, spec, num_gpus, self.per_gpu,
                                  self.rejected)
        if self.layouts is not None:
            defaults["sharding"] = list(LAYOUT_SHARDING)
        self.dims = _space({k: v for k, v in (space or {}).items() if k not in ("tp", "pp")},
                           defaults)
        self.eager = _uses_eager_attention(self.base)
        self.per_rank_traces: dict[tuple[Any, ...], _Traced | str] = {}
        """By (config, layout): the per-rank traces run (Note: [layouts are derived, then
        traced])."""
        for m in self.dims["micro_batch"]:
            if isinstance(m, bool) or not isinstance(m, int) or m < 1 or self.per_gpu % m:
                raise MemfitError(f"space micro_batch {m!r} must divide the per-GPU batch "
                                  f"{self.per_gpu}")
        self.micro_batches = sorted(set(self.dims["micro_batch"]))
        self.traces: dict[tuple[Any, ...], _Traced | str] = {}
        """By (combination, micro-batch): what the search uses (shared traces appear twice)."""
        self.runs: dict[tuple[Any, ...], _Traced | str] = {}
        """By (combination as traced, micro-batch): the traces run."""
        self.flops_at: dict[tuple[Any, ...], float] = {}
        self.candidates: list[Candidate] = []
        self.skipped: dict[Combo, dict[int, float]] = {}
        """The combinations pruned without a trace, with their bounds by micro-batch."""

    # -- memory: traces ------------------------------------------------------------------------

    def trace(self, combo: Combo, m: int) -> _Traced | str:
        """The combination's step traced at micro-batch ``m`` (cached; fp16-mixed shares
        bf16-mixed's trace, Note: [fp16 is traced as bf16])."""
        key = (*combo, m)
        if key not in self.traces:
            precision, ckpt, opt, chunked, attention = combo
            precision = self.traced_precision(precision)
            run = (precision, *combo[1:], m)
            if run not in self.runs:
                phase(f"tracing {precision}, ckpt={ckpt}, {opt}"
                      f"{', chunked loss' if chunked else ''}"
                      f"{', sdpa' if attention == 'sdpa' else ''}, micro-batch {m}")
                self.runs[run] = _trace_one(
                    self.base, self.sample_batch, precision=precision, ckpt=ckpt,
                    optimizer=opt, chunked=chunked, attention=attention, m=m,
                    per_gpu=self.per_gpu, device=self.device, gpu=self.spec,
                    loss_fn=self.loss_fn, num_gpus=self.num_gpus, device_budget=self.budget)
            self.traces[key] = self.runs[run]
        return self.traces[key]

    def traced_precision(self, precision: str) -> str:
        """The precision ``precision``'s step is traced with.

        Note: [fp16 is traced as bf16] On a CUDA target, fp16-mixed and bf16-mixed run the same
        step: CUDA autocast has one set of op lists for both lower-precision dtypes (the
        ``lower_precision_fp`` policy casts to the autocast dtype, whichever it is:
        ``aten/src/ATen/autocast_mode.h: WrapFunction_<CastPolicy::lower_precision_fp>`` casts
        to ``get_lower_precision_fp_from_device_type(CUDA)``, which is
        ``get_autocast_gpu_dtype()``; the list is ``AT_FORALL_LOWER_PRECISION_FP``, registered
        once for CUDA in ``autocast_mode.cpp: TORCH_LIBRARY_IMPL(aten, Autocast, m)``),
        both dtypes are 2 bytes, the fp32 master weights, gradients and optimizer states do not
        depend on it, and the one place the trace engine branches on the half dtype, the SDPA
        kernel choice (``sdp_utils.cpp: check_tensor_dtype``, ``check_dtypes_low_precision``:
        bf16 needs sm80+), accepts both on a GPU that runs bf16-mixed. So one trace serves both
        (``tests/test_fit_search.py`` traces both and compares them). GradScaler's state (a
        scale and a growth tracker, two scalars) is not in the trace of either. On the CPU only
        bf16-mixed is searched (the CPU kernels' scratch differs by dtype)."""
        if (self.share_traces and precision == "fp16-mixed" and self.device == "cuda"
                and self.spec is not None and self.spec.supports("bf16-mixed")):
            return "bf16-mixed"
        return precision

    def traced(self, combo: Combo, m: int) -> _Traced | str | None:
        """The cached trace, None when ``m`` was not traced."""
        return self.traces.get((*combo, m))

    def derive(self, t: _Traced, ref_m: int, m: int, offload_states: bool,
               offload_activations: bool, sharding: str, par: Parallel | None = None,
               per_rank: int | None = None, attention: str = "model") -> int:
        if par is None:
            return _derive(t, ref_m, m, offload_states, offload_activations, sharding,
                           self.num_gpus, self.per_gpu)
        units = (self.shape.unit_shares(par.tp, par.pp, root_split(par))
                 if self.shape is not None else (0.0, 0.0))
        if par.ep > 1 and self.shape is not None:  # a block gathers 1/ep of its experts
            block, root = units
            units = (block - self.shape.expert_share() / self.shape.layers * (1 - 1 / par.ep),
                     root)
        peak = _derive_layout(t, ref_m, m, offload_states, offload_activations, sharding, par,
                              per_rank or self.per_gpu, self.share(par),
                              self.act_factor(par, attention), units)
        if par.tp > 1 and not par.loss_parallel:
            # Without loss parallelism the logits are whole on every rank (the head replicated,
            # or all-gathering them under sequence parallelism), and the loss upcasts them;
            # act_factor shrank them with the rest (Korthikanti's equations count the blocks
            # only). Added back as fp32 logits and fp32 log-probabilities.
            peak += int(self.logits_bytes(m, 4) * 2 * (1 - self.act_factor(par, attention)))
        return peak

    def share(self, par: Parallel) -> float:
        """The share of the parameters the most loaded rank of ``par`` holds before
        data-parallel sharding (expert parallelism under DDP: ``1/ep`` of the experts; under
        FSDP2 every parameter ends up ``1/dp`` either way, so the sharding accounts for it)."""
        share = (self.shape.param_share(par.tp, par.pp, root_split(par))
                 if self.shape is not None else 1.0)
        if par.ep > 1 and sharding_of(par) == "none" and self.shape is not None:
            share -= self.shape.expert_share() * (1 - 1 / par.ep)
        return share

    def act_factor(self, par: Parallel, attention: str) -> float:
        return activation_factor(par.tp, eager=attention == "model" and self.eager,
                                 shape=self.shape, sp=par.sp)

    def logits_bytes(self, m: int, element: int) -> int:
        """A micro-batch's logits, ``m x seq x vocab`` elements of ``element`` bytes; 0 when
        unknown."""
        shape = self.shape
        if shape is None or not shape.seq or not shape.vocab:
            return 0
        return m * shape.seq * shape.vocab * element

    def layout_bytes(self, precision: str, m: int, par: Parallel) -> dict[str, Any]:
        """:func:`memfit.fitting.cost.layout_comm`'s sizes for the head, the loss and the
        experts of a micro-batch of ``m`` under ``par``."""
        shape = self.shape
        if shape is None:
            return {}
        element = vocab.precision(precision).compute_bytes
        tokens = m * (shape.seq or 0)
        out: dict[str, Any] = {"logits_bytes": self.logits_bytes(m, element), "tokens": tokens}
        if par.ep > 1 and shape.experts and shape.hidden:
            # memfit/models/build.py: MoE.capacity (capacity factor 1.0): each expert's buffer
            # holds ceil(tokens k / E) slots; one layer's buffers, E x capacity x hidden.
            experts = max(shape.experts)
            capacity = max(1, min(tokens, -(-tokens * shape.top_k // experts)))
            # The experts' share of the rank's parameter bytes the cost is given (self.share:
            # under DDP the rank holds 1/ep of the experts, under FSDP2 all before sharding).
            share = shape.expert_share()
            if sharding_of(par) == "none":
                share = share / par.ep / self.share(par)
            out.update(moe_layers=len(shape.experts), expert_share=share,
                       exchange_bytes=experts * capacity * shape.hidden * element)
        return out

    def variants(self, m: int) -> list[tuple[bool, bool, str, Parallel | None, int]]:
        """(offload states, offload activations, sharding, layout, per-rank batch) of the
        variants at micro-batch ``m``: the offload x sharding product on one GPU or with
        ``num_gpus``; with ``gpus=``, every layout whose per-rank batch ``m`` divides (offload
        only on one GPU)."""
        offloads = list(itertools.product(self.dims["offload_states"],
                                          self.dims["offload_activations"]))
        if self.layouts is None:
            return [(s, a, z, None, self.per_gpu) for s, a in offloads
                    for z in self.dims["sharding"]]
        out = []
        for par in self.layouts:
            per_rank = self.global_batch // par.dp
            if per_rank % m == 0 and sharding_of(par) in self.dims["sharding"] \
                    and schedule_searched(par, per_rank // m):
                out += [(False, False, sharding_of(par), par, per_rank)]
        return out

    def lowest_variant(self, t: _Traced, m: int, attention: str = "model") -> int:
        """The derived peak of the most memory-saving offload/sharding variant at ``m``."""
        return min((self.derive(t, m, m, s, a, z, par, per_rank, attention)
                    for s, a, z, par, per_rank in self.variants(m)), default=2**62)

    def boundary_bytes(self, precision: str, m: int) -> int:
        """One block's input for a micro-batch of ``m``: what a tensor-parallel all-reduce and a
        pipeline send move (``m x seq x hidden`` at 2 bytes, 4 in fp32); 0 when unknown."""
        shape = self.shape
        if shape is None or not shape.seq or not shape.hidden:
            return 0
        return m * shape.seq * shape.hidden * vocab.precision(precision).compute_bytes

    def cost(self, *, precision: str, micro_flops: float, m: int, traffic: int, offloaded: int,
             ops: int, weights: int, grads: int, states: int, off_s: bool, off_a: bool,
             shard: str, par: Parallel | None, per_rank: int, attention: str) -> StepCost:
        """``step_cost`` of a variant; with a layout, of its most loaded rank (the parameter
        share and activation factor of :mod:`memfit.fitting.layouts`)."""
        if par is None:
            return step_cost(
                self.rates, precision=precision, micro_flops=micro_flops,
                accumulation=self.per_gpu // m, activation_traffic_bytes=traffic,
                offloaded_bytes=offloaded, ops_per_micro=ops, param_bytes=weights,
                grad_bytes=grads, state_bytes=states, offload_activations=off_a,
                offload_states=off_s, sharding=shard, num_gpus=self.num_gpus)
        share = self.share(par)
        act = self.act_factor(par, attention) / par.pp
        return step_cost(
            self.rates, precision=precision, micro_flops=micro_flops,
            accumulation=per_rank // m, activation_traffic_bytes=int(traffic * act),
            offloaded_bytes=int(offloaded * act), ops_per_micro=-(-ops // par.pp),
            param_bytes=int(weights * share), grad_bytes=int(grads * share),
            state_bytes=int(states * share), offload_activations=off_a, offload_states=off_s,
            sharding=shard, num_gpus=self.num_gpus, parallel=par,
            boundary_bytes=self.boundary_bytes(precision, m),
            layers=self.shape.layers if self.shape is not None else 1,
            layout_bytes=self.layout_bytes(precision, m, par))

    # -- time: FLOPs, traffic, bounds ----------------------------------------------------------

    def flops(self, ckpt: str, modes: Any, chunked: bool, attention: str, m: int) -> float:
        """FLOPs of one micro-batch of ``m`` (one sample's, counted once, times ``m``)."""
        key = (ckpt, modes, chunked, attention)
        if key not in self.flops_at:
            cfg = FitConfig(checkpointing=ckpt if ckpt != "budget" else "full",
                            chunked_loss=chunked, attention=attention)
            if ckpt == "budget":
                cfg = FitConfig(checkpointing="budget", checkpoint_budget_bytes=1,
                                checkpoint_modes=modes, chunked_loss=chunked,
                                attention=attention)
            try:
                self.flops_at[key] = _count_flops(self.base, self.sample_batch, cfg,
                                                  self.loss_fn)[0]
            except RuntimeError:
                # Some models cannot be recomputed under the FLOP counter (selective
                # checkpointing's cache sees different ops): count the plain step and add the
                # forward of the fully checkpointed share of the blocks (selective recomputes
                # no matmul: + 0).
                plain_total, plain_forward = _count_flops(
                    self.base, self.sample_batch,
                    FitConfig(chunked_loss=chunked, attention=attention), self.loss_fn)
                share = (sum(mode == "full" for mode in modes) / len(modes)) if modes else 0.0
                self.flops_at[key] = plain_total + share * plain_forward
        return self.flops_at[key] * m

    def activation_traffic(self, combo: Combo, ref: _Traced, ref_m: int, m: int,
                           micro_flops: float) -> int:
        """Bytes of activations one micro-batch writes in the forward: what the step saves
        without checkpointing (checkpointing saves less but writes the same, and its recompute
        writes again, in proportion to the FLOPs it adds)."""
        _, _, _, chunked, attention = combo
        sibling = self.plain_sibling(combo)
        if sibling is None:
            return int(ref.saved_activations * m / ref_m)
        plain, plain_m = sibling
        plain_flops = self.flops("none", None, chunked, attention, m)
        return int(plain.saved_activations * m / plain_m * micro_flops / max(plain_flops, 1.0))

    def plain_sibling(self, combo: Combo) -> tuple[_Traced, int] | None:
        """The trace :meth:`activation_traffic` takes the activation traffic of ``combo`` from:
        the first traced micro-batch of the same combination without checkpointing."""
        precision, _, opt, chunked, attention = combo
        return next(((v, k[5]) for k, v in self.traces.items()
                     if k[:5] == (precision, "none", opt, chunked, attention)
                     and not isinstance(v, str)), None)

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
        before ``combo`` is traced (``tests/test_fit_search.py`` checks that siblings agree).
        The bound is then ``step_cost`` itself with no activation transfer (>= 0) and the plain
        sibling's ops per micro-batch for the dispatch (checkpointing only adds ops: the
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
        sibling = self.plain_sibling(combo) if self.traffic_bound else None
        states = self.model_states(precision, opt) if self.traffic_bound else None
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

    # -- the search ----------------------------------------------------------------------------

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
                    candidates_considered=len(cands) + len(self.rejected))

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
        table is full) or one heads it at the same time. ``tests/test_fit_search.py`` compares
        the search with the exhaustive one (``prune = False``) and checks every pruned
        combination's candidates against its bound."""
        precision, ckpt, opt, chunked, _ = combo
        top = self.top
        by_m = self.bounds(combo) if self.prune else {}
        if by_m:
            bound = max(flop_bound, min(by_m.values()))
            settled = [c for c in self.candidates if not _unverified(c)]
            floor = self.simplest(combo)

            tt = tie_time if self.tie_arithmetic else float
            times = [tt(c.cost.total_s) for c in settled]

            def ahead(m_bound: float) -> tuple[int, int]:
                """Settled candidates ranked ahead of one at ``m_bound`` or slower, by rule
                (in ``tie_time``, as ``rank`` compares)."""
                at_least = tt(max(m_bound, bound))
                at_m = tt(m_bound)
                slower = sum(1 for t in times if t * (1 + TIE_TOLERANCE) < at_least)
                simpler = sum(1 for t, c in zip(times, settled, strict=True)
                              if t * (1 + TIE_TOLERANCE) >= at_least
                              and t <= at_m and self.simpler_first
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

    def explore(self, combo: Combo) -> None:
        """Find the combination's largest fitting micro-batch and cost every micro-batch and
        variant of it that fits (rejections recorded)."""
        precision, ckpt, opt, chunked, attention = combo
        micro_batches = self.micro_batches
        largest = _largest_fitting(micro_batches, lambda m: self.trace(combo, m), self.budget,
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

    def candidates_at(self, combo: Combo, m: int, ref: _Traced, ref_m: int, what: str, *,
                      traced: bool) -> None:
        """Cost each offload/sharding variant of ``combo`` at micro-batch ``m`` from the trace
        ``ref`` at ``ref_m``: those that fit become candidates, the others are rejected."""
        precision, ckpt, opt, chunked, attention = combo
        plain = _plain_policy(ckpt, ref.checkpoint_modes)
        if plain is not None and plain in self.dims["checkpointing"]:
            self.rejected.append(Rejected(what=f"{what}, ckpt=budget", reason=(
                f"the budget resolves to ckpt={plain} for every block: the same as "
                f"ckpt={plain}, searched on its own")))
            return
        for off_s, off_a, shard, par, per_rank in self.variants(m):
            cfg = FitConfig(precision=precision, checkpointing=plain or ckpt,
                            checkpoint_budget_bytes=_scaled(ref.checkpoint_budget, m, ref_m,
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
                    f"predicted peak {_over(peak, self.budget)} (after {self.headroom:.0%} "
                    "headroom)"), peak_bytes=peak))
                continue
            micro_flops = self.flops(plain or ckpt, None if plain else ref.checkpoint_modes,
                                     chunked, attention, m)
            cost = self.cost(
                precision=precision, micro_flops=micro_flops, m=m,
                traffic=self.activation_traffic(combo, ref, ref_m, m, micro_flops),
                offloaded=int(ref.saved_activations * m / ref_m), ops=ref.ops_per_micro,
                weights=ref.weights, grads=ref.grads, states=ref.states, off_s=off_s,
                off_a=off_a, shard=shard, par=par, per_rank=per_rank, attention=attention)
            self.candidates.append(Candidate(config=cfg, peak_bytes=peak, cost=cost,
                                             traced=traced))

    def verify_micro_batches(self) -> None:
        """Note: [derived micro-batches are verified by a trace] A micro-batch below the
        largest one traced is costed from that trace (``_derive``), which is cheap enough for
        every micro-batch but over-states it (by 3 to 29% in 12 fp32 and bf16-mixed cases of
        ``tests/test_fit.py``'s classifier): it takes the traced step's accumulating peak less
        the activations alive at its one-step peak, and that peak is often the optimizer's
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
            return not c.traced and not _unverified(c) and (par is None or par.gpus == 1)

        def traced(cfg: FitConfig) -> tuple[Any, int] | str:
            precision = self.traced_precision(cfg.precision)
            # One trace per step (the sharding variants of a micro-batch share it), counted
            # with the search's.
            run = (precision, cfg.checkpointing, cfg.checkpoint_modes, cfg.optimizer,
                   cfg.chunked_loss, cfg.attention, cfg.micro_batch)
            if run not in self.runs:
                self.runs[run] = _trace_one(
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
        trace without offload (``_derive``); the ones that reach the table are traced with the
        offload applied (the engine keeps host copies out of the device peak), and their traced
        peak replaces the derived one, or rejects them."""
        per_gpu = self.per_gpu

        def traced(cfg: FitConfig) -> tuple[Any, int] | str:
            t = _trace_one(self.base, self.sample_batch, precision=cfg.precision,
                           ckpt=cfg.checkpointing, optimizer=cfg.optimizer,
                           chunked=cfg.chunked_loss, attention=cfg.attention,
                           m=cfg.micro_batch, per_gpu=per_gpu, device=self.device,
                           gpu=self.spec, loss_fn=self.loss_fn, num_gpus=self.num_gpus,
                           offload_activations=cfg.offload_activations,
                           offload_states=cfg.offload_states)
            if isinstance(t, str):
                return t
            return t, (t.peak_accum + _rest_of_batch(t, cfg.micro_batch, per_gpu)
                       if cfg.accumulation > 1 else t.peak)

        self._verify("memfit fit: tracing the offload candidates", _unverified, traced,
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
                        f"{what} {_over(peak, self.budget)} (after {self.headroom:.0%} "
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
        the one-GPU trace with the formulas (``_derive_layout``), which is cheap enough to cost
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
            return t, (t.peak_accum + _rest_of_batch(t, cfg.micro_batch, per_rank)
                       if cfg.accumulation > 1 and cfg.parallel.pp == 1 else t.peak)

        self._verify("memfit fit: tracing each rank of the layouts that can win",
                     lambda c: not c.per_rank, traced, "traced per rank: worst rank's peak",
                     lambda _t: {"per_rank": True},
                     f"no layout fits the budget of {self.budget:,} bytes once each rank is "
                     "traced; raise the budget, add GPUs, or shorten the sequence")

    def rank_trace(self, cfg: FitConfig) -> _Traced | str | None:
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
            t = _trace_one(self.base, self.sample_batch, precision=precision,
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


def _unverified(c: Candidate) -> bool:
    """Whether ``c``'s peak is derived for an offload that :meth:`_Search.verify_offload`
    traces once the search is done (it may yet be rejected)."""
    return (c.config.offload_activations or c.config.offload_states) \
        and c.config.sharding == "none"


def _over(peak: int, budget: int) -> str:
    """``7.86 GiB > budget 7.08 GiB``, in bytes where two decimals cannot tell them apart."""
    shown = format_bytes(peak), format_bytes(budget)
    if shown[0] == shown[1]:
        shown = f"{peak:,} B", f"{budget:,} B"
    return f"{shown[0]} > budget {shown[1]}"


def _plain_policy(ckpt: str, modes: tuple[str | None, ...] | None) -> str | None:
    """The plain policy a checkpointing budget resolved to when it chose the same for every
    block (``none`` when it checkpoints nothing); None when it mixes policies, or is not a
    budget."""
    if ckpt != "budget" or not modes or len(set(modes)) != 1:
        return None
    return modes[0] or "none"


def _scaled(ckpt_budget: int | None, m: int, ref_m: int, plain: str | None) -> int | None:
    """The activation budget of a micro-batch costed from a traced ``ref_m`` (activations scale
    with the micro-batch); None for a plain policy."""
    if ckpt_budget is None or plain is not None:
        return None
    return max(1, ckpt_budget * m // ref_m)


def _next(values: list[int], after: int) -> int:
    return next(v for v in values if v > after)


def _largest_fitting(micro_batches: list[int], trace: Callable[[int], _Traced | str],
                     budget: int, lowest: Callable[[_Traced, int], int]
                     ) -> tuple[int, _Traced] | None:
    """Binary search over the sorted micro-batches for the largest whose most memory-saving
    derived variant (``lowest(trace, m)``) fits (memory grows with the micro-batch)."""
    failed = False

    def fits(m: int) -> _Traced | None:
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
    best: tuple[int, _Traced] | None = None
    while lo <= hi and not failed:
        mid = (lo + hi) // 2
        t = fits(micro_batches[mid])
        if t is not None:
            best = (micro_batches[mid], t)
            lo = mid + 1
        else:
            hi = mid - 1
    return best


def _batch_bytes(batch: Any, device: str) -> int:
    """Bytes of a batch's distinct tensors (on CUDA, as the caching allocator rounds them)."""
    seen: dict[int, int] = {}
    for t in tensor_leaves(batch):
        nbytes = t.untyped_storage().nbytes()
        seen[int(t.untyped_storage()._cdata)] = (round_size(nbytes) if device == "cuda" and nbytes
                                                 else nbytes)
    return sum(seen.values())


def _rest_of_batch(t: _Traced, ref_m: int, per_gpu: int) -> int:
    """Bytes of the per-GPU batch beyond the ``ref_m`` samples traced: alive during every
    micro-batch, since the step is handed the whole batch and splits it."""
    # Note: [whole batch] Plan.apply's step (and accumulate()) takes the per-GPU batch and runs
    # views of it one micro-batch at a time, so all of it is alive at the peak. Leaving it out
    # under-predicted a 4 x 4 accumulation step by 6.5% (104,448 B of a 16-sample batch, in
    # tests/test_fit.py's model) while the 5% headroom hid it.
    return t.input_bytes * (per_gpu - ref_m) // ref_m


def per_rank_traced(par: Parallel) -> bool:
    """Whether the fit search traces ``par`` per rank: the data-parallel family (DDP, ZeRO-1,
    FSDP2, HSDP), tensor parallelism alone and tp x FSDP / HSDP, as
    ``memfit/parallel/apply.py: apply_model`` applies them, and pipelines alone, with tp and
    with DDP, ZeRO-1 or FSDP2 (``memfit/parallel/pipeline.py``: every stage's rank traced over
    the whole per-rank batch, :func:`memfit.fitting.layouts.traced_step`)."""
    if par.pp > 1:
        return pipeline_runs(par)
    if par.ep > 1:  # memfit/parallel/expert.py: check_experts
        return par.tp == 1 and par.strategy in ("ddp", "fsdp")
    return par.tp == 1 or par.dp == 1 or par.strategy in ("fsdp", "hsdp")


def _seq_of(batch: Any) -> int | None:
    """The sequence length of a sample batch: its first tensor's second dimension."""
    leaves = [t for t in tensor_leaves(batch) if t.dim() >= 2]
    return int(leaves[0].shape[1]) if leaves else None


def _derive_layout(t: _Traced, ref_m: int, m: int, offload_states: bool,
                   offload_activations: bool, sharding: str, par: Parallel, per_rank: int,
                   share: float, act_factor: float,
                   units: tuple[float, float] = (0.0, 0.0)) -> int:
    """Peak of the most loaded rank of layout ``par`` (Note: [layouts are derived, then
    traced]), from the one-GPU trace ``t``: the one-GPU step at this rank's batch
    (:func:`_derive`), less

    - the model states the rank does not hold: ``1 - share`` of them (tensor parallelism
      splits the blocks' projections, a pipeline stage holds its blocks; ``share`` is the
      most loaded rank's, :meth:`memfit.fitting.layouts.ModelShape.param_share`);
    - the activations it does not keep: a tensor-parallel rank keeps ``act_factor`` of them
      (:func:`memfit.fitting.layouts.activation_factor`) and the first pipeline stage
      ``1 / pp`` of each of the ``min(pp, micro-batches)`` it holds in flight (1F1B:
      memfit/analytic/activations.py);
    - the ZeRO-1/2/3 (and HSDP) shards of its states, gradients and weights over the ranks
      that shard them (``(n - 1) / n``);

    plus the buffers of the data-parallel engine (``units``: the largest block's and the
    root's shares of the parameters, :meth:`memfit.fitting.layouts.ModelShape.unit_shares`):
    DDP's (and ZeRO-1's) flat gradient buckets, a copy of the gradients
    (``torch/csrc/distributed/c10d/reducer.cpp: Reducer::initialize_buckets``; DDP's
    ``gradient_as_bucket_view`` is False by default); FSDP2 resharding after forward holds the
    gathered parameters of the block it runs and the one it prefetches and of the root, and a
    block's unsharded gradient before its reduce-scatter (``_fsdp_collectives.py:
    foreach_all_gather, foreach_reduce``); without resharding every block stays gathered from
    forward to backward beside its shard, with the unsharded gradient of a block and the root.
    (tests/test_fit_parallel.py's tiny model over 4 ranks, fp32, micro-batch 2: without these
    buffers the derivation gave 48-81% of the per-rank trace, with them 97.8-100%; in
    bf16-mixed with 2 micro-batches it gives 100-116%, over rather than under.)"""
    peak = _derive(t, ref_m, m, offload_states, offload_activations, "none", 1, per_rank)
    acts = t.activations_at_peak * m / ref_m
    in_flight = pipeline_in_flight(par, per_rank // m)
    states = 0 if offload_states else t.states
    peak -= (t.weights + t.grads + states) * (1 - share)
    peak -= acts * (1 - act_factor * in_flight / par.pp)
    n = par.fsdp if sharding == "hsdp" else par.dp
    if n > 1 and sharding != "none":
        keep = (n - 1) / n
        saved = states * share * keep
        if sharding in ("zero2", "zero3", "hsdp"):
            saved += t.grads * share * keep
        if sharding in ("zero3", "hsdp"):
            saved += t.weights * share * keep
        peak -= saved
    if par.dp > 1:
        block, root = units  # shares of all the parameters (t.weights, t.grads: all of them)
        if sharding in ("none", "zero1"):
            peak += t.grads * share
        elif sharding == "zero2":
            peak += t.weights * share / n + (block + root) * t.grads
        else:
            peak += (2 * block + root) * t.weights + block * t.grads
    return int(peak)


def _derive(t: _Traced, ref_m: int, m: int, offload_states: bool, offload_activations: bool,
            sharding: str, num_gpus: int, per_gpu: int) -> int:
    """Peak of a variant of the traced step (analytic, see the module docstring).

    - smaller micro-batch than traced: activations scale with it (linear in the batch);
    - accumulation (``m < per_gpu``): the earlier micro-batches' gradients exist, and the step
      holds the whole per-GPU batch while it runs one micro-batch of it;
    - activation offload: the activations at the peak leave the device except one module's;
    - state offload: the peak of the step with no optimizer state on the device;
    - ZeRO-1/2/3: states, + gradients, + weights divided over the GPUs (a gathered layer's
      weights are added back for ZeRO-3)."""
    shrink = t.activations_at_peak * (1 - m / ref_m)
    if m < per_gpu:
        # Over-states a smaller micro-batch: see Note: [derived micro-batches are verified by
        # a trace].
        peak = (t.peak_accum_wo_states if offload_states else t.peak_accum) - shrink
        peak += _rest_of_batch(t, ref_m, per_gpu)
    else:
        peak = (t.peak_wo_states if offload_states else t.peak) - shrink
    acts = t.activations_at_peak * m / ref_m
    if offload_activations:
        peak -= max(0.0, acts - t.largest_module_activations * m / ref_m)
    if num_gpus > 1 and sharding != "none":
        keep = (num_gpus - 1) / num_gpus
        saved = 0 if offload_states else t.states * keep
        if sharding in ("zero2", "zero3"):
            saved += t.grads * keep
        if sharding == "zero3":
            saved += t.weights * keep
        peak -= saved
    return int(peak)


def _uses_eager_attention(model: nn.Module) -> bool:
    """Whether ``model`` runs eager attention that :func:`use_sdpa` can switch (Hugging Face
    models by their config, memfit's builtin models by their attention modules)."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "_attn_implementation"):
        return config._attn_implementation == "eager"
    from memfit.models.build import Attention

    return any(isinstance(m, Attention) and m.eager for m in model.modules())


def _attention_choices(base: nn.Module, rejected: list[Rejected]) -> list[str]:
    """``["model"]``, plus ``"sdpa"`` when the model runs eager attention and can be switched
    (SDPA never keeps the s x s scores, so it is searched, not assumed)."""
    if not _uses_eager_attention(base):
        return ["model"]
    from memfit.techniques import use_sdpa

    try:
        use_sdpa(_meta_copy(base))
    except MemfitError as exc:
        rejected.append(Rejected(what="attention sdpa", reason=str(exc)))
        return ["model"]
    return ["model", "sdpa"]


def _default_space(base: nn.Module, optimizer: str, device: str, spec: GpuSpec | None,
                   num_gpus: int, per_gpu: int, rejected: list[Rejected]) -> dict[str, list[Any]]:
    from memfit.models.anatomy import find_blocks

    if device == "cpu":
        precisions = ["fp32", "bf16-mixed"]
    else:
        # Pure bf16 changes the math (updates under 2**-8 of a weight are lost), so it is
        # searched only when asked for: space={"precision": [..., "bf16"]}.
        precisions = [p for p in PRECISIONS
                      if p != "bf16" and (spec is None or spec.supports(p))]
        rejected.extend(Rejected(what=f"precision {p}", reason=f"{spec.name} has no {p}")
                        for p in PRECISIONS if p not in precisions and p != "bf16"
                        and spec is not None)
        rejected.append(Rejected(what="precision bf16 (pure)", reason=(
            "not searched by default: bf16 weights lose updates under 2**-8 of a weight; pass "
            "space={'precision': ['bf16-mixed', 'bf16']} to include it")))
    ckpts = list(CHECKPOINTING)
    try:
        find_blocks(base)
    except MemfitError as exc:
        ckpts = ["none"]
        rejected.append(Rejected(what="activation checkpointing", reason=str(exc)))
    optimizers = [optimizer]
    eight = _EIGHT_BIT.get(optimizer)
    if eight and device == "cuda":
        if importlib.util.find_spec("bitsandbytes") or importlib.util.find_spec("torchao"):
            optimizers.append(eight)
        else:
            rejected.append(Rejected(what=eight, reason="needs bitsandbytes or torchao: pip "
                                     "install 'memfit[bnb]' or pip install 'memfit[quant]'"))
    chunked = [False]
    try:
        from memfit.techniques import apply_chunked_loss

        apply_chunked_loss(_meta_copy(base))
        chunked.append(True)
    except MemfitError as exc:
        rejected.append(Rejected(what="chunked loss", reason=str(exc)))
    return {"precision": precisions, "checkpointing": ckpts,
            "micro_batch": _divisors(per_gpu), "optimizer": optimizers,
            "offload_states": [False, True] if device == "cuda" else [False],
            "offload_activations": [False, True] if device == "cuda" else [False],
            "chunked_loss": chunked, "attention": _attention_choices(base, rejected),
            "sharding": list(SHARDING) if num_gpus > 1 else ["none"]}


def _trace_one(base: nn.Module, sample: Any, *, precision: str, ckpt: str, optimizer: str,
               chunked: bool, attention: str, m: int, per_gpu: int, device: str,
               gpu: GpuSpec | None, loss_fn: Any, num_gpus: int,
               offload_activations: bool = False, offload_states: bool = False,
               device_budget: int | None = None, modes: tuple[str | None, ...] | None = None,
               parallel: Parallel | None = None) -> _Traced | str:
    """Trace one combination at micro-batch ``m``; a string is why it cannot run. With the
    offload options, the step runs with them as ``Plan.apply`` sets them up (activation offload
    after checkpointing; the optimizer's states and step on the host). With ``modes`` (a
    checkpointing budget the search resolved) the blocks are checkpointed as they say; with
    ``parallel`` the step is traced per rank (the worst rank's, ``memfit/parallel/trace.py``).
    """
    from memfit.parallel.trace import estimate
    from memfit.techniques.checkpointing import Budget, apply_activation_checkpointing
    from memfit.techniques.optim import offloaded

    model = _meta_copy(base)
    inputs = meta_batch(sample, m)
    fixed, modes = modes, None  # the modes asked for; the modes the traced model runs
    ckpt_budget: int | None = None
    # Note: [one traced step on CPU] The CPU has no caching allocator, so the second step's
    # peak is the first's forward/backward plus the optimizer states that then exist; one traced
    # step and that sum halve the search time. CUDA keeps two steps (allocator reuse matters).
    steps = 1 if device == "cpu" else 2
    try:
        cfg = FitConfig(checkpointing="none", chunked_loss=chunked, attention=attention)
        apply_techniques(model, cfg)
        if fixed is not None and ckpt != "none":
            from memfit.fitting.apply import FixedModes

            cp = apply_activation_checkpointing(model, FixedModes(tuple(fixed)))  # type: ignore[arg-type]
            modes = tuple(cp.modes)
        elif ckpt == "budget":
            from memfit.techniques.checkpointing import (
                find_blocks,
                predict_activation_bytes,
                profile_blocks,
            )

            names = find_blocks(model)
            profiles = profile_blocks(model, names, inputs)
            floor = predict_activation_bytes(profiles, ["full"] * len(names))
            ceiling = predict_activation_bytes(profiles, [None] * len(names))
            ckpt_budget = max(1, (floor + ceiling) // 2)  # halfway: a real trade-off point
            if device_budget is not None:
                # Never above what the device leaves for activations once the weights and
                # gradients are in (a lower bound of the model states): a bigger budget is a
                # number no step can use (issue 12: "budget(328.16 GiB)" on a 40 GB GPU; the
                # halfway point of a large micro-batch's profile can be far above the device).
                # Where even that is below the floor, the budget is the floor: every block
                # checkpointed, which collapses to ckpt=full.
                room = device_budget - _weights_and_grads(model, precision)
                ckpt_budget = max(floor, min(ckpt_budget, room))
            cp = apply_activation_checkpointing(model, Budget(ckpt_budget), inputs=inputs)
            modes = tuple(cp.modes)
        elif ckpt != "none":
            cp = apply_activation_checkpointing(model, ckpt)
            modes = tuple(cp.modes)
        if offload_activations:
            from memfit.techniques.offload import apply_activation_offload

            apply_activation_offload(model)
        traced_optimizer: Any = offloaded(optimizer) if offload_states else optimizer
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            est = estimate(model, inputs, optimizer=traced_optimizer, precision=precision,
                           loss_fn=loss_fn, device=device, gpu=gpu if device == "cuda" else None,
                           steps=steps, num_gpus=num_gpus, parallel=parallel)
    except MemfitError as exc:
        return str(exc)
    except (RuntimeError, NotImplementedError) as exc:  # rejected with the reason, not hidden
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"{ENGINE_FAILED}: {first}"
    if steps == 1 and len(est.per_rank) > 1:
        # The worst rank once its optimizer states exist (Note: [one traced step on CPU]): the
        # first step's worst can be another (tests/test_fit_pipeline.py's pp 2 at micro-batch
        # 2 x 4: the first step's worst stage gave a peak 4.4% under the two-step trace's).
        est = max(est.per_rank, key=_one_step_peak)
    cats = est.breakdown
    outside = est.total_bytes - est.peak_reserved_bytes
    reserve = est.peak_reserved_bytes - est.peak_bytes
    no_opt = max((p.total - p.by_category()[MemoryCategory.OPTIMIZER_STATES]
                  for p in est.timeline if p.phase != "optimizer"), default=0)
    weights = cats.get(MemoryCategory.WEIGHTS, 0)
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    if parallel is not None:  # this rank's gradients (shards), as the trace held them
        grads = max((p.by_category()[MemoryCategory.GRADIENTS] for p in est.timeline),
                    default=0)
    no_opt = max(no_opt, weights + grads) + reserve + outside
    states = max((p.by_category()[MemoryCategory.OPTIMIZER_STATES] for p in est.timeline),
                 default=0)
    peak = est.total_bytes if device == "cuda" else est.peak_bytes
    # The high points inside ops (a CPU kernel's scratch), which the timeline (bytes after each
    # op) does not show: without them a bf16-mixed step was under-predicted by 2-3%.
    fb_peaks = [v for (_, phase), v in est.phase_peaks.items() if phase in ("forward", "backward")]
    if steps == 1:  # see Note: [one traced step on CPU]
        final_states = est.timeline[-1].by_category()[MemoryCategory.OPTIMIZER_STATES] \
            if est.timeline else 0
        peak = max(peak, max(fb_peaks, default=0) + final_states)
    saved = sum(mod.activation_bytes for mod in est.modules.values())
    largest = max((mod.activation_bytes for mod in est.modules.values()), default=0)
    # Accumulation: from the second micro-batch on, every gradient exists during the forward
    # and backward. Each moment of the traced step is a moment of that micro-batch's step: its
    # live bytes without the gradients and states that exist then, plus all of them, plus the
    # gradient the op just made (the traced step makes it .grad; an accumulating one holds it
    # as a temporary until autograd adds it to the existing .grad). The moments are the points
    # after each op and the high points inside ops (a CPU kernel's scratch, measured), where
    # the op's own gradient is not made yet. (With one module's gradients added at every
    # moment instead, a bf16-mixed 4 x 4 step was 1.1% over on AVX2: its peak, a ReLU's
    # backward, holds no new gradient.)
    grad_i = TRACKED_INDEX[MemoryCategory.GRADIENTS]
    state_i = TRACKED_INDEX[MemoryCategory.OPTIMIZER_STATES]
    base_fb = prev_grads = prev_states = 0
    for p in est.timeline:
        g, s = p.bytes[grad_i], p.bytes[state_i]
        if p.phase in ("forward", "backward"):
            base_fb = max(base_fb, p.total - g - s + max(0, g - prev_grads))
            inside = est.op_peaks.get(p.index)
            if inside is not None:
                base_fb = max(base_fb, inside - prev_grads - prev_states)
        prev_grads, prev_states = g, s
    extra = reserve + outside
    peak_accum = max(peak, base_fb + grads + states + extra)
    peak_accum_wo = max(min(peak, no_opt), base_fb + grads + extra)
    return _Traced(peak=peak, peak_accum=peak_accum, peak_accum_wo_states=peak_accum_wo,
                   weights=weights, grads=grads, states=states,
                   peak_wo_states=min(peak, no_opt),
                   activations_at_peak=cats.get(MemoryCategory.ACTIVATIONS, 0),
                   largest_module_activations=largest, saved_activations=saved,
                   ops_per_micro=max(1, est.num_ops // max(1, est.steps)),
                   checkpoint_modes=modes, checkpoint_budget=ckpt_budget,
                   host_peak=est.host_peak_bytes, input_bytes=_batch_bytes(inputs, device))


def _one_step_peak(est: Any) -> int:
    """A CPU trace's peak of the second step from its first (Note: [one traced step on CPU]):
    the forward / backward high points plus the optimizer states the first step made."""
    fb = [v for (_, phase), v in est.phase_peaks.items() if phase in ("forward", "backward")]
    states = (est.timeline[-1].by_category()[MemoryCategory.OPTIMIZER_STATES]
              if est.timeline else 0)
    return max(est.peak_bytes, max(fb, default=0) + states)


def _weights_and_grads(model: nn.Module, precision: str) -> int:
    """Bytes of the weights and of the trainable weights' gradients (2 bytes per element in
    pure bf16, else the parameters' own dtype: mixed precision keeps fp32 weights)."""
    return sum(p.numel() * (2 if precision == "bf16" else p.element_size())
               * (2 if p.requires_grad else 1) for p in model.parameters())


def _fake_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are fake CPU tensors (call inside a
    ``FakeTensorMode``): models that branch on data (``.item()`` in Hugging Face's mask code)
    see fake tensors and take their tracing path, which meta tensors cannot."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="cpu"),
                                   requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.zeros(b.shape, dtype=b.dtype, device="cpu")
    return copy.deepcopy(model, memo)


def _fake_inputs(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return torch.zeros(batch.shape, dtype=batch.dtype, device="cpu")
    if isinstance(batch, dict):
        return {k: _fake_inputs(v) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(_fake_inputs(v) for v in batch)
    return batch


def _count_flops(base: nn.Module, sample: Any, cfg: FitConfig, loss_fn: Any
                 ) -> tuple[float, float]:
    """FLOPs of forward + backward (with recompute), and of the forward alone, of one sample,
    on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        model = _fake_copy(base)
        apply_techniques(model, cfg)
        inputs = _fake_inputs(meta_batch(sample, 1))
        with FlopCounterMode(display=False) as counter:
            loss = (loss_fn or model_loss)(model, inputs)
            forward = counter.get_total_flops()
            loss.backward()
    return float(counter.get_total_flops()), float(forward)
