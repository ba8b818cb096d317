"""How the model is run: mode, precision, optimizer, checkpointing, batch and parallelism."""

from __future__ import annotations

import copy
import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from memfit import vocab
from memfit.errors import MemfitError, suggest
from memfit.parallel.config import Parallel
from memfit.recipe import Recipe
from memfit.semi_structured import PLAN_FORMATS, check_pattern

Mode = Literal["train", "lora", "qlora", "inference"]
Precision = Literal["fp32", "fp16-mixed", "bf16-mixed", "bf16", "fp16", "fp8"]
Optimizer = Literal["adam", "adamw", "adamw-8bit", "sgd", "sgd-momentum", "adafactor", "lion"]
Checkpointing = Literal["none", "selective", "torchtitan", "selective-attn", "full"]
Engine = Literal["auto", "fsdp2", "ddp", "deepspeed", "megatron"]
OffloadTo = Literal["cpu", "nvme"]
Attention = Literal["sdpa", "flash", "eager"]
WeightQuant = Literal["none", "int8", "int4"]
KvDtype = Literal["fp32", "fp16", "bf16", "fp8", "int8"]
Sparsity = Literal["none", "2:4"]

MODES: tuple[str, ...] = get_args(Mode)
# The names come from memfit.vocab (the Literal types above say the same, for type checkers;
# tests/test_vocab.py holds them equal).
PRECISIONS: tuple[str, ...] = vocab.names("precision", "plan")
OPTIMIZERS: tuple[str, ...] = vocab.names("optimizer", "plan")
CHECKPOINTING: tuple[str, ...] = vocab.names("checkpointing", "plan")
ATTENTIONS: tuple[str, ...] = get_args(Attention)
WEIGHT_QUANTS: tuple[str, ...] = get_args(WeightQuant)
KV_DTYPES: tuple[str, ...] = get_args(KvDtype)
ENGINES: tuple[str, ...] = get_args(Engine)
OFFLOAD_TARGETS: tuple[str, ...] = get_args(OffloadTo)


def _check_recipe(fields: dict[str, Any]) -> None:
    """``Recipe.for_layer("plan", **fields)``, once per distinct fields: a search builds
    thousands of runs from a few recipes. Keyed by each value's type too, so that ``1`` does
    not pass for ``True`` (the recipe refuses a flag that is not a bool); fields that do not
    hash (a list of LoRA targets) are checked each time."""
    key = tuple((name, type(value), value) for name, value in fields.items())
    try:
        hash(key)
    except TypeError:
        Recipe.for_layer("plan", **fields)
        return
    _check_recipe_key(key)


@functools.lru_cache(maxsize=4096)
def _check_recipe_key(key: tuple[tuple[str, type, Any], ...]) -> None:
    Recipe.for_layer("plan", **{name: value for name, _, value in key})


def _check_positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise MemfitError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")


