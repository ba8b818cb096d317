"""The search behind :func:`memfit.fitting.rightsize.rightsize_training`: for one GPU and GPU
count, the fastest training configuration that fits by the plan's formulas, timed by ``fit``'s
cost model (the module docstring of :mod:`memfit.fitting.rightsize` says what is searched).

The dimensions, and the rules that keep them what ``fit`` and the engines run:

- layouts: tensor parallel 1, 2, 4, 8 inside a node (dividing the heads) x pipeline stages 1, 2,
  4, ... (at most the blocks; 1F1B, the schedule the formulas size) x DDP, ZeRO-1, ZeRO-2 or
  FSDP over the data-parallel ranks (tp only beside FSDP / ZeRO-2, as torchtitan), and ZeRO-3
  on a single GPU for parameter offload;
- precision: bf16-mixed (fp16-mixed without bf16) and fp8 (torchao's float8 linears under
  bf16 autocast) on GPUs of compute capability 8.9 or later;
- checkpointing: none, selective, full; the chunked loss (tp 1, no pipeline: fit's
  ``pipeline_refusal``);
- optimizer: the named one and its 8-bit form, optimizer offload (ZeRO-Offload: tp 1, not
  plain DDP), parameter offload beside it (ZeRO-Infinity: FSDP / ZeRO-3), activation offload
  (without checkpointing, where it moves the blocks' saved tensors, and no pipeline); under a
  pipeline, the named optimizer on the GPU only (fit runs torch's optimizers on its stages);
- micro-batch: the largest that fits (a power of two dividing the per-rank batch), or under a
  pipeline each that fits with at least ``pp`` micro-batches (a smaller one has less bubble).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from memfit.errors import MemfitError

__all__: list[str] = []

_CKPTS = ("none", "selective", "full")
_TPS = (1, 2, 4, 8)
_ZERO = {"ddp": None, "zero1": 1, "zero2": 2, "zero3": 3}
_EIGHT_BIT = {"adamw": "adamw-8bit", "adam": "adamw-8bit"}
"""The 8-bit form of an optimizer, as ``fit``'s search space names it
(:func:`memfit.fitting.search_space.default_space`)."""
FP8_MIN_CAPABILITY = (8, 9)
"""fp8 matmuls need compute capability 8.9 (Ada, Hopper and later: :mod:`memfit.vocab`)."""


def _powers_dividing(n: int) -> list[int]:
    return [m for m in (2 ** k for k in range(n.bit_length())) if n % m == 0]


@dataclass(frozen=True)
class _Best:
    step_s: float
    run: Any
    peak: int
    label: str
    sharding: str
    host: int = 0
    """Host bytes per GPU of the offloaded states (the plan's ``host_bytes``)."""
    extras: int = 0
    """The techniques beyond the plain step it uses (8-bit optimizer, offloads, chunked loss,
    fp8, pipeline): a more complex configuration replaces a simpler one only when more than
    fit's tie tolerance faster."""


@dataclass(frozen=True)
class _Variant:
    optimizer: str
    offload_optimizer: bool = False
    offload_params: bool = False
    offload_activations: bool = False

    def label(self) -> str:
        return self.optimizer + "".join(f", {n}" for n, on in (
            ("offload", self.offload_optimizer), ("param offload", self.offload_params),
            ("act offload", self.offload_activations)) if on)


@dataclass(frozen=True)
class _Host:
    """The host memory check of one GPU x count: the most host bytes a GPU's plan may need,
    and the configurations that fit the GPU but needed more (host bytes a GPU, label)."""

    limit: int
    rejected: list[tuple[int, str]]


def fp8_capable(gpu: Any) -> bool:
    """Whether ``gpu`` runs fp8 matmuls: the catalog says so, its compute capability is 8.9 or
    later, and it has an fp8 rate for the cost model."""
    cc = getattr(gpu, "compute_capability", None)
    try:
        major, minor = (int(x) for x in str(cc).split(".")[:2])
    except ValueError:
        return False
    return bool(gpu.supports("fp8") and (major, minor) >= FP8_MIN_CAPABILITY
                and gpu.tflops.get("fp8"))


def _layouts(count: int, heads: int, kv_heads: int, layers: int, global_batch: int,
             gpus_per_node: int) -> list[tuple[int, int, str]]:
    """(tp, pp, sharding) of ``count`` GPUs, without a pipeline first."""
    out: list[tuple[int, int, str]] = []
    pps = [p for p in _powers_dividing(count) if p <= layers]
    for pp in pps:
        for tp in _TPS:
            if tp > min(count, gpus_per_node) or count % (tp * pp) or heads % tp \
                    or kv_heads % tp:
                continue
            dp = count // (tp * pp)
            if global_batch % dp:
                continue
            if dp == 1:
                out.append((tp, pp, "none"))
                if tp == 1 and pp == 1:
                    out.append((1, 1, "zero3"))  # ZeRO-Infinity on one GPU: parameter offload
                continue
            for sharding in _ZERO:
                if tp > 1 and sharding in ("ddp", "zero1"):
                    continue  # tp beside DDP / ZeRO-1 is refused (torchtitan refuses it)
                out.append((tp, pp, sharding))
    return out


def _variants(optimizer: str, tp: int, pp: int, sharding: str, dp: int,
              ckpt: str) -> list[_Variant]:
    """The optimizer and offload variants of a layout, simplest first (see the module
    docstring); a single-GPU ZeRO-3 layout exists for parameter offload alone."""
    if pp > 1:
        return [_Variant(optimizer)]
    optimizers = [optimizer] + ([_EIGHT_BIT[optimizer]] if optimizer in _EIGHT_BIT else [])
    single_zero3 = sharding == "zero3" and dp == 1
    out = [] if single_zero3 else [_Variant(o) for o in optimizers]
    if tp == 1 and sharding != "ddp" and not single_zero3:
        out += [_Variant(o, offload_optimizer=True) for o in optimizers]
    if tp == 1 and sharding == "zero3":
        out.append(_Variant(optimizer, offload_optimizer=True, offload_params=True))
    if ckpt == "none" and not single_zero3:
        out += [_Variant(o, offload_activations=True) for o in optimizers]
    return out


def _fitting(spec: Any, run: Any, gpu: Any, per_rank: int, *, above: int, most: int,
             closest: list[tuple[float, str]], what: str, tally: list[int],
             host: _Host | None = None) -> list[tuple[int, Any]]:
    """The micro-batches above ``above`` and at most ``most`` (powers of two dividing
    ``per_rank``) at which ``run`` fits on ``gpu`` by the plan, each with its plan, the largest
    last (the pipeline searches all of them; the others take the last). Bisected for the
    largest: the plan's bytes grow with the micro-batch, so those that fit are a prefix of the
    sorted list (when none does, the smallest is the last one planned, and the closest miss).
    A plan whose offloaded states need more than ``host.limit`` bytes of host memory a GPU does
    not fit (the bytes only grow with the micro-batch too); the first such is added to
    ``host.rejected``."""
    from memfit.analytic.planner import plan

    sizes = [m for m in _powers_dividing(per_rank) if above < m <= most]
    lo, hi = 0, len(sizes) - 1
    found: dict[int, Any] = {}
    while lo <= hi:
        mid = (lo + hi) // 2
        m = sizes[mid]
        tally[0] += 1
        try:
            p = plan(spec, run.with_batch(m, per_rank // m), gpu)
        except MemfitError:
            return []
        over_host = host is not None and p.host_bytes > host.limit
        if p.fits and not over_host:
            found[m] = p
            lo = mid + 1
            continue
        hi = mid - 1
        if p.fits:  # the GPU holds it, the host does not
            assert host is not None
            if not any(label == f"{what})" for _, label in host.rejected):
                host.rejected.append((p.host_bytes, f"{what})"))
            continue
        if m == 1 and p.capacity_bytes:
            closest.append((p.total_bytes / p.capacity_bytes,
                            f"{what}, micro-batch {m}): {p.total_bytes / 2**30:,.1f} GiB of "
                            f"{p.capacity_bytes / 2**30:,.1f} GiB"))
    if not found:
        return []
    top = max(found)
    if run.parallel.pp == 1:
        return [(top, found[top])]
    for m in sizes:  # the pipeline: every smaller micro-batch fits too (the prefix)
        if m < top and m not in found:
            tally[0] += 1
            found[m] = plan(spec, run.with_batch(m, per_rank // m),
                            gpu)
    return sorted(found.items())


def _flops(counted: Any, precision: str, rates: Any) -> float:
    """FLOPs of one sample at ``precision``'s rate: under fp8 the linear layers' matmuls run at
    the fp8 rate and the rest (attention, the loss) at bf16's, so the FLOPs handed to the cost
    model, which divides by the fp8 rate, count the rest at ``fp8 / bf16`` times theirs."""
    if precision != "fp8":
        return float(counted.flops)
    rest = counted.flops - counted.linear_flops
    return counted.linear_flops + rest * rates.flops["fp8"] / rates.flops["bf16-mixed"]


class _Ranks:
    """What fit gives the cost model (search_state.cost), from one plan of the tp x pp group
    alone (one micro-batch in flight, without checkpointing or offload, no data-parallel
    sharding), kept by what it depends on: the rank's model states before data-parallel
    sharding (its tensor-parallel and pipeline-stage share; the optimizer's whether or not they
    are offloaded), and the activations one micro-batch saves without checkpointing, which
    scaled by the recompute are the bytes it writes (fit's activation_traffic) and which
    activation offload moves (fit's ``offloaded``)."""

    def __init__(self, spec: Any, gpu: Any, tally: list[int]) -> None:
        self.spec, self.gpu, self.tally = spec, gpu, tally
        self.plans: dict[tuple[Any, ...], Any] = {}

    def __call__(self, run: Any, m: int) -> Any:
        from memfit.analytic.planner import plan
        from memfit.layout import Parallel

        par = run.parallel
        # fp8's plan is bf16-mixed's (Note: [fp8 is planned as bf16-mixed])
        precision = "bf16-mixed" if run.precision == "fp8" else run.precision
        key = (precision, run.optimizer, run.chunked_loss, par.tp, par.pp, m)
        if key not in self.plans:
            self.tally[0] += 1
            self.plans[key] = plan(self.spec, dataclasses.replace(
                run, precision=precision, checkpointing="none", offload_optimizer=False,
                offload_params=False, offload_activations=False, batch=m, grad_accum=1,
                parallel=Parallel(gpus=par.tp * par.pp, tp=par.tp, pp=par.pp)), self.gpu)
        return self.plans[key]


def _step_seconds(spec: Any, run: Any, rates: Any, *, m: int, per_rank: int, seq: int,
                  counted: Any, plain: Any, count: int, ranks: _Ranks) -> float:
    """``fit``'s cost model for the planned ``run`` at micro-batch ``m``."""
    from memfit.categories import MemoryCategory as Cat
    from memfit.fitting.config import sharding_of
    from memfit.fitting.cost import step_cost
    from memfit.vocab import precision as precision_info

    par, precision = run.parallel, run.precision
    element = precision_info(precision).compute_bytes
    rank = ranks(run, m)
    saved = rank.breakdown.get(Cat.ACTIVATIONS, 0)
    traffic = int(saved * counted.flops / max(plain.flops, 1.0))
    tokens = m * seq
    return step_cost(
        rates, precision=precision, micro_flops=_flops(counted, precision, rates) * m,
        accumulation=per_rank // m, activation_traffic_bytes=traffic,
        offloaded_bytes=saved, ops_per_micro=-(-counted.ops // par.pp),
        param_bytes=rank.breakdown.get(Cat.WEIGHTS, 0),
        grad_bytes=rank.breakdown.get(Cat.GRADIENTS, 0),
        state_bytes=rank.breakdown.get(Cat.OPTIMIZER_STATES, 0),
        offload_activations=run.offload_activations,
        offload_states=run.offload_optimizer, offload_params=run.offload_params,
        sharding=sharding_of(par), num_gpus=count,
        parallel=par, boundary_bytes=tokens * spec.hidden_size * element,
        layers=spec.num_layers,
        layout_bytes={"logits_bytes": tokens * spec.vocab_size * element,
                      "tokens": tokens},
        sac_ops_per_micro=-(-counted.sac_ops // par.pp)).total_s


def _variant_bound(v: _Variant, run: Any, rates: Any, ranks: _Ranks, compute_s: float) -> float:
    """A lower bound on the step of variant ``v`` at any micro-batch: ``compute_s`` (the
    combination's compute alone), the optimizer's step (on the GPU, or on the host at
    :data:`memfit.fitting.cost.HOST_OPTIMIZER_BYTES_PER_S` when offloaded) and the offloads'
    transfers at one micro-batch, the terms ``step_cost`` adds whatever the micro-batch."""
    from memfit.categories import MemoryCategory as Cat
    from memfit.fitting.cost import HOST_OPTIMIZER_BYTES_PER_S

    rank = ranks(run, 1)
    weights = rank.breakdown.get(Cat.WEIGHTS, 0)
    grads = rank.breakdown.get(Cat.GRADIENTS, 0)
    model = weights + grads + rank.breakdown.get(Cat.OPTIMIZER_STATES, 0)
    bound = compute_s + 2 * model / (HOST_OPTIMIZER_BYTES_PER_S if v.offload_optimizer
                                     else rates.bandwidth)
    if v.offload_optimizer:
        bound += (grads + weights) / rates.host_link
    if v.offload_params:
        bound += 2 * weights / run.parallel.dp / rates.host_link
    return bound


def _precisions(gpu: Any, rates: Any) -> list[str]:
    base = "bf16-mixed" if gpu.bf16 else "fp16-mixed"
    if base not in rates.flops:
        return []
    return [base] + (["fp8"] if base == "bf16-mixed" and fp8_capable(gpu) else [])


def _with_fp8_rate(gpu: Any, rates: Any) -> Any:
    """``rates`` with an fp8 rate where the GPU has one: the catalog's dense fp8 peak at the
    bf16 rate's efficiency (the same measured matmul ceiling over the peak)."""
    if not fp8_capable(gpu) or "bf16-mixed" not in rates.flops:
        return rates
    fp8 = rates.flops["bf16-mixed"] * gpu.tflops["fp8"] / gpu.tflops["bf16"]
    return dataclasses.replace(rates, flops={**rates.flops, "fp8": fp8})


def search_gpu_count(spec: Any, base_run: Any, gpu: Any, count: int, *, global_batch: int,
                     seq: int, counter: Any, gpus_per_node: int,
                     closest: list[tuple[float, str]], prune: bool = True,
                     tally: list[int] | None = None,
                     host: _Host | None = None) -> _Best | None:
    """The fastest fitting configuration of ``count`` x ``gpu`` (None: none fits).

    With ``prune``, a (precision, checkpointing, chunked loss) combination is not planned once
    a configuration already found is faster than its compute alone: ``global_batch / count``
    samples of its FLOPs at the GPU's rate, a lower bound on any layout's step (each rank
    computes ``1 / (tp pp)`` of its ``global_batch / dp`` samples; the cost model only adds to
    that); and an offload (of the optimizer, the parameters or the activations) is planned
    only at micro-batches larger than the largest of the same configuration without it (at
    one micro-batch an offload only adds time in the cost model: its transfers, and for the
    optimizer its step at the host's bandwidth, below every GPU's); a variant is not planned
    when its lower bound (:func:`_variant_bound`: the compute, the optimizer's step and the
    offloads' transfers) is no faster than the best, or when it does not fit at micro-batch 1
    under full checkpointing (Note: [full checkpointing is lowest]). The answer is the same
    (tested against ``prune=False``). ``tally[0]`` counts the plans made. With ``host``, a
    configuration whose offloaded states need more host memory a GPU than ``host.limit`` does
    not fit; it is added to ``host.rejected``."""
    tally = [0] if tally is None else tally
    from memfit.fitting.config import layout_label, sharding_of
    from memfit.fitting.cost import HOST_OPTIMIZER_BYTES_PER_S
    from memfit.fitting.plan import TIE_TOLERANCE
    from memfit.fitting.rates import gpu_rates
    from memfit.layout import Parallel

    rates = _with_fp8_rate(gpu, gpu_rates(gpu))
    precisions = _precisions(gpu, rates)
    if not precisions:
        return None
    skip_offload = prune and HOST_OPTIMIZER_BYTES_PER_S <= rates.bandwidth
    heads = getattr(spec, "num_heads", 1) or 1
    kv_heads = getattr(spec, "num_kv_heads", None) or heads
    decoder = getattr(spec, "arch", "decoder") == "decoder"
    best: _Best | None = None
    ranks = _Ranks(spec, gpu, tally)
    for tp, pp, sharding in _layouts(count, heads, kv_heads, spec.num_layers, global_batch,
                                     gpus_per_node):
        par = Parallel(gpus=count, gpus_per_node=min(count, gpus_per_node), tp=tp, pp=pp,
                       zero=_ZERO.get(sharding))
        per_rank = global_batch // par.dp
        if per_rank < pp:
            continue  # 1F1B needs at least pp micro-batches (fit's pipeline_refusal)
        chunks = [False, True] if decoder and tp == 1 and pp == 1 else [False]
        if pp > 1 and precisions[0] == "fp16-mixed":
            continue  # GradScaler's skipped steps would differ between stages
        lowest: dict[tuple[bool, _Variant], bool] = {}  # Note: [full checkpointing is lowest]
        for chunked in chunks:
            for ckpt in _CKPTS:
                counted = counter(ckpt, chunked)
                compute_s = {pr: _flops(counted, pr, rates) * global_batch / count
                             / rates.flops[pr] for pr in precisions}
                if prune and best is not None and min(compute_s.values()) >= best.step_s:
                    continue
                best = _search_variants(
                    spec, base_run, gpu, rates, par, best, ranks, prune=prune, lowest=lowest,
                    compute_s=compute_s, ckpt=ckpt, chunked=chunked, counted=counted,
                    plain=counter("none", chunked), sharding=sharding, per_rank=per_rank,
                    seq=seq, count=count, skip_offload=skip_offload, closest=closest,
                    tally=tally, tie=TIE_TOLERANCE, layout=layout_label(par),
                    shard=sharding_of(par), host=host)
    return best


def _search_variants(spec: Any, base_run: Any, gpu: Any, rates: Any, par: Any,
                     best: _Best | None, ranks: _Ranks, *, prune: bool,
                     lowest: dict[tuple[bool, _Variant], bool],
                     compute_s: dict[str, float], ckpt: str, chunked: bool,
                     counted: Any, plain: Any, sharding: str, per_rank: int, seq: int,
                     count: int, skip_offload: bool, closest: list[tuple[float, str]],
                     tally: list[int], tie: float, layout: str, shard: str,
                     host: _Host | None = None) -> _Best | None:
    """:func:`search_gpu_count`'s inner loop: each optimizer / offload variant of one layout,
    checkpointing policy and loss, at its fitting micro-batches, in each precision of
    ``compute_s`` (the first one's plans serve fp8's too: Note: [fp8 is planned as
    bf16-mixed]). With ``prune``, a variant whose lower bound (:func:`_variant_bound`) is no
    faster than the best so far is not planned, nor a precision whose compute alone is not."""
    # Note: [fp8 is planned as bf16-mixed] memfit plan sizes fp8 training as torchao's float8
    # linears run it: bf16-mixed storage (fp32 parameters under autocast), fp8 only inside the
    # matmuls; its casts are transient and not counted, so an fp8 run's plan is the bf16-mixed
    # run's byte for byte (tested) and the fit is decided once for both.
    precisions = list(compute_s)
    # each configuration's largest micro-batch without the offload that the next one adds
    largest: dict[tuple[str, bool], int] = {}
    for v in _variants(base_run.optimizer, par.tp, par.pp, sharding, par.dp, ckpt):
        run = dataclasses.replace(base_run, precision=precisions[0], checkpointing=ckpt,
                                  optimizer=v.optimizer, offload_optimizer=v.offload_optimizer,
                                  offload_params=v.offload_params,
                                  offload_activations=v.offload_activations,
                                  chunked_loss=chunked, parallel=par)
        if prune and best is not None and _variant_bound(
                v, run, rates, ranks, min(compute_s.values())) >= best.step_s:
            continue
        tech = v.label() + (", chunked-loss" if chunked else "")
        what = f"{count} x {gpu.name} ({layout}, ckpt={ckpt}, {tech}"
        # Note: [full checkpointing is lowest] Of the three policies, full checkpointing keeps
        # the fewest bytes in the plan for the same variant (tested), so a variant that does
        # not fit at micro-batch 1 under it fits under none: planned once for each layout,
        # loss and variant (not for activation offload, which under full checkpointing
        # moves nothing a checkpointed block keeps). The host bytes, the offloaded states,
        # are the same under each policy, so the host check does not change this.
        if prune and not v.offload_activations:
            key = (chunked, v)
            if key not in lowest:
                low = dataclasses.replace(run, checkpointing="full")
                lowest[key] = bool(_fitting(spec, low, gpu, per_rank, tally=tally,
                                            closest=closest, above=0, most=1, host=host,
                                            what=what.replace(f"ckpt={ckpt}", "ckpt=full")))
            if not lowest[key]:
                continue
        # Note: an offload added at a micro-batch the configuration without it reaches only
        # adds time (its transfers; the optimizer's step on the host): planned above it.
        above = 0
        if skip_offload and (v.offload_params or v.offload_activations):
            above = largest.get((v.optimizer, v.offload_optimizer), 0)
        if skip_offload and v.offload_optimizer:
            above = max(above, largest.get((v.optimizer, False), 0))
        fits = _fitting(spec, run, gpu, per_rank, tally=tally, closest=closest, above=above,
                        most=per_rank // par.pp, what=what, host=host)
        if not fits:
            continue
        if not (v.offload_params or v.offload_activations):
            largest[(v.optimizer, v.offload_optimizer)] = fits[-1][0]
        for precision in precisions:
            if prune and best is not None and compute_s[precision] >= best.step_s:
                continue
            extras = (int(v.optimizer != base_run.optimizer) + int(v.offload_optimizer)
                      + int(v.offload_params) + int(v.offload_activations) + int(chunked)
                      + int(precision == "fp8") + int(par.pp > 1))
            for m, p in fits:
                p_run = (p.run if precision == p.run.precision
                         else dataclasses.replace(p.run, precision=precision))
                step_s = _step_seconds(spec, p_run, rates, m=m, per_rank=per_rank, seq=seq,
                                       counted=counted, plain=plain, count=count, ranks=ranks)
                margin = tie if best is not None and extras > best.extras else 1e-9
                if best is None or step_s < best.step_s * (1 - margin):
                    best = _Best(step_s=step_s, run=p_run, peak=p.total_bytes,
                                 host=p.host_bytes,
                                 label=f"{precision}, ckpt={ckpt}, {tech}, mb={m}x"
                                       f"{per_rank // m}, {layout}",
                                 sharding=shard, extras=extras)
    return best
