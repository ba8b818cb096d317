"""One loss signature, ``loss_fn(model, batch) -> scalar``, across estimate, fit, guard,
Plan.apply, find_batch_size and accumulate; and the micro-batch weighting of mean and sum losses.

Parity tests: the expected weights come from a plain PyTorch full-batch step (forward of the
whole batch, ``F.cross_entropy`` mean, backward, ``torch.optim.SGD(lr=0.1).step()``), never
from memfit. Tolerance: fp32, ``rtol=1e-5, atol=1e-7``: splitting changes only the summation
order of the per-row gradient contributions (a few ulps of values of order 0.1-1).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memfit
from memfit.batch_size import find_batch_size
from memfit.errors import MemfitError
from memfit.fitting.apply import apply_config
from memfit.fitting.config import FitConfig
from memfit.techniques.accumulation import AccumulatedStep, accumulate, split_batch

ROWS, DIM, CLASSES, LR = 11, 16, 5, 0.1  # 11 rows: every split below is uneven
RTOL, ATOL = 1e-5, 1e-7


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, 32), nn.Tanh(), nn.Linear(32, CLASSES))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(ROWS, DIM, generator=g), torch.randint(0, CLASSES, (ROWS,), generator=g)


def mean_ce(model: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(b[0]), b[1])


def sum_ce(model: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(b[0]), b[1], reduction="sum")


LOSSES = {"mean": mean_ce, "sum": sum_ce}


def plain_step() -> list[torch.Tensor]:
    """The weights after one plain full-batch SGD step (PyTorch only)."""
    model = mlp()
    x, y = batch()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    return [p.detach() for p in model.parameters()]


def assert_weights(model: nn.Module, expected: list[torch.Tensor]) -> None:
    got = list(model.parameters())
    assert len(got) == len(expected)
    for p, q in zip(got, expected, strict=True):
        torch.testing.assert_close(p.detach(), q, rtol=RTOL, atol=ATOL)


class OomAbove(nn.Module):
    """Raises ``torch.OutOfMemoryError`` in the forward of a micro-batch above ``rows`` rows, and
    once in the backward of the first micro-batch that gets through (an OOM after part of the
    gradients were accumulated)."""

    def __init__(self, model: nn.Module, rows: int) -> None:
        super().__init__()
        self.model = model
        self.rows = rows
        self.backward_oom = True
        self.fired = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.rows:
            self.fired += 1
            raise torch.OutOfMemoryError(f"injected: {x.shape[0]} rows")
        out = self.model(x)
        if self.backward_oom:
            self.backward_oom = False

            def hook(grad: torch.Tensor) -> torch.Tensor:
                self.fired += 1
                raise torch.OutOfMemoryError("injected in backward")

            out.register_hook(hook)
        return out


# -- the signature -----------------------------------------------------------------------------

def old_loss(out: torch.Tensor) -> torch.Tensor:
    return out.sum()


def one_line_rewrite(exc: pytest.ExceptionInfo[MemfitError]) -> None:
    message = str(exc.value)
    assert "\n" not in message
    assert "loss_fn=lambda model, batch: my_loss(model(batch))" in message


def test_old_one_argument_loss_is_refused_everywhere() -> None:
    model, (x, y) = mlp(), batch()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    calls = {
        "estimate": lambda: memfit.estimate(model, x, loss_fn=old_loss, device="cpu"),
        "fit": lambda: memfit.fit(model, (x, y), global_batch=4, budget_bytes=2**30,
                                  device="cpu", loss_fn=old_loss, progress=False),
        "guard": lambda: memfit.guard(model, opt, old_loss),
        "Plan.apply": lambda: apply_config(copy.deepcopy(model), FitConfig(optimizer="sgd"),
                                           loss_fn=old_loss),
        "accumulate": lambda: accumulate(model, [(x, y)], old_loss),
        "AccumulatedStep": lambda: AccumulatedStep(model, 1, old_loss),
        "find_batch_size": lambda: find_batch_size(model, lambda n: torch.randn(n, DIM),
                                                   budget_bytes=2**30, device="cpu",
                                                   loss_fn=old_loss),
    }
    for name, call in calls.items():
        with pytest.raises(MemfitError, match="one argument") as exc:
            call()
        one_line_rewrite(exc)
        assert name  # each entry point refuses before running anything


def test_loss_modules_and_non_callables_are_refused() -> None:
    model, (x, _) = mlp(), batch()
    with pytest.raises(MemfitError, match="loss module"):
        memfit.estimate(model, x, loss_fn=nn.CrossEntropyLoss(), device="cpu")
    with pytest.raises(MemfitError, match="callable"):
        memfit.estimate(model, x, loss_fn="mse", device="cpu")  # type: ignore[arg-type]
    with pytest.raises(MemfitError, match="reduction"):
        accumulate(model, [batch()], mean_ce, reduction="avg")


def test_estimate_calls_loss_fn_with_model_and_batch() -> None:
    """The batch is ``inputs`` (as fake tensors of the same structure), labels included; the
    default (no loss_fn) runs ``model(*inputs)`` and reads its loss."""
    model, (x, y) = mlp(), batch()
    seen: list[tuple[type, tuple[int, ...]]] = []

    def loss_fn(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        seen.append((type(m), tuple(b[1].shape)))
        return F.cross_entropy(m(b[0]), b[1])

    est = memfit.estimate(model, (x, y), loss_fn=loss_fn, device="cpu", steps=1)
    assert seen == [(nn.Sequential, (ROWS,))]
    assert est.peak_bytes > 0

    def keyword_loss(model: nn.Module, batch: object, *, scale: float = 1.0) -> torch.Tensor:
        return scale * F.cross_entropy(model(batch[0]), batch[1])  # type: ignore[index]

    memfit.estimate(model, (x, y), loss_fn=keyword_loss, device="cpu", steps=1)


# -- parity with a plain step --------------------------------------------------------------------

@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("injected", [False, True])
def test_guard_step_equals_a_plain_step(reduction: str, injected: bool) -> None:
    expected = plain_step()
    inner = mlp()
    model: nn.Module = OomAbove(inner, rows=5) if injected else inner
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    # Uninjected: micro-batch 4 of 11 rows (4, 4, 3). Injected: 11 rows fail in the forward;
    # at 5 rows the first micro-batch's backward fails once (after part of its gradients were
    # made); the batch then runs as (2, 2, 2, 2, 2, 1).
    step = memfit.guard(model, opt, LOSSES[reduction], micro_batch_size=ROWS if injected else 4,
                        reduction=reduction, log=False)
    loss = step(batch())
    if injected:
        assert isinstance(model, OomAbove) and model.fired == 2
        assert [r.new_micro_batch_size for r in step.recoveries] == [5, 2]
    assert_weights(inner, expected)
    x, y = batch()
    assert loss == pytest.approx(F.cross_entropy(mlp()(x), y).item(), rel=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("micro", [ROWS, 4, 1])
def test_accumulate_equals_a_plain_step(reduction: str, micro: int) -> None:
    expected = plain_step()
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    result = accumulate(model, split_batch(batch(), micro), LOSSES[reduction], optimizer=opt,
                        reduction=reduction)
    assert result.num_items == ROWS
    assert_weights(model, expected)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_accumulated_step_module_equals_a_plain_step(reduction: str) -> None:
    """:class:`AccumulatedStep` (what estimate traces) gives the same gradients: 11 rows do not
    divide, so 10 rows in 2 micro-batches against a plain step on the same 10 rows."""
    model, (x, y) = mlp(), batch()
    ref = mlp()
    F.cross_entropy(ref(x[:10]), y[:10]).backward()
    AccumulatedStep(model, 2, LOSSES[reduction], reduction=reduction)(x[:10], y[:10]).backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_plan_apply_step_equals_a_plain_step(reduction: str) -> None:
    expected = plain_step()
    model = mlp()
    config = FitConfig(micro_batch=4, accumulation=3, optimizer="sgd")
    model, opt, step = apply_config(model, config, loss_fn=LOSSES[reduction],
                                    reduction=reduction, log_recoveries=False)
    for group in opt.param_groups:
        group.update(lr=LR, momentum=0.0, weight_decay=0.0)
    step(batch())
    assert_weights(model, expected)


def test_plan_apply_forwards_reduction_and_count_fn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = memfit.fit(mlp(), batch(), global_batch=ROWS, budget_bytes=2**30, device="cpu",
                          loss_fn=mean_ce, progress=False,
                          space={"precision": ["fp32"], "optimizer": ["sgd"],
                                 "checkpointing": ["none"], "micro_batch": [ROWS]})
    counted: list[int] = []

    def rows(b: tuple[torch.Tensor, torch.Tensor]) -> int:
        counted.append(b[0].shape[0])
        return b[0].shape[0]

    model, opt, step = plan.apply(mlp(), loss_fn=sum_ce, reduction="sum", count_fn=rows,
                                  log=False)
    for group in opt.param_groups:
        group.update(lr=LR, momentum=0.0, weight_decay=0.0)
    step(batch())
    assert counted  # the guard counted the batch's items with our count_fn
    assert_weights(model, plain_step())
    with pytest.raises(MemfitError, match="reduction"):
        plan.apply(mlp(), reduction="avg")
