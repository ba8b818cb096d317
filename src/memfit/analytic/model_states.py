"""Weights, gradients and optimizer states per GPU.

Sources (see shared facts):
- ZeRO (Rajbhandari et al., SC'20, Fig. 1): mixed-precision Adam keeps 2Ψ fp16 weights + 2Ψ fp16
  gradients + KΨ optimizer states with K = 12 (fp32 master weights, momentum, variance) = 16Ψ.
  ZeRO-1 shards the K term over N_d ranks, ZeRO-2 also the gradients, ZeRO-3 also the weights.
- EleutherAI "Transformer Math 101": optimizer bytes per parameter: AdamW 8, 8-bit Adam 2,
  SGD with momentum 4 (+4 fp32 master under mixed precision).
- QLoRA (Dettmers et al. 2023): NF4 base weights with double quantization, 4.127 bits/param.

Each engine keeps its own layout (RunConfig.layout; Note: [engine layouts]).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import TypeVar

from memfit import semi_structured, vocab
from memfit.analytic.checks import sparse_shard_shapes
from memfit.analytic.config import RunConfig
from memfit.dtypes import nbytes
from memfit.errors import MemfitError
from memfit.models.hf_auto import HFModelSpec
from memfit.models.spec import ModelSpec, ParamCountSpec, TransformerSpec

# Optimizer state tensors per trainable parameter (each one parameter-sized).
STATES_PER_PARAM: dict[str, int] = {
    "adam": 2, "adamw": 2,  # exp_avg, exp_avg_sq
    "sgd": 0, "sgd-momentum": 1,  # momentum_buffer
    "lion": 1,  # exp_avg
    "adafactor": 0,  # factored: see _adafactor_state_elements
    "adamw-8bit": 2,
}

# bitsandbytes' 8-bit optimizers quantize each state blockwise (256 values per block) with one
# fp32 absmax per block: 1 byte + 4/256 bytes per value per state.
BNB_8BIT_BYTES_PER_STATE = Fraction(1) + Fraction(4, 256)

# NF4 with double quantization (QLoRA §2): 4 bits + 8-bit absmax per 64 values + fp32 absmax of
# those per 256 blocks = 4 + 8/64 + 32/(64*256) = 4.127 bits per parameter.
NF4_BYTES_PER_PARAM = (Fraction(4) + Fraction(8, 64) + Fraction(32, 64 * 256)) / 8

# Weight-only inference quantization (torchao defaults): int8 per-output-channel scales in 16-bit;
# int4 in groups of 128 with a 16-bit scale and zero point per group.
INT8_BYTES_PER_PARAM = Fraction(1)
INT4_BYTES_PER_PARAM = Fraction(1, 2) + Fraction(2 + 2, 128)


def _ceil(x: Fraction | int) -> int:
    if isinstance(x, int):  # already whole: no Fraction arithmetic
        return x
    x = Fraction(x)
    return -(-x.numerator // x.denominator)


@dataclass(frozen=True, kw_only=True)
class ParamSplit:
    """The parameters one GPU holds before ZeRO sharding (after tensor/pipeline splitting)."""

    total: int
    """All parameters on this GPU."""
    linear: int
    """Of which inside the blocks' linear layers (what LoRA wraps and quantizers compress)."""
    trainable: int
    """Of which trained (all in train mode, the adapters in lora/qlora)."""
    largest_layer: int
    """Parameters of one block on this GPU (ZeRO-3 gathers one at a time)."""
    adafactor_state_elements: int
    """fp32 elements Adafactor keeps for the trainable parameters (factored second moment)."""


def lora_params_per_layer(spec: TransformerSpec, rank: int, targets: tuple[str, ...]) -> int:
    """LoRA adds A (r x in) and B (out x r) to each targeted linear layer (Hu et al. 2021)."""
    return sum(rank * (s.in_features + s.out_features) * s.count
               for s in spec.linear_shapes() if s.role in targets)


