"""The batch-size finder on CPU with byte budgets.

Expected batch sizes come from this file's own measurement of the step (two AdamW training
steps, or a no-grad forward) with the PyTorch profiler's allocator events: the budget is put
half-way between the measured peaks of batch ``b`` and ``b + 1``, so the finder must return
exactly ``b``.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memfit.batch_size as batch_size_module
from memfit.batch_size import find_batch_size
from memfit.errors import MemfitError
from memfit.profiling.cpu import measure_cpu_peak

IN, HIDDEN, OUT = 32, 128, 10


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))


def make_batch(b: int) -> torch.Tensor:
    return torch.randn(b, IN)


def measured_peak(model: nn.Module, batch: object, *, train: bool) -> int:
    """Peak bytes of the step on a copy of the model: two steps of a fresh AdamW(lr=1e-3) on
    ``model(x).sum()`` (memfit's 'adamw' and the default loss of a non-scalar output), or a
    no-grad forward in eval mode."""
    m = copy.deepcopy(model).train(train)
    args = batch if isinstance(batch, tuple) else (batch,)

    def step() -> None:
        if not train:
            with torch.no_grad():
                m(*args)
            return
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        for _ in range(2):
            m(*args).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    return measure_cpu_peak(step, m, batch).peak_bytes


def budget_between(model: nn.Module, make, b: int, *, train: bool) -> int:  # type: ignore[no-untyped-def]
    low = measured_peak(model, make(b), train=train)
    high = measured_peak(model, make(b + 1), train=train)
    assert low < high
    return (low + high) // 2


@pytest.fixture(scope="module")
def budget40() -> int:
    """The training budget between batch 40 and 41 of ``mlp()``: measured once for the tests
    that search for 40 (``mlp()`` is seeded, so every test's model has the same weights and
    the same peaks)."""
    return budget_between(mlp(), make_batch, 40, train=True)


def test_train_finds_the_largest_batch_within_the_budget(caplog, budget40):
    model = mlp()
    budget = budget40
    with caplog.at_level(logging.INFO, logger="memfit"):
        found = find_batch_size(model, make_batch, budget_bytes=budget, device="cpu")
    assert found == 40
    assert measured_peak(model, make_batch(found), train=True) <= budget
    assert measured_peak(model, make_batch(found + 1), train=True) > budget
    summary = [r.getMessage() for r in caplog.records if "train batch" in r.getMessage()]
    assert len(summary) == 1 and "batch 40 fits" in summary[0]


@pytest.mark.parametrize("start", [1, 39, 41, 120])
def test_search_grows_and_shrinks_from_any_seed(start, budget40, monkeypatch):
    sizes: list[int] = []
    real = batch_size_module._Trials.fits

    def counting(self, rows):  # type: ignore[no-untyped-def]
        if rows not in self.results:
            sizes.append(rows)
        return real(self, rows)

    monkeypatch.setattr(batch_size_module._Trials, "fits", counting)
    assert find_batch_size(mlp(), make_batch, budget_bytes=budget40, start=start,
                           log=False) == 40
    # The MLP's peak is piecewise linear in the batch (128 B a sample up to 32, measured, 1,664
    # from 39 on): the line through two batches that do not fit meets the budget at
    # 40, and 41 closes the search. Galloping and bisecting alone take 12 trials from 1 (1, 2,
    # 4, ..., 64, 48, 40, 44, 42, 41) and 14 from 120.
    assert len(sizes) <= 6, sizes


def test_eval_is_separate_and_fits_a_larger_batch(budget40):
    model = mlp()
    budget = budget40
    train = find_batch_size(model, make_batch, budget_bytes=budget, log=False)
    evaluated = find_batch_size(model, make_batch, budget_bytes=budget, mode="eval", log=False)
    assert evaluated > train == 40
    assert measured_peak(model, make_batch(evaluated), train=False) <= budget
    assert measured_peak(model, make_batch(evaluated + 1), train=False) > budget


def test_weights_gradients_and_mode_are_restored():
    model = mlp().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    budget = budget_between(model, make_batch, 20, train=True)
    find_batch_size(model, make_batch, budget_bytes=budget, log=False)
    assert not model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_max_batch_caps_the_search():
    assert find_batch_size(mlp(), make_batch, budget_bytes=2**40, max_batch=64, log=False) == 64


class Pooled(nn.Module):
    """Input ``(batch, seq, IN)`` and labels: activations grow with the sequence length."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(IN, HIDDEN)
        self.head = nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(torch.relu(self.proj(x)).mean(1)), y, reduction="sum")


