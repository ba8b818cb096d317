"""Foreach ops on fake tensors, one meta run per distinct element (memfit/trace/foreach.py).

The expected values are torch's own: each foreach op runs on the same fake tensors with and
without the rule (torch/_subclasses/fake_impls.py: foreach_run_and_map_input_device is torch's
implementation), and every output must have the same dtype, shape, stride, offset, storage size
and device, in a fresh storage of its own; errors must be the same. The lists mix repeated and
distinct shapes, dtypes and a transposed (non-contiguous) tensor, as an optimizer's lists do.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memfit.trace import foreach


def _meta(t: Any) -> tuple[Any, ...]:
    return (t.dtype, t.shape, t.stride(), t.storage_offset(), t.untyped_storage().nbytes(),
            t.device, t.requires_grad)


def _lists(mode: FakeTensorMode) -> tuple[list[torch.Tensor], ...]:
    shapes = [(8, 4), (8, 4), (16,), (8, 4), (16,), (3, 5)]
    with mode:
        a = [torch.empty(s) for s in shapes]
        b = [torch.empty(s) for s in shapes]
        a[5] = torch.empty(5, 3).t()  # non-contiguous
        b[5] = torch.empty(3, 5)
        half = [torch.empty(s, dtype=torch.bfloat16) for s in shapes]
    return a, b, half


def _run(op: Any, patched: bool) -> tuple[Any, Any]:
    mode = FakeTensorMode()
    a, b, half = _lists(mode)
    ctx = foreach.grouped() if patched else contextlib.nullcontext()
    with ctx, mode:
        try:
            out = op(a, b, half)
        except Exception as exc:  # compared with torch's
            return None, (type(exc), str(exc))
    return out, (a, b, half)


OPS = {
    "sqrt": lambda a, b, h: torch._foreach_sqrt(a),
    "add_list": lambda a, b, h: torch._foreach_add(a, b),
    "add_scalar": lambda a, b, h: torch._foreach_add(h, 1.5),
    "mul_scalarlist": lambda a, b, h: torch._foreach_mul(a, [1.0, 1.0, 2.0, 1.0, 2.0, 3.0]),
    "addcdiv_scalarlist": lambda a, b, h: torch._foreach_addcdiv(a, b, b, [0.5] * 6),
    "lerp_": lambda a, b, h: torch._foreach_lerp_(a, b, 0.1),
    "addcmul_": lambda a, b, h: torch._foreach_addcmul_(a, b, b, value=0.1),
    "div_scalarlist_": lambda a, b, h: torch._foreach_div_(a, [2.0] * 6),
    "mixed_dtypes": lambda a, b, h: torch._foreach_add(a, h),
    "mismatch": lambda a, b, h: torch._foreach_add(a, b[::-1]),  # shapes differ: an error
}


@pytest.mark.parametrize("name", sorted(OPS))
def test_foreach_outputs_equal_torchs(name: str) -> None:
    want, _ = _run(OPS[name], patched=False)
    got, kept = _run(OPS[name], patched=True)
    if want is None:
        assert got is None and kept == _
        return
    assert [_meta(t) for t in got] == [_meta(t) for t in want]
    if name.endswith("_"):  # in-place: torch returns the first list itself
        assert all(g is t for g, t in zip(got, kept[0], strict=True))
        return
    storages = {t.untyped_storage()._cdata for t in got}
    assert len(storages) == len(got)  # each output its own storage
    inputs = {t.untyped_storage()._cdata for ts in kept for t in ts}
    assert not storages & inputs


def test_identical_elements_run_the_meta_kernel_once() -> None:
    from torch._subclasses import fake_impls

    calls: list[int] = []
    original = fake_impls.foreach_run_and_map_input_device

    def counting(mode: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(len(args[0]))
        return original(mode, func, *args, **kwargs)

    fake_impls.foreach_run_and_map_input_device = counting
    try:
        _run(OPS["sqrt"], patched=True)
    finally:
        fake_impls.foreach_run_and_map_input_device = original
    assert calls == [3]  # (8, 4), (16,), the transposed (3, 5): 3 of 6
