"""Activation offload: keep the tensors saved for backward in (pinned) CPU memory, not on the GPU.

>>> with offload_activations(min_bytes=2**20):          # around the forward (and loss)
...     loss = model(**batch)
>>> loss.backward()                                      # tensors come back as backward needs them
>>> apply_activation_offload(model, min_bytes=2**20)     # or: every forward of ``model``

Each tensor autograd saves in the forward passes through a pack hook
(``torch.autograd.graph.saved_tensors_hooks``). A CUDA tensor of at least ``min_bytes`` is
copied to a pinned CPU buffer and its GPU memory is released; in backward the unpack hook copies
it back when the op that needs it runs. With ``use_streams=True`` the device-to-host copies run
on a side CUDA stream, overlapped with the forward's compute (``record_stream`` keeps the GPU
block from being reused until its copy is done), and backward prefetches: when it brings a tensor
back it also starts copying the one saved just before it (the next one backward will need, as
backward runs the forward in reverse) on a second side stream, so that copy overlaps with the
current op's compute. The price is one more offloaded tensor on the GPU at a time
(``prefetch=False`` turns it off). Pinned memory makes the copies asynchronous.

A tensor saved by several nodes (a ReLU's output, saved by the ReLU and by the next matmul) is
copied once. ``memfit.estimate(..., device="cuda")`` predicts the effect: the host copies are
left out of the device peak and reported as ``Estimate.host_peak_bytes`` (see
Note: [host memory in a CUDA trace] in ``memfit/trace/host.py``).

On the CPU there is nothing to gain (the "device" is host memory): CPU tensors are passed through
untouched (no copy, no extra memory) and a warning says so once.

Note: [offload after checkpointing] Apply activation checkpointing first. A checkpointed block
saves no tensors through autograd: ``torch.utils.checkpoint`` keeps its inputs alive in the
recompute closure and selective checkpointing caches its kept outputs in its own storage, so
offload moves neither. It moves everything that is still saved the ordinary way: blocks left
uncheckpointed (``EveryK``, ``Budget``), the embeddings, the head and the loss. Tensors recomputed
in backward are made outside the forward's hooks and stay on the GPU, briefly.

Known limitations: prefetch looks one tensor ahead, in the reverse of the order they were saved;
a tensor saved by several nodes is brought back for each node that unpacks it (the prefetched
copy serves the first); parameters (and, given ``model=``, any view of a parameter or buffer) are
never offloaded; tensors smaller than ``min_bytes`` stay.
"""

from __future__ import annotations

import copy
import functools
import logging
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from memfit.errors import MemfitError
from memfit.trace.host import (
    copy_to_device,
    copy_to_host,
    record_stream,
    side_stream,
    stands_for_device,
)

__all__ = ["OffloadActivations", "OffloadStats", "apply_activation_offload",
           "offload_activations"]

log = logging.getLogger("memfit")

# Stream ids of the side streams in a trace's allocator model (0 is the compute stream).
_D2H_STREAM, _H2D_STREAM = 1, 2

_CPU_NOTE = ("memfit: offload_activations on CPU tensors saves nothing (the device is host "
             "memory); they are kept as they are")


@dataclass
class OffloadStats:
    """What the hooks did since the context was entered."""

    offloaded: int = 0
    """Tensors copied to the CPU."""
    offloaded_bytes: int = 0
    """Their bytes (the device memory freed until backward)."""
    kept: int = 0
    """Tensors left where they were (small, parameters, already on the CPU)."""
    prefetched: int = 0
    """Tensors whose copy back to the device backward started ahead of need."""


class _Offloaded:
    """A saved tensor's host copy, the device to return it to, and for prefetch: the copy saved
    just before it (``prev``, weakly), and its own device copy made ahead of need."""

    __slots__ = ("__weakref__", "ahead", "cpu", "device", "event", "fetched", "prev", "traced")

    def __init__(self, cpu: torch.Tensor, device: torch.device, traced: bool,
                 prev: _Offloaded | None) -> None:
        self.cpu, self.device, self.traced = cpu, device, traced
        self.prev = weakref.ref(prev) if prev is not None else None
        self.ahead: torch.Tensor | None = None  # prefetched, not yet handed to backward
        self.event: Any = None  # CUDA event: the prefetch copy is done
        self.fetched = False  # brought back (or prefetched) at least once


def _storage_key(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)