def _adafactor_state_elements(spec: TransformerSpec, layers: int, with_embed: bool,
                              with_head: bool) -> int:
    """Adafactor (Shazeer & Stern 2018) keeps row + column factors for each matrix and a full
    second moment for vectors; no first moment (torch.optim.Adafactor's default)."""
    h = spec.hidden_size
    per_layer = sum((s.in_features + s.out_features) * s.count for s in spec.linear_shapes())
    per_layer += spec.layer_params() - sum(
        s.in_features * s.out_features * s.count for s in spec.linear_shapes())
    total = layers * per_layer
    if with_embed:
        total += spec.embedding_params() - (spec.vocab_size * h) + (spec.vocab_size + h)
    if with_head:
        total += spec.head_params()
        if spec.arch == "decoder" and not spec.tie_embeddings:
            total -= spec.vocab_size * h - (spec.vocab_size + h)
    return total


def stage_layers(spec: TransformerSpec, run: RunConfig) -> int:
    """Blocks on one pipeline stage (the first stage when they do not divide evenly)."""
    return -(-spec.num_layers // run.parallel.pp)


def split_params(model: ModelSpec, run: RunConfig, *, stage: int = 0) -> ParamSplit:
    """Parameters on one GPU of pipeline stage ``stage`` after tp/pp splitting.

    Tensor parallelism divides every weight by tp (norms are replicated; ignored, < 0.01%).
    Kept by what it reads (the model, the mode, LoRA's rank and targets, tp, pp, the stage): a
    plan asks for it several times, and a search (``memfit rightsize``) for the same ones again
    and again.
    """
    key = (model, run.mode, run.lora_rank, run.lora_targets, run.parallel.tp, run.parallel.pp,
           stage)
    return _kept(_SPLITS, key, lambda: _split_params(model, run, stage=stage))


_SPLITS: dict[tuple[object, ...], ParamSplit] = {}
_T = TypeVar("_T")


def _kept(cache: dict[tuple[object, ...], _T], key: tuple[object, ...],
          compute: Callable[[], _T]) -> _T:
    """``cache[key]``, computed by ``compute`` the first time; computed each time when a field
    of the key does not hash (a model spec's, a list of LoRA targets). Emptied past 4,096
    entries."""
    try:
        found = cache.get(key)
    except TypeError:
        return compute()
    if found is None:
        if len(cache) > 4096:
            cache.clear()
        found = cache[key] = compute()
    return found


def _split_params(model: ModelSpec, run: RunConfig, *, stage: int) -> ParamSplit:
    """:func:`split_params`, computed."""
    if isinstance(model, ParamCountSpec):
        if run.mode in ("lora", "qlora"):
            if isinstance(model, HFModelSpec):  # a config.json the formulas do not cover
                raise MemfitError(
                    f"--mode {run.mode}: memfit's formulas do not cover model_type "
                    f"{model.model_type!r} (which layers get adapters); it is traced on one "
                    "GPU: drop --gpus and --method analytic")
            raise MemfitError(
                "--mode lora/qlora needs the model's architecture (which layers get adapters); "
                "give a preset or a config.json instead of --params")
        total = _ceil(Fraction(model.params, run.parallel.tp * run.parallel.pp))
        return ParamSplit(total=total, linear=total, trainable=total, largest_layer=0,
                          adafactor_state_elements=0)
    spec = model
    layers = stage_layers(spec, run)
    first, last = stage == 0, stage == run.parallel.pp - 1
    per_layer = spec.layer_params()
    linear_per_layer = sum(s.in_features * s.out_features * s.count for s in spec.linear_shapes())
    total = layers * per_layer
    if first:
        total += spec.embedding_params()
    if last:
        total += spec.head_params()
    if run.mode in ("lora", "qlora"):
        trainable = layers * lora_params_per_layer(spec, run.lora_rank, run.lora_targets)
        ada = layers * sum((run.lora_rank + s.in_features + run.lora_rank + s.out_features)
                           * s.count for s in spec.linear_shapes() if s.role in run.lora_targets)
    else:
        trainable = total
        ada = _adafactor_state_elements(spec, layers, first, last)
    tp = run.parallel.tp
    return ParamSplit(
        total=_ceil(Fraction(total, tp)) + (trainable if run.mode in ("lora", "qlora") else 0),
        linear=_ceil(Fraction(layers * linear_per_layer, tp)),
        trainable=_ceil(Fraction(trainable, tp)),
        largest_layer=_ceil(Fraction(per_layer, tp)),
        adafactor_state_elements=_ceil(Fraction(ada, tp)),
    )


# Note: [engine layouts] bytes per trainable parameter Ψ under bf16/fp16 mixed precision with
# AdamW (K = 8 bytes of states), N data-parallel ranks:
# - zero-paper (auto): the ZeRO paper's 2Ψ 16-bit weights + 2Ψ 16-bit gradients + (4 + K)Ψ fp32
#   master and states, sharded per ZeRO stage (Rajbhandari et al., Fig. 1).
# - deepspeed: the same layout (deepspeed/runtime/zero/stage_1_and_2.py and stage3.py keep 16-bit
#   parameters and gradients and an fp32 partition of master weights and states); ZeRO-Offload
#   (offload_optimizer) moves the fp32 master, states and an fp32 gradient partition to the host,
#   and with ZeRO-2/3 the 16-bit gradients leave the GPU bucket by bucket
#   (stage_1_and_2.py: async_inplace_copy_grad_to_fp32_buffer_from_gpu); offload_param moves the
#   16-bit parameter partitions too. Host bytes per GPU 16Ψ/N (18Ψ/N with parameters), as
#   DeepSpeed's estimators count (stage_1_and_2.py: estimate_zero2_model_states_mem_needs,
#   stage3.py: estimate_zero3_model_states_mem_needs, without their 1.5 buffer factor).
#   ZeRO-Infinity's NVMe tier (offload_to="nvme") puts those bytes on NVMe instead.
# - fsdp2: fully_shard keeps the sharded parameters in their own dtype (fp32 under
#   MixedPrecisionPolicy(param_dtype=bf16)), sharded gradients in the same dtype, and states;
#   the optimizer steps on the fp32 shards, so there is no separate master: 4Ψ/N + 4Ψ/N + KΨ/N.
#   CPUOffloadPolicy keeps all three on the host (the optimizer steps on the CPU).
# - ddp: torch.autocast with fp32 parameters (4Ψ), fp32 gradients (4Ψ) and states (KΨ);
#   ZeroRedundancyOptimizer (zero 1) shards the states.
# - megatron: bf16 parameters (2Ψ) in a contiguous buffer, a contiguous fp32 main-grad buffer (4Ψ,
#   megatron/core/distributed/param_and_grad_buffer.py: grad_dtype = torch.float if
#   grad_reduce_in_fp32; bf16 turns that on, megatron/training/arguments.py) and fp32 master +
#   states (12Ψ), sharded over N by the distributed optimizer (zero 1): 6 + 12/d bytes per
#   parameter; fp16: 4 + 16/d (fp16 gradients, an fp32 main-grad copy with the optimizer); fp32:
#   8 + 8/d (docs/user-guide/features/dist_optimizer.md, megatron/core/optimizer/
#   distrib_optimizer.py).


@dataclass(frozen=True, kw_only=True)
class ModelStates:
    """Bytes per GPU of the model states, and what went to host memory (or NVMe)."""

    weights: int
    gradients: int
    optimizer_states: int
    host_bytes: int
    """Host (CPU) memory holding offloaded optimizer states / parameters, per GPU."""
    notes: tuple[str, ...] = ()
    nvme_bytes: int = 0
    """NVMe bytes holding offloaded states per GPU (ZeRO-Infinity, ``offload_to="nvme"``)."""


def _optimizer_states_per_param(run: RunConfig) -> Fraction:
    """Optimizer state bytes per trainable parameter, without the fp32 master copy."""
    if run.optimizer == "adamw-8bit":
        return STATES_PER_PARAM["adamw-8bit"] * BNB_8BIT_BYTES_PER_STATE
    # torch optimizers keep their states in the parameters' dtype (16-bit for pure bf16/fp16)
    state_bytes = vocab.precision(run.precision).weight_bytes
    return Fraction(STATES_PER_PARAM[run.optimizer] * state_bytes)


def _weights(split: ParamSplit, run: RunConfig, compute_bytes: int, frozen: int, frozen_linear: int,
             notes: list[str]) -> int:
    """The weights' bytes on one GPU before sharding: quantized, 2:4-compressed or 16-bit."""
    if run.mode == "inference":
        quant = {"int8": INT8_BYTES_PER_PARAM, "int4": INT4_BYTES_PER_PARAM}.get(run.weight_quant)
        if run.sparsity == "2:4":
            # 2:4: the blocks' projections as torch stores them compressed (the kept half of
            # the values + 4-bit position codes; memfit.semi_structured cites each constant).
            per_weight = semi_structured.bytes_per_weight(run.compute_format)
            weights = (_ceil(split.linear * per_weight)
                       + (split.total - split.linear) * compute_bytes)
            notes.append(
                f"2:4 sparsity: the blocks' linear weights ({split.linear:,} parameters) stored "
                f"compressed, {per_weight} bytes per weight (the kept half of the values and "
                f"their 4-bit position codes, the same in torch's CUTLASS and cuSPARSELt "
                f"layouts) instead of {compute_bytes}; embeddings, the head and norms stay "
                "dense; needs compute capability 8.0+")
        elif quant is None:
            weights = split.total * compute_bytes
        else:
            weights = _ceil(split.linear * quant) + (split.total - split.linear) * compute_bytes
    elif run.mode == "qlora":
        weights = (_ceil(frozen_linear * NF4_BYTES_PER_PARAM)
                   + (frozen - frozen_linear) * compute_bytes
                   + split.trainable * compute_bytes)
    else:
        # Mixed precision: the 16-bit working copy; the fp32 master is an optimizer state.
        weights = (frozen + split.trainable) * compute_bytes
    return weights


def sparse_training_copies(model: TransformerSpec, run: RunConfig, *,
                           stage: int = 0) -> tuple[int, str]:
    """2:4 training (torchao's ``SemiSparseLinear``): the bytes of the compressed W, W^T and
    bitmask that each forward makes of every block projection (its tensor-parallel shard) and
    autograd keeps until that layer's backward (:func:`memfit.semi_structured.training_bytes`),
    at the backward peak on one GPU of ``stage``, and the note that says so. The dense
    weights, gradients and optimizer states are unchanged: 2:4 training saves compute, not
    memory. Under full checkpointing a block's copies are dropped in its forward and remade
    when it is recomputed: one block's worth; 1F1B holds one set per micro-batch in flight."""
    fmt = vocab.precision(run.precision).matmul
    per_block = sum(semi_structured.training_bytes(rows, cols, fmt).total * count
                    for _, rows, cols, count in sparse_shard_shapes(model, run))
    in_flight = min(run.parallel.pp - stage, run.grad_accum)
    blocks = 1 if run.checkpointing == "full" else stage_layers(model, run) * in_flight
    return blocks * per_block, (
        "2:4 training (torchao's SemiSparseLinear): the dense weights, gradients and optimizer "
        "states stay; each forward adds compressed copies of every block projection's W and "
        f"W^T and a bitmask ({semi_structured.TRAINING_BYTES_PER_WEIGHT} bytes per weight), "
        f"held until its backward and counted in activations (for {blocks} block(s)): it "
        "saves compute, not memory")


def model_states(model: ModelSpec, run: RunConfig, *, stage: int = 0) -> ModelStates:
    """Weights, gradients and optimizer states on one GPU of pipeline stage ``stage``.

    Kept by the model, the run without its micro-batch and accumulation (the states do not
    depend on them) and the stage: a search (``memfit rightsize``) plans the same run at each
    micro-batch it tries."""
    key = (model, run.with_batch(1, 1), stage)
    return _kept(_STATES, key, lambda: _model_states(model, run, stage=stage))


_STATES: dict[tuple[object, ...], ModelStates] = {}


def _model_states(model: ModelSpec, run: RunConfig, *, stage: int) -> ModelStates:
    """:func:`model_states`, computed."""
    split = split_params(model, run, stage=stage)
    compute_bytes = nbytes(1, run.compute_format)
    notes: list[str] = []
    frozen = split.total - split.trainable if run.mode in ("lora", "qlora") else 0
    frozen_linear = split.linear if run.mode in ("lora", "qlora") else 0

    weights = _weights(split, run, compute_bytes, frozen, frozen_linear, notes)
    if not run.training:
        return ModelStates(weights=weights, gradients=0, optimizer_states=0, host_bytes=0,
                           notes=tuple(notes))

    # --- gradients and optimizer states of the trainable parameters
    layout = run.layout
    prec = vocab.precision(run.precision)
    master = prec.master_bytes
    if layout in ("fsdp2", "ddp"):
        # PyTorch keeps the trainable parameters in fp32 under mixed precision (autocast or
        # MixedPrecisionPolicy): they are the optimizer's master copy; gradients match them.
        weights += split.trainable * (prec.weight_bytes - compute_bytes)
        gradients = split.trainable * prec.grad_bytes
        master = 0
    elif layout == "megatron":
        # fp32 main-grad buffer for bf16 (and fp32); fp16 keeps fp16 model gradients and the
        # optimizer an fp32 main-grad copy (Note: [engine layouts])
        fp16_grads = prec.mixed and prec.compute == "fp16"
        grad_bytes = compute_bytes if fp16_grads or not prec.mixed else 4
        gradients = split.trainable * grad_bytes
        if fp16_grads:
            master += 4  # the fp32 main gradients live with the optimizer
    else:
        gradients = split.trainable * compute_bytes
    if run.optimizer == "adafactor":
        optimizer = _ceil(split.trainable * master) + 4 * split.adafactor_state_elements
        if isinstance(model, ParamCountSpec):
            notes.append("adafactor: factored states of a model known only by its parameter "
                         "count are taken as negligible")
    else:
        optimizer = _ceil(split.trainable * (_optimizer_states_per_param(run) + master))

    # --- ZeRO sharding over the data-parallel ranks
    dp = run.parallel.dp
    if run.zero >= 1:
        optimizer = _ceil(Fraction(optimizer, dp))
    if run.zero >= 2:
        gradients = _ceil(Fraction(gradients, dp))
    if run.zero >= 3:  # FSDP/ZeRO-3 shards every parameter, frozen ones included
        weights = _ceil(Fraction(weights, dp))

    host = 0
    if layout == "fsdp2" and run.offload_params:
        # CPUOffloadPolicy: sharded parameters, gradients and optimizer states on the host
        host = weights + gradients + optimizer
        weights = gradients = optimizer = 0
        notes.append("FSDP2 CPUOffloadPolicy: sharded parameters, gradients and optimizer "
                     "states live in host memory; each block is copied in before use and the "
                     "optimizer steps on the CPU")
    elif run.offload_optimizer or run.offload_params:
        if run.offload_optimizer:
            # ZeRO-Offload: fp32 master + states and an fp32 gradient partition on the host
            fp32_grads = _ceil(Fraction(split.trainable * 4, dp if run.zero >= 1 else 1))
            host += optimizer + fp32_grads
            optimizer = 0
            if run.zero >= 2:
                gradients = 0  # reduced bucket by bucket straight into the host partition
                notes.append("DeepSpeed ZeRO-Offload: fp32 masters, optimizer states and fp32 "
                             "gradients live in host memory; 16-bit gradients leave the GPU "
                             "through the reduce bucket; the optimizer steps on the CPU")
            else:
                notes.append("DeepSpeed ZeRO-Offload (stage 0/1): fp32 masters, optimizer "
                             "states and an fp32 gradient copy live in host memory; the 16-bit "
                             "gradients stay on the GPU until the step (--zero 2 moves them)")
        if run.offload_params:
            host += weights
            weights = 0
            notes.append("ZeRO-Infinity parameter offload: 16-bit parameter partitions live "
                         "in host memory; each module is fetched before use")
    nvme = 0
    if run.offload_to == "nvme":
        # ZeRO-Infinity: the offloaded states sit on NVMe; the host keeps the swap buffers
        # (engine_buffers.py: nvme_host_buffers counts them)
        nvme, host = host, 0
    return ModelStates(weights=weights, gradients=gradients, optimizer_states=optimizer,
                       host_bytes=host, notes=tuple(notes), nvme_bytes=nvme)

