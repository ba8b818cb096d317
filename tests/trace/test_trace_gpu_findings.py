"""What the first GPU validation (H100, torch 2.11; bench/results/validate-h100-2026-11-27*.json)
found, checked on the CPU: a user-built torch optimizer on a CUDA target takes the implementation
torch picks for real CUDA parameters (foreach; Note: [torch's default optimizer implementation on
CUDA] in ``memfit/trace/optim.py``), and an estimate with convolutions says what it leaves out."""

from __future__ import annotations

import torch
from torch import nn

import memfit

WIDTH, LAYERS = 1024, 4
P = LAYERS * WIDTH * WIDTH * 4  # fp32 parameter bytes, no biases: 16 MiB
MiB = 1 << 20
WORKSPACES = 2 * 32 * MiB


def _net() -> tuple[nn.Module, tuple[torch.Tensor]]:
    with torch.device("meta"):
        net = nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)))
    return net, (torch.empty(2, WIDTH, device="meta"),)


def _peak(optimizer) -> int:
    net, batch = _net()
    return memfit.estimate(net, batch, optimizer=optimizer, device="cuda", gpu="h100-sxm-80gb",
                           loss_fn=lambda m, b: m(*b).sum()).peak_bytes


def test_user_built_adamw_is_traced_as_foreach_on_cuda() -> None:
    # AdamW's foreach step (torch/optim/adam.py: _multi_tensor_adam) holds weights, gradients,
    # exp_avg, exp_avg_sq and _foreach_sqrt's output for every parameter at once: 5 P. Beside
    # them: two cuBLAS workspaces of 32 MiB (Hopper; one per handle and stream, the forward's
    # thread and autograd's device thread; measured on an H100, bench/results/cuda-facts-*) and
    # the activations of two rows (a few KiB).
    user = _peak(lambda ps: torch.optim.AdamW(ps, lr=1e-4))
    assert 5 * P + WORKSPACES <= user <= 5 * P + WORKSPACES + MiB, (user - WORKSPACES) / P
    assert user == _peak("adamw")


def test_an_explicit_for_loop_choice_is_kept() -> None:
    # foreach=False: the for-loop's temporaries (sqrt, the division) are one parameter's at a
    # time (4 MiB each), so the step stays under foreach's 5 P.
    loop = _peak(lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=False))
    assert 4 * P + WORKSPACES < loop < 5 * P + WORKSPACES, (loop - WORKSPACES) / P


def test_a_convolution_on_a_cuda_target_says_what_is_not_modelled() -> None:
    # The first GPU validation found conv nets 4-16% above the trace (cuDNN workspaces among
    # the causes): an estimate with a convolution says so; one without does not.
    from memfit.trace.result import CONV_NOTE

    with torch.device("meta"):
        conv = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.LazyLinear(4))
        conv(torch.empty(1, 3, 8, 8))  # materialise the lazy layer's shape
    est = memfit.estimate(conv, (torch.empty(2, 3, 8, 8, device="meta"),), device="cuda",
                          gpu="h100-sxm-80gb", loss_fn=lambda m, b: m(*b).sum())
    assert CONV_NOTE in est.assumptions
    net, batch = _net()
    plain = memfit.estimate(net, batch, device="cuda", gpu="h100-sxm-80gb",
                            loss_fn=lambda m, b: m(*b).sum())
    assert CONV_NOTE not in plain.assumptions
