"""The collector during a trace (Note: [frozen heap] in ``memfit/trace/heap.py``).

Expected values: the estimates of the same trace with the collector left alone (``_trace``
unwrapped), and hand-computed bytes for a tensor that only the collector frees.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from _hf import tiny_hf_llama
from memfit.trace import engine, estimate, heap


@pytest.fixture
def unfrozen() -> Iterator[None]:
    """The process without the session's freeze (conftest.py), given back after the test."""
    heap.mark_process_frozen(False)
    gc.unfreeze()
    try:
        yield
    finally:
        gc.collect()
        gc.freeze()
        heap.mark_process_frozen()


def test_nested_freezes_unfreeze_once(unfrozen: None) -> None:
    before = gc.get_freeze_count()
    assert before == 0
    with heap.frozen_heap():
        frozen = gc.get_freeze_count()
        assert frozen > 0
        made = [[] for _ in range(1000)]  # tracked objects a second freeze would add
        # Frozen objects that die (refcount) leave the count: it may drop by a few (2 once,
        # under xdist), never rise without a freeze. An inner freeze would add `made`; an
        # inner unfreeze would empty it.
        with heap.frozen_heap():
            assert gc.get_freeze_count() <= frozen
        assert frozen - len(made) < gc.get_freeze_count() <= frozen  # the outer freeze kept
    assert gc.get_freeze_count() == 0


class _NoCount:
    """The gc module, but counting the frozen objects fails the test."""

    def __getattr__(self, name: str) -> object:
        return getattr(gc, name)

    def get_freeze_count(self) -> int:
        raise AssertionError("frozen_heap counted the frozen objects of a declared freeze")


def test_a_declared_freeze_is_neither_counted_nor_undone(
        unfrozen: None, monkeypatch: pytest.MonkeyPatch) -> None:
    gc.freeze()
    before = gc.get_freeze_count()
    heap.mark_process_frozen()
    monkeypatch.setattr(heap, "gc", _NoCount())
    with heap.frozen_heap():
        pass
    monkeypatch.undo()
    assert gc.get_freeze_count() >= before - 100  # kept (a frozen object may die meanwhile)
    heap.mark_process_frozen(False)
    gc.unfreeze()
    with heap.frozen_heap():  # taken back: counted, then frozen and unfrozen by the trace
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


class CycleNet(nn.Module):
    """Makes a 4 MiB tensor held only by a reference cycle, then collects: the collector must
    still free it inside the trace, so it is not live at the later 4 MiB allocation."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cycle: list[object] = [torch.empty(1 << 20)]  # 4 MiB fp32
        cycle.append(cycle)
        del cycle
        gc.collect()
        later = torch.empty(1 << 20)
        return self.lin(x).sum() + later.sum()


def test_cycles_made_in_the_trace_are_collected() -> None:
    with torch.device("meta"):
        model = CycleNet()
    x = torch.empty(4, 8, device="meta")
    est = estimate(model, x, optimizer="sgd", device="cpu", steps=1)
    # Both 4 MiB tensors live at once would make the peak at least 8 MiB.
    assert est.peak_bytes < 2 * (4 << 20)
    assert est.peak_bytes >= 4 << 20


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_estimates_equal_the_unfrozen_trace(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_hf_llama()
    ids = torch.zeros(1, 16, dtype=torch.long, device="meta")
    kw = {"gpu": "h100-sxm-80gb"} if device == "cuda" else {}
    inputs = {"input_ids": ids, "labels": ids}
    frozen = dataclasses.asdict(estimate(model, inputs, optimizer="adamw", device=device,
                                         steps=2, **kw))
    monkeypatch.setattr(engine, "_trace", engine._trace.__wrapped__)
    plain = dataclasses.asdict(estimate(model, inputs, optimizer="adamw", device=device,
                                        steps=2, **kw))
    frozen.pop("trace_seconds"), plain.pop("trace_seconds")
    assert frozen == plain


def test_a_freeze_the_process_made_is_left_alone(unfrozen: None) -> None:
    """A process that called gc.freeze() itself keeps its permanent generation after a trace
    (unfreezing would move the user's objects back into collections). ``gc.unfreeze()`` empties
    the permanent generation (its count drops to 0); a frozen object that dies meanwhile (a
    finalizer, another thread) lowers the count by one, which CI once saw (2 fewer of 3.48
    million), so the check is that the generation was kept, not that no object in it died."""
    import gc

    from memfit.trace.heap import frozen_heap

    gc.freeze()
    try:
        before = gc.get_freeze_count()
        assert before > 0
        with frozen_heap():
            pass
        assert gc.get_freeze_count() > before // 2
    finally:
        gc.unfreeze()
