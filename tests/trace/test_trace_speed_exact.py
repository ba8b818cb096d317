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


def _estimate(microbatches: int, checkpointing: str | None = None, layers: int = 4,
              **layout: object) -> memfit.Estimate:
    from memfit.models.build import build_model, example_inputs
    from memfit.parallel.measure import tiny_spec

    spec = tiny_spec(layers=layers)
    model = build_model(spec, backend="builtin", device="meta")
    if checkpointing:
        from memfit.techniques.checkpointing import apply_activation_checkpointing

        apply_activation_checkpointing(model, policy=checkpointing)
    inputs = example_inputs(spec, batch=microbatches, seq=64, device="meta")
    parallel = memfit.Parallel(microbatches=microbatches, **layout)  # type: ignore[arg-type]
    return memfit.estimate(model, inputs, optimizer="adamw", precision="bf16-mixed",
                           device="cuda", gpu="h100-80gb", parallel=parallel)


def _fields(est: memfit.Estimate) -> list[dict[str, object]]:
    """Every field of each rank's estimate but the wall time."""
    return [{f.name: getattr(e, f.name) for f in dataclasses.fields(e)
             if f.name not in ("trace_seconds", "per_rank")} for e in est.per_rank]


@pytest.mark.parametrize(("layout", "microbatches", "checkpointing", "replaying"), [
    # issue 14's 405B layout in small: TP inside each of 4 stages, 1F1B; every stage replays
    ({"gpus": 8, "pp": 4, "tp": 2}, 6, None, 4),
    # every forward before any backward: replays before the backward's template is recorded
    ({"gpus": 2, "pp": 2, "pp_schedule": "gpipe"}, 4, None, 2),
    # two stage modules per rank
    ({"gpus": 2, "pp": 2, "pp_schedule": "interleaved-1f1b"}, 4, None, 4),
    # the recompute runs inside the replayed backward; sequence parallelism between stages
    ({"gpus": 4, "pp": 2, "tp": 2, "sp": True}, 4, "selective", 2),
    # loss parallelism: the last stage's logits are a DTensor, its calls are not replayed
    ({"gpus": 4, "pp": 2, "tp": 2, "sp": True, "loss_parallel": True}, 4, None, 1),
    # DDP / FSDP2 beside the pipeline keep state across calls: nothing replayed
    ({"gpus": 4, "pp": 2}, 4, None, 0),
    ({"gpus": 4, "pp": 2, "fsdp": 2}, 4, None, 0),
])
def test_replayed_micro_batches_give_the_estimate_of_the_real_trace(
        layout: dict, microbatches: int, checkpointing: str | None, replaying: int) -> None:
    before = dict(replay.counts)
    fast = _estimate(microbatches, checkpointing, **layout)
    used = replay.counts["replayed"] - before["replayed"]
    with replay.disabled():
        slow = _estimate(microbatches, checkpointing, **layout)
    # micro-batches 2.. of each replaying stage module in the first step, 1.. in the second
    assert used == replaying * ((microbatches - 2) + (microbatches - 1))
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

    layout = {"gpus": 2, "pp": 2, "pp_schedule": "gpipe"}
    with replay.disabled():
        slow = _estimate(4, **layout)
    monkeypatch.setattr(replay, "_window", refuse_backwards)
    before = replay.counts["redone"]
    fast = _estimate(4, **layout)
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
