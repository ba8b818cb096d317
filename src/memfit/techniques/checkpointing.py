"""Activation checkpointing: find the repeated blocks, wrap them in place, pick what to recompute.

>>> plan = apply_activation_checkpointing(model, policy="full")          # every block
>>> plan = apply_activation_checkpointing(model, policy="selective")     # keep matmul outputs
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
compute) with saved-tensor hooks: ``A`` the block saves without checkpointing, ``K`` its inputs
(what full checkpointing keeps), ``S`` its inputs plus its matmul/attention outputs (what
``selective`` keeps). The recompute cost of a full checkpoint is the block's forward FLOPs
(``FlopCounterMode``); of a selective one, one FLOP per element written by the cheap ops. The
choice is greedy: repeatedly take the change (none -> selective -> full) that removes the most
bytes per FLOP recomputed, until the prediction fits.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)
from torch.utils.flop_counter import FlopCounterMode

from memfit._tensors import call_model, fake_inputs, fake_model, tensor_leaves
from memfit.errors import MemfitError, suggest
from memfit.models.anatomy import find_blocks

__all__ = [
    "SAVE_OPS",
    "BlockProfile",
    "Budget",
    "CheckpointPlan",
    "EveryK",
    "Full",
    "Policy",
    "Selective",
    "activation_bytes",
    "apply_activation_checkpointing",
    "find_blocks",
    "predict_activation_bytes",
    "profile_blocks",
    "remove_activation_checkpointing",
]

log = logging.getLogger("memfit")
aten = torch.ops.aten

Mode = Literal["full", "selective"]

# Ops whose outputs ``selective`` keeps: the matmuls and attention kernels (the FLOPs). Every other
# op inside a checkpointed block is recomputed in backward.
SAVE_OPS: frozenset[Any] = frozenset(
    op for op in (
        aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        getattr(aten, "_scaled_dot_product_cudnn_attention", None)
        and aten._scaled_dot_product_cudnn_attention.default,
        getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
        and aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_attention_math.default,
        aten.convolution.default,
    ) if op is not None
)


def _selective_policy(_ctx: Any, func: Any, *_args: Any, **_kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if func in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context() -> tuple[Any, Any]:
    return create_selective_checkpoint_contexts(_selective_policy)


# -- policies ------------------------------------------------------------------------------------

class Policy:
    """Which blocks to checkpoint, and how. Subclasses override :meth:`choose`."""

    def choose(self, blocks: Sequence[str], profile: Callable[[], list[BlockProfile]]
               ) -> list[Mode | None]:
        """One entry per block: ``"full"``, ``"selective"`` or ``None`` (leave it alone).
        ``profile()`` measures the blocks (costly: call it only if needed)."""
        raise NotImplementedError


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


POLICIES: dict[str, Callable[[], Policy]] = {"full": Full, "selective": Selective}


def _policy(policy: str | Policy) -> Policy:
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str) and policy in POLICIES:
        return POLICIES[policy]()
    name = str(policy)
    raise MemfitError(f"unknown checkpointing policy {policy!r}{suggest(name, POLICIES)}; valid: "
                      "'full', 'selective', EveryK(k), Budget(bytes)")


# -- wrapping ------------------------------------------------------------------------------------

def _checkpointed_forward(forward: Callable[..., Any], mode: Mode, *args: Any,
                          **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():  # inference: nothing is saved, nothing to recompute
        return forward(*args, **kwargs)
    context_fn = _selective_context if mode == "selective" else _noop_context
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def _noop_context() -> tuple[Any, Any]:
    return contextlib.nullcontext(), contextlib.nullcontext()


def _wrap(module: nn.Module, mode: Mode) -> None:
    # Wrap the forward the module has now (another technique may have given it one), and
    # remember it for remove_activation_checkpointing.
    previous = vars(module).get("forward")
    module.forward = functools.partial(  # type: ignore[method-assign]
        _checkpointed_forward, module.forward, mode)
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

    ``policy``: ``"full"``, ``"selective"``, :class:`EveryK`, :class:`Budget` (needs ``inputs``:
    the batch as the model takes it, a tensor, tuple or dict; real, meta or fake) or your own
    :class:`Policy`. Applying it again replaces the previous choice. Apply it before offload,
    ``torch.compile`` and sharding (see :mod:`memfit.techniques`).

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
    if len(modes) != len(names):
        raise MemfitError(f"{type(chosen).__name__}.choose returned {len(modes)} modes for "
                          f"{len(names)} blocks; return one per block")
    modules = dict(model.named_modules())
    for name, mode in zip(names, modes, strict=True):
        if mode is not None:
            if mode not in ("full", "selective"):
                raise MemfitError(f"checkpoint mode {mode!r} for block {name!r}; valid: 'full', "
                                  "'selective', None")
            _wrap(modules[name], mode)
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


# -- measuring blocks ------------------------------------------------------------------------------

@dataclass
class BlockProfile:
    """Activation storages of one block, measured on fake tensors; keys are storage ids."""

    name: str
    saved: dict[int, int] = field(default_factory=dict)
    """Storages the block saves for backward uncheckpointed (``A``): id -> bytes."""
    inputs: dict[int, int] = field(default_factory=dict)
    """Storages of the block's tensor inputs (``K``: what full checkpointing keeps)."""
    selective: dict[int, int] = field(default_factory=dict)
    """Inputs plus matmul/attention outputs (``S``: what selective checkpointing keeps)."""
    forward_flops: int = 0
    """Matmul/attention FLOPs of one forward of the block (``FlopCounterMode``)."""
    cheap_flops: int = 0
    """Elements written by the block's other ops (the selective recompute, one FLOP each)."""
    other: dict[int, int] = field(default_factory=dict)
    """Only on the first profile: storages saved outside every block (embeddings, head, loss)."""

    def kept(self, mode: Mode | None) -> dict[int, int]:
        return {None: self.saved, "full": self.inputs, "selective": self.selective}[mode]

    def recompute_flops(self, mode: Mode | None) -> int:
        return {None: 0, "full": self.forward_flops + self.cheap_flops,
                "selective": self.cheap_flops}[mode]


