"""``apply_sparse_embeddings`` and ``SparseAdamWithDense`` (memfit.techniques.sparse)."""

from __future__ import annotations

import torch
from torch import nn

from memfit.techniques import SparseAdamWithDense, apply_sparse_embeddings


class Tables(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.items = nn.Embedding(1000, 8)
        self.small = nn.Embedding(10, 8)
        self.bag = nn.EmbeddingBag(500, 8, mode="sum")
        self.maxbag = nn.EmbeddingBag(500, 8, mode="max")
        self.words = nn.Embedding(50, 8)
        self.head = nn.Linear(8, 50, bias=False)
        self.head.weight = self.words.weight  # tied: its gradient is dense

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.items(ids).sum(1) + self.bag(ids % 500) + self.maxbag(ids % 500)
        return self.head(x + self.words(ids % 50).sum(1) + self.small(ids % 10).sum(1))


def test_apply_sparse_embeddings_skips_max_bags_tied_and_small_tables() -> None:
    model = Tables()
    assert apply_sparse_embeddings(model, min_rows=100) == ["items", "bag"]
    assert model.items.sparse and model.bag.sparse
    assert not (model.small.sparse or model.maxbag.sparse or model.words.sparse)
    model(torch.randint(0, 1000, (4, 3))).sum().backward()
    assert model.items.weight.grad.is_sparse and model.bag.weight.grad.is_sparse
    assert not model.words.weight.grad.is_sparse
    before = Tables()
    assert apply_sparse_embeddings(before) == ["items", "small", "bag"]


def test_sparse_adam_with_dense_is_sparse_adam_plus_adam() -> None:
    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Embedding(100, 8, sparse=True), nn.Flatten(), nn.Linear(32, 1))

    ours, ref = make(), make()
    opt = SparseAdamWithDense(ours.parameters(), lr=0.01)
    ref_opts = [torch.optim.SparseAdam([ref[0].weight], lr=0.01),
                torch.optim.Adam(list(ref[2].parameters()), lr=0.01)]
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, 100, (16, 4), generator=g)
        for model in (ours, ref):
            model(ids).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        for o in ref_opts:
            o.step()
            o.zero_grad(set_to_none=True)
    for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)
    # SparseAdam's moments are dense and as large as the table (torch/optim/sparse_adam.py:
    # torch.zeros_like(p, memory_format=torch.preserve_format)).
    state = opt.state[ours[0].weight]
    for key in ("exp_avg", "exp_avg_sq"):
        assert state[key].layout is torch.strided and state[key].shape == (100, 8)


def test_sparse_adam_moves_only_touched_rows() -> None:
    # Lazy semantics: a row not looked up this step keeps its value (Adam would move it by its
    # decaying momentum).
    torch.manual_seed(0)
    table = nn.Embedding(10, 4, sparse=True)
    opt = SparseAdamWithDense(table.parameters(), lr=0.1)
    table(torch.tensor([0, 1])).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    row1 = table.weight[1].detach().clone()
    table(torch.tensor([0])).sum().backward()
    opt.step()
    assert torch.equal(table.weight[1], row1)


def test_sparse_gradient_hint_only_where_tables_dominate() -> None:
    from memfit.techniques.sparse import sparse_gradient_hint

    # 100k x 16 = 1.6M table parameters against a 129-parameter head: 100% (rounded); dense
    # gradients of the table: 1.6M x 4 bytes = 6.10 MiB.
    rec = nn.Sequential(nn.Embedding(100_000, 16), nn.Flatten(), nn.Linear(128, 1))
    hint = sparse_gradient_hint(rec)
    assert hint is not None and "100%" in hint and "6.10 MiB" in hint
    assert "apply_sparse_embeddings" in hint
    # 1000 x 16 = 16k table parameters against 64 x 1024 + 1024 = 66.6k: 19%, no hint.
    small = nn.Sequential(nn.Embedding(1000, 16), nn.Linear(16, 64), nn.Linear(64, 1024))
    assert sparse_gradient_hint(small) is None
    # Already sparse, or tied to a head: nothing to offer.
    apply_sparse_embeddings(rec)
    assert sparse_gradient_hint(rec) is None
    assert sparse_gradient_hint(Tables()) is not None  # items and bag qualify, words does not
