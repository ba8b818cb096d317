"""Profile a real run: every tensor storage, by category and module, over the whole run.

``with memfit.profile() as prof: <train>`` records, while the block runs:

- every new tensor storage an op returns (a ``TorchDispatchMode`` sees each aten op, forward,
  backward and optimizer alike), and its free (a weakref callback on the storage);
- what each storage turned out to be: a parameter or buffer of a module that ran (weights), a
  ``.grad`` (gradients, seen by post-accumulate-grad hooks and before each optimizer step), an
  optimizer's ``state`` (optimizer states, after each step), a tensor autograd saved for
  backward or an input of the outermost module (activations, via ``saved_tensors_hooks``);
  anything else is a temporary. Roles are decided after the run, so the breakdown at the peak is
  exact even if the peak came before a role was known;
- the innermost module running each op (global module hooks; in backward, the module whose
  output gradient was computed last), and with ``stacks=True`` the Python stack of each
  allocation.

The storages, their events and the replay at the peak are :mod:`memfit.ledger`'s, the ledger
the trace keeps too; the timeline is the trace's type (:class:`memfit.ledger.TimelinePoint`).
The record and the result built from it are :class:`memfit.profiling.recorder.Recorder`'s, which
:class:`Profiler` extends with the hooks that feed it.

Baseline: memory allocated before the block counts. By default (``baseline="gc"``) every tensor
reachable from the garbage collector at entry (``gc.get_objects()``: tensors, parameters, module
buffers, optimizer states, ``.grad``) is registered as live with its role, by storage (views and
tied weights count once); tensors held only by C++ (e.g. a graph saved from an earlier forward)
are not reachable and are not counted. ``baseline=(model, optimizer, batch)`` counts only those
objects at entry; any other model or optimizer is counted from the moment it is first used (a
module's forward, an optimizer step), which is what ``memfit profile`` relies on (the script
creates everything after profiling began).

The peak is the allocator's, not the ledger's: kernels allocate scratch no tensor owns (oneDNN's
reorders and workspaces on CPU, cuBLAS/cuDNN workspaces on CUDA). On CPU the PyTorch profiler's
allocator events are read (``allocator_events=True``, the default), with a profiler range around
each op so their peak can be placed on the ledger's timeline (Note: [ops on the allocator's
clock]); the breakdown is the ledger's at that moment and ``inside_kernels_bytes`` the rest.
On CUDA the allocator is read too: ``max_memory_allocated/reserved`` over the run (peak stats
are reset at entry), allocated and reserved after every op, fragmentation at the end, and a
``_record_memory_history`` snapshot for https://pytorch.org/memory_viz.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch._C._profiler import _RecordFunctionFast
from torch.utils._python_dispatch import TorchDispatchMode

from memfit._compat import torch_internals
from memfit._tensors import tensor_leaves
from memfit.categories import MemoryCategory
from memfit.errors import MemfitError
from memfit.profiling.cpu import OP_MARKER
from memfit.profiling.recorder import _BASELINE_OP, _MARK_OP, Recorder
from memfit.profiling.result import ProfileResult

if TYPE_CHECKING:
    from memfit.trace.estimate import Estimate

_faking = torch_internals.fake_mode_active()


# Note: [fake work is not measured] Work on fake tensors holds no memory: memfit's own trace (the
# OOM guard's prediction at a step's first batch of a shape, which Plan.apply's step runs) runs
# a fake copy of the model under a FakeTensorMode, an infra mode that sits below this
# profiler's dispatch mode, so every fake op, the fake model's module calls, its saved tensors
# and its optimizer's step reach this profiler too. Counted, the fake copy's weights and states
# were a second model (tracked peak above the allocator's, negative "inside kernels", every
# module twice: issue 20). While a fake mode is active, the ops and hooks are skipped, and a fake
# tensor met elsewhere is never a storage; the allocator's events of real memory made in that
# time (the trace's small CPU kernel measurements) still count.
class _Mode(TorchDispatchMode):
    def __init__(self, prof: Profiler) -> None:
        super().__init__()
        self.prof = prof

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        prof = self.prof
        if _faking():  # Note: [fake work is not measured]
            return func(*args, **(kwargs or {}))
        if not prof._mark_ops:
            out = func(*args, **(kwargs or {}))
            prof._after_op(func, out)
            return out
        # Note: [ops on the allocator's clock] a profiler range around each op places the
        # allocator's events on this ledger's timeline: the ledger's event counts when op k
        # started and when it was recorded are kept, the k-th range's events are op k's.
        events = prof._ledger.events
        prof._op_starts.append(len(events))
        try:
            with _RecordFunctionFast(OP_MARKER):
                out = func(*args, **(kwargs or {}))
            prof._after_op(func, out)
        finally:
            prof._op_ends.append(len(events))
        return out


class Profiler(Recorder):
    """Measures the memory of the code run inside it; see :func:`profile`.

    Known limitations: only memory owned by tensor storages is categorised; what the allocator
    holds beyond them (scratch inside kernels, e.g. oneDNN's reorders) is one number,
    ``inside_kernels_bytes``. On CPU that needs ``allocator_events=True`` (the default); without
    it ``peak_bytes`` is the ledger's and misses that scratch. A tensor created in the block by a
    path the dispatch mode cannot see and first met later (e.g. by a module hook) is counted
    twice at the peak, by the allocator and as alive before the block. Memory of other threads'
    ops that do not inherit the dispatch mode, of DataLoader worker processes, and of
    ``torch.compile``-d regions (which run below the dispatch mode) is not tracked; the KV cache
    is not recognised (it counts as temporaries or activations).
    """

    def __init__(self, *, device: str = "auto", stacks: bool = False,
                 record_history: bool = True, allocator_events: bool = True,
                 baseline: str | Sequence[object] = "gc",
                 max_history_entries: int = 100_000) -> None:
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device not in ("cpu", "cuda"):
            raise MemfitError(f"profile device {device!r} is not supported; valid values: "
                              "auto, cpu, cuda")
        if device == "cuda" and not torch.cuda.is_available():
            raise MemfitError("profile device 'cuda' requested but CUDA is not available; use "
                              "device='cpu' (or 'auto')")
        if isinstance(baseline, str) and baseline != "gc":
            raise MemfitError(f"baseline {baseline!r} is not supported; pass 'gc' (every tensor "
                              "alive at entry) or the objects to count, e.g. (model, optimizer)")
        super().__init__(device, stacks)
        self.baseline = baseline
        self.record_history = record_history and device == "cuda"
        self.allocator_events = allocator_events and device == "cpu"
        self._mark_ops = False
        self.max_history_entries = max_history_entries
        self._names: dict[int, str] = {}       # id(module) -> dotted name
        self._num_roots = 0
        self._param_hooks: list[Any] = []
        self._seen_params: set[int] = set()
        self._param_owner: dict[int, str] = {}
        self._exit: contextlib.ExitStack | None = None
        self._closed = False
        self._start = 0.0
        self.first_call: tuple[nn.Module, tuple[Any, ...]] | None = None
        """The outermost module called first with grad enabled, and its positional arguments
        with tensors replaced by :class:`TensorSpec` (``--predict`` traces it)."""
        self.optimizers: list[torch.optim.Optimizer] = []
        self.result: ProfileResult | None = None
        self._snapshot: dict[str, Any] | None = None

    # -- public ---------------------------------------------------------------------------------

    def __enter__(self) -> Profiler:
        if self._exit is not None or self._closed:
            raise MemfitError("a memfit.profile() object can be entered once; create a new one")
        stack = contextlib.ExitStack()
        try:
            self._setup(stack)
        except BaseException:
            stack.close()
            raise
        self._exit = stack
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._exit is not None
        elapsed = time.perf_counter() - self._start
        try:
            self._exit.close()
        finally:
            self._exit = None
        self._closed = True
        self._ledger.close()
        self.result = self._build(elapsed, self._allocator_peak())

    def mark(self, label: str) -> None:
        """Add a labelled point to the timeline now (e.g. ``prof.mark("after forward")``)."""
        if self._exit is None:
            raise MemfitError("prof.mark() works only inside the `with memfit.profile() as "
                              "prof:` block")
        self._record(_MARK_OP, len(self._ledger.events))
        self._marks.append((len(self._op_events) - 1, str(label)))

    @property
    def peak_bytes(self) -> int:
        return self._require().peak_bytes

    @property
    def breakdown(self) -> dict[MemoryCategory, int]:
        return self._require().breakdown

    def to_dict(self, *, estimate: Estimate | None = None) -> dict[str, Any]:
        return self._require().to_dict(estimate=estimate)

    def save_json(self, path: str | os.PathLike[str], *,
                  estimate: Estimate | None = None) -> None:
        """Write the ``--json`` document to ``path``."""
        import json

        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(estimate=estimate), f, indent=2)
            f.write("\n")

    def report(self, path: str | os.PathLike[str], *, estimate: Estimate | None = None,
               title: str = "memfit profile") -> None:
        """Write the self-contained offline HTML report to ``path``."""
        from memfit.profiling.report.html import write_html

        write_html(path, self._require(), estimate=estimate, title=title)

    def save_png(self, path: str | os.PathLike[str]) -> None:
        """Write the timeline as a PNG (needs ``pip install 'memfit[report]'``)."""
        from memfit.profiling.report.png import write_png

        write_png(path, self._require())

    def save_snapshot(self, path: str | os.PathLike[str]) -> None:
        """CUDA: write the allocator history snapshot (drag it onto https://pytorch.org/memory_viz)."""
        if self._snapshot is None:
            raise MemfitError("no CUDA memory snapshot was recorded; profile on CUDA with "
                              "record_history=True to get one")
        with open(path, "wb") as f:
            pickle.dump(self._snapshot, f)

    # -- setup ----------------------------------------------------------------------------------

    def _require(self) -> ProfileResult:
        if self.result is None:
            raise MemfitError("the profile has no result yet; read it after the `with "
                              "memfit.profile() as prof:` block has ended")
        return self.result

    def _setup(self, stack: contextlib.ExitStack) -> None:
        from torch.nn.modules import module as module_mod
        from torch.optim import optimizer as optim_mod

        if self.device == "cuda":
            torch.cuda.synchronize()
            # torch/cuda/memory.py: reset_peak_memory_stats sets the peaks that
            # max_memory_allocated/reserved read to the bytes allocated/reserved now.
            torch.cuda.reset_peak_memory_stats()
            if self.record_history:
                torch.cuda.memory._record_memory_history(max_entries=self.max_history_entries)
                stack.callback(self._stop_history)
        self._register_baseline()
        stack.callback(self._drop_param_hooks)
        stack.enter_context(_removing(module_mod.register_module_forward_pre_hook(self._pre)))
        stack.enter_context(_removing(module_mod.register_module_forward_hook(self._post)))
        stack.enter_context(_removing(optim_mod.register_optimizer_step_pre_hook(
            self._opt_pre)))
        stack.enter_context(_removing(optim_mod.register_optimizer_step_post_hook(
            self._opt_post)))
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack))
        if self.allocator_events:
            from torch.profiler import ProfilerActivity

            from memfit._noise import quiet_profile

            self._kineto = stack.enter_context(quiet_profile(
                activities=[ProfilerActivity.CPU], profile_memory=True))
            self._mark_ops = True
            stack.callback(setattr, self, "_mark_ops", False)
        stack.enter_context(_Mode(self))
        self._start = time.perf_counter()

    def _stop_history(self) -> None:
        torch.cuda.synchronize()
        self._snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)

    def _register_baseline(self) -> None:
        modules: list[nn.Module] = []
        optimizers: list[torch.optim.Optimizer] = []
        tensors: list[torch.Tensor] = []
        if isinstance(self.baseline, str):
            with warnings.catch_warnings():  # isinstance() on deprecated attributes warns
                warnings.simplefilter("ignore")
                objects: Iterable[object] = gc.get_objects()
                _sort_objects(objects, tensors, modules, optimizers, recurse=False)
        else:
            _sort_objects(self.baseline, tensors, modules, optimizers, recurse=True)
            for m in modules:
                tensors.extend(m.parameters())
                tensors.extend(b for b in m.buffers())
        for t in tensors:
            if _is_fake(t):
                continue
            uid = self._track(t, _BASELINE_OP)
            if uid is None:
                continue
            if isinstance(t, nn.Parameter):
                self._ledger.claim(uid, MemoryCategory.WEIGHTS)
                if t.grad is not None:
                    self._mark(t.grad, MemoryCategory.GRADIENTS)
        for m in modules:
            for b in m._buffers.values():
                if b is not None:
                    self._mark(b, MemoryCategory.WEIGHTS)
        for opt in optimizers:
            self._opt_post(opt, (), {})
        self._baseline = self._ledger.current
        self._baseline_events = len(self._ledger.events)

    def _drop_param_hooks(self) -> None:
        for h in self._param_hooks:
            h.remove()
        self._param_hooks.clear()

    # -- hooks ----------------------------------------------------------------------------------

    def _name_of(self, mod: nn.Module) -> str:
        name = self._names.get(id(mod))
        return type(mod).__name__ if name is None else name

    def _pre(self, mod: nn.Module, args: Any) -> None:
        if _faking():  # Note: [fake work is not measured]
            return
        if not self._modules.stack:
            if id(mod) not in self._names:
                self._discover(mod)
            for a in tensor_leaves(args):
                self._mark(a, MemoryCategory.ACTIVATIONS)
            if self.first_call is None and torch.is_grad_enabled():
                # Shapes only: holding the tensors would change what is measured.
                self.first_call = (mod, tuple(_spec(a) for a in args))
        self._modules.enter(self._module_id(self._name_of(mod)))

    def _post(self, mod: nn.Module, args: Any, out: Any) -> None:
        if _faking():
            return
        self._modules.leave(tensor_leaves(out) if torch.is_grad_enabled() else ())

    def _discover(self, root: nn.Module) -> None:
        """Name the modules of a newly seen top-level module and mark its parameters and buffers
        as weights. The first model's modules are named as in ``named_modules()`` (the model
        itself is ``""``); a second, unrelated one gets its class name as a prefix."""
        prefix = type(root).__name__ if self._num_roots else ""
        self._num_roots += 1
        for mod_name, mod in root.named_modules():
            name = ".".join(x for x in (prefix, mod_name) if x)
            name = self._names.setdefault(id(mod), name)
            for p in mod._parameters.values():
                if p is None:
                    continue
                self._param_owner.setdefault(id(p), name)
                self._mark(p, MemoryCategory.WEIGHTS, name)
                if p.grad is not None:
                    self._mark(p.grad, MemoryCategory.GRADIENTS, name)
                if id(p) not in self._seen_params and p.requires_grad:
                    self._seen_params.add(id(p))
                    self._param_hooks.append(
                        p.register_post_accumulate_grad_hook(self._grad_hook))
            for b in mod._buffers.values():
                if b is not None:
                    self._mark(b, MemoryCategory.WEIGHTS, name)

    def _grad_hook(self, p: torch.Tensor) -> None:
        self._mark(p.grad, MemoryCategory.GRADIENTS, self._param_owner.get(id(p)))

    def _opt_pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if _faking():  # Note: [fake work is not measured]
            return
        self._in_optimizer += 1
        if not any(o is opt for o in self.optimizers):
            self.optimizers.append(opt)
        for group in opt.param_groups:
            for p in group["params"]:
                self._mark(p, MemoryCategory.WEIGHTS, self._param_owner.get(id(p)))
                if p.grad is not None:
                    self._mark(p.grad, MemoryCategory.GRADIENTS, self._param_owner.get(id(p)))

    def _opt_post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if _faking():
            return
        if self._in_optimizer:
            self._in_optimizer -= 1
        for p, state in opt.state.items():
            for v in tensor_leaves(state):
                self._mark(v, MemoryCategory.OPTIMIZER_STATES, self._param_owner.get(id(p)))

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if not _faking():
            self._mark(t, MemoryCategory.ACTIVATIONS)
        return t

