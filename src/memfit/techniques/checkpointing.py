"""Activation checkpointing: find the repeated blocks, wrap them in place, pick what to recompute.

>>> plan = apply_activation_checkpointing(model, policy="full")          # every block
>>> plan = apply_activation_checkpointing(model, policy="selective")     # keep matmul outputs
>>> plan = apply_activation_checkpointing(model, policy="torchtitan")    # every second mm too
>>> plan = apply_activation_checkpointing(model, policy=OpPolicy(save={aten.mm.default}))
>>> plan = apply_activation_checkpointing(model, policy=EveryK(2))       # blocks 0, 2, 4, ...
>>> plan = apply_activation_checkpointing(model, policy=Budget(2 * 2**30), inputs=batch)

Blocks are found without help when the model has a ``ModuleList`` (or a ``Sequential`` of two or
more modules) of one type (``model.layers``, ``transformer.h``, ``blocks``): the one holding the
most parameters. ``blocks=`` overrides it with a container's or blocks' names, or block types.

A checkpointed block runs under non-reentrant ``torch.utils.checkpoint.checkpoint``: its forward
saves nothing for backward except its inputs, and backward runs its forward again (the recompute).
``selective`` passes a ``context_fn`` from ``create_selective_checkpoint_contexts`` whose policy
keeps the outputs of matmuls and attention (the expensive ops) and recomputes the rest (norms,
activations, residual adds, dropout masks are regenerated from the saved RNG state).
``torchtitan`` is torchtitan's op-level policy (Note: [torchtitan's op-level policy]), and
:class:`OpPolicy` any save list with a rule.

Note: [torchtitan's op-level policy] torchtitan's selective checkpointing saves the outputs of
the ops in its save list except every second ``mm`` of a block's forward, counted in the forward
and in the recompute separately (torchtitan/parallelisms/parallelize_llama.py at d4c86e3, the
code of its published Llama 3.1 runs: ``_save_list`` = mm, the flash and memory-efficient SDPA
kernels, ``_c10d_functional.reduce_scatter_tensor``, abs, max; ``_get_custom_policy``: "Saves
output of all compute ops, except every second mm"; the same rule today in
torchtitan/distributed/activation_checkpoint.py, ``SelectiveAC._wrap_block``). In a Llama block
the mms run q, k, v, o, gate, up, down: q, v, gate and down are kept, k, o and up recomputed.
:data:`TORCHTITAN_SAVE_OPS` adds the cuDNN, CPU-flash and math SDPA kernels (torchtitan's list
today has the cuDNN and math ones), so that the attention output is kept on every backend.

Note: [wrapping without renaming] A block is wrapped by giving *the instance* a ``forward`` that
calls its class's forward under checkpoint, instead of replacing it with a wrapper module
(``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``, as torchtitan does). Parameter
names, ``state_dict`` keys and optimizer parameter groups are unchanged, so checkpoints saved with
and without checkpointing load into each other, and the private torch module is not needed.
``remove_activation_checkpointing`` undoes it.

Note: [budget accounting] ``Budget(bytes)`` bounds the *activation peak* of eager training, in
this model: the bytes saved for backward at the end of the forward pass (every storage counted
once) plus, during backward, the largest extra that recomputing one checkpointed block brings back.
Per block it is measured by running the model's forward once on fake tensors (no memory, no
compute; :func:`memfit.techniques.block_profile.profile_blocks`) with saved-tensor hooks: ``A``
the block saves without checkpointing, ``K`` its inputs (what full checkpointing keeps), ``S``
its inputs plus its matmul/attention outputs (what ``selective`` keeps). The recompute cost of
a full checkpoint is the block's forward FLOPs (``FlopCounterMode``); of a selective one, one
FLOP per element written by the cheap ops. The choice is greedy: repeatedly take the change
(none -> selective -> full) that removes the most bytes per FLOP recomputed, until the
prediction fits.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from memfit.errors import MemfitError, suggest
from memfit.models.anatomy import find_blocks
from memfit.techniques.block_profile import (
    SAVE_OPS,
    BlockProfile,
    Mode,
    predict_activation_bytes,
    profile_blocks,
)

__all__ = [
    "TORCHTITAN_SAVE_OPS",
    "Budget",
    "CheckpointPlan",
    "EveryK",
    "Full",
    "OpPolicy",
    "Policy",
    "Selective",
    "Torchtitan",
    "apply_activation_checkpointing",
    "remove_activation_checkpointing",
]

log = logging.getLogger("memfit")


def _selective_policy(_ctx: Any, func: Any, *_args: Any, **_kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if func in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context() -> tuple[Any, Any]:
    return create_selective_checkpoint_contexts(_selective_policy)


aten = torch.ops.aten
MM_OPS: frozenset[Any] = frozenset(op for op in (aten.mm.default, aten.linear.default))
"""The ops torchtitan's rule counts (``mm_ops``: some backends dispatch ``linear`` whole)."""

