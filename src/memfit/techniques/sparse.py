"""Sparse embedding gradients: a table's gradient holds only the rows a batch looks up.

A dense embedding gradient is as large as the table (2M rows x 16 fp32: 128 MB) however few rows
a batch touches. With ``sparse=True``, ``nn.Embedding`` and ``nn.EmbeddingBag`` return a sparse
COO gradient instead: one int64 index and one row of values per id looked up (repeats included,
uncoalesced), e.g. 16k ids x 16 fp32: 1.2 MB. The optimizer must take sparse gradients:
``torch.optim.SGD`` (no weight decay), ``torch.optim.Adagrad`` and ``torch.optim.SparseAdam``;
:class:`SparseAdamWithDense` pairs SparseAdam with Adam for a model's other parameters.

SparseAdam is not Adam: its moments (dense, full-size tensors) and its update are applied only to
the rows the batch touched; a row nobody looks up keeps moments that did not decay and gets no
update, where Adam would still move it by its decaying momentum. See docs/sparse.md.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)


DOMINANT_SHARE = 0.5
"""Embedding tables that could take sparse gradients hold at least this share of a model's
trainable parameters: their dense gradients are then most of the gradient memory."""


Table = nn.Embedding | nn.EmbeddingBag


def _eligible(model: nn.Module) -> tuple[list[tuple[str, Table]], list[tuple[str, str]]]:
    """The dense embedding tables of ``model`` that can take sparse gradients, and those that
    cannot, with why (see :func:`apply_sparse_embeddings`)."""
    owners: dict[int, int] = {}
    for mod in model.modules():
        for p in mod.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    ok: list[tuple[str, Table]] = []
    kept: list[tuple[str, str]] = []
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Embedding | nn.EmbeddingBag) or mod.sparse:
            continue
        if isinstance(mod, nn.EmbeddingBag) and mod.mode == "max":
            kept.append((name, "EmbeddingBag(mode='max') has no sparse gradient"))
        elif owners.get(id(mod.weight), 0) > 1:
            kept.append((name, "its weight is shared (tied) with another module"))
        else:
            ok.append((name, mod))
    return ok, kept


def sparse_gradient_hint(model: nn.Module) -> str | None:
    """One line suggesting sparse gradients when the embedding tables that could take them
    hold at least :data:`DOMINANT_SHARE` of ``model``'s trainable parameters, else None.

    >>> print(sparse_gradient_hint(nn.Sequential(nn.Embedding(10**6, 16), nn.Linear(16, 1))))
    embedding tables hold 100% of the trainable parameters (0): sparse gradients ...
    """
    from memfit.units import format_bytes

    tables, _ = _eligible(model)
    table_params: dict[int, torch.Tensor] = {id(m.weight): m.weight for _, m in tables
                                             if m.weight.requires_grad}
    total = sum(p.numel() for p in model.parameters() if p.requires_grad)
    size = sum(p.numel() for p in table_params.values())
    if not total or size < DOMINANT_SHARE * total:
        return None
    grad_bytes = sum(p.numel() * p.element_size() for p in table_params.values())
    names = ", ".join(name for name, _ in tables[:3]) + (", ..." if len(tables) > 3 else "")
    return (f"embedding tables hold {size / total:.0%} of the trainable parameters ({names}): "
            f"sparse gradients keep only the rows a batch looks up instead of "
            f"{format_bytes(grad_bytes)} of dense gradients: "
            f"memfit.techniques.apply_sparse_embeddings(model) with SGD, Adagrad or "
            f"SparseAdamWithDense (docs/sparse.md)")


def apply_sparse_embeddings(model: nn.Module, *, min_rows: int = 0) -> list[str]:
    """Make the embedding tables of ``model`` (with at least ``min_rows`` rows) return sparse
    gradients; return their names. In place; the math of the forward and backward is unchanged.

    Skipped, with the reason logged: ``EmbeddingBag(mode="max")`` (torch has no sparse gradient
    for it) and a table whose weight another module shares (a tied LM head's gradient is dense,
    and the sum of the two is dense too).

    >>> model = nn.Sequential(nn.Embedding(1000, 16), nn.Linear(16, 1))
    >>> apply_sparse_embeddings(model)
    ['0']
    """
    tables, kept = _eligible(model)
    for name, why in kept:
        log.info("memfit: %s kept dense: %s", name, why)
    changed: list[str] = []
    for name, mod in tables:
        if mod.num_embeddings >= min_rows:
            mod.sparse = True
            changed.append(name)
    log.info("memfit: sparse gradients for %d embedding table(s): %s", len(changed),
             ", ".join(changed) or "none")
    return changed


class SparseAdamWithDense(torch.optim.Optimizer):
    """``torch.optim.SparseAdam`` for the parameters whose gradients are sparse and
    ``torch.optim.Adam`` for the rest, stepped in that order; the split is made at the first
    step, from the gradients' layouts, so it can be built from ``model.parameters()``.

    >>> opt = SparseAdamWithDense(model.parameters(), lr=1e-3)

    Known limitations: one parameter group (the split optimizers take ``lr``, ``betas`` and
    ``eps``); ``state`` holds both optimizers' states (the same tensors) after the first step,
    but save and load ``parts``' state dicts to checkpoint.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        super().__init__(list(params), {"lr": lr, "betas": betas, "eps": eps})
        self.parts: list[torch.optim.Optimizer] = []

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if not self.parts:
            group = self.param_groups[0]
            kw = {"lr": group["lr"], "betas": group["betas"], "eps": group["eps"]}
            ps = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
            sparse = [p for p in ps if p.grad.is_sparse]
            dense = [p for p in ps if not p.grad.is_sparse]
            if sparse:
                self.parts.append(torch.optim.SparseAdam(sparse, **kw))
            if dense:
                self.parts.append(torch.optim.Adam(dense, **kw))
        for opt in self.parts:
            opt.step()
            self.state.update(opt.state)
