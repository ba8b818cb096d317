"""Fake tensors run a foreach op's meta kernel once per distinct element.

Note: [foreach ops on fake tensors] An optimizer's foreach ops (``torch/optim/adam.py:
_multi_tensor_adam``: ``_foreach_lerp_``, ``_foreach_mul_``, ``_foreach_addcmul_``,
``_foreach_sqrt``, ``_foreach_div_``, ``_foreach_add_``, ``_foreach_addcdiv_``) take one list
entry per parameter. The fake mode caches an op by all of its arguments, so each of them misses
the cache at the first step, and torch's fake implementation (``torch/_subclasses/
fake_impls.py: foreach_run_and_map_input_device``, torch 2.13.0) runs the op's meta kernel over
every element (one Python meta function per element) and wraps each output. A foreach op is the
per-element op applied at each index: the output at an index (its shape, stride, dtype, device),
and any error the kernel raises, is a function of the arguments at that index (each list's
entry) and of the arguments all indices share. A transformer's parameters come in a handful of
shapes, so the rule here runs torch's own implementation on one index of each group of
identical indices (the same tensor metadata in every list: dtype, shape, stride, device,
storage offset and size, autograd and conj/neg bits; the same number in a scalar list) and gives
each other index of the group a new fake tensor with its group's metadata, made as torch's
implementation makes them (a meta ``empty_strided``, ``from_meta_and_device``). An in-place
foreach op returns nothing: only its checks run, once per group. Its version-counter bumps
happen above the fake mode (``ADInplaceOrView``, for every element), not in the meta kernel.
Anything else (keyword arguments, a tensor outside the lists, tensors that are not this mode's
fake tensors, fresh outputs that are not plain ``empty_strided`` tensors) runs as torch runs it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._mode_utils import no_dispatch

from memfit._compat import torch_internals

_NUMBERS = (int, float, bool, complex)


class _IsForeach:
    """``op in _IsForeach()``: an aten foreach op, the ops torch's foreach fake implementation
    takes (its check: ``func.name().startswith("aten::_foreach_")`` and a Meta kernel)."""

    def __contains__(self, func: Any) -> bool:
        return getattr(func, "namespace", None) == "aten" and func.name().startswith(
            "aten::_foreach_")


def _key(x: Any, mode: Any) -> Any:
    from torch._subclasses.fake_tensor import FakeTensor

    if type(x) in _NUMBERS:
        return (type(x), x)
    if (type(x) is FakeTensor and x.fake_mode is mode and x.layout is torch.strided
            and x.constant is None and not x._has_symbolic_sizes_strides):
        return (x.dtype, x.shape, x.stride(), x.fake_device, x.storage_offset(),
                x.untyped_storage().nbytes(), x.requires_grad, x.is_conj(), x.is_neg(),
                x.is_inference())
    return None


def rule(fake_mode: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
    """The fake implementation of foreach op ``func``: see Note: [foreach ops on fake tensors]."""
    from torch._subclasses.fake_impls import foreach_run_and_map_input_device

    if kwargs:
        return NotImplemented
    lists = [i for i, a in enumerate(args) if isinstance(a, list | tuple)]
    if not lists or any(not (a is None or type(a) in _NUMBERS)
                        for i, a in enumerate(args) if i not in lists):
        return NotImplemented
    length = len(args[lists[0]])
    if any(len(args[i]) != length for i in lists):
        return NotImplemented
    group_of: dict[Any, int] = {}
    groups: list[int] = []
    firsts: list[int] = []
    for j in range(length):
        key = tuple(_key(args[i][j], fake_mode) for i in lists)
        if None in key:
            return NotImplemented
        g = group_of.setdefault(key, len(group_of))
        if g == len(firsts):
            firsts.append(j)
        groups.append(g)
    if len(firsts) == length:
        return NotImplemented
    reduced = tuple(type(a)(a[j] for j in firsts) if i in lists else a
                    for i, a in enumerate(args))
    out = foreach_run_and_map_input_device(fake_mode, func, *reduced)
    if out is NotImplemented or not out:
        return out  # torch's answer for an op it cannot run; nothing for an in-place op
    if len(out) != len(firsts) or not all(_fresh(t, fake_mode) for t in out):
        return NotImplemented
    made: list[Any] = []
    seen: set[int] = set()
    for g in groups:
        rep = out[g]
        if g not in seen:
            seen.add(g)
            made.append(rep)
            continue
        with no_dispatch():
            meta = torch.empty_strided(rep.shape, rep.stride(), dtype=rep.dtype, device="meta")
        made.append(fake_mode.fake_tensor_converter.from_meta_and_device(
            fake_mode, meta, rep.fake_device))
    return made


def _fresh(t: Any, mode: Any) -> bool:
    """A new output as ``empty_strided`` makes it (offset 0, the storage its sizes need)."""
    from torch._subclasses.fake_tensor import FakeTensor

    if type(t) is not FakeTensor or t.fake_mode is not mode or t.storage_offset() != 0:
        return False
    with no_dispatch():
        need = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    return t.untyped_storage().nbytes() == need.untyped_storage().nbytes()


@contextlib.contextmanager
def grouped() -> Iterator[None]:
    """Within the context, fake tensors run foreach ops through :func:`rule`."""
    with torch_internals.fake_op_rule(_IsForeach(), rule):  # type: ignore[arg-type]
        yield
