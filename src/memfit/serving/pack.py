"""``memfit pack``: place several served models (tenants), each with its traffic, onto a GPU
pool, whole GPUs shared or MIG slices, with memory and HBM bandwidth both constraining.

Each tenant is one vLLM 0.33 engine (one process per GPU of its TP group). Per GPU of its
group it needs, on the device it lands on (a whole GPU or a MIG instance):

- **memory**: weights + profile-run activation peak + memory outside torch + CUDA graphs
  (vLLM's startup budget, :func:`memfit.serving.startup.startup_budget`) + the CUDA context,
  NCCL and cuBLAS baseline (each engine is its own process) + the KV cache its concurrency
  needs: ``max(C x R(prompt + output), R(max_model_len) + one block)``, ``R(n)`` the bytes vLLM
  holds for a request of ``n`` tokens (block-rounded, every KV cache group; vLLM's startup
  check needs one request of ``max_model_len`` beside the null block);
- **HBM bandwidth**: ``(W + C x R(prompt + output / 2)) / TPOT`` bytes/s: each decode step
  streams the weights ``W`` and every running request's KV (at its mean decode context), and
  the engine steps every ``TPOT`` seconds.

The concurrency ``C`` comes from Little's law, ``C = ceil(QPS x request seconds)``, with a
deliberately simple request-time model (an **estimate**, not a simulation):

- prefill is compute-bound: ``prompt x 2 P / (PREFILL_MFU x FLOPS)``, ``P`` the parameters on
  one GPU of the group, ``FLOPS`` the catalog's dense bf16 peak (x the MIG compute fraction);
- decode is bound by HBM bandwidth: each output token takes one step of at most the tenant's
  TPOT target (``tpot_ms``, default :data:`DEFAULT_TPOT_S`); the bandwidth need above is what
  holds that target. A tenant stepping faster on an idle GPU only lowers ``C``: the memory
  figure is an upper bound.

Capacities: a whole GPU's ``usable_bytes`` and ``HBM_EFFICIENCY x`` its bandwidth; a MIG
instance its ``nvidia-smi`` memory and ``memory_slices / 8`` of that bandwidth
(:mod:`memfit.serving.mig`). Tenants sharing a whole GPU add up in both; a MIG instance holds
one tenant, and a GPU's instances must form a valid MIG combination.

The packer minimises (tenants left unplaced, GPUs used): first-fit decreasing by each tenant's
larger fraction of a GPU (memory or bandwidth), then, when the instance has at most
:data:`EXACT_MAX_TENANTS` tenants and :data:`EXACT_MAX_GPUS` GPUs, an exhaustive
branch-and-bound search whose answer replaces the heuristic's (first-fit decreasing can use
more GPUs than needed: items 5, 4, 3, 3, 3, 2 in bins of 10 take 3 bins, 2 suffice).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from itertools import combinations
from pathlib import Path
from typing import Any

from memfit.errors import MemfitError, suggest
from memfit.serving.mig import (
    MIG_GPUS,
    MIG_UNLISTED,
    MigProfile,
    mig_profile,
    mig_profiles,
    valid_combination,
)

__all__ = ["DEFAULT_TPOT_S", "EXACT_MAX_GPUS", "EXACT_MAX_TENANTS", "HBM_EFFICIENCY",
           "PREFILL_MFU", "Demand", "Item", "PackResult", "Packing", "Tenant", "load_tenants",
           "pack", "pack_items", "parse_pool", "tenant_demand"]

HBM_EFFICIENCY = 0.8
"""The share of the catalog's HBM bandwidth a decode step streams at (memory-bound kernels
reach 70-90% of peak; an estimate)."""
PREFILL_MFU = 0.5
"""The share of the catalog's dense bf16 FLOPS a prefill reaches (an estimate)."""
DEFAULT_TPOT_S = 0.05
"""A tenant's decode step (time per output token) target when it sets none: 50 ms."""
EXACT_MAX_TENANTS = 8
"""The exhaustive search runs when the instance has at most this many tenants ..."""
EXACT_MAX_GPUS = 6
"""... and at most this many GPUs in the pool."""

_TENANT_KEYS = ("name", "model", "qps", "prompt_tokens", "output_tokens", "concurrency",
                "context", "tp", "quant", "kv_cache_dtype", "max_model_len", "max_num_seqs",
                "max_num_batched_tokens", "enforce_eager", "tpot_ms", "ttft_ms", "mig",
                "activation_peak_bytes", "cuda_graph_bytes")


# --------------------------------------------------------------------------------------------
# Tenants


