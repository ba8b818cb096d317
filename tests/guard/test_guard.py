"""The OOM guard: recovery is exact, prediction splits ahead of time, other errors propagate.

The fault injector is a TorchDispatchMode that raises ``torch.OutOfMemoryError`` at chosen
allocation points: it counts the aten ops of the forward and backward passes that allocate (a
non-mutating op whose output has a storage none of its inputs has) and raises at the chosen
counts after running the op, as if the allocator had failed on its output. It arms when
``loss_fn`` starts a micro-batch and disarms when the optimizer (or the scaler's unscale) starts,
so failures land only where the guard promises to recover.
"""

from __future__ import annotations

import gc
import importlib
import logging
import random
import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import memfit
from memfit.errors import MemfitError
from memfit.oom_guard import BudgetWarning, GuardedStep, guard
from memfit.techniques.accumulation import accumulate, split_batch

IN, HIDDEN, OUT = 6, 12, 3


@pytest.fixture(autouse=True, scope="module")
def fast_cpu() -> Iterator[None]:
    """One intra-op thread (tiny kernels on a loaded 2-core machine), and the objects alive now
    moved out of the collector's reach so the guard's gc.collect() stays ~1 ms, not ~100 ms."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    # A warm-up recovery imports what the dispatch mode and the guard import lazily.
    guarded_run(0, "adamw", True, make_batches(0, [8]), 8, {5})
    gc.collect()
    gc.freeze()  # left frozen after the module, like the session's freeze (conftest.py)
    yield
    torch.set_num_threads(threads)


class OomInjector(TorchDispatchMode):
    """Raise ``torch.OutOfMemoryError`` at the ``fail_at`` counts of armed allocating ops."""

    def __init__(self, fail_at: set[int] | None = None, *, always: bool = False) -> None:
        super().__init__()
        self.fail_at = fail_at or set()
        self.always = always
        self.armed = False
        self.count = 0
        self.fired = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if not self.armed or func._schema.is_mutable:
            return out
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        fresh = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)
                 and t.untyped_storage().nbytes() > 0
                 and t.untyped_storage().data_ptr() not in inputs]
        if not fresh:
            return out
        self.count += 1
        if self.always or self.count in self.fail_at:
            self.fired += 1
            self.armed = False  # re-armed by the next micro-batch's loss_fn
            raise torch.OutOfMemoryError(f"injected at allocation {self.count} ({func})")
        return out


def make_model(seed: int, *, dropout: float = 0.25) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Dropout(dropout),
                         nn.Linear(HIDDEN, OUT))


def make_batches(seed: int, sizes: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, IN, generator=g), torch.randint(0, OUT, (n,), generator=g))
            for n in sizes]


def make_optimizer(kind: str, model: nn.Module, injector: OomInjector | None = None
                   ) -> torch.optim.Optimizer:
    opt: torch.optim.Optimizer
    if kind == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=1e-1, momentum=0.9)
    if injector is not None:
        opt.register_step_pre_hook(lambda *_: setattr(injector, "armed", False))
    return opt


def make_scaler(injector: OomInjector | None = None) -> torch.amp.GradScaler:
    class DisarmingScaler(torch.amp.GradScaler):
        def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
            if injector is not None:
                injector.armed = False
            super().unscale_(optimizer)

    # A small initial scale: 2**16 overflows fp16 gradients of this toy model at every step.
    return DisarmingScaler("cpu", init_scale=2.0 ** 8)


def make_loss(fp16: bool, injector: OomInjector | None = None):  # type: ignore[no-untyped-def]
    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if injector is not None:
            injector.armed = True
        x, y = batch
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            logits = model(x)
        return F.cross_entropy(logits.float(), y, reduction="sum")
    return loss_fn


def reference_run(seed: int, kind: str, fp16: bool, batches: list, micros: list[int]
                  ) -> nn.Module:
    """An uninterrupted run: the same batches with the micro-batch sizes the guard ended with,
    through :func:`accumulate` (fp32) or a hand-written scaled loop (fp16 + GradScaler)."""
    model = make_model(seed)
    opt = make_optimizer(kind, model)
    loss_fn = make_loss(fp16)
    scaler = make_scaler() if fp16 else None
    torch.manual_seed(1000 + seed)
    for batch, micro in zip(batches, micros, strict=True):
        parts = split_batch(batch, micro)
        if scaler is None:
            accumulate(model, parts, loss_fn, optimizer=opt, reduction="sum")
            continue
        num_items = batch[0].shape[0]
        for part in parts:
            (scaler.scale(loss_fn(model, part)) * (1 / num_items)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    return model


def guarded_run(seed: int, kind: str, fp16: bool, batches: list, micro: int,
                fail_at: set[int]) -> tuple[nn.Module, GuardedStep, OomInjector]:
    model = make_model(seed)
    injector = OomInjector(fail_at)
    opt = make_optimizer(kind, model, injector)
    scaler = make_scaler(injector) if fp16 else None
    step = guard(model, opt, make_loss(fp16, injector), micro_batch_size=micro, scaler=scaler,
                 log=False, reduction="sum")
    torch.manual_seed(1000 + seed)
    with injector:
        for batch in batches:
            step(batch)
    return model, step, injector


CONFIGS = [(kind, fp16) for kind in ("sgd", "adamw") for fp16 in (False, True)]
SIZES = [16, 12, 16]  # 12 at micro-batch 8 splits unevenly: [8, 4]
MICRO = 8
TRIALS = 240


@pytest.fixture(scope="module")
def allocations() -> dict[tuple[str, bool], int]:
    """Armed allocating ops of an uninterrupted run per config: the range failures are drawn
    from (retries add more ops, so late draws may land past the end and not fire)."""
    counts = {}
    for kind, fp16 in CONFIGS:
        _, _, injector = guarded_run(0, kind, fp16, make_batches(0, SIZES), MICRO, set())
        counts[(kind, fp16)] = injector.count
    return counts


def test_injector_counts_forward_and_backward_allocations(allocations):
    # One micro-batch of the MLP allocates at least: 2 linear outputs, relu, dropout mask and
    # output, loss, and in backward the grads of 2 weights, 2 biases and 2 activations.
    micro_batches = sum(-(-n // MICRO) for n in SIZES)
    for count in allocations.values():
        assert count >= 12 * micro_batches


def test_recovery_is_bit_exact_over_seeded_trials(allocations):
    rng = random.Random(20261122)
    failures: list[str] = []
    fired = recovered_steps = 0
    for trial in range(TRIALS):
        kind, fp16 = CONFIGS[trial % len(CONFIGS)]
        total = allocations[(kind, fp16)]
        fail_at = set(rng.sample(range(1, total + 1), rng.randint(1, 3)))
        batches = make_batches(trial, SIZES)
        model, step, injector = guarded_run(trial, kind, fp16, batches, MICRO, fail_at)
        fired += injector.fired
        assert len(step.recoveries) == injector.fired
        assert all(r.reason == "oom" for r in step.recoveries)
        assert step.steps == len(SIZES) and len(step.history) == len(SIZES)
        recovered_steps += len({r.step for r in step.recoveries})
        reference = reference_run(trial, kind, fp16, batches, step.history)
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            if not torch.equal(p, q):
                failures.append(f"trial {trial} ({kind}, fp16={fp16}, fail_at={sorted(fail_at)},"
                                f" history={step.history}): {name} differs by "
                                f"{(p - q).abs().max().item():.3g}")
        assert all(p.grad is None for p in model.parameters())
    assert failures == []
    assert fired >= TRIALS  # most trials really failed at least once
    assert recovered_steps >= TRIALS // 2


def test_recovery_matches_the_unsplit_batch_within_rounding():
    """Against the original micro-batch size the result differs only by summation order."""
    batches = make_batches(7, SIZES)
    model, step, injector = guarded_run(7, "adamw", False, batches, MICRO, {3, 40})
    assert injector.fired == 2 and step.history != [MICRO] * len(SIZES)
    reference = reference_run(7, "adamw", False, batches, [MICRO] * len(SIZES))
    # Dropout masks are drawn per micro-batch in order, so the same RNG stream gives the same
    # masks whatever the split: only the rounding of the sums differs.
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_scaler_state_is_untouched_by_failed_attempts():
    batches = make_batches(3, [8])
    model = make_model(3)
    injector = OomInjector({5})
    opt = make_optimizer("sgd", model, injector)
    scaler = make_scaler(injector)
    step = guard(model, opt, make_loss(True, injector), micro_batch_size=8, scaler=scaler,
                 log=False, reduction="sum")
    with injector:
        step(batches[0])
    assert injector.fired == 1
    ref_scaler = make_scaler()
    ref_model = make_model(3)
    ref_opt = make_optimizer("sgd", ref_model)
    loss_fn = make_loss(True)
    for part in split_batch(batches[0], 4):
        (ref_scaler.scale(loss_fn(ref_model, part)) * (1 / 8)).backward()
    ref_scaler.step(ref_opt)
    ref_scaler.update()
    assert scaler.get_scale() == ref_scaler.get_scale()
    assert scaler.state_dict() == ref_scaler.state_dict()


def test_non_oom_error_propagates_and_changes_nothing():
    model = make_model(1)
    opt = make_optimizer("adamw", model)
    step = guard(model, opt, make_loss(False), micro_batch_size=4, log=False, reduction="sum")
    step(make_batches(1, [8])[0])  # one real step so the optimizer has state
    weights = [p.detach().clone() for p in model.parameters()]
    state = {k: v.clone() for s in opt.state.values() for k, v in s.items()}
    calls = 0

    def failing(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if calls == 2:  # after the first micro-batch's backward accumulated gradients
            # The message says "out of memory": detection must be by type, not by text.
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 MiB (not really)")
        return make_loss(False)(model, batch)

    step.loss_fn = failing
    with pytest.raises(RuntimeError, match="not really"):
        step(make_batches(2, [8])[0])
    assert step.recoveries == [] and step.micro_batch_size == 4
    for p, w in zip(model.parameters(), weights, strict=True):
        assert torch.equal(p, w) and p.grad is None
    after = {k: v for s in opt.state.values() for k, v in s.items()}
    assert all(torch.equal(after[k], v) for k, v in state.items())


def test_oom_at_micro_batch_one_gives_up_with_a_clear_error():
    model = make_model(2)
    weights = [p.detach().clone() for p in model.parameters()]
    injector = OomInjector(always=True)
    opt = make_optimizer("sgd", model, injector)
    step = guard(model, opt, make_loss(False, injector), micro_batch_size=4, log=False,
                 reduction="sum")
    with injector, pytest.raises(torch.OutOfMemoryError, match="micro-batch 1"):
        step(make_batches(2, [8])[0])
    assert [(r.old_micro_batch_size, r.new_micro_batch_size) for r in step.recoveries] == [
        (4, 2), (2, 1)]
    assert injector.fired == 3
    assert all(torch.equal(p, w) and p.grad is None
               for p, w in zip(model.parameters(), weights, strict=True))
    assert opt.state == {} or all(not s for s in opt.state.values())


def test_oom_in_the_optimizer_step_is_not_retried():
    model = make_model(4)

    class Exploding(torch.optim.SGD):
        def step(self, closure=None):  # type: ignore[no-untyped-def, override]
            raise torch.OutOfMemoryError("injected in step")

    step = guard(model, Exploding(model.parameters(), lr=0.1), make_loss(False),
                 micro_batch_size=4, log=False, reduction="sum")
    with pytest.raises(torch.OutOfMemoryError, match="optimizer step"):
        step(make_batches(4, [8])[0])
    assert step.recoveries == [] and all(p.grad is None for p in model.parameters())


def test_each_recovery_logs_one_line(caplog):
    model = make_model(5)
    injector = OomInjector({2})
    step = guard(model, make_optimizer("sgd", model, injector), make_loss(False, injector),
                 micro_batch_size=8, reduction="sum")
    with caplog.at_level(logging.WARNING, logger="memfit"), injector:
        step(make_batches(5, [8])[0])
    lines = [r.getMessage() for r in caplog.records if "memfit guard" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert "micro-batch 8" in lines[0] and "micro-batch 4" in lines[0]
    assert "2 accumulation steps" in lines[0]


def test_batchnorm_statistics_are_restored_before_a_retry():
    def bn_model() -> nn.Module:
        torch.manual_seed(6)
        return nn.Sequential(nn.Linear(IN, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.ReLU(),
                             nn.Linear(HIDDEN, OUT))

    batch = make_batches(6, [8])[0]
    model = bn_model()
    injector = OomInjector()
    calls = 0

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if calls == 2:  # the second micro-batch: the first already updated the statistics
            injector.fail_at = {injector.count + 3}
        return make_loss(False, injector)(model, batch)

    step = guard(model, make_optimizer("sgd", model, injector), loss_fn, micro_batch_size=4,
                 log=False, reduction="sum")
    with injector:
        step(batch)
    assert injector.fired == 1 and step.history == [2]
    ref = bn_model()
    accumulate(ref, split_batch(batch, 2), make_loss(False), optimizer=make_optimizer("sgd", ref),
               reduction="sum")
    for a, b in zip(model.state_dict().values(), ref.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_non_oom_error_leaves_normalisation_buffers_alone():
    torch.manual_seed(11)
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.Linear(HIDDEN, OUT))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    calls = 0

    def failing(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        nonlocal calls
        calls += 1
        loss = make_loss(False)(model, batch)  # the forward updates the running statistics
        if calls == 2:
            raise KeyError("user bug")
        return loss

    step = guard(model, make_optimizer("sgd", model), failing, micro_batch_size=4, log=False,
                 reduction="sum")
    with pytest.raises(KeyError, match="user bug"):
        step(make_batches(11, [8])[0])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_token_counts_normalise_over_the_whole_batch():
    """Labels with ignored tokens: the guarded, split and retried batch trains like one
    ``F.cross_entropy(..., ignore_index=-100)`` mean over all its tokens."""
    from memfit.techniques.accumulation import count_tokens

    vocab, seq = 11, 5

    def lm() -> nn.Module:
        torch.manual_seed(12)
        return nn.Sequential(nn.Embedding(vocab, 8), nn.Linear(8, vocab))

    g = torch.Generator().manual_seed(12)
    tokens = torch.randint(0, vocab, (6, seq), generator=g)
    labels = torch.randint(0, vocab, (6, seq), generator=g)
    labels[0, 1:] = -100  # rows with very different numbers of real tokens
    labels[3, 2:] = -100
    batch = {"tokens": tokens, "labels": labels}

    def sum_loss(model: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
        injector.armed = True
        logits = model(b["tokens"])
        return F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), reduction="sum")

    model = lm()
    injector = OomInjector({4})
    step = guard(model, make_optimizer("sgd", model, injector), sum_loss, micro_batch_size=4,
                 count_fn=lambda b: count_tokens(b["labels"]), log=False, reduction="sum")
    with injector:
        loss = step(batch)
    assert injector.fired == 1 and step.history == [2]

    ref = lm()
    opt = make_optimizer("sgd", ref)
    mean = F.cross_entropy(ref(tokens).flatten(0, 1), labels.flatten())
    mean.backward()
    opt.step()
    assert loss == pytest.approx(mean.item(), rel=1e-6)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


class SeqModel(nn.Module):
    """Input ``(batch, seq, IN)``: activations grow with the sequence length."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(IN, HIDDEN)
        self.head = nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.proj(x)).mean(dim=1))


