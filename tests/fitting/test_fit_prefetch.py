"""memfit.fit(prefetch_batches=): each candidate's peak counts the DevicePrefetcher's batches."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from _models import ReluBlock
from memfit.fitting import fit

D, T, C = 32, 64, 8


class SeqNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(ReluBlock(D), ReluBlock(D))
        self.head = nn.Linear(D, C)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.head(self.blocks(x)).flatten(0, 1), y.flatten())


def test_each_candidate_counts_depth_micro_batches() -> None:
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = SeqNet()
    batch = (torch.randn(8, T, D), torch.randint(0, C, (8, T)))
    row = T * D * 4 + T * 8  # one sample by hand: fp32 x (T x D) and int64 y (T)
    space = {"precision": ["fp32"], "checkpointing": ["none"]}
    plain = fit(model, batch, global_batch=8, budget_bytes=2**30, device="cpu", space=space,
                progress=False)
    ahead = fit(model, batch, global_batch=8, budget_bytes=2**30, device="cpu", space=space,
                progress=False, prefetch_batches=2)
    before = {c.config.label(): c for c in (plain.chosen, *plain.runners_up)}
    after = (ahead.chosen, *ahead.runners_up)
    assert before and all(c.config.label() in before for c in after)
    for c in after:
        m = c.config.micro_batch
        assert c.peak_bytes - before[c.config.label()].peak_bytes == 2 * m * row, c.config
    assert ahead.peak_bytes - plain.peak_bytes == 2 * ahead.config.micro_batch * row