@dataclass(frozen=True, kw_only=True)
class Tenant:
    """One served model and its traffic: ``qps`` with ``prompt_tokens`` and ``output_tokens``
    (Little's law gives the concurrency), or ``concurrency`` requests of ``context`` tokens.

    Known limitations: the request-time model is a roofline estimate (module docstring); MoE
    models count every expert's parameters for the prefill FLOPs (slower prefill, larger
    concurrency: conservative).
    """

    name: str
    model: str | Mapping[str, Any]
    """Anything ``serve_plan`` takes: a preset, a config.json or its folder, a cached hub id."""
    qps: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    concurrency: int | None = None
    """Requests in flight, given instead of ``qps`` (then ``context`` tokens each)."""
    context: int | None = None
    tp: int = 1
    quant: str | None = None
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None
    """vLLM's ``--max-model-len`` (default: prompt + output, or ``context``)."""
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enforce_eager: bool = False
    tpot_s: float = DEFAULT_TPOT_S
    """The decode step target (s): the bandwidth need is the bytes of one step over it."""
    ttft_s: float | None = None
    """A prefill-time limit (s): a device whose estimated prefill is longer does not fit."""
    mig: str | None = None
    """None: share whole GPUs; ``auto``: any MIG profile that fits; or a profile name."""
    activation_peak_bytes: int | None = None
    """Skip the traced profile run with this activation peak (as ``serve_plan``)."""
    cuda_graph_bytes: int | None = None

    def __post_init__(self) -> None:
        where = f"tenant {self.name!r}"
        if self.concurrency is None:
            if self.qps is None or self.prompt_tokens is None or self.output_tokens is None:
                raise MemfitError(f"{where}: give qps, prompt_tokens and output_tokens (or "
                                  "concurrency and context)")
            if not self.qps > 0 or not math.isfinite(self.qps):
                raise MemfitError(f"{where}: qps must be a number > 0, got {self.qps!r}")
        elif self.qps is not None:
            raise MemfitError(f"{where}: give qps (with prompt/output tokens) or concurrency "
                              "(with context), not both")
        elif self.context is None:
            raise MemfitError(f"{where}: concurrency needs context (tokens per request)")
        # Note: [keys that do nothing] each traffic form refuses the other's keys
        if self.concurrency is None and self.context is not None:
            raise MemfitError(f"{where}: context goes with concurrency; with qps give "
                              "prompt_tokens and output_tokens")
        if self.concurrency is not None and (self.prompt_tokens is not None or
                                             self.output_tokens is not None
                                             or self.ttft_s is not None):
            raise MemfitError(f"{where}: prompt_tokens, output_tokens and ttft_ms go with qps; "
                              "with concurrency give context")
        if self.max_model_len is not None and self.max_model_len < self.request_tokens:
            raise MemfitError(f"{where}: max_model_len {self.max_model_len} is below the "
                              f"{self.request_tokens} tokens of one request; raise it or drop it")
        for key in ("tpot_s", "ttft_s"):
            v = getattr(self, key)
            if v is not None and (not v > 0 or not math.isfinite(v)):
                raise MemfitError(f"{where}: {key.replace('_s', '_ms')} must be > 0")

    @property
    def request_tokens(self) -> int:
        """Tokens one request holds at its end: prompt + output, or ``context``."""
        if self.concurrency is not None:
            assert self.context is not None
            return self.context
        assert self.prompt_tokens is not None and self.output_tokens is not None
        return self.prompt_tokens + self.output_tokens

    @property
    def decode_context(self) -> int:
        """The mean context a decode step reads per request: prompt + output / 2 (the full
        ``context`` when the concurrency is given)."""
        if self.concurrency is not None:
            return self.request_tokens
        assert self.prompt_tokens is not None and self.output_tokens is not None
        return self.prompt_tokens + self.output_tokens // 2


def _number(value: Any, key: str, where: str, *, integer: bool) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MemfitError(f"{where}: {key} must be a number, got {value!r}")
    if integer:
        if not float(value).is_integer() or value <= 0:
            raise MemfitError(f"{where}: {key} must be a positive integer, got {value!r}")
        return int(value)
    if not math.isfinite(value) or value <= 0:
        raise MemfitError(f"{where}: {key} must be a number > 0, got {value!r}")
    return float(value)


