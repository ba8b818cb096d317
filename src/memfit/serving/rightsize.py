"""``rightsize_serving``: the cheapest replica count of every GPU x TP size x quantization that
serves a request rate within p95 TTFT / TPOT targets, ranked by cost, with $ per million tokens.

For each configuration:

1. :func:`~memfit.serving.serve_plan` sizes vLLM's KV pool on the GPU (one plan per
   ``(gpu, tp, quant)``; the traced activation peak is cached per ``(tp, max_num_batched_tokens)``
   by :mod:`memfit.serving.profile_run`; not traced where the pool is empty at a 0 peak, and
   traced on three layers where all are alike: :func:`_plan`). A plan that raises, or whose
   pool does not hold one request of ``max_model_len``, is skipped with the reason.
2. The **floors**: one request alone (:func:`~memfit.serving.simulate`) gives the lowest TTFT
   and TPOT the configuration reaches at any replica count; above a target, it is skipped.
3. The **throughput bound**: a replica computes ``2 x params x (P + O) + 2 x lm_head x O``
   FLOPs a request at ``peak x compute_efficiency`` (the roofline's), so it keeps up with
   ``QPS / replicas`` only if ``QPS / replicas x t_request < 1``: the search starts at
   ``floor(QPS x t_request) + 1`` replicas.
4. The **search**: one replica is simulated at ``QPS / replicas`` (``num_requests`` requests,
   200 by default, seeded Poisson arrivals with fixed lengths; the same seed at each count, so
   arrival times scale by the count), doubling the count until the p95s meet the targets
   (at most ``max_replicas``), then bisecting down to the fewest that meet them. The bisection
   assumes the p95s do not rise with more replicas (true of these scaled arrivals up to the
   simulator's step granularity).

Cost ``= replicas x tp x price_per_hour``; ``$ / M tokens = cost / (tokens an hour) x 1e6``, the
tokens being the offered load (``QPS x 3600 x output_tokens``; ``..._total_tokens`` counts the
prompt too). The Pareto front: the candidates no other candidate matches or beats on cost,
p95 TTFT and p95 TPOT at once.

Known limitations: the roofline's (:mod:`memfit.serving.roofline`): no TP all-reduce time (a
larger TP looks faster than it is), no CPU overhead; prefix caching off; a replica is one
engine (no data-parallel attention); load spread evenly over replicas.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memfit.errors import MemfitError
from memfit.serving.prices import (
    DEFAULT_MAX_PRICE_AGE_DAYS,
    GpuPrice,
    catalog_prices,
    load_prices,
    price_is_stale,
)
from memfit.serving.roofline import Roofline
from memfit.serving.simulate import Simulation, percentile, roofline_for, simulate
from memfit.serving.workload import Request, poisson_requests
from memfit.units import plural

__all__ = ["DEFAULT_NUM_REQUESTS", "RightsizeResult", "ServingCandidate", "Skipped",
           "pareto_front", "rightsize_serving"]

DEFAULT_NUM_REQUESTS = 200
"""Requests simulated per replica count (seeded Poisson arrivals, fixed lengths)."""
DEFAULT_MAX_REPLICAS = 256


@dataclass(frozen=True, kw_only=True)
class ServingCandidate:
    """One configuration at its cheapest replica count meeting the targets."""

    gpu: str
    tp: int
    quant: str
    replicas: int
    price: GpuPrice
    stale_price: bool
    p95_ttft_s: float
    p95_tpot_s: float | None
    kv_cache_tokens: int
    """Per replica (vLLM's ``GPU KV cache size``)."""
    qps: float
    prompt_tokens: int
    output_tokens: int

    @property
    def count(self) -> int:
        """GPUs in all: replicas x tp."""
        return self.replicas * self.tp

    @property
    def cost_per_hour(self) -> float:
        return self.count * self.price.price_per_hour

    def usd_per_million(self, tokens_per_request: int) -> float:
        per_hour = self.qps * 3600 * tokens_per_request
        return self.cost_per_hour / per_hour * 1e6

    def to_json(self) -> dict[str, Any]:
        return {"gpu": self.gpu, "count": self.count, "tp": self.tp, "quant": self.quant,
                "replicas": self.replicas, "pricing": "on-demand",
                "price_per_gpu_hour": self.price.price_per_hour,
                "price_date": self.price.date, "price_source": self.price.source,
                "stale_price": self.stale_price, "cost_per_hour": self.cost_per_hour,
                "usd_per_million_tokens": self.usd_per_million(self.output_tokens),
                "usd_per_million_total_tokens": self.usd_per_million(
                    self.prompt_tokens + self.output_tokens),
                "p95_ttft_s": self.p95_ttft_s, "p95_tpot_s": self.p95_tpot_s,
                "kv_cache_tokens": self.kv_cache_tokens}


@dataclass(frozen=True, kw_only=True)
class Skipped:
    """A configuration left out, and why. ``p95_ttft_s`` / ``p95_tpot_s``: the best it reached
    (its floors, or at ``max_replicas``) when it missed a latency target; else None."""

    gpu: str
    tp: int
    quant: str
    reason: str
    p95_ttft_s: float | None = None
    p95_tpot_s: float | None = None
    replicas: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"gpu": self.gpu, "tp": self.tp, "quant": self.quant, "reason": self.reason,
                "p95_ttft_s": self.p95_ttft_s, "p95_tpot_s": self.p95_tpot_s,
                "replicas": self.replicas}


