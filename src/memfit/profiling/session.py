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

import bisect
import contextlib
import gc
import os
import pickle
import sys
import time
import warnings
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch._C._profiler import _RecordFunctionFast
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

from memfit._compat import torch_internals
from memfit._tensors import tensor_leaves
from memfit.categories import MemoryCategory
from memfit.errors import MemfitError
from memfit.ledger import Ledger, ModuleMemory, ModuleStack, Storage, replay
from memfit.profiling.cpu import OP_MARKER, marked_allocator_events
from memfit.profiling.result import (
    TRACKED,
    MeasuredPoint,
    ProfileResult,
    TensorRecord,
)

if TYPE_CHECKING:
    from memfit.trace.estimate import Estimate

PHASES = ("other", "forward", "backward", "optimizer")
_OTHER, _FORWARD, _BACKWARD, _OPTIMIZER = range(4)
_BASELINE_OP = -1
_MARK_OP = -2
_TOP_TENSORS = 12
_STACK_DEPTH = 8
_SKIP_DIRS = tuple(os.path.dirname(m.__file__ or "") + os.sep
                   for m in (torch, sys.modules["memfit"]))
_in_backward = torch_internals.current_graph_task_id()
_faking = torch_internals.fake_mode_active()


class _Storage(Storage):
    """A measured storage (:class:`memfit.ledger.Storage`; phase and module are indices into
    ``PHASES`` and the profiler's module names), with what made it."""

    __slots__ = ("dtype", "op", "shape", "stack")

    def __init__(self, nbytes: int, op: int, phase: int, module: int,
                 shape: torch.Size, dtype: torch.dtype, stack: int) -> None:
        super().__init__(nbytes, phase, 0, module)
        self.op = op
        self.shape = shape
        self.dtype = dtype
        self.stack = stack


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