def tenant_from_dict(data: Mapping[str, Any], index: int = 0) -> Tenant:
    """A :class:`Tenant` from one entry of a tenants file (keys as in docs/pack.md)."""
    where = f"tenant {index}"
    if not isinstance(data, Mapping):
        raise MemfitError(f"{where}: expected a mapping of keys (name, model, qps, ...), got "
                          f"{type(data).__name__}")
    for key in data:
        if key not in _TENANT_KEYS:
            raise MemfitError(f"{where}: unknown key {key!r}{suggest(str(key), _TENANT_KEYS)}; "
                              f"valid: {', '.join(_TENANT_KEYS)}")
    name = data.get("name", data.get("model"))
    if not isinstance(name, str) or not name:
        raise MemfitError(f"{where}: give it a name (a string)")
    where = f"tenant {name!r}"
    model = data.get("model")
    if not (isinstance(model, str) and model) and not isinstance(model, Mapping):
        raise MemfitError(f"{where}: model must be a preset, config.json path or hub id")
    kw: dict[str, Any] = {"name": name, "model": model}
    for key in ("prompt_tokens", "output_tokens", "concurrency", "context", "tp",
                "max_model_len", "max_num_seqs", "max_num_batched_tokens"):
        if data.get(key) is not None:
            kw[key] = _number(data[key], key, where, integer=True)
    for key in ("activation_peak_bytes", "cuda_graph_bytes"):
        if data.get(key) is not None:
            v = data[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise MemfitError(f"{where}: {key} must be a whole number of bytes >= 0")
            kw[key] = v
    if "qps" in data:
        qps = data["qps"]
        if isinstance(qps, (int, float)) and not isinstance(qps, bool) and qps <= 0:
            raise MemfitError(f"{where}: qps must be a number > 0, got {qps!r}; a tenant with "
                              "no traffic needs no GPU (remove it)")
        kw["qps"] = _number(qps, "qps", where, integer=False)
    for key in ("tpot_ms", "ttft_ms"):
        if data.get(key) is not None:
            kw[key.replace("_ms", "_s")] = _number(data[key], key, where, integer=False) / 1e3
    for key in ("quant", "kv_cache_dtype"):
        if data.get(key) is not None:
            kw[key] = str(data[key])
    if data.get("enforce_eager") is not None:
        kw["enforce_eager"] = bool(data["enforce_eager"])
    mig = data.get("mig")
    if mig is not None and mig is not False:
        kw["mig"] = "auto" if mig is True else str(mig).strip().lower()
    return Tenant(**kw)


def load_tenants(source: str | Path | Sequence[Any] | Mapping[str, Any]) -> list[Tenant]:
    """Tenants from a YAML or JSON file (YAML through ``yaml.safe_load`` only), or the parsed
    data: a list of tenants, or ``{"defaults": {...}, "tenants": [...]}`` where ``defaults``
    fills each tenant's missing keys."""
    data: Any = source
    if isinstance(source, (str, Path)):
        path = Path(source).expanduser()
        if not path.is_file():
            raise MemfitError(f"tenants file {str(path)!r} not found; pass a YAML or JSON file "
                              "(docs/pack.md shows the format)")
        text = path.read_text(encoding="utf-8")
        if path.suffix.lower() == ".json":
            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                raise MemfitError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}); "
                                  "fix the file") from None
        else:
            try:
                import yaml  # type: ignore[import-untyped]
            except ImportError:
                raise MemfitError("reading YAML needs PyYAML: pip install pyyaml (or pass the "
                                  "tenants as a .json file)") from None
            try:
                data = yaml.safe_load(text)
            except yaml.YAMLError as exc:
                mark = getattr(exc, "problem_mark", None)
                at = f" at line {mark.line + 1}" if mark is not None else ""
                raise MemfitError(f"{path}: not valid YAML{at}; fix the file "
                                  "(docs/pack.md shows the format)") from None
    defaults: Mapping[str, Any] = {}
    if isinstance(data, Mapping):
        unknown = set(data) - {"tenants", "defaults"}
        if unknown:
            raise MemfitError(f"unknown top-level keys {sorted(unknown)}; a tenants file is "
                              "{tenants: [...], defaults: {...}} or a list of tenants")
        defaults = data.get("defaults") or {}
        if not isinstance(defaults, Mapping):
            raise MemfitError("defaults must be a mapping of tenant keys")
        data = data.get("tenants")
    if not isinstance(data, list) or not data:
        raise MemfitError("expected a non-empty list of tenants (each with name, model and "
                          "qps / prompt_tokens / output_tokens); see docs/pack.md")
    tenants = [t if isinstance(t, Tenant) else
               tenant_from_dict({**defaults, **t} if isinstance(t, Mapping) else t, i)
               for i, t in enumerate(data)]
    names = [t.name for t in tenants]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise MemfitError(f"tenant names must be unique; repeated: {', '.join(dup)}")
    return tenants


# --------------------------------------------------------------------------------------------
# The pool and its devices


@dataclass(frozen=True, kw_only=True)
class Device:
    """Where a tenant runs: a whole GPU (``profile`` None) or one MIG instance of it."""

    gpu: str
    profile: MigProfile | None
    memory_bytes: int
    bandwidth_bytes_per_s: float
    """The bandwidth a decode streams at: ``HBM_EFFICIENCY x`` the catalog's (x the MIG share)."""
    flops: float
    """Dense bf16 FLOPS (x the MIG compute share)."""

    @property
    def label(self) -> str:
        return self.gpu if self.profile is None else f"{self.gpu} MIG {self.profile.name}"


def device(gpu: Any, profile: MigProfile | None = None) -> Device:
    """The :class:`Device` of a catalog GPU (a ``GpuSpec``), whole or one MIG profile."""
    tf = gpu.tflops.get("bf16") or gpu.tflops.get("fp16")
    if not tf:
        raise MemfitError(f"{gpu.name} has no bf16/fp16 FLOPS in the catalog; pack needs them "
                          "for the prefill time (add them with --gpu-file)")
    bw = HBM_EFFICIENCY * gpu.bandwidth_gbps * 1e9
    if profile is None:
        return Device(gpu=gpu.name, profile=None, memory_bytes=gpu.usable_bytes,
                      bandwidth_bytes_per_s=bw, flops=tf * 1e12)
    return Device(gpu=gpu.name, profile=profile, memory_bytes=profile.memory_bytes,
                  bandwidth_bytes_per_s=bw * profile.bandwidth_fraction,
                  flops=tf * 1e12 * profile.compute_fraction)


def parse_pool(text: str) -> list[Any]:
    """``4xh100-sxm-80gb`` (or ``h100-sxm-80gb``, or several joined by commas) as one
    ``GpuSpec`` per GPU, in order."""
    from memfit.gpus import get_gpu

    pool: list[Any] = []
    for part in str(text).split(","):
        part = part.strip()
        count_text, sep, name = part.partition("x")
        if sep and count_text.strip().isdigit():
            count = int(count_text)
        else:
            count, name = 1, part
        if count <= 0 or not name.strip():
            raise MemfitError(f"--gpus {text!r}: write COUNTxGPU, e.g. 4xh100-sxm-80gb (a "
                              "positive count; several joined by commas)")
        gpu = get_gpu(name.strip())
        pool.extend([gpu] * count)
    if not pool:
        raise MemfitError("--gpus is empty; write e.g. 4xh100-sxm-80gb")
    return pool


