"""The custom decoder of the tensor-parallel plan tests: its attention projections are named
``q``, ``k``, ``v``, ``proj`` and its MLP ``fc1`` / ``fc2`` (GPT-2 / nanoGPT style), so memfit's
projection names find nothing and the user's plan is the only one (tests/parallel/
test_parallel_tp_plan.py, test_parallel_tp_plan_pp.py, tests/fitting/test_fit_tp_plan.py)."""

from __future__ import annotations

import torch
from torch import nn

PLAN = {"blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise",
        "blocks.*.attn.v": "colwise", "blocks.*.attn.proj": "rowwise",
        "blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"}
"""Megatron's split on the custom names."""
PLAN_ROOT = {**PLAN, "emb": "embedding_rowwise", "head": "colwise_rep"}
"""Also the vocabulary-split embedding and head (transformers' spellings)."""


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        # The key's bias adds q.b to every score of a row, which softmax ignores: its gradient
        # is 0 up to rounding, which AdamW would scale to a full step of noise (no bias, as
        # Llama's attention has none).
        self.q, self.v = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape  # the local heads: -1 (a rank's q has heads / tp of them)
        q, k, v = (m(x).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for m in (self.q, self.k, self.v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))


class CustomDecoder(nn.Module):
    """Embedding, 2 blocks, head; ``forward(input_ids, labels)`` returns the cross-entropy, or,
    with ``logits=True``, ``forward(input_ids)`` the logits (a model split into stages)."""

    def __init__(self, vocab: int, hidden: int, heads: int, *, logits: bool = False) -> None:
        super().__init__()
        self.logits = logits
        self.emb = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(2))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, input_ids: torch.Tensor,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.emb(input_ids)
        for block in self.blocks:
            x = block(x)
        if self.logits:
            return self.head(x)
        assert labels is not None
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())
