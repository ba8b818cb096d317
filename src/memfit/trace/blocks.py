"""Replay of a model's identical blocks: the transformer layers of a traced step run once or
twice, and the others replayed from that record (:mod:`memfit.trace.replay`'s windows).

Note: [replaying identical blocks] A decoder runs ``N`` blocks of one class, each with
parameters of the same shapes, dtypes and strides, each on a hidden state of the same metadata
and on the same other arguments (the same rotary tables, mask and flags, passed as the very
same objects). On fake tensors a call is a function of metadata alone (Note: [replaying a
pipeline stage's micro-batches] in replay.py), so block ``k``'s forward runs the same ops and
allocates the same sizes as block ``1``'s, given the same state of what the call reads besides
its arguments and parameters. That state is the same for every block but the first, in each
step: the autocast cache holds cast copies per weight (each block casts its own weights for the
first time), each parameter's ``.grad`` is None before its block's backward (checked at each
replay: a ``.grad`` already there, as with accumulation or ``zero_grad(set_to_none=False)``,
stops it), and the first matmul of a phase, which makes cuBLAS's workspaces, is block 0's in
the forward and the output head's in the backward (block 0 is never replayed). So:

- forward: block 0 runs; block 1 runs and its ledger events are recorded (the forward
  template); blocks 2 .. N-2 replay them; block N-1 runs, and its events must equal block 1's
  (checked: a mismatch redoes the trace without replay);
- backward, in reverse: block N-1's backward runs (it follows a real forward) and is recorded,
  from its output's gradient to the moment block N-2's output gradient is ready (the autograd
  engine runs every node of a block before any node of the block below: nodes run by sequence
  number, highest first, and a block's nodes were all made after the block below's,
  ``torch/csrc/autograd/engine.cpp: CompareNodeTaskTime``); blocks N-2 .. 2 replay that
  backward template; blocks 1 and 0 run;
- later steps: block 0 runs (its arguments, the same metadata as the first step's, are the
  ones blocks 1 .. N-1 must match), blocks 1 .. N-1 replay the first step's templates.

Block 0 runs in every step because its saved tensors are what hold the arguments every block
shares (the rotary tables) until its backward frees them, as in the real step.

What a replayed block shares with the world outside stays real: its output (a fake tensor with
the recorded metadata, watched by the ledger); its input, kept alive until the recorded
backward frees it where block 1 saved its own (a bf16-mixed block's ``x.float()`` is ``x``),
and not kept where block 1's input died once the call returned (a pure-bf16 block saves only
its fp32 copy); the gradient it receives (freed where the recorded one was) and the ones it
gives: the input's gradient, returned to autograd, and each parameter's ``.grad``, set as
``AccumulateGrad`` set it. Every other storage the forward leaves alive is freed by the block's
own backward, or dies when the forward ends (autocast's cached casts that activation
checkpointing did not save: autocast caches the low-precision copy of a leaf fp32 tensor that
requires grad, ``aten/src/ATen/autocast_mode.cpp: cached_cast``, until the outermost autocast
exits, ``torch/amp/autocast_mode.py: __exit__`` calling ``clear_autocast_cache``; freed for the
replayed blocks when the tracker closes the forward, after the last op, as the cache is cleared
then; checked against block N-1's); else the template is refused. Module names in a
template are relative to its block and renamed for the block replayed, so the breakdown by
module is the real one's; a name outside every block (the rotary backward of Hugging Face's
``apply_rotary_pos_emb``, attributed to no module) is kept.

A forward without grad (inference) replays the forward template alone; what a block leaves
alive but its output must die when the forward ends (autocast's cached casts), and a block given
an object (a KV cache it adds its own entries to) runs.

Used for a single-process trace on a CUDA target only: a CPU target measures kernel scratch per
op (its windows are refused), a parallel layout's blocks hold FSDP or DTensor state across
calls, and real values replayed into data-dependent ops differ per call. A model that calls its
blocks in another order, with other arguments or with another grad mode stops the replay;
if a block was already replayed in that step, the trace is redone without replay
(:class:`memfit.trace.replay_windows.ReplayMismatch`), as it is when a template turns out not to be
replayable. ``tests/test_trace_block_replay_exact.py`` compares every Estimate field with replay
on and off.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch import nn

from memfit._compat.torch_internals import DisableTorchFunction
from memfit.trace import replay as _r
from memfit.trace.replay_windows import (
    ReplayMismatch,
    _meta,
    _new_tensor,
    _plain_uid,
    _snapshot,
    _Window,
    _window,
    emit,
)

MIN_BLOCKS = 4
"""Fewer blocks leave nothing to replay (blocks 0, 1 and N-1 always run)."""

_F = TypeVar("_F", bound=Callable[..., Any])


def _bookkeeping(fn: _F) -> _F:
    """``fn`` runs with torch-function handling off: the replay's own tensor calls
    (``.grad``, ``.shape``, making a fake tensor) are not the model's, and the trace's modes
    (autocast lists, SDPA routing) would otherwise see each of them."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with DisableTorchFunction():
            return fn(*args, **kwargs)
    return run  # type: ignore[return-value]


