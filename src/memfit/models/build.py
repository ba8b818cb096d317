"""Build a real ``torch.nn.Module`` from a :class:`TransformerSpec`.

Two backends:

- ``"transformers"``: the Hugging Face model itself, built from a config made in code (never
  downloaded): ``AutoModelForCausalLM`` for decoders, ``BertModel`` (with pooler) for BERT,
  ``ViTForImageClassification`` for ViT. Needs ``pip install 'memfit[hf]'``.
- ``"builtin"``: memfit's own compact reference implementations in plain PyTorch (below), in the
  spirit of nanoGPT / torchtitan: one pre-norm decoder block (RMSNorm or LayerNorm, RoPE or learned
  positions, GQA through SDPA, SwiGLU / GeGLU / GeLU MLP, optional biases, optional top-k MoE), a
  post-norm BERT encoder and a pre-norm ViT. Parameter counts equal ``spec.param_count()`` exactly
  (tied embeddings are tied for real), and decoders use Hugging Face Llama's parameter names
  (``model.layers.0.self_attn.q_proj.weight``, ...), so Llama-family state dicts load as they are.

``"auto"`` picks transformers when it is installed, else builtin.

Forward contracts (both backends; the HF models return their ``ModelOutput`` instead of a tensor):

- decoders: ``model(input_ids, labels=None)`` -> logits ``[b, s, vocab]``, or with labels the mean
  cross-entropy of next-token prediction (labels shifted left by one inside, ``-100`` ignored,
  logits upcast to fp32), as Hugging Face's ``ForCausalLMLoss`` computes it;
- BERT: ``model(input_ids, token_type_ids=None)`` -> the last hidden state ``[b, s, h]`` (the
  pooler's output is not part of it: ``model.pool(hidden)`` gives it);
- ViT: ``model(pixel_values, labels=None)`` -> logits ``[b, num_labels]`` or the cross-entropy.

Use :func:`example_inputs` for keyword inputs of the right shapes. Hugging Face decoders are
built with ``use_cache=False`` (a training step keeps no KV cache); set
``model.config.use_cache = True`` to trace generation.

Known limitations of the builtin models: numerics-only details are not reproduced (Gemma-2's
``1 + w`` RMSNorm scaling, embedding scaling and soft-capping, sliding windows, RoPE scaling; the
RoPE base is one published value per family); attention has no padding mask; MoE layers use a
fixed expert capacity (see :class:`MoE`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memfit.errors import MemfitError, suggest
from memfit.models.spec import TransformerSpec

__all__ = ["BACKENDS", "build_model", "example_inputs", "transformers_available"]

BACKENDS = ("auto", "transformers", "builtin")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")

# Normalisation epsilon per family (the published configs; numerics only).
_NORM_EPS = {"gpt2": 1e-5, "bert": 1e-12, "vit": 1e-12, "qwen2": 1e-6, "gemma2": 1e-6,
             "qwen3": 1e-6, "qwen3_moe": 1e-6, "gemma3_text": 1e-6, "olmo2": 1e-6}
_DEFAULT_NORM_EPS = 1e-5
# RoPE base per family: Llama-3, Mistral v0.2+, Mixtral, Qwen2.5, Qwen3, Gemma-3 (global layers),
# OLMo-2 published values (numerics only).
_ROPE_THETA = {"llama": 500_000.0, "mistral": 1e6, "mixtral": 1e6, "qwen2": 1e6, "qwen3": 1e6,
               "qwen3_moe": 1e6, "gemma3_text": 1e6, "olmo2": 500_000.0}
_DEFAULT_ROPE_THETA = 10_000.0
_INIT_STD = 0.02  # GPT-2 / BERT / Llama initializer_range
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
        tokens, h = x.shape
        e, k = self.num_experts, self.top_k
        capacity = self.capacity(tokens)

        probs = F.softmax(self.router(x).float(), dim=-1)
        weights, expert = torch.topk(probs, k, dim=-1)  # [tokens, k]
        weights = weights / weights.sum(dim=-1, keepdim=True)

        with torch.no_grad():
            expert = expert.reshape(-1)  # [tokens*k], token-major
            one_hot = torch.zeros(tokens * k, e, dtype=torch.int32, device=x.device)
            one_hot.scatter_(1, expert[:, None], 1)
            slot = one_hot.cumsum(0).gather(1, expert[:, None]).squeeze(1) - 1
            # Dropped assignments go to a scratch row past the expert buffers.
            dest = torch.where(slot < capacity, expert * capacity + slot,
                               torch.full_like(slot, e * capacity))
            token = torch.arange(tokens * k, device=x.device) // k

        buffers = x.new_zeros(e * capacity + 1, h).index_add(0, dest, x.index_select(0, token))
        expert_in = buffers[: e * capacity].view(e, capacity, h)
        out = self.run_experts(expert_in).reshape(e * capacity, h)
        out = torch.cat((out, out.new_zeros(1, h)))  # the scratch row reads back as zero
        y = out.index_select(0, dest) * weights.reshape(-1, 1).to(out.dtype)
        return y.view(tokens, k, h).sum(dim=1).view(shape)

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


# ---------------------------------------------------------------------------------- the models
class DecoderModel(nn.Module):
    """Token (+ learned position) embeddings, pre-norm blocks, final norm."""

    def __init__(self, spec: TransformerSpec, *, attn_implementation: str,
                 moe_capacity_factor: float | None) -> None:
        super().__init__()
        h = spec.hidden_size
        self.embed_tokens = _embedding(spec.vocab_size, h)
        self.embed_positions = (_embedding(spec.max_position_embeddings, h)
                                if spec.position == "learned" else None)
        self.rotary_emb = (RotaryEmbedding(spec.head_dim, _rope_theta(spec))
                           if spec.position == "rope" else None)
        self.dropout = _dropout(spec.dropout)
        self.layers = nn.ModuleList(
            PreNormBlock(spec, causal=True, attn_implementation=attn_implementation,
                         moe_capacity_factor=moe_capacity_factor)
            for _ in range(spec.num_layers))
        self.norm = _norm(spec)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        seq = input_ids.shape[1]
        x = self.embed_tokens(input_ids)
        if self.embed_positions is not None:
            x = x + self.embed_positions(torch.arange(seq, device=input_ids.device))
        x = self.dropout(x)
        rope = self.rotary_emb(x, seq) if self.rotary_emb is not None else None
        for layer in self.layers:
            x = layer(x, rope)
        return self.norm(x)


class DecoderLM(nn.Module):
    """A causal language model: :class:`DecoderModel` + LM head (tied to the embedding if the
    spec ties them)."""

    def __init__(self, spec: TransformerSpec, *, attn_implementation: str = "sdpa",
                 moe_capacity_factor: float | None = 1.0) -> None:
        super().__init__()
        self.spec = spec
        self.model = DecoderModel(spec, attn_implementation=attn_implementation,
                                  moe_capacity_factor=moe_capacity_factor)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        _init_model(self)
        if spec.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.lm_head(self.model(input_ids))
        if labels is None:
            return logits
        # Hugging Face's ForCausalLMLoss: fp32 logits, labels shifted left by padding with -100.
        shift_labels = F.pad(labels, (0, 1), value=-100)[:, 1:]
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                               shift_labels.reshape(-1), ignore_index=-100)


class BertEncoder(nn.Module):
    """BERT: word + position + token-type embeddings with LayerNorm, post-norm blocks, pooler.

    ``forward`` returns the last hidden state; ``pool(hidden)`` applies the pooler
    (``tanh(dense(hidden[:, 0]))``).
    """

    def __init__(self, spec: TransformerSpec, *, attn_implementation: str = "sdpa") -> None:
        super().__init__()
        h = spec.hidden_size
        self.spec = spec
        self.word_embeddings = _embedding(spec.vocab_size, h)
        self.position_embeddings = (_embedding(spec.max_position_embeddings, h)
                                    if spec.position == "learned" else None)
        self.rotary_emb = (RotaryEmbedding(spec.head_dim, _rope_theta(spec))
                           if spec.position == "rope" else None)
        self.token_type_embeddings = (_embedding(spec.type_vocab_size, h)
                                      if spec.type_vocab_size else None)
        self.embed_norm = _norm(spec)
        self.dropout = _dropout(spec.dropout)
        self.layers = nn.ModuleList(PostNormBlock(spec, attn_implementation=attn_implementation)
                                    for _ in range(spec.num_layers))
        self.pooler = nn.Linear(h, h) if spec.pooler else None
        _init_model(self)

    def forward(self, input_ids: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        seq = input_ids.shape[1]
        x = self.word_embeddings(input_ids)
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(torch.arange(seq, device=input_ids.device))
        if self.token_type_embeddings is not None:
            if token_type_ids is None:
                token_type_ids = torch.zeros_like(input_ids)
            x = x + self.token_type_embeddings(token_type_ids)
        x = self.dropout(self.embed_norm(x))
        rope = self.rotary_emb(x, seq) if self.rotary_emb is not None else None
        for layer in self.layers:
            x = layer(x, rope)
        return x

    def pool(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.pooler is None:
            raise MemfitError(f"model {self.spec.name!r} has no pooler (spec.pooler is False)")
        return torch.tanh(self.pooler(hidden[:, 0]))


class VisionTransformer(nn.Module):
    """ViT (Dosovitskiy et al. 2021): patch conv, class token, learned positions, pre-norm
    blocks, final norm, linear classifier on the class token."""

    def __init__(self, spec: TransformerSpec, *, attn_implementation: str = "sdpa") -> None:
        super().__init__()
        h = spec.hidden_size
        self.spec = spec
        self.patch_embed = nn.Conv2d(spec.num_channels, h, kernel_size=spec.patch_size,
                                     stride=spec.patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, h))
        self.position_embeddings = nn.Parameter(torch.zeros(1, spec.num_patches + 1, h))
        self.dropout = _dropout(spec.dropout)
        self.layers = nn.ModuleList(
            PreNormBlock(spec, causal=False, attn_implementation=attn_implementation,
                         moe_capacity_factor=1.0)
            for _ in range(spec.num_layers))
        self.norm = _norm(spec)
        self.classifier = nn.Linear(h, spec.num_labels) if spec.num_labels else None
        if _init_model(self):
            nn.init.trunc_normal_(self.cls_token, std=_INIT_STD)
            nn.init.trunc_normal_(self.position_embeddings, std=_INIT_STD)

    def forward(self, pixel_values: torch.Tensor,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        # Images arrive in fp32 whatever the weights are; cast them as Hugging Face's ViT does.
        pixel_values = pixel_values.to(self.patch_embed.weight.dtype)
        x = self.patch_embed(pixel_values).flatten(2).transpose(1, 2)  # [b, patches, h]
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        x = self.dropout(x + self.position_embeddings)
        for layer in self.layers:
            x = layer(x)
        cls = self.norm(x)[:, 0]
        if self.classifier is None:
            if labels is not None:
                raise MemfitError(f"model {self.spec.name!r} has no classifier (num_labels=0); "
                                  "give no labels or set num_labels")
            return cls
        logits = self.classifier(cls)
        return logits if labels is None else F.cross_entropy(logits, labels)


def _dropout(p: float) -> nn.Module:
    # No module at all for p = 0, so traces show no dropout op where nothing is dropped.
    return nn.Dropout(p) if p > 0 else nn.Identity()


def _embedding(num_embeddings: int, dim: int) -> nn.Embedding:
    # Note: [no init on meta] nn.Embedding's own reset_parameters runs normal_, whose meta
    # implementation is a Python decomposition that imports torch._dynamo on first use (~1.5 s);
    # passing the storage skips it, and _init_model initialises real tensors instead.
    return nn.Embedding(num_embeddings, dim, _weight=torch.empty(num_embeddings, dim))


def _init_model(model: nn.Module) -> bool:
    """Initialise real weights (see [no init on meta]); returns False on meta, where there is
    nothing to initialise."""
    if any(p.is_meta for p in model.parameters()):
        return False
    model.apply(_init_weights)
    return True


def _init_weights(module: nn.Module) -> None:
    """GPT-2 / BERT initialisation: N(0, 0.02) weights, zero biases, unit norms."""
    if isinstance(module, nn.Linear | nn.Conv2d | nn.Embedding):
        nn.init.normal_(module.weight, std=_INIT_STD)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, MoE):
        for weight in (module.gate_proj, module.up_proj, module.down_proj):
            if weight is not None:
                nn.init.normal_(weight, std=_INIT_STD)


# --------------------------------------------------------------------------- Hugging Face side
# family -> (config class, model class); the Auto class used to build it is picked by arch.
_HF_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM"),
    "phi": ("PhiConfig", "PhiForCausalLM"),
    "falcon": ("FalconConfig", "FalconForCausalLM"),
    "bert": ("BertConfig", "BertModel"),
    "vit": ("ViTConfig", "ViTForImageClassification"),
}


# GPT-NeoX (use_parallel_residual), Phi-1/2 and Falcon (parallel_attn) run attention and the
# MLP side by side.
_PARALLEL_BLOCK_FAMILIES = frozenset({"gpt_neox", "phi", "falcon"})


def _import_transformers() -> Any:
    try:
        return importlib.import_module("transformers")
    except ImportError:
        raise MemfitError(
            "backend 'transformers' needs the transformers package: pip install 'memfit[hf]' "
            "(or use backend='builtin')") from None


def _hf_config(spec: TransformerSpec, hf: Any) -> Any:
    """The Hugging Face config for ``spec``, built in code (nothing is downloaded)."""
    eps = _NORM_EPS.get(spec.family, _DEFAULT_NORM_EPS)
    config_class = getattr(hf, _HF_CLASSES[spec.family][0])
    if spec.family == "gpt2":
        return config_class(
            vocab_size=spec.vocab_size, n_positions=spec.max_position_embeddings,
            n_embd=spec.hidden_size, n_layer=spec.num_layers, n_head=spec.num_heads,
            n_inner=spec.intermediate_size, activation_function="gelu_new",
            resid_pdrop=spec.dropout, embd_pdrop=spec.dropout, attn_pdrop=spec.attention_dropout,
            layer_norm_epsilon=eps, tie_word_embeddings=spec.tie_embeddings, use_cache=False,
            bos_token_id=None, eos_token_id=None)
    if spec.family == "gpt_neox":
        return config_class(
            vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
            num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
            intermediate_size=spec.intermediate_size, hidden_act="gelu",
            max_position_embeddings=spec.max_position_embeddings or 2048, layer_norm_eps=eps,
            tie_word_embeddings=spec.tie_embeddings, attention_bias=spec.qkv_bias,
            hidden_dropout=spec.dropout, attention_dropout=spec.attention_dropout,
            use_cache=False, bos_token_id=None, eos_token_id=None)
    if spec.family == "falcon":
        # A layout with the spec's parameters: two norms -> the new decoder architecture
        # (kv heads of its own); one norm -> parallel attention, multi-query when kv is 1.
        new = spec.norms_per_layer == 2 or spec.num_kv_heads not in (1, spec.num_heads)
        return config_class(
            vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
            num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
            num_kv_heads=spec.num_kv_heads, new_decoder_architecture=new,
            num_ln_in_parallel_attn=spec.norms_per_layer if new else None,
            multi_query=spec.num_kv_heads == 1, parallel_attn=True, bias=spec.qkv_bias,
            ffn_hidden_size=spec.intermediate_size, alibi=False,
            max_position_embeddings=spec.max_position_embeddings or 2048,
            layer_norm_epsilon=eps, tie_word_embeddings=spec.tie_embeddings,
            hidden_dropout=spec.dropout, attention_dropout=spec.attention_dropout,
            use_cache=False, bos_token_id=None, eos_token_id=None)
    if spec.family == "phi":
        return config_class(
            vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
            intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
            num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
            head_dim=spec.head_dim, resid_pdrop=spec.dropout, embd_pdrop=spec.dropout,
            attention_dropout=spec.attention_dropout, hidden_act="gelu_new",
            max_position_embeddings=spec.max_position_embeddings or 2048, layer_norm_eps=eps,
            tie_word_embeddings=spec.tie_embeddings, qk_layernorm=spec.qk_norm == "head",
            use_cache=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if spec.family in ("bert", "vit"):
        common = dict(
            hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers,
            num_attention_heads=spec.num_heads, intermediate_size=spec.intermediate_size,
            hidden_act="gelu", hidden_dropout_prob=spec.dropout,
            attention_probs_dropout_prob=spec.attention_dropout, layer_norm_eps=eps)
        if spec.family == "bert":
            return config_class(**common, vocab_size=spec.vocab_size,
                                max_position_embeddings=spec.max_position_embeddings,
                                type_vocab_size=spec.type_vocab_size)
        return config_class(**common, image_size=spec.image_size, patch_size=spec.patch_size,
                            num_channels=spec.num_channels, qkv_bias=spec.qkv_bias,
                            num_labels=spec.num_labels)
    # Llama-style decoders. Sliding windows and soft-capping are off: the spec ignores them.
    act = "silu" if spec.mlp == "swiglu" else "gelu_pytorch_tanh"
    kwargs: dict[str, Any] = dict(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim, max_position_embeddings=spec.max_position_embeddings or 2048,
        rms_norm_eps=eps, rope_theta=_rope_theta(spec), tie_word_embeddings=spec.tie_embeddings,
        attention_dropout=spec.attention_dropout, use_cache=False,
        pad_token_id=None, bos_token_id=None, eos_token_id=None)
    if spec.family == "llama":
        kwargs.update(hidden_act=act, attention_bias=spec.qkv_bias, mlp_bias=spec.mlp_bias)
    elif spec.family in ("mistral", "mixtral"):
        kwargs.update(hidden_act=act, sliding_window=None)
        if spec.family == "mixtral":
            kwargs.update(num_local_experts=spec.num_experts,
                          num_experts_per_tok=spec.experts_per_token)
    elif spec.family == "qwen2":
        kwargs.update(hidden_act=act, use_sliding_window=False)
    elif spec.family in ("qwen3", "qwen3_moe"):
        kwargs.update(hidden_act=act, attention_bias=spec.qkv_bias, use_sliding_window=False)
        if spec.family == "qwen3_moe":
            kwargs.update(num_experts=spec.num_experts, num_experts_per_tok=spec.experts_per_token,
                          moe_intermediate_size=spec.intermediate_size, decoder_sparse_step=1,
                          mlp_only_layers=[])
    elif spec.family == "olmo2":
        kwargs.update(hidden_act=act, attention_bias=spec.qkv_bias)
    elif spec.family == "gemma3_text":
        kwargs.update(hidden_activation=act, attention_bias=spec.qkv_bias,
                      query_pre_attn_scalar=spec.head_dim, final_logit_softcapping=None,
                      attn_logit_softcapping=None,
                      layer_types=["full_attention"] * spec.num_layers)
    elif spec.family == "gemma2":
        kwargs.update(hidden_activation=act, attention_bias=spec.qkv_bias,
                      query_pre_attn_scalar=spec.head_dim, final_logit_softcapping=None,
                      attn_logit_softcapping=None,
                      layer_types=["full_attention"] * spec.num_layers)
    elif spec.family == "phi3":
        kwargs.update(hidden_act=act, resid_pdrop=spec.dropout, embd_pdrop=spec.dropout)
    return config_class(**kwargs)


def _build_transformers(spec: TransformerSpec, attn_implementation: str | None) -> nn.Module:
    hf = _import_transformers()
    if spec.family not in _HF_CLASSES:
        raise MemfitError(
            f"model {spec.name!r}: family {spec.family!r} has no transformers mapping; supported: "
            f"{', '.join(_HF_CLASSES)}{suggest(spec.family, _HF_CLASSES)}; or use "
            "backend='builtin'")
    config = _hf_config(spec, hf)
    model_class = getattr(hf, _HF_CLASSES[spec.family][1])
    supports_sdpa = bool(getattr(model_class, "_supports_sdpa", False))
    if attn_implementation is None:
        attn_implementation = "sdpa" if supports_sdpa else "eager"
    elif attn_implementation == "sdpa" and not supports_sdpa:
        raise MemfitError(
            f"transformers {hf.__version__} has no SDPA attention for {model_class.__name__}; "
            "use attn_implementation='eager' (or leave it unset)")
    if spec.arch == "decoder":
        return hf.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    if spec.family == "bert":
        return hf.AutoModel.from_config(config, attn_implementation=attn_implementation,
                                        add_pooling_layer=spec.pooler)
    return hf.AutoModelForImageClassification.from_config(
        config, attn_implementation=attn_implementation)


def _build_builtin(spec: TransformerSpec, attn_implementation: str | None,
                   moe_capacity_factor: float | None) -> nn.Module:
    if spec.family in _PARALLEL_BLOCK_FAMILIES or spec.head_bias:
        raise MemfitError(
            f"model {spec.name!r}: the builtin backend has no parallel attention + MLP block "
            f"or LM-head bias ({spec.family}); use backend='transformers' "
            "(pip install 'memfit[hf]')")
    attn = attn_implementation or "sdpa"
    if spec.arch == "decoder":
        return DecoderLM(spec, attn_implementation=attn, moe_capacity_factor=moe_capacity_factor)
    if spec.arch == "encoder":
        return BertEncoder(spec, attn_implementation=attn)
    return VisionTransformer(spec, attn_implementation=attn)


# ---------------------------------------------------------------------------------- public API
@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Create floating parameters in ``dtype`` directly (no fp32 copy first); restore on exit."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def transformers_available() -> bool:
    """Whether Hugging Face ``transformers`` imports here (``backend="auto"`` then builds
    with it)."""
    try:
        importlib.import_module("transformers")
    except ImportError:
        return False
    return True


def build_model(
    spec: TransformerSpec,
    *,
    backend: str = "auto",
    device: str | torch.device = "meta",
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
    moe_capacity_factor: float | None = 1.0,
) -> nn.Module:
    """Build ``spec`` as a real module, on ``device`` (meta by default: no memory) in ``dtype``.

    ``attn_implementation``: ``"sdpa"`` or ``"eager"``; unset means SDPA (eager for Hugging
    Face models that have no SDPA path, e.g. Gemma-2 in transformers 5).
    ``moe_capacity_factor`` only affects builtin MoE layers (see :class:`MoE`).

    >>> model = build_model(spec, backend="builtin")          # meta, fp32
    >>> loss = model(**example_inputs(spec, batch=2, seq=128))
    """
    if not isinstance(spec, TransformerSpec):
        raise MemfitError(
            f"model {getattr(spec, 'name', spec)!r} has no architecture (only a parameter count) "
            "and cannot be built or traced; give a preset name or a config.json")
    if backend not in BACKENDS:
        raise MemfitError(f"unknown backend {backend!r}{suggest(backend, BACKENDS)}; "
                          f"valid: {', '.join(BACKENDS)}")
    if attn_implementation is not None and attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise MemfitError(
            f"unknown attn_implementation {attn_implementation!r}"
            f"{suggest(attn_implementation, ATTN_IMPLEMENTATIONS)}; valid: "
            f"{', '.join(ATTN_IMPLEMENTATIONS)}")
    if moe_capacity_factor is not None and not moe_capacity_factor > 0:
        raise MemfitError(f"moe_capacity_factor must be positive or None, got "
                          f"{moe_capacity_factor}")
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise MemfitError(f"dtype must be a floating torch.dtype (e.g. torch.bfloat16), got "
                          f"{dtype!r}")
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise MemfitError(f"bad device {device!r}: {exc}; use e.g. 'meta', 'cpu' or 'cuda'"
                          ) from None
    if backend == "auto":
        backend = "transformers" if transformers_available() else "builtin"

    with target, _default_dtype(dtype):
        if backend == "transformers":
            model = _build_transformers(spec, attn_implementation)
        else:
            model = _build_builtin(spec, attn_implementation, moe_capacity_factor)

    built = sum(p.numel() for p in model.parameters())
    if built != spec.param_count():
        raise MemfitError(
            f"model {spec.name!r}: the {backend} {spec.family} model has {built:,} parameters but "
            f"the spec counts {spec.param_count():,}; the spec sets something this backend "
            "cannot express (biases, head_dim, norms); try the other backend")
    return model


def example_inputs(
    spec: TransformerSpec,
    batch: int,
    seq: int | None = None,
    device: str | torch.device = "meta",
    *,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Keyword inputs for ``build_model(spec)``: ``input_ids`` and ``labels`` (a separate tensor,
    as a data collator gives) for decoders, ``input_ids`` for BERT, ``pixel_values`` (in
    ``dtype``) and ``labels`` for ViT (labels only with a classifier). ``seq`` defaults to
    ``spec.default_seq_len``; for ViT it is fixed by the image size.

    >>> model(**example_inputs(spec, batch=4, seq=2048))
    """
    if isinstance(batch, bool) or not isinstance(batch, int) or batch <= 0:
        raise MemfitError(f"batch must be a positive integer, got {batch!r}")
    if seq is not None and (isinstance(seq, bool) or not isinstance(seq, int) or seq <= 0):
        raise MemfitError(f"seq must be a positive integer, got {seq!r}")
    if spec.arch == "vision":
        if seq is not None and seq != spec.default_seq_len:
            raise MemfitError(
                f"model {spec.name!r} sees {spec.default_seq_len} tokens per image "
                f"({spec.num_patches} patches + class token); leave seq unset or change "
                "image_size")
        size = (batch, spec.num_channels, spec.image_size, spec.image_size)
        inputs = {"pixel_values": torch.randn(size, device=device, dtype=dtype)}
        if spec.num_labels:
            inputs["labels"] = torch.randint(0, spec.num_labels, (batch,), device=device)
        return inputs
    seq = seq or spec.default_seq_len
    if spec.position == "learned" and seq > spec.max_position_embeddings:
        raise MemfitError(
            f"model {spec.name!r} has {spec.max_position_embeddings} learned positions, "
            f"seq {seq} is longer; use seq <= {spec.max_position_embeddings}")
    input_ids = torch.randint(0, spec.vocab_size, (batch, seq), device=device)
    if spec.arch == "encoder":
        return {"input_ids": input_ids}
    return {"input_ids": input_ids, "labels": input_ids.clone()}
