"""Tiny models shared by several test files (one definition, not one per file).

The blocks build their submodules in a fixed order, so a seeded model has the same weights in
every file that uses it. Blocks still defined in a test file differ in what they run (another
forward, another signature), not only in their sizes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    """A pre-norm GPT block: causal SDPA attention over ``heads`` heads, then a GELU MLP of
    width ``4 * dim``, each added to the residual (through ``dropout``, if not 0)."""

    def __init__(self, dim: int = 64, heads: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, s, d)))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class TinyGPT(nn.Module):
    """The tiny decoder: an embedding, ``layers`` blocks (:class:`Block`), a final LayerNorm and a
    bias-free head over ``vocab`` tokens (``tied``: the head is the embedding's weight;
    ``ckpt``: each block under ``torch.utils.checkpoint``, non-reentrant)."""

    def __init__(self, layers: int = 4, *, vocab: int = 256, dim: int = 64, heads: int = 4,
                 dropout: float = 0.0, tied: bool = False, ckpt: bool = False) -> None:
        super().__init__()
        self.ckpt = ckpt
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.ckpt else block(x)
        return self.head(self.ln(x))


class ReluBlock(nn.Module):
    """``x + down(relu(up(x)))``, ``up`` from ``dim`` to ``4 * dim``: a residual ReLU MLP with no
    norm (few parameters, activations of batch x 4 * dim)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class MlpBlock(nn.Module):
    """A pre-norm GELU MLP block with a residual (through ``dropout``, if not 0)."""

    def __init__(self, d: int, h: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, h), nn.Linear(h, d)
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(nn.functional.gelu(self.fc1(self.norm(x)))))


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


class CustomBlock(nn.Module):
    """``x + fc2(gelu(fc1(ln(x))))``, ``fc1`` from ``dim`` to ``hidden``: a pre-norm GELU MLP
    block whose names (``ln``, ``fc1``, ``fc2``) are in none of memfit's lists."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class CustomDecoder(nn.Module):
    """A custom decoder, its names in none of memfit's lists, as a pipeline split at named
    submodules takes it (``Parallel(pp_split_points=...)``): an embedding ``tok``, a ModuleList
    ``blocks`` of ``layers`` :class:`CustomBlock` that the forward iterates, a LayerNorm
    ``ln_f`` and a bias-free head ``out`` over ``vocab`` tokens."""

    def __init__(self, layers: int, *, dim: int, hidden: int, vocab: int = 256) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(CustomBlock(dim, hidden) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        for block in self.blocks:
            x = block(x)
        return self.out(self.ln_f(x))


class MoEBlock(nn.Module):
    """``x + moe(ln(x))``: a pre-norm residual block around memfit's builtin MoE
    (``memfit.models.builtin_layers.MoE``: ``experts`` SwiGLU experts of width ``2 * dim``,
    top 2, capacity factor 1.0), its weights drawn from N(0, 0.02)."""

    def __init__(self, dim: int, experts: int) -> None:
        import dataclasses

        from memfit.models.builtin_layers import MoE
        from memfit.parallel.measure import tiny_moe_spec

        super().__init__()
        spec = dataclasses.replace(tiny_moe_spec(1, experts), hidden_size=dim,
                                   intermediate_size=2 * dim)
        self.ln = nn.LayerNorm(dim)
        self.moe = MoE(spec, 1.0)
        for p in self.moe.parameters():
            nn.init.normal_(p, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.ln(x))


class CustomMoE(nn.Module):
    """A custom mixture-of-experts decoder (names in none of memfit's lists): an embedding
    ``tok``, a ModuleList ``blocks`` of ``layers`` :class:`MoEBlock`, a LayerNorm ``ln_f`` and a
    bias-free head ``out``; ``forward(ids)`` returns the logits (``labels`` ignored: fit calls
    ``model(**batch)``)."""

    def __init__(self, layers: int, *, dim: int = 64, vocab: int = 256,
                 experts: int = 4) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(MoEBlock(dim, experts) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.tok(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.out(self.ln_f(x))
