"""Pruned weights (``torch.nn.utils.prune``) in a trace: what pruning keeps, and the note that
says it costs memory.

``prune.l1_unstructured(module, "weight", amount=0.5)`` (and every other method of
``torch.nn.utils.prune``) replaces the parameter ``weight`` with
(``torch/nn/utils/prune.py: BasePruningMethod.apply``):

- ``weight_orig``: the parameter, as large as the weight, with its gradient and optimizer states;
- ``weight_mask``: a buffer of the weight's shape and dtype (``torch.ones_like``: 0 or 1 in the
  weight's dtype, not bools);
- ``weight``: a plain attribute, ``weight_orig * weight_mask``, set at pruning time and
  recomputed by a forward pre-hook before every forward (a new tensor; the old one is freed once
  the new one is set). The backward computes the gradient of that product (weight-sized) and then
  multiplies it by the mask into ``weight_orig``'s gradient.

So a pruned weight holds three weight-sized tensors where the unpruned one held one: the
zeros save nothing until the weight is converted to a sparse layout
(``memfit.techniques.sparsify``). The trace runs the hooks as they are (the fake model keeps
them); :func:`mark_recomputed` files the recomputed weight under ``WEIGHTS`` (it would otherwise
be a forward tensor, an activation) and :func:`note` states the cost.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import prune

from memfit.categories import MemoryCategory
from memfit.trace.tracker import Tracker
from memfit.units import format_bytes


@dataclass(frozen=True)
class PrunedTensor:
    """One pruned tensor of a module: ``module.<name>_orig``, ``<name>_mask`` and ``<name>``."""

    module: str
    name: str
    orig_bytes: int
    mask_bytes: int
    weight_bytes: int

    @property
    def extra_bytes(self) -> int:
        """Held beyond the unpruned weight: the mask and the recomputed weight."""
        return self.mask_bytes + self.weight_bytes


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def pruned_names(module: nn.Module) -> list[str]:
    """The names of ``module``'s own tensors that ``torch.nn.utils.prune`` manages (its pruning
    forward pre-hooks; a tensor pruned twice has one hook, a ``PruningContainer``)."""
    return [hook._tensor_name for hook in module._forward_pre_hooks.values()
            if isinstance(hook, prune.BasePruningMethod)]


def pruned_tensors(model: nn.Module) -> list[PrunedTensor]:
    """Every pruned tensor of ``model``, with its parts' bytes (as the model holds them now).

    >>> lin = nn.Linear(4, 2)
    >>> _ = prune.l1_unstructured(lin, "weight", amount=0.5)
    >>> pruned_tensors(nn.Sequential(lin))
    [PrunedTensor(module='0', name='weight', orig_bytes=32, mask_bytes=32, weight_bytes=32)]
    """
    found = []
    for mod_name, mod in model.named_modules():
        for name in pruned_names(mod):
            orig = getattr(mod, f"{name}_orig")
            mask = getattr(mod, f"{name}_mask")
            weight = getattr(mod, name, None)
            found.append(PrunedTensor(
                module=mod_name, name=name, orig_bytes=_nbytes(orig), mask_bytes=_nbytes(mask),
                weight_bytes=_nbytes(weight) if isinstance(weight, torch.Tensor)
                else _nbytes(orig)))
    return found


def note(model: nn.Module, *, training: bool) -> str | None:
    """The estimate's line on pruning's cost, or None if nothing in ``model`` is pruned."""
    found = pruned_tensors(model)
    if not found:
        return None
    masks = sum(p.mask_bytes for p in found)
    weights = sum(p.weight_bytes for p in found)
    names = ", ".join(f"{p.module}.{p.name}" if p.module else p.name for p in found[:3])
    more = f" and {len(found) - 3} more" if len(found) > 3 else ""
    orig = ("weight_orig (the parameter, with its gradient and optimizer states)" if training
            else "weight_orig (the parameter)")
    backward = " and a weight-sized gradient in each backward" if training else ""
    return (f"pruned weights (torch.nn.utils.prune) on {len(found)} tensor(s) ({names}{more}) "
            f"keep {orig} and weight_mask and recompute the weight before each forward: "
            f"+{format_bytes(masks + weights)} held vs unpruned (masks {format_bytes(masks)}, "
            f"recomputed weights {format_bytes(weights)}){backward}; the zeros save no memory "
            f"until prune.remove() and memfit.techniques.sparsify() store them sparse "
            f"(inference)")


@contextlib.contextmanager
def mark_recomputed(model: nn.Module, tracker: Tracker) -> Iterator[None]:
    """File each pruned tensor recomputed before a forward under ``WEIGHTS`` (of its module).

    Registered after the pruning hooks, so each runs once the weight is set."""
    handles = []
    for mod_name, mod in model.named_modules():
        names = pruned_names(mod)
        if not names:
            continue

        def hook(module: nn.Module, _args: object, mod_name: str = mod_name,
                 names: list[str] = names) -> None:
            for name in names:
                t = getattr(module, name)
                if isinstance(t, torch.Tensor):
                    tracker.track(t, MemoryCategory.WEIGHTS, mod_name)

        handles.append(mod.register_forward_pre_hook(hook))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
