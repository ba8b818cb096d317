"""The real values of a real step, for the data-dependent ops fake tensors cannot answer.

Note: [real values of a real step] A value computed from floating-point inputs and weights
(``if x.sum() > 0:``, MoE router counts) is not known that way. When the model's parameters and
buffers and the inputs are all real CPU tensors and the forward of a trace needed an assumption,
the engine runs the real forward (and loss) once on the CPU under ``no_grad``
(:func:`record_real_values`: RNG and buffers restored after), recording the answer of every op
that fake tensors cannot answer, in order (:class:`Record`: ``.item()`` / ``if tensor:`` values,
the sizes of ``nonzero``, ``masked_select``, boolean indexing, ``unique``, ``bincount``...). It
then traces again, and each forward phase answers those ops from the recording, in order
(:class:`RealValues`). Each answer must match the recorded op and its arguments' shapes; at the
first mismatch (the trace took another path, e.g. under ``no_grad`` vs grad), the recording is
dropped and the assumptions of ``datadep.py`` answer from there on, which
``Estimate.assumptions`` says.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

_SIZED = {
    aten.nonzero.default, aten.argwhere.default, aten.masked_select.default,
    aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default,
    aten._unique.default, aten.bincount.default, aten.repeat_interleave.Tensor,
}
_BOOL_INDEXED = {
    op for op in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
                  getattr(aten, "_unsafe_index_put", None) and aten._unsafe_index_put.default)
    if op
}


def _is_mask(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


def _recorded(func: Any, args: Any, kwargs: dict[str, Any]) -> bool:
    """Whether fake tensors cannot answer this call: its answer is recorded from the real run."""
    if func is aten._local_scalar_dense.default or func is aten._ctc_loss.Tensor:
        return True
    if func is aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None
    if func in _SIZED:
        return True
    return func in _BOOL_INDEXED and any(_is_mask(i) for i in args[1])


def _shapes(args: Any) -> tuple[tuple[tuple[int, ...], bool], ...]:
    """What a recorded call is matched by: its tensor arguments' shapes and whether each is
    floating point (not the dtype: a pure-bf16 trace runs in another float dtype)."""
    flat, _ = torch.utils._pytree.tree_flatten(args)
    return tuple((tuple(t.shape), t.is_floating_point()) for t in flat
                 if isinstance(t, torch.Tensor))


@dataclass(frozen=True)
class Record:
    """One data-dependent answer of the real run: the op, its arguments' shapes, the answer
    (a Python scalar for ``.item()``, else the sizes the fake output needs)."""

    func: Any
    shapes: tuple[tuple[tuple[int, ...], bool], ...]
    answer: Any


def _answer(func: Any, args: Any, out: Any) -> Any:
    if func is aten._local_scalar_dense.default:
        return out
    if func in (aten.nonzero.default, aten.argwhere.default, aten.masked_select.default,
                aten.bincount.default, aten.repeat_interleave.Tensor):
        return int(out.shape[0])
    if func in _SIZED:  # unique: every output's shape
        return tuple(tuple(o.shape) for o in out)
    if func is aten._ctc_loss.Tensor:
        return int(args[3].max().item()) if args[3].numel() else 0
    # boolean indexing: the number of elements each mask selects
    return tuple(int(i.count_nonzero()) if _is_mask(i) else None for i in args[1])


class _Recorder(TorchDispatchMode):
    """Records the answers of the real run's data-dependent ops."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[Record] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _recorded(func, args, kwargs):
            self.records.append(Record(func, _shapes(args), _answer(func, args, out)))
        return out


class _ToList(TorchFunctionMode):
    """``Tensor.tolist()`` of a real tensor reads its data without dispatching; a fake tensor's
    ``tolist`` calls ``.item()`` per element (``torch/_subclasses/fake_tensor.py:
    FakeTensor.tolist``): record one ``.item()`` per element, in the same (row-major) order."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.Tensor.tolist and isinstance(args[0], torch.Tensor):
            element = (((), args[0].is_floating_point()),)
            values = out if isinstance(out, list) else [out]
            flat, _ = torch.utils._pytree.tree_flatten(values)
            self.recorder.records.extend(
                Record(aten._local_scalar_dense.default, element, v) for v in flat)
        return out


@contextlib.contextmanager
def _buffers_restored(model: nn.Module) -> Iterator[None]:
    """A real forward in training mode updates BatchNorm's running statistics: put them back."""
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)


def record_real_values(model: nn.Module, run: Callable[[], Any]) -> list[Record]:
    """The data-dependent answers of ``run()`` (the real forward and loss of ``model``), in
    order; run on the CPU under ``no_grad`` with the RNG and the model's buffers restored."""
    recorder = _Recorder()
    with torch.random.fork_rng(devices=[]), _buffers_restored(model), torch.no_grad():
        with _ToList(recorder), recorder:
            run()
    return recorder.records


class RealValues:
    """Replays a real run's data-dependent answers, in order, during each traced forward."""

    def __init__(self, records: list[Record]) -> None:
        self.records = records
        self.position = 0
        self.active = False
        self.replayed = 0
        self.diverged: str | None = None
        """Why the replay stopped (the trace asked for another op than the real run made)."""

    def start(self) -> None:
        """A forward begins: its data-dependent ops are the recorded ones from the first."""
        self.position = 0
        self.active = self.diverged is None

    def stop(self) -> None:
        self.active = False

    def next(self, func: Any, args: Any) -> Record | None:
        if not self.active:
            return None
        if self.position >= len(self.records):
            self.diverged = (f"the trace needed more data-dependent values than the real forward "
                             f"made ({len(self.records)}; next: {func})")
        else:
            record = self.records[self.position]
            if record.func is func and record.shapes == _shapes(args):
                self.position += 1
                self.replayed += 1
                return record
            self.diverged = (f"value {self.position + 1} of the real forward came from "
                             f"{record.func}, the trace asked {func}")
        self.active = False
        return None