def _relative(window: _Window | None, prefix: str, blocks: frozenset[str]
              ) -> _Window | None:
    """``window`` with its module names as indices into ``window.names``: ``(True, rest)`` for
    a name inside block ``prefix`` (``rest`` after the prefix), ``(False, name)`` for one
    outside every block (a function called in the block but attributed by autograd's hooks to
    an outer module). None where a name is inside another block."""
    if window is None:
        return None
    index: dict[str, int] = {}
    names: list[tuple[bool, str]] = []

    def of(name: str) -> int | None:
        k = index.get(name)
        if k is None:
            if name == prefix or name.startswith(prefix + "."):
                entry = (True, name[len(prefix):])
            elif _inside(name, blocks):
                return None
            else:
                entry = (False, name)
            k = index[name] = len(names)
            names.append(entry)
        return k

    events = []
    for e in window.events:
        if e[0] == "a":
            k = of(e[2])
            if k is None:
                return None
            events.append(("a", e[1], k))
        else:
            events.append(e)
    ops = []
    for func, module, count in window.ops:
        k = of(module)
        if k is None:
            return None
        ops.append((func, k, count))
    window.events, window.ops, window.names = events, ops, names
    return window


def _inside(name: str, blocks: frozenset[str]) -> bool:
    """Whether module ``name`` is one of ``blocks`` or inside one."""
    parts = name.split(".")
    return any(".".join(parts[:k]) in blocks for k in range(1, len(parts) + 1))


def _names_for(window: _Window, prefix: str) -> list[str]:
    return [prefix + name if rel else name for rel, name in window.names]


def _same_window(a: _Window, b: _Window) -> bool:
    return (a.events == b.events and a.ops == b.ops and a.survivors == b.survivors
            and a.real_local == b.real_local and a.meta == b.meta and a.names == b.names)


_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)


def _signature(obj: Any) -> Any:
    """What identifies a block's argument without keeping it alive (a kept tensor would live
    longer than in the real run): tensors and other objects by weak reference, sequences by
    their items, plain values by value. None where there is no such handle."""
    if isinstance(obj, _PLAIN):
        return ("v", type(obj), obj)
    if isinstance(obj, tuple | list):
        items = [_signature(o) for o in obj]
        return None if any(i is None for i in items) else ("s", type(obj), items)
    if type(obj) is dict:
        values = {k: _signature(v) for k, v in obj.items()}
        return None if any(v is None for v in values.values()) else ("d", values)
    try:
        return ("r", weakref.ref(obj))
    except TypeError:
        return None


def _meta_signature(obj: Any) -> Any:
    """The metadata of a block's arguments (tensors by shape, strides, dtype, device and
    whether they need grad), to compare arguments of different steps."""
    if isinstance(obj, torch.Tensor):
        return ("t", tuple(obj.shape), tuple(obj.stride()), obj.dtype, obj.device.type,
                obj.requires_grad)
    if isinstance(obj, _PLAIN):
        return ("v", type(obj), obj)
    if isinstance(obj, tuple | list):
        return ("s", type(obj), [_meta_signature(o) for o in obj])
    if type(obj) is dict:
        return ("d", {k: _meta_signature(v) for k, v in obj.items()})
    return ("o", type(obj))