@dataclass(frozen=True, kw_only=True)
class RightsizeResult:
    """The candidates sorted by cost, the skipped ones, and the Pareto front (indices)."""

    candidates: tuple[ServingCandidate, ...]
    skipped: tuple[Skipped, ...]
    pareto: tuple[int, ...]
    num_requests: int
    seconds: float = 0.0
    notes: tuple[str, ...] = field(default=())

    def to_json(self) -> dict[str, Any]:
        return {"candidates": [c.to_json() for c in self.candidates],
                "skipped": [s.to_json() for s in self.skipped], "pareto": list(self.pareto),
                "num_requests": self.num_requests}


def pareto_front(points: Sequence[Sequence[float]]) -> tuple[int, ...]:
    """Indices of the points no other point matches or beats in every coordinate while beating
    it in one (lower is better; equal points are all kept).

    >>> pareto_front([(1, 5), (2, 3), (3, 4), (1, 6)])
    (0, 1)
    """
    def dominates(a: Sequence[float], b: Sequence[float]) -> bool:
        return all(x <= y for x, y in zip(a, b, strict=True)) and \
            any(x < y for x, y in zip(a, b, strict=True))

    return tuple(i for i, p in enumerate(points)
                 if not any(dominates(q, p) for j, q in enumerate(points) if j != i))


def _p95s(sim: Simulation) -> tuple[float, float | None]:
    run = sim.continuous
    return percentile(run.ttft_s, 95), (percentile(run.tpot_s, 95) if run.tpot_s else None)


def _meets(p95: tuple[float, float | None], ttft: float | None, tpot: float | None) -> bool:
    return (ttft is None or p95[0] <= ttft) and \
        (tpot is None or p95[1] is None or p95[1] <= tpot)


def _request_seconds(roofline: Roofline, prompt: int, output: int) -> float:
    """A request's matmul FLOPs at the roofline's compute rate (the throughput bound)."""
    flops = 2 * roofline.params * (prompt + output) + 2 * roofline.lm_head_params * output
    return flops / (roofline.peak_flops * roofline.compute_efficiency)


@dataclass(frozen=True, kw_only=True)
class _Workload:
    qps: float
    prompt: int
    output: int
    ttft: float | None
    tpot: float | None
    num_requests: int
    seed: int
    max_replicas: int


_Found = tuple[int | None, tuple[float, float | None], int, str]


