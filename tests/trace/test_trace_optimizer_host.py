"""AdamW's step counters on a CUDA target: host memory unless the group is fused
(Note: [optimizer step counters on the host] in ``memfit/trace/step.py``).

Expected values by hand: AdamW's two fp32 moments are 8 B per parameter; a fused group's 20
counters are 512-byte device blocks; a foreach group's are 4-byte host scalars, plus the 1.0
that ``_multi_tensor_adam`` adds to them (``torch/optim/adam.py``)."""

from __future__ import annotations

import torch
from torch import nn

import memfit
from memfit.categories import MemoryCategory

LAYERS, WIDTH = 10, 256
PARAMS = LAYERS * (WIDTH * WIDTH + WIDTH)
TENSORS = 2 * LAYERS


def _states(optimizer: object) -> tuple[int, int]:
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    x = torch.zeros(4, WIDTH, device="meta")
    est = memfit.estimate(model, x, optimizer=optimizer, device="cuda", gpu="h100-80gb",
                          loss_fn=lambda m, b: m(b).sum())
    return est.breakdown[MemoryCategory.OPTIMIZER_STATES], est.host_peak_bytes


def test_foreach_adamw_keeps_its_step_counters_on_the_host() -> None:
    states, host = _states("adamw")
    assert states == 8 * PARAMS
    assert host == 4 * TENSORS + 4


def test_fused_adamw_keeps_them_on_the_device() -> None:
    states, host = _states(lambda ps: torch.optim.AdamW(ps, fused=True))
    assert states == 8 * PARAMS + 512 * TENSORS
    assert host == 0
