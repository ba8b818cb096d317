"""``rightsize_training``: every priced GPU x GPU count x pricing (on-demand, and spot) with
the fastest training configuration that fits it, its step time, the job's time and its cost,
ranked by cost, with the cost-vs-time Pareto front.

For each GPU and count (1, 2, 4, ... up to ``gpus_max``) the search
(:mod:`memfit.fitting.rightsize_search`, whose docstring lists the rules) tries each layout
(tensor parallel 1, 2, 4, 8 inside a node x 1F1B pipeline stages x DDP, ZeRO-1, ZeRO-2, FSDP
over the data-parallel ranks) x precision (bf16-mixed, and fp8 from compute capability 8.9) x
activation checkpointing (none, selective, full) x chunked loss x optimizer (the named one and
its 8-bit form, as ``fit`` searches it) x offload (of the optimizer, the parameters, the
activations), each at its largest fitting micro-batch (under a pipeline, at each fitting one),
and keeps the fastest; a configuration with more of these techniques replaces one with fewer
only when more than ``fit``'s tie tolerance (:data:`memfit.fitting.plan.TIE_TOLERANCE`, 1%)
faster (the tie goes to the simpler option, as in ``fit``):

- **Memory:** :func:`memfit.plan`'s formulas (:mod:`memfit.analytic.planner`), which cover
  LoRA and QLoRA, tensor and pipeline parallelism, ZeRO and its offloads, the chunked loss and
  activation offload; a configuration fits when the plan says so
  (:data:`memfit.analytic.planner.FITS_MARGIN` kept free). ``fit`` traces instead; one traced
  ``fit`` of llama-3-8b at seq 4096 took over ten minutes on the 2-core development machine,
  so a traced search of every GPU and count is out of reach here.
- **Time:** ``fit``'s cost model, :func:`memfit.fitting.cost.step_cost`, at the GPU's catalog
  rates (:func:`memfit.fitting.rates.gpu_rates`), fed what ``fit`` feeds it: the FLOPs of
  forward + backward (+ recompute) counted by ``FlopCounterMode`` on fake tensors with the
  techniques applied (LoRA adapters, checkpointing and the chunked loss, as ``fit``'s
  ``count_flops``; under fp8 the linear layers' matmuls at the fp8 rate), and the
  aten ops dispatched (the launch term). The model's blocks are identical, so both are counted
  on the model cut to one and to two blocks and extended linearly to all of them (exact for a
  stack of identical blocks); the activation traffic is the plan's saved activations scaled by
  the recompute, as ``fit`` scales its traced ones; the model states are the rank's before
  data-parallel sharding (its tensor-parallel and pipeline-stage share), as ``fit`` gives
  them. Bounds prune what cannot win or cannot fit (the answer is the same: tested).
- **Job:** ``steps = ceil(train_tokens / (global_batch x seq))``; ``job_hours = steps x
  step_seconds / 3600``; ``cost = job_hours x count x price_per_gpu_hour``.
- **Spot** (``spot=True``): the same configuration priced by :func:`memfit.preempt.spot_plan`:
  Young's checkpoint interval from the checkpoint's bytes (:func:`memfit.preempt.checkpoint_bytes`
  of the run: weights and optimizer states) at ``write_bandwidth``, the work lost per
  preemption and the restarts, at the named preemption rate for ``ceil(count /
  gpus_per_node)`` instances, and the spot discount.

- **Host memory:** a configuration whose offloaded states (the plan's ``host_bytes``) need more
  than each GPU's share of host RAM, less :data:`memfit.fitting.rightsize_host.HOST_MEMORY_MARGIN`,
  does not fit (:mod:`memfit.fitting.rightsize_host` says where the share comes from:
  ``host_memory``, the RAM of a node as ``memfit plan --host-memory`` means it, else the
  catalog's machine, else a default); what was dropped is in ``host_rejected``.

The Pareto front: the candidates that no other matches or beats on both cost and job time.

Known limitations: memory from the formulas, not the trace; the host memory checked is the
offloaded model states' (not activation offload's host copies, nor the input pipeline's beyond
the margin); only the 1F1B schedule (the one the formulas
size); fp8's casts are not timed; the LoRA adapters' FLOPs are counted but QLoRA's
dequantization is not; no data-loading, evaluation or checkpoint time in the on-demand job.
"""

