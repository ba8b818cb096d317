"""The building blocks of memfit's builtin models, in plain PyTorch (nanoGPT / torchtitan style).

RMSNorm, RoPE, attention with grouped K/V heads (SDPA or eager), the dense MLP (GeLU, SwiGLU,
GeGLU), a top-k MoE layer with static shapes, and the pre-norm (decoder, ViT) and post-norm
(BERT) blocks made of them, with Hugging Face Llama's parameter names. ``build.py`` assembles
them into whole models; the per-family numerics here (norm epsilon, RoPE base) are also what
the Hugging Face configs of ``hf_build.py`` are given.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from memfit.errors import MemfitError
from memfit.models.spec import TransformerSpec

# Normalisation epsilon per family (the published configs; numerics only).
_NORM_EPS = {"gpt2": 1e-5, "bert": 1e-12, "vit": 1e-12, "qwen2": 1e-6, "gemma2": 1e-6,
             "qwen3": 1e-6, "qwen3_moe": 1e-6, "gemma3_text": 1e-6, "olmo2": 1e-6}
_DEFAULT_NORM_EPS = 1e-5
# RoPE base per family: Llama-3, Mistral v0.2+, Mixtral, Qwen2.5, Qwen3, Gemma-3 (global layers),
# OLMo-2 published values (numerics only).
_ROPE_THETA = {"llama": 500_000.0, "mistral": 1e6, "mixtral": 1e6, "qwen2": 1e6, "qwen3": 1e6,
               "qwen3_moe": 1e6, "gemma3_text": 1e6, "olmo2": 500_000.0}
_DEFAULT_ROPE_THETA = 10_000.0
# Eager attention: Hugging Face's Llama-style models take the softmax in fp32; GPT-2, BERT and ViT
# in the activations' dtype (the saved probabilities are twice as large in the first case).
_FP32_SOFTMAX_FAMILIES = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe",
                                    "gemma2", "gemma3_text", "olmo2", "phi3"})

# enable_gqa appeared in torch 2.5; Hugging Face passes it under the same condition (no mask).
_SDPA_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


# ------------------------------------------------------------------------------ building blocks
class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32 and cast back, like Hugging Face's LlamaRMSNorm."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _norm(spec: TransformerSpec) -> nn.Module:
    eps = _NORM_EPS.get(spec.family, _DEFAULT_NORM_EPS)
    if spec.norm == "rmsnorm":
        return RMSNorm(spec.hidden_size, eps)
    return nn.LayerNorm(spec.hidden_size, eps=eps)


def _activation(spec: TransformerSpec) -> Callable[[torch.Tensor], torch.Tensor]:
    if spec.mlp == "swiglu":
        return F.silu
    if spec.family in ("gpt2", "gemma2", "gemma3_text") or spec.mlp == "geglu":
        # GPT-2's "gelu_new" and Gemma's "gelu_pytorch_tanh" are the tanh approximation.
        return functools.partial(F.gelu, approximate="tanh")
    return F.gelu  # BERT, ViT: exact GeLU


class RotaryEmbedding(nn.Module):
    """cos/sin tables for RoPE (Su et al. 2021), rotate-half layout as in Hugging Face Llama."""

    inv_freq: torch.Tensor

    def __init__(self, head_dim: int, theta: float = _DEFAULT_ROPE_THETA) -> None:
        super().__init__()
        # Computed on the CPU and moved: on meta, pow/div run as Python decompositions that import
        # torch._dynamo on first use (a one-off second) for no benefit.
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
        inv_freq = (1.0 / (theta**exponent)).to(torch.empty(()).device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(seq_len, device=x.device, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq.float()[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)  # [s, head_dim]
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)


def _rope_theta(spec: TransformerSpec) -> float:
    return _ROPE_THETA.get(spec.family, _DEFAULT_ROPE_THETA)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    """Multi-head attention with grouped K/V heads (GQA), causal or not, through SDPA or eager."""

    def __init__(self, spec: TransformerSpec, *, causal: bool, attn_implementation: str) -> None:
        super().__init__()
        h = spec.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = (
            spec.num_heads, spec.num_kv_heads, spec.head_dim)
        self.causal = causal
        self.eager = attn_implementation == "eager"
        self.softmax_dtype = torch.float32 if spec.family in _FP32_SOFTMAX_FAMILIES else None
        self.dropout = spec.attention_dropout
        self.q_proj = nn.Linear(h, spec.q_dim, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(h, spec.kv_dim, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(h, spec.kv_dim, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(spec.q_dim, h, bias=spec.attn_out_bias)
        # Qwen3 / Gemma-3 normalise each head of q and k; OLMo-2 the whole projections.
        self.qk_norm = spec.qk_norm
        if spec.qk_norm != "none":
            eps = _NORM_EPS.get(spec.family, _DEFAULT_NORM_EPS)
            per_head = spec.qk_norm == "head"
            self.q_norm = RMSNorm(spec.head_dim if per_head else spec.q_dim, eps)
            self.k_norm = RMSNorm(spec.head_dim if per_head else spec.kv_dim, eps)

    def forward(self, x: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        q, k = self.q_proj(x), self.k_proj(x)
        if self.qk_norm == "proj":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(b, s, self.num_heads, self.head_dim)
        k = k.view(b, s, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if rope is not None:
            q, k = _apply_rope(q, *rope), _apply_rope(k, *rope)
        dropout_p = self.dropout if self.training else 0.0
        groups = self.num_heads // self.num_kv_heads
        if self.eager:
            y = self._eager(q, _repeat_kv(k, groups), _repeat_kv(v, groups), dropout_p)
        elif groups > 1 and _SDPA_HAS_GQA:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p,
                                               is_causal=self.causal, enable_gqa=True)
        else:
            y = F.scaled_dot_product_attention(q, _repeat_kv(k, groups), _repeat_kv(v, groups),
                                               dropout_p=dropout_p, is_causal=self.causal)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))

    def _eager(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               dropout_p: float) -> torch.Tensor:
        # The b*a*s*s score and probability matrices are materialised (Korthikanti's 5as/h term).
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        if self.causal:
            s = q.shape[-2]
            future = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        probs = F.softmax(scores, dim=-1, dtype=self.softmax_dtype).to(q.dtype)
        probs = F.dropout(probs, p=dropout_p)
        return probs @ v


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[b, kv, s, d] -> [b, kv*groups, s, d], as Hugging Face's repeat_kv."""
    if groups == 1:
        return x
    b, kv, s, d = x.shape
    return x[:, :, None].expand(b, kv, groups, s, d).reshape(b, kv * groups, s, d)