def seq_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1], reduction="sum")


def seq_batch(n: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, seq, IN), torch.randint(0, OUT, (n,))


def test_prediction_splits_new_shapes_ahead_of_time_and_is_cached():
    calls: list[tuple[int, int]] = []

    def predict(meta_batch: tuple[torch.Tensor, torch.Tensor]) -> int:
        x = meta_batch[0]
        assert x.device.type == "meta"
        calls.append((x.shape[0], x.shape[1]))
        return 100 * x.shape[0] * x.shape[1]  # bytes proportional to tokens

    model = SeqModel()
    step = guard(model, torch.optim.SGD(model.parameters(), lr=0.1), seq_loss,
                 micro_batch_size=8, budget_bytes=100 * 8 * 16, predict=predict, log=False,
                 reduction="sum")
    step(seq_batch(8, 16))      # 8 x 16 tokens fit
    step(seq_batch(8, 64))      # 4x the tokens: 8 -> 4 -> 2
    step(seq_batch(8, 64))      # cached: no new prediction
    step(seq_batch(8, 16))      # short sequences keep the large micro-batch
    assert calls == [(8, 16), (8, 64), (4, 64), (2, 64)]
    assert step.history == [8, 2, 2, 8]
    assert [(r.reason, r.new_micro_batch_size) for r in step.recoveries] == [
        ("predicted", 4), ("predicted", 2)]
    assert step.micro_batch_size == 8


