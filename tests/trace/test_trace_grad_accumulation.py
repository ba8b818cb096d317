"""Autograd's engine sums two gradients of one input in place when it holds the only reference
(``input_buffer.cpp``: ``accumulate``); the tracer models it (:mod:`memfit.trace.grad_accumulation`)
only if it recognises the engine's own call across its dispatch frames."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import memfit.trace.tracker as tracker
from memfit.trace import estimate
from memfit.trace.grad_accumulation import ADD, ADD_


class TwoUses(nn.Module):
    """``y`` feeds two ops, so its gradient is the engine's sum of two fresh gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y * 2 + y.sin()


def test_the_engines_gradient_sum_is_traced_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    chosen: list[Any] = []
    real = tracker.gradient_accumulation

    def recording(args: Any) -> tuple[Any, Any]:
        func, new_args = real(args)
        chosen.append(func)
        return func, new_args

    monkeypatch.setattr(tracker, "gradient_accumulation", recording)
    estimate(TwoUses(), (torch.randn(8, 32),), optimizer="sgd", device="cpu", steps=1)
    assert ADD_ in chosen, chosen  # the sum of y's two gradients reuses one of them
    assert set(chosen) <= {ADD, ADD_}