TORCHTITAN_SAVE_OPS: frozenset[Any] = frozenset(
    op for op in (
        aten.mm.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        getattr(aten, "_scaled_dot_product_cudnn_attention", None)
        and aten._scaled_dot_product_cudnn_attention.default,
        getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
        and aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_attention_math.default,
        getattr(getattr(torch.ops, "_c10d_functional", None), "reduce_scatter_tensor", None)
        and torch.ops._c10d_functional.reduce_scatter_tensor.default,
        aten.abs.default,
        aten.max.default,
    ) if op is not None
)
"""torchtitan's ``_save_list`` (Note: [torchtitan's op-level policy])."""


def recompute_every_second_mm(func: Any, n: int) -> bool:
    """torchtitan's rule: keep the 1st, 3rd, 5th, ... ``mm`` of a block's forward, recompute
    the 2nd, 4th, ...; every other op of the save list is kept."""
    return func not in MM_OPS or n % 2 == 1


# -- policies ------------------------------------------------------------------------------------

class Policy:
    """Which blocks to checkpoint, and how. Subclasses override :meth:`choose`."""

    def choose(self, blocks: Sequence[str], profile: Callable[[], list[BlockProfile]]
               ) -> list[Mode | None]:
        """One entry per block: ``"full"``, ``"selective"`` or ``None`` (leave it alone).
        ``profile()`` measures the blocks (costly: call it only if needed)."""
        raise NotImplementedError

    def context_fn(self) -> Callable[[], tuple[Any, Any]] | None:
        """The ``context_fn`` of its ``"selective"`` blocks (None: memfit's :data:`SAVE_OPS`)."""
        return None


@dataclass(frozen=True)
class Full(Policy):
    """Checkpoint every block: keep only block inputs, recompute each block's whole forward."""

    def choose(self, blocks: Sequence[str], profile: Callable[[], list[BlockProfile]]
               ) -> list[Mode | None]:
        return ["full"] * len(blocks)


@dataclass(frozen=True)
class Selective(Policy):
    """Checkpoint every block but keep matmul/attention outputs (:data:`SAVE_OPS`); recompute
    only the cheap ops."""

    def choose(self, blocks: Sequence[str], profile: Callable[[], list[BlockProfile]]
               ) -> list[Mode | None]:
        return ["selective"] * len(blocks)