def _holds_objects(obj: Any) -> bool:
    """Whether ``obj`` (a block's arguments) holds anything but tensors and plain values."""
    if isinstance(obj, (torch.Tensor, *_PLAIN)):
        return False
    if isinstance(obj, tuple | list):
        return any(_holds_objects(o) for o in obj)
    if type(obj) is dict:
        return any(_holds_objects(o) for o in obj.values())
    return True


def _matches(sig: Any, obj: Any) -> bool:
    """Whether ``obj`` is what ``sig`` (from :func:`_signature`) identified: the same objects,
    or equal plain values."""
    kind = sig[0]
    if kind == "v":
        return type(obj) is sig[1] and obj == sig[2]
    if kind == "s":
        return (type(obj) is sig[1] and len(obj) == len(sig[2])
                and all(_matches(s, o) for s, o in zip(sig[2], obj, strict=True)))
    if kind == "d":
        return (type(obj) is dict and obj.keys() == sig[1].keys()
                and all(_matches(s, obj[k]) for k, s in sig[1].items()))
    return sig[1]() is obj


class _Blocks:
    """The replay state of one model's blocks in one trace (see the module's note)."""

    def __init__(self, tracker: Any, fake_mode: Any, blocks: list[tuple[str, nn.Module]],
                 training: bool = True) -> None:
        self.training = training  # else a forward without grad: no backward to replay
        self.tracker = tracker
        self.fake_mode = fake_mode
        self.names = [n for n, _ in blocks]
        self.block_names = frozenset(self.names)
        self.params = [[p for p in m.parameters()] for _, m in blocks]
        self.n = len(blocks)
        self.off = False
        self.step = -1
        self.saved_keys: dict[int, int] = {}
        self.backward_t = None
        self.complete = False  # the templates of an earlier step are all there
        self._new_step()

    def _new_step(self) -> None:
        self.step = self.tracker.step
        self.expected = 0
        self.replayed = 0  # blocks replayed in this step
        self.sig: tuple[Any, ...] | None = None  # block 1's input metadata and arguments
        self.pending: dict[str, Any] | None = None
        self.forwards: list[list[int]] = []  # the uids each replayed forward made
        # A later step starts where the first did (Note: [replaying identical blocks]): the
        # first step's templates serve every block of it but block 0.
        self.reusing = self.complete
        if not self.reusing:
            self._forget_templates()

    def _forget_templates(self) -> None:
        self.complete = False
        self.forward_t: _Window | None = None
        self.backward_t: _Window | None = None
        self.meta_sig: Any = None  # the arguments' metadata, to compare across steps
        self.grad_in: int | None = None  # local index of the input's gradient (-1: passed on)
        self.param_grads: list[int | None] = []  # local index of each parameter's .grad
        self.param_metas: list[Any] = []
        self.x1_uid: int | None = None  # block 1's input, to see whether it outlives the call
        self.hold_input = False  # whether a block's input lives until its backward
        # survivors of a forward (indices) that die when the forward ends (autocast's cached
        # casts that checkpointing did not save), not in the backward
        self.dead_at_end: list[int] | None = None
        self.last_survivors: list[int] = []  # block N-1's forward survivors (uids)

    def stop(self, why: str) -> None:
        """No more replay in this trace; a step with replayed blocks is redone without."""
        self.off = True
        if self.replayed:
            raise ReplayMismatch(f"block replay stopped after {self.replayed} replayed blocks: "
                                 f"{why}")

    # -- the forward ---------------------------------------------------------------------------

    def call(self, i: int, run: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.off:
            return run(*args, **kwargs)
        with DisableTorchFunction():
            how = self._decide(i, args, kwargs)
        if how == "run":
            return run(*args, **kwargs)
        if how == "record":
            return self._record_forward(i, run, args, kwargs)
        if how == "last":
            return self._record_last(i, run, args, kwargs)
        self.replayed += 1
        _r.counts["replayed"] += 1
        if not self.training:
            with DisableTorchFunction():
                window = self.forward_t
                assert window is not None and window.meta is not None
                out = _new_tensor(window.meta, self.fake_mode)
                self.forwards.append(_emit(self, window, {}, {window.real_local: out}, i))
            return out
        out = _BlockReplayed.apply(self, i, args[0])
        if i == self.n - 2 and not self.reusing:
            out.register_hook(self._close_template)  # block N-1's backward ends here
        return out

    def _decide(self, i: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """What block ``i``'s call is: "run", "record" (block 1's forward), "last" (block
        N-1's) or "replay"."""
        tracker = self.tracker
        if tracker.phase != "forward":  # a checkpoint's recompute: as it comes
            return "run"
        if tracker.step != self.step:
            if self.pending is not None or self.expected not in (0, self.n):
                self.stop("a step began before the last one's blocks were done")
                return "run"
            self._new_step()
        if i != self.expected or torch.is_grad_enabled() != self.training:
            self.stop(f"block {i} called where block {self.expected} was expected, or "
                      f"{'without' if self.training else 'with'} grad")
            return "run"
        self.expected += 1
        x = args[0] if args else None
        rest = (args[1:], kwargs)
        if i == 0 and not self.reusing:
            return "run"
        if i == 0 or (i == 1 and not self.reusing):  # the arguments later blocks must match
            sig = (_meta(x) if isinstance(x, torch.Tensor) else None, _signature(rest))
            meta_sig = _meta_signature(rest)
            if sig[1] is None:
                self.stop(f"block {i}'s arguments cannot be compared with later blocks'")
                return "run"
            if not self.training and _holds_objects(rest):
                # a KV cache (Hugging Face's past_key_values): each block adds its own entries
                self.stop(f"block {i} is given an object (a cache) without grad")
                return "run"
            if i == 1:
                self.meta_sig, self.sig = meta_sig, sig
                return "record"
            # Block 0 runs in every step: its saved tensors hold the arguments all blocks
            # share (the rotary tables) until its backward frees them, as in the real step.
            if sig[0] != self.x_meta or meta_sig != self.meta_sig:
                self.reusing = False  # this step records its own templates
                self._forget_templates()
            else:
                self.sig = sig
            return "run"
        if (self.sig is None or not isinstance(x, torch.Tensor) or _meta(x) != self.sig[0]
                or not _matches(self.sig[1], rest)):
            self.stop(f"block {i} called with other arguments than block "
                      f"{0 if self.reusing else 1}")
            return "run"
        if i == self.n - 1 and not self.reusing:
            return "last"
        if not self.training:
            return "replay"
        if any(p.grad is not None for p in self.params[i]):
            self.stop(f"block {i}'s parameters have gradients before its backward")
            return "run"
        if i == 2 and not self.reusing:
            # Block 1's input is dead by now unless block 1 saved it for its backward (or the
            # model keeps it): a replayed block keeps its input alive exactly then.
            if self.x1_uid is None:
                self.stop("block 1's input is not a storage of its own")
                return "run"
            self.hold_input = self.x1_uid in tracker._refs
        return "replay"

    def _record_forward(self, i: int, run: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
                        ) -> Any:
        """Block 1 runs, and its ledger events become the forward template."""
        x = args[0] if args else None
        tracker = self.tracker
        with DisableTorchFunction():
            refused = (not isinstance(x, torch.Tensor) or x.requires_grad != self.training
                       or any(isinstance(a, torch.Tensor) and a.requires_grad
                              for a in (*args[1:], *kwargs.values()))
                       or (tracker.allocator is not None
                           and tracker.allocator.pending_free_bytes)
                       or tracker.stream)
        if refused:
            self.stop("block 1's call is not replayable (its input needs no grad, another "
                      "argument needs grad, or side-stream work is pending)")
            return run(*args, **kwargs)
        start = _snapshot(tracker)
        out = run(*args, **kwargs)
        with DisableTorchFunction():
            window = self._forward_window(i, start, out)
            if window is None:
                self.stop("block 1's forward touched what a replay cannot reproduce")
                return out
            assert self.sig is not None
            self.forward_t, self.x_meta = window, self.sig[0]
            self.x1_uid = _plain_uid(tracker, x)
        _r.counts["recorded"] += 1
        return out

    def _forward_window(self, i: int, start: tuple[int, ...], out: Any) -> _Window | None:
        tracker = self.tracker
        uid = _plain_uid(tracker, out)
        if uid is None or out.requires_grad != self.training or (
                self.training and out.grad_fn is None):
            return None
        window = _window(tracker, start, {}, uid, _meta(out))
        return _relative(window, self.names[i], self.block_names)

    def _record_last(self, i: int, run: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
                     ) -> Any:
        """Block N-1 runs; its forward must equal the template, and its backward is recorded."""
        tracker = self.tracker
        start = _snapshot(tracker)
        out = run(*args, **kwargs)
        with DisableTorchFunction():
            self._recorded_last(i, start, args[0], out)
        return out

    def _recorded_last(self, i: int, start: tuple[int, ...], x: torch.Tensor, out: Any) -> None:
        tracker = self.tracker
        window = self._forward_window(i, start, out)
        if window is None or self.forward_t is None or not _same_window(window, self.forward_t):
            self.stop(f"block {i}'s forward differs from block 1's")
            return
        allocs = [e for e in tracker.events[start[0]:] if e >= 0]
        self.last_survivors = [allocs[local] for local in window.survivors]
        if not self.training:  # forward_ended checks what outlives the forward
            return
        # the storages block N-1's backward frees: its forward's survivors (by index), the
        # output's gradient (-1) and its input (-2)
        foreign = {allocs[local]: index for index, local in enumerate(window.survivors)}
        x_uid = _plain_uid(tracker, x)
        if x_uid is not None:
            foreign[x_uid] = -2
        state: dict[str, Any] = {"foreign": foreign, "x_uid": x_uid}

        @_bookkeeping
        def begin(grad: Any) -> None:
            if any(p.grad is not None for p in self.params[i]):
                return  # accumulated into existing gradients: no template
            state["start"] = _snapshot(tracker)
            uid = _plain_uid(tracker, grad)
            if uid is not None:
                state["foreign"][uid] = -1

        out.register_hook(begin)
        self.pending = state

    @_bookkeeping
    def forward_ended(self) -> None:
        """The forward ended (autocast's cache was cleared): which of block N-1's survivors
        died since its last op (recorded), and the same survivors of each replayed block."""
        tracker = self.tracker
        if self.off or not self.forwards:
            return
        if not self.reusing:
            if (self.pending is None and self.training) or self.forward_t is None \
                    or not self.last_survivors:
                raise ReplayMismatch("the forward ended before the last block ran")
            since = tracker.ops[-1][4] if tracker.ops else 0  # events once the last op returned
            # (survivor 0, the output, is a real tensor in a replay: it dies as it does)
            dead = [k for k, uid in enumerate(self.last_survivors)
                    if k and uid not in tracker._refs]
            frees = {~e for e in tracker.events[since:] if e < 0}
            if any(self.last_survivors[k] not in frees for k in dead):
                raise ReplayMismatch("a replayed block's storage died inside the forward")
            if self.training:
                foreign = self.pending["foreign"]  # type: ignore[index]
                for k in dead:
                    del foreign[self.last_survivors[k]]
            elif len(dead) != len(self.last_survivors) - 1:
                # without grad nothing but the output may outlive the forward (a KV cache)
                raise ReplayMismatch("a block's storage outlives a forward without grad")
            else:
                self.complete = True
            self.dead_at_end = dead
        forward = self.forward_t
        assert forward is not None and self.dead_at_end is not None
        live = tracker.live
        for uids in self.forwards:
            for k in self.dead_at_end:
                uid = uids[forward.survivors[k]]
                live.pop(self.saved_keys.pop(uid), None)
                tracker.freed(uid)
        self.forwards = []

    # -- the backward --------------------------------------------------------------------------

    @_bookkeeping
    def _close_template(self, grad: Any) -> None:
        """Block N-2's output gradient is ready: block N-1's backward is done; make its
        window the backward template."""
        tracker = self.tracker
        state, self.pending = self.pending, None
        i = self.n - 1
        window = None
        if state is not None and "start" in state:
            window = _relative(_window(tracker, state["start"], state["foreign"], None, None),
                               self.names[i], self.block_names)
        if window is None:
            raise ReplayMismatch(f"block {i}'s backward is not replayable")
        window.module_after = self._rel_module(str(tracker.modules.backward), i)
        allocs = [e for e in tracker.events[state["start"][0]:] if e >= 0]
        local_of = {uid: k for k, uid in enumerate(allocs)}
        alive = set(window.survivors)
        param_grads: list[int | None] = []
        param_metas: list[Any] = []
        for p in self.params[i]:
            if p.grad is None:
                param_grads.append(None)
                param_metas.append(None)
                continue
            uid = _plain_uid(tracker, p.grad)
            if uid is None or local_of.get(uid) not in alive:
                raise ReplayMismatch(f"a parameter gradient of block {i} is not its own storage")
            param_grads.append(local_of[uid])
            param_metas.append(_meta(p.grad))
            alive.discard(local_of[uid])
        uid = _plain_uid(tracker, grad)
        if uid is not None and uid in local_of and local_of[uid] in alive:
            grad_in = local_of[uid]
            alive.discard(grad_in)
            window.meta = _meta(grad)
        elif uid is not None and state["foreign"].get(uid) == -1:
            grad_in = -1  # the output's gradient, passed on (summed into in place)
        else:
            raise ReplayMismatch(f"block {i}'s input gradient is not a storage of its own")
        freed = {e[2] for e in window.events if e[0] == "f" and e[1] == "s"}
        survivors = len(self.forward_t.survivors) if self.forward_t is not None else 0
        dead = set(self.dead_at_end or ())
        if alive or freed - {-1, -2} != set(range(1, survivors)) - dead or (
                grad_in == -1 and -1 in freed):
            raise ReplayMismatch(f"block {i}'s backward leaves other storages alive, or does "
                                 "not free its saved activations")
        self.backward_t, self.grad_in, self.complete = window, grad_in, True
        self.param_grads, self.param_metas = param_grads, param_metas

    def _rel_module(self, name: str, i: int) -> tuple[bool, str]:
        prefix = self.names[i]
        if name == prefix or name.startswith(prefix + "."):
            return (True, name[len(prefix):])
        if _inside(name, self.block_names):
            raise ReplayMismatch(f"block {i}'s backward ended in module {name!r}")
        return (False, name)


class _BlockReplayed(torch.autograd.Function):
    """One replayed block: the forward template's events, then the backward template's."""

    @staticmethod
    @_bookkeeping
    def forward(ctx: Any, blocks: _Blocks, i: int, x: torch.Tensor) -> torch.Tensor:  # type: ignore
        window = blocks.forward_t
        assert window is not None and window.meta is not None
        out = _new_tensor(window.meta, blocks.fake_mode)
        ctx.blocks, ctx.i = blocks, i
        # the input lives until the backward frees it, where block 1's saved it
        ctx.x = x if blocks.hold_input else None
        ctx.saved = _emit(blocks, window, {}, {window.real_local: out}, i)
        blocks.forwards.append(ctx.saved)
        ctx.x_uid = _plain_uid(blocks.tracker, x)
        return out

    @staticmethod
    @_bookkeeping
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, torch.Tensor]:
        blocks: _Blocks = ctx.blocks
        i = ctx.i
        window, forward = blocks.backward_t, blocks.forward_t
        if window is None or forward is None:
            raise ReplayMismatch(f"replayed block {i} has no backward template")
        params = blocks.params[i]
        if any(p.grad is not None for p in params):
            raise ReplayMismatch(f"block {i}'s parameters have gradients before its backward")
        tracker = blocks.tracker
        foreign = {index: ctx.saved[local] for index, local in enumerate(forward.survivors)}
        uses = {e[2] for e in window.events if e[0] == "f" and e[1] == "s"}
        if -1 in uses or blocks.grad_in == -1:
            uid = _plain_uid(tracker, grad)
            if uid is None:
                raise ReplayMismatch("a replayed block's output gradient is not a storage of "
                                     "its own")
            foreign[-1] = uid
        if -2 in uses:
            if ctx.x_uid is None or not blocks.hold_input:
                raise ReplayMismatch("a replayed block's input is not a storage of its own")
            foreign[-2] = ctx.x_uid
        fake_mode = blocks.fake_mode
        reals: dict[int, torch.Tensor] = {}
        grads: list[torch.Tensor | None] = []
        for local, meta in zip(blocks.param_grads, blocks.param_metas, strict=True):
            if local is None:
                grads.append(None)
                continue
            g = _new_tensor(meta, fake_mode)
            reals[local] = g
            grads.append(g)
        if blocks.grad_in is not None and blocks.grad_in >= 0:
            assert window.meta is not None
            grad_in = _new_tensor(window.meta, fake_mode)
            reals[blocks.grad_in] = grad_in
        else:
            grad_in = grad
        _emit(blocks, window, foreign, reals, i)
        rel, name = window.module_after  # type: ignore[misc]
        tracker.modules.backward = blocks.names[i] + name if rel else name
        for p, g in zip(params, grads, strict=True):
            if g is not None:
                p.grad = g  # as AccumulateGrad set it in the recorded window
        del ctx.saved
        ctx.x = None
        return None, None, grad_in


def _emit(blocks: _Blocks, window: _Window, foreign: Any, reals: dict[int, torch.Tensor],
          i: int) -> list[int]:
    return emit(blocks.tracker, blocks.fake_mode, blocks.saved_keys, window, foreign, reals,
                   _names_for(window, blocks.names[i]))


def _blocks_of(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's repeated blocks when they are replayable in principle: four or more modules
    of one class in one container, with parameters and buffers of the same names and
    metadata, no hooks of the user's inside them, no tensor subclasses (FSDP, DTensor)."""
    from memfit.errors import MemfitError
    from memfit.models.anatomy import find_blocks

    try:
        names = find_blocks(model)
    except MemfitError:
        return []
    if len(names) < MIN_BLOCKS:
        return []
    modules = dict(model.named_modules())
    blocks = [(n, modules[n]) for n in names if n in modules]
    if len(blocks) != len(names) or len({type(m) for _, m in blocks}) != 1:
        return []
    g = torch.nn.modules.module
    if (g._global_forward_hooks or g._global_forward_pre_hooks or g._global_backward_hooks
            or g._global_backward_pre_hooks):
        return []  # they would not run inside a replayed block

    def signature(m: nn.Module) -> tuple[Any, ...]:
        out = []
        for name, t in (*m.named_parameters(), *m.named_buffers()):
            if type(t) not in (torch.nn.Parameter, torch.Tensor) and not _is_plain_fake(t):
                return ("subclass",)
            out.append((name, tuple(t.shape), tuple(t.stride()), t.dtype, t.requires_grad))
        for sub in m.modules():
            if (sub._forward_hooks or sub._forward_pre_hooks or sub._backward_hooks
                    or sub._backward_pre_hooks):
                return ("hooks",)
        return tuple(out)

    first = signature(blocks[0][1])
    if first and first[0] in ("subclass", "hooks"):
        return []
    if any(signature(m) != first for _, m in blocks[1:]):
        return []
    return blocks


def _is_plain_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return type(t) is FakeTensor or (isinstance(t, torch.nn.Parameter)
                                     and type(t.data) is FakeTensor)


@contextlib.contextmanager
def replaying_blocks(model: nn.Module, tracker: Any, fake_mode: Any, *, training: bool = True
                     ) -> Iterator[None]:
    """Inside the block, the model's identical blocks replay (see the module's note). Enter it
    before the trace registers its own module hooks."""
    blocks = _blocks_of(model) if _r.enabled() else []
    if not blocks:
        yield
        return
    state = _Blocks(tracker, fake_mode, blocks, training)
    tracker.on_forward_end.append(state.forward_ended)
    previous = []  # a forward of the instance's own (activation checkpointing's wrapper)
    for i, (_, module) in enumerate(blocks):
        run = module.forward
        previous.append(vars(module).get("forward"))

        def forward(*args: Any, _i: int = i, _run: Any = run, **kwargs: Any) -> Any:
            return state.call(_i, _run, args, kwargs)

        module.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        tracker.on_forward_end.remove(state.forward_ended)
        for (_, module), forward in zip(blocks, previous, strict=True):
            if forward is None:
                del module.forward
            else:
                module.forward = forward  # type: ignore[method-assign]
