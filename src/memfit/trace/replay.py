"""Replay of a module's repeated calls: record what one call of a module (its forward, then the
backward of that forward) did to the trace's ledger, and replay that record for the later calls
of the same step instead of running them.

Note: [replaying a pipeline stage's micro-batches] A pipeline schedule runs one stage module on
every micro-batch of the step (``torch/distributed/pipelining/stage.py: forward_one_chunk``,
``backward_one_chunk``): 16 micro-batches are 16 forwards and 16 backwards of the same module,
on inputs of the same shape, dtype and strides. On fake tensors a call is a function of metadata
alone: no value exists, so the same Python code runs the same ops in the same order, and each op
allocates the same sizes (a fake kernel reads only shapes, dtypes and strides), given the same
state of everything the call reads besides its input. Micro-batch 0 is the first call of the step
and changes that state (the autocast cache of cast weights, the cuBLAS workspaces of the first
matmul of a phase, the first ``.grad`` of each parameter in its backward); micro-batch 1 runs
where every later one runs: the caches full, every ``.grad`` allocated, the step and the phase
the same. So the ledger events of micro-batch 1's forward and backward, replayed with fresh uids,
are those of micro-batch k >= 2, and of micro-batch k >= 1 of the later steps, which start from
the same state as the first (``zero_grad(set_to_none=True)`` left no ``.grad``, the step's
autocast cache was cleared when its autocast exited, an optimizer's update is in place and a fake
one changes no metadata), except for what they must share with the world outside the call,
which stays real here:

- the forward's output is a real fake tensor (same metadata), watched by the tracker as the
  template's output storage was, so the schedule keeps and frees it as before;
- the backward's gradient of the input (the receive buffer's ``.grad``) is a real fake tensor
  handed to autograd, which accumulates it into the buffer as before;
- every other storage the forward leaves alive must be freed by the same call's backward (the
  saved activations), and the backward leaves nothing else alive and frees nothing made outside
  the call: else the call is not replayable (:class:`ReplayMismatch` when replays were already
  made, and the trace is redone without replay, ``redo_without_replay``).

Ledger events are the whole of what the estimate is computed from (``result._result``: the log,
the ops' marks, the allocator model fed in the same order, the running peaks), so the replayed
trace's estimate is the real one's, field for field; ``tests/trace/test_trace_speed_exact.py``
compares both on pipeline layouts with ``MEMFIT_NO_REPLAY=1`` (or :func:`disabled`) as the
reference. Replay is used only where nothing else hangs on the skipped calls: no FSDP inside the
module (its hooks own state across calls), no real values replayed into data-dependent ops, no host
memory, no side-stream frees pending.

The windows both replays record and replay, and :class:`ReplayMismatch`, are in
``replay_windows.py``; here: the switch (:func:`enabled`, :func:`disabled`), the one retry
(:func:`redo_without_replay`) and the replay of a stage module's calls (:func:`replaying`).
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from memfit.trace.replay_windows import (
    ReplayMismatch,
    _meta,
    _new_tensor,
    _plain_uid,
    _snapshot,
    _streams,
    _uids_of,
    _Window,
    _window,
    device_of_fake,
    emit,
    torch_internals_queue,
)

_ENV = "MEMFIT_NO_REPLAY"
_disabled = 0
T = TypeVar("T")

counts = {"recorded": 0, "replayed": 0, "redone": 0}
"""Calls recorded as templates, calls replayed, rank traces redone without replay (this process;
for tests and benchmarks)."""


def enabled() -> bool:
    """Whether replay is on (``MEMFIT_NO_REPLAY=1`` or :func:`disabled` turn it off)."""
    return not _disabled and os.environ.get(_ENV, "") in ("", "0")


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Every call traced for real inside the block (the reference for exactness tests)."""
    global _disabled
    _disabled += 1
    try:
        yield
    finally:
        _disabled -= 1


def redo_without_replay(run: Callable[[], T], *, before: Callable[[], None] | None = None) -> T:
    """``run()``; where it failed on a :class:`ReplayMismatch` (raised, or the cause or context
    of what was raised: a pipeline schedule wraps a backward's error), ``before()`` (state the
    failed run left to drop), then ``run()`` again with replay disabled, counted in
    ``counts["redone"]``. The one retry of a trace whose replayed call turned out not to be
    replayable (the engine's single-device trace, and each rank of a parallel layout)."""
    try:
        return run()
    except Exception as exc:
        cause: BaseException | None = exc
        while cause is not None and not isinstance(cause, ReplayMismatch):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
    if before is not None:
        before()
    counts["redone"] += 1
    with disabled():
        return run()