@dataclass(frozen=True)
class OpPolicy(Policy):
    """Checkpoint every block, keeping the outputs of the ops in ``save`` for which ``rule``
    says so, and recomputing every other op: your own op-level selective checkpointing.

    >>> aten = torch.ops.aten
    >>> policy = OpPolicy(save=frozenset({aten.mm.default}), rule=lambda op, n: n % 3 != 0)

    Known limitations: the rule sees the op and its call count only (torchtitan's also reads
    the weight's shape to force-recompute MoE router gates)."""

    save: frozenset[Any] = SAVE_OPS
    """The ops whose outputs may be kept (``torch.ops.aten.mm.default``, ...); each kept
    output costs its bytes until the block's backward and saves recomputing it."""
    rule: Callable[[Any, int], bool] | None = None
    """``rule(op, n)``: keep this call's output, ``n`` counting the calls of ``op`` in the
    block's forward from 1 (the recompute counts its own, so it decides the same). None: keep
    every call of an op in ``save``."""

    def __post_init__(self) -> None:
        if not self.save:
            raise MemfitError("OpPolicy(save=...): give at least one op to keep, e.g. "
                              "frozenset({torch.ops.aten.mm.default}); use 'full' to keep none")
        if self.rule is not None and not callable(self.rule):
            raise MemfitError(f"OpPolicy(rule=...): a function (op, n) -> bool, got "
                              f"{self.rule!r}")

    def choose(self, blocks: Sequence[str], profile: Callable[[], list[BlockProfile]]
               ) -> list[Mode | None]:
        return ["selective"] * len(blocks)

    def context_fn(self) -> Callable[[], tuple[Any, Any]]:
        save, rule = self.save, self.rule

        def contexts() -> tuple[Any, Any]:
            counts: dict[tuple[bool, Any], int] = {}  # one count per block call

            def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
                if func not in save:
                    return CheckpointPolicy.PREFER_RECOMPUTE
                key = (bool(ctx.is_recompute), func)
                counts[key] = counts.get(key, 0) + 1
                if rule is None or rule(func, counts[key]):
                    return CheckpointPolicy.MUST_SAVE
                return CheckpointPolicy.PREFER_RECOMPUTE

            return create_selective_checkpoint_contexts(policy)

        return contexts


@dataclass(frozen=True)
class Torchtitan(OpPolicy):
    """torchtitan's op-level selective checkpointing: keep matmul and attention outputs except
    every second ``mm`` of each block (Note: [torchtitan's op-level policy])."""

    save: frozenset[Any] = TORCHTITAN_SAVE_OPS
    rule: Callable[[Any, int], bool] | None = recompute_every_second_mm


@dataclass(frozen=True)
class EveryK(Policy):
    """Fully checkpoint blocks ``0, k, 2k, ...`` (torchtitan's ``selective_ac_option="k"``)."""

    k: int
    """Checkpoint one block in every ``k``: 1 is ``Full``; larger saves less memory, recomputes
    less."""

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise MemfitError(f"EveryK(k): k must be a positive integer, got {self.k!r}; "
                              "EveryK(1) checkpoints every block, EveryK(2) every other one")

    def choose(self, blocks: Sequence[str], profile: Callable[[], list[BlockProfile]]
               ) -> list[Mode | None]:
        return ["full" if i % self.k == 0 else None for i in range(len(blocks))]