def test_a_loader_is_searched_at_its_longest_sequence():
    model = Pooled()
    g = torch.Generator().manual_seed(0)
    loader = [(torch.randn(4, seq, IN, generator=g), torch.randint(0, OUT, (4,), generator=g))
              for seq in (8, 32, 16)]

    def at(seq: int):  # type: ignore[no-untyped-def]
        return lambda b: (torch.randn(b, seq, IN), torch.randint(0, OUT, (b,)))

    budget = budget_between(model, at(32), 12, train=True)
    found = find_batch_size(model, loader, budget_bytes=budget, log=False)
    assert found == 12
    # The short sequences alone would have allowed a larger batch.
    assert measured_peak(model, at(8)(found + 1), train=True) <= budget


def test_make_batch_must_return_the_size_asked_for():
    with pytest.raises(MemfitError, match=r"make_batch\(\d+\) returned a batch of 3"):
        find_batch_size(mlp(), lambda b: torch.randn(3, IN), budget_bytes=2**30, start=5,
                        log=False)


def test_batch_one_over_budget_is_a_clear_error():
    with pytest.raises(MemfitError, match="even batch size 1 peaks at"):
        find_batch_size(mlp(), make_batch, budget_bytes=1000, log=False)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"mode": "evl"}, r"unknown mode 'evl' \(did you mean 'eval'\?\)"),
    ({"budget_bytes": 0}, "budget_bytes must be a positive integer"),
    ({"budget_bytes": None}, "budget_bytes is required on cpu"),
    ({"device": "meta"}, "the model is on cpu but device=meta"),
])
def test_bad_input_is_a_memfit_error(kwargs, message):
    args = {"budget_bytes": 2**30, **kwargs}
    with pytest.raises(MemfitError, match=message):
        find_batch_size(mlp(), make_batch, **args)


def test_an_optimizer_instance_is_refused():
    model = mlp()
    with pytest.raises(MemfitError, match="trial steps build a fresh one"):
        find_batch_size(model, make_batch, budget_bytes=2**30,
                        optimizer=torch.optim.AdamW(model.parameters()))  # type: ignore[arg-type]


@pytest.fixture
def gloo_group(tmp_path):  # type: ignore[no-untyped-def]
    dist = torch.distributed
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    yield dist
    dist.destroy_process_group()


def test_rank_zero_decides_and_broadcasts(gloo_group, monkeypatch, budget40):
    model = mlp()
    budget = budget40
    sent: list[tuple[int, int]] = []
    real_broadcast = gloo_group.broadcast

    def spy(tensor, src, *args, **kwargs):  # type: ignore[no-untyped-def]
        sent.append((int(tensor.item()), src))
        return real_broadcast(tensor, src, *args, **kwargs)

    monkeypatch.setattr(gloo_group, "broadcast", spy)
    assert find_batch_size(model, make_batch, budget_bytes=budget, log=False) == 40
    assert sent == [(40, 0)]


def test_other_ranks_run_no_trial_and_take_rank_zeros_answer(gloo_group, monkeypatch):
    monkeypatch.setattr(gloo_group, "get_rank", lambda *a, **k: 1)

    def from_rank_zero(tensor, src, *args, **kwargs):  # type: ignore[no-untyped-def]
        assert src == 0 and int(tensor.item()) == 0
        tensor.fill_(24)  # what rank 0 would have sent

    def no_trials(b: int) -> torch.Tensor:
        raise AssertionError("a rank other than 0 built a batch")

    monkeypatch.setattr(gloo_group, "broadcast", from_rank_zero)
    assert find_batch_size(mlp(), no_trials, budget_bytes=2**30, log=False) == 24


def test_rank_zero_failure_reaches_every_rank(gloo_group, monkeypatch):
    monkeypatch.setattr(gloo_group, "get_rank", lambda *a, **k: 1)
    monkeypatch.setattr(gloo_group, "broadcast", lambda tensor, src, *a, **k: None)
    with pytest.raises(MemfitError, match="rank 0 could not find a batch size"):
        find_batch_size(mlp(), make_batch, budget_bytes=2**30, log=False)


