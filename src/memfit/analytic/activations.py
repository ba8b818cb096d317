"""Activation memory of a transformer step, adapted from Korthikanti et al. 2022.

"Reducing Activation Recomputation in Large Transformer Models" (arXiv 2205.05198, §4) counts
the bytes a GPT block saves for backward with 16-bit activations: sbh(34 + 5as/h) without
parallelism, sbh(10 + 24/t + 5as/(ht)) with tensor parallelism t, (sbh/t)(34 + 5as/h) with
sequence parallelism, 34sbh/t with selective recompute, and 2sbh (the block input) with full
recompute. Here the same accounting is done term by term, so that it holds for each
architecture's real shapes: any activation width e (2 bytes for 16-bit, 4 for fp32), GQA (fewer
K/V heads), SwiGLU/GeGLU MLPs (four f-wide tensors instead of two), MoE (each token runs through
k experts), extra norms (Gemma-2) and no dropout (modern LLMs train without it, so no masks).
For a GPT-2-shaped block with dropout, e = 2 and eager attention the terms add up to exactly
Korthikanti's 34sbh + 5as²b (a test checks this). Under autocast the attention scores cost more
than Korthikanti's 5 bytes per element (Note: [eager scores under autocast]), and separate
projections keep one 16-bit input each (Note: [projection inputs under autocast]).

``selective`` is op-level selective activation checkpointing as ``memfit.techniques`` applies
it (Note: [op-level selective checkpointing]); Korthikanti's score-only recompute is
``selective-attn``.

Known limitations: the logits/loss terms assume Hugging Face's loss (logits upcast to fp32 then
log-softmax); fused/chunked losses (Liger) need far less. Kernel workspaces are not counted.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from memfit.analytic.config import RunConfig
from memfit.dtypes import nbytes
from memfit.models.spec import TransformerSpec

MASK_BYTES = 1  # dropout masks are torch.bool
LSE_BYTES = 4  # fused attention saves a fp32 logsumexp per query row and head
INDEX_BYTES = 8  # token ids and labels are int64
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
# fused kernel (nn.functional.gelu, silu) that keeps only its input.
PYTHON_GELU_FAMILIES = frozenset({"gpt2"})
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


def layer_terms(spec: TransformerSpec, *, seq: int, batch: int, act_bytes: int,
                attention: str, trainable: frozenset[str] | None = None,
                lora_rank: int = 0, residual_bytes: int | None = None,
                autocast: bool = False) -> LayerTerms:
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
    """
    s, b, e, h = seq, batch, act_bytes, spec.hidden_size

    def keeps(*roles: str) -> bool:
        return trainable is None or any(r in trainable for r in roles)

    sbh = s * b * h
    hidden_dropout = spec.dropout > 0
    attn_dropout = spec.attention_dropout > 0 and attention == "eager"

    replicated = spec.norms_per_layer * norm_saved_bytes(
        spec, residual_bytes=residual_bytes or e, trained=trainable is None) * sbh

    def input_copies(roles: tuple[str, ...], fused: bool) -> int:
        """Copies of a norm output that the projections reading it keep (see the note)."""
        kept = [r for r in roles if keeps(r)]
        if not kept:
            return 0
        return len(kept) if autocast and not fused else 1

    # inputs of the Q/K/V projections (the norm's output)
    replicated += input_copies(("q", "k", "v"), spec.family in FUSED_QKV_FAMILIES) * e * sbh
    # input of the MLP's first projection(s); a GeLU MLP and an MoE router have one
    gated_separately = (spec.mlp != "gelu" and not spec.is_moe
                        and spec.family not in FUSED_GATE_UP_FAMILIES)
    replicated += input_copies(("gate", "up"), not gated_separately) * e * sbh
    if hidden_dropout:
        replicated += 2 * MASK_BYTES * sbh  # residual dropout masks after attention and MLP

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
    if keeps("o") or attention != "eager":
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

    f = spec.intermediate_size
    # GeLU MLP keeps the GeLU input and the second projection's input (Korthikanti's 16sbh);
    # a gated MLP keeps the gate and up outputs, act(gate) and the product: 4 f-wide tensors.
    wide = 2 if spec.mlp == "gelu" else 4
    if not keeps("down"):
        wide -= 1  # the down projection's input (GeLU output / gated product) is not kept
    mlp = wide * e * s * b * f
    if spec.family in PYTHON_GELU_FAMILIES:
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
        dispatched = k * e * sbh if keeps("gate", "up") else 0
        mlp = k * mlp + dispatched + k * e * sbh + 4 * s * b * spec.num_experts
    split += mlp
    if trainable is not None and lora_rank:
        # each adapter keeps its rank-r intermediate x·A for B's gradient
        split += sum(e * s * b * lora_rank * shape.count for shape in spec.linear_shapes()
                     if shape.role in trainable)
    return LayerTerms(replicated=replicated, split=split, attention_scores=scores)


