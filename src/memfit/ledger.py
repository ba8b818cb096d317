"""The one storage ledger of predicted and measured memory, and the one timeline type.

Both the trace (:mod:`memfit.trace.tracker`, fake tensors) and the profiler
(:mod:`memfit.profiling.session`, real tensors) record a run the same way:

- every new storage is an **allocation** (:meth:`Ledger.add`): its bytes, the phase and the module
  running when it was made; a weakref on the storage records its **free** when the last tensor
  using it dies (:meth:`Ledger.watch`). The log is one integer per event: ``uid`` for an
  allocation, ``~uid`` for a free;
- what a storage *is* (a weight, a ``.grad``, an optimizer state, an activation...) is decided
  when it becomes known (:meth:`Ledger.assign`, :meth:`Ledger.claim`), possibly after the peak:
  replaying the log afterwards (:func:`replay`) gives the exact breakdown at the peak;
- the running total and its peak (:meth:`Ledger.reached`): the level can be the ledger's own
  bytes or, where the caller knows better, an allocator's count (the trace's CUDA allocator
  model, a CPU kernel's scratch); the bytes beyond the storages are ``peak_extra``;
- module attribution (:class:`ModuleStack`): the innermost module whose forward is running, and
  in backward the module whose output's gradient was computed last.

The result of either is a list of :class:`TimelinePoint` (bytes by category after each op) and a
:class:`Snapshot` at the peak, so a prediction and a measurement compare category by category.
This module imports no torch.
"""

from __future__ import annotations

import weakref
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from memfit.categories import MemoryCategory

CATEGORIES = (MemoryCategory.WEIGHTS, MemoryCategory.GRADIENTS, MemoryCategory.OPTIMIZER_STATES,
              MemoryCategory.ACTIVATIONS, MemoryCategory.KV_CACHE, MemoryCategory.TEMPORARIES,
              MemoryCategory.RUNTIME)
"""The order of :attr:`TimelinePoint.bytes`. ``RUNTIME`` is last: only a trace has it (the cuBLAS
workspaces its allocator model holds); a measured run's storages are never runtime."""

STORAGE_CATEGORIES = CATEGORIES[:-1]
"""The categories a tensor storage can be in (a measured timeline's columns)."""

ROLE_PRIORITY = {MemoryCategory.WEIGHTS: 0, MemoryCategory.GRADIENTS: 1,
                 MemoryCategory.OPTIMIZER_STATES: 2, MemoryCategory.KV_CACHE: 3,
                 MemoryCategory.ACTIVATIONS: 4, MemoryCategory.TEMPORARIES: 5,
                 MemoryCategory.RUNTIME: 6}
"""For :meth:`Ledger.claim`, lower wins: a parameter saved for backward stays a weight, a
``.grad`` saved for backward stays a gradient."""
_NO_ROLE = len(ROLE_PRIORITY)


@dataclass(frozen=True, slots=True)
class TimelinePoint:
    """Live bytes right after one op (or a user mark), predicted or measured."""

    index: int
    """Position of the op in the run (0-based, over all steps)."""
    op: str
    """The aten op (``aten.mm.default``), or ``mark: <label>`` for a profiler mark."""
    phase: str
    """``forward``, ``backward``, ``optimizer``; a trace also has ``zero_grad``, a measured run
    ``other`` (outside any module, optimizer step or backward)."""
    module: str
    """Dotted name of the innermost module running the op (``""``: the model itself / none)."""
    bytes: tuple[int, ...]
    """Live bytes per category, in the order of :data:`CATEGORIES` (a measured run's stop before
    ``RUNTIME``: :data:`STORAGE_CATEGORIES`)."""
    allocated: int | None = None
    """Measured on CUDA only: ``torch.cuda.memory_allocated()`` after the op."""
    reserved: int | None = None
    """Measured on CUDA only: ``torch.cuda.memory_reserved()`` after the op."""
    step: int = 0
    """Training step (0-based) of a traced run; 0 for a measured one."""

    @property
    def total(self) -> int:
        return sum(self.bytes)

    def by_category(self) -> dict[MemoryCategory, int]:
        return dict(zip(CATEGORIES[:len(self.bytes)], self.bytes, strict=True))


@dataclass(frozen=True, kw_only=True)
class ModuleMemory:
    """Bytes attributed to one module (its own tensors, not its children's), predicted or
    measured."""

    name: str
    at_peak: dict[MemoryCategory, int]
    """Bytes live at the peak that this module created, or owns: the weights, gradients and
    optimizer states of its own parameters."""
    activation_bytes: int = 0
    """Traced: bytes this module created in the forward pass that were still alive when it ended
    (saved for backward), summed over all calls in the first step. 0 when measured."""

    @property
    def total(self) -> int:
        return sum(self.at_peak.values())

    @property
    def peak_total(self) -> int:
        """The same as :attr:`total` (the trace's name)."""
        return self.total