class Mlp(nn.Module):
    """Feed-forward: ``down(act(gate(x)) * up(x))`` (SwiGLU / GeGLU) or ``down(act(up(x)))``."""

    def __init__(self, spec: TransformerSpec) -> None:
        super().__init__()
        h, f = spec.hidden_size, spec.intermediate_size
        self.act = _activation(spec)
        self.gate_proj = nn.Linear(h, f, bias=spec.mlp_bias) if spec.mlp != "gelu" else None
        self.up_proj = nn.Linear(h, f, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(f, h, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_proj is None:
            return self.down_proj(self.act(self.up_proj(x)))
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """Top-k routed experts (Mixtral routing) dispatched with static shapes.

    Routing follows Mixtral: softmax over all experts in fp32, keep the top k, renormalise.
    Dispatch is the GShard / Switch-Transformer capacity formulation rather than Hugging Face's
    loop over ``nonzero()`` hits, so that no shape depends on the data (the module traces on meta
    tensors): every expert gets a fixed buffer of ``capacity`` token slots,
    ``capacity = min(tokens, ceil(tokens * k * capacity_factor / num_experts))``; each token's
    slot in its expert's buffer comes from a cumulative sum over a one-hot of the assignments
    (earlier tokens first), the buffers run through the experts as one batched matmul, and results
    are gathered back and weighted. Assignments beyond an expert's capacity are dropped (the
    residual carries the token on), as in Switch Transformers.

    ``capacity_factor=1.0`` (the default) is balanced routing: activation memory equals the
    analytic balanced estimate. ``capacity_factor=None`` sets ``capacity = tokens``, which never
    drops (each token picks distinct experts) and computes exactly what Mixtral computes, with
    expert buffers ``num_experts / k`` times larger.
    """

    def __init__(self, spec: TransformerSpec, capacity_factor: float | None) -> None:
        super().__init__()
        e, h, f = spec.num_experts, spec.hidden_size, spec.intermediate_size
        self.num_experts, self.top_k, self.capacity_factor = (
            e, spec.experts_per_token, capacity_factor)
        self.act = _activation(spec)
        self.router = nn.Linear(h, e, bias=False)
        # Stacked expert weights in nn.Linear's [out, in] layout, one slice per expert.
        gated = spec.mlp != "gelu"
        self.gate_proj = nn.Parameter(torch.empty(e, f, h)) if gated else None
        self.up_proj = nn.Parameter(torch.empty(e, f, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, f))
        bias = spec.mlp_bias
        self.gate_bias = nn.Parameter(torch.zeros(e, f)) if bias and gated else None
        self.up_bias = nn.Parameter(torch.zeros(e, f)) if bias else None
        self.down_bias = nn.Parameter(torch.zeros(e, h)) if bias else None

    def capacity(self, tokens: int) -> int:
        if self.capacity_factor is None:
            return tokens
        return max(1, min(tokens, math.ceil(tokens * self.top_k * self.capacity_factor
                                            / self.num_experts)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, expert = self.route(x)
        return self.dispatch_combine(x, weights, expert).view(shape)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The router on ``[tokens, hidden]``: each token's top-k weights (renormalised) and
        experts, ``[tokens, k]`` each."""
        probs = F.softmax(self.router(x).float(), dim=-1)
        weights, expert = torch.topk(probs, self.top_k, dim=-1)  # [tokens, k]
        return weights / weights.sum(dim=-1, keepdim=True), expert

    def dispatch_combine(self, x: torch.Tensor, weights: torch.Tensor,
                         expert: torch.Tensor) -> torch.Tensor:
        """The routed tokens ``x`` (``[tokens, hidden]``) into the capacity buffers, through the
        experts (:meth:`run_experts`) and back, weighted: ``[tokens, hidden]``."""
        tokens, h = x.shape
        e, k = self.num_experts, self.top_k
        capacity = self.capacity(tokens)
        dest, token = dispatch_slots(expert.reshape(-1), k, e, capacity)
        buffers = x.new_zeros(e * capacity + 1, h).index_add(0, dest, x.index_select(0, token))
        expert_in = buffers[: e * capacity].view(e, capacity, h)
        out = self.run_experts(expert_in).reshape(e * capacity, h)
        out = torch.cat((out, out.new_zeros(1, h)))  # the scratch row reads back as zero
        y = out.index_select(0, dest) * weights.reshape(-1, 1).to(out.dtype)
        return y.view(tokens, k, h).sum(dim=1)

    def run_experts(self, expert_in: torch.Tensor) -> torch.Tensor:
        """Each expert on its buffer: ``[experts, capacity, hidden]`` in and out (expert
        parallelism replaces it with an all-to-all exchange around the local experts:
        ``memfit/parallel/expert.py``)."""
        hidden = _batched_linear(expert_in, self.up_proj, self.up_bias)
        if self.gate_proj is None:
            hidden = self.act(hidden)
        else:
            hidden = self.act(_batched_linear(expert_in, self.gate_proj, self.gate_bias)) * hidden
        return _batched_linear(hidden, self.down_proj, self.down_bias)


@torch.no_grad()
def dispatch_slots(expert: torch.Tensor, k: int, experts: int,
                   capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The capacity dispatch of :class:`MoE` (also expert parallelism's on transformers'
    experts, ``memfit/parallel/hf_expert.py``): for the ``tokens * k`` assignments ``expert``
    (token-major), each one's row in the ``[experts * capacity + 1, hidden]`` buffers (its
    expert's next free slot, earlier tokens first; past ``capacity``, the scratch row
    ``experts * capacity``) and its token. Static shapes only: a cumulative sum over a one-hot."""
    assignments = expert.shape[0]
    one_hot = torch.zeros(assignments, experts, dtype=torch.int32, device=expert.device)
    one_hot.scatter_(1, expert[:, None], 1)
    slot = one_hot.cumsum(0).gather(1, expert[:, None]).squeeze(1) - 1
    # Dropped assignments go to a scratch row past the expert buffers.
    dest = torch.where(slot < capacity, expert * capacity + slot,
                       torch.full_like(slot, experts * capacity))
    token = torch.arange(assignments, device=expert.device) // k
    return dest, token


def _batched_linear(x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """Per-expert ``x[e] @ weight[e].T + bias[e]`` for x [E, C, in], weight [E, out, in]."""
    if bias is None:
        return torch.bmm(x, weight.transpose(1, 2))
    return torch.baddbmm(bias[:, None, :], x, weight.transpose(1, 2))


class PreNormBlock(nn.Module):
    """Decoder / ViT block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``.

    With four norms (Gemma-2), the sub-layer outputs are normalised too before the residual add.
    Names follow Hugging Face Llama / Gemma-2 (``post_attention_layernorm`` is the pre-MLP norm of
    a two-norm block, as there).
    """

    def __init__(self, spec: TransformerSpec, *, causal: bool, attn_implementation: str,
                 moe_capacity_factor: float | None) -> None:
        super().__init__()
        if spec.norms_per_layer not in (2, 4):
            raise MemfitError(
                f"model {spec.name!r}: the builtin backend builds blocks with 2 or 4 norms, not "
                f"norms_per_layer={spec.norms_per_layer}; use backend='transformers'")
        self.sandwich = spec.norms_per_layer == 4
        # OLMo-2 normalises each sub-layer's output before the residual add, and nothing before.
        self.post_norm = spec.family == "olmo2" and not self.sandwich
        if not self.post_norm:
            self.input_layernorm = _norm(spec)
        self.self_attn = Attention(spec, causal=causal, attn_implementation=attn_implementation)
        self.post_attention_layernorm = _norm(spec)
        if self.post_norm:
            self.post_feedforward_layernorm = _norm(spec)
        if self.sandwich:
            self.pre_feedforward_layernorm = _norm(spec)
            self.post_feedforward_layernorm = _norm(spec)
        self.mlp: nn.Module = MoE(spec, moe_capacity_factor) if spec.is_moe else Mlp(spec)
        self.dropout = _dropout(spec.dropout)

    def forward(self, x: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        if self.post_norm:
            x = x + self.dropout(self.post_attention_layernorm(self.self_attn(x, rope)))
            return x + self.dropout(self.post_feedforward_layernorm(self.mlp(x)))
        if self.sandwich:
            x = x + self.dropout(self.post_attention_layernorm(
                self.self_attn(self.input_layernorm(x), rope)))
            return x + self.dropout(self.post_feedforward_layernorm(
                self.mlp(self.pre_feedforward_layernorm(x))))
        x = x + self.dropout(self.self_attn(self.input_layernorm(x), rope))
        return x + self.dropout(self.mlp(self.post_attention_layernorm(x)))


class PostNormBlock(nn.Module):
    """BERT block: ``norm(x + attn(x))`` then ``norm(x + mlp(x))`` (Vaswani et al. 2017)."""

    def __init__(self, spec: TransformerSpec, *, attn_implementation: str) -> None:
        super().__init__()
        if spec.norms_per_layer != 2 or spec.is_moe:
            raise MemfitError(
                f"model {spec.name!r}: the builtin encoder block has 2 norms and a dense MLP; "
                "use backend='transformers'")
        self.attention = Attention(spec, causal=False, attn_implementation=attn_implementation)
        self.attention_norm = _norm(spec)
        self.mlp = Mlp(spec)
        self.mlp_norm = _norm(spec)
        self.dropout = _dropout(spec.dropout)

    def forward(self, x: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        x = self.attention_norm(x + self.dropout(self.attention(x, rope)))
        return self.mlp_norm(x + self.dropout(self.mlp(x)))


def _dropout(p: float) -> nn.Module:
    # No module at all for p = 0, so traces show no dropout op where nothing is dropped.
    return nn.Dropout(p) if p > 0 else nn.Identity()

