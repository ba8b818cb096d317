"""Technique 5, gradient accumulation: exact large-batch gradients, measured and predicted peak."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memfit.errors import MemfitError
from memfit.profiling import measure_cpu_peak
from memfit.techniques.accumulation import (
    AccumulatedStep,
    accumulate,
    count_tokens,
    split_batch,
)
from memfit.trace import estimate

VOCAB, DIM, BATCH, SEQ, K = 50, 16, 8, 12, 4


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.mix = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.emb(ids))))


def lm_batch() -> dict[str, torch.Tensor]:
    """Labels with a different number of ignored tokens in every micro-batch (rows 2i, 2i+1)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    for row in range(BATCH):
        labels[row, SEQ - 1 - row:] = -100  # row r ignores its last r + 1 tokens
    return {"ids": ids, "labels": labels}


def sum_ce(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(batch["ids"])
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum",
                           ignore_index=-100)


def tokens(batch: dict[str, torch.Tensor]) -> int:
    return count_tokens(batch["labels"])


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


def full_batch_grads(batch: dict[str, torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
    torch.manual_seed(0)
    model = TinyLM()
    logits = model(batch["ids"])
    loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
    loss.backward()
    return grads(model), loss.detach()


# -- exactness --------------------------------------------------------------------------------

def test_accumulated_gradients_equal_full_batch() -> None:
    batch = lm_batch()
    expected, expected_loss = full_batch_grads(batch)
    torch.manual_seed(0)
    model = TinyLM()
    result = accumulate(model, split_batch(batch, BATCH // K), sum_ce, count_fn=tokens,
                        reduction="sum")
    assert result.num_items == count_tokens(batch["labels"]) == BATCH * SEQ - sum(
        r + 1 for r in range(BATCH))
    # fp32; the full batch sums all token gradients in one reduction, accumulation adds K
    # partial sums into .grad: equal up to summation order, a few ulps of |grad| (<= ~0.1).
    for got, want in zip(grads(model), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(result.loss, expected_loss, rtol=1e-6, atol=0)


def test_per_micro_batch_mean_would_be_wrong() -> None:
    """The check above can fail: the common (mean / K) recipe differs measurably here."""
    batch = lm_batch()
    expected, _ = full_batch_grads(batch)
    torch.manual_seed(0)
    model = TinyLM()
    for part in split_batch(batch, BATCH // K):
        (sum_ce(model, part) / tokens(part) / K).backward()
    worst = max(((g - e).abs().max() / e.abs().max()).item()
                for g, e in zip(grads(model), expected, strict=True))
    assert worst > 1e-3


def test_accumulate_in_float64_is_exact_to_fp64_rounding() -> None:
    batch = lm_batch()
    torch.manual_seed(0)
    ref = TinyLM().double()
    F.cross_entropy(ref(batch["ids"]).flatten(0, 1), batch["labels"].flatten()).backward()
    torch.manual_seed(0)
    model = TinyLM().double()
    accumulate(model, split_batch(batch, 1), sum_ce, count_fn=tokens, reduction="sum")
    for got, want in zip(grads(model), grads(ref), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-15)


def test_optimizer_steps_once_and_zeroes() -> None:
    torch.manual_seed(0)
    model = TinyLM()
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    accumulate(model, split_batch(lm_batch(), 2), sum_ce, count_fn=tokens, optimizer=opt,
               reduction="sum")
    assert all(p.grad is None for p in model.parameters())
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


# -- no_sync ----------------------------------------------------------------------------------

class RecordingDDP(nn.Module):
    """Stands in for DDP: records whether each backward ran inside no_sync()."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.in_no_sync = False
        self.synced: list[bool] = []

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.in_no_sync = True
        try:
            yield
        finally:
            self.in_no_sync = False

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.module(ids)
        out.register_hook(lambda g: self.synced.append(not self.in_no_sync))
        return out


def test_no_sync_for_all_but_the_last_micro_batch() -> None:
    torch.manual_seed(0)
    model = RecordingDDP(TinyLM())
    accumulate(model, split_batch(lm_batch(), BATCH // K), sum_ce, count_fn=tokens, reduction="sum")
    assert model.synced == [False] * (K - 1) + [True]


def test_real_ddp_single_process_matches() -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    batch = lm_batch()
    expected, _ = full_batch_grads(batch)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = DDP(TinyLM())
        accumulate(model, split_batch(batch, BATCH // K), sum_ce, count_fn=tokens, reduction="sum")
        for got, want in zip(grads(model), expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    finally:
        dist.destroy_process_group()


# -- measured and predicted effect -------------------------------------------------------------

D, H, B = 64, 1024, 512


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, H), nn.GELU(), nn.Linear(H, D))


def sq_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    # (out - y)^2 summed; not F.mse_loss, whose CPU backward temporary the trace engine misses.
    x, y = batch
    return (model(x) - y).pow(2).sum()


def xy() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randn(B, D, generator=g), torch.randn(B, D, generator=g)


def measured(k: int) -> int:
    model, (x, y) = mlp(), xy()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        for _ in range(2):
            accumulate(model, split_batch((x, y), B // k), sq_loss, optimizer=opt,
                       reduction="sum")

    gc.collect()  # garbage of earlier tests freed inside the measurement would count
    return measure_cpu_peak(step, model, x, y).peak_bytes


def test_accumulation_cuts_activation_peak() -> None:
    full, micro = measured(1), measured(K)
    # Saved per row for backward: the first Linear's output (GELU input) and the GELU output,
    # H fp32 values each = 8 KiB/row, plus the loss's (out - y) at D values. The full batch
    # keeps B rows, a micro-batch B/K: the peak drops by at least (1 - 1/K) * B * 2H * 4 B
    # (3 MiB here) minus one micro-batch's gradient of the weights (0.5 MiB, live earlier).
    saved_per_row = 2 * H * 4
    weights = (D * H + H + H * D + D) * 4
    assert full - micro >= (1 - 1 / K) * B * saved_per_row - weights


@pytest.mark.parametrize("k", [1, K])
def test_estimate_predicts_accumulation(k: int) -> None:
    model, (x, y) = mlp(), xy()
    est = estimate(AccumulatedStep(model, k, sq_loss, reduction="sum"), (x, y), device="cpu",
                   steps=2, optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3))
    real = measured(k)
    assert abs(est.peak_bytes - real) <= 0.01 * real, (est.peak_bytes, real)


# -- errors -----------------------------------------------------------------------------------

def test_errors() -> None:
    model = TinyLM()
    with pytest.raises(MemfitError, match="no micro-batches"):
        accumulate(model, [], sum_ce, reduction="sum")
    with pytest.raises(MemfitError, match="no items"):
        empty = {"ids": torch.zeros(2, 3, dtype=torch.long),
                 "labels": torch.full((2, 3), -100)}
        accumulate(model, [empty], sum_ce, count_fn=tokens, reduction="sum")
    with pytest.raises(MemfitError, match="positive integer"):
        split_batch(torch.zeros(4), 0)
    with pytest.raises(MemfitError, match="different first dimensions"):
        split_batch((torch.zeros(4), torch.zeros(6)), 2)
    with pytest.raises(MemfitError, match="scalar"):
        accumulate(model, [lm_batch()], lambda m, b: m(b["ids"]), count_fn=tokens)


class RecordingFSDP2(nn.Module):
    """Stands in for an FSDP2 (fully_shard) module: gradient sync toggled by a setter."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.sync = True
        self.synced: list[bool] = []

    def set_requires_gradient_sync(self, requires: bool) -> None:
        self.sync = requires

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.module(ids)
        out.register_hook(lambda g: self.synced.append(self.sync))
        return out


def test_fsdp2_gradient_sync_toggled() -> None:
    torch.manual_seed(0)
    model = RecordingFSDP2(TinyLM())
    accumulate(model, split_batch(lm_batch(), BATCH // K), sum_ce, count_fn=tokens, reduction="sum")
    assert model.synced == [False] * (K - 1) + [True]
    assert model.sync  # restored