def predict_activation_bytes(profiles: Sequence[BlockProfile],
                             modes: Sequence[Mode | None]) -> int:
    """The activation peak for a choice of modes (see Note: [budget accounting])."""
    kept, transient = activation_bytes(profiles, modes)
    return kept + transient


def activation_bytes(profiles: Sequence[BlockProfile],
                     modes: Sequence[Mode | None]) -> tuple[int, int]:
    """``(kept, transient)``: bytes saved for backward at the end of the model's forward, and the
    most that recomputing one checkpointed block adds back in backward."""
    kept: dict[int, int] = {}
    for p in profiles:
        kept.update(p.other)
    transient = 0
    for p, mode in zip(profiles, modes, strict=True):
        kept.update(p.kept(mode))
        if mode is not None:
            kept_here = p.kept(mode)
            transient = max(transient, sum(n for k, n in p.saved.items() if k not in kept_here))
    return sum(kept.values()), transient


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def profile_blocks(model: nn.Module, blocks: Sequence[str], inputs: Any) -> list[BlockProfile]:
    """Measure each block's saved activations and FLOPs by running ``model``'s forward once on
    fake tensors (a structural copy: the model is not touched, nothing real is allocated).

    The forward runs as the caller would run it (under the caller's autocast, if any).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    profiles = [BlockProfile(name) for name in blocks]
    index = {name: i for i, name in enumerate(blocks)}
    current: list[int] = []
    outside: dict[int, int] = {}
    first_seen: set[int] = set()
    producer: dict[int, tuple[Any, int, int]] = {}  # storage -> (op, block or -1, bytes)
    constant: set[int] = set()
    alive: list[torch.Tensor] = []  # keeps fake storages alive so their ids are never reused

    class Producers(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            block = current[-1] if current else -1
            for t in tensor_leaves(out if isinstance(out, tuple | list) else [out]):
                alive.append(t)
                key = _storage_key(t)
                if key not in producer and key not in constant:
                    producer[key] = (func, block, t.untyped_storage().nbytes())
                    if block >= 0 and func not in SAVE_OPS and t.is_floating_point():
                        profiles[block].cheap_flops += t.numel()
            return out

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key in constant or key in first_seen:
            return t
        first_seen.add(key)
        nbytes = t.untyped_storage().nbytes()
        if current:
            profiles[current[-1]].saved[key] = nbytes
        else:
            outside[key] = nbytes
        return t

    def pre(i: int) -> Callable[..., None]:
        def hook(_m: nn.Module, args: Any, kwargs: Any) -> None:
            current.append(i)
            for t in tensor_leaves((args, kwargs)):
                key = _storage_key(t)
                if key not in constant and not any(key in p.inputs for p in profiles):
                    profiles[i].inputs[key] = t.untyped_storage().nbytes()
        return hook

    def post(_m: nn.Module, _args: Any, _kwargs: Any, _out: Any) -> None:
        current.pop()

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_mode:
        # Each tensor on its own device (the CPU for a meta one).
        fmodel = fake_model(model, None)
        weights = [*fmodel.parameters(), *fmodel.buffers()]
        finputs = fake_inputs(inputs, None)
        for t in [*weights, *tensor_leaves(finputs)]:
            constant.add(_storage_key(t))
        fmods = dict(fmodel.named_modules())
        handles = []
        for name in blocks:
            handles.append(fmods[name].register_forward_pre_hook(pre(index[name]),
                                                                 with_kwargs=True))
            handles.append(fmods[name].register_forward_hook(post, with_kwargs=True))
        flops = FlopCounterMode(display=False)
        try:
            with (torch.enable_grad(), flops, Producers(),
                  torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)):
                out = call_model(fmodel, finputs)
                del out
        finally:
            for h in handles:
                h.remove()
    counts = flops.get_flop_counts()
    root = type(fmodel).__name__
    for p in profiles:
        p.forward_flops = int(sum(counts.get(f"{root}.{p.name}", {}).values()))
        p.selective = dict(p.inputs)
    # SAC keeps every matmul/attention output made inside the block, also those backward never
    # needed (an output projection feeding a residual add).
    for key, (func, block, nbytes) in producer.items():
        if block >= 0 and func in SAVE_OPS:
            profiles[block].selective[key] = nbytes
    # Note: [checkpoint RNG state] checkpoint(preserve_rng_state=True) keeps a copy of the CPU
    # generator's state per checkpointed call (``torch.get_rng_state()``, about 5 KB): device
    # memory when the model runs on the CPU, host memory otherwise.
    on_cpu = any(t.device.type == "cpu" for t in tensor_leaves(finputs))
    rng = torch.get_rng_state().untyped_storage().nbytes() if on_cpu else 0
    for i, p in enumerate(profiles):
        if rng:
            p.inputs[-1 - i] = p.selective[-1 - i] = rng
    if profiles:
        profiles[0].other = outside
    return profiles
