"""Activation memory of a transformer step, adapted from Korthikanti et al. 2022.

"Reducing Activation Recomputation in Large Transformer Models" (arXiv 2205.05198, §4) counts
the bytes a GPT block saves for backward with 16-bit activations: sbh(34 + 5as/h) without
parallelism, sbh(10 + 24/t + 5as/(ht)) with tensor parallelism t, (sbh/t)(34 + 5as/h) with
sequence parallelism, 34sbh/t with selective recompute, and 2sbh (the block input) with full
recompute. Here the same accounting is done term by term (one block's terms in
``block_activations.py``; this module adds the inputs, the head and the loss, checkpointing,
pipeline stages and the moment of the peak), so that it holds for each architecture's real
shapes: any activation width e (2 bytes for 16-bit, 4 for fp32), GQA (fewer K/V heads),
SwiGLU/GeGLU MLPs (four f-wide tensors instead of two), MoE (each token runs through k experts),
extra norms (Gemma-2) and no dropout (modern LLMs train without it, so no masks). For a
GPT-2-shaped block with dropout, e = 2 and eager attention the terms add up to exactly
Korthikanti's 34sbh + 5as²b (a test checks this). Under autocast the attention scores cost more
than Korthikanti's 5 bytes per element (Note: [eager scores under autocast]), and separate
projections keep one 16-bit input each (Note: [projection inputs under autocast]).

``selective`` is op-level selective activation checkpointing as ``memfit.techniques`` applies
it (Note: [op-level selective checkpointing] in ``selective_activations.py``), ``torchtitan``
torchtitan's op-level policy (Note: [torchtitan's policy in the formulas]); Korthikanti's
score-only recompute is ``selective-attn``.

``chunked_loss`` sizes memfit's chunked cross-entropy (Note: [chunked loss in the formulas]) and
``offload_activations`` its activation offload (Note: [activation offload in the formulas]).

Known limitations: the logits/loss terms assume Hugging Face's loss (logits upcast to fp32 then
log-softmax), or memfit's chunked loss on its PyTorch path (Liger's fused kernel, which it uses
on CUDA when installed, needs less). Kernel workspaces are not counted. Activation offload's
host bytes are not added to the plan's host memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from memfit.analytic.block_activations import (
    MASK_BYTES,
    LayerTerms,
    layer_terms,
    norm_saved_bytes,
)
from memfit.analytic.config import RunConfig
from memfit.analytic.selective_activations import selective_layer_bytes
from memfit.dtypes import nbytes
from memfit.errors import MemfitError
from memfit.models.spec import TransformerSpec

INDEX_BYTES = 8  # token ids and labels are int64
CHUNKED_LOSS_TOKENS = 1024
"""Tokens per chunk of memfit's chunked loss (``apply_chunked_loss``'s default chunk_size)."""

# Note: [chunked loss in the formulas] memfit/techniques/loss.py: _ChunkedCrossEntropy keeps, of
# the loss, only its inputs (the head input, and the shifted int64 labels) and one fp32
# log-sum-exp per token, not the [tokens, vocab] fp32 log-softmax. Its forward holds one chunk
# of c = min(CHUNKED_LOSS_TOKENS, tokens) rows at a time: the 16-bit logits and their fp32 copy
# ((e + 4) c V). Its backward allocates the head input's gradient (e s b h) and, when the head is
# trained, an fp32 weight-gradient accumulator (4 V h) beside each chunk's fp32 product
# grad.t() @ h.float() (4 V h, and the 4 c h fp32 copy of the chunk's input), with the chunk's
# fp32 logits gradient and its 16-bit cast ((4 + e) c V). The 16-bit gradient it returns is the
# head's gradient (model states). Vocabulary-parallel heads (tp > 1) are not sized chunked.

# Note: [activation offload in the formulas] memfit/techniques/offload.py moves every tensor
# autograd saves to host memory in the forward and brings each back when backward needs it,
# prefetching the one saved before it. On the device, at every moment of backward: the saved
# tensors of the block being back-propagated and of the one being prefetched (an upper bound on
# "one tensor ahead": two blocks' worth), and at the loss the head's and loss's saved tensors,
# which backward needs first. A checkpointed block saves nothing through autograd (its inputs
# and kept outputs stay in the checkpoint's own storage, Note: [offload after checkpointing]),
# so under checkpointing only the inputs before the first block leave the device.


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
                 residual_bytes: int | None = None, trained: bool = True,
                 chunked: bool = False) -> int:
    """Saved bytes after the last block: final norm, head input and the loss's log-softmax.

    The logits themselves are not kept: HF upcasts them to fp32 and cross-entropy keeps only
    its log-softmax output, so the 16-bit logits and the fp32 copy are transient (counted as
    temporaries). ``chunked``: memfit's chunked loss keeps the head input (frozen head too),
    the shifted labels and one fp32 log-sum-exp per token instead of the log-softmax (Note:
    [chunked loss in the formulas])."""
    s, b, e, h = seq, batch, act_bytes, spec.hidden_size
    r = residual_bytes or e
    if spec.arch == "vision":
        return r * s * b * h + e * b * h  # final norm input, classifier input (class token)
    if spec.arch == "encoder":
        return e * b * h if spec.pooler else 0
    total = norm_saved_bytes(spec, residual_bytes=r, trained=trained) * s * b * h
    if chunked:
        return total + e * s * b * h + (INDEX_BYTES + 4) * s * b
    if trained:
        total += e * s * b * h  # LM head input, for the head's weight gradient
    vocab = -(-spec.vocab_size // tp)  # vocab-parallel head under tensor parallelism
    return total + 4 * s * b * vocab  # cross-entropy keeps its fp32 log-softmax output


def _checkpointed_block(spec: TransformerSpec, run: RunConfig, terms: LayerTerms,
                        per_layer: int, *, seq: int, act_bytes: int, residual: int,
                        lora: bool) -> tuple[int, int, list[str]]:
    """Under ``run.checkpointing``: what each block keeps until its backward, what recomputing
    one block in backward brings back (once, whatever the micro-batches in flight), and the
    notes."""
    s, b, e, h = seq, run.batch, act_bytes, spec.hidden_size
    notes: list[str] = []
    if run.checkpointing == "full":
        # Only each block's input is kept (Korthikanti's 2sbh); during backward one block is
        # recomputed, so its full activations exist once.
        block_input = residual * s * b * h
        if run.parallel.sp:
            block_input = -(-block_input // run.parallel.tp)
        return block_input, per_layer, notes
    if run.checkpointing in ("selective", "torchtitan"):
        sel = selective_layer_bytes(spec, seq=s, batch=b, act_bytes=e, attention=run.attention,
                                    residual_bytes=residual, per_layer=per_layer,
                                    tp=run.parallel.tp,
                                    sequence_parallel=run.parallel.sp,
                                    lora_targets=run.lora_targets if lora else None,
                                    lora_rank=run.lora_rank if lora else 0,
                                    every_second_mm=run.checkpointing == "torchtitan")
        if lora and sel.saved > per_layer:
            notes.append("op-level selective checkpointing keeps every matmul output, the frozen "
                         "base's too, which a LoRA step without checkpointing does not keep: "
                         "here it holds more than --checkpointing none")
        return sel.saved, sel.recompute, notes
    if run.checkpointing == "selective-attn":
        # Korthikanti et al.'s selective recompute: only the attention scores are recomputed
        # (nothing to drop when a fused kernel keeps no scores)
        scores = -(-terms.attention_scores // run.parallel.tp)
        if not scores:
            notes.append("selective-attn recomputes only the attention scores, which fused "
                         "attention (sdpa/flash) does not keep: the same as no checkpointing; "
                         "--checkpointing selective is op-level selective checkpointing")
        return per_layer - scores, scores, notes
    return per_layer, 0, notes


def _transients(spec: TransformerSpec, run: RunConfig, terms: LayerTerms, *, seq: int,
                act_bytes: int, last: bool) -> tuple[int, int, int]:
    """The largest transients of the step's moments: the gradient of the logits at the loss,
    the gradients of a block's wide tensors in its backward, and the logits at the end of
    forward."""
    s, b, e, h = seq, run.batch, act_bytes, spec.hidden_size
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
    if vocab and run.chunked_loss:  # Note: [chunked loss in the formulas]
        c = min(CHUNKED_LOSS_TOKENS, s * b)
        trained_head = run.mode == "train"
        loss_grad = ((4 + e) * c * vocab + e * s * b * h
                     + ((4 + 4) * vocab * h + 4 * c * h if trained_head else 0))
    f_local = -(-spec.intermediate_size // run.parallel.tp)
    block_grad = 2 * e * s * b * f_local + 2 * e * s * b * h
    if run.attention == "eager":
        block_grad += -(-terms.attention_scores // run.parallel.tp)
    # At the end of forward (the loss is computed inside the model's forward): the 16-bit logits
    # and their fp32 copy.
    logits_forward = (e + 4 if e != 4 else 4) * s * b * vocab
    if run.layout == "megatron":
        logits_forward = e * s * b * vocab  # the fp32 copy is the exp(logits) it saves
    if vocab and run.chunked_loss:
        logits_forward = (e + 4) * min(CHUNKED_LOSS_TOKENS, s * b) * vocab
    return loss_grad, block_grad, logits_forward


def _weight_casts(spec: TransformerSpec, run: RunConfig, *, act_bytes: int, lora: bool,
                  last: bool) -> tuple[int, int]:
    """The 16-bit copies autocast makes of one block's trained weights, and of the LM head's
    (Note: [autocast weight casts])."""
    # Note: [autocast weight casts] Under torch.autocast with fp32 parameters (plain PyTorch,
    # engine ddp), each linear layer casts its fp32 weight to 16-bit; the cast of a leaf that
    # requires grad is cached until autocast exits (aten/src/ATen/autocast_mode.cpp: cached_cast)
    # and mm keeps it for the input's gradient, so every trained weight has a 16-bit copy at the
    # loss. In backward, without checkpointing each copy lives until its layer's backward; a
    # checkpointed block makes its copies again only while it is recomputed. (The ZeRO paper's
    # layout counts these 16-bit copies as the weights themselves.)
    e = act_bytes
    casts_per_layer = casts_head = 0
    if run.autocast and run.layout == "ddp":
        targets = run.lora_targets if lora else None
        casts_per_layer = e * sum(
            (run.lora_rank * (sh.in_features + sh.out_features) if lora
             else sh.in_features * sh.out_features) * sh.count
            for sh in spec.linear_shapes() if targets is None or sh.role in targets)
        casts_per_layer = -(-casts_per_layer // run.parallel.tp)
        if last and not lora and spec.arch == "decoder":
            casts_head = e * -(-spec.vocab_size * spec.hidden_size // run.parallel.tp)
    return casts_per_layer, casts_head


def training_activations(spec: TransformerSpec, run: RunConfig, seq: int,
                         stage: int = 0, engine: Mapping[str, int] | None = None) -> Activations:
    """Saved activations on one pipeline stage plus the largest backward temporary.

    ``engine``: the engine's buffer bytes (not returned here) by moment (``loss``, ``block``,
    ``backward start``, ``forward start``, ``forward end``: see ``Activations.moment``); they
    only decide which moment is the peak (FSDP2 holds different buffers at each:
    engine_buffers.py: fsdp2_buffers). The last three are moments only such an engine has."""
    e = nbytes(1, run.compute_format)
    s, b = seq, run.batch
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
                        autocast=run.autocast, megatron=run.layout == "megatron")
    per_layer = terms.per_gpu(run.parallel.tp, run.parallel.sp)
    layers = -(-spec.num_layers // run.parallel.pp)

    # kept: what every block keeps until its backward; recompute: what recomputing one block in
    # backward brings back (once, whatever the micro-batches in flight)
    block_kept, recompute, notes = _checkpointed_block(
        spec, run, terms, per_layer, seq=s, act_bytes=e, residual=residual, lora=lora)
    kept = layers * block_kept

    # 1F1B: stage i holds activations of min(pp - i, micro-batches) micro-batches at once.
    in_flight = min(run.parallel.pp - stage, run.grad_accum)
    if run.parallel.pp > 1:
        notes.append(f"pipeline 1F1B: stage {stage} holds {in_flight} micro-batches in flight")
    first, last = stage == 0, stage == run.parallel.pp - 1
    held = in_flight * kept
    if first:
        held += in_flight * input_terms(spec, seq=s, batch=b, act_bytes=e)
    checkpointed = run.checkpointing in ("selective", "torchtitan", "full")
    if run.offload_activations:  # Note: [activation offload in the formulas]
        held = in_flight * kept if checkpointed else min(held, 2 * block_kept)
        kept = held // max(in_flight * layers, 1)
        notes.append("activation offload: saved tensors in host memory, "
                     + ("the checkpointed blocks' kept tensors stay on the device"
                        if checkpointed else "two blocks' on the device"))
    chunked = run.chunked_loss and spec.arch == "decoder" and last
    if run.chunked_loss and run.parallel.tp > 1:
        raise MemfitError("the chunked loss is sized for a whole LM head (tp 1): "
                          "drop chunked_loss or tensor parallelism")
    outputs = output_terms(spec, seq=s, batch=b, act_bytes=e, tp=run.parallel.tp,
                           residual_bytes=norm_input, trained=not lora,
                           chunked=chunked) if last else 0

    loss_grad, block_grad, logits_forward = _transients(spec, run, terms, seq=s, act_bytes=e,
                                                        last=last)
    # Two moments of backward compete for the peak: at the loss (the head's saved tensors and
    # the logits' gradient) and in the last block's backward (the head's tensors are freed by
    # then; the recomputed block and its gradients exist).
    casts_per_layer, casts_head = _weight_casts(spec, run, act_bytes=e, lora=lora, last=last)
    casts = layers * casts_per_layer + casts_head
    # A third moment, the end of forward (the loss is computed inside the model's forward): the
    # 16-bit logits and their fp32 copy, and the weight casts still in autocast's cache, which a
    # checkpointed block does not keep for backward.
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
