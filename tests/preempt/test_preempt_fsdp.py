"""memfit.preemptible under FSDP2 (2 gloo ranks on the CPU): sharded DCP checkpoints, a SIGTERM
seen by one rank stops both at the same step, and the resumed run (saving asynchronously) ends
with an uninterrupted run's weights bit for bit."""

from __future__ import annotations

import os
import signal
import tempfile
from pathlib import Path

import torch
from torch import nn

from memfit.parallel.gloo import spawn

STEPS, STOP_AT = 6, 3


def _make(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.3), nn.Tanh(), nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (2,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[3], mesh=mesh)
    fully_shard(model, mesh=mesh)
    torch.manual_seed(100 + rank)  # each rank its own data and dropout: per-rank RNG state
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor().clone() for k, v in model.state_dict().items()}


def _run(rank: int, world: int, ckpt: str, out: str) -> None:
    import memfit

    model, opt = _make(rank)
    code = None
    try:
        with memfit.preemptible(ckpt, model=model, optimizer=opt, every_steps=2) as p:
            for _ in range(p.step, STEPS):
                if rank == 0 and p.step + 1 == STOP_AT:  # preempted mid-step, on rank 0 only
                    os.kill(os.getpid(), signal.SIGTERM)
                _step(model, opt)
                p.end_step()
    except SystemExit as exc:
        code = exc.code
    assert code == 143 and p.step == STOP_AT, (code, p.step)
    saved = Path(ckpt, f"step-{STOP_AT:09d}")
    assert sorted(f.name for f in saved.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]

    model, opt = _make(rank)
    with memfit.preemptible(ckpt, model=model, optimizer=opt, every_steps=2,
                            async_save=True) as p:
        assert p.step == STOP_AT
        for _ in range(p.step, STEPS):
            _step(model, opt)
            p.end_step()
    resumed = _full(model)

    model, opt = _make(rank)  # a second resume, from the last asynchronous save
    with memfit.preemptible(ckpt, model=model, optimizer=opt) as p:
        assert p.step == STEPS
    reloaded = _full(model)

    model, opt = _make(rank)
    for _ in range(STEPS):
        _step(model, opt)
    reference = _full(model)
    for name, value in reference.items():
        assert torch.equal(resumed[name], value), name
        assert torch.equal(reloaded[name], value), name
    Path(out, str(rank)).write_text("ok")


def test_fsdp2_preempted_and_resumed_is_bit_exact() -> None:
    with tempfile.TemporaryDirectory() as ckpt, tempfile.TemporaryDirectory() as out:
        spawn(_run, 2, ckpt, out)
        assert [Path(out, str(r)).read_text() for r in range(2)] == ["ok", "ok"]