def _search(plan: Any, roofline: Roofline, w: _Workload) -> _Found:
    """``(replicas, their p95s, replicas, "")``: the fewest replicas that meet the targets; or
    ``(None, the best p95s reached, at how many replicas (0: one request alone), why)``."""
    floor = _p95s(simulate(plan, [Request(arrival_time=0.0, prompt_tokens=w.prompt,
                                          output_tokens=w.output)],
                           roofline=roofline, static=False))
    if not _meets(floor, w.ttft, w.tpot):
        return None, floor, 0, "one request alone misses the latency target"
    cache: dict[int, tuple[float, float | None]] = {}

    def p95_at(r: int) -> tuple[float, float | None]:
        if r not in cache:
            reqs = poisson_requests(w.num_requests, w.qps / r, prompt_tokens=w.prompt,
                                    output_tokens=w.output, seed=w.seed)
            cache[r] = _p95s(simulate(plan, reqs, roofline=roofline, static=False))
        return cache[r]

    low = math.floor(w.qps * _request_seconds(roofline, w.prompt, w.output)) + 1
    if low > w.max_replicas:
        return None, floor, low, (f"needs {low} replicas for the throughput, above "
                                  f"max_replicas {w.max_replicas}")
    fail, r = low - 1, low
    while not _meets(p95_at(r), w.ttft, w.tpot):
        if r >= w.max_replicas:
            return None, p95_at(r), r, (f"misses the latency target at {plural(r, 'replica')} "
                                        "(the most searched)")
        fail, r = r, min(2 * r, w.max_replicas)
    while r - fail > 1:  # the fewest that meet: in (fail, r]
        mid = (fail + r) // 2
        if _meets(p95_at(mid), w.ttft, w.tpot):
            r = mid
        else:
            fail = mid
    return r, p95_at(r), r, ""


_UNIFORM_LAYERS = frozenset({"llama", "mistral"})
"""Model types whose decoder layers are all alike (no per-layer types, windows or experts)."""
_SAMPLED_LAYERS = 3


def _sampled_config(config: Mapping[str, Any]) -> dict[str, Any] | None:
    """``config`` cut to its first :data:`_SAMPLED_LAYERS` decoder layers when every layer is
    alike (:data:`_UNIFORM_LAYERS`, no ``layer_types``, not multimodal), else None. The
    profile run's peak is the residual stream plus the largest sub-block transient over the
    layers; the first, a middle and the last layer show every transient a stack of identical
    layers has, so the cut config's peak is the full one's (tests/serving/test_rightsize.py
    checks it on llama-3-8b) at a fraction of the trace."""
    if config.get("model_type") not in _UNIFORM_LAYERS or "layer_types" in config or \
            any(k in config for k in ("text_config", "vision_config")):
        return None
    layers = config.get("num_hidden_layers")
    if not isinstance(layers, int) or layers <= _SAMPLED_LAYERS:
        return None
    return {**config, "num_hidden_layers": _SAMPLED_LAYERS}


def _plan(serve_plan: Any, model: Any, config: Mapping[str, Any], *,
          activation_peak_bytes: int | None, prune: bool, **kw: Any) -> Any:
    """``serve_plan(model, **kw)``. With ``prune`` (and no ``activation_peak_bytes``), first at
    an activation peak of 0 (no trace): the KV budget falls as the peak rises (``requested -
    weights - activation - ...``), so a pool already empty at 0 is empty at the traced peak,
    and that plan (pool 0, no block) is the traced one in every field the search reads; the
    trace is skipped. Else the peak is traced on :func:`_sampled_config` where the layers are
    alike, and given to ``serve_plan`` (its ``activation_source`` then reads "given")."""
    if not prune or activation_peak_bytes is not None:
        return serve_plan(model, activation_peak_bytes=activation_peak_bytes, **kw)
    bound = serve_plan(model, activation_peak_bytes=0, **kw)
    if bound.budget is None or bound.budget.kv_cache_bytes <= 0:
        return bound
    sampled = _sampled_config(config)
    if sampled is None:
        return serve_plan(model, **kw)
    from memfit.serving.kv_spec import model_dtype_bytes
    from memfit.serving.profile_run import profile_activation_peak

    peak = profile_activation_peak(sampled, max_num_batched_tokens=bound.max_num_batched_tokens,
                                   max_num_seqs=bound.max_num_seqs, tp=bound.tp,
                                   dtype_bytes=model_dtype_bytes(config))
    return serve_plan(model, activation_peak_bytes=int(peak), **kw)


def _prices(gpus: Sequence[str] | None, prices: str | Path | Mapping[str, Any] | None,
            gpu_file: str | Path | None,
            today: dt.date) -> tuple[list[str], dict[str, GpuPrice]]:
    from memfit.gpus import get_gpu

    table = catalog_prices(gpu_file)
    if prices is not None:
        table.update(load_prices(prices, gpu_file, today=today))
    names = list(table) if gpus is None else [get_gpu(g, gpu_file).name for g in gpus]
    if not names:
        raise MemfitError("no GPUs to size: pass --gpus NAME,... (`memfit gpus` lists them)")
    return list(dict.fromkeys(names)), table


