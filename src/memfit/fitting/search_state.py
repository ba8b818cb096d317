"""The fit search's state: its checked inputs, its trace caches, and the memory and time of one
candidate (a variant of a traced combination at a micro-batch), which the bounds
(:mod:`memfit.fitting.search_bounds`), the verification (:mod:`memfit.fitting.search_verify`)
and the search loop (:mod:`memfit.fitting.search`) build on."""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from memfit import vocab
from memfit._loss import LossFn
from memfit._tensors import meta_copy
from memfit.budget import device_budget
from memfit.errors import MemfitError
from memfit.fitting.config import LAYOUT_SHARDING, FitConfig, sharding_of
from memfit.fitting.cost import StepCost, step_cost
from memfit.fitting.derive import derive as derive_one_gpu
from memfit.fitting.derive import derive_layout
from memfit.fitting.layout_space import layouts
from memfit.fitting.layouts import (
    ModelShape,
    activation_factor,
    model_shape,
    root_split,
    schedule_searched,
)
from memfit.fitting.plan import Candidate, Rejected
from memfit.fitting.rates import Rates, target_rates
from memfit.fitting.search_space import (
    check_request,
    check_space,
    default_space,
    leading,
    seq_of,
    uses_eager_attention,
)
from memfit.fitting.traced import Traced, count_flops, trace_one
from memfit.gpus import GpuSpec
from memfit.parallel.config import Parallel
from memfit.progress import phase
from memfit.runtime.input_pipeline import DataLoaderSpec, input_pipeline_memory
from memfit.trace.dataloader import tensor_bytes

__all__ = ["Combo", "SearchOptions", "SearchState", "unverified"]

Combo = tuple[str, str, str, bool, str]
"""(precision, checkpointing, optimizer, chunked loss, attention): a technique combination, the
search's unit of work (its micro-batches, offload and sharding variants follow from its
traces)."""


@dataclass(kw_only=True, frozen=True)
class SearchOptions:
    """How :func:`memfit.fitting.fit` searches: each option saves traces without changing the
    answer (``tests/fitting/test_fit_prune.py`` and ``tests/fitting/test_fit_search.py`` compare the
    searches with and without them). The defaults are what ``fit`` runs; turning one off searches
    more (and more slowly), for tests and ``bench/fit.py``."""

    traffic_bound: bool = True
    """Prune by compute + activation traffic (Note: [traffic bound]); False: by FLOPs alone
    (``bench/fit.py --search --baseline`` times both in one run)."""
    prune: bool = True
    """Branch and bound (Note: [pruning]); False: every combination is explored, the exhaustive
    search the tests compare the pruned one with."""
    simpler_first: bool = True
    """Prune what can at best tie with ``top`` simpler candidates (Note: [pruning], rule 2)."""
    tie_arithmetic: bool = True
    """Prune by :func:`memfit.fitting.plan.tie_time`, the time ``rank`` groups by (Note:
    [pruning]); False: by raw float times, as before (prunes less; kept so that the tests
    show what the raw comparison kept)."""
    share_traces: bool = True
    """Trace fp16-mixed as bf16-mixed on a CUDA target that runs both (Note: [fp16 is traced as
    bf16])."""


