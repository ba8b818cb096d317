"""The step-time model's cost of selective checkpointing's Python dispatch (Note: [selective
checkpointing's dispatch] in memfit/fitting/cost.py): the op count, the term, and the ranking
it changes on a CUDA target."""

from __future__ import annotations

import collections
import warnings
from unittest import mock

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from memfit.fitting import fit
from memfit.fitting.rates import CUDA_SAC_OP_S, gpu_rates
from memfit.fitting.traced import sac_ops
from memfit.gpus import get_gpu
from memfit.techniques import apply_activation_checkpointing
from memfit.units import GiB


@pytest.fixture(autouse=True)
def _quiet() -> None:
    warnings.simplefilter("ignore")


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class Toy(nn.Module):
    def __init__(self, d: int = 16, n: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), y.flatten())


def _batch(b: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(b, 8, 16), torch.randint(0, 4, (b, 8))


def _forward_mode_ops(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> int:
    """The ops torch's SAC forward mode (``_CachingTorchDispatchMode``) runs through Python in a
    real CPU step of ``model`` (checkpointed), counted at the mode itself."""
    counts: collections.Counter[str] = collections.Counter()
    cls = torch_checkpoint._CachingTorchDispatchMode
    original = cls.__torch_dispatch__

    def counted(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func not in torch_checkpoint.SAC_IGNORED_OPS:
            counts["ops"] += 1
        return original(self, func, types, args, kwargs)

    with mock.patch.object(cls, "__torch_dispatch__", counted):
        model(*batch).backward()
    return counts["ops"]


def test_sac_ops_are_the_forward_modes_ops_twice() -> None:
    """Every op of a selective block goes through SAC's Python mode in the forward and again in
    the recompute: the count the cost model charges is twice what the forward mode runs in a
    real step, and a block left alone adds nothing."""
    model, batch = Toy(), _batch()
    modes = ("selective", None, "selective")
    predicted = sac_ops(model, batch, modes, chunked=False, attention="model")
    apply_activation_checkpointing(model, "selective")
    per_block = _forward_mode_ops(model, batch) // 3
    assert per_block > 5  # norm, two linears, gelu, the residual add: real ops were counted
    assert predicted == 2 * 2 * per_block


def test_sac_term_is_ops_times_the_per_op_constant() -> None:
    """A CUDA target's candidate with selective checkpointing carries ``sac_s`` = accumulation x
    the ops SAC's modes see x the calibrated constant; full checkpointing carries none."""
    model, batch = Toy(), _batch(1)
    per_micro = sac_ops(model, batch, ("selective",) * 3, chunked=False, attention="model")
    plan = fit(model, batch, global_batch=8, gpu="h100-sxm-80gb", device="cuda",
               budget_bytes=8 * GiB, progress=False, top=10,
               space={"precision": ["fp32"], "checkpointing": ["selective", "full"],
                      "micro_batch": [4], "optimizer": ["adamw"], "offload_states": [False],
                      "offload_activations": [False]})
    by_ckpt = {c.config.checkpointing: c for c in (plan.chosen, *plan.runners_up)}
    assert gpu_rates(get_gpu("h100-sxm-80gb")).sac_op_s == CUDA_SAC_OP_S
    assert by_ckpt["selective"].cost.sac_s == pytest.approx(2 * per_micro * CUDA_SAC_OP_S)
    assert by_ckpt["full"].cost.sac_s == 0.0


def _gpt2_blocks() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """GPT-2's block (hidden 768, 12 heads) twice, a 512-token vocabulary, on meta."""
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_embd=768, n_layer=2, n_head=12, vocab_size=512,
                                           n_positions=512, bos_token_id=0, eos_token_id=0))
    ids = torch.randint(0, 512, (1, 512))
    return model, {"input_ids": ids, "labels": ids}


def test_fit_prefers_full_over_selective_where_both_fit_on_cuda() -> None:
    """The recorded H100/H200 runs (bench/results/techniques-h{1,2}00-2026-11-27.json) measured
    full checkpointing faster than selective (48.4 vs 68.9 ms, 44.9 vs 76.5 ms): selective's
    modes cost the host more than full's recompute costs the GPU. GPT-2's blocks at 128 x 512
    tokens on an H100 are the regime of the recorded gpt2 search: full's step is set by its
    GPU work (the recompute's FLOPs), selective's less work was all the old model saw (it chose
    selective). With both in budget, fit now picks full."""
    model, batch = _gpt2_blocks()
    plan = fit(model, batch, global_batch=128, gpu="h100-sxm-80gb", device="cuda",
               budget_bytes=60 * GiB, progress=False,
               space={"precision": ["bf16-mixed"], "checkpointing": ["selective", "full"],
                      "micro_batch": [128], "optimizer": ["adamw"], "chunked_loss": [False],
                      "offload_states": [False], "offload_activations": [False]})
    by_ckpt = {c.config.checkpointing: c for c in (plan.chosen, *plan.runners_up)}
    assert sorted(by_ckpt) == ["full", "selective"]  # both fit
    full, selective = by_ckpt["full"].cost, by_ckpt["selective"].cost
    # The regime: full's GPU work is more than selective's (its recompute), and sets its step.
    assert full.compute_s + full.traffic_s > selective.compute_s + selective.traffic_s
    assert plan.chosen.config.checkpointing == "full"


def test_cpu_target_has_no_sac_term() -> None:
    """A CPU target keeps its step model: selective checkpointing measured 1.02x the baseline on
    one CPU thread (bench/results/techniques-cpu-2026-11-22.json), the term is not charged."""
    model, batch = Toy(), _batch(1)
    plan = fit(model, batch, global_batch=4, device="cpu", budget_bytes=1 * GiB,
               progress=False, rates={"flops": 1e11, "bandwidth": 2e10, "launch_s": 4e-6},
               space={"precision": ["fp32"], "checkpointing": ["selective"],
                      "micro_batch": [4], "optimizer": ["adamw"]})
    assert plan.chosen.cost.sac_s == 0.0


def test_cuda_constants_are_the_recorded_calibration() -> None:
    """The per-op constants are those bench/step_cost_calibration.py derives from the recorded
    H100 / H200 steps (measured seconds over traced op counts), to the rounding."""
    import json
    from pathlib import Path

    from memfit.fitting.rates import CUDA_LAUNCH_S

    path = (Path(__file__).resolve().parents[2] / "bench" / "results"
            / "step-cost-calibration-2026-11-27.json")
    derived = json.loads(path.read_text())["derived"]
    assert CUDA_LAUNCH_S == pytest.approx(derived["host_s_per_eager_op"], rel=0.01)
    assert CUDA_SAC_OP_S == pytest.approx(derived["sac_s_per_op"], rel=0.01)


def test_pinning_sac_op_s_zero_turns_the_term_off() -> None:
    """``rates={"sac_op_s": 0}`` on a CUDA target: no term, the rest the catalog's (a plan
    saved on a CPU target, ``sac_op_s`` 0, loading back as a pin: test_fit_rates.py)."""
    model, batch = Toy(), _batch(1)
    space = {"precision": ["fp32"], "checkpointing": ["selective"], "micro_batch": [4],
             "optimizer": ["adamw"], "offload_states": [False], "offload_activations": [False]}
    on = fit(model, batch, global_batch=4, gpu="h100-sxm-80gb", device="cuda",
             budget_bytes=8 * GiB, progress=False, space=space)
    off = fit(model, batch, global_batch=4, gpu="h100-sxm-80gb", device="cuda",
              budget_bytes=8 * GiB, progress=False, space=space, rates={"sac_op_s": 0})
    assert on.chosen.cost.sac_s > 0 and off.chosen.cost.sac_s == 0.0
    assert off.chosen.cost.dispatch_s == on.chosen.cost.dispatch_s