class _Replay:
    """The state of one stage module's replay in one trace (see the module's note); it holds
    no reference to the module (the key of ``_REPLAYS``)."""

    def __init__(self, tracker: Any) -> None:
        self.tracker = tracker
        self.step = -1
        self.calls = 0
        self.forward_t: _Window | None = None
        self.backward_t: _Window | None = None
        self.failed = False
        self.replayed = 0
        self.anchor: torch.Tensor | None = None

    def new_step(self) -> None:
        """A new step: its calls replay the templates of the first step from micro-batch 1 on
        (every step starts from the same state: see the module's note); without complete
        templates, micro-batch 1 is recorded again."""
        self.step, self.calls = self.tracker.step, 0
        if self.failed or self.forward_t is None or self.backward_t is None:
            self.forward_t = self.backward_t = None
            self.failed = False

    # -- recording -----------------------------------------------------------------------------

    def record(self, run: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        tracker = self.tracker
        grads = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        if (kwargs or len(grads) > 1 or (tracker.allocator is not None
                and tracker.allocator.pending_free_bytes) or tracker.stream):
            self.failed = True
            return run(*args, **kwargs)
        start = _snapshot(tracker)
        out = run(*args)
        uid = _plain_uid(tracker, out)
        meta = _meta(out) if uid is not None else None
        window = _window(tracker, start, {}, uid, meta) if uid is not None else None
        if window is None or not out.requires_grad or out.grad_fn is None:
            self.failed = True
            return out
        self.forward_t = window
        counts["recorded"] += 1
        survivors_at = {u: i for i, u in enumerate(
            _uids_of(tracker, start, window.survivors))}
        state: dict[str, Any] = {}

        def begin(grad: Any) -> None:
            x = state.get("input")
            if x is not None and x.grad is not None:
                return  # accumulated into an existing .grad: not replayed
            state["start"] = _snapshot(tracker)
            state["grad_out_uid"] = _plain_uid(tracker, grad)
            torch_internals_queue(end_of_backward)

        def end_of_backward() -> None:
            state["handle"].remove()
            x = state.pop("input", None)
            if x is not None and x.grad is not None:
                state["grad_uid"] = _plain_uid(tracker, x.grad)
                state["grad_meta"] = _meta(x.grad)
            self._backward_recorded(state, survivors_at)

        state["handle"] = out.register_hook(begin)
        state["input"] = grads[0] if grads else None
        state["has_input_grad"] = bool(grads)
        return out

    def _backward_recorded(self, state: dict[str, Any], survivors_at: dict[int, int]) -> None:
        """The engine finished the backward of the recorded call: its window is from the
        output's gradient to the end of that backward. The input's gradient (when it needs
        one: not the first stage's token ids) is the one storage it leaves alive, accumulated
        into the input's ``.grad`` by autograd, which steals it (no op, no event:
        ``torch/csrc/autograd/functions/accumulate_grad.h: AccumulateGrad::accumulateGrad``,
        "use_count() <= num_expected_refs"), wherever in the window that happened; a replay
        checks that nothing follows its backward (:class:`_Replayed`)."""
        tracker = self.tracker
        window = None
        if "start" in state and (state.get("grad_uid") is not None
                                 or not state["has_input_grad"]):
            foreign = dict(survivors_at)
            if state.get("grad_out_uid") is not None:
                foreign[state["grad_out_uid"]] = -1  # the output's gradient
            window = _window(tracker, state["start"], foreign,
                             state.get("grad_uid"), state.get("grad_meta"))
        if window is not None:
            window.module_after = str(tracker.modules.backward)
            freed = {e[2] for e in window.events if e[0] == "f" and e[1] == "s"} - {-1}
            # every survivor of the forward but its output (0) is freed here, and nothing but
            # the input's gradient outlives the window
            if (freed != set(range(1, len(survivors_at)))
                    or len(window.survivors) != int(state["has_input_grad"])):
                window = None
        if window is None:
            self.failed = True
            if self.replayed:
                raise ReplayMismatch("a replayed micro-batch's backward template is not "
                                     "replayable")
            return
        self.backward_t = window

    # -- replay --------------------------------------------------------------------------------

    def emit(self, window: _Window, foreign: Any, reals: dict[int, torch.Tensor]
             ) -> list[int]:
        """Replay ``window``'s events and ops now (:func:`emit`)."""
        return emit(self.tracker, self.fake_mode, self.saved_keys, window, foreign, reals)

    saved_keys: dict[int, int]
    fake_mode: Any = None


class _Replayed(torch.autograd.Function):
    """One replayed call: its forward replays the template's forward events and returns the
    output; its backward replays the backward events and returns the input's gradient."""

    @staticmethod
    def forward(ctx: Any, replay: _Replay, x: torch.Tensor) -> torch.Tensor:  # type: ignore
        window = replay.forward_t
        assert window is not None and window.meta is not None
        fake_mode = replay.fake_mode
        out = _new_tensor(window.meta, fake_mode)
        uids = replay.emit(window, [], {window.real_local: out})
        ctx.replay, ctx.saved = replay, uids
        ctx.fake_mode = fake_mode
        ctx.input = x if x is not replay.anchor else None
        return out

    @staticmethod
    def backward(ctx: Any, _grad: torch.Tensor) -> tuple[None, torch.Tensor | None]:
        replay: _Replay = ctx.replay
        window = replay.backward_t
        if window is None:
            raise ReplayMismatch("a replayed micro-batch has no backward template")
        forward = replay.forward_t
        assert forward is not None
        saved = [ctx.saved[i] for i in forward.survivors]
        if any(e[0] == "f" and e[2] == -1 for e in window.events):
            uid = _plain_uid(replay.tracker, _grad)
            if uid is None:
                raise ReplayMismatch("a replayed backward's output gradient is not a storage "
                                     "of its own")
            saved.append(uid)  # index -1
        grad = _new_tensor(window.meta, ctx.fake_mode) if window.meta is not None else None
        replay.emit(window, saved, {} if grad is None else {window.real_local: grad})
        replay.tracker.modules.backward = window.module_after
        count = len(replay.tracker.events), len(replay.tracker.ops)

        def nothing_after() -> None:
            if (len(replay.tracker.events), len(replay.tracker.ops)) != count:
                raise ReplayMismatch("events after a replayed backward")

        torch_internals_queue(nothing_after)
        del ctx.saved
        x, ctx.input = ctx.input, None
        if grad is not None:
            # Set as autograd's AccumulateGrad set it in the recorded window (whose ops and
            # events, a clone or a detach, were replayed above); returned, it would be
            # accumulated again (a detach op more).
            if x is None or x.grad is not None:
                raise ReplayMismatch("a replayed input's gradient has no empty .grad to go to")
            x.grad = grad
        return None, None


@contextlib.contextmanager
def replaying(modules: list[torch.nn.Module], tracker: Any) -> Iterator[None]:
    """Inside the block, each of ``modules`` replays its calls from the second one on in each
    step (see the module's note); its own forward again on exit."""
    if not enabled():
        yield
        return
    states = []
    on_stream = tracker.on_stream

    @contextlib.contextmanager
    def counted(stream: int) -> Iterator[None]:  # side-stream allocations refuse a window
        _streams[id(tracker)] = _streams.get(id(tracker), 0) + 1
        with on_stream(stream):
            yield

    tracker.on_stream = counted
    for module in modules:
        if _has_fsdp(module):
            continue
        replay = _REPLAYS.get(module)
        if replay is None or replay.tracker is not tracker:  # kept across the trace's steps
            replay = _REPLAYS[module] = _Replay(tracker)
            replay.saved_keys = {}
        run = module.forward

        def forward(*args: Any, _replay: _Replay = replay, _run: Any = run,
                    **kwargs: Any) -> Any:
            return _call(_replay, _run, args, kwargs)

        module.forward = forward  # type: ignore[method-assign]
        states.append((module, replay))
    try:
        yield
    finally:
        del tracker.on_stream
        _streams.pop(id(tracker), None)
        for module, _ in states:
            del module.forward


_REPLAYS: weakref.WeakKeyDictionary[torch.nn.Module, _Replay] = weakref.WeakKeyDictionary()


def _has_fsdp(module: torch.nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return any(isinstance(m, FSDPModule) for m in module.modules())


def _call(replay: _Replay, run: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    tracker = replay.tracker
    if tracker.step != replay.step:
        replay.new_step()
    replay.calls += 1
    index = replay.calls - 1
    if index == 0:
        mode = getattr(args[0], "fake_mode", None) if args else None
        # the fake mode that tracks (memfit/trace/tracker.py: TrackingFakeMode); with real
        # values replayed into data-dependent ops (datadep.real), each call reads its own
        if (mode is None or getattr(mode, "tracker", None) is not tracker
                or getattr(getattr(mode, "datadep", None), "real", 1) is not None):
            replay.failed = True
        replay.fake_mode = mode
    if index == 0 or replay.failed or not torch.is_grad_enabled():
        return run(*args, **kwargs)
    if index == 1 and replay.forward_t is None:
        return replay.record(run, args, kwargs)
    window = replay.forward_t
    if window is None or kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor):
        return run(*args, **kwargs)
    x = args[0]
    if not x.requires_grad:
        if replay.anchor is None:
            replay.anchor = _new_tensor(((0,), (1,), torch.float32, 0, device_of_fake(x)),
                                        replay.fake_mode).requires_grad_()
        x = replay.anchor
    replay.replayed += 1
    counts["replayed"] += 1
    return _Replayed.apply(replay, x)