class OffloadActivations(torch.autograd.graph.saved_tensors_hooks):
    """The saved-tensor hooks behind :func:`offload_activations` (a context manager).

    A tensor saved by several autograd nodes (an activation's output saved by it and by the next
    matmul) is copied once: later saves of the same tensor, unmodified, share its host copy.

    Known limitations: see the module docstring.
    """

    def __init__(self, *, min_bytes: int = 1024, pin_memory: bool = True,
                 use_streams: bool = True, prefetch: bool = True,
                 model: nn.Module | None = None) -> None:
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
            raise MemfitError(f"min_bytes must be a non-negative integer, got {min_bytes!r}; "
                              "e.g. 2**20 to offload tensors of 1 MiB and more")
        self.min_bytes = min_bytes
        self.pin_memory = pin_memory
        self.use_streams = use_streams
        self.prefetch = prefetch and use_streams  # ahead of need only pays off on side streams
        self.stats = OffloadStats()
        self.model = model
        self._exclude: set[int] = set()
        # id(tensor) -> (weakref to it, its version when copied, the copy): one copy per tensor
        self._copies: dict[int, tuple[weakref.ref[torch.Tensor], int, _Offloaded]] = {}
        self._stream: Any = None  # device-to-host copies
        self._h2d: Any = None  # prefetch copies back
        self._last: _Offloaded | None = None  # the copy made last: the next one's ``prev``
        self._warned = False
        super().__init__(self._pack, self._unpack)

    def __deepcopy__(self, memo: dict[int, Any]) -> OffloadActivations:
        # memfit.estimate deep-copies the model, and these hooks with its forward. After a real
        # step on a GPU they hold CUDA streams, which cannot be copied ("cannot pickle
        # 'Stream'", seen on the first GPU run): the copy starts without streams, copies or
        # statistics, and makes its own streams when it first needs them.
        new = copy.copy(self)
        memo[id(self)] = new
        new.model = copy.deepcopy(self.model, memo)
        new.stats = OffloadStats()
        new._exclude, new._copies, new._last = set(), {}, None
        new._stream = new._h2d = None
        new.pack_hook, new.unpack_hook = new._pack, new._unpack
        return new

    def __enter__(self) -> OffloadActivations:  # ``with offload_activations() as off:``
        # The model's storages now (it may have moved since the hooks were made).
        if self.model is not None:
            self._exclude = {_storage_key(t) for t in (*self.model.parameters(),
                                                       *self.model.buffers())
                             if not is_traceable_wrapper_subclass(t)}  # quantized: no storage
        self._copies.clear()
        self._last = None
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._copies.clear()  # the packed copies live on in the autograd graph, not here
        self._last = None

    def _keep(self, t: torch.Tensor) -> bool:
        if isinstance(t, nn.Parameter) or t.untyped_storage().nbytes() == 0:
            return True
        if t.numel() * t.element_size() < self.min_bytes:
            return True
        if not stands_for_device(t):  # host memory (the CPU itself) or meta
            if t.device.type == "cpu" and not self._warned:
                self._warned = True
                warnings.warn(_CPU_NOTE, stacklevel=4)
            return True
        return _storage_key(t) in self._exclude

    def _pack(self, t: torch.Tensor) -> Any:
        if self._keep(t):
            self.stats.kept += 1
            return t
        seen = self._copies.get(id(t))
        if seen is not None and seen[0]() is t and seen[1] == t._version:
            return seen[2]
        self.stats.offloaded += 1
        self.stats.offloaded_bytes += t.numel() * t.element_size()
        from torch._subclasses.fake_tensor import FakeTensor

        prev = self._last
        if isinstance(t, FakeTensor):  # traced by memfit.estimate: model the copy and streams
            packed = _Offloaded(copy_to_host(t), t.device, traced=True, prev=prev)
            if self.use_streams:
                record_stream(t, _D2H_STREAM)  # as t.record_stream(self._stream) below
        elif self.use_streams and t.is_cuda:
            pin = self.pin_memory
            # Same strides when dense (preserve_format), so the copy is one straight run of bytes.
            cpu = torch.empty_like(t, device="cpu", pin_memory=pin)
            if self._stream is None:
                self._stream = torch.cuda.Stream(t.device)
            current = torch.cuda.current_stream(t.device)
            self._stream.wait_stream(current)  # t is made on the compute stream
            with torch.cuda.stream(self._stream):
                cpu.copy_(t, non_blocking=pin)
            t.record_stream(self._stream)  # no reuse of t's block before its copy is done
            packed = _Offloaded(cpu, t.device, traced=False, prev=prev)
        else:
            packed = _Offloaded(copy_to_host(t, pin_memory=self.pin_memory), t.device,
                                traced=False, prev=prev)
        self._copies[id(t)] = (weakref.ref(t), t._version, packed)
        self._last = packed
        return packed

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Offloaded):
            return packed
        if packed.ahead is not None:  # prefetched: hand it over once its copy is done
            t, packed.ahead = packed.ahead, None
            self._arrived(packed, t)
        else:
            t = self._fetch(packed, ahead=False)
        packed.fetched = True
        nxt = packed.prev() if self.prefetch and packed.prev is not None else None
        if nxt is not None and not nxt.fetched:  # backward needs it next: start its copy now
            nxt.ahead = self._fetch(nxt, ahead=True)
            nxt.fetched = True
            self.stats.prefetched += 1
        return t

    def _fetch(self, packed: _Offloaded, *, ahead: bool) -> torch.Tensor:
        """A device copy of ``packed``'s host copy; ``ahead``: on the prefetch stream."""
        if packed.traced:
            if not ahead:
                return copy_to_device(packed.cpu, packed.device)
            with side_stream(_H2D_STREAM):  # made on the prefetch stream: its own pool
                t = copy_to_device(packed.cpu, packed.device)
            record_stream(t, 0)  # as _arrived: used and freed on the compute stream
            return t
        pinned = packed.cpu.is_pinned()
        if ahead and self._stream is not None:
            if self._h2d is None:
                self._h2d = torch.cuda.Stream(packed.device)
            self._h2d.wait_stream(self._stream)  # its device-to-host copy is done
            with torch.cuda.stream(self._h2d):
                t = packed.cpu.to(packed.device, non_blocking=pinned)
                packed.event = torch.cuda.Event()
                packed.event.record(self._h2d)
            return t
        if self._stream is not None:  # the host copy must be complete before it is read back
            torch.cuda.current_stream(packed.device).wait_stream(self._stream)
        return packed.cpu.to(packed.device, non_blocking=pinned)

    def _arrived(self, packed: _Offloaded, t: torch.Tensor) -> None:
        """Make the current stream wait for ``t``'s prefetch copy, which it will now use."""
        if packed.event is None:
            return
        current = torch.cuda.current_stream(packed.device)
        current.wait_event(packed.event)
        t.record_stream(current)  # made on the prefetch stream, used and freed on this one
        packed.event = None