@dataclass(frozen=True)
class Budget(Policy):
    """Checkpoint as little as possible so the predicted activation peak of eager training stays
    under ``bytes`` (see Note: [budget accounting]). Needs ``inputs=`` in
    :func:`apply_activation_checkpointing`.

    Known limitations: the prediction is for the forward as traced with the given inputs (same
    shapes, same autocast); the recompute cost of cheap ops is counted as one FLOP per element.
    """

    bytes: int
    """The activation budget in bytes (saved-for-backward bytes plus the recompute transient)."""
    allow_selective: bool = True
    """Consider selective checkpointing of a block before full checkpointing."""

    def __post_init__(self) -> None:
        if isinstance(self.bytes, bool) or not isinstance(self.bytes, int) or self.bytes <= 0:
            raise MemfitError(f"Budget(bytes): bytes must be a positive integer, got "
                              f"{self.bytes!r}; e.g. Budget(4 * 2**30) for 4 GiB")

    def choose(self, blocks: Sequence[str], profile: Callable[[], list[BlockProfile]]
               ) -> list[Mode | None]:
        profiles = profile()
        modes: list[Mode | None] = [None] * len(profiles)
        floor = predict_activation_bytes(profiles, ["full"] * len(profiles))
        if floor > self.bytes:
            raise MemfitError(
                f"activation budget {self.bytes:,} bytes cannot be met: even checkpointing "
                f"every block needs {floor:,} bytes; raise the budget, lower the batch size or "
                f"sequence length, or add activation offload (offload_activations)")
        steps: tuple[Mode, ...] = ("selective", "full") if self.allow_selective else ("full",)
        # Greedy on the kept bytes (additive over blocks): the recompute transient is paid once,
        # for the largest checkpointed block, so a first step may not lower the total at all.
        while predict_activation_bytes(profiles, modes) > self.bytes:
            best: tuple[float, int, int, Mode] | None = None
            for i, p in enumerate(profiles):
                for mode in steps:
                    if _rank(mode) <= _rank(modes[i]):
                        continue
                    saved = _nbytes(p.kept(modes[i])) - _nbytes(p.kept(mode))
                    cost = p.recompute_flops(mode) - p.recompute_flops(modes[i])
                    if saved > 0 and (best is None or (saved / max(cost, 1), saved)
                                      > (best[0], best[1])):
                        best = (saved / max(cost, 1), saved, i, mode)
            if best is None:  # nothing left to checkpoint: cannot happen above the floor
                modes = ["full"] * len(profiles)
                break
            modes[best[2]] = best[3]
        # Then undo what the budget does not need, the most recompute first.
        order = sorted(range(len(profiles)), key=lambda i: -profiles[i].recompute_flops(modes[i]))
        for i in order:
            for lower in (None, "selective") if modes[i] == "full" else (None,):
                if not self.allow_selective and lower == "selective":
                    continue
                trial = [*modes[:i], lower, *modes[i + 1:]]
                if predict_activation_bytes(profiles, trial) <= self.bytes:
                    modes = trial
                    break
        return modes


def _nbytes(storages: Mapping[int, int]) -> int:
    return sum(storages.values())


def _rank(mode: Mode | None) -> int:
    return {None: 0, "selective": 1, "full": 2}[mode]


POLICIES: dict[str, Callable[[], Policy]] = {"full": Full, "selective": Selective,
                                             "torchtitan": Torchtitan}


def _policy(policy: str | Policy) -> Policy:
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str) and policy in POLICIES:
        return POLICIES[policy]()
    name = str(policy)
    raise MemfitError(f"unknown checkpointing policy {policy!r}{suggest(name, POLICIES)}; valid: "
                      "'full', 'selective', 'torchtitan', EveryK(k), Budget(bytes), "
                      "OpPolicy(save, rule)")


# -- wrapping ------------------------------------------------------------------------------------

