"""Weights, gradients and optimizer states per GPU.

Sources (see shared facts):
- ZeRO (Rajbhandari et al., SC'20, Fig. 1): mixed-precision Adam keeps 2Ψ fp16 weights + 2Ψ fp16
  gradients + KΨ optimizer states with K = 12 (fp32 master weights, momentum, variance) = 16Ψ.
  ZeRO-1 shards the K term over N_d ranks, ZeRO-2 also the gradients, ZeRO-3 also the weights.
- EleutherAI "Transformer Math 101": optimizer bytes per parameter: AdamW 8, 8-bit Adam 2,
  SGD with momentum 4 (+4 fp32 master under mixed precision).
- QLoRA (Dettmers et al. 2023): NF4 base weights with double quantization, 4.127 bits/param.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from memfit.analytic.config import RunConfig
from memfit.errors import MemfitError
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

FORMAT_BYTES: dict[str, int] = {"fp32": 4, "fp16": 2, "bf16": 2}


def _ceil(x: Fraction | int) -> int:
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
    return -(-spec.num_layers // run.pp)


def split_params(model: ModelSpec, run: RunConfig, *, stage: int = 0) -> ParamSplit:
    """Parameters on one GPU of pipeline stage ``stage`` after tp/pp splitting.

    Tensor parallelism divides every weight by tp (norms are replicated; ignored, < 0.01%).
    """
    if isinstance(model, ParamCountSpec):
        if run.mode in ("lora", "qlora"):
            raise MemfitError(
                "--mode lora/qlora needs the model's architecture (which layers get adapters); "
                "give a preset or a config.json instead of --params")
        total = _ceil(Fraction(model.params, run.tp * run.pp))
        return ParamSplit(total=total, linear=total, trainable=total, largest_layer=0,
                          adafactor_state_elements=0)
    spec = model
    layers = stage_layers(spec, run)
    first, last = stage == 0, stage == run.pp - 1
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
    tp = run.tp
    return ParamSplit(
        total=_ceil(Fraction(total, tp)) + (trainable if run.mode in ("lora", "qlora") else 0),
        linear=_ceil(Fraction(layers * linear_per_layer, tp)),
        trainable=_ceil(Fraction(trainable, tp)),
        largest_layer=_ceil(Fraction(per_layer, tp)),
        adafactor_state_elements=_ceil(Fraction(ada, tp)),
    )


@dataclass(frozen=True, kw_only=True)
class ModelStates:
    """Bytes per GPU of the model states, and what went to host memory."""

    weights: int
    gradients: int
    optimizer_states: int
    host_bytes: int
    """Host (CPU) memory holding offloaded optimizer states / parameters, per GPU."""
    notes: tuple[str, ...] = ()


def _optimizer_bytes_per_param(run: RunConfig) -> Fraction:
    """Optimizer state bytes per trainable parameter, fp32 master copy included."""
    pure16 = run.precision in ("bf16", "fp16")
    if run.optimizer == "adamw-8bit":
        states = STATES_PER_PARAM["adamw-8bit"] * BNB_8BIT_BYTES_PER_STATE
    else:
        states = Fraction(STATES_PER_PARAM[run.optimizer] * (2 if pure16 else 4))
    master = 4 if run.mixed else 0
    return states + master


def model_states(model: ModelSpec, run: RunConfig, *, stage: int = 0) -> ModelStates:
    """Weights, gradients and optimizer states on one GPU of pipeline stage ``stage``."""
    split = split_params(model, run, stage=stage)
    compute_bytes = FORMAT_BYTES[run.compute_format]
    notes: list[str] = []
    frozen = split.total - split.trainable if run.mode in ("lora", "qlora") else 0
    frozen_linear = split.linear if run.mode in ("lora", "qlora") else 0

    # --- weights
    if run.mode == "inference":
        quant = {"int8": INT8_BYTES_PER_PARAM, "int4": INT4_BYTES_PER_PARAM}.get(run.weight_quant)
        if quant is None:
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
    if not run.training:
        return ModelStates(weights=weights, gradients=0, optimizer_states=0, host_bytes=0)

    # --- gradients and optimizer states of the trainable parameters
    gradients = split.trainable * compute_bytes
    if run.optimizer == "adafactor":
        opt_per = Fraction(4 if run.mixed else 0)
        optimizer = _ceil(split.trainable * opt_per) + 4 * split.adafactor_state_elements
        if isinstance(model, ParamCountSpec):
            notes.append("adafactor: factored states of a model known only by its parameter "
                         "count are taken as negligible")
    else:
        optimizer = _ceil(split.trainable * _optimizer_bytes_per_param(run))

    # --- ZeRO sharding over the data-parallel ranks
    dp = run.dp
    if run.zero >= 1:
        optimizer = _ceil(Fraction(optimizer, dp))
    if run.zero >= 2:
        gradients = _ceil(Fraction(gradients, dp))
    if run.zero >= 3:  # FSDP/ZeRO-3 shards every parameter, frozen ones included
        weights = _ceil(Fraction(weights, dp))

    host = 0
    if run.offload_optimizer:
        host += optimizer
        optimizer = 0
        notes.append("optimizer states and fp32 masters live in host memory; the optimizer "
                     "step runs on the CPU")
    if run.offload_params:
        host += weights
        weights = 0
        notes.append("parameters live in host memory; each block is fetched before use")
    return ModelStates(weights=weights, gradients=gradients, optimizer_states=optimizer,
                       host_bytes=host, notes=tuple(notes))
