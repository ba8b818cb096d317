"""How a step runs, whatever the model: memfit's one :class:`Recipe`.

A recipe names the techniques of a training (or inference) step in memfit's vocabulary
(:mod:`memfit.vocab`): the precision, the optimizer, activation checkpointing, what is offloaded
and where, the attention kernels, the micro-batch and accumulation, the chunked loss, weight
quantization, LoRA and the multi-GPU layout (:class:`memfit.Parallel`). Every part of memfit
that describes a run holds one, or is one: ``memfit fit``'s :class:`memfit.fitting.FitConfig` is
a recipe plus its ZeRO ``sharding``; ``memfit plan``'s :class:`memfit.RunConfig` reads its
recipe from :attr:`memfit.RunConfig.recipe`; the exporters' ``PlanSettings``, ``memfit
validate``'s configs and the gloo measurement's ``Case`` hold one.

It is applied to a model in one place, :func:`memfit.apply_recipe` (the techniques in the
documented order, Note: [composition order] in :mod:`memfit.techniques`, then the layout and the
optimizer), and traced in one, :func:`memfit.trace_recipe` (the same techniques, then
:func:`memfit.estimate` with the recipe's precision, optimizer and layout).

Torch-free, like the vocabulary, so the analytic CLI builds one without importing torch.

>>> r = Recipe(precision="bf16-mixed", checkpointing="full", micro_batch=4, accumulation=8)
>>> r.global_batch_per_rank
32

Serving (issue 22): an inference deployment is a recipe too: ``weight_quant`` (the weights'
format), ``kv_cache_dtype`` (the KV cache's), ``parallel`` (its ``tp`` size) and ``engine``
(the serving engine, once named in :data:`ENGINES`); what only serving has (the batch of
concurrent sequences and their lengths) belongs to the serving request beside the recipe, as
the sequence length of a training step belongs to its batch, not here.

Known limitations: the recipe is model-independent, so what it cannot know without the model
(a checkpointing budget larger than the blocks' activations, LoRA targets the model lacks, a
layout whose ``tp`` does not divide the heads) is refused where it is applied, not here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from memfit import vocab
from memfit.errors import MemfitError, suggest
from memfit.layout import Parallel

__all__ = ["ATTENTIONS", "ENGINES", "KV_DTYPES", "LORA_TARGETS", "OFFLOAD_TARGETS", "WEIGHT_QUANTS",
           "Recipe"]

ATTENTIONS = ("model", "sdpa", "flash", "eager")
"""``model``: the model's own attention; ``sdpa``: switched to scaled_dot_product_attention
(``memfit.techniques.use_sdpa``); ``flash`` / ``eager``: the kernels the analytic planner
prices (fused, or scores and softmax kept)."""
OFFLOAD_TARGETS = ("cpu", "nvme")
WEIGHT_QUANTS = ("none", "int8", "int4")
KV_DTYPES = ("fp32", "fp16", "bf16", "fp8", "int8")
ENGINES = ("auto", "fsdp2", "ddp", "deepspeed", "megatron")
"""The engine whose memory layout a step follows (``memfit plan --engine``); serving engines
join this list (issue 22)."""
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
CHECKPOINT_MODES = ("full", "selective", None)


_NAMED = (("precision", "precision"), ("optimizer", "optimizer"),
          ("checkpointing", "checkpointing policy"))
"""The recipe's fields named in :mod:`memfit.vocab`, and how errors call them."""


def _check_names(layer: str, fields: dict[str, Any]) -> None:
    for kind, label in _NAMED:
        value = fields.get(kind)
        if isinstance(value, str):
            vocab.check(kind, value, layer, what=label)


