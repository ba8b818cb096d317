"""Which modules are a model's identical blocks, and when two calls of them are the same: the
blocks a model's replay may use (:func:`_blocks_of`, at least :data:`MIN_BLOCKS`), the
signatures of a block's arguments (:func:`_signature`, :func:`_meta_signature`,
:func:`_matches`), and a ledger window's module names relative to its block
(:func:`_relative`), so that one block's template serves another (Note: [replaying identical
blocks] in ``blocks.py``).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from memfit.trace.replay_windows import _Window

MIN_BLOCKS = 4
"""Fewer blocks leave nothing to replay (blocks 0, 1 and N-1 always run)."""


def _relative(window: _Window | None, prefix: str, blocks: frozenset[str]
              ) -> _Window | None:
    """``window`` with its module names as indices into ``window.names``: ``(True, rest)`` for
    a name inside block ``prefix`` (``rest`` after the prefix), ``(False, name)`` for one
    outside every block (a function called in the block but attributed by autograd's hooks to
    an outer module). None where a name is inside another block."""
    if window is None:
        return None
    index: dict[str, int] = {}
    names: list[tuple[bool, str]] = []

    def of(name: str) -> int | None:
        k = index.get(name)
        if k is None:
            if name == prefix or name.startswith(prefix + "."):
                entry = (True, name[len(prefix):])
            elif _inside(name, blocks):
                return None
            else:
                entry = (False, name)
            k = index[name] = len(names)
            names.append(entry)
        return k

    events = []
    for e in window.events:
        if e[0] == "a":
            k = of(e[2])
            if k is None:
                return None
            events.append(("a", e[1], k))
        else:
            events.append(e)
    ops = []
    for func, module, count in window.ops:
        k = of(module)
        if k is None:
            return None
        ops.append((func, k, count))
    window.events, window.ops, window.names = events, ops, names
    return window


def _inside(name: str, blocks: frozenset[str]) -> bool:
    """Whether module ``name`` is one of ``blocks`` or inside one."""
    parts = name.split(".")
    return any(".".join(parts[:k]) in blocks for k in range(1, len(parts) + 1))


def _names_for(window: _Window, prefix: str) -> list[str]:
    return [prefix + name if rel else name for rel, name in window.names]


def _same_window(a: _Window, b: _Window) -> bool:
    return (a.events == b.events and a.ops == b.ops and a.survivors == b.survivors
            and a.real_local == b.real_local and a.meta == b.meta and a.names == b.names)


_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)


def _signature(obj: Any) -> Any:
    """What identifies a block's argument without keeping it alive (a kept tensor would live
    longer than in the real run): tensors and other objects by weak reference, sequences by
    their items, plain values by value. None where there is no such handle."""
    if isinstance(obj, _PLAIN):
        return ("v", type(obj), obj)
    if isinstance(obj, tuple | list):
        items = [_signature(o) for o in obj]
        return None if any(i is None for i in items) else ("s", type(obj), items)
    if type(obj) is dict:
        values = {k: _signature(v) for k, v in obj.items()}
        return None if any(v is None for v in values.values()) else ("d", values)
    try:
        return ("r", weakref.ref(obj))
    except TypeError:
        return None


def _meta_signature(obj: Any) -> Any:
    """The metadata of a block's arguments (tensors by shape, strides, dtype, device and
    whether they need grad), to compare arguments of different steps."""
    if isinstance(obj, torch.Tensor):
        return ("t", tuple(obj.shape), tuple(obj.stride()), obj.dtype, obj.device.type,
                obj.requires_grad)
    if isinstance(obj, _PLAIN):
        return ("v", type(obj), obj)
    if isinstance(obj, tuple | list):
        return ("s", type(obj), [_meta_signature(o) for o in obj])
    if type(obj) is dict:
        return ("d", {k: _meta_signature(v) for k, v in obj.items()})
    return ("o", type(obj))


def _holds_objects(obj: Any) -> bool:
    """Whether ``obj`` (a block's arguments) holds anything but tensors and plain values."""
    if isinstance(obj, (torch.Tensor, *_PLAIN)):
        return False
    if isinstance(obj, tuple | list):
        return any(_holds_objects(o) for o in obj)
    if type(obj) is dict:
        return any(_holds_objects(o) for o in obj.values())
    return True


def _matches(sig: Any, obj: Any) -> bool:
    """Whether ``obj`` is what ``sig`` (from :func:`_signature`) identified: the same objects,
    or equal plain values."""
    kind = sig[0]
    if kind == "v":
        return type(obj) is sig[1] and obj == sig[2]
    if kind == "s":
        return (type(obj) is sig[1] and len(obj) == len(sig[2])
                and all(_matches(s, o) for s, o in zip(sig[2], obj, strict=True)))
    if kind == "d":
        return (type(obj) is dict and obj.keys() == sig[1].keys()
                and all(_matches(s, obj[k]) for k, s in sig[1].items()))
    return sig[1]() is obj


def _blocks_of(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's repeated blocks when they are replayable in principle: four or more modules
    of one class in one container, with parameters and buffers of the same names and
    metadata, no hooks of the user's inside them, no tensor subclasses (FSDP, DTensor)."""
    from memfit.errors import MemfitError
    from memfit.models.anatomy import find_blocks

    try:
        names = find_blocks(model)
    except MemfitError:
        return []
    if len(names) < MIN_BLOCKS:
        return []
    modules = dict(model.named_modules())
    blocks = [(n, modules[n]) for n in names if n in modules]
    if len(blocks) != len(names) or len({type(m) for _, m in blocks}) != 1:
        return []
    g = torch.nn.modules.module
    if (g._global_forward_hooks or g._global_forward_pre_hooks or g._global_backward_hooks
            or g._global_backward_pre_hooks):
        return []  # they would not run inside a replayed block

    def signature(m: nn.Module) -> tuple[Any, ...]:
        out = []
        for name, t in (*m.named_parameters(), *m.named_buffers()):
            if type(t) not in (torch.nn.Parameter, torch.Tensor) and not _is_plain_fake(t):
                return ("subclass",)
            out.append((name, tuple(t.shape), tuple(t.stride()), t.dtype, t.requires_grad))
        for sub in m.modules():
            if (sub._forward_hooks or sub._forward_pre_hooks or sub._backward_hooks
                    or sub._backward_pre_hooks):
                return ("hooks",)
        return tuple(out)

    first = signature(blocks[0][1])
    if first and first[0] in ("subclass", "hooks"):
        return []
    if any(signature(m) != first for _, m in blocks[1:]):
        return []
    return blocks


def _is_plain_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return type(t) is FakeTensor or (isinstance(t, torch.nn.Parameter)
                                     and type(t.data) is FakeTensor)