class Profiler:
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
        self.baseline = baseline
        self.device = device
        self.stacks = stacks
        self.record_history = record_history and device == "cuda"
        self.allocator_events = allocator_events and device == "cpu"
        self._mark_ops = False
        self._op_starts: list[int] = []        # ledger events when dispatched op k started
        self._op_ends: list[int] = []          # ... and when it had been recorded
        self._baseline_events = 0
        self.max_history_entries = max_history_entries
        self._cuda = device == "cuda"
        # The storages of the run: the ledger the trace keeps too (memfit.ledger).
        self._ledger = Ledger(round_to=512 if self._cuda else 1)
        self._op_events = array("q")             # events recorded once op i returned
        self._op_func = array("l")
        self._op_phase = array("b")
        self._op_module = array("l")
        self._op_alloc = array("q")
        self._op_reserved = array("q")
        self._funcs: dict[Any, int] = {}
        self._func_names: list[str] = []
        self._module_names: list[str] = [""]
        self._module_index: dict[str, int] = {"": 0}
        self._stacks: dict[tuple[tuple[str, int, str], ...], int] = {(): 0}
        self._stack_list: list[tuple[tuple[str, int, str], ...]] = [()]
        self._marks: list[tuple[int, str]] = []
        self._baseline = 0
        self._modules = ModuleStack(0)
        self._in_optimizer = 0
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
        self._kineto: Any = None

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

    # -- tracking -------------------------------------------------------------------------------

    def _track(self, t: torch.Tensor, op: int,
               where: tuple[int, int] | None = None) -> int | None:
        # Note: [per-op cost] this runs for every op output; `is_cpu`/`is_cuda` are cheaper
        # than building `t.device`.
        if not (t.is_cuda if self._cuda else t.is_cpu):
            return None
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse, or a subclass without storage
            return None
        key = st._cdata
        ledger = self._ledger
        uid = ledger.live.get(key)
        if uid is not None:
            return uid
        nbytes = st.nbytes()
        if nbytes == 0 or isinstance(t, FakeTensor):  # Note: [fake work is not measured]
            return None
        phase, module = self._where() if where is None else where
        uid = ledger.add(_Storage(nbytes, op, phase, module, t.shape, t.dtype,
                                  self._stack() if self.stacks else 0), key, st)
        if ledger.current > ledger.peak:
            ledger.reached(ledger.current)
        return uid

    def _mark(self, t: Any, role: MemoryCategory, owner: str | None = None) -> None:
        if isinstance(t, torch.Tensor):
            uid = self._track(t, _BASELINE_OP)
            if uid is not None:
                self._ledger.claim(uid, role, None if owner is None else self._module_id(owner))

    def _after_op(self, func: Any, out: Any) -> None:
        fid = self._funcs.get(func)
        if fid is None:
            fid = self._funcs[func] = len(self._func_names)
            self._func_names.append(str(func))
        where = self._where()
        if isinstance(out, torch.Tensor):
            self._track(out, fid, where)
        elif isinstance(out, list | tuple):
            for o in out:
                if isinstance(o, torch.Tensor):
                    self._track(o, fid, where)
                elif isinstance(o, list | tuple):
                    for p in o:
                        if isinstance(p, torch.Tensor):
                            self._track(p, fid, where)
        self._record(fid, len(self._ledger.events), where)

    def _record(self, fid: int, n_events: int, where: tuple[int, int] | None = None) -> None:
        phase, module = self._where() if where is None else where
        self._op_events.append(n_events)
        self._op_func.append(fid)
        self._op_phase.append(phase)
        self._op_module.append(module)
        if self._cuda:
            self._op_alloc.append(torch.cuda.memory_allocated())
            self._op_reserved.append(torch.cuda.memory_reserved())

    def _where(self) -> tuple[int, int]:
        """(phase, module index) of the op running now."""
        backward = _in_backward is not None and _in_backward() != -1
        stack = self._modules.stack
        if stack:
            module = stack[-1]
        else:
            module = self._modules.backward if backward else 0
        if self._in_optimizer:
            return _OPTIMIZER, module
        if backward:
            return _BACKWARD, module
        return (_FORWARD if stack else _OTHER), module

    def _module_id(self, name: str) -> int:
        idx = self._module_index.get(name)
        if idx is None:
            idx = self._module_index[name] = len(self._module_names)
            self._module_names.append(name)
        return idx

    def _stack(self) -> int:
        frames: list[tuple[str, int, str]] = []
        f: FrameType | None = sys._getframe(3)
        while f is not None and len(frames) < _STACK_DEPTH:
            code = f.f_code
            if not code.co_filename.startswith(_SKIP_DIRS):
                frames.append((code.co_filename, f.f_lineno, code.co_name))
            f = f.f_back
        key = tuple(frames)
        idx = self._stacks.get(key)
        if idx is None:
            idx = self._stacks[key] = len(self._stack_list)
            self._stack_list.append(key)
        return idx

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

    # -- result ---------------------------------------------------------------------------------

    def _build(self, elapsed: float, measured: tuple[int, int] | None) -> ProfileResult:
        """The result; ``measured`` is ``(allocator peak, ledger events at its moment)`` (CPU
        with allocator events), else the ledger's own peak is the peak."""
        ledger = self._ledger
        peak_events = ledger.peak_events if measured is None else measured[1]
        run = replay(ledger, self._op_events, peak_events, TRACKED)
        names = self._func_names
        marks = dict(self._marks)
        cuda = self.device == "cuda"
        timeline = [
            MeasuredPoint(i, f"mark: {marks[i]}" if self._op_func[i] == _MARK_OP
                          else names[self._op_func[i]], PHASES[self._op_phase[i]],
                          self._module_names[self._op_module[i]], after,
                          self._op_alloc[i] if cuda else None,
                          self._op_reserved[i] if cuda else None)
            for i, after in enumerate(run.after)]
        # The peak before op 0's events were all recorded counts as the baseline's.
        peak_index = -1 if run.peak_op == 0 else min(run.peak_op, len(timeline) - 1)
        breakdown = run.peak.by_category(TRACKED)
        at_peak = run.peak.live
        modules = sorted((ModuleMemory(name=self._module_names[m], at_peak=v)
                          for m, v in ledger.by_module(at_peak).items()),
                         key=lambda m: m.total, reverse=True)
        infos = ledger.infos
        top = sorted(at_peak, key=lambda u: ledger.size(infos[u].nbytes),
                     reverse=True)[:_TOP_TENSORS]
        top_tensors = [self._record_of(u) for u in top]
        peak_point = timeline[peak_index] if peak_index >= 0 else None
        peak_bytes = ledger.peak if measured is None else measured[0]
        reserved: int | None = None
        cuda_facts: dict[str, Any] | None = None
        if cuda:
            # torch/cuda/memory.py: max_memory_allocated ("the maximum GPU memory occupied by
            # tensors in bytes", since reset_peak_memory_stats at entry) is the allocator's peak,
            # kernel workspaces included; max_memory_reserved is the caching allocator's.
            peak_bytes = torch.cuda.max_memory_allocated()
            reserved = torch.cuda.max_memory_reserved()
            cuda_facts = _cuda_facts()
        inside_kernels: int | None = None
        if measured is not None or cuda:
            # Note: [inside kernels] what the allocator held at its peak beyond the storages the
            # ledger saw alive then: scratch allocated and freed inside a kernel (oneDNN
            # reorders, cuBLAS workspaces). On CUDA the breakdown is at the ledger's peak,
            # which the allocator's peak may not coincide with.
            inside_kernels = peak_bytes - sum(breakdown.values())
        return ProfileResult(
            device=self.device, peak_bytes=peak_bytes, peak_reserved_bytes=reserved,
            breakdown=breakdown, tracked_peak_bytes=ledger.peak, baseline_bytes=self._baseline,
            peak_index=peak_index, peak_op=peak_point.op if peak_point else "baseline",
            peak_phase=peak_point.phase if peak_point else "other",
            peak_module=peak_point.module if peak_point else "", num_ops=len(timeline),
            timeline=timeline, modules=modules, top_tensors=top_tensors, marks=self._marks,
            cuda=cuda_facts, allocator_peak_bytes=None if measured is None else measured[0],
            inside_kernels_bytes=inside_kernels, stacks=self.stacks,
            seconds=elapsed, torch_version=torch.__version__)

    def _record_of(self, uid: int) -> TensorRecord:
        info: _Storage = self._ledger.infos[uid]  # type: ignore[assignment]
        op = "baseline" if info.op == _BASELINE_OP else self._func_names[info.op]
        return TensorRecord(nbytes=info.nbytes, category=info.category(),
                            module=self._module_names[info.module], phase=PHASES[info.phase],
                            op=op, shape=tuple(info.shape),
                            dtype=str(info.dtype).removeprefix("torch."),
                            stack=self._stack_list[info.stack])

    def _allocator_peak(self) -> tuple[int, int] | None:
        """``(peak bytes, ledger events at the peak)`` from the allocator's events, or None.

        The allocator's running sum starts at the bytes alive at entry. It never sees tensors
        that were allocated before the block, so the ledger's events for those (counted when
        first met, or freed during the block) are merged in, placed where the ledger recorded
        them: between two ops, after the allocator's events there (hooks run outside ops).
        """
        if self._kineto is None:
            return None
        starts, ends, events = self._op_starts, self._op_ends, self._ledger.events
        infos: list[_Storage] = self._ledger.infos  # type: ignore[assignment]
        merged: list[tuple[int, int, int, int]] = [  # (slot, order, ±bytes, ledger position)
            (slot, i, nbytes, -1)
            for i, (slot, nbytes) in enumerate(marked_allocator_events(self._kineto))]
        for idx in range(self._baseline_events, len(events)):
            e = events[idx]
            info = infos[e if e >= 0 else ~e]
            if info.op == _BASELINE_OP:
                slot = 2 * bisect.bisect_right(starts, idx)
                merged.append((slot, len(merged), info.nbytes if e >= 0 else -info.nbytes,
                               idx + 1))
        merged.sort()
        running = peak = self._baseline
        where: tuple[int, int] | None = None
        for slot, _, nbytes, position in merged:
            running += nbytes
            if running > peak:
                peak, where = running, (slot, position)
        if where is None:
            return peak, self._baseline_events
        slot, position = where
        if position >= 0:
            return peak, position
        k = slot // 2
        if slot % 2:  # inside op k: its outputs are alive, what it made and freed is not
            return peak, ends[k]
        return peak, starts[k] if k < len(starts) else len(events)

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


def _cuda_facts() -> dict[str, Any]:
    stats = torch.cuda.memory_stats()
    reserved = int(stats.get("reserved_bytes.all.current", 0))
    allocated = int(stats.get("allocated_bytes.all.current", 0))
    inactive = int(stats.get("inactive_split_bytes.all.current", 0))
    return {
        "device_name": torch.cuda.get_device_name(),
        "total_bytes": torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory,
        "allocated_bytes": allocated,
        "reserved_bytes": reserved,
        "inactive_split_bytes": inactive,
        "fragmentation": (inactive / reserved) if reserved else 0.0,
        "num_alloc_retries": int(stats.get("num_alloc_retries", 0)),
        "num_ooms": int(stats.get("num_ooms", 0)),
    }