def _choice(where: str, what: str, value: Any, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise MemfitError(f"{where}: unknown {what} {value!r}{suggest(str(value), valid)}; "
                          f"valid: {', '.join(valid)}")


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """How one step runs, independent of the model (see the module). Validated once, here:
    a bad value is a one-line :class:`memfit.MemfitError` naming the valid ones."""

    where: ClassVar[str] = "recipe"
    """How errors name the object (``plan config`` for a fit plan's)."""

    precision: str = "fp32"
    """A name of :data:`memfit.vocab.PRECISIONS`: fp32, bf16-mixed / fp16-mixed (autocast over
    fp32 weights), bf16 / fp16 (weights, gradients and states in 16-bit), fp8."""
    optimizer: str = "adamw"
    """A name of :data:`memfit.vocab.OPTIMIZERS` (8-bit variants: 2 bytes/param of state)."""
    checkpointing: str = "none"
    """none, selective (recompute cheap ops), torchtitan (also every second matmul),
    selective-attn (the planner's attention-only recompute), full (recompute each block) or
    budget (the fewest blocks that keep the activations under ``checkpoint_budget_bytes``)."""
    checkpoint_budget_bytes: int | None = None
    """The activation budget of ``checkpointing="budget"``."""
    checkpoint_modes: tuple[str | None, ...] | None = None
    """Per block, what a budget resolved to (``full``/``selective``/None), so that applying the
    recipe needs no profiling."""
    micro_batch: int = 1
    """Samples per forward/backward on each data-parallel rank: it is how the step is cut
    (the guard and the accumulation split the batch by it), not a property of the model."""
    accumulation: int = 1
    """Micro-batches per optimizer step (a pipeline's micro-batches)."""
    offload_states: bool = False
    """Optimizer states (and their step) in host memory: no state memory on the device."""
    offload_activations: bool = False
    """Saved activations to host memory during the forward, back for the backward."""
    offload_params: bool = False
    """Parameters in host memory, fetched per block (ZeRO-Infinity, FSDP2 CPUOffloadPolicy)."""
    offload_gradients: bool = False
    """Gradients in host memory (ZeRO-Offload's and FSDP2's offload move them with the
    states)."""
    offload_to: str = "cpu"
    """Where offloaded tensors go: cpu, or nvme (ZeRO-Infinity's NVMe tier, DeepSpeed only)."""
    attention: str = "model"
    """One of :data:`ATTENTIONS`."""
    chunked_loss: bool = False
    """Cross-entropy over sequence chunks: the full logits are never materialized."""
    weight_quant: str = "none"
    """Weight-only quantization of the linear layers (inference): none, int8, int4."""
    lora_rank: int | None = None
    """LoRA adapters of this rank on a frozen base; None: every weight trains."""
    lora_targets: tuple[str, ...] = ("q", "k", "v", "o")
    """The linear layers that get adapters: memfit's short names (:data:`LORA_TARGETS`, the
    ``<name>_proj`` layers, all the formulas take), a model's own layer names matched as peft's
    ``target_modules`` matches them (the full dotted name or its last components), or
    ``("all-linear",)``: every ``nn.Linear`` but the head. Checked against the model where it
    is applied or planned."""
    qlora: bool = False
    """The frozen base in 4-bit NF4 (QLoRA); needs ``lora_rank``."""
    kv_cache_dtype: str | None = None
    """Inference: the KV cache's format (:data:`KV_DTYPES`); None follows the precision."""
    engine: str = "auto"
    """One of :data:`ENGINES`."""
    parallel: Parallel | None = None
    """The multi-GPU layout; None: one device (no layout)."""

    def __post_init__(self) -> None:
        where = self.where
        for kind, label in _NAMED:
            value = getattr(self, kind)
            if not isinstance(value, str):
                raise MemfitError(f"{where}: {kind} must be a name, got {value!r}")
            try:
                vocab.check(kind, value, None, what=label)
            except MemfitError as exc:
                raise MemfitError(f"{where}: {exc}") from None
        _choice(where, "attention", self.attention, ATTENTIONS)
        _choice(where, "offload target", self.offload_to, OFFLOAD_TARGETS)
        _choice(where, "weight quantization", self.weight_quant, WEIGHT_QUANTS)
        _choice(where, "engine", self.engine, ENGINES)
        if self.kv_cache_dtype is not None:
            _choice(where, "KV cache dtype", self.kv_cache_dtype, KV_DTYPES)
        for name in ("micro_batch", "accumulation"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MemfitError(f"{where}: {name} must be a positive integer, got {value!r}")
        for name in ("offload_states", "offload_activations", "offload_params",
                     "offload_gradients", "chunked_loss", "qlora"):
            if not isinstance(getattr(self, name), bool):
                raise MemfitError(f"{where}: {name} must be true or false, got "
                                  f"{getattr(self, name)!r}")
        self._check_checkpointing()
        self._check_lora()
        if self.parallel is not None and not isinstance(self.parallel, Parallel):
            raise MemfitError(f"{where}: parallel must be a memfit.Parallel, not "
                              f"{type(self.parallel).__name__}")

    def _check_checkpointing(self) -> None:
        budget = self.checkpoint_budget_bytes
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)
                                   or budget < 1):
            raise MemfitError(f"{self.where}: checkpoint_budget_bytes must be a positive "
                              f"integer, got {budget!r}")
        if self.checkpointing == "budget" and budget is None and self.checkpoint_modes is None:
            raise MemfitError(f"{self.where}: checkpointing='budget' needs a positive "
                              "checkpoint_budget_bytes (or the checkpoint_modes it resolved to)")
        modes = self.checkpoint_modes
        if modes is not None and (not isinstance(modes, tuple)
                                  or any(m not in CHECKPOINT_MODES for m in modes)):
            raise MemfitError(f"{self.where}: checkpoint_modes must be a list of 'full', "
                              "'selective' or null")

    def _check_lora(self) -> None:
        rank = self.lora_rank
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
            raise MemfitError(f"{self.where}: lora_rank must be a positive integer, got {rank!r}")
        if self.qlora and rank is None:
            raise MemfitError(f"{self.where}: qlora trains LoRA adapters on a 4-bit base; give "
                              "lora_rank")
        targets = self.lora_targets
        if (not isinstance(targets, tuple) or not targets
                or not all(isinstance(t, str) and t.strip() == t and t for t in targets)):
            raise MemfitError(f"{self.where}: lora_targets must be a non-empty tuple of layer "
                              f"names ({', '.join(LORA_TARGETS)}, a model's own, or "
                              f"'all-linear'), got {targets!r}")

    def check_layer(self, layer: str) -> None:
        """Raise MemfitError unless ``layer`` (:data:`memfit.vocab.LAYERS`: plan, trace, fit,
        apply) takes this recipe's precision, optimizer and checkpointing policy."""
        _check_names(layer, {kind: getattr(self, kind) for kind, _ in _NAMED})

    @classmethod
    def for_layer(cls, layer: str, **fields: Any) -> Recipe:
        """``cls(**fields)``, its precision, optimizer and checkpointing policy checked first
        against what ``layer`` takes (:meth:`check_layer`), so that a name only another layer
        takes says where it works, and an unknown one lists this layer's names."""
        _check_names(layer, fields)
        return cls(**fields)

    @property
    def global_batch_per_rank(self) -> int:
        """Samples per optimizer step on each data-parallel rank: micro-batch x accumulation."""
        return self.micro_batch * self.accumulation

    @property
    def offloads(self) -> bool:
        """Whether anything is offloaded."""
        return (self.offload_states or self.offload_activations or self.offload_params
                or self.offload_gradients)

    def as_recipe(self) -> Recipe:
        """This object as a plain :class:`Recipe` (a subclass's own fields dropped)."""
        from dataclasses import fields

        return Recipe(**{f.name: getattr(self, f.name) for f in fields(Recipe)})