def _check(qps: float, prompt_tokens: int, output_tokens: int, ttft: float | None,
           tpot: float | None, num_requests: int, max_replicas: int) -> None:
    if isinstance(qps, bool) or not isinstance(qps, (int, float)) or not \
            (math.isfinite(qps) and qps > 0):
        raise MemfitError(f"--qps must be a finite rate > 0 requests per second, got {qps!r}")
    for flag, value in (("--prompt-tokens", prompt_tokens), ("--output-tokens", output_tokens),
                        ("num_requests", num_requests), ("max_replicas", max_replicas)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise MemfitError(f"{flag} must be an integer >= 1, got {value!r}")
    for flag, target in (("--p95-ttft", ttft), ("--p95-tpot", tpot)):
        if target is not None and not (math.isfinite(target) and target > 0):
            raise MemfitError(f"{flag} must be a time > 0, got {target!r}")


def _check_model_options(config: Mapping[str, Any], tp: Sequence[int],
                         quant: Sequence[str]) -> None:
    """Refuse, before any GPU is sized, a ``--quant`` name vLLM does not serve, and ``--tp``
    sizes of which the model's heads take none: both hold on every GPU. A tp size the heads
    cannot take beside one they can (the default 1, 2, 4, 8 on a model of 28 heads) stays in
    the search's skipped list, with the per-GPU reasons (a capability below a format's minimum,
    a pool too small)."""
    from memfit.serving.kv_spec import kv_spec
    from memfit.serving.weights import check_quant

    for q in dict.fromkeys(quant):
        check_quant(q)
    refusals = []
    for size in dict.fromkeys(tp):
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise MemfitError(f"--tp must be whole numbers >= 1, got {size!r}")
        try:
            kv_spec(config, tp=size)
        except MemfitError as exc:
            refusals.append(str(exc))
    if refusals and len(refusals) == len(dict.fromkeys(tp)):
        raise MemfitError(refusals[0] if len(refusals) == 1 else
                          f"no --tp size fits the model: {'; '.join(refusals)}")


def _closest(skipped: Sequence[Skipped], ttft: float | None, tpot: float | None) -> str:
    near = [s for s in skipped if s.p95_ttft_s is not None]
    if not near:
        reasons = "; ".join(f"{s.gpu} tp{s.tp} {s.quant}: {s.reason}" for s in skipped[:3])
        return f"no configuration fits ({len(skipped)} skipped: {reasons})"

    def ratio(s: Skipped) -> float:
        return max((s.p95_ttft_s or 0) / ttft if ttft else 0,
                   (s.p95_tpot_s or 0) / tpot if tpot else 0)

    best = min(near, key=ratio)
    ttft_text = f"{(best.p95_ttft_s or 0) * 1e3:.1f} ms"
    tp_text = "-" if best.p95_tpot_s is None else f"{best.p95_tpot_s * 1e3:.1f} ms"
    return (f"no configuration meets the latency targets; the closest is {best.gpu} tp"
            f"{best.tp} {best.quant} ({best.reason}): p95 TTFT {ttft_text}, "
            f"p95 TPOT {tp_text}; relax --p95-ttft / --p95-tpot or add GPUs")


def rightsize_serving(model: str | Path | Mapping[str, Any], *, qps: float, prompt_tokens: int,
                      output_tokens: int, p95_ttft_s: float | None = None,
                      p95_tpot_s: float | None = None, gpus: Sequence[str] | None = None,
                      tp: Sequence[int] = (1, 2, 4, 8), quant: Sequence[str] = ("none", "fp8"),
                      prices: str | Path | Mapping[str, Any] | None = None,
                      max_price_age_days: int = DEFAULT_MAX_PRICE_AGE_DAYS,
                      today: dt.date | None = None, max_model_len: int | None = None,
                      gpu_memory_utilization: float = 0.9,
                      activation_peak_bytes: int | None = None,
                      num_requests: int = DEFAULT_NUM_REQUESTS, seed: int = 0,
                      max_replicas: int = DEFAULT_MAX_REPLICAS,
                      gpu_file: str | Path | None = None, prune: bool = True,
                      ) -> RightsizeResult:
    """Every GPU (``gpus``, default the catalog's priced ones) x ``tp`` x ``quant`` (``none``:
    the checkpoint's dtype) at its cheapest replica count for ``qps`` requests/s of
    ``prompt_tokens`` + ``output_tokens`` within the p95 targets (seconds); the search is the
    module docstring's. ``prices`` (a file or mapping) overrides the catalog's; a price older
    than ``max_price_age_days`` on ``today`` (default: today) is flagged.

    ``prune=False`` turns off the work savings of :func:`_plan` (no trace where the KV pool is
    empty at any activation peak; the peak traced on three decoder layers where all are
    alike): the same result, slower (the tests compare them).

    Bad input, or no configuration that meets the targets (the closest named), raises
    MemfitError (one line).
    """
    import time

    from memfit.gpus import get_gpu
    from memfit.serving.plan import load_config, serve_plan

    started = time.perf_counter()
    _check(qps, prompt_tokens, output_tokens, p95_ttft_s, p95_tpot_s, num_requests,
           max_replicas)
    today = today or dt.date.today()
    names, table = _prices(gpus, prices, gpu_file, today)
    _, config = load_config(model)
    _check_model_options(config, tp, quant)
    w = _Workload(qps=float(qps), prompt=prompt_tokens, output=output_tokens, ttft=p95_ttft_s,
                  tpot=p95_tpot_s, num_requests=num_requests, seed=seed,
                  max_replicas=max_replicas)
    found: list[ServingCandidate] = []
    skipped: list[Skipped] = []
    for name in names:
        for size in dict.fromkeys(tp):
            for q in dict.fromkeys(quant):
                def skip(reason: str, p95: tuple[float, float | None] | None = None,
                         replicas: int | None = None, name: str = name, size: int = size,
                         q: str = q) -> None:
                    skipped.append(Skipped(gpu=name, tp=size, quant=q, reason=reason,
                                           p95_ttft_s=None if p95 is None else p95[0],
                                           p95_tpot_s=None if p95 is None else p95[1],
                                           replicas=replicas))

                price = table.get(name)
                if price is None:
                    skip("no price (pass --prices FILE)")
                    continue
                fmt = None if q == "none" else q
                if get_gpu(name, gpu_file).vendor not in ("nvidia", "custom"):
                    skip("serve_plan models vLLM on CUDA GPUs only")
                    continue
                try:
                    plan = _plan(serve_plan, model, config, gpu=name, tp=size, quant=fmt,
                                 max_model_len=max_model_len,
                                 gpu_memory_utilization=gpu_memory_utilization,
                                 activation_peak_bytes=activation_peak_bytes, prune=prune)
                    if not plan.fits or plan.num_gpu_blocks < 2:
                        skip(f"the KV pool ({plan.kv_cache_bytes / 2**30:.1f} GiB) holds no "
                             f"request of max_model_len {plan.max_model_len}")
                        continue
                    if prompt_tokens + output_tokens > plan.max_model_len:
                        skip(f"a request of {prompt_tokens + output_tokens} tokens is above "
                             f"max_model_len {plan.max_model_len}")
                        continue
                    roofline = roofline_for(plan, gpu=name, config=config, quant=fmt)
                    got = _search(plan, roofline, w)
                except MemfitError as exc:
                    skip(str(exc))
                    continue
                replicas, p95, at, why = got
                if replicas is None:
                    skip(why, p95, at or None)
                    continue
                found.append(ServingCandidate(
                    gpu=name, tp=size, quant=q, replicas=replicas, price=price,
                    stale_price=price_is_stale(price, today=today,
                                               max_age_days=max_price_age_days),
                    p95_ttft_s=p95[0], p95_tpot_s=p95[1],
                    kv_cache_tokens=plan.kv_cache_tokens, qps=w.qps,
                    prompt_tokens=prompt_tokens, output_tokens=output_tokens))
    if not found:
        raise MemfitError(_closest(skipped, p95_ttft_s, p95_tpot_s))
    found.sort(key=lambda c: (c.cost_per_hour, c.p95_ttft_s, c.gpu, c.tp, c.quant))
    front = pareto_front([(c.cost_per_hour, c.p95_ttft_s, c.p95_tpot_s or 0.0) for c in found])
    return RightsizeResult(candidates=tuple(found), skipped=tuple(skipped), pareto=front,
                           num_requests=num_requests, seconds=time.perf_counter() - started)