# --------------------------------------------------------------------------------------------
# One tenant's need on one device


@dataclass(frozen=True, kw_only=True)
class Demand:
    """What a tenant needs on each GPU of its TP group when placed on ``device``."""

    memory_bytes: int
    bandwidth_bytes_per_s: float
    parts: Mapping[str, int] = field(default_factory=dict)
    """weights, activation_peak, non_torch, cuda_graphs, baseline, kv_cache (bytes)."""
    concurrency: int = 1
    prefill_s: float = 0.0
    request_s: float | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    too_slow: str | None = None
    """Why the device misses the tenant's latency hint (None: it meets them)."""


def _model_key(model: str | Mapping[str, Any]) -> str:
    return model if isinstance(model, str) else json.dumps(model, sort_keys=True, default=str)


@cache
def _activation(model_key: str, tp: int, mnbt: int, mns: int, num_sms: int) -> int:
    """The traced profile-run activation peak, once per (model, tp, batch limits)."""
    from memfit.serving.kv_spec import model_dtype_bytes
    from memfit.serving.plan import load_config
    from memfit.serving.profile_run import DEFAULT_NUM_SMS, profile_activation_peak

    model = json.loads(model_key) if model_key.startswith("{") else model_key
    _, config = load_config(model)
    return int(profile_activation_peak(config, max_num_batched_tokens=mnbt, max_num_seqs=mns,
                                       tp=tp, dtype_bytes=model_dtype_bytes(config),
                                       num_sms=num_sms or DEFAULT_NUM_SMS))


def tenant_demand(tenant: Tenant, gpu: Any, profile: MigProfile | None = None) -> Demand:
    """``tenant``'s memory and bandwidth need on each GPU of its TP group, on ``gpu`` (a
    ``GpuSpec``) whole or on one MIG ``profile`` (the module docstring has the model)."""
    from memfit.serving.budget import default_batch_limits
    from memfit.serving.kv_spec import model_dtype_bytes
    from memfit.serving.plan import load_config, serve_plan
    from memfit.serving.startup import startup_budget
    from memfit.serving.vllm import max_memory_usage_bytes
    from memfit.serving.weights import weights_from_config

    dev = device(gpu, profile)
    _, config = load_config(tenant.model)
    dtype_bytes = model_dtype_bytes(config)
    params = weights_from_config(config, tp=tenant.tp, dtype_bytes=dtype_bytes).total \
        / dtype_bytes
    # Little's law: C = QPS x (prefill + output x TPOT)
    if tenant.concurrency is not None:
        prefill_s, request_s, concurrency = 0.0, None, tenant.concurrency
    else:
        assert tenant.qps is not None and tenant.prompt_tokens is not None
        assert tenant.output_tokens is not None
        prefill_s = tenant.prompt_tokens * 2 * params / (PREFILL_MFU * dev.flops)
        request_s = prefill_s + tenant.output_tokens * tenant.tpot_s
        concurrency = max(1, math.ceil(tenant.qps * request_s - 1e-9))
    seqs_default, tokens_default = default_batch_limits(dev.memory_bytes, gpu.name)
    mnbt = tenant.max_num_batched_tokens or tokens_default
    mns = max(tenant.max_num_seqs or seqs_default, concurrency)
    max_model_len = tenant.max_model_len or tenant.request_tokens
    geometry = serve_plan(tenant.model, kv_cache_memory=0, gpu=gpu.name, tp=tenant.tp,
                          kv_cache_dtype=tenant.kv_cache_dtype, max_model_len=max_model_len,
                          max_num_batched_tokens=mnbt, max_num_seqs=mns, quant=tenant.quant)

    def request_bytes(tokens: int) -> int:  # R(n): the bytes vLLM holds for n tokens
        return max_memory_usage_bytes(geometry.groups, tokens,
                                      max_in_flight_tokens=geometry.max_in_flight_tokens)

    kv = max(concurrency * request_bytes(tenant.request_tokens),
             geometry.request_bytes + geometry.bytes_per_block)
    activation = tenant.activation_peak_bytes
    if activation is None:
        activation = _activation(_model_key(tenant.model), tenant.tp, mnbt, mns, 0)
    budget = startup_budget(
        tenant.model, config, gpu=dataclasses.replace(gpu, usable_bytes=dev.memory_bytes),
        gpu_memory_utilization=1.0, tp=tenant.tp, quant=tenant.quant,
        max_num_batched_tokens=mnbt, max_num_seqs=mns, enforce_eager=tenant.enforce_eager,
        activation_peak_bytes=activation, cuda_graph_bytes=tenant.cuda_graph_bytes)
    parts = {"weights": budget.weights_bytes, "activation_peak": budget.activation_peak_bytes,
             "non_torch": budget.non_torch_bytes, "cuda_graphs": budget.cuda_graph_bytes,
             "baseline": budget.baseline_bytes, "kv_cache": kv}
    step_bytes = budget.weights_bytes + concurrency * request_bytes(tenant.decode_context)
    too_slow = None
    if tenant.ttft_s is not None and prefill_s > tenant.ttft_s:
        too_slow = (f"its estimated prefill, {prefill_s * 1e3:.0f} ms, is over its ttft_ms "
                    f"{tenant.ttft_s * 1e3:g} on {dev.label}")
    return Demand(memory_bytes=sum(parts.values()),
                  bandwidth_bytes_per_s=step_bytes / tenant.tpot_s, parts=parts,
                  concurrency=concurrency, prefill_s=prefill_s, request_s=request_s,
                  max_num_seqs=mns, max_num_batched_tokens=mnbt, too_slow=too_slow)


