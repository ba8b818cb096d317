"""``fit`` says what a pruned model's weights cost (``torch.nn.utils.prune`` keeps the original
weight, a mask and the recomputed weight)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import prune

import memfit
from memfit.units import format_bytes


def test_fit_notes_the_cost_of_pruning() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 1))
    prune.l1_unstructured(model[0], "weight", amount=0.5)
    plan = memfit.fit(model, torch.randn(4, 64), optimizer="sgd", global_batch=8,
                      budget_bytes=2**30, device="cpu", loss_fn=lambda m, b: m(b).pow(2).mean(),
                      progress=False, space={"precision": ["fp32"], "checkpointing": ["none"]},
                      rates={"flops": 1e10, "bandwidth": 1e10, "launch_s": 1e-5})
    [hint] = [s for s in plan.suggestions if "torch.nn.utils.prune" in s]
    # the mask and the recomputed weight: two fp32 64 x 128 tensors
    assert f"+{format_bytes(2 * 4 * 64 * 128)} held vs unpruned" in hint
    assert "sparsify" in " ".join(plan.render(width=200).split())
