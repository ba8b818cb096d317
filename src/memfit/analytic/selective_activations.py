"""What one block keeps under op-level selective activation checkpointing (SAVE_OPS), and what
recomputing it in backward brings back (Note: [op-level selective checkpointing])."""

from __future__ import annotations

from dataclasses import dataclass

from memfit.analytic.block_activations import LSE_BYTES
from memfit.models.spec import TransformerSpec

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