def test_default_prediction_uses_the_trace_engine():
    model = SeqModel()

    def peak(rows: int) -> int:  # the engine's prediction of one micro-batch's training step
        class LossStep(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.model = model

            def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
                return seq_loss(self.model, (x, y))

        x = torch.empty(rows, 256, IN, device="meta")
        y = torch.empty(rows, dtype=torch.long, device="meta")
        return memfit.estimate(LossStep(), (x, y), device="cpu",
                               optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1)).peak_bytes

    at8, at4 = peak(8), peak(4)
    assert at8 > at4
    model_step = guard(model, torch.optim.SGD(model.parameters(), lr=0.1), seq_loss,
                       micro_batch_size=8, budget_bytes=(at8 + at4) // 2, log=False,
                       reduction="sum")
    model_step(seq_batch(8, 256))
    assert model_step.history == [4]
    assert model_step.recoveries[0].predicted_bytes == at8


def test_a_budget_below_micro_batch_one_warns_once_and_runs_at_one():
    # 64 -> 256 -> 10 with AdamW: weights, gradients and two states are 16 B per parameter,
    # 307,360 B before any activation, so no micro-batch fits 300,000 B (first principles).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    params = 64 * 256 + 256 + 256 * 10 + 10
    budget = 300_000
    assert 16 * params > budget
    x, y = torch.randn(33, 64), torch.randint(0, 10, (33,))
    with torch.no_grad():
        expected = F.cross_entropy(model(x), y).item()
    def loss_fn(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(m(b[0]).reshape(-1, 10), b[1].reshape(-1))

    step = guard(model, torch.optim.AdamW(model.parameters()), loss_fn, budget_bytes=budget,
                 log=False)
    with pytest.warns(BudgetWarning) as record:
        loss = step((x, y))
        step((x[:20], y[:20]))      # the same shape signature: cached, no second prediction
        step((torch.randn(8, 2, 64), torch.randint(0, 10, (8, 2))))  # a new one, also over
    assert len(record) == 1
    message = str(record[0].message)
    assert "even micro-batch 1" in message and f"{budget:,} B" in message
    predicted = int(message.split(" is predicted at ")[1].split(" B")[0].replace(",", ""))
    assert predicted > 16 * params  # the prediction holds the model states at least
    assert record[0].filename == __file__  # points at the caller's step(batch)
    # Training goes on, at the least memory the guard can give, with the full batch's loss.
    assert step.history == [1, 1, 1] and loss == pytest.approx(expected, rel=1e-5)
    # A budget micro-batch 1 fits: no warning.
    roomy = guard(model, torch.optim.AdamW(model.parameters()), loss_fn,
                  budget_bytes=predicted, log=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BudgetWarning)
        roomy((x, y))
    assert roomy.history == [1]


def test_grow_back_after_clean_steps_is_opt_in():
    model = make_model(8)
    injector = OomInjector({2})
    step = guard(model, make_optimizer("sgd", model, injector), make_loss(False, injector),
                 micro_batch_size=8, grow_after=2, log=False, reduction="sum")
    with injector:
        for batch in make_batches(8, [8] * 4):
            step(batch)
    assert step.history == [4, 4, 4, 8]
    assert [r.reason for r in step.recoveries] == ["oom", "grow"]
    never = guard(model, make_optimizer("sgd", model), make_loss(False), micro_batch_size=2,
                  log=False, reduction="sum")
    for batch in make_batches(8, [8] * 3):
        never(batch)
    assert never.history == [2, 2, 2]


def test_returns_the_mean_loss_of_the_whole_batch():
    model = make_model(9, dropout=0.0)
    batch = make_batches(9, [12])[0]
    with torch.no_grad():
        expected = F.cross_entropy(model(batch[0]), batch[1]).item()
    step = guard(model, make_optimizer("sgd", model), make_loss(False), micro_batch_size=5,
                 log=False, reduction="sum")
    assert step(batch) == pytest.approx(expected, rel=1e-6)
    assert step.micro_batch_size == 5 and step.history == [5]


def test_default_micro_batch_is_the_whole_batch():
    model = make_model(10)
    step = guard(model, make_optimizer("sgd", model), make_loss(False), log=False, reduction="sum")
    step(make_batches(10, [6])[0])
    assert step.micro_batch_size == 6 and step.history == [6]


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_bad_micro_batch_size_is_a_memfit_error(bad):
    model = make_model(0)
    with pytest.raises(MemfitError, match="micro_batch_size must be a positive integer"):
        guard(model, make_optimizer("sgd", model), make_loss(False), micro_batch_size=bad,
              reduction="sum")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_cuda_oom_is_recovered():
    """A real allocator OOM: the process is limited (and restored) to a fraction of the GPU
    between the measured peaks of micro-batch 4096 and 1024."""
    def model_and_opt() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 10)).cuda()
        return model, torch.optim.SGD(model.parameters(), lr=0.01)

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(model(batch[0]), batch[1], reduction="sum")

    g = torch.Generator(device="cuda").manual_seed(0)
    batch = (torch.randn(4096, 1024, device="cuda", generator=g),
             torch.randint(0, 10, (4096,), device="cuda", generator=g))

    def reserved_peak(micro: int) -> int:
        model, opt = model_and_opt()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        accumulate(model, split_batch(batch, micro), loss_fn, optimizer=opt, reduction="sum")
        peak = torch.cuda.max_memory_reserved()
        del model, opt
        torch.cuda.empty_cache()
        return peak

    full, quarter = reserved_peak(4096), reserved_peak(1024)
    assert full > quarter
    total = torch.cuda.get_device_properties(0).total_memory
    model, opt = model_and_opt()
    step = guard(model, opt, loss_fn, micro_batch_size=4096, log=False, reduction="sum")
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction((full + quarter) / 2 / total)
    try:
        step(batch)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert step.recoveries and step.recoveries[0].reason == "oom"
    assert step.history[0] < 4096
    ref, ref_opt = model_and_opt()
    accumulate(ref, split_batch(batch, step.history[0]), loss_fn, optimizer=ref_opt,
               reduction="sum")
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q)


