"""Mixture-of-experts layers: the grouped matmul traces, and the routing's memory is counted.

transformers (5.x) runs experts through ``torch._grouped_mm`` by default
(``modeling_utils.py: get_correct_experts_implementation`` picks ``"grouped_mm"``;
``integrations/moe.py: _can_use_grouped_mm`` keeps it on CUDA for compute capability >= 8.0 and on
CPU for torch > 2.10). torch's meta function for it accepts only bf16
(``torch/_meta_registrations.py: _meta_grouped_mm_common``) while the kernels take fp32, bf16 and
fp16 (``aten/src/ATen/native/GroupedMMUtils.h: _grouped_mm_validate_inputs``;
``aten/src/ATen/native/cuda/GroupedBlas.cpp: _grouped_mm_cuda`` falls back to one mm per group for
anything but bf16 on sm90/sm100). See Note: [grouped_mm on fake tensors] in ``trace/fake_rules.py``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from memfit.trace import estimate


class Grouped(nn.Module):
    def __init__(self, experts: int, d: int, f: int) -> None:
        super().__init__()
        # (E, f, d) transposed to (E, d, f): the layout transformers passes (is_transposed=False).
        self.w = nn.Parameter(torch.empty(experts, f, d))

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return torch._grouped_mm(x, self.w.transpose(-2, -1), offs=offs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grouped_mm_output_is_the_kernels(dtype: torch.dtype) -> None:
    """The fake output's bytes equal the real CPU kernel's output storage (an independent
    measurement), which follows ``create_grouped_gemm_output_tensor`` (GroupedMMUtils.h): the
    last dimension's stride padded to 16 bytes, [8, 30] -> stride (32, 1) in fp32."""
    experts, d, f, tokens = 4, 16, 30 if dtype == torch.float32 else 28, 8
    offs = torch.tensor([2, 4, 6, 8], dtype=torch.int32)
    real = Grouped(experts, d, f).to(dtype)
    nn.init.normal_(real.w)
    x = torch.randn(tokens, d, dtype=dtype)
    out_bytes = real(x, offs).untyped_storage().nbytes()
    with torch.device("meta"):
        model = Grouped(experts, d, f).to(dtype)
    est = estimate(model, (x, offs), optimizer=None, device="cpu")
    weights = experts * f * d * dtype.itemsize
    assert est.peak_bytes == weights + x.nbytes + offs.nbytes + out_bytes


def _mixtral(top_k: int) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, num_local_experts=4, num_experts_per_tok=top_k)
    with torch.device("meta"):
        return transformers.MixtralForCausalLM(config)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
@pytest.mark.parametrize("top_k", [1, 2])
def test_mixtral_experts_keep_the_routed_tokens(top_k: int, device: str) -> None:
    """Hand-computed bytes the experts module keeps for backward (fp32, T = 2 x 32 tokens,
    hidden h = 64, intermediate I = 128, E = 4 experts, S = T * top_k routed copies), following
    ``transformers/integrations/moe.py: grouped_mm_experts_forward``:

    - the permuted token copies ``hidden_states[perm // k]``: S*h*4 (saved by grouped_mm);
    - the gate/up grouped_mm output S*2I*4 (its halves saved by SiLU and the product);
    - the product act(gate)*up, S*I*4 (the down grouped_mm's input);
    - the down output, S*h*4 (saved by the multiply with the routing weights);
    - the permuted routing weights, S*4;
    - three int64 index tensors saved by the indexing ops (perm // k, perm, inv_perm): 3*S*8;
    - the int32 group offsets, E*4.
    """
    tokens, h, inter, experts = 64, 64, 128, 4
    routed = tokens * top_k
    expected = routed * (2 * h + 3 * inter) * 4 + routed * (4 + 3 * 8) + experts * 4
    ids = torch.zeros(2, 32, dtype=torch.long, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = estimate(_mixtral(top_k), {"input_ids": ids, "labels": ids}, device=device,
                       steps=1)
    assert est.modules["model.layers.0.mlp.experts"].activation_bytes == expected


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed", "bf16"])
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_mixtral_traces_in_every_precision(precision: str, device: str) -> None:
    """grouped_mm has no autocast kernel (``autocast_mode.cpp`` lists it nowhere); transformers
    casts its input to the weights' dtype, so under autocast the experts run in fp32, as on the
    GPU, and with bf16 weights in bf16 (the CUTLASS path on sm90)."""
    ids = torch.zeros(2, 32, dtype=torch.long, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = estimate(_mixtral(2), {"input_ids": ids, "labels": ids}, device=device,
                       precision=precision, steps=1)
    kept = est.modules["model.layers.0.mlp.experts"].activation_bytes
    fp32_floats = 128 * (2 * 64 + 3 * 128) * 4
    if precision == "bf16":
        assert kept < fp32_floats
    else:
        assert kept > fp32_floats


class SplitRouting(nn.Module):
    """JetMoE-style routing: tokens per expert read with ``.tolist()``, then ``split``."""

    def __init__(self, d: int = 16, experts: int = 4, k: int = 2) -> None:
        super().__init__()
        self.router = nn.Linear(d, experts)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(experts))
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx = self.router(x).topk(self.k, dim=-1).indices
        counts = torch.nn.functional.one_hot(idx.flatten(), len(self.experts)).sum(0).tolist()
        routed = x.repeat_interleave(self.k, dim=0)
        outs = [e(chunk) for e, chunk in zip(self.experts, routed.split(counts), strict=True)]
        return torch.cat(outs).sum()


def test_split_by_computed_counts_is_balanced() -> None:
    """The counts are data: the trace assumes balanced routing (stated in the warning) and splits
    the T*k = 64 routed rows evenly, 16 per expert; each expert's output [16, 16] fp32 is 1 KiB,
    so the forward's outputs of the four experts add up to the whole routed batch."""
    with torch.device("meta"):
        model = SplitRouting()
    x = torch.empty(32, 16, device="meta")
    with pytest.warns(UserWarning, match="data-dependent"):
        est = estimate(model, x, optimizer=None, device="cpu", steps=1)
    expert_out = [p for p in est.timeline if p.module.startswith("experts.")
                  and p.op == "aten.addmm.default"]
    assert len(expert_out) == 4
    grown = [p.total - est.timeline[p.index - 1].total for p in expert_out]
    assert grown == [16 * 16 * 4] * 4
