"""Known values: the real values of fake tensors that have one, computed on first read.

The integer and boolean inputs the user passes as real tensors (an attention mask, token ids)
keep their values next to their fake copies, and so do small integer/boolean tensors
computed only from known ones and from factories (``arange``, ``ones``...): such ops also run on
the real values. A data-dependent answer about a known tensor is then the real one: Hugging Face's
"is the attention mask all ones?" check sees the padding of a padded batch, and the trace takes
the masked attention path the real step takes.

:class:`KnownValues` holds them (a fake tensor -> its :class:`_Value`); ``datadep.py``'s
:class:`~memfit.trace.datadep.DataDependentSizes` answers data-dependent ops from them.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

aten = torch.ops.aten

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


class KnownValues:
    """The known values of one trace (see the module docstring and Note: [lazy known
    values])."""

    def __init__(self) -> None:
        self.known = WeakIdKeyDictionary()  # fake tensor -> its real value (a _Value)
        self._pending: list[weakref.ref[_Run]] = []  # runs not computed yet, oldest first

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