def test_a_default_prediction_that_fails_warns_once_and_training_goes_on(monkeypatch, caplog):
    guard_module = importlib.import_module("memfit.oom_guard.step")

    def untraceable(*args, **kwargs):  # type: ignore[no-untyped-def]
        def predict(meta_batch):  # type: ignore[no-untyped-def]
            raise RuntimeError("cannot trace this op")
        return predict

    monkeypatch.setattr(guard_module, "default_predict", untraceable)
    model = SeqModel()
    step = guard(model, torch.optim.SGD(model.parameters(), lr=0.1), seq_loss,
                 micro_batch_size=4, budget_bytes=1, reduction="sum")
    with caplog.at_level(logging.WARNING, logger="memfit"):
        step(seq_batch(8, 4))
        step(seq_batch(8, 9))
    warnings = [r for r in caplog.records if "cannot predict" in r.getMessage()]
    assert len(warnings) == 1 and step.history == [4, 4] and step.recoveries == []


def test_a_given_predict_that_fails_raises():
    model = SeqModel()

    def predict(meta_batch):  # type: ignore[no-untyped-def]
        raise RuntimeError("my predictor is broken")

    step = guard(model, torch.optim.SGD(model.parameters(), lr=0.1), seq_loss,
                 micro_batch_size=4, budget_bytes=1, predict=predict, log=False, reduction="sum")
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="my predictor is broken"):
        step(seq_batch(8, 4))
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))


