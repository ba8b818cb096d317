"""The one storage ledger (memfit.ledger) that the trace and the profiler share: hand-computed
sequences of allocations and frees, and a prediction and a measurement of the same step read as
the same timeline type, category by category."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from memfit.categories import MemoryCategory
from memfit.ledger import (
    CATEGORIES,
    STORAGE_CATEGORIES,
    Ledger,
    ModuleStack,
    Storage,
    TimelinePoint,
    replay,
)

W, G, S = MemoryCategory.WEIGHTS, MemoryCategory.GRADIENTS, MemoryCategory.OPTIMIZER_STATES
A, T, R = MemoryCategory.ACTIVATIONS, MemoryCategory.TEMPORARIES, MemoryCategory.RUNTIME


class _Block:
    """Stands for a storage: something a weakref can watch."""


def _alloc(ledger: Ledger, key: int, nbytes: int, module: str = "",
           phase: str = "forward") -> tuple[int, _Block]:
    block = _Block()
    uid = ledger.add(Storage(nbytes, phase, 0, module))
    ledger.watch(uid, key, block)
    ledger.reached(ledger.current)
    return uid, block


def test_add_free_running_total_and_peak() -> None:
    """100 B, then 50 B, free the 100, then 200: 100, 150, 50, 250 live; the peak is the 250
    after four events, and frees are recorded when the storage object dies."""
    ledger = Ledger()
    a, block_a = _alloc(ledger, 1, 100)
    b, block_b = _alloc(ledger, 2, 50)
    assert (ledger.current, ledger.peak, ledger.peak_events) == (150, 150, 2)
    del block_a
    gc.collect()
    assert ledger.current == 50 and 1 not in ledger.live
    c, block_c = _alloc(ledger, 3, 200)
    assert (ledger.current, ledger.peak, ledger.peak_events) == (250, 250, 4)
    assert list(ledger.events) == [a, b, ~a, c]
    ledger.close()
    del block_b, block_c
    gc.collect()
    assert len(ledger.events) == 4  # frees after close are not recorded


def test_round_to_counts_whole_blocks() -> None:
    """On CUDA a storage counts as its size rounded up to 512 bytes (kMinBlockSize): 1 B and
    513 B hold 512 + 1024."""
    ledger = Ledger(round_to=512)
    keep = [_alloc(ledger, 1, 1), _alloc(ledger, 2, 513)]
    assert ledger.current == ledger.peak == 1536
    assert keep


def test_reached_beyond_the_storages_is_peak_extra() -> None:
    """A level above the storages (a kernel's scratch, whole allocator blocks) raises the peak;
    the excess is ``peak_extra``; a lower level changes nothing."""
    ledger = Ledger()
    keep = _alloc(ledger, 1, 100)
    assert ledger.reached(130) and (ledger.peak, ledger.peak_extra) == (130, 30)
    assert not ledger.reached(120) and ledger.peak == 130
    assert keep


def test_roles_decided_after_the_peak_replay_into_the_breakdown() -> None:
    """A storage's role becomes known after the peak (Adam's states in the first step): the
    replay at the peak still counts it in its category."""
    ledger = Ledger()
    w, bw = _alloc(ledger, 1, 400, "fc")
    x, bx = _alloc(ledger, 2, 40, "fc")
    tmp, btmp = _alloc(ledger, 3, 16, "fc")
    del btmp
    gc.collect()
    ledger.assign(w, W)
    saved = ledger.infos[x]
    saved.saved = True  # made in a forward and alive when it ended
    run = replay(ledger, [1, 2, 3, 4], ledger.peak_events)
    assert run.peak_op == 2 and run.peak.events == 3
    assert run.peak.by_category() == {W: 400, G: 0, S: 0, A: 40, MemoryCategory.KV_CACHE: 0,
                                      T: 16, R: 0}
    assert run.after[-1] == (400, 0, 0, 40, 0, 0, 0)
    assert run.peak.live == {w, x, tmp}
    assert bw and bx


def test_assign_last_word_wins_claim_strongest_role_wins() -> None:
    """``assign`` (the trace: roles given at known moments) keeps the last; ``claim`` (the
    profiler: roles seen by hooks in any order) keeps the strongest: a parameter saved for
    backward stays a weight, and a gradient claimed by its owner moves to that module."""
    ledger = Ledger()
    u, bu = _alloc(ledger, 1, 8, "made.here")
    ledger.claim(u, A, "elsewhere")
    assert (ledger.infos[u].category(), ledger.infos[u].module) == (A, "elsewhere")
    ledger.claim(u, W, "owner")
    ledger.claim(u, A, "saver")
    assert (ledger.infos[u].category(), ledger.infos[u].module) == (W, "owner")
    ledger.claim(u, W, "tied.owner")  # same role: the owner moves
    assert ledger.infos[u].module == "tied.owner"
    ledger.assign(u, G)
    assert (ledger.infos[u].category(), ledger.infos[u].module) == (G, "tied.owner")
    assert bu


def test_module_attribution_at_the_peak() -> None:
    """Bytes alive at the peak by module, then category (rounded sizes on CUDA)."""
    ledger = Ledger(round_to=512)
    w, bw = _alloc(ledger, 1, 1000, "a")
    g, bg = _alloc(ledger, 2, 1000, "a")
    _, bx = _alloc(ledger, 3, 10, "b")
    ledger.assign(w, W)
    ledger.assign(g, G)
    run = replay(ledger, [3], ledger.peak_events)
    assert ledger.by_module(run.peak.live) == {"a": {W: 1024, G: 1024}, "b": {T: 512}}
    assert bw and bg and bx


def test_peak_after_the_last_op() -> None:
    """An allocation after the last op (a hook) is the peak: replayed after the last point.
    Neither has a role: both are temporaries (the sixth column)."""
    ledger = Ledger()
    keep = [_alloc(ledger, 1, 10)]
    keep.append(_alloc(ledger, 2, 20))
    run = replay(ledger, [1], ledger.peak_events)
    assert run.peak_op == 1 and run.after == [(0, 0, 0, 0, 0, 10, 0)]
    assert sum(run.peak.bytes) == 30


def test_module_stack_forward_and_backward() -> None:
    """The innermost running module; in backward the one whose output's gradient came last."""
    stack = ModuleStack("")
    stack.enter("block")
    stack.enter("block.fc")
    assert stack.top() == "block.fc"
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    stack.leave([y])
    assert stack.top() == "block"
    z = y.sum()
    stack.leave([z])
    assert stack.top() == "" and stack.backward == ""
    z.backward()
    assert stack.backward == "block.fc"  # dz/dy is computed last (hooks fire outer first)
    stack.leave([])  # an unbalanced exit is ignored
    assert stack.top() == ""


