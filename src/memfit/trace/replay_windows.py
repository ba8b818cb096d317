"""Windows of the trace's ledger, the unit both replays record and replay: what one call did
(its allocations, frees and ops, in template form: :class:`_Window`, taken by :func:`_window`
from a :func:`_snapshot`) and :func:`emit`, which replays a window's events and ops with
fresh uids; with the fake-tensor helpers both use (:func:`_plain_uid`, :func:`_meta`,
:func:`_new_tensor`) and :class:`ReplayMismatch`, raised where a window turns out not to be
replayable. The replays: a pipeline stage's micro-batches (``replay.py``, whose note says why a
window can be replayed) and a model's identical blocks (``blocks.py``).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import torch
from torch.utils._mode_utils import no_dispatch

from memfit.trace.tracker import StorageInfo

_keys = itertools.count(-1, -1)  # ledger keys of replayed storages: never a real StorageImpl
_streams: dict[int, int] = {}  # id(tracker) -> side-stream contexts entered (see replay.replaying)


class ReplayMismatch(RuntimeError):
    """A call was replayed, then its template turned out not to be replayable; the trace of
    this rank is redone without replay."""


@dataclasses.dataclass
class _Window:
    """What one call did to the ledger: ``events`` (``("a", nbytes, module)`` allocations and
    ``("f", source, index)`` frees, ``source`` "l" for a storage allocated in this window, "s"
    for the paired forward's survivor number ``index``), ``ops`` ((func, module, number of this
    window's events once the op returned)), and the local indices of the storages it shares
    with the outside."""

    events: list[tuple[Any, ...]]
    ops: list[tuple[Any, str, int]]
    phase: str
    survivors: list[int]  # local indices alive at the end (forward: output first)
    real_local: int | None  # local index of the storage that stays a real tensor
    meta: tuple[Any, ...] | None  # that tensor's _meta: shape, stride, dtype, bytes, device
    module_after: Any = ""  # blocks.py: (relative, name)
    names: list[tuple[bool, str]] = dataclasses.field(default_factory=list)  # blocks.py


def _snapshot(tracker: Any) -> tuple[int, int, int, int, int]:
    return (len(tracker.events), len(tracker.infos), len(tracker.ops), len(tracker.op_peaks),
            _streams.get(id(tracker), 0))


def _window(tracker: Any, start: tuple[int, ...], foreign: dict[int, int],
            real_uid: int | None, meta: Any) -> _Window | None:
    """The window of ledger activity since ``start``, in template form; None where it touches
    anything a replay could not reproduce. ``foreign``: uid -> survivor index of the paired
    forward (a backward may free those)."""
    n_ev, n_infos, n_ops, n_peaks, n_streams = start
    if len(tracker.op_peaks) != n_peaks or _streams.get(id(tracker), 0) != n_streams:
        return None  # an opaque CPU kernel's scratch, or allocations on a side stream
    infos = tracker.infos
    local: dict[int, int] = {}
    events: list[tuple[Any, ...]] = []
    alive: dict[int, None] = {}
    positions = []  # event count at each allocation, to map ops
    for e in tracker.events[n_ev:]:
        if e >= 0:
            info = infos[e]
            if (e < n_infos or info.role is not None or info.host or info.step != tracker.step
                    or (info.handle is None and tracker.allocator is not None)):
                return None
            local[e] = len(local)
            alive[e] = None
            events.append(("a", info.nbytes, info.module))
        else:
            uid = ~e
            if uid in local:
                alive.pop(uid, None)
                events.append(("f", "l", local[uid]))
            elif uid in foreign:
                events.append(("f", "s", foreign[uid]))
            else:
                return None
        positions.append(len(events))
    if any(i.host for i in infos[n_infos:]) or len(infos) - n_infos != len(local):
        return None  # host storages (no event) or allocations with no event
    ops = []
    for func, phase, step, module, count in tracker.ops[n_ops:]:
        if phase != tracker.phase or step != tracker.step:
            return None
        ops.append((func, module, count - n_ev))
    survivors = [local[uid] for uid in alive]
    real_local = None
    if real_uid is not None:
        if real_uid not in alive:
            return None
        real_local = local[real_uid]
        survivors.remove(real_local)
        survivors.insert(0, real_local)
    return _Window(events, ops, tracker.phase, survivors, real_local, meta)


def emit(tracker: Any, fake_mode: Any, saved_keys: dict[int, int], window: _Window,
     foreign: Any, reals: dict[int, torch.Tensor], names: list[str] | None = None
     ) -> list[int]:
    """Replay ``window``'s events and ops now; returns the new uids by local index.

    ``foreign[i]``: the uid of the paired forward's survivor ``i`` (negative ``i``: a
    storage made outside, freed here and forgotten, see :func:`_forget`); ``reals``: local
    index -> the real fake tensor that storage is (watched, not a ledger key); ``names``: the
    module names of a window whose events and ops hold indices into its ``names``
    (:func:`memfit.trace.block_match._relative`), for the block replayed. ``saved_keys``: the
    replay's ledger keys of the forward survivors still alive, by uid."""
    if tracker.phase != window.phase:
        raise ReplayMismatch(f"replayed in phase {tracker.phase}, recorded in "
                             f"{window.phase}")
    uids: list[int] = []
    keys: dict[int, int] = {}
    live = tracker.live
    ops = tracker.ops
    phase, step = tracker.phase, tracker.step
    k = 0
    events = window.events
    for func, module, upto in [*window.ops, (None, "", len(events))]:
        while k < upto:
            e = events[k]
            k += 1
            if e[0] == "a":
                local = len(uids)
                uid = tracker._allocate(StorageInfo(
                    e[1], phase, step, e[2] if names is None else names[e[2]]))
                uids.append(uid)
                real = reals.get(local)
                if real is not None:
                    st = real.untyped_storage()
                    tracker.watch(uid, st._cdata, st)
                else:
                    key = next(_keys)
                    live[key] = uid
                    keys[local] = key
            else:
                if e[1] == "l":
                    uid = uids[e[2]]
                    live.pop(keys.pop(e[2]), None)
                elif e[2] < 0:  # made outside (the output's gradient): freed here
                    uid = foreign[e[2]]
                    _forget(tracker, uid)
                else:
                    uid = foreign[e[2]]
                    live.pop(saved_keys.pop(uid), None)
                tracker.freed(uid)
        if func is not None:
            if tracker.oom is not None and tracker.oom is not fake_mode._oom_noted:
                fake_mode._oom_noted = tracker.oom
                fake_mode.warn(f"an unlimited GPU from {func} on: the step does not fit "
                               f"({tracker.oom})")
            ops.append((func, phase, step, module if names is None else names[module],
                        len(tracker.events)))
    for local, key in keys.items():
        saved_keys[uids[local]] = key
    return uids


