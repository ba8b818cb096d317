"""What each block of a model saves for backward, measured on fake tensors, and the activation
peak a choice of checkpoint modes gives: the measurements ``Budget`` checkpointing chooses from
(Note: [budget accounting] in :mod:`memfit.techniques.checkpointing`).

>>> profiles = profile_blocks(model, find_blocks(model), batch)
>>> predict_activation_bytes(profiles, ["full"] * len(profiles))  # every block checkpointed
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.utils.checkpoint
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from memfit._tensors import call_model, fake_inputs, fake_model, tensor_leaves
from memfit.trace.fake_rules import grouped_mm_rule

__all__ = [
    "SAVE_OPS",
    "BlockProfile",
    "Mode",
    "activation_bytes",
    "predict_activation_bytes",
    "profile_blocks",
]

aten = torch.ops.aten
SAC_IGNORED_OPS: frozenset[Any] = frozenset(
    getattr(torch.utils.checkpoint, "SAC_IGNORED_OPS", {aten.detach.default}))

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
    ops: int = 0
    """Ops one forward of the block dispatches, less those selective checkpointing's modes pass
    straight through (``torch.utils.checkpoint.SAC_IGNORED_OPS``: ``detach``, size queries)."""
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
            if block >= 0 and func not in SAC_IGNORED_OPS:
                profiles[block].ops += 1
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
            # grouped_mm_rule: transformers' MoE experts' fp32 grouped matmuls, as the trace
            # runs them (Note: [grouped_mm on fake tensors]; `memfit fit mixtral-8x7b` failed
            # here on torch's bf16-only meta check)
            with (torch.enable_grad(), flops, Producers(), grouped_mm_rule(),
                  torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)):
                out = call_model(fmodel, finputs)
                del out
        finally:
            for h in handles:
                h.remove()
    _finish(profiles, flops.get_flop_counts(), type(fmodel).__name__, producer,
            any(t.device.type == "cpu" for t in tensor_leaves(finputs)), outside)
    return profiles


def _finish(profiles: list[BlockProfile], counts: Any, root: str,
            producer: dict[int, tuple[Any, int, int]], on_cpu: bool,
            outside: dict[int, int]) -> None:
    """The profiles' FLOPs, selective checkpointing's saved set and the RNG state copies, from
    what :func:`profile_blocks`'s forward recorded."""
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
    rng = torch.get_rng_state().untyped_storage().nbytes() if on_cpu else 0
    for i, p in enumerate(profiles):
        if rng:
            p.inputs[-1 - i] = p.selective[-1 - i] = rng
    if profiles:
        profiles[0].other = outside