def test_timeline_point_columns() -> None:
    """A trace's point has every column, runtime last; a measured one stops before runtime."""
    predicted = TimelinePoint(0, "aten.mm.default", "forward", "fc", (1, 2, 3, 4, 5, 6, 7))
    measured = TimelinePoint(0, "aten.mm.default", "forward", "fc", (1, 2, 3, 4, 5, 6))
    assert predicted.by_category()[R] == 7 and list(predicted.by_category()) == list(CATEGORIES)
    assert list(measured.by_category()) == list(STORAGE_CATEGORIES)
    assert predicted.total == 28 and measured.total == 21


def _step_parts() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Linear(64, 32, bias=False), torch.randn(16, 64)


def test_prediction_and_measurement_share_the_timeline_type_and_categories() -> None:
    """One SGD-with-momentum step of a bias-free Linear(64, 32) on a (16, 64) fp32 batch,
    traced (predicted) and profiled (measured). Both timelines are memfit.ledger.TimelinePoint
    lists, and their most bytes held per category agree with the hand count: weights
    64 * 32 * 4 = 8192, gradients 8192, the momentum buffer 8192, activations the batch
    16 * 64 * 4 = 4096 (autograd saves the batch and the weight for mm, nothing else). The one
    difference is a convention: the trace counts the 4-byte loss as an activation (made in the
    forward, alive when it ended), the profiler as a temporary (autograd never saved it)."""
    import memfit
    import memfit.trace

    def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    def loss_fn(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return model(batch).sum()

    model, batch = _step_parts()
    est = memfit.trace.estimate(model, batch, optimizer=sgd, loss_fn=loss_fn, device="cpu",
                                steps=1)
    model, batch = _step_parts()
    opt = sgd(list(model.parameters()))
    with memfit.profile(device="cpu", baseline=(model, opt, batch)) as prof:
        loss_fn(model, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    measured = prof.result
    assert measured is not None
    assert {type(p) for p in est.timeline} == {type(p) for p in measured.timeline} == {
        TimelinePoint}
    expected = {W: 8192, G: 8192, S: 8192, A: 4096}
    loss = {A: 4}
    for cat, nbytes in expected.items():
        predicted_max = max(p.by_category()[cat] for p in est.timeline)
        measured_max = max(p.by_category()[cat] for p in measured.timeline)
        assert (predicted_max, measured_max) == (nbytes + loss.get(cat, 0), nbytes), cat
    # The breakdowns at the peak are keyed alike (every category) and agree on the model states.
    assert set(est.breakdown) == set(measured.breakdown) == set(MemoryCategory)
    for cat in (W, G, S):
        assert est.breakdown[cat] == measured.breakdown[cat] == expected[cat], cat


@pytest.mark.parametrize("module", ["memfit.trace.tracker", "memfit.profiling.session"])
def test_both_recorders_are_the_one_ledger(module: str) -> None:
    """The trace's tracker is a Ledger; the profiler keeps one: neither has its own log."""
    import importlib

    mod = importlib.import_module(module)
    if module.endswith("tracker"):
        assert issubclass(mod.Tracker, Ledger)
    else:
        prof = mod.Profiler(device="cpu")
        assert isinstance(prof._ledger, Ledger)
        assert not hasattr(prof, "_events") and not hasattr(prof, "_infos")


def test_the_ledger_imports_no_torch() -> None:
    """Reports and the torch-free CLI paths can read the one timeline type without torch."""
    import subprocess
    import sys

    code = "import sys, memfit.ledger; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"