class SearchState:
    """One :func:`fit` call's checked inputs and caches, and the memory (``trace``, ``derive``)
    and time (``cost``, ``flops``) of its candidates."""

    def __init__(self, model: nn.Module, sample_batch: Any, *, optimizer: str = "adamw",
                 global_batch: int, gpu: str | GpuSpec | None = None,
                 budget_bytes: int | None = None, device: str = "cuda",
                 loss_fn: LossFn | None = None, reduction: str = "mean",
                 count_fn: Callable[[Any], Any] | None = None, num_gpus: int = 1,
                 measure: bool = False, space: dict[str, Any] | None = None,
                 progress: bool | None = None, top: int = 5, headroom: float | None = None,
                 gpus: int | None = None, gpus_per_node: int | None = None,
                 rates: Rates | Mapping[str, Any] | str | os.PathLike[str] | None = None,
                 options: SearchOptions | None = None, prefetch_batches: int = 0,
                 tp_plan: Mapping[str, Any] | None = None,
                 pp_split_points: list[str] | tuple[str, ...] | None = None) -> None:
        self.started = time.perf_counter()
        if isinstance(prefetch_batches, bool) or not isinstance(prefetch_batches, int) \
                or prefetch_batches < 0:
            raise MemfitError(f"prefetch_batches must be an int >= 0 (DevicePrefetcher's "
                              f"depth), not {prefetch_batches!r}")
        self.prefetch_batches = prefetch_batches
        self.options = options or SearchOptions()
        self.layouts: list[Parallel] | None = None
        """With ``gpus=``: the layouts searched (Note: [layouts are derived, then traced])."""
        spec, num_gpus, headroom = check_request(
            model, global_batch=global_batch, gpu=gpu, budget_bytes=budget_bytes, device=device,
            loss_fn=loss_fn, reduction=reduction, num_gpus=num_gpus, measure=measure,
            headroom=headroom, gpus=gpus, gpus_per_node=gpus_per_node)
        # The device's budget by target (memfit.budget): a Jetson's or a Mac's less the host side.
        device_bytes = device_budget(spec).budget_bytes if spec else None
        self.full_budget = min(b for b in (budget_bytes, device_bytes) if b)
        # Note: [headroom] A candidate must fit in the budget less the headroom. On the CPU the
        # applied step measures within 0.5% of the plan (tests/fitting/test_fit.py), so 5% is ample.
        # On CUDA the default is the trace's margin, derived from its worst under-prediction of a
        # published GPU measurement (TRACE_FITS_MARGIN); the OOM guard, not a crash, handles
        # what is still missed.
        self.budget = int(self.full_budget * (1 - headroom))
        # Note: [rates do not move with the load] (fitting/rates.py): the catalog's, this
        # CPU's measured once and kept on disk, or the caller's.
        self.rates = target_rates(device, spec, rates)
        self.model, self.sample_batch, self.loss_fn = model, sample_batch, loss_fn
        self.reduction, self.count_fn, self.measure = reduction, count_fn, measure
        self.device, self.spec, self.headroom = device, spec, headroom
        self.global_batch, self.num_gpus, self.top = global_batch, num_gpus, top
        self.progress = progress
        self.per_gpu = global_batch // num_gpus
        leading(sample_batch)
        self.base = meta_copy(model)
        self.rejected: list[Rejected] = []
        self.shape: ModelShape | None = None
        self.gpus_per_node = gpus_per_node
        if tp_plan is not None and (gpus is None or gpus < 2):
            raise MemfitError("tp_plan splits the model over tensor-parallel ranks; search "
                              "several GPUs with gpus=N (N > 1), or drop tp_plan")
        self.tp_plan = tp_plan
        self.pp_split_points: tuple[str, ...] | None = None
        if pp_split_points is not None:
            if gpus is None or gpus < 2:
                raise MemfitError("pp_split_points split the model into pipeline stages over "
                                  "several GPUs; search them with gpus=N (N > 1), or drop "
                                  "pp_split_points")
            if not isinstance(pp_split_points, list | tuple) or not pp_split_points:
                raise MemfitError(f"pp_split_points={pp_split_points!r}: give a list of module "
                                  "names, each the first of a stage, e.g. ['blocks.2']")
            stages = len(pp_split_points) + 1  # Parallel's own check of the names, one line
            self.pp_split_points = Parallel(gpus=stages, pp=stages,
                                            pp_split_points=tuple(pp_split_points)).pp_split_points
        if gpus is not None:
            self._layouts(gpus, space)
        elif space and ("tp" in space or "pp" in space):
            raise MemfitError("space tp/pp need gpus=N (the layout search)")
        self._dims(optimizer, space)
        self.eager = uses_eager_attention(self.base)
        self.per_rank_traces: dict[tuple[Any, ...], Traced | str] = {}
        """By (config, layout): the per-rank traces run (Note: [layouts are derived, then
        traced])."""
        self.traces: dict[tuple[Any, ...], Traced | str] = {}
        """By (combination, micro-batch): what the search uses (shared traces appear twice)."""
        self.runs: dict[tuple[Any, ...], Traced | str] = {}
        """By (combination as traced, micro-batch): the traces run."""
        self.flops_at: dict[tuple[Any, ...], float] = {}
        self.candidates: list[Candidate] = []
        self.skipped: dict[Combo, dict[int, float]] = {}
        """The combinations pruned without a trace, with their bounds by micro-batch."""

    def _layouts(self, gpus: int, space: dict[str, Any] | None) -> None:
        """The multi-GPU layouts of ``gpus`` GPUs to search (``space``'s tp, pp and sharding)."""
        layout_space = {k: list(v) for k, v in check_space(
            {k: v for k, v in (space or {}).items() if k in ("tp", "pp", "sharding")},
            {}).items()}
        for value in layout_space.get("sharding", []):
            if value not in LAYOUT_SHARDING:
                raise MemfitError(f"space sharding {value!r} is not one of "
                                  f"{', '.join(LAYOUT_SHARDING)}")
        if self.tp_plan is not None:  # Parallel's own checks of the plan, one line each
            Parallel(gpus=2, tp=2, tp_plan=self.tp_plan)
        self.shape = model_shape(self.base, seq_of(self.sample_batch), self.tp_plan,
                                 self.pp_split_points)
        found = layouts(gpus=gpus, gpus_per_node=self.gpus_per_node,
                        global_batch=self.global_batch, shape=self.shape, space=layout_space,
                        rejected=self.rejected, tp_plan=self.tp_plan,
                        pp_split_points=self.pp_split_points)
        if gpus > 1:
            self.layouts = found
            # Micro-batches divide the largest per-rank batch (the fewest data-parallel
            # ranks).
            self.per_gpu = self.global_batch // min(p.dp for p in self.layouts)
            self.rejected.append(Rejected(what="offload with a multi-GPU layout", reason=(
                "not searched: FSDP2's CPUOffloadPolicy, which neither the per-rank trace "
                "nor Plan.apply runs yet")))

    def _dims(self, optimizer: str, space: dict[str, Any] | None) -> None:
        """The technique dimensions searched: the defaults, narrowed or widened by ``space``."""
        defaults = default_space(self.base, optimizer, self.device, self.spec, self.num_gpus,
                                 self.per_gpu, self.rejected)
        if self.layouts is not None:
            defaults["sharding"] = list(LAYOUT_SHARDING)
        self.dims = check_space(
            {k: v for k, v in (space or {}).items() if k not in ("tp", "pp")}, defaults)
        for m in self.dims["micro_batch"]:
            if isinstance(m, bool) or not isinstance(m, int) or m < 1 or self.per_gpu % m:
                raise MemfitError(f"space micro_batch {m!r} must divide the per-GPU batch "
                                  f"{self.per_gpu}")
        self.micro_batches = sorted(set(self.dims["micro_batch"]))

    # -- memory: traces ------------------------------------------------------------------------

    def trace(self, combo: Combo, m: int) -> Traced | str:
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
                self.runs[run] = trace_one(
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
        (``tests/fitting/test_fit_search.py`` traces both and compares them). GradScaler's state (a
        scale and a growth tracker, two scalars) is not in the trace of either. On the CPU only
        bf16-mixed is searched (the CPU kernels' scratch differs by dtype)."""
        if (self.options.share_traces and precision == "fp16-mixed" and self.device == "cuda"
                and self.spec is not None and self.spec.supports("bf16-mixed")):
            return "bf16-mixed"
        return precision

    def traced(self, combo: Combo, m: int) -> Traced | str | None:
        """The cached trace, None when ``m`` was not traced."""
        return self.traces.get((*combo, m))

    def prefetch_bytes(self, m: int) -> int:
        """The DevicePrefetcher's ``prefetch_batches`` batches of micro-batch ``m`` on the device
        (memfit.runtime.input_pipeline: the sample batch's tensors scaled to ``m`` rows, each a
        512-byte block on CUDA), alive through the step."""
        if not self.prefetch_batches:
            return 0
        rows = leading(self.sample_batch)
        per_tensor = tuple(b * m // rows for b in tensor_bytes(self.sample_batch))
        spec = DataLoaderSpec(tensor_bytes=per_tensor, depth=self.prefetch_batches)
        return input_pipeline_memory(spec, device="cpu" if self.device == "cpu"
                                     else "cuda").device_bytes

    def derive(self, t: Traced, ref_m: int, m: int, offload_states: bool,
               offload_activations: bool, sharding: str, par: Parallel | None = None,
               per_rank: int | None = None, attention: str = "model") -> int:
        return self.prefetch_bytes(m) + self._derive(t, ref_m, m, offload_states,
                                                     offload_activations, sharding, par,
                                                     per_rank, attention)

    def _derive(self, t: Traced, ref_m: int, m: int, offload_states: bool,
                offload_activations: bool, sharding: str, par: Parallel | None = None,
                per_rank: int | None = None, attention: str = "model") -> int:
        if par is None:
            return derive_one_gpu(t, ref_m, m, offload_states, offload_activations, sharding,
                                  self.num_gpus, self.per_gpu)
        units = (self.shape.unit_shares(par.tp, par.pp, root_split(par))
                 if self.shape is not None else (0.0, 0.0))
        if par.ep > 1 and self.shape is not None:  # a block gathers 1/ep of its experts
            block, root = units
            units = (block - self.shape.expert_share() / self.shape.layers * (1 - 1 / par.ep),
                     root)
        peak = derive_layout(t, ref_m, m, offload_states, offload_activations, sharding, par,
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
            routed = tokens // par.tp  # beside tp, each tp rank routes its share of the tokens
            capacity = max(1, min(routed, -(-routed * shape.top_k // experts)))
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
        out: list[tuple[bool, bool, str, Parallel | None, int]] = []
        for par in self.layouts:
            per_rank = self.global_batch // par.dp
            if per_rank % m == 0 and sharding_of(par) in self.dims["sharding"] \
                    and schedule_searched(par, per_rank // m):
                out += [(False, False, sharding_of(par), par, per_rank)]
        return out

    def lowest_variant(self, t: Traced, m: int, attention: str = "model") -> int:
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
             shard: str, par: Parallel | None, per_rank: int, attention: str,
             sac_ops: int = 0) -> StepCost:
        """``step_cost`` of a variant; with a layout, of its most loaded rank (the parameter
        share and activation factor of :mod:`memfit.fitting.layouts`)."""
        if par is None:
            return step_cost(
                self.rates, precision=precision, micro_flops=micro_flops,
                accumulation=self.per_gpu // m, activation_traffic_bytes=traffic,
                offloaded_bytes=offloaded, ops_per_micro=ops, param_bytes=weights,
                grad_bytes=grads, state_bytes=states, offload_activations=off_a,
                offload_states=off_s, sharding=shard, num_gpus=self.num_gpus,
                sac_ops_per_micro=sac_ops)
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
            layout_bytes=self.layout_bytes(precision, m, par),
            sac_ops_per_micro=-(-sac_ops // par.pp))

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
                self.flops_at[key] = count_flops(self.base, self.sample_batch, cfg,
                                                 self.loss_fn)[0]
            except RuntimeError:
                # Some models cannot be recomputed under the FLOP counter (selective
                # checkpointing's cache sees different ops): count the plain step and add the
                # forward of the fully checkpointed share of the blocks (selective recomputes
                # no matmul: + 0).
                plain_total, plain_forward = count_flops(
                    self.base, self.sample_batch,
                    FitConfig(chunked_loss=chunked, attention=attention), self.loss_fn)
                share = (sum(mode == "full" for mode in modes) / len(modes)) if modes else 0.0
                self.flops_at[key] = plain_total + share * plain_forward
        return self.flops_at[key] * m

    def activation_traffic(self, combo: Combo, ref: Traced, ref_m: int, m: int,
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

    def plain_sibling(self, combo: Combo) -> tuple[Traced, int] | None:
        """The trace :meth:`activation_traffic` takes the activation traffic of ``combo`` from:
        the first traced micro-batch of the same combination without checkpointing."""
        precision, _, opt, chunked, attention = combo
        return next(((v, k[5]) for k, v in self.traces.items()
                     if k[:5] == (precision, "none", opt, chunked, attention)
                     and not isinstance(v, str)), None)


def unverified(c: Candidate) -> bool:
    """Whether ``c``'s peak is derived for an offload that the search traces once it is done
    (:meth:`memfit.fitting.search_verify.Verification.verify_offload`; it may yet be
    rejected)."""
    return (c.config.offload_activations or c.config.offload_states) \
        and c.config.sharding == "none"