def _checkpointed_forward(forward: Callable[..., Any], mode: Mode,
                          context_fn: Callable[[], tuple[Any, Any]] | None, *args: Any,
                          **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():  # inference: nothing is saved, nothing to recompute
        return forward(*args, **kwargs)
    if mode != "selective":
        context_fn = _noop_context
    elif context_fn is None:
        context_fn = _selective_context
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def _noop_context() -> tuple[Any, Any]:
    return contextlib.nullcontext(), contextlib.nullcontext()


def _wrap(module: nn.Module, mode: Mode,
          context_fn: Callable[[], tuple[Any, Any]] | None = None) -> None:
    # Wrap the forward the module has now (another technique may have given it one), and
    # remember it for remove_activation_checkpointing.
    previous = vars(module).get("forward")
    module.forward = functools.partial(  # type: ignore[method-assign]
        _checkpointed_forward, module.forward, mode, context_fn)
    module._memfit_checkpoint = (mode, previous)  # type: ignore[assignment]


def remove_activation_checkpointing(model: nn.Module) -> int:
    """Undo :func:`apply_activation_checkpointing`; returns how many blocks were unwrapped."""
    count = 0
    for mod in model.modules():
        state = vars(mod).get("_memfit_checkpoint")
        if state is not None:
            _, previous = state
            if previous is None:
                del mod.forward
            else:
                mod.forward = previous  # type: ignore[method-assign]
            del mod._memfit_checkpoint
            count += 1
    return count


@dataclass(frozen=True)
class CheckpointPlan:
    """What :func:`apply_activation_checkpointing` did."""

    blocks: tuple[str, ...]
    """Names of the candidate blocks, in order."""
    modes: tuple[Mode | None, ...]
    """Per block: ``"full"``, ``"selective"`` or ``None`` (not checkpointed)."""
    predicted_activation_bytes: int | None = None
    """For ``Budget``: the predicted activation peak (see Note: [budget accounting])."""
    profiles: tuple[BlockProfile, ...] = ()
    """For ``Budget``: the per-block measurements the choice was made from."""

    @property
    def checkpointed(self) -> tuple[str, ...]:
        return tuple(b for b, m in zip(self.blocks, self.modes, strict=True) if m)

    def summary(self) -> str:
        full = sum(m == "full" for m in self.modes)
        sel = sum(m == "selective" for m in self.modes)
        text = (f"activation checkpointing: {full} full + {sel} selective of "
                f"{len(self.blocks)} blocks")
        if self.predicted_activation_bytes is not None:
            text += f", predicted activation peak {self.predicted_activation_bytes:,} bytes"
        return text


def apply_activation_checkpointing(
    model: nn.Module,
    policy: str | Policy = "full",
    *,
    blocks: str | type | Sequence[str | type] | None = None,
    inputs: Any = None,
) -> CheckpointPlan:
    """Checkpoint ``model``'s repeated blocks in place and return what was done.

    ``policy``: ``"full"``, ``"selective"``, ``"torchtitan"`` (:class:`Torchtitan`),
    :class:`OpPolicy` (a save list and a rule), :class:`EveryK`, :class:`Budget` (needs
    ``inputs``: the batch as the model takes it, a tensor, tuple or dict; real, meta or fake)
    or your own :class:`Policy`. Applying it again replaces the previous choice. Apply it
    before offload, ``torch.compile`` and sharding (see :mod:`memfit.techniques`).

    >>> plan = apply_activation_checkpointing(model, "selective")
    >>> plan.checkpointed
    ('model.layers.0', 'model.layers.1')
    """
    chosen = _policy(policy)
    names = find_blocks(model, blocks)
    remove_activation_checkpointing(model)
    profiles: list[BlockProfile] = []

    def profile() -> list[BlockProfile]:
        if inputs is None:
            raise MemfitError(f"{type(chosen).__name__} measures the blocks' activations and "
                              "needs the batch: pass inputs=... (a tensor, tuple or dict as the "
                              "model takes it; meta tensors are fine)")
        profiles.extend(profile_blocks(model, names, inputs))
        return profiles

    modes = chosen.choose(names, profile)
    context_fn = chosen.context_fn()
    if len(modes) != len(names):
        raise MemfitError(f"{type(chosen).__name__}.choose returned {len(modes)} modes for "
                          f"{len(names)} blocks; return one per block")
    modules = dict(model.named_modules())
    for name, mode in zip(names, modes, strict=True):
        if mode is not None:
            if mode not in ("full", "selective"):
                raise MemfitError(f"checkpoint mode {mode!r} for block {name!r}; valid: 'full', "
                                  "'selective', None")
            _wrap(modules[name], mode, context_fn)
    if any(mode is not None for mode in modes):
        _no_kv_cache(model)
    predicted = predict_activation_bytes(profiles, modes) if profiles else None
    plan = CheckpointPlan(blocks=tuple(names), modes=tuple(modes),
                          predicted_activation_bytes=predicted, profiles=tuple(profiles))
    log.info("memfit: %s", plan.summary())
    return plan


def _no_kv_cache(model: nn.Module) -> None:
    """Turn off a Hugging Face model's KV cache, as its own ``gradient_checkpointing_enable`` does
    ("`use_cache=True` is incompatible with gradient checkpointing"): the recompute would append
    a block's keys and values to the cache a second time, so it would attend over twice the
    length and, under selective checkpointing, run ops the forward did not (torch's SAC then
    raises "encountered during backward but not found in storage")."""
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        config.use_cache = False  # type: ignore[union-attr]
        log.info("memfit: use_cache=False (a KV cache does not survive checkpoint's recompute)")
