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

Known values: the integer and boolean inputs the user passes as real tensors (an attention mask,
token ids) keep their values next to their fake copies, and so do small integer/boolean tensors
computed only from known ones and from factories (``arange``, ``ones``...): such ops also run on
the real values. A data-dependent answer about a known tensor is then the real one: Hugging Face's
"is the attention mask all ones?" check sees the padding of a padded batch, and the trace takes
the masked attention path the real step takes.

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
dropped and the assumptions above answer from there on, which ``Estimate.assumptions`` says.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
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


# Known values are propagated for integer/boolean tensors up to this many elements (the real ops
# run on the CPU next to the fake ones).
KNOWN_NUMEL_LIMIT = 1 << 22  # 32 MiB of int64 at most per tensor
_FACTORIES = {
    aten.arange.default, aten.arange.start, aten.arange.start_step, aten.ones.default,
    aten.zeros.default, aten.full.default, aten.scalar_tensor.default, aten.ones_like.default,
    aten.zeros_like.default, aten.full_like.default,
}
_EXACT = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _knowable(t: Any) -> bool:
    return (isinstance(t, torch.Tensor) and t.dtype in _EXACT
            and t.numel() <= KNOWN_NUMEL_LIMIT)


# Note: [lazy known values] Known values are computed when first read, not when the fake op runs:
# most are never read (the math SDPA kernel's causal mask ``ones(L, S).tril()`` of every layer: a
# megabyte of real work per layer, for a value nothing asks about). An op on known values records
# a :class:`_Run` (the op and its arguments' values, themselves pending or computed) and its
# outputs a :class:`_Value`; reading one computes its run and, first, the runs it reads. Pure ops
# read only their arguments, which nothing changes before the read, so the value is the one the
# op would have computed when it ran, except where an op writes to its arguments (``add_``) or
# draws random numbers: such an op first computes every pending run still referenced, in the
# order they were made, then runs at once, as every op did before. ``MEMFIT_EAGER_KNOWN=1``
# computes every run at once (the reference the tests compare with).
EAGER_KNOWN = os.environ.get("MEMFIT_EAGER_KNOWN") == "1"
_EAGER_CACHE: dict[Any, bool] = {}


def _eager(func: Any) -> bool:
    """Whether ``func`` writes to an argument or draws random numbers (run at once)."""
    eager = _EAGER_CACHE.get(func)
    if eager is None:
        schema = getattr(func, "_schema", None)
        eager = (schema is None
                 or any(a.alias_info is not None and a.alias_info.is_write
                        for a in schema.arguments)
                 or torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()))
        _EAGER_CACHE[func] = eager
    return eager


class _Run:
    """One op on known values, computed on first read (Note: [lazy known values])."""

    __slots__ = ("__weakref__", "args", "done", "func", "kwargs", "outs")

    def __init__(self, func: Any, args: Any, kwargs: dict[str, Any]) -> None:
        self.func, self.args, self.kwargs = func, args, kwargs
        self.outs: list[torch.Tensor] | None = None
        self.done = False

    def resolve(self) -> list[torch.Tensor] | None:
        if not self.done:
            self.done = True
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            failed = False

            def get(a: Any) -> Any:
                nonlocal failed
                if isinstance(a, _Value):
                    v = a.get()
                    failed = failed or v is None
                    return v
                return a

            try:
                with unset_fake_temporarily():
                    r_args, r_kwargs = torch.utils._pytree.tree_map(
                        get, (self.args, self.kwargs), is_leaf=lambda a: isinstance(a, _Value))
                    if not failed:
                        r_out = self.func(*r_args, **r_kwargs)
                        self.outs = [o for o in (r_out if isinstance(r_out, list | tuple)
                                                 else (r_out,)) if isinstance(o, torch.Tensor)]
            except Exception:  # a value that cannot be computed stays unknown
                self.outs = None
            self.args = self.kwargs = None  # free the inputs' values
        return self.outs