# Note: [op-level selective checkpointing]
# memfit.techniques.checkpointing wraps each block in torch.utils.checkpoint.checkpoint with a
# context_fn from create_selective_checkpoint_contexts whose policy is MUST_SAVE for the ops in
# its SAVE_OPS (mm, addmm, bmm, baddbmm, the SDPA kernels, convolution) and PREFER_RECOMPUTE for
# every other op. In forward, the checkpoint's saved-tensor hooks drop what autograd saves, and
# torch/utils/checkpoint.py's _CachingTorchDispatchMode stores the outputs of every MUST_SAVE op
# (whether or not backward needs them); the block's input is kept for the recompute. So a block
# keeps, from first principles:
#   its input (the residual stream, e_r bytes per token x hidden);
#   every projection's matmul output (q, k, v, o; gate, up, down or fc, proj; each LoRA
#   adapter's x.A (rank r) and (x.A).B (the layer's output width); an MoE router's logits and
#   each of the k experts' matmuls), e bytes per element (autocast's matmul output dtype);
#   attention: the fused kernel's output (e bytes per q element) and its fp32 logsumexp, or, in
#   eager attention, the two bmm outputs: QK^T (a x s x s) and softmax(.)V.
# Norms, activations, RoPE, residual adds, casts and dropout masks are recomputed. During
# backward one block at a time is recomputed: its tensors that are not already cached come back
# (see selective_layer_bytes: ``recompute``).


@dataclass(frozen=True, kw_only=True)
class SelectiveTerms:
    """Bytes one block keeps under op-level selective checkpointing, per GPU."""

    saved: int
    """The block input and its matmul/attention outputs (Note: [op-level selective
    checkpointing])."""
    recompute: int
    """What recomputing one block in backward brings back beyond ``saved``."""