# --------------------------------------------------------------------------------------------
# The packer, on abstract items


@dataclass(frozen=True, kw_only=True)
class Item:
    """A tenant as the packer sees it: ``tp`` GPUs of one type, each needing ``needs[(gpu,
    profile name or None)] = (memory bytes, bandwidth bytes/s)``; only the devices where it
    fits alone are keys. ``mig``: it runs on MIG instances (else on shared whole GPUs)."""

    name: str
    needs: Mapping[tuple[str, str | None], tuple[int, float]]
    tp: int = 1
    mig: bool = False


@dataclass
class _Gpu:
    kind: str
    mode: str | None = None  # None (empty), "whole", "mig"
    memory: int = 0
    bandwidth: float = 0.0
    profiles: list[MigProfile] = field(default_factory=list)
    placed: list[tuple[int, str | None]] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class Packing:
    """Which GPU (index into the pool) holds which items: ``gpus[g]`` is a list of ``(item
    index, MIG profile name or None)``; ``unplaced`` the items left out."""

    gpus: tuple[tuple[tuple[int, str | None], ...], ...]
    unplaced: tuple[int, ...]
    method: str
    """``exhaustive`` (optimal) or ``first-fit-decreasing``."""

    @property
    def used(self) -> int:
        return sum(1 for g in self.gpus if g)

    @property
    def cost(self) -> tuple[int, int]:
        return len(self.unplaced), self.used


class _Search:
    """The shared state of the heuristic and the exhaustive search over one instance."""

    def __init__(self, items: Sequence[Item], pool: Sequence[Any]) -> None:
        self.items = items
        self.kinds = [g.name for g in pool]
        self.caps = {g.name: device(g) for g in pool}
        self.mig = {g.name: {p.name: p for p in mig_profiles(g.name)} for g in pool}

    def fresh(self) -> list[_Gpu]:
        return [_Gpu(kind=k) for k in self.kinds]

    def whole_fits(self, gpu: _Gpu, i: int) -> bool:
        need = self.items[i].needs.get((gpu.kind, None))
        if need is None or gpu.mode == "mig":
            return False
        cap = self.caps[gpu.kind]
        return (gpu.memory + need[0] <= cap.memory_bytes
                and gpu.bandwidth + need[1] <= cap.bandwidth_bytes_per_s * (1 + 1e-12))

    def mig_options(self, gpu: _Gpu, i: int) -> Iterator[MigProfile]:
        """The profiles ``i`` may take on ``gpu`` now, smallest first."""
        if gpu.mode == "whole":
            return
        for name, p in self.mig[gpu.kind].items():
            if (gpu.kind, name) in self.items[i].needs and valid_combination(
                    [*gpu.profiles, p]):
                yield p

    def put(self, gpu: _Gpu, i: int, profile: MigProfile | None) -> None:
        item = self.items[i]
        if profile is None:
            m, b = item.needs[(gpu.kind, None)]
            gpu.mode, gpu.memory, gpu.bandwidth = "whole", gpu.memory + m, gpu.bandwidth + b
        else:
            gpu.mode = "mig"
            gpu.profiles.append(profile)
        gpu.placed.append((i, None if profile is None else profile.name))

    def take(self, gpu: _Gpu, i: int, profile: MigProfile | None) -> None:
        item = self.items[i]
        gpu.placed.pop()
        if profile is None:
            m, b = item.needs[(gpu.kind, None)]
            gpu.memory, gpu.bandwidth = gpu.memory - m, gpu.bandwidth - b
        else:
            gpu.profiles.pop()
        if not gpu.placed:
            gpu.mode, gpu.memory, gpu.bandwidth = None, 0, 0.0

    def size(self, i: int) -> float:
        """The item's weighted size: its larger fraction (memory or bandwidth) of the device
        it needs least of, times its TP GPUs."""
        item, best = self.items[i], math.inf
        for (kind, prof), (m, b) in item.needs.items():
            cap = self.caps[kind]
            if prof is None:
                frac = max(m / cap.memory_bytes, b / cap.bandwidth_bytes_per_s)
            else:
                frac = self.mig[kind][prof].memory_slices / 8
            best = min(best, frac)
        return item.tp * best if best < math.inf else 0.0

    def result(self, gpus: list[_Gpu], unplaced: list[int], method: str) -> Packing:
        return Packing(gpus=tuple(tuple(g.placed) for g in gpus), unplaced=tuple(unplaced),
                       method=method)

    # -- first-fit decreasing --------------------------------------------------------------

    def first_fit(self, order: Sequence[int]) -> Packing:
        gpus, unplaced = self.fresh(), []
        for i in order:
            if not self._first_fit_one(gpus, i):
                unplaced.append(i)
        return self.result(gpus, sorted(unplaced), "first-fit-decreasing")

    def _first_fit_one(self, gpus: list[_Gpu], i: int) -> bool:
        item = self.items[i]
        # open GPUs first, then empty ones, each in pool order
        ranked = sorted(range(len(gpus)), key=lambda g: (gpus[g].mode is None, g))
        if item.mig:
            for g in ranked:
                for p in self.mig_options(gpus[g], i):
                    self.put(gpus[g], i, p)
                    return True
            return False
        for kind in dict.fromkeys(self.kinds):
            chosen = [g for g in ranked if gpus[g].kind == kind and
                      self.whole_fits(gpus[g], i)][:item.tp]
            if len(chosen) == item.tp:
                for g in chosen:
                    self.put(gpus[g], i, None)
                return True
        return False

    # -- exhaustive branch and bound -------------------------------------------------------

    def exhaustive(self, order: Sequence[int], bound: Packing) -> Packing:
        gpus = self.fresh()
        best = [bound]
        unplaced: list[int] = []

        def used() -> int:
            return sum(1 for g in gpus if g.mode is not None)

        def dfs(k: int) -> None:
            if (len(unplaced), used()) >= best[0].cost:
                return
            if k == len(order):
                best[0] = self.result(gpus, sorted(unplaced), "exhaustive")
                return
            i = order[k]
            for placement in self._options(gpus, i):
                for g, p in placement:
                    self.put(gpus[g], i, p)
                dfs(k + 1)
                for g, p in reversed(placement):
                    self.take(gpus[g], i, p)
            unplaced.append(i)
            dfs(k + 1)
            unplaced.pop()

        dfs(0)
        if best[0] is bound:  # the heuristic was optimal
            return dataclasses.replace(bound, method="exhaustive")
        return best[0]

    def _options(self, gpus: list[_Gpu], i: int) -> Iterator[list[tuple[int, MigProfile | None]]]:
        """Every way to place item ``i`` now, up to the symmetry of empty GPUs of a kind (only
        the first empty ones of each kind are tried)."""
        item = self.items[i]
        for kind in dict.fromkeys(self.kinds):
            open_ = [g for g, s in enumerate(gpus) if s.kind == kind and s.mode is not None]
            empty = [g for g, s in enumerate(gpus) if s.kind == kind and s.mode is None]
            if item.mig:
                for g in open_ + empty[:1]:
                    for p in self.mig_options(gpus[g], i):
                        yield [(g, p)]
                continue
            fit = [g for g in open_ if self.whole_fits(gpus[g], i)]
            fresh = empty if (kind, None) in item.needs else []
            for n_new in range(min(item.tp, len(fresh)) + 1):
                for chosen in combinations(fit, item.tp - n_new):
                    yield [(g, None) for g in (*chosen, *fresh[:n_new])]


