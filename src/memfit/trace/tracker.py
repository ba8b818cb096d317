"""Storage-level accounting of one traced run: every allocation and free, in order.

A fake tensor mode sees each op; every output whose storage is new is an allocation (views
share their base's storage and in-place ops return it, so neither counts twice), and a weakref
callback on the storage records the free when the last tensor using it dies. Categories are decided
after the run, from what each storage turned out to be (a parameter, a ``.grad``, an optimizer
state, a forward tensor still alive when the forward ended...), so the breakdown at the peak is
exact even though the peak happens before some roles are known (e.g. Adam's states created in the
first step).

The log, the running peak, the replay and module attribution are :mod:`memfit.ledger`'s, the one
ledger the profiler of real runs keeps too; this module feeds it from fake tensors.

Where real tensors behave differently from fake ones, the real behaviour is modelled:
- autograd sums two gradients of one input in place when it holds the only reference, but never
  for tensor subclasses (fake tensors): see :mod:`memfit.trace.grad_accumulation`;
- a tensor subclass that stores other tensors (quantized weights) is its inner tensors' storages.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.utils._mode_utils import no_dispatch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from memfit._compat import torch_internals
from memfit.categories import MemoryCategory
from memfit.errors import MemfitError
from memfit.ledger import Ledger, ModuleStack, Storage
from memfit.trace import sparse
from memfit.trace.cpu_kernels import is_opaque, rnn_workspace_bytes, transient_peak
from memfit.trace.datadep import ASSUMPTION, DATA_DEPENDENT, DataDependentSizes
from memfit.trace.fastkey import (
    _DEVICE_HANDLER,
    FastCacheKey,
    cacheable_twin,
    device_of,
    lifted_constant,
)
from memfit.trace.fastkey import enabled as fast_keys_enabled
from memfit.trace.grad_accumulation import ADD, called_by_autograd_engine, gradient_accumulation

_FORWARD = "forward"
aten = torch.ops.aten
_PRIM_DEVICE = torch.ops.prim.device.default
_ITEM = aten._local_scalar_dense.default
_MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
            aten._addmm_activation.default, aten.addmv.default, aten.mv.default}


class StorageInfo(Storage):
    """One allocation of the trace (see :class:`memfit.ledger.Storage`), with its block in the
    allocator model and whether it is host memory."""

    __slots__ = ("handle", "host")

    def __init__(self, nbytes: int, phase: str, step: int, module: str,
                 host: bool = False) -> None:
        super().__init__(nbytes, phase, step, module)
        self.host = host  # host memory of a device target: not part of the device's peak
        self.handle: int | None = None


class Tracker(Ledger):
    """Allocation log of a traced run on one device type ("cpu" or "cuda"): the shared storage
    ledger (:class:`memfit.ledger.Ledger`) fed from fake tensors, with the CUDA allocator model
    and host memory.

    ``host_split``: the target is a device with memory of its own (CUDA), so storages created as
    host memory (see host.py) are kept out of the device's log and counted in ``host_peak``."""

    def __init__(self, device_type: str, *, round_to: int = 1, allocator: Any = None,
                 host_split: bool = False) -> None:
        super().__init__(round_to=round_to)
        self.device_type = device_type
        self.allocator = allocator
        self.host_split = host_split
        self.host_depth = 0  # > 0 inside host.host_memory(): new storages are host memory
        self._host_keys: dict[int, weakref.ref[Any]] = {}  # host storages made while not tracking
        self.host_current = 0
        self.host_peak = 0
        self.infos: list[StorageInfo] = []  # type: ignore[assignment]
        self._resized: set[int] = set()  # storages resize_ freed (see resize)
        # One mark per op: (op, phase, step, module, number of events once the op returned).
        self.ops: list[tuple[Any, str, int, str, int]] = []
        self.phase = "setup"
        self.step = 0
        self.modules = ModuleStack("")
        self.peak_op = -1
        # ``peak_extra`` (the ledger's bytes at the peak beyond the storages, counted as
        # temporaries): transient scratch inside an opaque CPU kernel, or on CUDA the
        # allocator's whole-block excess (Note: [peak in allocator blocks]).
        self.phase_peaks: dict[tuple[int, str], int] = {}  # (step, phase) -> its high point
        self.op_peaks: dict[int, int] = {}  # op index -> high point inside that op's kernel
        self.stream = 0  # CUDA stream new device storages are allocated on (0: the compute one)
        self.oom: Any = None  # the first SimulatedOOM of the allocator model (then unlimited)
        self.on_forward_end: list[Any] = []  # called when the forward ends (replayed blocks)

    @property
    def module(self) -> str:
        if self.phase == "backward":
            return str(self.modules.backward)
        return str(self.modules.top())

    def track(self, t: torch.Tensor, role: MemoryCategory | None = None,
              module: str | None = None) -> int | None:
        """Record ``t``'s storage if it is new; return its uid (or None: other device/empty).

        A tensor subclass that stores other tensors is recorded as those tensors' storages."""
        if is_traceable_wrapper_subclass(t):
            uid = None
            for name in t.__tensor_flatten__()[0]:  # type: ignore[attr-defined]
                inner = getattr(t, name)
                if isinstance(inner, torch.Tensor):  # DTensor also names its device_mesh
                    uid = self.track(inner, role, module)
            return uid
        if t.layout in _SPARSE_LAYOUTS:
            return self._track_sparse(t, role, module)
        # A FakeTensor's ``.device`` is a dispatched op (prim.device); its attribute is not.
        device = getattr(t, "fake_device", None) or t.device
        st = t.untyped_storage()
        key = st._cdata
        host = self.host_split and (self.host_depth > 0 or key in self._host_keys)
        if device.type != self.device_type and not host:
            return None
        uid = self.live.get(key)
        if uid is None:
            nbytes = st.nbytes()
            if nbytes == 0:
                return None
            uid = self._allocate(StorageInfo(nbytes, self.phase, self.step,
                                             self.module if module is None else module, host))
            self.watch(uid, key, st)
        if role is not None:
            self.assign(uid, role, module)
        return uid

    def _track_sparse(self, t: torch.Tensor, role: MemoryCategory | None,
                      module: str | None) -> int | None:
        """A sparse COO tensor is its indices and values (see sparse.py); the indices of an
        embedding's gradient are the ids the forward looked up, which keep the role they have."""
        if t.layout is not torch.sparse_coo:
            raise MemfitError(f"the trace does not know the {t.layout} layout's storages; only "
                              f"sparse COO tensors (nn.Embedding(sparse=True)) are traced")
        indices, values = sparse.parts(t)
        uid = self.live.get(indices.untyped_storage()._cdata)
        if uid is None or self.infos[uid].role is None:
            self.track(indices, role, module)
        else:
            self.track(indices)
        return self.track(values, role, module)

    def freed(self, uid: int) -> None:
        info = self.infos[uid]
        if info.host:
            self.host_current -= info.nbytes
            return
        super().freed(uid)
        if self.allocator is not None and info.handle is not None:
            self.allocator.free(info.handle)

    def add_pseudo(self, nbytes: int, role: MemoryCategory, module: str = "") -> None:
        """An allocation no tensor stands for (a library workspace) that lives to the end."""
        info = StorageInfo(nbytes, self.phase, self.step, module)
        info.role = role
        self._allocate(info)

    def resize(self, st: Any, nbytes: int) -> None:
        """``UntypedStorage.resize_(nbytes)`` of a storage this tracker has seen: the old
        allocation is freed and, for ``nbytes > 0``, a new one is made for the same storage, as
        the allocator does (FSDP2 frees and re-allocates its all-gather outputs so:
        ``torch/distributed/fsdp/_fully_shard/_fsdp_param.py: free_storage, alloc_storage``)."""
        key = st._cdata
        uid = self.live.get(key)
        if uid is not None:
            self._freer(uid, key)(None)
            self._resized.add(key)
        elif key not in self._resized:
            return  # never tracked (another device, or made before the trace)
        if nbytes > 0:
            new = self._allocate(StorageInfo(nbytes, self.phase, self.step, self.module))
            self.watch(new, key, st)

    def _allocate(self, info: StorageInfo) -> int:
        """Record a new allocation: its event, the allocator model, the running peak."""
        if info.host:
            self.host_current += info.nbytes
            self.host_peak = max(self.host_peak, self.host_current)
            return self.add_untracked(info)
        uid = self.add(info)
        level = self.current
        if self.allocator is not None:
            info.handle = self._malloc(info.nbytes)
            # Note: [peak in allocator blocks] On CUDA the peak is the allocator's
            # allocated_bytes (max_memory_allocated): whole block sizes. A block that
            # should_split does not split (large pool, remainder <= 1 MiB or request >=
            # max_split_size) is handed out and counted whole, above the 512-rounded request.
            # That excess is carried as peak_extra (counted with the temporaries).
            level = self.allocator.allocated_bytes
        self.reached(level)
        return uid

    def reached(self, level: int) -> bool:
        key = (self.step, self.phase)
        if level > self.phase_peaks.get(key, 0):
            self.phase_peaks[key] = level
        if super().reached(level):
            self.peak_op = len(self.ops)
            return True
        return False

    def _malloc(self, nbytes: int) -> int:
        """The allocator model's malloc on the current stream. A simulated out-of-memory (the
        step would not fit the GPU) is remembered in ``oom`` and the trace goes on with an
        unlimited device, so the estimate still says by how much it does not fit."""
        from memfit.trace.allocator_model import SimulatedOOM

        allocator = self.allocator
        try:
            return int(allocator.malloc(nbytes, self.stream))
        except SimulatedOOM as error:
            if self.oom is None:
                # Kept without its traceback: the frames it holds (the optimizer's, say) would
                # keep their tensors (gradients) alive after the step freed them.
                self.oom = error.with_traceback(None)
            allocator.capacity = None
            allocator.allowed_memory_maximum = None
            return int(allocator.malloc(nbytes, self.stream))

    def op_started(self) -> None:
        """An op is about to run: the side-stream work recorded before it is done
        (``process_events``): see Note: [record_stream in a trace]."""
        if self.allocator is not None and self.allocator.pending_free_bytes:
            self.allocator.process_events()

    @contextlib.contextmanager
    def on_stream(self, stream: int) -> Iterator[None]:
        """Allocate new device storages on CUDA stream ``stream`` (its own pools) inside."""
        before, self.stream = self.stream, stream
        try:
            yield
        finally:
            self.stream = before

    def record_stream(self, t: torch.Tensor, stream: int) -> None:
        """``t.record_stream(stream)``: ``t``'s block is in use on ``stream`` too, so its free
        waits for that stream.

        Note: [record_stream in a trace] PyTorch frees such a block only once an event recorded
        on ``stream`` at the free has completed (``insert_events``), and finds out at the next
        ``malloc`` (``process_events``). The trace has no clock: it takes the side-stream work
        (an offload copy) to be done by the time the next op starts, so the block is unusable
        for the rest of the op that freed it (:meth:`op_started`).
        """
        if self.allocator is None or is_traceable_wrapper_subclass(t):
            return
        uid = self.live.get(t.untyped_storage()._cdata)
        if uid is not None and self.infos[uid].handle is not None:
            self.allocator.record_stream(self.infos[uid].handle, stream)

    def mark_host(self, t: torch.Tensor) -> None:
        """Remember ``t``'s storage as host memory (made inside host.host_memory() by an op the
        fake mode does not track: building an optimizer, say) until it is freed."""
        if not self.host_split or is_traceable_wrapper_subclass(t):
            return
        st = t.untyped_storage()
        key = st._cdata
        if key not in self._host_keys:
            self._host_keys[key] = weakref.ref(st, lambda _: self._host_keys.pop(key, None))

    def is_host(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage was recorded as host memory."""
        key = t.untyped_storage()._cdata
        uid = self.live.get(key)
        return key in self._host_keys or (uid is not None and self.infos[uid].host)

    def transient(self, candidate: int) -> None:
        """An op's kernel held ``candidate`` live bytes at its high point (see cpu_kernels.py)."""
        op = len(self.ops)  # this op's index (it is appended once it returns)
        self.op_peaks[op] = max(candidate, self.op_peaks.get(op, 0))
        self.reached(candidate)

    def end_forward(self) -> None:
        """Mark forward-created storages alive now as saved activations (first, the frees
        ``on_forward_end`` stands in for: see Note: [replaying identical blocks])."""
        for callback in self.on_forward_end:
            callback()
        infos = self.infos
        for uid in self.live.values():
            info = infos[uid]
            if info.phase == _FORWARD and info.step == self.step and not info.host:
                info.saved = True


_SPARSE_OPS = frozenset(map(id, sparse.OPS))  # (an int's hash is cheaper than an op's)
_SPARSE_LAYOUTS = frozenset({torch.sparse_coo, torch.sparse_csr, torch.sparse_csc,
                             torch.sparse_bsr, torch.sparse_bsc})


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, list | tuple):
        found: list[torch.Tensor] = []
        for o in out:
            found.extend(_tensors(o))
        return found
    return []


