"""The templates of a model's block replay, and the replay of a block from them: the state of
one trace's block replay (:class:`_BlockState`: templates kept across steps, the checks at the
end of the forward, block N-1's backward made the backward template) and the autograd function
that replays one block (:class:`_BlockReplayed`). When a block is recorded, run or replayed is
decided in ``blocks.py`` (Note: [replaying identical blocks]).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from memfit._compat.torch_internals import DisableTorchFunction
from memfit.trace.block_match import _inside, _names_for, _relative
from memfit.trace.replay_windows import (
    ReplayMismatch,
    _meta,
    _new_tensor,
    _plain_uid,
    _Window,
    _window,
    emit,
)

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


class _BlockState:
    """The replay state of one model's blocks in one trace (see the note in ``blocks.py``):
    its templates, the end of the forward and of block N-1's backward that complete them.
    :class:`memfit.trace.blocks._Blocks` adds the forward's decisions."""

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
    def forward(ctx: Any, blocks: _BlockState, i: int,  # type: ignore
                x: torch.Tensor) -> torch.Tensor:
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
        blocks: _BlockState = ctx.blocks
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


def _emit(blocks: _BlockState, window: _Window, foreign: Any, reals: dict[int, torch.Tensor],
          i: int) -> list[int]:
    return emit(blocks.tracker, blocks.fake_mode, blocks.saved_keys, window, foreign, reals,
                   _names_for(window, blocks.names[i]))
