"""Per-op speed-ups of the single-GPU trace change no byte: each one switched off gives the same
estimate, field for field (peak, reserved, breakdown, timeline, modules, phase and op peaks).

Dynamo's disable wrapper (``trace/tracker.py``, Note: [dynamo's disable wrapper]): PyTorch wraps
every dispatch mode's ``__torch_dispatch__`` in ``torch._disable_dynamo``
(``torch/utils/_python_dispatch.py: TorchDispatchMode.__init_subclass__``); its ``_fn``
(``torch/_dynamo/eval_frame.py: DisableContext.__call__``) only sets and restores the eval-frame
callback, which is None throughout when no ``torch.compile`` frame is running and the stance is
"default". The tracking mode skips the wrapper then; the reference is the wrapper on every call
(the path taken when a callback is set).
"""

from __future__ import annotations

import dataclasses

import pytest

import memfit
from memfit.trace import tracker


def _estimate(checkpointing: str | None, precision: str) -> memfit.Estimate:
    from memfit.models.build import build_model, example_inputs
    from memfit.parallel.measure import tiny_spec

    spec = tiny_spec(layers=3)
    model = build_model(spec, backend="builtin", device="meta")
    if checkpointing:
        from memfit.techniques.checkpointing import apply_activation_checkpointing

        apply_activation_checkpointing(model, policy=checkpointing)
    inputs = example_inputs(spec, batch=2, seq=64, device="meta")
    return memfit.estimate(model, inputs, optimizer="adamw", precision=precision,
                           device="cuda", gpu="h100-80gb", steps=2)


def _fields(est: memfit.Estimate) -> dict[str, object]:
    """Every field of the estimate but the wall time."""
    return {f.name: getattr(est, f.name) for f in dataclasses.fields(est)
            if f.name != "trace_seconds"}


@pytest.mark.parametrize(("checkpointing", "precision"), [
    (None, "bf16-mixed"), ("full", "bf16-mixed"), (None, "fp32"), ("full", "fp32")])
def test_skipping_dynamos_disable_wrapper_changes_no_field(
        checkpointing: str | None, precision: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # (No Python wrapper around the dispatch itself: the tracker walks the frames above an op
    # to tell the autograd engine's gradient accumulation from a forward's add.)
    frames = (tracker._DYNAMO or tracker._load_dynamo())[1]
    asked = {"fast": 0, "wrapped": 0}

    def no_callback() -> None:
        asked["fast"] += 1

    def a_callback() -> object:  # a stand-in: every call goes through torch's wrapper
        asked["wrapped"] += 1
        return object()

    monkeypatch.setattr(tracker, "_DYNAMO", [no_callback, frames])
    fast = _fields(_estimate(checkpointing, precision))
    monkeypatch.setattr(tracker, "_DYNAMO", [a_callback, frames])
    wrapped = _fields(_estimate(checkpointing, precision))
    assert asked["fast"] > 1000 and asked["wrapped"] > 1000
    assert fast == wrapped



# -- the one retry (memfit.trace.replay.redo_without_replay) -----------------------------------

def test_a_replay_mismatch_is_redone_once_without_replay() -> None:
    from memfit.trace import replay
    from memfit.trace.replay_windows import ReplayMismatch

    calls: list[bool] = []
    dropped: list[bool] = []

    def run() -> str:
        calls.append(replay.enabled())
        if len(calls) == 1:  # wrapped, as a pipeline schedule wraps a backward's error
            try:
                raise ReplayMismatch("block 3's backward is not replayable")
            except ReplayMismatch as exc:
                raise RuntimeError("stage backward failed") from exc
        return "traced"

    before = replay.counts["redone"]
    assert replay.redo_without_replay(run, before=lambda: dropped.append(True)) == "traced"
    assert calls == [replay.enabled(), False]  # the second run without replay
    assert dropped == [True] and replay.counts["redone"] == before + 1


def test_another_error_is_not_retried() -> None:
    from memfit.trace import replay

    calls = []

    def run() -> None:
        calls.append(1)
        raise ValueError("a real error")

    with pytest.raises(ValueError, match="a real error"):
        replay.redo_without_replay(run)
    assert calls == [1]
