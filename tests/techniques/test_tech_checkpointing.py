"""Activation checkpointing: exact gradients, exact recompute FLOPs, real and predicted savings."""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from _models import Block, TinyGPT
from memfit import MemoryCategory, estimate
from memfit.errors import MemfitError
from memfit.models.anatomy import find_blocks
from memfit.models.build import build_model, example_inputs
from memfit.models.spec import TransformerSpec
from memfit.profiling import measure_cpu_peak
from memfit.techniques.block_profile import activation_bytes
from memfit.techniques.checkpointing import (
    Budget,
    EveryK,
    Full,
    Policy,
    Selective,
    apply_activation_checkpointing,
    remove_activation_checkpointing,
)

DIM, VOCAB = 64, 256  # TinyGPT's defaults (tests/_models.py)


def lm_loss(logits: torch.Tensor) -> torch.Tensor:
    targets = torch.arange(logits.shape[0] * logits.shape[1]) % VOCAB
    return F.cross_entropy(logits.flatten(0, 1), targets)


def mse(logits: torch.Tensor) -> torch.Tensor:
    # The memory tests use this loss (a cheap backward, so checkpointing's effect dominates).
    return logits.pow(2).mean()


def grads_after_step(model: nn.Module, x: torch.Tensor, seed: int = 0
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    loss = lm_loss(model(x))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def train_steps(model: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    gc.collect()  # checkpoint frames form reference cycles: free earlier runs' now, not mid-run
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def run() -> None:
        for _ in range(2):
            loss = mse(model(x))
            loss.backward()
            del loss
            opt.step()
            opt.zero_grad(set_to_none=True)
    return run


# -- finding blocks ------------------------------------------------------------------------------

def test_finds_the_repeated_blocks() -> None:
    assert find_blocks(TinyGPT(layers=3)) == ["blocks.0", "blocks.1", "blocks.2"]
    spec = TransformerSpec(name="t", family="llama", arch="decoder", hidden_size=32, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
                           vocab_size=128,
                           norm="rmsnorm", position="rope", mlp="swiglu")
    model = build_model(spec, backend="builtin", device="meta")
    assert find_blocks(model) == ["model.layers.0", "model.layers.1"]
    assert find_blocks(TinyGPT(), Block) == [f"blocks.{i}" for i in range(4)]
    assert find_blocks(TinyGPT(), "blocks") == [f"blocks.{i}" for i in range(4)]
    assert find_blocks(TinyGPT(), ["blocks.1", "ln"]) == ["blocks.1", "ln"]


def test_bad_blocks_and_policies_raise_memfit_errors() -> None:
    with pytest.raises(MemfitError, match="no repeated blocks"):
        find_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    with pytest.raises(MemfitError, match="did you mean 'blocks'"):
        find_blocks(TinyGPT(), "blokcs")
    with pytest.raises(MemfitError, match="valid: 'full', 'selective'"):
        apply_activation_checkpointing(TinyGPT(), "ful")
    with pytest.raises(MemfitError, match="positive integer"):
        EveryK(0)
    with pytest.raises(MemfitError, match="needs the batch"):
        apply_activation_checkpointing(TinyGPT(), Budget(10**6))


def test_wrapping_keeps_names_and_can_be_removed() -> None:
    model = TinyGPT()
    keys = list(model.state_dict())
    plan = apply_activation_checkpointing(model, EveryK(2))
    assert plan.checkpointed == ("blocks.0", "blocks.2")
    assert list(model.state_dict()) == keys
    assert remove_activation_checkpointing(model) == 2
    assert "forward" not in vars(model.blocks[0])


# -- exactness -----------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", [Full(), Selective(), EveryK(2)], ids=repr)
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_loss_and_gradients_are_bit_exact(policy: Policy, dropout: float) -> None:
    # Recompute replays the same kernels on the same inputs, and checkpoint restores the RNG
    # state, so dropout masks are the same too: nothing may differ by even one bit.
    torch.manual_seed(0)
    base = TinyGPT(dropout=dropout)
    model = copy.deepcopy(base)
    apply_activation_checkpointing(model, policy)
    x = torch.randint(0, VOCAB, (2, 32))
    loss0, grads0 = grads_after_step(base, x)
    loss1, grads1 = grads_after_step(model, x)
    assert torch.equal(loss0, loss1)
    assert grads0.keys() == grads1.keys()
    for name in grads0:
        assert torch.equal(grads0[name], grads1[name]), name


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_hugging_face_llama_is_bit_exact(policy: str) -> None:
    pytest.importorskip("transformers")
    spec = TransformerSpec(name="t", family="llama", arch="decoder", hidden_size=64, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                           vocab_size=512, norm="rmsnorm", position="rope", mlp="swiglu")
    torch.manual_seed(0)
    base = build_model(spec, backend="transformers", device="cpu")
    model = copy.deepcopy(base)
    plan = apply_activation_checkpointing(model, policy)
    assert plan.checkpointed == ("model.layers.0", "model.layers.1")
    inputs = example_inputs(spec, batch=2, seq=32, device="cpu")
    losses = []
    for m in (base, model):
        loss = m(**inputs).loss
        loss.backward()
        losses.append(loss.detach())
    assert torch.equal(losses[0], losses[1])
    for (name, p0), p1 in zip(base.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(p0.grad, p1.grad), name


# -- recompute, counted exactly ------------------------------------------------------------------

def step_flops(model: nn.Module, x: torch.Tensor) -> int:
    with FlopCounterMode(display=False) as counter:
        lm_loss(model(x)).backward()
    return counter.get_total_flops()


def test_recompute_flops_are_exactly_the_blocks_forward() -> None:
    b, s, layers = 2, 32, 4
    n = b * s
    # One block's forward, from the shapes: four matmuls at 2 FLOPs per multiply-add (qkv 3d,
    # proj d, fc1 4d, fc2 4d output columns). Two things are not recomputed or not counted:
    # - fc2: non-reentrant checkpoint stops recomputing once every tensor backward needs is back
    #   (torch.utils.checkpoint's "early stop"), and fc2's output is saved by nothing;
    # - attention: FlopCounterMode has no formula for the CPU flash kernel
    #   (aten._scaled_dot_product_flash_attention_for_cpu), so it counts 0 with or without.
    block_recompute = 2 * n * DIM * (3 * DIM + DIM + 4 * DIM)
    torch.manual_seed(0)
    base = TinyGPT(layers=layers)
    x = torch.randint(0, VOCAB, (b, s))
    flops0 = step_flops(base, x)
    for policy, recomputed_blocks in ((Full(), layers), (EveryK(2), layers // 2)):
        model = copy.deepcopy(base)
        apply_activation_checkpointing(model, policy)
        assert step_flops(model, x) - flops0 == recomputed_blocks * block_recompute, policy
    # Selective keeps every matmul and attention output: no counted FLOP is recomputed.
    model = copy.deepcopy(base)
    apply_activation_checkpointing(model, "selective")
    assert step_flops(model, x) == flops0


# -- measured and predicted effect ---------------------------------------------------------------

BATCH, SEQ = 8, 128
POLICIES: dict[str, Policy | None] = {"none": None, "full": Full(), "selective": Selective(),
                                      "every-2": EveryK(2)}


@pytest.fixture(scope="module")
def real_peaks() -> dict[str, int]:
    """The real CPU peak of two AdamW steps under each policy (profiler allocator events)."""
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    peaks = {}
    for name, policy in POLICIES.items():
        torch.manual_seed(0)
        model = TinyGPT()
        if policy is not None:
            apply_activation_checkpointing(model, policy)
        peaks[name] = measure_cpu_peak(train_steps(model, x), model, x).peak_bytes
    return peaks


def test_full_checkpointing_saves_real_memory(real_peaks: dict[str, int]) -> None:
    # Rough first-principles bound. Per token, an uncheckpointed block saves about 17*d fp32
    # values (LN in/out 2d, qkv 3d, attention out + proj in 2d, residual d, LN2 in/out 2d,
    # fc1 out 4d, GeLU out 4d ...) = 17*64*4 B; with 1024 tokens and 4 blocks that is ~17.8 MB.
    # Checkpointed, each block keeps its 0.26 MB input and backward recomputes one block (~4.5 MB).
    # Weights, grads and two AdamW states of ~0.23 M params are ~3.6 MB; the logits, their
    # square and gradient ~3 MB either way. Peak ~3.6+17.8+3 = 24 MB vs <= 3.6+1+4.5+3 = 12
    # MB: at least 40% saved, leaving margin for temporaries.
    assert real_peaks["full"] <= 0.60 * real_peaks["none"], real_peaks


def test_partial_policies_sit_between_none_and_full(real_peaks: dict[str, int]) -> None:
    for name in ("selective", "every-2"):
        assert real_peaks["full"] < real_peaks[name] < real_peaks["none"], (name, real_peaks)


@pytest.mark.parametrize("name", [
    "none", "selective", "every-2",
    "full",
])
def test_estimate_predicts_the_peak(name: str, real_peaks: dict[str, int]) -> None:
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    model = TinyGPT()
    policy = POLICIES[name]
    if policy is not None:
        apply_activation_checkpointing(model, policy)
    est = estimate(model, (x,), optimizer="adamw", loss_fn=lambda m, b: mse(m(*b)), device="cpu",
                   steps=2)
    real = real_peaks[name]
    assert abs(est.peak_bytes - real) <= 0.01 * real, (est.peak_bytes, real)


# -- budget --------------------------------------------------------------------------------------

class Fixed(Policy):
    """A user policy: the given mode per block."""

    def __init__(self, modes: list[Any]) -> None:
        self.modes = modes

    def choose(self, blocks: Sequence[str], profile: Callable[[], list[Any]]) -> list[Any]:
        return self.modes


def forward_kept_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes the real forward leaves allocated, minus its output (the logits)."""
    out: list[torch.Tensor] = []
    gc.collect()  # checkpoint frames form reference cycles: free earlier runs' now, not mid-run
    peak = measure_cpu_peak(lambda: out.append(model(x)), model, x)
    return peak.end_delta_bytes - out[0].untyped_storage().nbytes()


def test_budget_profile_matches_the_real_forward_exactly() -> None:
    # The per-block measurement on fake tensors must give, for any choice of modes, exactly the
    # bytes a real CPU forward keeps for backward (allocator events).
    torch.manual_seed(0)
    x = torch.randint(0, VOCAB, (2, 64))
    model = TinyGPT()
    plan = apply_activation_checkpointing(model, Budget(10**12), inputs=(x,))
    profiles = list(plan.profiles)
    for modes in ([None] * 4, ["full"] * 4, ["selective"] * 4, ["full", None, "selective", None]):
        m = TinyGPT()
        apply_activation_checkpointing(m, Fixed(modes))
        kept, _ = activation_bytes(profiles, modes)
        assert forward_kept_bytes(m, x) == kept, modes


def test_budget_checkpoints_just_enough() -> None:
    torch.manual_seed(0)
    x = torch.randint(0, VOCAB, (2, 64))
    none = apply_activation_checkpointing(TinyGPT(), Budget(10**12), inputs=(x,))
    assert none.modes == (None,) * 4
    assert none.predicted_activation_bytes is not None
    profiles = list(none.profiles)
    floor = sum(activation_bytes(profiles, ["full"] * 4))
    top = none.predicted_activation_bytes
    budget = (floor + top) // 2
    plan = apply_activation_checkpointing(TinyGPT(), Budget(budget), inputs=(x,))
    assert plan.predicted_activation_bytes is not None
    assert plan.predicted_activation_bytes <= budget
    assert 0 < len(plan.checkpointed) and plan.modes != ("full",) * 4
    # Recomputing as little as possible: undoing any one block's choice breaks the budget.
    for i, mode in enumerate(plan.modes):
        if mode is not None:
            fewer = [*plan.modes[:i], None, *plan.modes[i + 1:]]
            assert sum(activation_bytes(profiles, fewer)) > budget
    with pytest.raises(MemfitError, match="cannot be met"):
        apply_activation_checkpointing(TinyGPT(), Budget(floor - 1), inputs=(x,))
    exact = apply_activation_checkpointing(TinyGPT(), Budget(floor), inputs=(x,))
    assert exact.predicted_activation_bytes is not None
    assert exact.predicted_activation_bytes <= floor


@pytest.mark.parametrize("policy", ["full", "selective", EveryK(2)])
def test_cuda_target_recomputes_with_cuda_attention_kernels(policy: Any) -> None:
    # A CUDA target on a CPU-only torch routes attention to CUDA's kernels (memory-efficient
    # attention on an A100-class GPU). Checkpointing recomputes the forward in backward, where the
    # routing must still hold: otherwise the recompute takes the CPU kernel, saves different
    # tensors, and torch.utils.checkpoint rejects the step.
    spec = TransformerSpec(name="t", family="llama", arch="decoder", hidden_size=64,
                           num_layers=2, num_heads=4, num_kv_heads=4, head_dim=16,
                           intermediate_size=192, vocab_size=512)
    inputs = example_inputs(spec, batch=2, seq=64, device="cpu")
    torch.manual_seed(0)
    plain = build_model(spec, backend="builtin", device="cpu")
    model = copy.deepcopy(plain)
    apply_activation_checkpointing(model, policy)
    base = estimate(plain, inputs, optimizer="sgd", device="cuda", steps=1)
    est = estimate(model, inputs, optimizer="sgd", device="cuda", steps=1)
    ops = {(p.phase, p.op) for p in est.timeline if "attention" in p.op}
    assert not any("for_cpu" in op for _, op in ops), ops
    assert ("forward", "aten._scaled_dot_product_efficient_attention.default") in ops
    if policy == "full":  # the whole block, attention included, runs again in backward
        assert ("backward", "aten._scaled_dot_product_efficient_attention.default") in ops
    assert est.breakdown[MemoryCategory.ACTIVATIONS] < base.breakdown[MemoryCategory.ACTIVATIONS]


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_hugging_face_model_with_a_kv_cache_is_exact(policy: str) -> None:
    """A Hugging Face model built with ``use_cache=True`` (GPT-2's default): the recompute must
    not append to the KV cache again. Under selective checkpointing that made torch's SAC raise
    "aten.slice.Tensor encountered during backward but not found in storage" (transformers
    slices K/V when they are longer than the queries). Loss and gradients equal the plain
    step's exactly, and the cache is off, as HF's own ``gradient_checkpointing_enable`` does."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    assert model.config.use_cache
    base = copy.deepcopy(model)
    base.config.use_cache = False
    apply_activation_checkpointing(model, policy)
    assert model.config.use_cache is False
    ids = torch.randint(0, 100, (2, 16))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    ref = base(input_ids=ids, labels=ids).loss
    ref.backward()
    assert torch.equal(loss, ref)
    for p, q in zip(model.parameters(), base.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