def pack_items(items: Sequence[Item], pool: Sequence[Any], *,
               exact: bool | None = None) -> Packing:
    """Place ``items`` on ``pool`` (one ``GpuSpec`` per GPU), minimising (items unplaced, GPUs
    used): first-fit decreasing, then the exhaustive search when ``exact`` (default: the
    instance has at most :data:`EXACT_MAX_TENANTS` items and :data:`EXACT_MAX_GPUS` GPUs);
    ``exact=False`` gives the heuristic's answer alone."""
    search = _Search(items, pool)
    order = sorted(range(len(items)), key=lambda i: (-search.size(i), i))
    heuristic = search.first_fit(order)
    if exact is None:
        exact = len(items) <= EXACT_MAX_TENANTS and len(pool) <= EXACT_MAX_GPUS
    if not exact or heuristic.cost == (0, _lower_bound(search)):
        return heuristic if not exact else dataclasses.replace(heuristic, method="exhaustive")
    return search.exhaustive(order, heuristic)


def _lower_bound(search: _Search) -> int:
    """At least one GPU per TP rank of the largest item (0 without items)."""
    return max((it.tp for it in search.items), default=0)


# --------------------------------------------------------------------------------------------
# The answer


@dataclass(frozen=True, kw_only=True)
class PackResult:
    """A packing of tenants on a pool, with each tenant's need, device and headroom."""

    tenants: tuple[Tenant, ...]
    pool: tuple[str, ...]
    packing: Packing
    demands: tuple[Mapping[tuple[str, str | None], Demand], ...]
    """Per tenant: its need on each device it fits alone."""
    devices: Mapping[tuple[str, str | None], Device]
    nowhere: Mapping[int, str]
    """Tenants that fit no device of the pool even alone: why, and by how much."""

    @property
    def gpus_used(self) -> int:
        return self.packing.used

    def _where(self, t: int) -> list[tuple[int, str | None]]:
        return [(g, p) for g, slots in enumerate(self.packing.gpus) for i, p in slots if i == t]

    def _gpu_load(self, g: int) -> tuple[int, float]:
        kind = self.pool[g]
        mem = bw = 0.0
        for i, p in self.packing.gpus[g]:
            d = self.demands[i][(kind, p)]
            mem, bw = mem + d.memory_bytes, bw + d.bandwidth_bytes_per_s
        return int(mem), bw

    def tenant_rows(self) -> list[dict[str, Any]]:
        rows = []
        for t, tenant in enumerate(self.tenants):
            where = self._where(t)
            row: dict[str, Any] = {"name": tenant.name, "model": _model_key(tenant.model),
                                   "tp": tenant.tp, "gpus": [g for g, _ in where],
                                   "mig_profile": where[0][1] if where else None,
                                   "placed": bool(where)}
            if not where:
                row["reason"] = self.nowhere.get(t) or self._no_room(t)
                rows.append(row)
                continue
            g, prof = where[0]
            kind = self.pool[g]
            d, dev = self.demands[t][(kind, prof)], self.devices[(kind, prof)]
            if prof is None:  # shared: the headroom the GPU has left, on the tightest rank
                loads = [self._gpu_load(gg) for gg, _ in where]
                mem_free = min(dev.memory_bytes - m for m, _ in loads)
                bw_free = min(dev.bandwidth_bytes_per_s - b for _, b in loads)
            else:
                mem_free = dev.memory_bytes - d.memory_bytes
                bw_free = dev.bandwidth_bytes_per_s - d.bandwidth_bytes_per_s
            row.update({
                "device": dev.label, "concurrency": d.concurrency,
                "prefill_seconds": round(d.prefill_s, 6),
                "request_seconds": None if d.request_s is None else round(d.request_s, 6),
                "tpot_seconds": tenant.tpot_s,
                "max_num_seqs": d.max_num_seqs,
                "max_num_batched_tokens": d.max_num_batched_tokens,
                "memory_bytes": d.memory_bytes, "memory_parts": dict(d.parts),
                "memory_capacity_bytes": dev.memory_bytes, "memory_headroom_bytes": mem_free,
                "bandwidth_bytes_per_s": round(d.bandwidth_bytes_per_s),
                "bandwidth_capacity_bytes_per_s": round(dev.bandwidth_bytes_per_s),
                "bandwidth_headroom_bytes_per_s": round(bw_free),
                "gpu_memory_utilization": math.ceil(
                    (d.memory_bytes - d.parts.get("baseline", 0)) / dev.memory_bytes * 1000)
                / 1000,
            })
            rows.append(row)
        return rows

    def _no_room(self, t: int) -> str:
        (kind, prof), d = min(self.demands[t].items(), key=lambda kv: kv[1].memory_bytes)
        return (f"no room left in the pool: it needs {_gib(d.memory_bytes)} and "
                f"{_tbs(d.bandwidth_bytes_per_s)} per GPU on "
                f"{self.devices[(kind, prof)].label}; add GPUs")

    def gpu_rows(self) -> list[dict[str, Any]]:
        rows = []
        for g, slots in enumerate(self.packing.gpus):
            kind = self.pool[g]
            dev = self.devices[(kind, None)]
            mem, bw = self._gpu_load(g)
            mig = any(p is not None for _, p in slots)
            rows.append({"gpu": g, "type": kind, "mode": None if not slots else
                         ("mig" if mig else "whole"),
                         "tenants": [{"name": self.tenants[i].name, "mig_profile": p}
                                     for i, p in slots],
                         "memory_capacity_bytes": dev.memory_bytes,
                         "memory_used_bytes": mem,
                         "bandwidth_capacity_bytes_per_s": round(dev.bandwidth_bytes_per_s),
                         "bandwidth_used_bytes_per_s": round(bw)})
        return rows

    def to_json(self) -> dict[str, Any]:
        """The stable ``--json`` keys (bytes as integers, bandwidth in bytes/s)."""
        return {
            "gpus_available": len(self.pool), "gpus_used": self.gpus_used,
            "method": self.packing.method, "optimal": self.packing.method == "exhaustive",
            "gpus": self.gpu_rows(), "tenants": self.tenant_rows(),
            "unplaced": [self.tenants[i].name for i in self.packing.unplaced],
            "assumptions": {"hbm_efficiency": HBM_EFFICIENCY, "prefill_mfu": PREFILL_MFU,
                            "default_tpot_seconds": DEFAULT_TPOT_S,
                            "exact_max_tenants": EXACT_MAX_TENANTS,
                            "exact_max_gpus": EXACT_MAX_GPUS,
                            "estimate": "request time from a roofline (prefill on FLOPS, "
                                        "decode on HBM bandwidth); Little's law concurrency"},
        }