def _check_choice(what: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise MemfitError(
            f"unknown {what} {value!r}{suggest(value, valid)}; valid: {', '.join(valid)}")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """One training or inference step, per the user's options: the formulas' input.

    The recipe is a derived view (:attr:`recipe`), not a field: a run is its recipe (precision,
    optimizer, checkpointing, offload, attention, LoRA, quantization, engine, layout) plus what
    only a step of one model has (``mode``, ``batch``, ``seq``, ``new_tokens``), kept flat so
    that the CLI and the ~100 places that build a run keep one constructor. What the recipe's
    fields may be is checked by the :class:`memfit.Recipe` this run builds (one place, then the
    plan layer's subset, :meth:`memfit.Recipe.check_layer`); what is checked here is only what
    a run adds (its mode, the kernels the formulas price, the flags' combinations, each engine's
    layouts), so every estimator can trust the values.
    """

    mode: Mode = "train"
    """train: all weights trained. lora/qlora: frozen base (16-bit / 4-bit NF4) + adapters.
    inference: weights + KV cache + prefill activations, no gradients."""
    precision: Precision = "bf16-mixed"
    """fp32; fp16-mixed/bf16-mixed (16-bit compute, fp32 master weights held by the optimizer,
    16Ψ bytes with Adam per the ZeRO paper); bf16/fp16 (pure: states in 16-bit too);
    fp8 (fp8 matmuls, bf16-mixed storage; needs a GPU with fp8)."""
    optimizer: Optimizer = "adamw"
    checkpointing: Checkpointing = "none"
    """none; selective (op-level selective activation checkpointing as memfit.techniques applies
    it: each block keeps its input and the outputs of its matmuls and attention kernels, the
    rest is recomputed); torchtitan (torchtitan's op-level policy: the same but every second
    matmul of a block is recomputed); selective-attn (Korthikanti et al.'s selective recompute:
    only the attention scores are recomputed; nothing to drop with fused attention); full (keep
    block inputs only, recompute one block at a time)."""
    attention: Attention = "sdpa"
    """sdpa/flash: fused attention, no s×s score matrix kept; eager: scores and softmax kept."""
    batch: int = 1
    """Micro-batch per GPU (per data-parallel rank)."""
    seq: int | None = None
    """Tokens per sample (prompt length for inference); None: the model's default."""
    grad_accum: int = 1
    """Micro-batches per optimizer step (pipeline parallelism uses them as its micro-batches)."""
    parallel: Parallel = field(default_factory=lambda: Parallel(gpus=1))
    """How the step is spread over GPUs: the house's one layout type (:class:`memfit.Parallel`,
    the per-rank trace's and ``fit``'s too). The formulas read its ``gpus``, ``tp``, ``pp``,
    ``zero`` (ZeRO stage over the data-parallel ranks; 3 = FSDP full sharding) and ``sp``
    (Megatron sequence parallelism: norms/dropouts sharded along the sequence too); they
    shard over every data-parallel rank (no HSDP) and do not model ``ep``, ``loss_parallel``
    or the pipeline schedule (the trace does). Read them as ``run.parallel.tp``, or through
    the read-only views :attr:`gpus`, :attr:`tp`, :attr:`pp`, :attr:`dp`, :attr:`zero`
    (0-3), :attr:`sequence_parallel`."""
    offload_optimizer: bool = False
    """Optimizer states (and fp32 masters) live in host memory (ZeRO-Offload)."""
    offload_params: bool = False
    """Parameters live in host memory and are fetched per block (ZeRO-Infinity; needs zero=3)."""
    offload_to: OffloadTo = "cpu"
    """Where offloaded states go: cpu (host memory) or nvme (ZeRO-Infinity's NVMe tier: DeepSpeed
    only; host memory keeps the swap buffers)."""
    offload_activations: bool = False
    """The tensors saved for backward live in host memory (``memfit.techniques.
    apply_activation_offload``): on the device stay the block being back-propagated and the one
    prefetched, the head's and loss's tensors at the loss, and whatever a checkpointed block
    keeps (its own storage, which offload does not move: Note: [offload after checkpointing])."""
    chunked_loss: bool = False
    """The decoder's cross-entropy over :data:`memfit.analytic.activations.CHUNKED_LOSS_TOKENS`
    tokens at a time (``memfit.techniques.apply_chunked_loss``, its PyTorch path): no full fp32
    logits or log-softmax, one chunk's at a time."""
    engine: Engine = "auto"
    """The training engine whose memory layout is planned: fsdp2 (PyTorch fully_shard,
    MixedPrecisionPolicy, CPUOffloadPolicy), ddp (PyTorch DDP under autocast; ZeRO-1 as
    ZeroRedundancyOptimizer), deepspeed (ZeRO 1-3, ZeRO-Offload, ZeRO-Infinity), megatron
    (Megatron-LM: bf16 parameters, fp32 main-grad buffer, distributed optimizer = ZeRO-1).
    auto: the ZeRO paper's layout (16-bit weights and gradients, fp32 masters with the
    optimizer, activations under autocast), DeepSpeed's when something is offloaded."""
    lora_rank: int = 16
    lora_targets: tuple[str, ...] = ("q", "k", "v", "o")
    weight_quant: WeightQuant = "none"
    """Inference: weight-only quantization of the linear layers."""
    kv_cache_dtype: KvDtype | None = None
    """Inference: KV cache format; None follows the compute precision."""
    new_tokens: int = 0
    """Inference: tokens generated after the prompt (KV cache holds seq + new_tokens)."""
    sparsity: Sparsity = "none"
    """Inference: ``2:4`` stores the blocks' linear weights as torch's 2:4 semi-structured
    tensors (half the values plus 4-bit position codes: 9/8 bytes per fp16/bf16 weight;
    :mod:`memfit.semi_structured`); embeddings, head and norms stay dense. Training
    (``mode="train"``): torchao's ``SemiSparseLinear`` keeps the dense weights, gradients and
    optimizer states and adds, per forward, compressed copies of W and W^T held until backward
    (19/8 bytes per weight: :func:`memfit.semi_structured.training_bytes`): it saves compute,
    not memory. Needs fp16/bf16 weights in the forward and a GPU of compute capability 8.0 or
    later."""

    def __post_init__(self) -> None:
        _check_choice("mode", self.mode, MODES)
        # The formulas price a kernel: the Recipe's "model" (keep the model's own) is not one.
        _check_choice("attention implementation", self.attention, ATTENTIONS)
        if not isinstance(self.parallel, Parallel):
            raise MemfitError(f"RunConfig(parallel={self.parallel!r}): give a memfit.Parallel, "
                              "e.g. parallel=Parallel(gpus=8, zero=3)")
        for name in ("batch", "grad_accum", "lora_rank"):
            _check_positive(name, getattr(self, name))
        if self.seq is not None and (not isinstance(self.seq, int) or self.seq <= 0):
            raise MemfitError(f"--seq must be a positive integer, got {self.seq!r}")
        if self.new_tokens < 0:
            raise MemfitError(f"--new-tokens must be >= 0, got {self.new_tokens}")
        try:  # the recipe's names (precision, optimizer, ..., LoRA targets), checked there
            _check_recipe(self._recipe_fields())
        except MemfitError as exc:
            raise MemfitError(str(exc).removeprefix(f"{Recipe.where}: ")) from None
        if self.engine == "fsdp2" and self.zero == 0 and self.training:
            # fully_shard is ZeRO-3 (frozen dataclass)
            object.__setattr__(self, "parallel", relayout(self.parallel, zero=3))
        self._check_engine()
        if self.offload_params and self.zero != 3:
            raise MemfitError("parameter offload needs ZeRO-3 / FSDP: add --zero 3, "
                              "or use --offload-optimizer alone")
        if not self.training and (self.offload_activations or self.chunked_loss):
            raise MemfitError("activation offload and the chunked loss act on a training step's "
                              "saved tensors and loss; drop them for --mode inference")
        if self.mode == "inference":
            if self.zero:
                raise MemfitError("ZeRO shards training state; it does not apply to "
                                  "--mode inference (use --tp to split the model)")
            if self.offload_optimizer:
                raise MemfitError("--offload-optimizer needs a training mode; "
                                  "inference has no optimizer")
        elif self.weight_quant != "none":
            raise MemfitError(f"--quant {self.weight_quant} is weight-only quantization for "
                              "--mode inference; to train on a 4-bit base use --mode qlora")
        if self.mode == "qlora" and self.compute_format == "fp32":
            raise MemfitError("qlora computes in 16-bit; use --precision bf16-mixed or "
                              "fp16-mixed")
        # Note: [options that do nothing] an option that cannot act in this mode is refused,
        # not ignored; RunConfig's defaults (adamw, rank 16) cannot tell "given" from "default",
        # so here a value other than the default is refused, and the CLI (whose flags default
        # to None) refuses the flag itself (cli/plan.py: run_config).
        if self.new_tokens and self.mode != "inference":
            raise MemfitError(f"--new-tokens {self.new_tokens} is for --mode inference (tokens "
                              f"generated after the prompt); --mode {self.mode} has no generation")
        if self.mode == "inference" and self.optimizer != "adamw":
            raise MemfitError(f"--optimizer {self.optimizer} does nothing in --mode inference (no "
                              "optimizer state); drop it or use a training mode")
        if self.mode == "inference" and self.checkpointing != "none":
            raise MemfitError(f"--checkpointing {self.checkpointing} does nothing in --mode "
                              "inference (no backward recomputes activations); drop it or use a "
                              "training mode")
        if self.mode == "inference" and self.grad_accum != 1:
            raise MemfitError(f"--grad-accum {self.grad_accum} does nothing in --mode inference "
                              "(no gradients to accumulate; the rows of one forward are --batch): "
                              "drop it or use a training mode")
        if self.kv_cache_dtype is not None and self.mode != "inference":
            raise MemfitError(f"--kv-cache-dtype {self.kv_cache_dtype} is for --mode inference; "
                              f"--mode {self.mode} keeps no KV cache")
        self._check_sparsity()
        if self.mode not in ("lora", "qlora") and self.lora_rank != 16:
            raise MemfitError(f"--lora-rank {self.lora_rank} is for --mode lora or qlora, not "
                              f"--mode {self.mode}")

    def _check_sparsity(self) -> None:
        """2:4 weights: inference or full training, in fp16/bf16, without weight quantization
        (the GPU and the shapes are checked with the model, in
        :func:`memfit.analytic.checks._check_compatible`)."""
        check_pattern(self.sparsity)
        if self.sparsity == "none":
            return
        if self.mode not in ("inference", "train"):
            raise MemfitError(f"--sparsity {self.sparsity} is planned for --mode inference "
                              "(compressed weights) and --mode train (torchao's "
                              f"SemiSparseLinear), not --mode {self.mode}: LoRA's base weights "
                              "are frozen; drop --sparsity")
        if vocab.precision(self.precision).matmul not in PLAN_FORMATS:
            raise MemfitError(f"--sparsity {self.sparsity} with --precision {self.precision}: "
                              f"torch's 2:4 kernels take fp16 or bf16 weights (fp32 is 1:2 on "
                              "CUTLASS only); use --precision bf16 or fp16")
        if self.weight_quant != "none":
            raise MemfitError(f"--sparsity {self.sparsity} with --quant {self.weight_quant}: "
                              "memfit plans 2:4 for fp16/bf16 weights only; drop one of them")
        if self.mode != "train":
            return
        if self.layout == "megatron":
            raise MemfitError(f"--sparsity {self.sparsity} --engine megatron: torchao's "
                              "SemiSparseLinear replaces nn.Linear, and Megatron-LM runs its "
                              "own parallel linear layers; use another --engine")
        if self.layout == "ddp" and vocab.precision(self.precision).mixed:
            raise MemfitError(f"--sparsity {self.sparsity} --engine ddp --precision "
                              f"{self.precision}: autocast keeps fp32 weights, and torch's 2:4 "
                              "tile kernel (torchao's SemiSparseLinear) takes fp16/bf16 "
                              "weights; use --precision bf16 or fp16, or --engine fsdp2 "
                              "(16-bit parameters in the forward)")

    def _check_engine(self) -> None:
        """What each engine can run (one line each, with the fix)."""
        offload = self.offload_optimizer or self.offload_params
        if self.engine != "auto" and not self.training:
            raise MemfitError(f"--engine {self.engine} chooses a training engine's memory "
                              "layout; --mode inference has none: drop --engine")
        if self.offload_to == "nvme" and not offload:
            raise MemfitError("--offload-to nvme needs something to offload: add "
                              "--offload-optimizer and/or --offload-params (ZeRO-Infinity)")
        engine = self.engine
        if self.offload_to == "nvme" and engine not in ("auto", "deepspeed"):
            raise MemfitError(f"--offload-to nvme is ZeRO-Infinity's NVMe tier, a DeepSpeed "
                              f"feature; --engine {engine} cannot offload to NVMe: use --engine "
                              "deepspeed or --offload-to cpu")
        if engine == "fsdp2":
            if self.zero in (1, 2):
                raise MemfitError(f"--engine fsdp2 shards parameters, gradients and optimizer "
                                  f"states (ZeRO-3); --zero {self.zero} is not an FSDP2 layout: "
                                  "use --zero 3 or --engine deepspeed")
            if self.offload_optimizer and not self.offload_params:
                raise MemfitError("FSDP2's CPUOffloadPolicy moves parameters, gradients and "
                                  "optimizer states together: add --offload-params, or use "
                                  "--engine deepspeed for optimizer offload alone")
        elif engine == "ddp":
            if self.zero >= 2:
                raise MemfitError(f"--engine ddp replicates the model; --zero {self.zero} needs "
                                  "--engine fsdp2 (zero 3) or deepspeed (ZeRO-1 in DDP is "
                                  "ZeroRedundancyOptimizer: --zero 1)")
            if offload:
                raise MemfitError("--engine ddp does not offload; use --engine deepspeed "
                                  "(ZeRO-Offload) or fsdp2 (CPUOffloadPolicy)")
        elif engine == "megatron":
            if self.zero >= 2:
                raise MemfitError(f"--engine megatron shards only the optimizer (its distributed "
                                  f"optimizer, --zero 1); --zero {self.zero} is not a Megatron-LM "
                                  "layout: use --zero 1, or --engine fsdp2/deepspeed")
            if offload:
                raise MemfitError("--engine megatron: optimizer/parameter offload is not "
                                  "planned; use --engine deepspeed or fsdp2 to offload")

    @property
    def recipe(self) -> Recipe:
        """This run's model-independent :class:`memfit.Recipe` (what :func:`memfit.trace_recipe`
        traces): the micro-batch is ``batch``, the accumulation ``grad_accum``, the optimizer's
        offload ``offload_optimizer``; LoRA only in lora/qlora mode."""
        return Recipe(**self._recipe_fields())

    def _recipe_fields(self) -> dict[str, Any]:
        lora = self.mode in ("lora", "qlora")
        return {"precision": self.precision, "optimizer": self.optimizer,
                "checkpointing": self.checkpointing, "micro_batch": self.batch,
                "accumulation": self.grad_accum, "offload_states": self.offload_optimizer,
                "offload_params": self.offload_params, "offload_to": self.offload_to,
                "offload_activations": self.offload_activations,
                "chunked_loss": self.chunked_loss,
                "attention": self.attention, "weight_quant": self.weight_quant,
                "lora_rank": self.lora_rank if lora else None,
                "lora_targets": self.lora_targets, "qlora": self.mode == "qlora",
                "kv_cache_dtype": self.kv_cache_dtype, "engine": self.engine,
                "parallel": self.parallel}

    @property
    def layout(self) -> str:
        """The engine whose memory layout is planned: ``auto`` resolves to ``deepspeed`` when
        something is offloaded (ZeRO-Offload), else to ``zero-paper``."""
        if self.engine != "auto":
            return self.engine
        return "deepspeed" if (self.offload_optimizer or self.offload_params) else "zero-paper"

    @property
    def autocast(self) -> bool:
        """Activations are computed under torch.autocast (fp32 parameters and residual stream,
        16-bit matmuls): memfit's own way and DDP's. FSDP2's MixedPrecisionPolicy, DeepSpeed's
        bf16/fp16 modes and Megatron-LM cast the model to 16-bit and compute in it."""
        return self.mixed and self.engine in ("auto", "ddp")

    # Read-only views of :attr:`parallel` in the formulas' vocabulary (no second layout).
    @property
    def gpus(self) -> int:
        """GPUs in all: ``parallel.gpus``."""
        return self.parallel.gpus

    @property
    def tp(self) -> int:
        """Tensor-parallel degree: ``parallel.tp``."""
        return self.parallel.tp

    @property
    def pp(self) -> int:
        """Pipeline stages: ``parallel.pp``."""
        return self.parallel.pp

    @property
    def zero(self) -> int:
        """ZeRO stage 0-3 over the data-parallel ranks: ``parallel.zero``, 0 for None."""
        return self.parallel.zero or 0

    @property
    def sequence_parallel(self) -> bool:
        """Megatron sequence parallelism: ``parallel.sp``."""
        return self.parallel.sp

    @property
    def dp(self) -> int:
        """Data-parallel ranks: ``parallel.dp``."""
        return self.parallel.dp

    def relayout(self, **changes: Any) -> RunConfig:
        """This run on another layout: :func:`relayout` of :attr:`parallel`."""
        return dataclasses.replace(self, parallel=relayout(self.parallel, **changes))

    def with_batch(self, batch: int, grad_accum: int = 1) -> RunConfig:
        """This run at micro-batch ``batch`` with ``grad_accum`` micro-batches per step, as
        ``dataclasses.replace(run, batch=..., grad_accum=...)`` gives it, checking only those
        two: nothing else :meth:`__post_init__` checks depends on them, so a search over
        micro-batches does not validate the rest again for each one."""
        _check_positive("batch", batch)
        _check_positive("grad_accum", grad_accum)
        new = copy.copy(self)
        object.__setattr__(new, "batch", batch)  # frozen dataclass, as __post_init__ does
        object.__setattr__(new, "grad_accum", grad_accum)
        return new

    def to_dict(self) -> dict[str, Any]:
        """The run as a JSON object (``memfit plan --json``'s ``"run"``), its layout nested as
        ``"parallel"`` (:meth:`Parallel.to_dict`)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["lora_targets"] = list(self.lora_targets)
        out["parallel"] = self.parallel.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        """A run from :meth:`to_dict`'s object, or from one of before the layout was nested:
        its flat ``gpus``, ``zero`` (0-3), ``tp``, ``pp``, ``sequence_parallel`` make the
        :class:`Parallel`."""
        data = dict(data)
        flat = {k: data.pop(k) for k in FLAT_LAYOUT if k in data}
        if "parallel" in data:
            if flat:
                raise MemfitError(f"run: {', '.join(flat)} beside \"parallel\"; give the layout "
                                  "once, inside \"parallel\"")
            data["parallel"] = Parallel.from_dict(data["parallel"], where="run")
        elif flat:
            data["parallel"] = layout(**flat)
        if "lora_targets" in data:
            data["lora_targets"] = tuple(data["lora_targets"])
        return cls(**data)

    @property
    def training(self) -> bool:
        return self.mode != "inference"

    @property
    def compute_format(self) -> str:
        """Number format of activations and 16-bit copies of the weights."""
        return vocab.precision(self.precision).compute

    @property
    def mixed(self) -> bool:
        """Mixed precision: 16-bit working weights + fp32 masters in the optimizer."""
        return vocab.precision(self.precision).mixed


FLAT_LAYOUT = ("gpus", "zero", "tp", "pp", "sequence_parallel")
"""The layout fields ``RunConfig`` had before it held a :class:`Parallel` (read by
:meth:`RunConfig.from_dict` and :func:`layout`)."""


def layout(*, gpus: int = 1, zero: int = 0, tp: int = 1, pp: int = 1,
           sequence_parallel: bool = False) -> Parallel:
    """The :class:`Parallel` of the formulas' flat vocabulary (ZeRO stage 0-3, Megatron
    ``sequence_parallel``), with its one-line errors; a ``sequence_parallel`` without tensor
    parallelism does nothing and is dropped (old plan files carry it)."""
    check_flat_layout(gpus=gpus, zero=zero, tp=tp, pp=pp)
    return Parallel(gpus=gpus, tp=tp, pp=pp, zero=zero or None,
                    sp=bool(sequence_parallel) and tp > 1)


def relayout(parallel: Parallel, **changes: Any) -> Parallel:
    """``parallel`` with ``changes`` to its fields (``zero=0`` for None), the rest kept; what
    ZeRO-2/3 derived (``fsdp`` over every data-parallel rank, ``reshard_after_forward``) is
    derived again for the new degrees, and ``sp`` / ``loss_parallel`` go without tensor
    parallelism, ``gpus_per_node`` when it no longer divides ``gpus``.

    >>> relayout(Parallel(gpus=8, zero=3), gpus=16).fsdp
    16
    """
    given = {f.name: getattr(parallel, f.name) for f in dataclasses.fields(parallel)}
    if parallel.zero in (2, 3) and parallel.fsdp == parallel.dp:
        given["fsdp"] = 1  # ZeRO-2/3's own: every data-parallel rank
    if given["reshard_after_forward"] == (parallel.zero != 2):
        given["reshard_after_forward"] = None
    if changes.get("zero") == 0:
        changes["zero"] = None
    given.update(changes)
    if given["tp"] == 1:
        given["sp"] = given["loss_parallel"] = False
    per_node = given["gpus_per_node"]
    if per_node is not None and given["gpus"] % per_node:
        given["gpus_per_node"] = None
    return Parallel(**given)


def check_flat_layout(*, gpus: int, zero: int, tp: int, pp: int) -> None:
    """The formulas' and the CLI's one-line errors for a ZeRO stage and degrees, worded with the
    flags (``Parallel``'s own checks follow)."""
    if isinstance(zero, bool) or zero not in (0, 1, 2, 3):
        raise MemfitError(f"--zero must be 0, 1, 2 or 3 (3 = FSDP full sharding), got {zero}")
    for name, value in (("gpus", gpus), ("tp", tp), ("pp", pp)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise MemfitError(f"--{name} must be a positive integer, got {value!r}")
    if gpus % (tp * pp):
        raise MemfitError(f"--gpus {gpus} is not divisible by tp x pp = {tp * pp}; use a GPU "
                          "count that is a multiple of --tp times --pp")
