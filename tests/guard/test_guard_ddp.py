"""The OOM guard under DDP with two real processes (gloo on the CPU): an OOM on one rank makes
every rank retry the same batch at the same micro-batch size, and nobody hangs.

Note: [OOM agreement under DDP] in memfit/oom_guard/__init__.py.
"""

from __future__ import annotations

import datetime
import os
import sys
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

WORLD, BATCH, D, STEPS = 2, 8, 16, 3


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 1))


def rank_batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(BATCH, D, generator=g), torch.randn(BATCH, 1, generator=g))
            for _ in range(STEPS)]


def sum_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return (model(x) - y).pow(2).sum()


def worker(rank: int, store_path: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    code = 0
    try:
        scenarios(rank, out_dir)
        dist.barrier()  # both ranks are done before either tears its process group down
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        # No interpreter teardown: gloo's background threads can make it abort (std::terminate)
        # after the work is done; the exit code says how the work went.
        os._exit(code)


def scenarios(rank: int, out_dir: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from memfit.oom_guard import guard

    for scenario in ("oom", "error"):
        model = DDP(make_model())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def loss_fn(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
                    scenario: str = scenario) -> torch.Tensor:
            # rank 1 "runs out of memory" on micro-batches larger than 2 (before its
            # forward: it misses whatever collective the forward would make)
            if scenario == "oom" and rank == 1 and batch[0].shape[0] > 2:
                raise torch.OutOfMemoryError("injected")
            if scenario == "error" and rank == 1:
                raise ValueError("injected bug")
            return sum_loss(m, batch)

        step = guard(model, opt, loss_fn, micro_batch_size=BATCH, log=False, reduction="sum")
        try:
            for batch in rank_batches(rank):
                step(batch)
        except (RuntimeError, ValueError) as exc:
            Path(out_dir, f"{scenario}-error{rank}.txt").write_text(
                f"{type(exc).__name__}: {exc}")
            continue
        state = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
        torch.save({"state": state, "history": step.history,
                    "reasons": [r.reason for r in step.recoveries]},
                   Path(out_dir, f"{scenario}-rank{rank}.pt"))


def reference() -> dict[str, torch.Tensor]:
    """One process, both ranks' batches, SGD on the global batch's mean loss. BatchNorm in
    training mode normalises each micro-batch by its own statistics, so the reference runs the
    micro-batches of 2 that both ranks end with; the running statistics are rank 0's (DDP
    broadcasts its buffers from rank 0): rank 1's micro-batches run first, and the buffers are
    put back before rank 0's."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    per_rank = [rank_batches(r) for r in range(WORLD)]
    for s in range(STEPS):
        before = {name: b.clone() for name, b in model.named_buffers()}
        for r in (1, 0):
            with torch.no_grad():
                for name, b in model.named_buffers():
                    b.copy_(before[name])
            x, y = per_rank[r][s]
            for i in range(0, BATCH, 2):
                sum_loss(model, (x[i:i + 2], y[i:i + 2])).div(WORLD * BATCH).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_ranks_agree_on_recovery_and_on_errors(tmp_path: Path) -> None:
    ctx = mp.start_processes(worker, args=(str(tmp_path / "store"), str(tmp_path)),
                             nprocs=WORLD, join=False, start_method="spawn")
    while not ctx.join(timeout=120):
        pass
    results = [torch.load(tmp_path / f"oom-rank{r}.pt") for r in range(WORLD)]
    # An OOM on rank 1 only: both ranks go 8 -> 4 -> 2 in the first step and stay there.
    for r, res in enumerate(results):
        assert res["history"] == [2] * STEPS, r
    assert results[1]["reasons"] == ["oom", "oom"]
    assert results[0]["reasons"] == ["oom-other-rank", "oom-other-rank"]
    # The weights are the same on both ranks, and equal to one process over the global batch
    # (to summation order); rank 0's buffers are the reference's (rank 1's are replaced by
    # rank 0's before the next batch, as DDP does before the next forward).
    want = reference()
    params = {name for name, _ in make_model().named_parameters()}
    for key in want:
        if key in params:
            assert torch.equal(results[0]["state"][key], results[1]["state"][key]), key
        torch.testing.assert_close(results[0]["state"][key], want[key], rtol=1e-5, atol=1e-6)
    # Another error on rank 1: rank 0 raises too instead of waiting for it forever.
    assert "ValueError: injected bug" in (tmp_path / "error-error1.txt").read_text()
    assert "another rank raised an error" in (tmp_path / "error-error0.txt").read_text()