def profile(*, device: str = "auto", stacks: bool = False, record_history: bool = True,
            allocator_events: bool = True,
            baseline: str | Sequence[object] = "gc") -> Profiler:
    """Measure the memory of the code in a ``with`` block, by category, module and tensor.

    ``device``: ``auto`` (CUDA if available), ``cpu`` or ``cuda``. ``stacks``: record the Python
    stack of every allocation (slower; shown for the top tensors at the peak). ``record_history``
    (CUDA): keep an allocator history for :meth:`Profiler.save_snapshot`. ``allocator_events``
    (CPU, default on): read the PyTorch profiler's allocator events, so ``peak_bytes`` is the
    allocator's peak and ``inside_kernels_bytes`` the scratch no tensor owned (off: the
    ledger's peak, faster, blind to kernel scratch). ``baseline``: what alive at entry counts,
    ``"gc"`` (every tensor the garbage collector can reach) or the objects to count, e.g.
    ``(model, optimizer, batch)`` (modules, optimizers, tensors, and dicts/lists of them); a
    model or optimizer not listed is still counted, from the moment it is first used.

    >>> import torch, memfit.profiling.session as s
    >>> model = torch.nn.Linear(256, 256)
    >>> with s.profile(device="cpu") as prof:
    ...     model(torch.randn(32, 256)).sum().backward()
    >>> prof.breakdown[MemoryCategory.WEIGHTS] == (256 * 256 + 256) * 4
    True
    """
    return Profiler(device=device, stacks=stacks, record_history=record_history,
                    allocator_events=allocator_events, baseline=baseline)


