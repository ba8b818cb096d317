"""Applying sharded fit plans (ZeRO-1 with DDP + ZeroRedundancyOptimizer, ZeRO-2/3 with FSDP2)
on one gloo rank: the training step is the unsharded one, bit for bit."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from _models import ReluBlock
from memfit.errors import MemfitError
from memfit.fitting import FitConfig
from memfit.fitting.apply import apply_config

D, C = 16, 4


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[ReluBlock(D) for _ in range(3)])
        self.head = nn.Linear(D, C)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.head(self.blocks(x)), y)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, D, generator=g), torch.randint(0, C, (8,), generator=g)


def config(sharding: str, optimizer: str = "adamw") -> FitConfig:
    return FitConfig(precision="fp32", checkpointing="full", micro_batch=4, accumulation=2,
                     optimizer=optimizer, sharding=sharding)


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@pytest.fixture
def one_rank() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def train(sharding: str, steps: int = 2) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _, step = apply_config(model, config(sharding), num_gpus=1, log_recoveries=False)
        for _ in range(steps):
            step(batch())
    inner = getattr(model, "module", model)  # DDP wraps; FSDP2 shards in place
    return {name: full(p.detach()).clone() for name, p in inner.named_parameters()}


@pytest.mark.slow
def test_sharded_plans_train_like_the_unsharded_one(one_rank: None) -> None:
    pytest.importorskip("torch.distributed.fsdp", reason="needs FSDP2 (torch >= 2.6)")
    want = train("none")
    for sharding in ("zero1", "zero2", "zero3"):
        got = train(sharding)
        assert got.keys() == want.keys(), sharding
        for name in want:
            assert torch.equal(got[name], want[name]), (sharding, name)


def test_sharded_plan_wraps_the_model(one_rank: None) -> None:
    pytest.importorskip("torch.distributed.fsdp", reason="needs FSDP2 (torch >= 2.6)")
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    model, opt, _ = apply_config(Net(), config("zero1"), num_gpus=1, log_recoveries=False)
    assert isinstance(model, DistributedDataParallel)
    assert isinstance(opt, ZeroRedundancyOptimizer)
    model, opt, _ = apply_config(Net(), config("zero3"), num_gpus=1, log_recoveries=False)
    assert type(model).__name__.startswith("FSDP")  # fully_shard's dynamic class
    assert all(type(model.blocks[i]).__name__.startswith("FSDP") for i in range(3))


def test_sharded_plan_errors(one_rank: None) -> None:
    with pytest.raises(MemfitError, match=r"searched for 2 GPUs but torch\.distributed has 1"):
        apply_config(Net(), config("zero3"), num_gpus=2)
    with pytest.raises(MemfitError, match="needs whole parameters on one device"):
        apply_config(Net(), config("zero2", optimizer="adamw-8bit"), num_gpus=1)


def test_sharded_plan_without_distributed_says_how_to_launch() -> None:
    with pytest.raises(MemfitError, match="torchrun --nproc-per-node 2"):
        apply_config(copy.deepcopy(Net()), config("zero3"), num_gpus=2)


def test_guard_does_not_retry_an_oom_under_fsdp_with_several_ranks(
        one_rank: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # One rank cannot rerun a batch alone under FSDP (the others would wait in its all-gathers):
    # the guard says so instead of retrying. A second rank is pretended (the check reads the
    # world size); with one real rank a retry would be safe.
    pytest.importorskip("torch.distributed.fsdp", reason="needs FSDP2 (torch >= 2.6)")
    from memfit.oom_guard import guard

    torch.manual_seed(0)
    model, _, _ = apply_config(Net(), config("zero3"), num_gpus=1, log_recoveries=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss_fn(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if b[0].shape[0] > 2:
            raise torch.OutOfMemoryError("injected")
        return m(*b) * b[0].shape[0]

    step = guard(model, opt, loss_fn, micro_batch_size=8, log=False, reduction="sum")
    monkeypatch.setattr(dist, "get_world_size", lambda *args, **kwargs: 2)
    with pytest.raises(torch.OutOfMemoryError, match="under FSDP with 2 ranks"):
        step(batch())
    monkeypatch.undo()
    assert step(batch()) > 0  # one real rank: the guard retries at micro-batch 2
    assert step.history == [2]
