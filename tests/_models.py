"""Tiny models shared by several test files (one definition, not one per file)."""

from __future__ import annotations

import torch
from torch import nn


class MlpBlock(nn.Module):
    """A pre-norm GELU MLP block with a residual."""

    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


class Classifier(nn.Module):
    """Issue 20's classifier (there: inp 128, width 512, hidden 2048, 3 blocks, 100 classes):
    ``inp``, pre-norm GELU MLP blocks, ``head``, and its own cross-entropy as the output."""

    def __init__(self, inp: int, d: int, h: int, blocks: int, classes: int) -> None:
        super().__init__()
        self.inp = nn.Linear(inp, d)
        self.blocks = nn.ModuleList(MlpBlock(d, h) for _ in range(blocks))
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return nn.functional.cross_entropy(self.head(h), y)
