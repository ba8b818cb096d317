"""Pruned models (``torch.nn.utils.prune``) in the trace: ``weight_orig`` (a parameter, with its
gradient and optimizer states), ``weight_mask`` (a buffer) and the weight recomputed before each
forward, against hand-computed bytes and the real CPU step measured with the profiler's allocator
events; and the estimate's note that pruning costs memory.

Measuring: the ``weight`` a pruned module holds before the run was allocated before the profiler
started, so its free in step 0's pre-hook is not reported (``memfit.cpu_peak``'s known
limitation); it is left out of the baseline, which makes every point after that free exact, and
two steps are run, the second repeating the first with every allocation and free seen.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import prune

import memfit
from memfit.categories import MemoryCategory
from memfit.profiling import measure_cpu_peak
from memfit.trace import estimate
from memfit.units import format_bytes

F32 = 4
BATCH = 64
# Linear(256, 512), Linear(512, 256), Linear(256, 8): weight elements per layer
WEIGHTS = (256 * 512, 512 * 256, 256 * 8)
BIASES = (512, 256, 8)


def mlp(pruned: bool) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                          nn.Linear(256, 8))
    if pruned:
        for mod in model:
            if isinstance(mod, nn.Linear):
                prune.l1_unstructured(mod, "weight", amount=0.5)
    return model


def real_training_peak(model: nn.Module, x: torch.Tensor, optimizer: str) -> int:
    opt = (torch.optim.AdamW(model.parameters()) if optimizer == "adamw"
           else torch.optim.SGD(model.parameters(), lr=0.1))

    def step() -> None:
        for _ in range(2):
            loss = model(x).pow(2).mean()
            loss.backward()
            del loss
            opt.step()
            opt.zero_grad(set_to_none=True)

    return measure_cpu_peak(step, model, x, opt).peak_bytes


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_pruned_training_step_matches_the_profiler(optimizer: str) -> None:
    # Within 1%, the suite's tolerance (tests/trace/test_trace_accuracy.py); measured: to the
    # byte with SGD, 12 bytes under with AdamW (as for the unpruned model).
    x = torch.randn(BATCH, 256)
    model = mlp(pruned=True)
    est = estimate(model, x, optimizer=optimizer, device="cpu",
                   loss_fn=lambda m, b: m(b).pow(2).mean())
    real = real_training_peak(model, x, optimizer)
    assert abs(est.peak_bytes - real) <= 0.01 * real, (est.peak_bytes, real)
    # and pruning costs memory: the same step unpruned, measured the same way
    dense = real_training_peak(mlp(pruned=False), x, optimizer)
    held = 2 * F32 * sum(WEIGHTS)  # the masks and the recomputed weights
    assert real - dense >= held, (real, dense)


def test_pruned_inference_peak_by_hand() -> None:
    # No grad: each Linear's pre-hook makes the new weight (orig * mask) while the old one is
    # still set, then frees the old one. The peak is at the second Linear's product: the new
    # weights of layers 0 and 2, the old weights of layers 2 and 4, the input and the first ReLU's
    # output (the first Linear's output was freed once the ReLU had read it).
    x = torch.randn(BATCH, 256)
    model = mlp(pruned=True)
    params = F32 * (sum(WEIGHTS) + sum(BIASES))  # weight_orig and the biases
    masks = F32 * sum(WEIGHTS)
    weights_at_peak = F32 * (WEIGHTS[0] + 2 * WEIGHTS[1] + WEIGHTS[2])
    activations = F32 * (BATCH * 256 + BATCH * 512)
    est = estimate(model, x, optimizer=None, device="cpu")
    assert est.peak_bytes == params + masks + weights_at_peak + activations
    # the recomputed weights are weights, not forward tensors (the input is an activation, the
    # ReLU's output, which no backward keeps, a temporary)
    assert est.breakdown[MemoryCategory.WEIGHTS] == params + masks + weights_at_peak
    assert est.breakdown[MemoryCategory.ACTIVATIONS] == F32 * BATCH * 256

    def run() -> None:
        with torch.no_grad():
            for _ in range(2):
                model(x)

    assert est.peak_bytes == measure_cpu_peak(run, model, x).peak_bytes


def test_estimate_notes_the_cost_of_pruning() -> None:
    x = torch.randn(BATCH, 256)
    est = memfit.estimate(mlp(pruned=True), x, optimizer="sgd", device="cpu",
                          loss_fn=lambda m, b: m(b).pow(2).mean())
    [note] = [a for a in est.assumptions if "torch.nn.utils.prune" in a]
    masks = F32 * sum(WEIGHTS)
    assert f"+{format_bytes(2 * masks)} held vs unpruned" in note
    assert f"masks {format_bytes(masks)}" in note
    assert "3 tensor(s) (0.weight, 2.weight, 4.weight)" in note
    assert "gradient in each backward" in note
    assert "torch.nn.utils.prune" in str(est)  # the rendered estimate shows it
    unpruned = memfit.estimate(mlp(pruned=False), x, optimizer="sgd", device="cpu",
                               loss_fn=lambda m, b: m(b).pow(2).mean())
    assert not any("prune" in a for a in unpruned.assumptions)


def test_pruned_twice_and_bf16_params() -> None:
    # A tensor pruned twice has one hook (a PruningContainer) and one mask; bf16 precision casts
    # the orig, the mask and the weight alike: the note's bytes are those the trace holds.
    model = nn.Sequential(nn.Linear(64, 32))
    prune.l1_unstructured(model[0], "weight", amount=0.3)
    prune.random_unstructured(model[0], "weight", amount=0.3)
    est = estimate(model, torch.randn(4, 64), optimizer=None, device="cpu", precision="bf16")
    [note] = [a for a in est.assumptions if "torch.nn.utils.prune" in a]
    assert "1 tensor(s) (0.weight)" in note
    assert f"masks {format_bytes(2 * 64 * 32)}" in note
