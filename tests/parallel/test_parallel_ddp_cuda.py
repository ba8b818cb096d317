"""DDP on a CUDA target: the first buckets stay alive beside the rebuilt ones (Note: [DDP's first
buckets on NCCL] in memfit/parallel/rank.py, measured on an H100 and an H200)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memfit
from memfit.parallel import rank


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(256, 256)
        self.b = nn.Linear(256, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))).square().mean()


def _estimate(device: str) -> memfit.Estimate:
    with torch.device("meta"):
        model = _Net()
    x = torch.randn(32, 256, device="meta")
    return memfit.estimate(model, (x,), optimizer="sgd", device=device,
                           gpu="h100-sxm-80gb" if device == "cuda" else None,
                           parallel=memfit.Parallel(gpus=2))


def test_a_cuda_target_holds_a_second_set_of_buckets(monkeypatch: pytest.MonkeyPatch) -> None:
    held = _estimate("cuda").peak_bytes
    monkeypatch.setattr(rank, "_rebuilt_buckets", lambda *args: [])
    without = _estimate("cuda").peak_bytes
    # One bucket (279,616 B < the 25 MiB cap): the fp32 parameters, 256*256 + 256 + 256*16 + 16
    # floats, in one CUDA allocator block rounded up to 512 B.
    params = 4 * (256 * 256 + 256 + 256 * 16 + 16)
    assert held - without == -(-params // 512) * 512 == 280_064


def test_a_cpu_target_keeps_one_set(monkeypatch: pytest.MonkeyPatch) -> None:
    with_hook = _estimate("cpu").peak_bytes
    monkeypatch.setattr(rank, "_rebuilt_buckets", lambda *args: pytest.fail("CPU target"))
    assert _estimate("cpu").peak_bytes == with_hook


def test_fsdp2_under_autocast_on_cuda_says_what_was_measured() -> None:
    from memfit.parallel.trace import FSDP_AUTOCAST_NOTE

    with torch.device("meta"):
        model = _Net()
    x = torch.randn(32, 256, device="meta")
    layouts = {"fsdp": memfit.Parallel(gpus=2, fsdp=2), "ddp": memfit.Parallel(gpus=2)}
    for name, parallel in layouts.items():
        for precision in ("bf16-mixed", "fp32"):
            est = memfit.estimate(model, (x,), optimizer="sgd", device="cuda",
                                  gpu="h100-sxm-80gb", precision=precision, parallel=parallel)
            said = FSDP_AUTOCAST_NOTE in est.assumptions
            assert said == (name == "fsdp" and precision == "bf16-mixed"), (name, precision)
            assert len(est.per_rank) >= 1