from __future__ import annotations

import datetime as dt
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memfit.errors import MemfitError
from memfit.fitting.rightsize_args import check_training_args
from memfit.fitting.rightsize_count import _count, _Counter
from memfit.fitting.rightsize_host import HOST_MEMORY_MARGIN, HostLimit, host_limit, rejection
from memfit.fitting.rightsize_search import _Best, _Host, search_gpu_count
from memfit.units import plural

_ = _count  # re-exported for the tests

__all__ = ["DEFAULT_WRITE_BANDWIDTH", "TrainingCandidate", "TrainingRightsize",
           "cost_time_front", "job_steps", "rightsize_training"]

DEFAULT_WRITE_BANDWIDTH = 1e9
"""Bytes/s the checkpoint is written at on spot (1 GB/s: one NVMe-backed cloud volume's order;
give yours)."""

@dataclass(frozen=True, kw_only=True)
class TrainingCandidate:
    """One GPU x count x pricing at its fastest fitting configuration."""

    gpu: str
    count: int
    pricing: str
    price_per_gpu_hour: float
    """On-demand price; a spot row's cost applies the discount to it."""
    config: dict[str, Any]
    step_seconds: float
    job_hours: float
    cost_usd: float
    stale_price: bool = False
    price_date: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"gpu": self.gpu, "count": self.count, "pricing": self.pricing,
                "price_per_gpu_hour": self.price_per_gpu_hour, "config": self.config,
                "step_seconds": self.step_seconds, "job_hours": self.job_hours,
                "cost_usd": self.cost_usd}


@dataclass(frozen=True, kw_only=True)
class TrainingRightsize:
    """The candidates sorted by cost, the Pareto front (indices) and what was left out."""

    candidates: tuple[TrainingCandidate, ...]
    pareto: tuple[int, ...]
    skipped: tuple[str, ...]
    steps: int
    spot: dict[str, Any] | None = None
    plans: int = 0
    """Memory plans made (the search's unit of work besides the FLOP counts)."""
    seconds: float = 0.0
    notes: tuple[str, ...] = field(default=())
    host_memory: dict[str, Any] = field(default_factory=dict)
    """The host memory checked: ``margin``, ``node_bytes`` (``--host-memory``, or None) and for
    each GPU sized its ``ram_bytes_per_gpu`` on a full node and their ``source``."""
    host_rejected: tuple[dict[str, Any], ...] = ()
    """Each GPU x count where a configuration fit the GPU but not its share of host memory:
    ``gpu``, ``count``, ``configurations`` (how many the search planned and dropped),
    ``least_host_bytes_per_gpu``, ``limit_bytes_per_gpu``, ``row_dropped`` (no configuration
    was left) and ``reason``."""

    def to_json(self) -> dict[str, Any]:
        return {"candidates": [c.to_json() for c in self.candidates],
                "pareto": list(self.pareto), "host_memory": self.host_memory,
                "host_rejected": list(self.host_rejected)}


def cost_time_front(candidates: Sequence[TrainingCandidate]) -> tuple[int, ...]:
    """Indices of the candidates no other matches or beats on both ``cost_usd`` and
    ``job_hours`` while beating it on one (equal ones all kept)."""
    from memfit.serving.rightsize import pareto_front

    return pareto_front([(c.cost_usd, c.job_hours) for c in candidates])


def job_steps(train_tokens: float, global_batch: int, seq: int) -> int:
    """Optimizer steps to see ``train_tokens``: ``ceil(tokens / (global_batch x seq))``."""
    return math.ceil(train_tokens / (global_batch * seq))


def _counts(gpus_max: int) -> list[int]:
    out, n = [], 1
    while n <= gpus_max:
        out.append(n)
        n *= 2
    return out