# -- reduction: mean losses (the default) and sum losses give the full batch's SGD step ----------


def mean_loss(injector: OomInjector | None = None):  # type: ignore[no-untyped-def]
    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if injector is not None:
            injector.armed = True
        return F.cross_entropy(model(batch[0]), batch[1])  # reduction="mean", as people write it
    return loss_fn


def plain_sgd_step(seed: int, batch: tuple[torch.Tensor, torch.Tensor]
                   ) -> tuple[nn.Module, float]:
    """One SGD step on the full batch's mean loss, no guard, no split."""
    model = make_model(seed, dropout=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loss = F.cross_entropy(model(batch[0]), batch[1])
    loss.backward()
    opt.step()
    return model, loss.item()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("fail_at", [set(), {3}], ids=["no-oom", "oom"])
def test_reduction_gives_the_full_batch_step(reduction, fail_at):
    batch = make_batches(21, [12])[0]
    ref, ref_loss = plain_sgd_step(21, batch)
    model = make_model(21, dropout=0.0)
    injector = OomInjector(fail_at)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    opt.register_step_pre_hook(lambda *_: setattr(injector, "armed", False))
    loss_fn = mean_loss(injector) if reduction == "mean" else make_loss(False, injector)
    kwargs = {} if reduction == "mean" else {"reduction": "sum"}  # mean is the default
    step = guard(model, opt, loss_fn, micro_batch_size=5, log=False, **kwargs)
    with injector:
        loss = step(batch)
    # 12 rows as 5 + 5 + 2 (unequal shares), or after the OOM as 2 * 6
    assert step.history == ([2] if fail_at else [5]) and injector.fired == len(fail_at)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_mean_loss_with_a_sum_reduction_is_not_the_default_silent_error():
    """The issue's reproduction: a mean loss read as a sum divides twice; the default is right."""
    batch = make_batches(22, [12])[0]
    _, ref_loss = plain_sgd_step(22, batch)
    model = make_model(22, dropout=0.0)
    step = guard(model, torch.optim.SGD(model.parameters(), lr=0.5), mean_loss(),
                 micro_batch_size=5, log=False)
    assert step(batch) == pytest.approx(ref_loss, rel=1e-5)


@pytest.mark.parametrize("bad", ["avg", "none", None, "Mean"])
def test_invalid_reduction_is_a_one_line_memfit_error(bad):
    model = make_model(0)
    with pytest.raises(MemfitError, match=r"reduction must be 'mean'.*or 'sum'") as info:
        guard(model, make_optimizer("sgd", model), mean_loss(), reduction=bad)
    assert "\n" not in str(info.value)


def tiny_gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50,
                                     n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def gpt2_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 50, (4, 8), generator=g)
    labels = ids.clone()
    labels[0, 3:] = -100  # padded rows: micro-batches hold unequal numbers of tokens
    labels[2, 6:] = -100
    labels[3, :] = -100  # a row with nothing to predict
    return {"input_ids": ids, "labels": labels}


@pytest.mark.parametrize("micro", [4, 2, 1])
def test_hf_causal_lm_loss_with_causal_lm_count_is_the_full_batch_step(micro):
    from memfit.oom_guard import causal_lm_count

    batch = gpt2_batch()
    ref = tiny_gpt2()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    ref_loss = ref(**batch).loss
    ref_loss.backward()
    ref_opt.step()
    model = tiny_gpt2()
    step = guard(model, torch.optim.SGD(model.parameters(), lr=0.5), lambda m, b: m(**b).loss,
                 micro_batch_size=micro, count_fn=causal_lm_count, log=False)
    assert causal_lm_count(batch) == 2 + 5 + 7 + 0
    assert step(batch) == pytest.approx(ref_loss.item(), rel=1e-5)
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_mean_with_token_labels_and_no_count_fn_is_refused():
    model = tiny_gpt2()
    step = guard(model, torch.optim.SGD(model.parameters(), lr=0.5), lambda m, b: m(**b).loss,
                 micro_batch_size=2, log=False)
    with pytest.raises(MemfitError,
                       match=r"count_fn=causal_lm_count \(from memfit\.oom_guard import"):
        step(gpt2_batch())
