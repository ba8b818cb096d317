"""The time of one engine step from a roofline: the slower of the step's FLOPs at the GPU's
matmul rate and its bytes (weights + KV cache) at the GPU's memory bandwidth.

For a step that runs ``n_i`` new tokens of request ``i`` on top of ``c_i`` cached ones (on one
GPU of the TP group):

- FLOPs ``= 2 x params x sum(n_i)`` (every token through every matmul of the decoder layers)
  ``+ 2 x lm_head_params x rows`` (vLLM computes logits for one position per scheduled request:
  ``vllm/v1/worker/gpu_model_runner.py: GPUModelRunner._prepare_inputs``, ``logits_indices``)
  ``+ attention_flops_per_pair x sum(n_i c_i + n_i (n_i + 1) / 2)`` (``QK^T`` and ``PV``, 2
  FLOPs a multiply-add each: ``4 x layers x q_heads x head_dim`` per query-key pair, causal);
- bytes ``= weights_bytes + kv_bytes_per_token x sum(c_i + n_i)`` (the weights read once per
  step; each request's cached KV read and its new KV written);
- ``step = max(FLOPs / (peak x compute_efficiency), bytes / (bandwidth x bandwidth_efficiency))
  + step_overhead_s``.

A decode step (``n_i = 1``) is then bound by the bandwidth until the batch is large; a prefill
by the FLOPs. Default efficiencies (shared/facts.md, measured, not fitted to any serving
benchmark): :data:`COMPUTE_EFFICIENCY` 0.80, an H100's bf16 matmul ceiling (~794 of 989
TFLOPS, 8192^3 matmuls); :data:`BANDWIDTH_EFFICIENCY` 0.90, an H200's device-to-device copy
(~4.3 of 4.8 TB/s). Both are applied to every GPU: an assumption.

Known limitations: attention kernels run at the matmul rate; no TP all-reduce time, no
CPU/scheduling overhead unless ``step_overhead_s`` is set, no CUDA-graph padding of the batch,
no sampling time; an MoE model's FLOPs count ``num_experts_per_tok`` experts a token while its
bytes read every expert each step (an upper bound on the bytes of a small batch).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from memfit.errors import MemfitError
from memfit.serving.kv_spec import config_int
from memfit.serving.weights import pad_vocab_size

__all__ = ["BANDWIDTH_EFFICIENCY", "COMPUTE_EFFICIENCY", "Roofline", "model_flop_params"]

COMPUTE_EFFICIENCY = 0.80
"""Matmul FLOP/s reached over the datasheet's dense peak: 794 / 989 on an H100 (bf16 8192^3,
shared/facts.md)."""
BANDWIDTH_EFFICIENCY = 0.90
"""Bytes/s reached over the datasheet's HBM bandwidth: ~4.3 / 4.8 TB/s on an H200
(device-to-device copy, shared/facts.md)."""


@dataclass(frozen=True, kw_only=True)
class Roofline:
    """The numbers one engine step's time is computed from (one GPU of the TP group)."""

    peak_flops: float
    """Dense peak FLOP/s in the dtype the matmuls run in (catalog TFLOPS x 1e12)."""
    bandwidth: float
    """HBM bytes/s (catalog GB/s x 1e9)."""
    params: int
    """Parameters every token multiplies: the decoder layers' linear weights on this rank
    (MoE: the experts a token is routed to), not the embedding nor the LM head."""
    weights_bytes: int
    """The weights read each step (this rank's, as loaded)."""
    kv_bytes_per_token: int
    """KV cache bytes one token adds over all layers on this rank."""
    lm_head_params: int = 0
    """The LM head's parameters on this rank, multiplied once per scheduled request."""
    attention_flops_per_pair: int = 0
    """``4 x layers x q_heads (this rank) x head_dim``: FLOPs per query-key pair."""
    compute_efficiency: float = COMPUTE_EFFICIENCY
    """Share of ``peak_flops`` reached (0, 1]; lower it for slower steps."""
    bandwidth_efficiency: float = BANDWIDTH_EFFICIENCY
    """Share of ``bandwidth`` reached (0, 1]."""
    step_overhead_s: float = 0.0
    """Seconds added to every step (scheduling, launches, sampling): 0 by default."""

    def __post_init__(self) -> None:
        for name in ("compute_efficiency", "bandwidth_efficiency"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise MemfitError(f"{name.replace('_', '-')} must be in (0, 1], got {value}")
        if self.peak_flops <= 0 or self.bandwidth <= 0:
            raise MemfitError("the GPU's FLOP/s and bandwidth must be > 0")
        if self.step_overhead_s < 0:
            raise MemfitError(f"step-overhead must be >= 0 seconds, got {self.step_overhead_s}")

    def flops(self, tokens: int, rows: int, attention_pairs: int) -> float:
        return (2 * self.params * tokens + 2 * self.lm_head_params * rows
                + self.attention_flops_per_pair * attention_pairs)

    def bytes(self, context_tokens: int) -> int:
        return self.weights_bytes + self.kv_bytes_per_token * context_tokens

    def step_seconds(self, *, tokens: int, rows: int, context_tokens: int,
                     attention_pairs: int) -> float:
        """One step: ``tokens`` new tokens over ``rows`` requests, ``context_tokens`` (``sum(c_i
        + n_i)``) of KV touched and ``attention_pairs`` (``sum(n_i c_i + n_i (n_i + 1) / 2)``)
        query-key pairs."""
        compute = self.flops(tokens, rows, attention_pairs) / (
            self.peak_flops * self.compute_efficiency)
        memory = self.bytes(context_tokens) / (self.bandwidth * self.bandwidth_efficiency)
        return max(compute, memory) + self.step_overhead_s

    def to_json(self) -> dict[str, Any]:
        return {"peak_flops": self.peak_flops, "bandwidth_bytes_per_s": self.bandwidth,
                "params": self.params, "lm_head_params": self.lm_head_params,
                "attention_flops_per_pair": self.attention_flops_per_pair,
                "weights_bytes": self.weights_bytes,
                "kv_bytes_per_token": self.kv_bytes_per_token,
                "compute_efficiency": self.compute_efficiency,
                "bandwidth_efficiency": self.bandwidth_efficiency,
                "step_overhead_s": self.step_overhead_s}


def _int(data: Mapping[str, Any], *keys: str, default: int | None = None) -> int:
    return config_int(data, *keys, default=default,
                      fix="the roofline needs the model's shapes (pass a full config.json)")


def model_flop_params(config: Mapping[str, Any], *, tp: int = 1) -> tuple[int, int, int]:
    """``(params, lm_head_params, attention_flops_per_pair)`` on one rank of ``tp`` from a
    decoder's config (the shapes :func:`memfit.serving.weights.weights_from_config` reads:
    q/k/v/o, gated MLP, MoE with ``num_experts_per_tok``; a KV head per rank when ``tp`` is
    above the KV heads).

    Llama-3-8B: 6,979,321,856 layer parameters and a 525,336,576-parameter LM head.

    >>> cfg = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
    ...        "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256}
    >>> model_flop_params(cfg)
    (6979321856, 525336576, 524288)
    """
    from memfit.serving.kv_spec import text_config

    data = text_config(config)
    if data.get("kv_lora_rank"):
        raise MemfitError("MLA models (kv_lora_rank) have no roofline from the config yet; pass "
                          "roofline=Roofline(...) with their FLOP parameters")
    hidden = _int(data, "hidden_size", "d_model")
    layers = _int(data, "num_hidden_layers", "n_layer")
    heads = _int(data, "num_attention_heads", "n_head")
    kv_heads = _int(data, "num_key_value_heads", default=heads)
    head_dim = _int(data, "head_dim", default=hidden // heads)
    experts = _int(data, "num_local_experts", "num_experts", default=0)
    inter = _int(data, "moe_intermediate_size", "intermediate_size") if experts else \
        _int(data, "intermediate_size", "ffn_dim")
    active = _int(data, "num_experts_per_tok", default=1) if experts else 1
    q_heads = heads // tp
    kv_rank = 1 if tp >= kv_heads else kv_heads // tp
    attn = hidden * (q_heads + 2 * kv_rank) * head_dim + q_heads * head_dim * hidden
    mlp = 3 * hidden * (inter // tp) * active + (hidden * experts if experts else 0)
    lm_head = pad_vocab_size(_int(data, "vocab_size")) // tp * hidden
    return layers * (attn + mlp), lm_head, 4 * layers * q_heads * head_dim