def torch_internals_queue(callback: Any) -> None:
    from memfit._compat import torch_internals

    torch_internals.queue_engine_callback(callback)


def _plain_uid(tracker: Any, t: Any) -> int | None:
    """The ledger uid of ``t``'s storage when ``t`` is a plain fake tensor owning all of it."""
    from torch._subclasses.fake_tensor import FakeTensor

    if type(t) is not FakeTensor or t.storage_offset() != 0:
        return None
    st = t.untyped_storage()
    uid = tracker.live.get(st._cdata)
    if uid is None or tracker.infos[uid].nbytes != st.nbytes():
        return None
    return uid


def _forget(tracker: Any, uid: int) -> None:
    """Stop watching ``uid``'s storage: its free is recorded by the replay, not by its death."""
    for key, value in list(tracker.live.items()):
        if value == uid:
            del tracker.live[key]
    tracker._refs.pop(uid, None)


def device_of_fake(t: torch.Tensor) -> torch.device:
    """A fake tensor's device without dispatching ``prim.device``."""
    return getattr(t, "fake_device", None) or t.device


def _meta(t: torch.Tensor) -> tuple[Any, ...]:
    device = device_of_fake(t)
    return (tuple(t.shape), tuple(t.stride()), t.dtype, t.untyped_storage().nbytes(), device)


def _uids_of(tracker: Any, start: tuple[int, ...], locals_: list[int]) -> list[int]:
    allocs = [e for e in tracker.events[start[0]:] if e >= 0]
    return [allocs[i] for i in locals_]


def _new_tensor(meta: tuple[Any, ...], fake_mode: Any) -> torch.Tensor:
    """A fresh fake tensor of ``meta``, made without a ledger event (the replay records it):
    a meta ``empty_strided`` wrapped as the fake mode wraps its kernels' outputs
    (``from_meta_and_device``), with no op dispatched."""
    shape, stride, dtype, nbytes, device = meta
    with no_dispatch():
        t = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    if t.untyped_storage().nbytes() != nbytes:
        raise ReplayMismatch(f"a replayed tensor's storage is {t.untyped_storage().nbytes()} "
                             f"bytes, the recorded one {nbytes}")
    return fake_mode.fake_tensor_converter.from_meta_and_device(fake_mode, t, device)