class _Value:
    """Output ``index`` of a run, of the fake output's ``shape``."""

    __slots__ = ("index", "run", "shape", "tensor")

    def __init__(self, run: _Run | None, index: int, shape: tuple[int, ...]) -> None:
        self.run, self.index, self.shape = run, index, shape
        self.tensor: torch.Tensor | None = None

    @classmethod
    def of(cls, tensor: torch.Tensor) -> _Value:
        v = cls(None, 0, tuple(tensor.shape))
        v.tensor = tensor
        return v

    def get(self) -> torch.Tensor | None:
        if self.run is not None:
            outs = self.run.resolve()
            r = outs[self.index] if outs is not None and self.index < len(outs) else None
            self.tensor = r if r is not None and tuple(r.shape) == self.shape else None
            self.run = None
        return self.tensor


# -- real values of a real step (Note: [real values of a real step]) ----------------------------

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


class DataDependentSizes:
    """Tracks top-k-derived masks and known values, and answers data-dependent ops (see the
    module docstring)."""

    def __init__(self, real: RealValues | None = None) -> None:
        self.density = WeakIdKeyDictionary()
        self.known = WeakIdKeyDictionary()  # fake tensor -> its real value (a _Value)
        self._pending: list[weakref.ref[_Run]] = []  # runs not computed yet, oldest first
        self.used = False
        self.real = real
        self.replayed_last = False
        """Whether the last :meth:`handle` answered from the real run (no assumption)."""
        self.assumed_in: set[str] = set()
        """The phases (``forward``...) in which an assumption answered a data-dependent op."""

    def know(self, fake: torch.Tensor, real: torch.Tensor) -> None:
        """Record the real value of a fake input (integer/boolean inputs given as real
        tensors)."""
        if _knowable(real) and real.device.type == "cpu":
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            with unset_fake_temporarily():  # a real copy (a clone in the fake mode is fake)
                self.known[fake] = _Value.of(real.detach().clone())

    def _propagate(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        """Give ``out`` the value of ``func`` on the real values when every tensor argument has
        one (Note: [lazy known values])."""
        outs = [o for o in (out if isinstance(out, list | tuple) else (out,))
                if isinstance(o, torch.Tensor)]
        if not outs or not all(_knowable(o) for o in outs):
            return
        flat, _ = torch.utils._pytree.tree_flatten((args, kwargs))
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        if tensors:
            if not all(t in self.known for t in tensors):
                return
        elif func not in _FACTORIES:
            return

        def real(a: Any) -> Any:
            if isinstance(a, torch.Tensor):
                return self.known[a]
            if isinstance(a, torch.device):
                return torch.device("cpu")
            return a

        r_args, r_kwargs = torch.utils._pytree.tree_map(real, (args, kwargs))
        if "device" in r_kwargs:
            r_kwargs["device"] = "cpu"
        run = _Run(func, r_args, r_kwargs)
        if EAGER_KNOWN or _eager(func):
            self._force_all()  # every pending run reads the values of its own time
            run.resolve()
        else:
            self._pending.append(weakref.ref(run))
        for i, o in enumerate(outs):
            self.known[o] = _Value(run, i, tuple(o.shape))

    def _force_all(self) -> None:
        """Compute every pending run still referenced, oldest first."""
        for ref in self._pending:
            run = ref()
            if run is not None:
                run.resolve()
        self._pending.clear()

    def value(self, fake: torch.Tensor) -> torch.Tensor | None:
        """The real value of ``fake``, or None when it has none (or computing it failed)."""
        v = self.known.get(fake)
        return None if v is None else v.get()

    # -- tagging ---------------------------------------------------------------------------
    def observe(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        if self.known:
            self._propagate(func, args, kwargs, out)
        elif func in _FACTORIES and _knowable(out):
            self._propagate(func, args, kwargs, out)
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
