"""Walking nested containers for the tensors inside, calling a model on a batch, and fake or meta
copies of a model and of its inputs (one helper each for every part of memfit)."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from memfit.errors import MemfitError


def tensor_leaves(obj: Any, *, objects: bool = False) -> Iterator[torch.Tensor]:
    """The tensors in ``obj``: a tensor, or mappings / lists / tuples of them, nested.

    ``objects=True`` also looks inside plain objects' attributes (e.g. a model's output
    dataclass), but never inside modules.
    """
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from tensor_leaves(v, objects=objects)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from tensor_leaves(v, objects=objects)
    elif objects and hasattr(obj, "__dict__") and not isinstance(obj, torch.nn.Module):
        for v in vars(obj).values():
            yield from tensor_leaves(v, objects=objects)


def call_model(model: torch.nn.Module, batch: Any) -> Any:
    """``model(**batch)`` for a mapping, ``model(*batch)`` for a tuple/list, else
    ``model(batch)``."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, list | tuple):
        return model(*batch)
    return model(batch)


def meta_batch(batch: Any, rows: int) -> Any:
    """Meta tensors like those in ``batch`` (nested mappings / lists / tuples) with ``rows`` in
    the first (batch) dimension; non-tensor leaves as they are."""
    if isinstance(batch, torch.Tensor):
        return torch.empty((rows, *batch.shape[1:]), dtype=batch.dtype, device="meta")
    if isinstance(batch, Mapping):
        return {k: meta_batch(v, rows) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(meta_batch(v, rows) for v in batch)
    return batch


# -- fake and meta copies -----------------------------------------------------------------------

def fake_like(t: torch.Tensor, device: str | torch.device | None,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """An empty tensor like ``t`` (its shape, strides, and dtype unless ``dtype`` is given for a
    floating ``t``) on ``device``; ``None``: on ``t``'s own device, the CPU for a meta tensor.
    Inside a ``FakeTensorMode`` it is a fake tensor; on ``"meta"`` outside one, a meta tensor."""
    if device is None:
        device = "cpu" if t.device.type == "meta" else t.device
    if is_traceable_wrapper_subclass(t):
        # A tensor subclass that stores other tensors (torchao's Int8Tensor / NF4Tensor, float8
        # weights...): fake its inner tensors, as stored (quantized data, scales), and rebuild
        # the subclass around them, so its bytes are the real ones and its own ops (dequantizing
        # temporaries) run.
        names, ctx = t.__tensor_flatten__()  # type: ignore[attr-defined]
        inner = {name: fake_like(getattr(t, name), device, None) for name in names}
        return type(t).__tensor_unflatten__(  # type: ignore[attr-defined, no-any-return]
            inner, ctx, t.size(), t.stride())
    dt = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
    if dt == t.dtype:
        fake = torch.empty_strided(t.shape, t.stride(), dtype=dt, device=device)
    else:
        fake = torch.empty(t.shape, dtype=dt, device=device)
    return fake


def fake_model(model: nn.Module, device: str | torch.device | None,
               dtype: torch.dtype | None = None) -> nn.Module:
    """A copy of ``model`` whose parameters, buffers and tensor attributes are :func:`fake_like`
    its own (fake inside a ``FakeTensorMode``, meta on ``"meta"`` outside one: no real data is
    copied); tied parameters stay one object (one storage)."""
    memo: dict[int, Any] = {}
    for mod in model.modules():
        for p in mod._parameters.values():
            if p is not None and id(p) not in memo:
                fake = fake_like(p, device, dtype)
                memo[id(p)] = param = nn.Parameter(fake, requires_grad=p.requires_grad)
                if type(p) is not nn.Parameter and vars(p):
                    state = _fake_state(vars(p), device, memo)
                    param.__dict__.update(state)
                    # see _register_baseline; an attribute torch's Parameter does not declare
                    param.__dict__["_memfit_state"] = tuple(state)
        for b in mod._buffers.values():
            if b is not None and id(b) not in memo:
                memo[id(b)] = fake_like(b, device, dtype)
        for v in shallow_leaves(vars(mod).values()):
            if id(v) not in memo:
                memo[id(v)] = fake_like(v, device, dtype).requires_grad_(
                    v.requires_grad and v.is_floating_point())
    try:
        return copy.deepcopy(model, memo)
    except Exception as exc:  # deepcopy of arbitrary user state: say what to do
        raise MemfitError(
            f"cannot copy the model to trace it ({type(exc).__name__}: {exc}); the engine needs "
            f"copy.deepcopy(model) to work: move unpicklable attributes (locks, open files) out "
            f"of the module") from exc


def _fake_state(state: dict[str, Any], device: str | torch.device | None,
                memo: dict[int, Any]) -> dict[str, Any]:
    """The attributes of a Parameter subclass (bitsandbytes' ``Params4bit.quant_state``: absmax,
    code...), copied with their tensors faked (a fake parameter is a plain Parameter: the subclass
    cannot wrap a fake tensor, so its state travels as attributes)."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            if id(value) not in memo:
                memo[id(value)] = fake_like(value, device, None)
            out[key] = memo[id(value)]
        elif hasattr(value, "__dict__") and not isinstance(value, type | nn.Module) and any(
                isinstance(v, torch.Tensor) or hasattr(v, "__dict__")
                for v in vars(value).values()):
            clone = copy.copy(value)
            clone.__dict__.update(_fake_state(vars(value), device, memo))
            out[key] = clone
        else:
            out[key] = value
    return out


def shallow_leaves(values: Any) -> Iterator[torch.Tensor]:
    """Tensors among module attributes, also inside a list/tuple/dict attribute (one level), so
    that deepcopy never copies real data."""
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, list | tuple):
            yield from (t for t in v if isinstance(t, torch.Tensor))
        elif isinstance(v, dict):
            yield from (t for t in v.values() if isinstance(t, torch.Tensor))


def fake_inputs(inputs: Any, device: str | torch.device | None,
                memo: dict[int, torch.Tensor] | None = None,
                dtype: torch.dtype | None = None) -> Any:
    """:func:`fake_like` copies of the tensors in ``inputs`` (nested mappings / lists / tuples;
    one copy per tensor, kept in ``memo``), with their ``requires_grad``; floating ones in
    ``dtype`` for pure low-precision runs (the user feeds a ``model.to(bf16)`` model bf16
    inputs)."""
    if memo is None:
        memo = {}
    if isinstance(inputs, torch.Tensor):
        if id(inputs) not in memo:
            memo[id(inputs)] = fake_like(inputs, device, dtype).requires_grad_(
                inputs.requires_grad)
        return memo[id(inputs)]
    if isinstance(inputs, Mapping):
        return {k: fake_inputs(v, device, memo, dtype) for k, v in inputs.items()}
    if isinstance(inputs, list | tuple):
        return type(inputs)(fake_inputs(v, device, memo, dtype) for v in inputs)
    return inputs


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` on the meta device (its parameters, buffers and tensor attributes meta
    tensors: no data), which the trace engine and the fit search take apart and trace."""
    return fake_model(model, "meta")