def offload_activations(*, min_bytes: int = 1024, pin_memory: bool = True,
                        use_streams: bool = True, prefetch: bool = True,
                        model: nn.Module | None = None) -> OffloadActivations:
    """A context manager: tensors saved for backward inside it (CUDA, ``>= min_bytes``) are kept
    in CPU memory until backward. ``model=``: never offload views of its parameters/buffers.
    ``use_streams``: copy on side CUDA streams; ``prefetch`` (with streams): start bringing back
    the next tensor backward needs while it computes with this one.

    >>> with offload_activations(min_bytes=2**20) as off:
    ...     loss = model(x).sum()
    >>> loss.backward(); off.stats.offloaded_bytes
    """
    return OffloadActivations(min_bytes=min_bytes, pin_memory=pin_memory,
                              use_streams=use_streams, prefetch=prefetch, model=model)


def _offloaded_forward(forward: Any, hooks: OffloadActivations, *args: Any,
                       **kwargs: Any) -> Any:
    with hooks:  # saved_tensors_hooks can be entered again after each exit
        return forward(*args, **kwargs)


def apply_activation_offload(model: nn.Module, *, min_bytes: int = 1024,
                             pin_memory: bool = True, use_streams: bool = True,
                             prefetch: bool = True) -> OffloadActivations:
    """Offload the activations of every forward of ``model`` (in place: its ``forward`` runs
    inside :func:`offload_activations`); returns the hooks (their ``stats``). Apply after
    activation checkpointing (see Note: [offload after checkpointing]).

    >>> apply_activation_checkpointing(model, EveryK(2))
    >>> apply_activation_offload(model, min_bytes=2**20)
    """
    hooks = OffloadActivations(min_bytes=min_bytes, pin_memory=pin_memory,
                               use_streams=use_streams, prefetch=prefetch, model=model)
    # Wraps the forward the model has now, e.g. apply_chunked_loss's (apply that first).
    model.forward = functools.partial(  # type: ignore[method-assign]
        _offloaded_forward, model.forward, hooks)
    log.info("memfit: activation offload to %s CPU memory, tensors >= %d bytes",
             "pinned" if pin_memory else "pageable", min_bytes)
    return hooks