def _gib(b: float) -> str:
    return f"{b / 2**30:.1f} GiB"


def _tbs(b: float) -> str:
    return f"{b / 1e12:.2f} TB/s"


def _shortfall(tenant: Tenant, tries: Sequence[tuple[Device, Demand]]) -> str:
    """Why ``tenant`` fits no device alone, and by how much, on the device it comes closest."""
    def gap(x: tuple[Device, Demand]) -> float:
        dev, d = x
        return max(d.memory_bytes / dev.memory_bytes,
                   d.bandwidth_bytes_per_s / dev.bandwidth_bytes_per_s)

    dev, d = min(tries, key=gap)
    if d.too_slow and d.memory_bytes <= dev.memory_bytes and \
            d.bandwidth_bytes_per_s <= dev.bandwidth_bytes_per_s:
        return d.too_slow
    bits = []
    if d.memory_bytes > dev.memory_bytes:
        short = _gib(d.memory_bytes - dev.memory_bytes)
        bits.append(f"{_gib(d.memory_bytes)} of memory ({dev.label} has "
                    f"{_gib(dev.memory_bytes)}: short by {short})")
    if d.bandwidth_bytes_per_s > dev.bandwidth_bytes_per_s:
        bits.append(f"{_tbs(d.bandwidth_bytes_per_s)} of HBM bandwidth for its "
                    f"{tenant.tpot_s * 1e3:g} ms TPOT ({dev.label} streams "
                    f"{_tbs(dev.bandwidth_bytes_per_s)}: short by "
                    f"{_tbs(d.bandwidth_bytes_per_s - dev.bandwidth_bytes_per_s)})")
    if d.too_slow:
        bits.append(d.too_slow)
    return f"tenant {tenant.name!r} fits no device of the pool: it needs " + "; ".join(bits) + \
        " (raise tp, quantize, lower its traffic, or relax tpot_ms)"


