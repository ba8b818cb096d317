"""A :class:`memfit.Recipe`'s model-side techniques, applied in the documented order (Note:
[composition order] in :mod:`memfit.techniques`): attention, LoRA, chunked loss, activation
checkpointing, activation offload. :func:`memfit.apply_recipe` (then the layout, the precision
and the optimizer) and :func:`memfit.trace_recipe` (then the trace) both run
:func:`apply_techniques`; so do ``memfit validate`` and the gloo measurement."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from memfit.errors import MemfitError
from memfit.recipe import Recipe
from memfit.techniques.block_profile import BlockProfile, Mode
from memfit.techniques.checkpointing import Budget, Policy

__all__ = ["FixedModes", "apply_adapters", "apply_techniques", "checkpoint_policy", "lora_layers"]


@dataclass(frozen=True)
class FixedModes(Policy):
    """Checkpoint exactly the modes the search chose (a ``Budget`` policy resolved once)."""

    modes: tuple[Mode | None, ...]

    def choose(self, blocks: Sequence[str], profile: Callable[[], list[BlockProfile]]
               ) -> list[Mode | None]:
        if len(blocks) != len(self.modes):
            raise MemfitError(f"the plan checkpoints {len(self.modes)} blocks but this model has "
                              f"{len(blocks)}; apply the plan to the model it was made for")
        return list(self.modes)


_NF4_WEIGHTS_PER_BLOCK = 64 * 256
"""torchao's ``to_nf4`` (block_size 64, scaler_block_size 256) asserts that a weight's size
divides into blocks of 64 and their count into blocks of 256."""


def lora_layers(model: nn.Module, targets: tuple[str, ...], *, mode: str = "lora"
                ) -> list[str]:
    """The dotted names of ``model``'s ``nn.Linear`` layers that ``targets`` (a recipe's
    ``lora_targets``) adapt, in module order: ``("all-linear",)``, every linear layer but the
    head (``lm_head``); otherwise each name matched as peft's ``target_modules`` matches it (the
    full dotted name or its last components: ``"q"`` adapts t5's ``...SelfAttention.q``), and a
    short name of :data:`memfit.recipe.LORA_TARGETS` that names no layer of its own adapts the
    ``<name>_proj`` layers (memfit's ``q`` is Llama's ``q_proj``). A name that matches nothing
    is refused in one line that lists the model's linear layers.

    Known limitations: adapters go on ``nn.Linear`` only (not transformers' ``Conv1D`` of
    GPT-2, nor the 3-D expert weights of a grouped MoE, which peft reaches through
    ``target_parameters``)."""
    from memfit.errors import suggest
    from memfit.recipe import LORA_TARGETS
    from memfit.techniques.peft import _targets

    if targets == ("all-linear",):
        return _targets(model, "all-linear")
    linears = [name for name, mod in model.named_modules() if isinstance(mod, nn.Linear)
               and name]
    chosen: set[str] = set()
    missing = []
    for target in targets:
        hits = [n for n in linears if n == target or n.endswith("." + target)]
        if not hits and target in LORA_TARGETS:
            hits = [n for n in linears if n.rsplit(".", 1)[-1] == f"{target}_proj"]
        if not hits:
            missing.append(target)
        chosen.update(hits)
    if missing:
        short = sorted({n.rsplit(".", 1)[-1] for n in linears})
        if all(t in LORA_TARGETS for t in missing):
            raise MemfitError(
                f"--mode {mode}: this model has no {', '.join(f'{t}_proj' for t in missing)} "
                f"layers (it names its projections differently); name its own linear layers in "
                f"--lora-targets (peft's target_modules): {', '.join(short) or 'none'}")
        raise MemfitError(
            f"--mode {mode}: --lora-targets {missing[0]!r} names no linear layer of the model"
            f"{suggest(missing[0], short)}; its linear layers: {', '.join(short) or 'none'}")
    return [n for n in linears if n in chosen]


def apply_adapters(model: nn.Module, recipe: Recipe) -> None:
    """A recipe's LoRA (``lora_rank``; ``memfit plan --mode lora``): the base frozen in bf16
    (as the analytic plan counts it: 16-bit), fp32 adapters of rank ``lora_rank`` on the
    linear layers ``lora_targets`` names (:func:`lora_layers`: by name, as PEFT's
    ``target_modules`` matches them; memfit's ``q`` is every ``q_proj``, a vision tower's
    included).
    ``qlora`` (``--mode qlora``): those layers' weights in NF4 (torchao's ``NF4Tensor``, which
    quantizes meta tensors: bitsandbytes needs real weights; both store 4.1 bits per weight)
    and fp32 adapters; the rest of the base in bf16."""
    import torch

    from memfit.techniques.peft import apply_lora, apply_qlora

    assert recipe.lora_rank is not None

    mode = "qlora" if recipe.qlora else "lora"
    targets = lora_layers(model, recipe.lora_targets, mode=mode)
    if recipe.qlora:
        # As a 4-bit load does (transformers' load_in_4bit): every linear layer but the head is
        # NF4, with or without an adapter; torchao's NF4 takes only whole blocks of weights.
        odd = [(name, tuple(mod.weight.shape)) for name, mod in model.named_modules()
               if type(mod) is nn.Linear and not name.endswith("lm_head")
               and mod.weight.numel() % _NF4_WEIGHTS_PER_BLOCK]
        if odd:
            more = f" (and {len(odd) - 1} more)" if len(odd) > 1 else ""
            raise MemfitError(
                f"--mode qlora: torchao's NF4 quantizes a weight whose size is a "
                f"multiple of {_NF4_WEIGHTS_PER_BLOCK} (blocks of 64 weights, their scales in "
                f"blocks of 256); {odd[0][0]} {'x'.join(map(str, odd[0][1]))}{more} is not: "
                "use --mode lora")
    model.to(torch.bfloat16)
    if recipe.qlora:
        from memfit.models.anatomy import replace_module
        from memfit.techniques.peft import NF4Linear

        adapted = set(targets)
        for name, mod in list(model.named_modules()):
            if (type(mod) is nn.Linear and name not in adapted
                    and not name.endswith("lm_head")):
                replace_module(model, name, NF4Linear(mod))
        apply_qlora(model, rank=recipe.lora_rank, targets=targets, quant_backend="torchao")
    else:
        apply_lora(model, rank=recipe.lora_rank, targets=targets, backend="builtin")
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # adapters train in fp32 under autocast


def checkpoint_policy(recipe: Recipe, *, resolvable: bool = False) -> Policy | str | None:
    """The checkpointing policy of ``recipe``: None (none), its resolved per-block modes, the
    policy's name, or (``resolvable``: the caller has the inputs to profile the blocks with)
    a :class:`~memfit.techniques.checkpointing.Budget` of its budget bytes."""
    if recipe.checkpointing == "none":
        return None
    if recipe.checkpoint_modes is not None:
        return FixedModes(tuple(recipe.checkpoint_modes))  # type: ignore[arg-type]
    if recipe.checkpointing == "budget":
        if resolvable and recipe.checkpoint_budget_bytes is not None:
            return Budget(recipe.checkpoint_budget_bytes)
        raise MemfitError("plan config: checkpointing='budget' needs checkpoint_modes (the "
                          "per-block choice the search made); re-run memfit fit")
    if recipe.checkpointing == "selective-attn":
        raise MemfitError("checkpointing 'selective-attn' is the analytic planner's formula "
                          "(attention scores only); apply 'selective' or 'full'")
    return recipe.checkpointing


def apply_techniques(model: nn.Module, recipe: Recipe, *, inputs: Any = None,
                     offload_min_bytes: int = 1024) -> tuple[str | None, ...] | None:
    """The model-side techniques of ``recipe``, in place, in the documented order: attention,
    LoRA adapters (:func:`apply_adapters`), chunked loss, checkpointing, activation offload.
    ``inputs`` (the batch as the model takes it) lets a ``budget`` without resolved modes be
    resolved by profiling the blocks. ``offload_min_bytes``: the smallest activation the
    offload moves (:func:`memfit.techniques.apply_activation_offload`'s ``min_bytes``).

    Returns the per-block checkpointing modes applied (``full``/``selective``/None per block),
    or None when nothing is checkpointed."""
    from memfit.techniques import (
        apply_activation_checkpointing,
        apply_activation_offload,
        apply_chunked_loss,
        use_sdpa,
    )

    if recipe.attention == "sdpa":
        use_sdpa(model)
    if recipe.lora_rank is not None:
        apply_adapters(model, recipe)
    if recipe.chunked_loss:
        apply_chunked_loss(model)
    modes: tuple[str | None, ...] | None = None
    policy = checkpoint_policy(recipe, resolvable=inputs is not None)
    if policy is not None:
        modes = tuple(apply_activation_checkpointing(model, policy, inputs=inputs).modes)
    if recipe.offload_activations:
        apply_activation_offload(model, min_bytes=offload_min_bytes)
    return modes