def _on_demand_row(best: _Best, *, name: str, count: int, price: Any, stale: bool,
                   steps: int, host: HostLimit) -> TrainingCandidate:
    """``best`` on ``count`` x ``name`` at the on-demand price: ``steps`` of ``best.step_s``."""
    config = {"label": best.label, "precision": best.run.precision,
              "checkpointing": best.run.checkpointing, "optimizer": best.run.optimizer,
              "offload_optimizer": best.run.offload_optimizer,
              "offload_params": best.run.offload_params,
              "offload_activations": best.run.offload_activations,
              "chunked_loss": best.run.chunked_loss, "micro_batch": best.run.batch,
              "accumulation": best.run.grad_accum, "tp": best.run.parallel.tp,
              "pp": best.run.parallel.pp, "dp": best.run.parallel.dp, "sharding": best.sharding,
              "peak_bytes_per_gpu": best.peak, "host_bytes_per_gpu": best.host,
              "host_limit_bytes_per_gpu": host.limit_bytes}
    hours = steps * best.step_s / 3600
    return TrainingCandidate(gpu=name, count=count, pricing="on-demand",
                             price_per_gpu_hour=price.price_per_hour, config=config,
                             step_seconds=best.step_s, job_hours=hours,
                             cost_usd=hours * count * price.price_per_hour, stale_price=stale,
                             price_date=price.date)


def _spot_info(band: str, mtbf_hours: float | None, gpus_per_node: int, write_bandwidth: float,
               discount: float) -> dict[str, Any]:
    """The spot assumptions every spot row was priced at (:attr:`TrainingRightsize.spot`)."""
    from memfit.preempt.spot import INTERRUPTION_BANDS

    return {"band": None if mtbf_hours is not None else band,
            "source": (f"{mtbf_hours} h per instance (given)" if mtbf_hours is not None
                       else INTERRUPTION_BANDS[band][2]),
            "mtbf_hours_per_instance": mtbf_hours if mtbf_hours is not None
            else INTERRUPTION_BANDS[band][0],
            "gpus_per_instance": gpus_per_node, "write_bandwidth": write_bandwidth,
            "discount": discount}


def _spot_row(spec: Any, best: _Best, *, name: str, count: int, price: Any, stale: bool,
              config: dict[str, Any], steps: int, band: str, mtbf_hours: float | None,
              gpus_per_node: int, write_bandwidth: float, discount: float,
              rate: str, skipped: list[str]) -> TrainingCandidate | None:
    """``best`` on ``count`` x ``name`` priced on spot (:func:`memfit.preempt.spot_plan`) at
    ``mtbf_hours`` per instance or the ``band``'s rate for ``ceil(count / gpus_per_node)``
    instances; ``None`` (the reason added to ``skipped``) where spot cannot run it."""
    from memfit.preempt.spot import INTERRUPTION_BANDS, band_mtbf_s, checkpoint_bytes, spot_plan

    instances = math.ceil(count / gpus_per_node)
    mtbf_s = (mtbf_hours * 3600 / instances if mtbf_hours is not None
              else band_mtbf_s(band, instances))
    notice = None if mtbf_hours is not None else INTERRUPTION_BANDS[band][1]
    size = checkpoint_bytes(spec, best.run)
    try:
        sp = spot_plan(checkpoint_bytes=size, write_bandwidth=write_bandwidth,
                       mtbf_s=mtbf_s, work_s=steps * best.step_s,
                       price_per_hour=count * price.price_per_hour,
                       spot_discount=discount, notice_s=notice,
                       step_s=best.step_s)
    except MemfitError as exc:
        skipped.append(f"{count} x {name} spot: {exc}")
        return None
    spot_config = {**config, "checkpoint_bytes": sp.checkpoint_bytes,
                   "checkpoint_every_s": sp.interval_s,
                   "job_mtbf_hours": mtbf_s / 3600,
                   "expected_preemptions": sp.expected_preemptions,
                   "lost_per_preemption_s": sp.lost_per_preemption_s,
                   "restart_s": sp.restart_s,
                   "preemption_rate": rate}
    return TrainingCandidate(
        gpu=name, count=count, pricing="spot",
        price_per_gpu_hour=price.price_per_hour, config=spot_config,
        step_seconds=best.step_s, job_hours=sp.wall_s / 3600,
        cost_usd=sp.spot_cost or 0.0, stale_price=stale, price_date=price.date)


