"""Ops whose output size depends on tensor values, which fake tensors do not have.

Assumption (stated in a warning, once per trace):
- ``nonzero`` / ``argwhere`` / ``torch.where(mask)`` / boolean indexing / ``masked_select``: if the
  mask derives from top-k indices (``topk(logits, k)`` over ``E`` choices compared with ``==``, or
  ``one_hot``), routing is assumed balanced and a fraction ``1/E`` of the elements is selected, as
  in MoE expert routing (every token's k choices spread evenly over the E experts); otherwise every
  element is assumed selected (an upper bound).
- ``unique`` / ``unique_consecutive``: every element distinct (an upper bound).
- ``bincount``: ``minlength`` bins if given, else one per input element.
- ``.item()`` / ``.tolist()`` of a computed tensor: 1 (``True`` for booleans), so ``if x.any()``
  takes the branch that does the work.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

aten = torch.ops.aten

ASSUMPTION = ("data-dependent sizes (nonzero, masked_select, boolean indexing, unique): masks "
              "derived from top-k indices select 1/E of the elements (balanced routing over E "
              "choices), other masks select every element (upper bound); .item() of a computed "
              "tensor reads 1")

# Ops through which "this mask selects 1/E of its elements" survives.
_PRESERVING = {
    aten.eq.Scalar, aten.eq.Tensor, aten.view.default, aten._unsafe_view.default,
    aten.reshape.default, aten.permute.default, aten.transpose.int, aten.t.default,
    aten.select.int, aten.slice.Tensor, aten.expand.default, aten.squeeze.dim,
    aten.squeeze.default, aten.squeeze.dims, aten.unsqueeze.default, aten.clone.default,
    aten._to_copy.default, aten.alias.default, aten.detach.default, aten.unbind.int,
    aten.flatten.using_ints, aten.contiguous.default if hasattr(aten, "contiguous") else None,
}
_PRESERVING.discard(None)


class DataDependentSizes:
    """Tracks top-k-derived masks and answers data-dependent ops (see the module docstring)."""

    def __init__(self) -> None:
        self.density = WeakIdKeyDictionary()
        self.used = False

    # -- tagging ---------------------------------------------------------------------------
    def observe(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        if func is aten.topk.default:
            x = args[0]
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            choices = x.shape[dim] if x.dim() else 1
            if choices:
                self.density[out[1]] = 1.0 / choices
            return
        if func is aten.one_hot.default:
            classes = out.shape[-1] if out.dim() else 1
            if classes:
                self.density[out] = 1.0 / classes
            return
        if func in _PRESERVING and self.density:
            d = None
            for a in args:
                if isinstance(a, torch.Tensor) and a in self.density:
                    d = self.density[a]
                    break
            if d is None:
                return
            if isinstance(out, torch.Tensor):
                self.density[out] = d
            elif isinstance(out, list | tuple):
                for o in out:
                    if isinstance(o, torch.Tensor):
                        self.density[o] = d

    # -- answering ---------------------------------------------------------------------------
    def _count(self, mask: torch.Tensor) -> int:
        self.used = True
        d = self.density.get(mask, 1.0) if isinstance(mask, torch.Tensor) else 1.0
        return round(mask.numel() * d)

    def nonzero(self, mask: torch.Tensor) -> torch.Tensor:
        n = self._count(mask)
        return torch.empty((n, mask.dim()), dtype=torch.long, device=mask.device)

    def handle(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """The fake output of a data-dependent op (called after the fake kernel refused)."""
        if func in (aten.nonzero.default, aten.argwhere.default):
            return self.nonzero(args[0])
        if func is aten.masked_select.default:
            x, mask = args[0], args[1]
            shape = torch.broadcast_shapes(x.shape, mask.shape)
            self.used = True
            d = self.density.get(mask, 1.0)
            n = round(torch.Size(shape).numel() * d)
            return torch.empty((n,), dtype=x.dtype, device=x.device)
        if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
                    aten._unsafe_index_put.default if hasattr(aten, "_unsafe_index_put") else None):
            indices = list(args[1])
            expanded: list[torch.Tensor | None] = []
            for idx in indices:
                if isinstance(idx, torch.Tensor) and idx.dtype in (torch.bool, torch.uint8):
                    nz = self.nonzero(idx)
                    expanded.extend(nz.unbind(1) if idx.dim() > 1 else [nz.view(-1)])
                else:
                    expanded.append(idx)
            return func(args[0], expanded, *args[2:], **kwargs)
        if func in (aten._unique2.default, aten.unique_dim.default,
                    aten.unique_consecutive.default, aten._unique.default):
            self.used = True
            x = args[0]
            flat = torch.empty((x.numel(),), dtype=x.dtype, device=x.device)
            outs: list[torch.Tensor] = [flat]
            if func is aten._unique.default:
                outs.append(torch.empty((x.numel(),), dtype=torch.long, device=x.device))
                return tuple(outs)
            outs.append(torch.empty(x.shape, dtype=torch.long, device=x.device))
            outs.append(torch.empty((x.numel(),), dtype=torch.long, device=x.device))
            return tuple(outs)
        if func is aten.bincount.default:
            self.used = True
            x = args[0]
            minlength = args[2] if len(args) > 2 else kwargs.get("minlength", 0)
            weights = args[1] if len(args) > 1 else kwargs.get("weights")
            dtype = torch.long if weights is None else torch.float64
            n = minlength if minlength else x.numel()
            return torch.empty((n,), dtype=dtype, device=x.device)
        if func is aten.repeat_interleave.Tensor:
            self.used = True
            repeats = args[0]
            n = kwargs.get("output_size") or repeats.numel()
            return torch.empty((n,), dtype=torch.long, device=repeats.device)
        if func is aten._local_scalar_dense.default:
            self.used = True
            x = args[0]
            if x.dtype == torch.bool:
                return True
            return 1.0 if x.is_floating_point() else 1
        return None


DATA_DEPENDENT = {
    op for op in (
        aten.nonzero.default, aten.argwhere.default, aten.masked_select.default,
        aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
        getattr(aten, "_unsafe_index_put", None) and aten._unsafe_index_put.default,
        aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default,
        aten._unique.default, aten.bincount.default, aten.repeat_interleave.Tensor,
        aten._local_scalar_dense.default,
    ) if op
}