class Storage:
    """One allocation: its size, when and where it was made, and what it turned out to be.

    ``phase`` and ``module`` are the recorder's tags (the trace's are strings; the profiler keeps
    small integers, indices into its tables). The category is ``role`` once one is known, else
    ``ACTIVATIONS`` for a storage made in a forward and still alive when it ended (``saved``),
    else ``TEMPORARIES``."""

    __slots__ = ("module", "nbytes", "phase", "role", "saved", "step")

    def __init__(self, nbytes: int, phase: Any, step: int, module: Any) -> None:
        self.nbytes = nbytes
        self.phase = phase
        self.step = step
        self.module = module
        self.role: MemoryCategory | None = None
        self.saved = False

    def category(self) -> MemoryCategory:
        if self.role is not None:
            return self.role
        if self.saved:
            return MemoryCategory.ACTIVATIONS
        return MemoryCategory.TEMPORARIES


class Ledger:
    """Allocations and frees of one run, in order, with the running total and its peak.

    ``round_to``: each storage counts as its size rounded up to a multiple of this (512 on CUDA,
    the caching allocator's ``kMinBlockSize``; 1 on CPU)."""

    def __init__(self, *, round_to: int = 1) -> None:
        self.round_to = round_to
        self.infos: list[Storage] = []
        self.live: dict[int, int] = {}  # storage key (StorageImpl address, _cdata) -> uid
        self._refs: dict[int, weakref.ref[Any]] = {}
        self.events = array("q")  # uid for an allocation, ~uid for a free
        self.current = 0
        self.peak = 0
        self.peak_events = 0  # events replayed at the peak
        # Bytes at the peak beyond the storages alive then (kernel scratch, whole allocator
        # blocks): what :meth:`reached` was told minus ``current``.
        self.peak_extra = 0
        self.closed = False

    def size(self, nbytes: int) -> int:
        """The bytes a storage of ``nbytes`` counts for."""
        r = self.round_to
        return nbytes if r == 1 else -(-nbytes // r) * r

    def add(self, info: Storage, key: int | None = None, storage: Any = None) -> int:
        """Record an allocation (its event and the running total); returns its uid. With
        ``storage``, watch it (:meth:`watch`). The peak is the caller's to update
        (:meth:`reached`), since what the level is depends on it."""
        uid = len(self.infos)
        self.infos.append(info)
        self.events.append(uid)
        r = self.round_to  # Note: [per-op cost] size() inlined: this runs for every allocation
        self.current += info.nbytes if r == 1 else -(-info.nbytes // r) * r
        if storage is not None:
            self.live[key] = uid  # type: ignore[index]
            self._refs[uid] = weakref.ref(storage, self._freer(uid, key))  # type: ignore[arg-type]
        return uid

    def add_untracked(self, info: Storage) -> int:
        """Record a storage that is not part of this ledger's memory (host memory of a device
        target): it gets a uid but no event."""
        self.infos.append(info)
        return len(self.infos) - 1

    def watch(self, uid: int, key: int, storage: Any) -> None:
        """``storage`` (key ``key``) is ``uid``'s: record the free when it is collected."""
        self.live[key] = uid
        self._refs[uid] = weakref.ref(storage, self._freer(uid, key))

    def _freer(self, uid: int, key: int) -> Callable[[Any], None]:
        def free(_: Any) -> None:
            if self.closed:
                return
            if self.live.get(key) == uid:
                del self.live[key]
            self._refs.pop(uid, None)
            self.freed(uid)
        return free

    def freed(self, uid: int) -> None:
        """``uid``'s storage was freed: its event and the running total."""
        self.events.append(~uid)
        nbytes = self.infos[uid].nbytes
        r = self.round_to
        self.current -= nbytes if r == 1 else -(-nbytes // r) * r

    def reached(self, level: int) -> bool:
        """The run holds ``level`` bytes now; whether that is a new peak (then the peak is
        placed here on the event log)."""
        if level > self.peak:
            self.peak = level
            self.peak_events = len(self.events)
            self.peak_extra = level - self.current
            return True
        return False

    def assign(self, uid: int, role: MemoryCategory, module: Any = None) -> None:
        """``uid`` is a ``role`` (owned by ``module`` if given): the last word wins."""
        info = self.infos[uid]
        info.role = role
        if module is not None:
            info.module = module

    def claim(self, uid: int, role: MemoryCategory, module: Any = None) -> None:
        """``uid`` was seen as a ``role`` (owned by ``module`` if given): the strongest role wins
        (:data:`ROLE_PRIORITY`); an owner of the same role (activations excepted: they belong to
        the module that made them) moves the storage to that module."""
        info = self.infos[uid]
        if ROLE_PRIORITY[role] < ROLE_PRIORITY.get(info.role, _NO_ROLE):  # type: ignore[arg-type]
            info.role = role
            if module is not None:
                info.module = module
        elif role is info.role and module is not None and role is not MemoryCategory.ACTIVATIONS:
            info.module = module

    def by_module(self, uids: Iterable[int]) -> dict[Any, dict[MemoryCategory, int]]:
        """Bytes of the storages ``uids`` by module, then category."""
        out: dict[Any, dict[MemoryCategory, int]] = {}
        infos = self.infos
        for uid in uids:
            info = infos[uid]
            per = out.setdefault(info.module, {})
            cat = info.category()
            per[cat] = per.get(cat, 0) + self.size(info.nbytes)
        return out

    def close(self) -> None:
        """Stop recording: frees from now on are not events."""
        self.closed = True
        self._refs.clear()


@dataclass(frozen=True)
class Snapshot:
    """The ledger at one moment: live bytes by category and the storages alive."""

    events: int
    """Events replayed (the moment, on the event log)."""
    bytes: tuple[int, ...]
    """Live bytes per category, in the order of the replay's categories."""
    live: frozenset[int]
    """uids of the storages alive."""

    def by_category(self, categories: Sequence[MemoryCategory] = CATEGORIES
                    ) -> dict[MemoryCategory, int]:
        """Every category of :class:`MemoryCategory`, with its bytes (0 if not replayed)."""
        out = {c: 0 for c in MemoryCategory}
        out.update(zip(categories, self.bytes, strict=True))
        return out


@dataclass(frozen=True)
class Replay:
    """A ledger's log replayed once the roles are known: bytes by category after each op, and
    the snapshot at the peak."""

    after: list[tuple[int, ...]]
    """Live bytes per category once op ``i``'s events were recorded."""
    peak: Snapshot
    peak_op: int
    """The first op whose events reach the peak (``len(after)``: after the last op)."""


def replay(ledger: Ledger, op_events: Sequence[int], peak_events: int,
           categories: Sequence[MemoryCategory] = CATEGORIES) -> Replay:
    """Replay ``ledger``'s events: ``op_events[i]`` is the number of events recorded once op
    ``i`` returned (non-decreasing), ``peak_events`` the number at the peak."""
    infos = ledger.infos
    index = {c: i for i, c in enumerate(categories)}
    cat = [index[info.category()] for info in infos]
    size = ledger.size
    nbytes = [size(info.nbytes) for info in infos]
    events = ledger.events
    totals = [0] * len(categories)
    live: set[int] = set()
    done = 0

    def to(upto: int) -> None:
        nonlocal done
        for e in events[done:upto]:
            if e >= 0:
                totals[cat[e]] += nbytes[e]
                live.add(e)
            else:
                totals[cat[~e]] -= nbytes[~e]
                live.discard(~e)
        done = max(done, upto)

    after: list[tuple[int, ...]] = []
    snapshot: Snapshot | None = None
    peak_op = len(op_events)
    for i, n_events in enumerate(op_events):
        if snapshot is None and peak_events <= n_events:
            to(peak_events)
            snapshot = Snapshot(peak_events, tuple(totals), frozenset(live))
            peak_op = i
        to(n_events)
        after.append(tuple(totals))
    if snapshot is None:  # the peak came after the last op (or there is none)
        to(peak_events)
        snapshot = Snapshot(peak_events, tuple(totals), frozenset(live))
    return Replay(after, snapshot, peak_op)


class ModuleStack:
    """Which module is running: the innermost module whose forward is running (``enter`` /
    ``leave`` from forward pre- and post-hooks), and in backward the module whose output's
    gradient was computed last (``leave`` hooks the outputs that require grad).

    Module tags are the recorder's (names, or indices into a table); ``none`` is the tag of no
    module."""

    __slots__ = ("backward", "none", "stack")

    def __init__(self, none: Any = "") -> None:
        self.none = none
        self.stack: list[Any] = []
        self.backward: Any = none

    def enter(self, module: Any) -> None:
        self.stack.append(module)

    def leave(self, outputs: Iterable[Any] = ()) -> None:
        """The innermost forward returned ``outputs`` (tensors; pass none with grad disabled):
        a gradient hook on each that requires grad marks the module in backward."""
        if not self.stack:
            return
        module = self.stack.pop()
        marker: Callable[[Any], None] | None = None
        for t in outputs:
            if t.requires_grad and t.grad_fn is not None:
                if marker is None:
                    marker = self._marker(module)
                t.register_hook(marker)

    def _marker(self, module: Any) -> Callable[[Any], None]:
        def mark(_grad: Any) -> None:
            self.backward = module
        return mark

    def top(self) -> Any:
        """The innermost module whose forward is running (``none``: none)."""
        return self.stack[-1] if self.stack else self.none