def _nothing_found(gpus_max: int, closest: list[tuple[float, str]],
                   skipped: list[str], rejected: list[dict[str, Any]]) -> MemfitError:
    """The error when no GPU x count fits: the host memory that ruled out what fit the GPUs,
    the closest miss, or why no GPU was sized."""
    if rejected:
        least = min(rejected, key=lambda r: r["least_host_bytes_per_gpu"]
                    / r["limit_bytes_per_gpu"])
        configs = sum(r["configurations"] for r in rejected)
        return MemfitError(f"no configuration fits on any GPU up to {plural(gpus_max, 'GPU')} "
                           f"within host memory: {plural(configs, 'configuration')} "
                           f"fit{'s' if configs == 1 else ''} a GPU but not its host memory; on "
                           f"{least['count']} x "
                           f"{least['gpu']}, {least['reason']}; give the node's RAM with "
                           "--host-memory, or raise --gpus-max")
    if closest:
        ratio, what = min(closest)
        return MemfitError(f"no configuration fits on any GPU up to {plural(gpus_max, 'GPU')}; the "
                           f"closest is {what} ({ratio:.2f}x); raise --gpus-max, shorten "
                           "--seq, or use --mode lora / qlora")
    return MemfitError("no GPU to size: " + ("; ".join(skipped[:3]) or "none priced")
                       + "; pass --prices FILE or --gpus")


def rightsize_training(model: str | Path, *, mode: str = "lora", train_tokens: float,
                       seq: int, global_batch: int, gpus_max: int = 16,
                       gpus: Sequence[str] | None = None, optimizer: str = "adamw",
                       spot: bool = False, interruption: str | None = None,
                       mtbf_hours: float | None = None,
                       write_bandwidth: float = DEFAULT_WRITE_BANDWIDTH,
                       spot_discount: float | None = None, gpus_per_node: int = 8,
                       prices: str | Path | Mapping[str, Any] | None = None,
                       max_price_age_days: int | None = None, today: dt.date | None = None,
                       gpu_file: str | Path | None = None,
                       host_memory: int | None = None,
                       prune: bool = True) -> TrainingRightsize:
    """Size a training job of ``train_tokens`` tokens (``mode``: train, lora or qlora) at
    ``seq`` tokens a sample and ``global_batch`` samples a step: every GPU (``gpus``, default
    the priced catalog's) x count (powers of two up to ``gpus_max``) x pricing, as the module
    docstring says. ``prices`` overrides the catalog's (:func:`memfit.serving.load_prices`);
    a price older than ``max_price_age_days`` is flagged. With ``spot``, each configuration is
    priced on spot too at ``interruption`` (a :data:`memfit.preempt.INTERRUPTION_BANDS` name,
    default :data:`memfit.preempt.spot.DEFAULT_BAND`) or ``mtbf_hours`` per instance.
    ``host_memory`` is a node's RAM in bytes (:mod:`memfit.fitting.rightsize_host`; default:
    the catalog's machine for each GPU). ``prune=False`` plans every policy (the same answer,
    slower).

    >>> r = rightsize_training("llama-3-8b", train_tokens=2e9, seq=4096, global_batch=64)
    >>> r.candidates[0].gpu, r.candidates[0].cost_usd
    """
    from memfit.gpus import get_gpu
    from memfit.serving.prices import DEFAULT_MAX_PRICE_AGE_DAYS, price_is_stale

    started = time.perf_counter()
    band, discount = check_training_args(
        train_tokens=train_tokens, seq=seq, global_batch=global_batch, gpus_max=gpus_max,
        gpus_per_node=gpus_per_node, mode=mode, interruption=interruption,
        mtbf_hours=mtbf_hours, write_bandwidth=write_bandwidth, spot_discount=spot_discount,
        host_memory=host_memory)
    age = DEFAULT_MAX_PRICE_AGE_DAYS if max_price_age_days is None else max_price_age_days
    today = today or dt.date.today()
    table, names = _priced_gpus(gpus, prices, gpu_file, today)
    spec, base_run = _training_model(model, mode, optimizer, seq)
    steps = job_steps(train_tokens, global_batch, seq)
    counter = _Counter(spec, base_run, seq)
    found: list[TrainingCandidate] = []
    skipped: list[str] = []
    closest: list[tuple[float, str]] = []
    tally = [0]
    rejected: list[dict[str, Any]] = []
    host_info: dict[str, Any] = {"margin": HOST_MEMORY_MARGIN, "node_bytes": host_memory,
                                 "gpus": {}}
    spot_info = _spot_info(band, mtbf_hours, gpus_per_node, write_bandwidth, discount) \
        if spot else None
    for name in names:
        price = table.get(name)
        if price is None:
            skipped.append(f"{name}: no price (pass --prices FILE)")
            continue
        gpu = get_gpu(name, gpu_file)
        if gpu.vendor not in ("nvidia", "custom"):
            skipped.append(f"{name}: fit's cost model and plans are CUDA's (vendor "
                           f"{gpu.vendor})")
            continue
        stale = price_is_stale(price, today=today, max_age_days=age)
        full = host_limit(gpu, gpus_per_node, host_memory=host_memory,
                          gpus_per_node=gpus_per_node)
        host_info["gpus"][name] = {"ram_bytes_per_gpu": full.ram_bytes, "source": full.source}
        for count in _counts(gpus_max):
            limit = host_limit(gpu, count, host_memory=host_memory, gpus_per_node=gpus_per_node)
            host = _Host(limit=limit.limit_bytes, rejected=[])
            best = search_gpu_count(spec, base_run, gpu, count, global_batch=global_batch,
                                     seq=seq, counter=counter, gpus_per_node=gpus_per_node,
                                     closest=closest, prune=prune, tally=tally, host=host)
            if host.rejected:
                rejected.append(rejection(name, count, limit, host.rejected, best is None))
            if best is None:
                continue
            found.append(_on_demand_row(best, name=name, count=count, price=price, stale=stale,
                                        steps=steps, host=limit))
            if spot:
                row = _spot_row(spec, best, name=name, count=count, price=price, stale=stale,
                                config=found[-1].config, steps=steps, band=band,
                                mtbf_hours=mtbf_hours, gpus_per_node=gpus_per_node,
                                write_bandwidth=write_bandwidth, discount=discount, skipped=skipped,
                                rate=spot_info["source"] if spot_info else "")
                if row is not None:
                    found.append(row)
    if not found:
        raise _nothing_found(gpus_max, closest, skipped, rejected)
    found.sort(key=lambda c: (c.cost_usd, c.job_hours))
    front = cost_time_front(found)
    return TrainingRightsize(candidates=tuple(found), pareto=front, skipped=tuple(skipped),
                             steps=steps, spot=spot_info, plans=tally[0],
                             seconds=time.perf_counter() - started, host_memory=host_info,
                             host_rejected=tuple(rejected))


