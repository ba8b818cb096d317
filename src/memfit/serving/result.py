"""``ServePlan``: what vLLM does with a KV budget on each GPU of the TP group, and its JSON
(stable keys, bytes as integers). Built by :func:`memfit.serving.serve_plan`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from memfit.serving.budget import Budget
from memfit.serving.kv_spec import LayerKV
from memfit.serving.speculative import SpeculativeDecoding
from memfit.serving.vllm import VLLM_SOURCE, KVCacheGroup, MambaCacheMode

__all__ = ["ServePlan"]

_BUDGET_KEYS = ("weights_bytes", "activation_peak_bytes", "non_torch_bytes",
                "cuda_graph_bytes")


@dataclass(frozen=True, kw_only=True)
class ServePlan:
    """What vLLM does with a KV budget of ``kv_cache_bytes`` on each GPU of the TP group.

    ``budget`` is the startup budget that chose ``kv_cache_bytes`` on a ``--gpu`` (None when
    the budget was given, vLLM's ``--kv-cache-memory``: its JSON keys are then null).
    """

    engine: str
    engine_version: str
    model: str
    tp: int
    kv_cache_dtype: str
    block_size: int
    max_model_len: int
    max_num_batched_tokens: int
    max_in_flight_tokens: int
    kv_cache_bytes: int
    layers: tuple[LayerKV, ...]
    groups: tuple[KVCacheGroup, ...]
    bytes_per_block: int
    """One block over every layer sharing it (the pool's unit)."""
    num_gpu_blocks: int
    kv_cache_tokens: int
    max_concurrency: float
    request_bytes: int
    """The bytes one request of ``max_model_len`` tokens needs (vLLM's startup check)."""
    fits: bool
    """Whether vLLM starts: one request of ``max_model_len`` fits beside the null block
    (``kv_cache_planning.py: _check_enough_kv_cache_memory``); else it raises at startup."""
    max_model_len_that_fits: int
    model_context: int | None
    max_num_seqs: int | None = None
    budget: Budget | None = None
    """The startup budget that chose ``kv_cache_bytes`` (None with ``--kv-cache-memory``)."""
    concurrency: int | None = None
    """Requests of ``max_model_len`` tokens wanted at once
    (for :attr:`utilization_for_concurrency`)."""
    mamba_cache_mode: MambaCacheMode | None = None
    """A hybrid model's ``mamba_cache_mode``: ``align`` with prefix caching, ``none`` without
    (None: no Mamba layers)."""
    speculative: SpeculativeDecoding | None = None
    """Speculative decoding's settings (None: off); its draft layers are in ``layers``."""
    source: str = VLLM_SOURCE

    @property
    def kv_bytes_for_concurrency(self) -> int | None:
        """The KV budget ``concurrency`` requests of ``max_model_len`` need: vLLM's
        concurrency is ``num_blocks / blocks per request``, and startup needs one request
        beside the null block."""
        if self.concurrency is None:
            return None
        return max(self.concurrency * self.request_bytes,
                   self.request_bytes + self.bytes_per_block)

    @property
    def utilization_for_concurrency(self) -> float | None:
        """The ``--gpu-memory-utilization`` that gives :attr:`kv_bytes_for_concurrency` (above
        1: no setting does on this GPU)."""
        need = self.kv_bytes_for_concurrency
        if need is None or self.budget is None:
            return None
        return self.budget.utilization_for(need)

    @property
    def startup_oom(self) -> str | None:
        """Why vLLM would fail before serving, or None: the baseline (CUDA context, NCCL,
        cuBLAS) leaves less free than requested (``request_memory``), or weights, activations,
        memory outside torch and CUDA graphs exceed the budget ("No available memory for the
        cache blocks")."""
        b = self.budget
        if b is None:
            return None
        if not b.baseline_fits and b.free_bytes is not None:
            return (f"unified memory: vLLM requests --gpu-memory-utilization "
                    f"{b.gpu_memory_utilization} x the whole {b.total_bytes:,} B "
                    f"({b.requested_bytes:,} B), more than the {b.free_bytes:,} B the OS and the "
                    f"CPU side leave less the CUDA context ({b.baseline_bytes:,} B): vLLM refuses "
                    "to start ('Free memory on device ... is less than desired GPU memory "
                    "utilization'); lower --gpu-memory-utilization")
        if not b.baseline_fits:
            return (f"the CUDA context, NCCL and cuBLAS ({b.baseline_bytes:,} B) leave less than "
                    f"--gpu-memory-utilization {b.gpu_memory_utilization} x total free: vLLM "
                    "refuses to start (vllm/v1/worker/utils.py: request_memory); lower it")
        if b.kv_cache_bytes <= 0:
            return (f"weights, activation peak, memory outside torch and CUDA graphs "
                    f"({b.requested_bytes - b.kv_cache_bytes:,} B) exceed the "
                    f"{b.requested_bytes:,} B budget: vLLM raises 'No available memory for the "
                    "cache blocks'; raise --gpu-memory-utilization, quantize, or add --tp")
        return None

    @property
    def log_line(self) -> str:
        """The line vLLM logs at startup for this budget, formatted as it formats it
        (``vllm/v1/core/kv_cache_utils.py: update_kv_cache_capacity``)."""
        return (f"GPU KV cache size: {self.kv_cache_tokens:,} tokens, Maximum concurrency for "
                f"{self.max_model_len:,} tokens per request: {self.max_concurrency:.2f}x")

    def to_json(self) -> dict[str, Any]:
        """The stable ``--json`` keys (bytes as integers); the profile-run keys are null."""
        out: dict[str, Any] = {
            "engine": self.engine, "engine_version": self.engine_version, "model": self.model,
            "tp": self.tp, "kv_cache_dtype": self.kv_cache_dtype, "block_size": self.block_size,
            "max_model_len": self.max_model_len,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_in_flight_tokens": self.max_in_flight_tokens,
            **self._budget_json(),
            "kv_cache_bytes": self.kv_cache_bytes, "kv_cache_tokens": self.kv_cache_tokens,
            "num_gpu_blocks": self.num_gpu_blocks,
            "max_concurrency": round(self.max_concurrency, 2),
            "max_model_len_that_fits": self.max_model_len_that_fits,
            "bytes_per_block": self.bytes_per_block, "request_bytes": self.request_bytes,
            "fits": self.fits, "log_line": self.log_line,
            "kv_cache_groups": [_group_json(g) for g in self.groups],
            "layers": [_layer_json(layer) for layer in self.layers],
            "source": self.source,
        }
        if self.mamba_cache_mode is not None:
            out["mamba_cache_mode"] = self.mamba_cache_mode
        if self.speculative is not None:
            out["speculative"] = {**self.speculative.to_json(), "draft_layers": sum(
                layer.draft for layer in self.layers)}
            if self.budget is not None:
                out["speculative"]["note"] = ("the draft's weights, activations and CUDA "
                                              "graphs are not in the startup budget")
        if self.budget is None:
            out["note"] = ("the KV budget is --kv-cache-memory (no profile run): weights, "
                           "activation peak, memory outside torch and CUDA graphs are null")
        return out

    def _budget_json(self) -> dict[str, Any]:
        b = self.budget
        if b is None:
            return {k: None for k in _BUDGET_KEYS}
        return {
            "gpu": b.gpu, "gpu_total_bytes": b.total_bytes, "gpu_free_bytes": b.free_bytes,
            "gpu_memory_utilization": b.gpu_memory_utilization,
            "requested_bytes": b.requested_bytes, "max_num_seqs": self.max_num_seqs,
            "weights_bytes": b.weights_bytes, "weights_parts": dict(b.weights_parts),
            "activation_peak_bytes": b.activation_peak_bytes,
            "activation_source": b.activation_source,
            "non_torch_bytes": b.non_torch_bytes, "cuda_graph_bytes": b.cuda_graph_bytes,
            "cuda_graphs": dict(b.cuda_graph_counts),
            "cuda_graphs_in_budget": b.cuda_graphs_in_budget,
            "baseline_bytes": b.baseline_bytes, "baseline_parts": dict(b.baseline_parts),
            "available_kv_log_line": b.log_line, "budget_log_lines": b.log_lines,
            "concurrency": self.concurrency,
            "kv_bytes_for_concurrency": self.kv_bytes_for_concurrency,
            "gpu_memory_utilization_for_concurrency": self.utilization_for_concurrency,
            "startup_oom": self.startup_oom,
            "multimodal": None if b.multimodal is None else b.multimodal.to_json(),
            "estimates": ["non_torch_bytes", "cuda_graph_bytes"] + (
                [] if b.activation_source == "profile_run" else ["activation_peak_bytes"]) + (
                [] if b.multimodal is None else ["multimodal.encoder_peak_bytes"]),
        }


def _group_json(g: KVCacheGroup) -> dict[str, Any]:
    s = g.spec
    return {"kind": "uniform_type" if g.uniform_type else s.kind, "layers": list(g.layers),
            "block_size": g.block_size, "page_size_bytes": g.page_size_bytes,
            "num_kv_heads": s.num_kv_heads, "head_size": s.head_size,
            "dtype_bytes": s.dtype_bytes, "sliding_window": s.sliding_window}


def _layer_json(layer: LayerKV) -> dict[str, Any]:
    out = {k: v for k, v in dataclasses.asdict(layer).items()
           if v not in (None, (), 0, False) or k in ("index", "kind")}
    out["bytes_per_token"] = layer.bytes_per_token
    if layer.kind in ("mamba", "linear"):
        out["state_bytes"] = layer.state_bytes
    return out
