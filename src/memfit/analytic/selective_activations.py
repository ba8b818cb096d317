"""What one block keeps under op-level selective activation checkpointing (SAVE_OPS), and what
recomputing it in backward brings back (Note: [op-level selective checkpointing])."""

from __future__ import annotations

from dataclasses import dataclass

from memfit.analytic.block_activations import (
    FUSED_GATE_UP_FAMILIES,
    FUSED_QKV_FAMILIES,
    LSE_BYTES,
)
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


# Note: [torchtitan's policy in the formulas] torchtitan's op-level policy (memfit.techniques'
# ``torchtitan``; Note: [torchtitan's op-level policy] in techniques/checkpointing.py) keeps the
# same block input and attention kernel output, and of the matmuls only aten.mm's, the 1st, 3rd,
# 5th, ... of the block's forward: in a Llama block q, v, gate and down are kept, k, o and up
# recomputed. A projection with a bias runs aten.addmm (torch's linear: addmm for a bias,
# matmul -> mm without; GPT-2's Conv1D always addmm), which torchtitan's list does not hold:
# neither kept nor counted. Eager attention's bmm outputs are not in its list either. A LoRA
# adapter's two mms (x.A, then (x.A).B) run after its base projection's, and count.


@dataclass(frozen=True)
class _Matmul:
    """One matmul output of a block's forward, in order."""

    nbytes: int
    split: bool  # column-parallel (tensor parallelism divides it) or a full-width partial sum
    mm: bool  # aten.mm (no bias); addmm otherwise
    mlp_input_side: bool = False  # the MLP's first projection(s): backward reads them too


def _block_matmuls(spec: TransformerSpec, *, sb: int, e: int,
                   lora_targets: tuple[str, ...] | None, lora_rank: int) -> list[_Matmul]:
    """The matmul outputs of one block's forward, in the order they run (fused projections as
    one; an MoE layer's router only: its experts run aten._grouped_mm)."""
    out: list[_Matmul] = []
    shapes = {sh.role: sh for sh in spec.linear_shapes()}

    def adapters(*roles: str) -> None:
        for role in roles:
            if lora_targets is not None and lora_rank and role in lora_targets and role in shapes:
                # x.A (rank r) and (x.A).B (the layer's output width), both mm outputs
                count = shapes[role].count
                out.append(_Matmul(e * sb * lora_rank * count, True, True))
                out.append(_Matmul(e * sb * shapes[role].out_features * count, True, True))

    def add(role: str, width: int, *, split: bool, bias: bool, mlp_in: bool = False) -> None:
        out.append(_Matmul(e * sb * width, split, not bias, mlp_in))
        adapters(role)

    if spec.family in FUSED_QKV_FAMILIES:
        out.append(_Matmul(e * sb * (spec.q_dim + 2 * spec.kv_dim), True, not spec.qkv_bias))
        adapters("q", "k", "v")
    else:
        add("q", spec.q_dim, split=True, bias=spec.qkv_bias)
        add("k", spec.kv_dim, split=True, bias=spec.qkv_bias)
        add("v", spec.kv_dim, split=True, bias=spec.qkv_bias)
    add("o", spec.hidden_size, split=False, bias=spec.attn_out_bias)
    f = spec.intermediate_size
    if spec.is_moe:
        # The router's logits are an mm output. Transformers 5 runs the experts' matmuls as
        # one aten._grouped_mm each (transformers/integrations/moe.py), in neither save list:
        # no expert output is kept (the backward recomputes them: they are in ``per_layer``).
        out.append(_Matmul(e * sb * spec.num_experts, True, True))
        adapters("gate", "up", "down")
    elif spec.mlp == "gelu":
        add("up", f, split=True, bias=spec.mlp_bias, mlp_in=True)
        add("down", spec.hidden_size, split=False, bias=spec.mlp_bias)
    elif spec.family in FUSED_GATE_UP_FAMILIES:
        out.append(_Matmul(e * sb * 2 * f, True, not spec.mlp_bias, True))
        adapters("gate", "up")
        add("down", spec.hidden_size, split=False, bias=spec.mlp_bias)
    else:
        add("gate", f, split=True, bias=spec.mlp_bias, mlp_in=True)
        add("up", f, split=True, bias=spec.mlp_bias, mlp_in=True)
        add("down", spec.hidden_size, split=False, bias=spec.mlp_bias)
    return out


def _kept(matmuls: list[_Matmul], every_second_mm: bool) -> list[_Matmul]:
    """The matmul outputs a policy keeps: all (SAVE_OPS holds mm and addmm), or torchtitan's
    odd-numbered mms (Note: [torchtitan's policy in the formulas])."""
    if not every_second_mm:
        return matmuls
    mms = [m for m in matmuls if m.mm]
    return [m for i, m in enumerate(mms) if i % 2 == 0]


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
                          lora_rank: int = 0, every_second_mm: bool = False) -> SelectiveTerms:
    """Saved bytes of one block under ``memfit.techniques``' selective policy (SAVE_OPS), from
    the shapes: see Note: [op-level selective checkpointing]. ``per_layer``: what the block
    saves without checkpointing on this GPU (bounds the recompute transient).
    ``every_second_mm``: torchtitan's policy instead (Note: [torchtitan's policy in the
    formulas]).

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
    split = full = 0
    if attention == "eager":
        if not every_second_mm:  # QK^T and softmax(QK^T) V: bmm, in SAVE_OPS only
            split += e * spec.num_heads * s * s * b + e * sb * spec.q_dim
    else:
        split += e * sb * spec.q_dim + LSE_BYTES * spec.num_heads * sb  # output + logsumexp
    kept = _kept(_block_matmuls(spec, sb=sb, e=e, lora_targets=lora_targets,
                                lora_rank=lora_rank), every_second_mm)
    split += sum(m.nbytes for m in kept if m.split)
    full += sum(m.nbytes for m in kept if not m.split)
    saved = block_input + -(-split // tp) + full
    # Recomputing a block brings back what its backward needs; the SDPA output and logsumexp
    # and the MLP's wide matmul outputs that were kept (GeLU's input; SiLU's and the product's
    # inputs) are the cached tensors themselves, so they do not come twice.
    cached_in_use = sum(m.nbytes for m in kept if m.mlp_input_side)
    if attention != "eager":
        cached_in_use += e * sb * spec.q_dim + LSE_BYTES * spec.num_heads * sb
    recompute = max(0, per_layer - -(-cached_in_use // tp))
    return SelectiveTerms(saved=saved, recompute=recompute)