def _priced_gpus(gpus: Sequence[str] | None, prices: str | Path | Mapping[str, Any] | None,
                 gpu_file: str | Path | None,
                 today: dt.date) -> tuple[dict[str, Any], list[str]]:
    """The price table (the catalog's, ``prices`` over it) and the GPUs to size: ``gpus``
    (catalog names, each once) or every priced one."""
    from memfit.gpus import get_gpu
    from memfit.serving.prices import catalog_prices, load_prices

    table = catalog_prices(gpu_file)
    if prices is not None:
        table.update(load_prices(prices, gpu_file, today=today))
    names = list(table) if gpus is None else \
        list(dict.fromkeys(get_gpu(g, gpu_file).name for g in gpus))
    return table, names


def _training_model(model: str | Path, mode: str, optimizer: str, seq: int) -> tuple[Any, Any]:
    """The decoder's spec and the run every candidate starts from, checked (one line)."""
    from memfit.analytic.checks import check_context
    from memfit.analytic.config import RunConfig
    from memfit.models import resolve_model
    from memfit.models.spec import TransformerSpec

    spec = resolve_model(model)
    if not isinstance(spec, TransformerSpec) or spec.arch == "vision":
        raise MemfitError(f"{model}: rightsize sizes decoder language models (a preset or a "
                          "config.json); see `memfit models`")
    base_run = RunConfig(mode=mode, optimizer=optimizer, seq=seq)  # type: ignore[arg-type]
    check_context(spec, base_run)
    return spec, base_run