def selective_layer_bytes(spec: TransformerSpec, *, seq: int, batch: int, act_bytes: int,
                          attention: str, residual_bytes: int, per_layer: int, tp: int = 1,
                          sequence_parallel: bool = False,
                          lora_targets: tuple[str, ...] | None = None,
                          lora_rank: int = 0) -> SelectiveTerms:
    """Saved bytes of one block under ``memfit.techniques``' selective policy (SAVE_OPS), from
    the shapes: see Note: [op-level selective checkpointing]. ``per_layer``: what the block
    saves without checkpointing on this GPU (bounds the recompute transient).

    Tensor parallelism divides the column-parallel outputs (q, k, v, gate, up, attention); the
    row-parallel ones (o, down) are full-width partial sums on every GPU.

    >>> from memfit.models import get_preset
    >>> t = selective_layer_bytes(get_preset("gpt2"), seq=1, batch=1, act_bytes=2,
    ...                           attention="sdpa", residual_bytes=2, per_layer=0)
    >>> t.saved == 2 * 768 + 2 * (3 * 768 + 768 + 3072 + 768) + 2 * 768 + 4 * 12
    True
    """
    s, b, e, h = seq, batch, act_bytes, spec.hidden_size
    sb = s * b
    block_input = residual_bytes * sb * h
    if sequence_parallel:
        block_input = -(-block_input // tp)
    split = e * sb * (spec.q_dim + 2 * spec.kv_dim)  # q, k, v projections
    full = e * sb * h  # o projection (row-parallel: full width per GPU)
    if attention == "eager":
        split += e * spec.num_heads * s * s * b  # QK^T (bmm)
        split += e * sb * spec.q_dim  # softmax(QK^T) V (bmm)
    else:
        split += e * sb * spec.q_dim + LSE_BYTES * spec.num_heads * sb  # output + logsumexp
    f = spec.intermediate_size
    wide = 1 if spec.mlp == "gelu" else 2  # fc; or gate and up
    if spec.is_moe:
        # The router's logits are an mm output. Transformers 5 runs the experts' matmuls as
        # one aten._grouped_mm each (transformers/integrations/moe.py), which is not in
        # SAVE_OPS: PREFER_RECOMPUTE, so no expert output is kept (and the backward recomputes
        # them with the rest of the block: they are in ``per_layer``).
        split += e * sb * spec.num_experts
    else:
        split += wide * e * sb * f
        full += e * sb * h  # down / second projection
    if lora_targets is not None and lora_rank:
        for shape in spec.linear_shapes():
            if shape.role in lora_targets:
                # x.A (rank r) and (x.A).B (the layer's output width), both mm outputs
                split += e * sb * (lora_rank + shape.out_features) * shape.count
    saved = block_input + -(-split // tp) + full
    # Recomputing a block brings back what its backward needs; the SDPA output and logsumexp
    # and the MLP's wide matmul outputs (GeLU's input; SiLU's and the product's inputs) are the
    # cached tensors themselves, so they do not come twice.
    cached_in_use = 0 if spec.is_moe else wide * e * sb * f
    if attention != "eager":
        cached_in_use += e * sb * spec.q_dim + LSE_BYTES * spec.num_heads * sb
    recompute = max(0, per_layer - -(-cached_in_use // tp))
    return SelectiveTerms(saved=saved, recompute=recompute)


@dataclass(frozen=True, kw_only=True)
class Activations:
    """Activation and temporary bytes per GPU at the backward peak."""

    activations: int
    temporaries: int
    per_layer: int
    """One block's saved bytes on this GPU, without recompute."""
    notes: tuple[str, ...] = ()
    moment: str = "loss"
    """When the peak is: ``loss`` (at the loss, end of forward or start of backward: the head's
    tensors and the logits or their gradient), ``block`` (the last block's backward, the head
    freed), or, for an engine that gathers parameters as it goes, ``forward start`` / ``forward
    end`` (its all-gather of the first / last block) and ``backward start`` (the root's
    all-gather again, before the loss's backward)."""


def input_terms(spec: TransformerSpec, *, seq: int, batch: int, act_bytes: int) -> int:
    """Saved bytes before the first block: the batch itself and the embedding's outputs."""
    s, b, e, h = seq, batch, act_bytes, spec.hidden_size
    if spec.arch == "vision":
        return 4 * b * spec.num_channels * spec.image_size**2  # fp32 pixels
    total = INDEX_BYTES * s * b  # input ids
    if spec.arch == "decoder":
        total += INDEX_BYTES * s * b  # labels
    if spec.dropout > 0:
        total += MASK_BYTES * s * b * h  # embedding dropout
    if spec.arch == "encoder":
        total += e * s * b * h  # embedding LayerNorm input
    return total


def output_terms(spec: TransformerSpec, *, seq: int, batch: int, act_bytes: int, tp: int,
                 residual_bytes: int | None = None, trained: bool = True) -> int:
    """Saved bytes after the last block: final norm, head input and the loss's log-softmax.

    The logits themselves are not kept: HF upcasts them to fp32 and cross-entropy keeps only
    its log-softmax output, so the 16-bit logits and the fp32 copy are transient (counted as
    temporaries)."""
    s, b, e, h = seq, batch, act_bytes, spec.hidden_size
    r = residual_bytes or e
    if spec.arch == "vision":
        return r * s * b * h + e * b * h  # final norm input, classifier input (class token)
    if spec.arch == "encoder":
        return e * b * h if spec.pooler else 0
    total = norm_saved_bytes(spec, residual_bytes=r, trained=trained) * s * b * h
    if trained:
        total += e * s * b * h  # LM head input, for the head's weight gradient
    vocab = -(-spec.vocab_size // tp)  # vocab-parallel head under tensor parallelism
    return total + 4 * s * b * vocab  # cross-entropy keeps its fp32 log-softmax output


def training_activations(spec: TransformerSpec, run: RunConfig, seq: int,
                         stage: int = 0, engine: Mapping[str, int] | None = None) -> Activations:
    """Saved activations on one pipeline stage plus the largest backward temporary.

    ``engine``: the engine's buffer bytes (not returned here) by moment (``loss``, ``block``,
    ``backward start``, ``forward start``, ``forward end``: see ``Activations.moment``); they
    only decide which moment is the peak (FSDP2 holds different buffers at each:
    engine_buffers.py: fsdp2_buffers). The last three are moments only such an engine has."""
    e = nbytes(1, run.compute_format)
    s, b, h = seq, run.batch, spec.hidden_size
    lora = run.mode in ("lora", "qlora")
    # Under autocast the residual stream stays fp32 (fp32 embeddings and residual adds); the
    # engines that cast the model to 16-bit (FSDP2's MixedPrecisionPolicy, DeepSpeed, Megatron)
    # keep it in 16-bit (RunConfig.autocast), and so does a LoRA/QLoRA step under autocast:
    # its frozen base is 16-bit (model_states.py counts it so), embeddings included, so the
    # residual adds stay 16-bit.
    residual = 4 if run.autocast and not lora else e
    # what a norm reads: LayerNorm is on CUDA autocast's fp32 list (aten/src/ATen/
    # autocast_mode.cpp: KERNEL_CUDA(layer_norm, fp32)), so it keeps an fp32 copy of a 16-bit
    # input; Hugging Face's RMSNorm upcasts by itself (norm_saved_bytes)
    norm_input = 4 if run.autocast and spec.norm == "layernorm" else residual
    terms = layer_terms(spec, seq=s, batch=b, act_bytes=e, attention=run.attention,
                        trainable=frozenset(run.lora_targets) if lora else None,
                        lora_rank=run.lora_rank if lora else 0, residual_bytes=norm_input,
                        autocast=run.autocast)
    per_layer = terms.per_gpu(run.parallel.tp, run.parallel.sp)
    layers = -(-spec.num_layers // run.parallel.pp)
    notes: list[str] = []

    # kept: what every block keeps until its backward; recompute: what recomputing one block in
    # backward brings back (once, whatever the micro-batches in flight)
    if run.checkpointing == "full":
        # Only each block's input is kept (Korthikanti's 2sbh); during backward one block is
        # recomputed, so its full activations exist once.
        block_input = residual * s * b * h
        if run.parallel.sp:
            block_input = -(-block_input // run.parallel.tp)
        kept, recompute = layers * block_input, per_layer
    elif run.checkpointing == "selective":
        sel = selective_layer_bytes(spec, seq=s, batch=b, act_bytes=e, attention=run.attention,
                                    residual_bytes=residual, per_layer=per_layer,
                                    tp=run.parallel.tp,
                                    sequence_parallel=run.parallel.sp,
                                    lora_targets=run.lora_targets if lora else None,
                                    lora_rank=run.lora_rank if lora else 0)
        kept, recompute = layers * sel.saved, sel.recompute
        if lora and sel.saved > per_layer:
            notes.append("op-level selective checkpointing keeps every matmul output, the frozen "
                         "base's too, which a LoRA step without checkpointing does not keep: "
                         "here it holds more than --checkpointing none")
    elif run.checkpointing == "selective-attn":
        # Korthikanti et al.'s selective recompute: only the attention scores are recomputed
        # (nothing to drop when a fused kernel keeps no scores)
        scores = -(-terms.attention_scores // run.parallel.tp)
        kept, recompute = layers * (per_layer - scores), scores
        if not scores:
            notes.append("selective-attn recomputes only the attention scores, which fused "
                         "attention (sdpa/flash) does not keep: the same as no checkpointing; "
                         "--checkpointing selective is op-level selective checkpointing")
    else:
        kept, recompute = layers * per_layer, 0

    # 1F1B: stage i holds activations of min(pp - i, micro-batches) micro-batches at once.
    in_flight = min(run.parallel.pp - stage, run.grad_accum)
    if run.parallel.pp > 1:
        notes.append(f"pipeline 1F1B: stage {stage} holds {in_flight} micro-batches in flight")
    first, last = stage == 0, stage == run.parallel.pp - 1
    held = in_flight * kept
    if first:
        held += in_flight * input_terms(spec, seq=s, batch=b, act_bytes=e)
    outputs = output_terms(spec, seq=s, batch=b, act_bytes=e, tp=run.parallel.tp,
                           residual_bytes=norm_input, trained=not lora) if last else 0

    # Largest transient in backward: at the loss, two logits-sized fp32 tensors: the gradient
    # nll_loss_backward returns and the one _log_softmax_backward_data makes from it (both alive
    # during the latter); inside a block, the gradients of the MLP's wide tensors.
    vocab = -(-spec.vocab_size // run.parallel.tp) if spec.arch == "decoder" and last else 0
    loss_grad = (4 + 4) * s * b * vocab
    if run.layout == "megatron":
        # Megatron's vocab-parallel cross-entropy (megatron/core/tensor_parallel/cross_entropy.py:
        # _VocabParallelCrossEntropy) keeps exp(logits) in fp32 (the same 4 bytes per local logit
        # as the log-softmax in output_terms) and its backward turns that saved tensor into the
        # gradient in place: only the 16-bit cast back to the logits' dtype is new.
        loss_grad = e * s * b * vocab
    f_local = -(-spec.intermediate_size // run.parallel.tp)
    block_grad = 2 * e * s * b * f_local + 2 * e * s * b * h
    if run.attention == "eager":
        block_grad += -(-terms.attention_scores // run.parallel.tp)
    # Two moments of backward compete for the peak: at the loss (the head's saved tensors and
    # the logits' gradient) and in the last block's backward (the head's tensors are freed by
    # then; the recomputed block and its gradients exist).
    # Note: [autocast weight casts] Under torch.autocast with fp32 parameters (plain PyTorch,
    # engine ddp), each linear layer casts its fp32 weight to 16-bit; the cast of a leaf that
    # requires grad is cached until autocast exits (aten/src/ATen/autocast_mode.cpp: cached_cast)
    # and mm keeps it for the input's gradient, so every trained weight has a 16-bit copy at the
    # loss. In backward, without checkpointing each copy lives until its layer's backward; a
    # checkpointed block makes its copies again only while it is recomputed. (The ZeRO paper's
    # layout counts these 16-bit copies as the weights themselves.)
    casts_per_layer = casts_head = 0
    if run.autocast and run.layout == "ddp":
        targets = run.lora_targets if lora else None
        casts_per_layer = e * sum(
            (run.lora_rank * (sh.in_features + sh.out_features) if lora
             else sh.in_features * sh.out_features) * sh.count
            for sh in spec.linear_shapes() if targets is None or sh.role in targets)
        casts_per_layer = -(-casts_per_layer // run.parallel.tp)
        if last and not lora and spec.arch == "decoder":
            casts_head = e * -(-spec.vocab_size * h // run.parallel.tp)
    checkpointed = run.checkpointing in ("selective", "full")
    casts = layers * casts_per_layer + casts_head
    # A third moment, the end of forward (the loss is computed inside the model's forward): the
    # 16-bit logits and their fp32 copy, and the weight casts still in autocast's cache, which a
    # checkpointed block does not keep for backward.
    logits_forward = (e + 4 if e != 4 else 4) * s * b * vocab
    if run.layout == "megatron":
        logits_forward = e * s * b * vocab  # the fp32 copy is the exp(logits) it saves
    at_forward = (held + outputs, logits_forward + casts) if checkpointed else (0, 0)
    at_loss = (held + outputs + (0 if checkpointed else casts), loss_grad)
    at_block = (held + recompute + casts_per_layer * (1 if checkpointed else layers),
                block_grad)
    eng = dict(engine or {})
    candidates = {"loss": (*at_loss, eng.get("loss", 0)),
                  "forward": (*at_forward, eng.get("loss", 0) if checkpointed else 0),
                  "block": (*at_block, eng.get("block", 0))}
    if engine:
        # Moments of an engine that gathers parameters as it goes (FSDP2): the forward's
        # all-gather of its first block, with only the inputs saved, and of its last block, with
        # every earlier block's activations; the root's all-gather again at the start of
        # backward, with every activation and no logits yet
        candidates |= {
            "forward start": (held - in_flight * kept if first else held, 0,
                              eng.get("forward start", 0)),
            "forward end": (held - in_flight * kept // max(layers, 1), 0,
                            eng.get("forward end", 0)),
            "backward start": (at_loss[0], 0, eng.get("backward start", 0))}
    moment, (activations, temporaries, _) = max(candidates.items(), key=lambda kv: sum(kv[1]))
    moment = {"forward": "loss"}.get(moment, moment)
    return Activations(activations=activations, temporaries=temporaries, per_layer=per_layer,
                       notes=tuple(notes), moment=moment)


def inference_activations(spec: TransformerSpec, run: RunConfig, seq: int) -> Activations:
    """Prefill working set: nothing is saved for backward, so the peak is one block's transient
    tensors plus the logits of the last position (HF generate computes only those)."""
    e = nbytes(1, run.compute_format)
    s, b, h, tp = seq, run.batch, spec.hidden_size, run.parallel.tp
    residual = 2 * e * s * b * h  # residual stream + normed copy
    qkv = -(-e * s * b * (spec.q_dim + 2 * spec.kv_dim) // tp)
    attn_out = -(-e * s * b * spec.q_dim // tp)
    scores = -(-2 * e * spec.num_heads * s * s * b // tp) if run.attention == "eager" else 0
    f_local = -(-spec.intermediate_size // tp)
    wide = 2 if spec.mlp == "gelu" else 3
    k = spec.experts_per_token if spec.is_moe else 1
    mlp = wide * e * s * b * f_local * k
    block = residual + max(qkv + attn_out + scores, mlp)
    if spec.arch == "decoder":
        vocab = -(-spec.vocab_size // tp)
        head = (e + 4) * b * vocab  # last-position logits and their fp32 copy for sampling
    else:
        head = 0
    inputs = INDEX_BYTES * s * b if spec.arch != "vision" else (
        4 * b * spec.num_channels * spec.image_size**2)
    return Activations(activations=block + head + inputs, temporaries=0, per_layer=block)
