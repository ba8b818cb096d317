"""Replay of a model's identical blocks: the transformer layers of a traced step run once or
twice, and the others replayed from that record (:mod:`memfit.trace.replay_windows`).

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
(:class:`memfit.trace.replay_windows.ReplayMismatch`), as it is when a template turns out not
to be replayable. ``tests/trace/test_trace_block_replay_exact.py`` compares every Estimate
field with replay on and off.

Here: which call runs, is recorded or is replayed (:class:`_Blocks`), and
:func:`replaying_blocks`. Which modules are blocks and when calls match: ``block_match.py``; the
templates and the replayed block: ``block_templates.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from memfit._compat.torch_internals import DisableTorchFunction
from memfit.trace import replay as _r
from memfit.trace.block_match import (
    _blocks_of,
    _holds_objects,
    _matches,
    _meta_signature,
    _relative,
    _same_window,
    _signature,
)
from memfit.trace.block_templates import _BlockReplayed, _BlockState, _bookkeeping, _emit
from memfit.trace.replay_windows import (
    _meta,
    _new_tensor,
    _plain_uid,
    _snapshot,
    _Window,
    _window,
)


class _Blocks(_BlockState):
    """The replay of one model's blocks in one trace: which call runs, is recorded or is
    replayed (see the module's note); its state and templates are :class:`_BlockState`'s."""

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
