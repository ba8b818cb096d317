"""The profiler's record of a run: each storage an op made (the :mod:`memfit.ledger` the trace
keeps too), each op's phase, module and Python stack on the timeline, and the
:class:`~memfit.profiling.result.ProfileResult` built from them at the end, with the allocator's
peak placed on that timeline (Note: [ops on the allocator's clock] in
:mod:`memfit.profiling.session`).

:class:`memfit.profiling.session.Profiler` extends :class:`Recorder` with the torch hooks that
feed it (a dispatch mode, module, optimizer and saved-tensor hooks); the record knows nothing of
them.
"""

from __future__ import annotations

import bisect
import os
import sys
from array import array
from types import FrameType
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from memfit._compat import torch_internals
from memfit.categories import MemoryCategory
from memfit.ledger import Ledger, ModuleMemory, ModuleStack, Storage, replay
from memfit.profiling.cpu import marked_allocator_events
from memfit.profiling.result import (
    TRACKED,
    MeasuredPoint,
    ProfileResult,
    TensorRecord,
)

__all__ = ["PHASES", "Recorder"]

PHASES = ("other", "forward", "backward", "optimizer")
_OTHER, _FORWARD, _BACKWARD, _OPTIMIZER = range(4)
_BASELINE_OP = -1
_MARK_OP = -2
_TOP_TENSORS = 12
_STACK_DEPTH = 8
_SKIP_DIRS = tuple(os.path.dirname(m.__file__ or "") + os.sep
                   for m in (torch, sys.modules["memfit"]))
_in_backward = torch_internals.current_graph_task_id()


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


class Recorder:
    """The storages, ops and modules of a measured run on ``device`` (``"cpu"`` or ``"cuda"``),
    with each allocation's Python stack when ``stacks``; :meth:`_build` makes the result."""

    def __init__(self, device: str, stacks: bool) -> None:
        self.device = device
        self.stacks = stacks
        self._op_starts: list[int] = []        # ledger events when dispatched op k started
        self._op_ends: list[int] = []          # ... and when it had been recorded
        self._baseline_events = 0
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
        self._kineto: Any = None

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
        # Note: [fake work is not measured] in memfit.profiling.session
        if nbytes == 0 or isinstance(t, FakeTensor):
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
