"""Each tenant's need in ``memfit pack``: memory and HBM bandwidth on each GPU of its TP group,
on each device of the pool it may run on (a whole GPU or a MIG instance).

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
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from memfit.budget import device_budget
from memfit.errors import MemfitError
from memfit.serving.mig import MIG_GPUS, MIG_UNLISTED, MigProfile, mig_profile, mig_profiles
from memfit.serving.tenants import DEFAULT_TPOT_S, Tenant

__all__ = ["DEFAULT_TPOT_S", "HBM_EFFICIENCY", "PREFILL_MFU", "Demand", "Device", "device",
           "model_key", "parse_pool", "tenant_demand", "tenant_targets"]

HBM_EFFICIENCY = 0.8
"""The share of the catalog's HBM bandwidth a decode step streams at (memory-bound kernels
reach 70-90% of peak; an estimate)."""
PREFILL_MFU = 0.5
"""The share of the catalog's dense bf16 FLOPS a prefill reaches (an estimate)."""


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
        return Device(gpu=gpu.name, profile=None, memory_bytes=device_budget(gpu).budget_bytes,
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


def model_key(model: str | Mapping[str, Any]) -> str:
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
        activation = _activation(model_key(tenant.model), tenant.tp, mnbt, mns, 0)
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


def tenant_targets(tenant: Tenant, kinds: Sequence[str]) -> list[tuple[str, str | None]]:
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
