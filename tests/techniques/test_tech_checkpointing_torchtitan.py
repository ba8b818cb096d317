"""torchtitan's op-level checkpointing policy and a user's OpPolicy: exact loss and gradients,
and exactly the matmuls torchtitan's rule recomputes (FlopCounterMode, CPU fp32).

Expected from first principles: torchtitan keeps the 1st, 3rd, 5th, 7th ``mm`` of a block's
forward (torchtitan/parallelisms/parallelize_llama.py at d4c86e3, ``_get_custom_policy``) and
recomputes the 2nd, 4th, 6th: in a Llama block q, k, v, o, gate, up, down, those are k, o and
up, so the backward runs their forward matmuls again: 2 * tokens * (h * kv + h * h + h * f)
FLOPs per block more than memfit's ``selective``, which keeps every matmul output.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from memfit.errors import MemfitError
from memfit.techniques import OpPolicy, Torchtitan, apply_activation_checkpointing

H, KV, FF, HEADS, LAYERS, VOCAB = 32, 16, 64, 4, 2, 50
B, T = 2, 8


class LlamaBlock(nn.Module):
    """q, k, v, o, gate, up, down without bias (nn.Linear on 3-d input: aten.mm)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(H), nn.RMSNorm(H)
        self.q_proj, self.k_proj = nn.Linear(H, H, bias=False), nn.Linear(H, KV, bias=False)
        self.v_proj, self.o_proj = nn.Linear(H, KV, bias=False), nn.Linear(H, H, bias=False)
        self.gate_proj, self.up_proj = nn.Linear(H, FF, bias=False), nn.Linear(H, FF, bias=False)
        self.down_proj = nn.Linear(FF, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        y = self.norm1(x)
        d = H // HEADS
        q = self.q_proj(y).view(b, t, HEADS, d).transpose(1, 2)
        k = self.k_proj(y).view(b, t, KV // d, d).transpose(1, 2)
        v = self.v_proj(y).view(b, t, KV // d, d).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, t, H))
        y = self.norm2(x)
        return x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))


class TinyLlama(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, H)
        self.layers = nn.ModuleList(LlamaBlock() for _ in range(LAYERS))
        self.head = nn.Linear(H, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _step(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = F.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _flops(model: nn.Module, ids: torch.Tensor) -> int:
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


@pytest.fixture(scope="module")
def setup() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return TinyLlama(), torch.randint(0, VOCAB, (B, T))


@pytest.mark.parametrize("policy", [
    "torchtitan", Torchtitan(),
    OpPolicy(save=frozenset({torch.ops.aten.mm.default}), rule=lambda op, n: n % 3 != 0),
])
def test_same_loss_and_grads_as_no_checkpointing(setup, policy) -> None:
    model, ids = setup
    loss, grads = _step(model, ids)
    ckpt = copy.deepcopy(model)
    plan = apply_activation_checkpointing(ckpt, policy)
    assert plan.modes == ("selective",) * LAYERS
    loss2, grads2 = _step(ckpt, ids)
    assert torch.equal(loss, loss2)
    assert grads.keys() == grads2.keys()
    assert all(torch.equal(grads[n], grads2[n]) for n in grads)


def test_torchtitan_recomputes_every_second_mm(setup) -> None:
    model, ids = setup
    tokens = B * T
    sel = copy.deepcopy(model)
    apply_activation_checkpointing(sel, "selective")
    tt = copy.deepcopy(model)
    apply_activation_checkpointing(tt, "torchtitan")
    # k (h -> kv), o (h -> h) and up (h -> ff): the 2nd, 4th and 6th mm of each block
    recomputed = LAYERS * 2 * tokens * (H * KV + H * H + H * FF)
    assert _flops(tt, ids) - _flops(sel, ids) == recomputed
    # a user rule that keeps no mm recomputes every projection up to the last one backward
    # needs: down's output is not needed, and the recompute stops before it
    # (torch.utils.checkpoint's early stop, on by default)
    none_kept = copy.deepcopy(model)
    apply_activation_checkpointing(none_kept, OpPolicy(save=frozenset(
        {torch.ops.aten.mm.default}), rule=lambda op, n: False))
    every = LAYERS * 2 * tokens * (H * H + 2 * H * KV + H * H + 2 * H * FF)
    assert _flops(none_kept, ids) - _flops(sel, ids) == every


def test_op_policy_rejects_bad_arguments() -> None:
    with pytest.raises(MemfitError, match="at least one op"):
        OpPolicy(save=frozenset())
    with pytest.raises(MemfitError, match="a function"):
        OpPolicy(rule=3)  # type: ignore[arg-type]


def test_recipe_and_fit_config_take_torchtitan(setup) -> None:
    from memfit import Recipe
    from memfit.fitting.config import FitConfig
    from memfit.techniques.recipe import apply_techniques

    model, ids = setup
    loss, grads = _step(model, ids)
    ckpt = copy.deepcopy(model)
    assert apply_techniques(ckpt, Recipe(checkpointing="torchtitan")) == ("selective",) * LAYERS
    loss2, grads2 = _step(ckpt, ids)
    assert torch.equal(loss, loss2) and all(torch.equal(grads[n], grads2[n]) for n in grads)
    assert FitConfig(checkpointing="torchtitan").checkpointing == "torchtitan"
