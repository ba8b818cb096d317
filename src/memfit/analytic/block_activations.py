"""What one transformer block saves for backward, term by term (Korthikanti et al. 2022, §4.1).

The byte widths of each saved tensor and the Hugging Face families whose code keeps different
tensors (fused projections, fp32 norms and softmax, Python GeLU), with the notes that derive
them from PyTorch's and transformers' source; :func:`layer_terms` adds them up per block, split
by what tensor parallelism divides. ``activations.py`` assembles a step from the blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.models.spec import TransformerSpec

MASK_BYTES = 1  # dropout masks are torch.bool
LSE_BYTES = 4  # fused attention saves a fp32 logsumexp per query row and head
SOFTMAX_AUTOCAST_BYTES = 4  # CUDA autocast runs softmax in fp32 (see the note below)
NORM_UPCAST_BYTES = 4  # Hugging Face's RMSNorm computes in fp32
# Hugging Face model types whose q/k/v (gate/up) are one linear layer: GPT-2's c_attn Conv1D,
# Phi-3's qkv_proj and gate_up_proj. The others (Llama, Mistral, Mixtral, Qwen2, Gemma-2, BERT,
# ViT) have one nn.Linear per projection.
FUSED_QKV_FAMILIES = frozenset({"gpt2", "phi3", "gpt_neox", "falcon"})
FUSED_GATE_UP_FAMILIES = frozenset({"phi3"})
# Note: [fused q/k/v with a concatenating RoPE]
# Phi-3's attention slices q, k and v out of one qkv_proj output (views of its storage) and its
# apply_rotary_pos_emb returns torch.cat([rotated, pass-through]): new, contiguous (b, h, s, d)
# q and k (transformers/models/phi3/modeling_phi3.py: Phi3Attention.forward,
# apply_rotary_pos_emb). V stays a view, and attention saves it for backward, so the whole qkv
# output stays alive: its q and k parts too, beside the rotated copies. And the fused kernel
# allocates its output with the query's layout (aten/src/ATen/native/transformers/cuda/
# attention.cu: _scaled_dot_product_flash_attention_cuda passes query.transpose(1, 2);
# flash_attn/flash_api.cpp: mha_fwd makes ``out = at::empty_like(q_padded)``): a contiguous
# (b, h, s, d) query gives an output that transformers' sdpa_attention_forward's
# ``transpose(1, 2).contiguous()`` must copy, so the kernel's saved output and the output
# projection's input are two tensors (Llama's RoPE adds keep the
# projection's (b, s, h, d) layout: one tensor). Checked with saved_tensors_hooks on a real
# bf16 Phi-3 block: 6 bytes per token x hidden of qkv, 2 + 2 of rotated q and k, 2 + 2 of
# output, for e = 2 and no GQA.
CAT_ROPE_FUSED_QKV_FAMILIES = frozenset({"phi3"})
# Hugging Face model types whose RMSNorm multiplies by its weight in fp32 and casts after
# (``(self.weight * hidden_states).to(input_dtype)``: transformers' Gemma2RMSNorm,
# Gemma3RMSNorm, Olmo2RMSNorm), so the normalised tensor kept for the weight's gradient is
# fp32 whatever the input's width; Llama's casts first (``self.weight * hidden.to(input_dtype)``).
FP32_NORM_WEIGHT_FAMILIES = frozenset({"gemma2", "gemma3_text", "olmo2"})
# Hugging Face model types whose MLP activation is "gelu_new" (transformers/activations.py:
# NewGELUActivation), the tanh approximation written as plain PyTorch ops; the others call a
# fused kernel (nn.functional.gelu, silu) that keeps only its input. Megatron-LM builds its own
# block whatever the config's family (Note: [Megatron's block]), so there it is never gelu_new.
PYTHON_GELU_FAMILIES = frozenset({"gpt2"})

# Note: [Megatron's block]
# Under --engine megatron the model is Megatron-LM's GPT (megatron/core/models/gpt/, local or
# Transformer Engine spec), not Hugging Face's module of the config's family. Its MLP runs the
# bias and GeLU as one fused autograd function that keeps only the fc1 output and the bias
# (megatron/core/fusions/fused_bias_gelu.py: GeLUFunction.forward, ``ctx.save_for_backward(
# input, bias)``; --bias-gelu-fusion is on by default), Korthikanti's 8sbh for h -> 4h, where
# Hugging Face's GPT-2 runs gelu_new op by op (Note: [gelu_new]): 3e bytes more per element
# of the 4h-wide tensor, 24sbh in bf16, about a fifth of a block's 114sbh at s = 1024, a = 8,
# h = 512. Its softmax is FusedScaleMaskSoftmax's 16-bit kernel (the scores' softmax output,
# e bytes, as in Korthikanti's 5as^2b), and the model is cast to 16-bit (no autocast).
# Hugging Face model types whose eager attention runs softmax(..., dtype=torch.float32) and
# casts back (Llama's eager_attention_forward and its copies), in any precision; GPT-2, BERT
# and ViT call a plain softmax.
SOFTMAX_FP32_FAMILIES = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe",
                                   "gemma2", "gemma3_text", "olmo2", "phi3"})

# Note: [eager scores under autocast]
# Korthikanti's 5as²b is for pure 16-bit activations: per score element the softmax output (2),
# the dropout mask (1) and the dropout output (2), which the matmul with V keeps. Under CUDA
# autocast (fp16-/bf16-mixed) softmax is on the fp32 list (aten/src/ATen/autocast_mode.h,
# AT_FORALL_FP32_SET_OPT_DTYPE: softmax(x, dim, dtype=float)), so its output, which
# softmax's backward keeps, is fp32 (4). Dropout on it is CUDA's native_dropout
# (aten/src/ATen/native/Dropout.cpp: dropout -> native_dropout when is_fused_kernel_acceptable),
# which keeps a bool mask (1); its fp32 output is not kept, but the matmul with V (autocast's
# lower-precision list) casts it to 16-bit and keeps that copy (e). Without dropout the matmul
# still keeps its own 16-bit cast of the softmax output: 4 + e, where pure 16-bit keeps one e.
# Models whose eager attention upcasts softmax itself (SOFTMAX_FP32_FAMILIES) keep the same
# 4 + e (+ mask) in pure 16-bit too.

# Note: [gelu_new]
# NewGELUActivation computes 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * pow(x, 3)))) op by
# op, and autograd keeps, per element of the s x b x f input (beyond x itself): pow's input (under
# CUDA autocast pow is on the fp32 list, aten/src/ATen/autocast_mode.h AT_FORALL_FP32, so an fp32
# copy of x: 4; in pure precision x itself: 0), tanh's output (fp32 after type promotion with the
# fp32 pow result under autocast: 4; else e), the two factors of the last mul: 0.5 * x (e) and
# 1 + tanh(.) (4 under autocast; else e). 4 + 4 + e + 4 under autocast, 3e otherwise. The
# scalar multiplications and the adds keep nothing.


def gelu_new_bytes_per_element(*, act_bytes: int, autocast: bool) -> int:
    """Bytes NewGELUActivation keeps per element beyond its input (Note: [gelu_new]).

    >>> gelu_new_bytes_per_element(act_bytes=2, autocast=True)
    14
    >>> gelu_new_bytes_per_element(act_bytes=4, autocast=False)
    12
    """
    return 4 + 4 + act_bytes + 4 if autocast else 3 * act_bytes


# Note: [projection inputs under autocast]
# Under CUDA autocast the residual stream is fp32 and so is every norm's output (layer_norm and
# rms_norm are on the fp32 list; Hugging Face's RMSNorm returns its input's dtype). Each linear
# layer (lower-precision list) casts that fp32 input to 16-bit itself, and mm keeps the cast for
# its weight's gradient. autocast caches casts only of leaf tensors that require grad
# (aten/src/ATen/autocast_mode.cpp: cached_cast, once is_eligible(arg): can_try_cache needs
# arg.requires_grad() && arg.is_leaf()), i.e. the weights, never an activation. So separate
# q, k and v projections keep three e-byte copies of the norm output (a fused QKV projection
# one), and a gated MLP's separate gate and up projections two. With a frozen base (LoRA) only
# the trained projections keep theirs (one per adapter). In pure 16-bit all of them keep the
# same tensor. (MoE experts' gathered inputs are left at one copy each: not traced yet.)


def norm_saved_bytes(spec: TransformerSpec, *, residual_bytes: int, trained: bool) -> int:
    """Bytes per (token x hidden) a norm keeps: its input (Korthikanti's 2sbh per LayerNorm;
    the fused LayerNorm's mean/rstd are negligible).

    Hugging Face's RMSNorm is plain PyTorch ops: it upcasts its input to fp32 (``pow`` keeps
    that copy, 4 bytes, whatever the input's width) and, when its weight is trained, keeps the
    normalised tensor for the weight's gradient, cast back to the input's dtype (the residual
    stream's width; Gemma-2, Gemma-3 and OLMo-2 multiply in fp32, so 4:
    :data:`FP32_NORM_WEIGHT_FAMILIES`).

    >>> from memfit.models import get_preset
    >>> norm_saved_bytes(get_preset("llama-3-8b"), residual_bytes=4, trained=True)
    8
    """
    if spec.norm == "layernorm":
        return residual_bytes
    normalised = (NORM_UPCAST_BYTES if spec.family in FP32_NORM_WEIGHT_FAMILIES
                  else residual_bytes)
    return NORM_UPCAST_BYTES + (normalised if trained else 0)


@dataclass(frozen=True, kw_only=True)
class LayerTerms:
    """Bytes one block saves for backward, split by what tensor parallelism divides."""

    replicated: int
    """Norm inputs, the attention and MLP block inputs, dropout masks (Korthikanti's 10sbh)."""
    split: int
    """Q/K/V, attention scores, the MLP's wide tensors (Korthikanti's 24sbh + 5as²b)."""
    attention_scores: int
    """The s×s part of ``split`` (what selective recompute drops)."""

    def per_gpu(self, tp: int, sequence_parallel: bool) -> int:
        replicated = -(-self.replicated // tp) if sequence_parallel else self.replicated
        return replicated + -(-self.split // tp)


def score_bytes_per_element(*, act_bytes: int, dropout: bool, autocast: bool) -> int:
    """Bytes eager attention keeps for backward per element of the a×s×s score matrix.

    Pure precision e: softmax output e (+ 1-byte dropout mask + dropout output e). Under
    autocast: fp32 softmax output + the matmul's e-byte copy (+ the mask); see
    Note: [eager scores under autocast].

    >>> score_bytes_per_element(act_bytes=2, dropout=True, autocast=False)  # Korthikanti's 5
    5
    >>> score_bytes_per_element(act_bytes=2, dropout=True, autocast=True)
    7
    """
    softmax_out = SOFTMAX_AUTOCAST_BYTES if autocast else act_bytes
    mask = MASK_BYTES if dropout else 0
    # the matmul with V keeps its own copy unless its input is the softmax output itself
    matmul_in = act_bytes if (dropout or autocast) else 0
    return softmax_out + mask + matmul_in


def _keeps(trainable: frozenset[str] | None, *roles: str) -> bool:
    """Whether a linear layer in one of ``roles`` keeps its input: its weight (or a LoRA
    adapter on it) gets a gradient."""
    return trainable is None or any(r in trainable for r in roles)


def _replicated_bytes(spec: TransformerSpec, *, sbh: int, e: int,
                      trainable: frozenset[str] | None, residual_bytes: int,
                      autocast: bool) -> int:
    """What tensor parallelism does not divide: the norms' inputs, the projections' copies of
    the norm outputs and the residual dropout masks (Korthikanti's 10sbh)."""
    replicated = spec.norms_per_layer * norm_saved_bytes(
        spec, residual_bytes=residual_bytes, trained=trainable is None) * sbh

    def input_copies(roles: tuple[str, ...], fused: bool) -> int:
        """Copies of a norm output that the projections reading it keep (see the note)."""
        kept = [r for r in roles if _keeps(trainable, r)]
        if not kept:
            return 0
        return len(kept) if autocast and not fused else 1

    # inputs of the Q/K/V projections (the norm's output)
    replicated += input_copies(("q", "k", "v"), spec.family in FUSED_QKV_FAMILIES) * e * sbh
    # input of the MLP's first projection(s); a GeLU MLP and an MoE router have one
    gated_separately = (spec.mlp != "gelu" and not spec.is_moe
                        and spec.family not in FUSED_GATE_UP_FAMILIES)
    replicated += input_copies(("gate", "up"), not gated_separately) * e * sbh
    if spec.dropout > 0:
        replicated += 2 * MASK_BYTES * sbh  # residual dropout masks after attention and MLP
    return replicated


def _attention_bytes(spec: TransformerSpec, *, s: int, b: int, e: int, attention: str,
                     trainable: frozenset[str] | None, autocast: bool) -> tuple[int, int]:
    """Attention's share of what tensor parallelism divides: Q, K, V, the output projection's
    input, and the eager scores or the fused kernel's logsumexp; with the s×s scores alone."""
    attn_dropout = spec.attention_dropout > 0 and attention == "eager"
    # Eager attention repeats GQA's K/V heads to all query heads before the matmuls, and the
    # matmuls keep the repeated copies; fused kernels read the grouped K/V directly.
    kv_width = spec.q_dim if attention == "eager" else spec.kv_dim
    split = e * s * b * (spec.q_dim + kv_width)  # Q and K, kept for QK^T
    if spec.qk_norm != "none":
        # Qwen3 / Gemma-3 / OLMo-2 normalise the q and k projections' outputs (e bytes wide)
        # before QK^T: each norm keeps what a hidden-state norm keeps, per q/k element.
        split += norm_saved_bytes(spec, residual_bytes=e, trained=trainable is None) * (
            s * b * (spec.q_dim + spec.kv_dim))
    split += e * s * b * kv_width  # V, kept for softmax(QK^T) V
    if spec.family in CAT_ROPE_FUSED_QKV_FAMILIES:
        # Note: [fused q/k/v with a concatenating RoPE]: V, a view, keeps the whole qkv output
        split += e * s * b * (spec.q_dim + spec.kv_dim)
        if attention != "eager":
            split += e * s * b * spec.q_dim  # the kernel's output beside its contiguous copy
    if _keeps(trainable, "o") or attention != "eager":
        # input of the output projection; the fused kernels keep their output for backward
        # whether or not the projection is trained (tools/autograd/derivatives.yaml:
        # _scaled_dot_product_flash_attention's backward takes ``output`` and ``logsumexp``)
        split += e * s * b * spec.q_dim
    scores = 0
    if attention == "eager":
        a_ss_b = spec.num_heads * s * s * b
        fp32_softmax = autocast or (spec.family in SOFTMAX_FP32_FAMILIES and e < 4)
        scores = score_bytes_per_element(act_bytes=e, dropout=attn_dropout,
                                         autocast=fp32_softmax) * a_ss_b
    else:
        split += LSE_BYTES * spec.num_heads * s * b  # flash/memory-efficient: logsumexp only
    split += scores
    return split, scores


def _mlp_bytes(spec: TransformerSpec, *, s: int, b: int, e: int,
               trainable: frozenset[str] | None, autocast: bool,
               megatron: bool = False) -> int:
    """The MLP's (or the MoE layer's) share of what tensor parallelism divides."""
    sbh = s * b * spec.hidden_size
    f = spec.intermediate_size
    # GeLU MLP keeps the GeLU input and the second projection's input (Korthikanti's 16sbh);
    # a gated MLP keeps the gate and up outputs, act(gate) and the product: 4 f-wide tensors.
    wide = 2 if spec.mlp == "gelu" else 4
    if not _keeps(trainable, "down"):
        wide -= 1  # the down projection's input (GeLU output / gated product) is not kept
    mlp = wide * e * s * b * f
    if spec.family in PYTHON_GELU_FAMILIES and not megatron:  # Note: [Megatron's block]
        mlp += gelu_new_bytes_per_element(act_bytes=e, autocast=autocast) * s * b * f
    if spec.is_moe:
        k = spec.experts_per_token
        # Each token visits k experts: k copies of the dispatched input (kept by the experts'
        # first matmul for its weight's gradient: not when the experts are frozen), k expert
        # MLPs, k expert outputs (the routing weight's multiply keeps each for the weight's
        # gradient: the weights come from the router, which the hidden states' gradient
        # reaches, frozen or not), and the router's fp32 probabilities (softmax over experts).
        # Checked with saved_tensors_hooks on real bf16 Mixtral and Qwen3-MoE blocks
        # (transformers 5, grouped_mm experts), trained and frozen.
        dispatched = k * e * sbh if _keeps(trainable, "gate", "up") else 0
        mlp = k * mlp + dispatched + k * e * sbh + 4 * s * b * spec.num_experts
    return mlp


def layer_terms(spec: TransformerSpec, *, seq: int, batch: int, act_bytes: int,
                attention: str, trainable: frozenset[str] | None = None,
                lora_rank: int = 0, residual_bytes: int | None = None,
                autocast: bool = False, megatron: bool = False) -> LayerTerms:
    """Bytes one block saves for backward (Korthikanti §4.1, term by term).

    ``trainable``: the linear roles whose weights get gradients (None: all). Autograd keeps a
    linear layer's input only when its weight needs a gradient (``mm`` saves ``self`` for
    ``mat2``'s gradient), so a frozen base (LoRA) does not keep the inputs of untargeted
    projections; a LoRA adapter on a projection keeps that input (for A's gradient) and its
    rank-r intermediate (for B's gradient).

    ``residual_bytes``: width of the residual stream that the norms read (default
    ``act_bytes``). Under PyTorch autocast it is 4: embeddings and residual adds run in fp32.

    ``autocast``: the step runs under CUDA autocast (fp16-/bf16-mixed), which keeps eager
    attention's softmax output in fp32 (Note: [eager scores under autocast]) and one 16-bit
    input per separate projection (Note: [projection inputs under autocast]).

    ``megatron``: the block is Megatron-LM's own (Note: [Megatron's block]): fused bias-GeLU.
    """
    s, b, e, h = seq, batch, act_bytes, spec.hidden_size
    replicated = _replicated_bytes(spec, sbh=s * b * h, e=e, trainable=trainable,
                                   residual_bytes=residual_bytes or e, autocast=autocast)
    split, scores = _attention_bytes(spec, s=s, b=b, e=e, attention=attention,
                                     trainable=trainable, autocast=autocast)
    split += _mlp_bytes(spec, s=s, b=b, e=e, trainable=trainable, autocast=autocast,
                        megatron=megatron)
    if trainable is not None and lora_rank:
        # each adapter keeps its rank-r intermediate x·A for B's gradient
        split += sum(e * s * b * lora_rank * shape.count for shape in spec.linear_shapes()
                     if shape.role in trainable)
    return LayerTerms(replicated=replicated, split=split, attention_scores=scores)