def pack(tenants: str | Path | Sequence[Any] | Mapping[str, Any], *, gpus: str | Sequence[Any],
         mig: str = "off", exact: bool | None = None) -> PackResult:
    """Place ``tenants`` (a tenants file, or its parsed data, or :class:`Tenant` objects) on
    the pool ``gpus`` (``"4xh100-sxm-80gb"``). ``mig``: ``off`` (tenants without a ``mig:``
    key share whole GPUs) or ``auto`` (they take the smallest MIG profile that fits).

    >>> r = pack([{"name": "a", "model": "llama-3-8b", "qps": 1, "prompt_tokens": 512,
    ...            "output_tokens": 128, "activation_peak_bytes": 2**30,
    ...            "cuda_graph_bytes": 0}], gpus="2xh100-sxm-80gb")
    >>> r.gpus_used, r.packing.method
    (1, 'exhaustive')
    """
    if mig not in ("off", "auto"):
        raise MemfitError(f"--mig must be off or auto, got {mig!r}")
    people = load_tenants(tenants)
    if mig == "auto":
        people = [t if t.mig is not None else dataclasses.replace(t, mig="auto")
                  for t in people]
    pool = parse_pool(gpus) if isinstance(gpus, str) else list(gpus)
    kinds = list(dict.fromkeys(g.name for g in pool))
    specs = {g.name: g for g in pool}
    devices: dict[tuple[str, str | None], Device] = {}
    for k in kinds:
        devices[(k, None)] = device(specs[k])
        for p in mig_profiles(k):
            devices[(k, p.name)] = device(specs[k], p)
    demands: list[dict[tuple[str, str | None], Demand]] = []
    items, nowhere = [], {}
    for t, tenant in enumerate(people):
        targets = _targets(tenant, kinds)
        need: dict[tuple[str, str | None], Demand] = {}
        tries = []
        for key in targets:
            d = tenant_demand(tenant, specs[key[0]],
                              None if key[1] is None else mig_profile(key[0], key[1]))
            need[key] = d
            tries.append((devices[key], d))
        demands.append(need)
        fits = {key: (d.memory_bytes, d.bandwidth_bytes_per_s) for key, d in need.items()
                if d.memory_bytes <= devices[key].memory_bytes
                and d.bandwidth_bytes_per_s <= devices[key].bandwidth_bytes_per_s
                and d.too_slow is None}
        if not fits or (tenant.tp > sum(1 for g in pool if (g.name, None) in fits)
                        and tenant.mig is None):
            nowhere[t] = _shortfall(tenant, tries) if not fits else (
                f"tenant {tenant.name!r} needs {tenant.tp} GPUs (tp) and the pool has fewer "
                "of a type it fits")
        items.append(Item(name=tenant.name, needs=fits, tp=tenant.tp,
                          mig=tenant.mig is not None))
    if len(nowhere) == len(people):
        raise MemfitError("; ".join(nowhere.values()))
    packing = pack_items(items, pool, exact=exact)
    return PackResult(tenants=tuple(people), pool=tuple(g.name for g in pool),
                      packing=packing, demands=tuple(demands), devices=devices,
                      nowhere=nowhere)


def _targets(tenant: Tenant, kinds: Sequence[str]) -> list[tuple[str, str | None]]:
    """The devices a tenant may run on: whole GPUs, or the MIG profiles it allows."""
    if tenant.mig is None:
        return [(k, None) for k in kinds]
    if tenant.tp > 1:
        raise MemfitError(f"tenant {tenant.name!r}: tp {tenant.tp} on MIG instances is not "
                          "supported (MIG instances have no peer-to-peer access); drop mig: "
                          "or set tp: 1")
    with_mig = [k for k in kinds if mig_profiles(k)]
    if not with_mig:
        what = "a MIG profile" if tenant.mig == "auto" else f"MIG profile {tenant.mig!r}"
        unlisted = [k for k in kinds if k in MIG_UNLISTED]
        if unlisted:
            raise MemfitError(f"tenant {tenant.name!r} asks for {what}, but memfit lists no MIG "
                              f"profiles for {', '.join(unlisted)} yet (only for "
                              f"{', '.join(MIG_GPUS)}); use one of those, or drop mig:")
        raise MemfitError(f"tenant {tenant.name!r} asks for {what} but no GPU of the pool "
                          f"({', '.join(kinds)}) has MIG; use an A100 or H100 "
                          f"({', '.join(MIG_GPUS)}), or drop mig:")
    if tenant.mig == "auto":
        return [(k, p.name) for k in with_mig for p in mig_profiles(k)]
    out: list[tuple[str, str | None]] = [(k, tenant.mig) for k in with_mig
           if any(p.name == tenant.mig for p in mig_profiles(k))]
    if not out:
        mig_profile(with_mig[0], tenant.mig)  # raises, naming the valid profiles
    return out
