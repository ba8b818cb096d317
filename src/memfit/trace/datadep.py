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
  takes the branch that does the work; a ``split`` by such sizes that does not add up splits
  evenly (balanced routing: each of E experts gets 1/E of the routed tokens).

Known values (``known_values.py``): integer and boolean tensors whose real values the trace
has (inputs given as real tensors, and what is computed only from them) answer with those
values. Note: [real values of a real step] (``real_values.py``): with real weights and inputs,
the answers of a real forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from memfit.trace.known_values import _FACTORIES, KnownValues, _knowable
from memfit.trace.real_values import _SIZED, RealValues, _is_mask, _recorded

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


class DataDependentSizes(KnownValues):
    """Tracks top-k-derived masks and known values, and answers data-dependent ops (see the
    module docstring)."""

    def __init__(self, real: RealValues | None = None) -> None:
        super().__init__()
        self.density = WeakIdKeyDictionary()
        self.used = False
        self.real = real
        self.replayed_last = False
        """Whether the last :meth:`handle` answered from the real run (no assumption)."""
        self.assumed_in: set[str] = set()
        """The phases (``forward``...) in which an assumption answered a data-dependent op."""


    # -- tagging ---------------------------------------------------------------------------
    def observe(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        if self.known:
            self._propagate(func, args, kwargs, out)
        elif func in _FACTORIES and _knowable(out):
            self._propagate(func, args, kwargs, out)
        if out is NotImplemented:  # a subclass (DTensor) answers first; its local op follows
            return
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
        if self.density and func in _PRESERVING:  # (the cheaper test first)
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
    def known_answer(self, func: Any, args: Any) -> Any:
        """The real answer of ``.item()`` on a tensor whose value is known or recorded from the
        real run, else None."""
        if func is not aten._local_scalar_dense.default:
            return None
        if self.real is not None:
            record = self.real.next(func, args)
            if record is not None:
                return record.answer
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():
            value = self.value(args[0])
            return None if value is None else value.item()

    def _count(self, mask: torch.Tensor) -> int:
        self.used = True
        d = self.density.get(mask, 1.0) if isinstance(mask, torch.Tensor) else 1.0
        return round(mask.numel() * d)

    def nonzero(self, mask: torch.Tensor) -> torch.Tensor:
        n = self._count(mask)
        return torch.empty((n, mask.dim()), dtype=torch.long, device=mask.device)

    def handle(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """The fake output of a data-dependent op (called after the fake kernel refused)."""
        self.replayed_last = False
        if self.real is not None and _recorded(func, args, kwargs):
            record = self.real.next(func, args)
            if record is not None:
                self.replayed_last = True
                return self._replay(func, args, kwargs, record.answer)
        return self._assume(func, args, kwargs)

    def _replay(self, func: Any, args: Any, kwargs: dict[str, Any], answer: Any) -> Any:
        """The fake output with the real run's sizes (see :func:`_answer`)."""
        x = args[0]
        if func in (aten.nonzero.default, aten.argwhere.default):
            return torch.empty((answer, x.dim()), dtype=torch.long, device=x.device)
        if func is aten.masked_select.default:
            return torch.empty((answer,), dtype=x.dtype, device=x.device)
        if func is aten.bincount.default:
            weights = args[1] if len(args) > 1 else kwargs.get("weights")
            dtype = torch.long if weights is None else torch.float64
            return torch.empty((answer,), dtype=dtype, device=x.device)
        if func is aten.repeat_interleave.Tensor:
            return torch.empty((answer,), dtype=torch.long, device=x.device)
        if func in _SIZED:  # unique: values in the input's dtype, indices and counts long
            return tuple(torch.empty(shape, dtype=x.dtype if i == 0 else torch.long,
                                     device=x.device) for i, shape in enumerate(answer))
        if func is aten._ctc_loss.Tensor:
            log_probs = x
            time, batch = log_probs.shape[0], (log_probs.shape[1] if log_probs.dim() == 3 else 1)
            dt = log_probs.dtype
            return (torch.empty((batch,), dtype=dt, device=x.device),
                    torch.empty((batch, time, 2 * answer + 1), dtype=dt, device=x.device))
        expanded: list[torch.Tensor | None] = []
        for idx, count in zip(args[1], answer, strict=True):
            if _is_mask(idx):
                flat = torch.empty((count,), dtype=torch.long, device=idx.device)
                expanded.extend([flat] * idx.dim())
            else:
                expanded.append(idx)
        return func(x, expanded, *args[2:], **kwargs)

    def _assume(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """The fake output under the module docstring's assumptions."""
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
        if func is aten._ctc_loss.Tensor:
            return self._ctc_loss(*args[:4])
        if func is aten.split_with_sizes.default and self.used:
            # Sizes read from a computed tensor (``.tolist()`` answered 1 per element), e.g.
            # tokens per expert in JetMoE-style routing: split evenly (balanced routing).
            x, sizes = args[0], list(args[1])
            dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
            total, parts = x.shape[dim], len(sizes)
            even = [total // parts + (i < total % parts) for i in range(parts)]
            return func(x, even, dim)
        if func is aten._local_scalar_dense.default:
            x = args[0]
            self.used = True
            if x.dtype == torch.bool:
                return True
            return 1.0 if x.is_floating_point() else 1
        return None

    def _ctc_loss(self, log_probs: torch.Tensor, targets: torch.Tensor, _input_lengths: Any,
                  target_lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """CTC loss with lengths given as tensors: its ``log_alpha`` (saved for backward) is
        [batch, time, 2 * max(target_lengths) + 1] (``aten/src/ATen/native/LossCTC.cpp:
        ctc_loss_cpu_template``; ``native/cuda/LossCTC.cu: ctc_loss_gpu_template`` the same).
        The maximum is read from the known lengths (computed from real labels), else bounded by
        the targets' padded length."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():
            lengths = self.value(target_lengths)
            longest = None if lengths is None else int(lengths.max().item())
        if longest is None:
            self.used = True
            longest = targets.shape[-1] if targets.dim() == 2 else targets.numel()
        time, batch = log_probs.shape[0], (log_probs.shape[1] if log_probs.dim() == 3 else 1)
        dt = log_probs.dtype
        return (torch.empty((batch,), dtype=dt, device=log_probs.device),
                torch.empty((batch, time, 2 * longest + 1), dtype=dt, device=log_probs.device))


DATA_DEPENDENT = {
    op for op in (
        aten.nonzero.default, aten.argwhere.default, aten.masked_select.default,
        aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
        getattr(aten, "_unsafe_index_put", None) and aten._unsafe_index_put.default,
        aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default,
        aten._unique.default, aten.bincount.default, aten.repeat_interleave.Tensor,
        aten._local_scalar_dense.default, aten._ctc_loss.Tensor, aten.split_with_sizes.default,
    ) if op
}
