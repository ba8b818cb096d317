"""The trace's speed-ups change no byte: each optimisation switched off gives the same estimate,
field for field (peak, reserved, breakdown, timeline, modules, phase and op peaks), on small
layouts where it acts.

Replay of a pipeline stage's micro-batches (``memfit/trace/replay.py``, Note: [replaying a
pipeline stage's micro-batches]): a stage module's forward on micro-batch k >= 2 and its backward
are replayed from micro-batch 1's recorded ledger events; the reference is every call traced for
real (``replay.disabled()``, the same as ``MEMFIT_NO_REPLAY=1``). The autograd steps the replay
stands in for are PyTorch's: the schedule's ``forward_one_chunk`` / ``backward_one_chunk``
(``torch/distributed/pipelining/stage.py``) and the input's ``AccumulateGrad``
(``torch/csrc/autograd/functions/accumulate_grad.h``), whose ops and events the replay repeats
from the recorded window.
"""

from __future__ import annotations

import dataclasses

import pytest

import memfit
from memfit.trace import replay


def _estimate(pp: int, tp: int, microbatches: int, schedule: str = "1f1b",
              layers: int = 4, checkpointing: str | None = None) -> memfit.Estimate:
    from memfit.models.build import build_model, example_inputs
    from memfit.parallel.measure import tiny_spec

    spec = tiny_spec(layers=layers)
    model = build_model(spec, backend="builtin", device="meta")
    if checkpointing:
        from memfit.techniques.checkpointing import apply_activation_checkpointing

        apply_activation_checkpointing(model, policy=checkpointing)
    inputs = example_inputs(spec, batch=microbatches, seq=64, device="meta")
    parallel = memfit.Parallel(gpus=pp * tp, tp=tp, pp=pp, microbatches=microbatches,
                               pp_schedule=schedule)
    return memfit.estimate(model, inputs, optimizer="adamw", precision="bf16-mixed",
                           device="cuda", gpu="h100-80gb", parallel=parallel)


def _fields(est: memfit.Estimate) -> list[dict[str, object]]:
    """Every field of each rank's estimate but the wall time."""
    return [{f.name: getattr(e, f.name) for f in dataclasses.fields(e)
             if f.name not in ("trace_seconds", "per_rank")} for e in est.per_rank]


@pytest.mark.parametrize(("pp", "tp", "microbatches", "schedule", "checkpointing"), [
    (4, 2, 8, "1f1b", None),  # issue 14's 405B layout in small: TP inside each stage, 1F1B
    (2, 1, 4, "gpipe", None),  # every forward before any backward: replays before the
    # backward's template is recorded
    (2, 1, 4, "interleaved-1f1b", None),  # two stage modules per rank
    (2, 2, 4, "1f1b", "selective"),  # the recompute runs inside the replayed backward
])
def test_replayed_micro_batches_give_the_estimate_of_the_real_trace(
        pp: int, tp: int, microbatches: int, schedule: str, checkpointing: str | None) -> None:
    before = dict(replay.counts)
    fast = _estimate(pp, tp, microbatches, schedule, checkpointing=checkpointing)
    used = replay.counts["replayed"] - before["replayed"]
    with replay.disabled():
        slow = _estimate(pp, tp, microbatches, schedule, checkpointing=checkpointing)
    # the replay acted: micro-batches 2.. of each stage module in the first step, 1.. in the
    # second, on every rank role
    modules = len(slow.per_rank) * (2 if schedule == "interleaved-1f1b" else 1)
    assert used == modules * ((microbatches - 2) + (microbatches - 1))
    assert replay.counts["redone"] == before["redone"]
    assert _fields(fast) == _fields(slow)
    assert [e.peak_bytes for e in fast.per_rank] == [e.peak_bytes for e in slow.per_rank]


def test_a_template_found_unreplayable_after_replays_redoes_the_rank(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """GPipe replays micro-batches 2.. before micro-batch 1's backward is recorded; a backward
    window refused there (forced here) redoes that rank without replay, to the same bytes."""
    window = replay._window

    def refuse_backwards(tracker, start, foreign, real_uid, meta):  # type: ignore[no-untyped-def]
        return None if foreign else window(tracker, start, foreign, real_uid, meta)

    with replay.disabled():
        slow = _estimate(2, 1, 4, "gpipe")
    monkeypatch.setattr(replay, "_window", refuse_backwards)
    before = replay.counts["redone"]
    fast = _estimate(2, 1, 4, "gpipe")
    assert replay.counts["redone"] - before == 2  # both stages
    assert _fields(fast) == _fields(slow)


def test_replay_is_off_with_the_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMFIT_NO_REPLAY", "1")
    assert not replay.enabled()
    monkeypatch.setenv("MEMFIT_NO_REPLAY", "0")
    assert replay.enabled()
    with replay.disabled():
        assert not replay.enabled()


def test_an_engine_callback_runs_when_the_backward_ends() -> None:
    """``torch_internals.queue_engine_callback`` (``Variable._execution_engine.queue_callback``),
    which closes a recorded backward window: queued from a gradient hook, it runs after every
    node, the leaf's ``AccumulateGrad`` included."""
    import torch

    from memfit._compat.torch_internals import queue_engine_callback

    x = torch.ones(3, requires_grad=True)
    seen: list[object] = []
    h = x * 2
    h.register_hook(lambda _g: queue_engine_callback(lambda: seen.append(x.grad)))
    h.sum().backward()
    assert len(seen) == 1 and isinstance(seen[0], torch.Tensor)
