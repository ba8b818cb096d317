"""``fit`` suggests sparse embedding gradients where embedding tables dominate the model."""

from __future__ import annotations

import torch
from torch import nn

import memfit
from memfit.fitting.plan import Plan


class Lookup(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(100_000, 16)
        self.head = nn.Linear(16 * 8, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.table(ids).flatten(1)).pow(2).mean()


def test_fit_suggests_sparse_gradients_and_the_plan_keeps_it() -> None:
    plan = memfit.fit(Lookup(), torch.randint(0, 100_000, (4, 8)), optimizer="sgd",
                      global_batch=8, budget_bytes=2**30, device="cpu",
                      loss_fn=lambda m, b: m(b), progress=False,
                      space={"precision": ["fp32"], "checkpointing": ["none"]},
                      rates={"flops": 1e10, "bandwidth": 1e10, "launch_s": 1e-5})
    assert len(plan.suggestions) == 1 and "apply_sparse_embeddings" in plan.suggestions[0]
    assert "suggestion: embedding tables hold" in plan.render(width=200)
    assert Plan.from_dict(plan.to_dict()).suggestions == plan.suggestions