_DYNAMO: list[Any] = []  # [get_eval_frame_callback, torch._dynamo.eval_frame] once loaded


def _load_dynamo() -> list[Any]:
    """The two names :meth:`TrackingFakeMode.__torch_dispatch__` reads (loaded at the first
    op, as torch's own wrapper imports ``torch._dynamo`` at its first call)."""
    try:
        from torch._C._dynamo.eval_frame import get_eval_frame_callback
        from torch._dynamo import eval_frame

        eval_frame._stance.stance  # noqa: B018 - torch >= 2.6 (torch.compiler.set_stance)
        _DYNAMO[:] = [get_eval_frame_callback, eval_frame]
    except (ImportError, AttributeError):  # another torch: its wrapper on every call
        _DYNAMO[:] = [lambda: True, None]
    return _DYNAMO


class TrackingFakeMode(FastCacheKey, FakeTensorMode):
    """A FakeTensorMode that records the new output storages of every top-level op.

    Tracking inside the fake mode itself (rather than in a dispatch mode stacked on top) halves
    the per-op cost: ``.device`` queries and the fake mode's own re-dispatches (decompositions,
    depth > 0) pass straight through, and only ops the program called are recorded.
    """

    def __init__(self, tracker: Tracker, datadep: DataDependentSizes, warn: Any, *,
                 measure_cpu_kernels: bool = False) -> None:
        super().__init__(allow_non_fake_inputs=True)
        self.measure_cpu_kernels = measure_cpu_kernels
        self.tracker = tracker
        self.datadep = datadep
        self.warn = warn
        self.tracking = False
        self._depth = 0
        # phase -> byte sizes of the workspaces a matmul first run in that phase allocates
        # (cuBLAS keeps one per handle, and the backward runs on another thread: another handle).
        self.matmul_workspaces: dict[str, list[int]] = {}
        self._oom_noted: Any = None
        self.fast_keys = fast_keys_enabled()  # see Note: [fast cache key] in fastkey.py
        self.sparse_ids = sparse.SparseIds(datadep)

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """No dynamo-disable wrapper from ``TorchDispatchMode.__init_subclass__``:
        :meth:`__torch_dispatch__` applies it itself, only where it does something (Note:
        [dynamo's disable wrapper])."""
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # Note: [dynamo's disable wrapper] torch wraps a dispatch mode's __torch_dispatch__ in
        # ``torch._disable_dynamo`` (``torch/utils/_python_dispatch.py:
        # TorchDispatchMode.__init_subclass__``), whose ``_fn`` (``torch/_dynamo/eval_frame.py:
        # DisableContext.__call__``) sets the eval-frame callback to None, then to
        # ``_callback_from_stance(None)`` (None under the "default" stance), runs the function
        # (annotating it only when exporting a function not named __torch_dispatch__) and
        # restores the prior callback. With no callback set and the default stance all of that
        # leaves every state as it was: the body runs directly. Else torch's wrapper runs it.
        # The trace asks this about three times per op (two of them prim.device).
        dynamo = _DYNAMO or _load_dynamo()
        if dynamo[0]() is not None or dynamo[1]._stance.stance != "default":
            return _disabled_top(self, func, types, args, kwargs)
        if func is _PRIM_DEVICE:  # as _top (device_of), two Python calls fewer: 2 per op
            return _DEVICE_HANDLER(args)
        return self._top(func, types, args, kwargs)

    def _top(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is _PRIM_DEVICE:
            return device_of(args)  # FakeTensorMode.dispatch's own answer (_device_handler)
        if self._depth:
            return self.dispatch(func, types, args, kwargs)
        if not self.tracking:
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if self.tracker.host_depth:
                for t in _tensors(out):
                    self.tracker.mark_host(t)
            return out
        self._depth += 1
        try:
            # Below the Python API: torch-function modes (the CUDA SDPA routing) have nothing to
            # say about the fake kernels or this bookkeeping, and would otherwise handle each of
            # its tensor-method calls.
            with torch_internals.DisableTorchFunction():
                return self._tracked(func, types, args, kwargs or {})
        finally:
            self._depth -= 1

    def _run(self, func: Any, types: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        # FakeTensorMode.__torch_dispatch__ minus its wrappers (a call counter, a second dynamo
        # disable inside this mode's own) and its "fake mode not set" assertion.
        if self.fast_keys:
            func = cacheable_twin(func, args)
            lifted = lifted_constant(self, func, args, kwargs)  # Note: [lifted constants]
            if lifted is not None:
                return lifted
        return self.dispatch(func, types, args, kwargs)

    def _tracked(self, func: Any, types: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        tracker = self.tracker
        if func is ADD and tracker.phase == "backward" and not kwargs:
            func, args = gradient_accumulation(args)
        tracker.op_started()
        if self.matmul_workspaces and func in _MATMULS:
            for nbytes in self.matmul_workspaces.pop(tracker.phase, []):
                tracker.add_pseudo(nbytes, MemoryCategory.RUNTIME)
        data_dependent = func in DATA_DEPENDENT  # (an OpOverload's hash is a Python call)
        known = self.datadep.known_answer(func, args) if data_dependent else None
        sparse_out = (sparse.run(func, args, kwargs, self, self.sparse_ids,
                                 engine_call=func is sparse.CLONE and called_by_autograd_engine(),
                                 cpu_kernels=self.measure_cpu_kernels)
                      if id(func) in _SPARSE_OPS and sparse.handles(func, args) else None)
        if sparse_out is not None:
            out = sparse_out
            if self.sparse_ids.assumed:
                self.warn(sparse.ASSUMPTION)
        elif known is not None:
            out = known
        elif (func is _ITEM and type(args[0]) is FakeTensor and args[0].constant is not None
              and args[0].fake_mode is self and self.shape_env is None):
            # What the fake mode does for ``.item()`` of a tensor with a known value (AdamW's
            # step counts: twice per parameter per step, ``adam.py: _get_value``), without the
            # rest of ``FakeTensorMode._dispatch_impl``: the op run on the constant, no dispatch.
            with no_dispatch():
                out = func(args[0].constant)
        elif data_dependent:
            try:
                out = self._run(func, types, args, kwargs)
            except (DynamicOutputShapeException, DataDependentOutputException, RuntimeError):
                with self:  # the answer is made of fake tensors
                    out = self.datadep.handle(func, args, kwargs)
                if out is None:
                    raise
                if not self.datadep.replayed_last:  # answered by an assumption
                    self.datadep.assumed_in.add(tracker.phase)
                    self.warn(ASSUMPTION)
        elif self.measure_cpu_kernels and is_opaque(func, args):
            within = transient_peak(func, args, kwargs)
            before = tracker.current
            out = self._run(func, types, args, kwargs)
            if func is aten.mkldnn_rnn_layer.default:
                ws = rnn_workspace_bytes(args, kwargs)
                if ws:
                    with self:
                        workspace = torch.empty(ws, dtype=torch.uint8, device=out[3].device)
                    out = (*out[:3], workspace)
            for t in _tensors(out):
                tracker.track(t)
            if within is not None:
                tracker.transient(before + within)
        else:
            out = self._run(func, types, args, kwargs)
        for t in _tensors(out):
            tracker.track(t)
        if tracker.oom is not None and tracker.oom is not self._oom_noted:
            self._oom_noted = tracker.oom
            self.warn(f"an unlimited GPU from {func} on: the step does not fit ({tracker.oom})")
        if func is sparse.CREATE:
            self.sparse_ids.created(func, args, out)
        tracker.ops.append((func, tracker.phase, tracker.step, tracker.module,
                            len(tracker.events)))
        self.datadep.observe(func, args, kwargs, out)
        return out


# torch's own wrapper (Note: [dynamo's disable wrapper]), for when dynamo has a callback set.
_disabled_top = torch._disable_dynamo(TrackingFakeMode._top, recursive=True)