def test_the_engine_seed_saves_trials(monkeypatch, budget40):
    model = mlp()
    budget = budget40
    sizes: list[int] = []
    real = batch_size_module._Trials.fits

    def counting(self, rows):  # type: ignore[no-untyped-def]
        sizes.append(rows)
        return real(self, rows)

    monkeypatch.setattr(batch_size_module._Trials, "fits", counting)
    assert find_batch_size(model, make_batch, budget_bytes=budget, log=False) == 40
    # A seed within a few samples of the answer: a handful of trials, not a sweep from 1.
    assert len(set(sizes)) <= 6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_budget_is_respected():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 10)).cuda()
    budget = 512 * 2**20

    def make(b: int) -> torch.Tensor:
        return torch.randn(b, 1024, device="cuda")

    def reserved_peak(b: int) -> int:
        m = model  # no copy: the same tensors alive as in the finder's trials
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        x = make(b)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(2):
            m(x).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        peak = torch.cuda.max_memory_reserved()
        del opt, x
        torch.cuda.empty_cache()
        return peak

    found = find_batch_size(model, make, budget_bytes=budget, max_batch=2**16, log=False)
    assert reserved_peak(found) <= budget
    assert reserved_peak(found + 1) > budget


def test_search_logic_on_every_threshold_and_seed():
    """``_largest`` against a synthetic "fits iff b <= threshold" for all small cases."""
    for max_batch in (1, 7, 64):
        for threshold in range(0, 70):
            for seed in range(1, 70):
                calls: list[int] = []

                def fits(b: int, threshold: int = threshold, calls: list[int] = calls,
                         top: int = max_batch) -> bool:
                    assert 1 <= b <= top
                    calls.append(b)
                    return b <= threshold

                found = batch_size_module._largest(fits, seed, max_batch)
                expected = min(threshold, max_batch) or None
                assert found == expected, (max_batch, threshold, seed)
                # Galloping plus bisection: O(log distance) trials, each size tried once.
                assert len(calls) == len(set(calls)) <= 2 * (abs(seed - threshold) + 1) \
                    .bit_length() + 2


@pytest.mark.parametrize("guess", ["affine", "wrong", "none"])
def test_search_logic_with_guesses_on_every_threshold_and_seed(guess):
    """``_largest`` with a ``guess``: an exact one (the line through measured peaks of an affine
    step) closes the bracket in at most two guesses; a wrong one, or none, still ends at the
    right size, with at most ``_GUESSES`` trials and one bisection of [1, max_batch] more than
    galloping and bisection alone."""
    for max_batch in (1, 7, 64):
        for threshold in range(0, 70):
            for seed in range(1, 70):
                calls: list[int] = []

                def fits(b: int, threshold: int = threshold, calls: list[int] = calls,
                         top: int = max_batch) -> bool:
                    assert 1 <= b <= top
                    calls.append(b)
                    return b <= threshold

                def propose(lo: int, hi: int, threshold: int = threshold,
                            calls: list[int] = calls) -> int | None:
                    if len(calls) < 2 or guess == "none":
                        return None
                    return threshold if guess == "affine" else (lo * 7 + hi * 3) % 97 - 10

                found = batch_size_module._largest(fits, seed, max_batch, propose)
                assert found == (min(threshold, max_batch) or None), (max_batch, threshold, seed)
                assert len(calls) == len(set(calls)), calls
                if guess == "affine":  # seed, one gallop step, the guess, the size above it
                    assert len(calls) <= 4, calls
                bound = 2 * (abs(seed - threshold) + 1).bit_length() + 2
                assert len(calls) <= (bound + batch_size_module._GUESSES
                                       + max_batch.bit_length()), calls


def test_prefetched_batches_are_counted(budget40):
    """prefetch_batches=2 (DevicePrefetcher depth 2): the budget is put between the measured
    peaks of batches 40 and 41 plus two more batches of their bytes each (b x IN float32s), so
    the finder must return 40; without counting them it finds more."""
    model = mlp()
    extra = 2 * IN * 4  # two batches of one row
    budget = (measured_peak(model, make_batch(40), train=True) + 40 * extra
              + measured_peak(model, make_batch(41), train=True) + 41 * extra) // 2
    assert find_batch_size(model, make_batch, budget_bytes=budget, device="cpu",
                           prefetch_batches=2) == 40
    assert find_batch_size(model, make_batch, budget_bytes=budget, device="cpu") > 40
    with pytest.raises(MemfitError, match="prefetch_batches must be an int >= 0"):
        find_batch_size(model, make_batch, budget_bytes=budget, device="cpu", prefetch_batches=-1)