@contextlib.contextmanager
def _removing(handle: Any) -> Iterator[None]:
    try:
        yield
    finally:
        handle.remove()


@dataclass(frozen=True)
class TensorSpec:
    """Shape, dtype and requires_grad of an argument of the first model call."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    def meta(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device="meta").requires_grad_(
            self.requires_grad)


def _spec(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return TensorSpec(tuple(a.shape), a.dtype, a.requires_grad)
    if isinstance(a, list | tuple):
        return type(a)(_spec(v) for v in a)
    if isinstance(a, dict):
        return {k: _spec(v) for k, v in a.items()}
    return a


def _sort_objects(objects: Iterable[object], tensors: list[torch.Tensor],
                  modules: list[nn.Module], optimizers: list[torch.optim.Optimizer], *,
                  recurse: bool) -> None:
    for obj in objects:
        if isinstance(obj, torch.Tensor):
            tensors.append(obj)
        elif isinstance(obj, nn.Module):
            modules.append(obj)
        elif isinstance(obj, torch.optim.Optimizer):
            optimizers.append(obj)
        elif recurse and isinstance(obj, dict):
            _sort_objects(obj.values(), tensors, modules, optimizers, recurse=True)
        elif recurse and isinstance(obj, list | tuple | set):
            _sort_objects(obj, tensors, modules, optimizers, recurse=True)


def _is_fake(t: torch.Tensor) -> bool:
    """A FakeTensor (or another subclass) whose storage is not really on its device."""
    try:
        return t.untyped_storage().device.type != t.device.type
    except (RuntimeError, NotImplementedError):
        return True


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t
