"""memfit.fit searches expert parallelism beside tensor parallelism (memfit/fitting/layout_space.py:
_expert_tp_layouts; memfit/fitting/traced.py: per_rank_traced), the layout of
memfit/parallel/expert.py (Note: [expert parallelism beside tensor parallelism]: torchtitan's
etp = 1, ep over the dp * tp ranks in whole tp groups, FSDP2 over the data-parallel ranks), whose
per-rank trace tests/parallel/test_parallel_ep_tp.py checks against real gloo ranks.
"""

from __future__ import annotations

import pytest
import torch

from memfit.parallel import Parallel

FIXED = {"precision": ["fp32"], "checkpointing": ["none"], "optimizer": ["adamw"],
         "chunked_loss": [False]}


def _moe(backend: str = "builtin") -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The tiny MoE decoder (2 layers, hidden 64, 4 heads, 4 experts, top 2), batch 4 x 16."""
    from memfit.models.build import build_model
    from memfit.parallel.measure import tiny_moe_spec

    torch.manual_seed(0)
    model = build_model(tiny_moe_spec(), backend=backend, device="cpu")
    ids = torch.zeros(4, 16, dtype=torch.long)
    return model, {"input_ids": ids, "labels": ids}


def test_layouts_offer_ep_beside_tp_in_whole_tp_groups() -> None:
    """4 GPUs, the builtin MoE (4 experts, 4 heads): beside tp 2 (dp 2, 4 ranks) ep may be 2 or
    4 (multiples of tp dividing dp * tp = 4 and the 4 experts; each rank's 4 / ep experts split
    evenly over the 4 / ep ranks holding them: 2 over 2, 1 over 1), with FSDP2 over the 2
    data-parallel ranks (zero2, zero3); beside tp 4 (dp 1) ep 4 alone. No pipeline beside
    them, no DDP or ZeRO-1."""
    from memfit.fitting.layout_space import layouts
    from memfit.fitting.layouts import model_shape

    model, _ = _moe()
    found = layouts(gpus=4, gpus_per_node=None, global_batch=8, shape=model_shape(model, 16),
                    space={}, rejected=[])
    beside = {(p.tp, p.ep, p.strategy, p.reshard_after_forward)
              for p in found if p.tp > 1 and p.ep > 1}
    assert beside == {(2, 2, "fsdp", True), (2, 2, "fsdp", False), (2, 4, "fsdp", True),
                      (2, 4, "fsdp", False), (4, 4, "none", True)}
    assert not any(p.tp > 1 and p.ep > 1 and p.pp > 1 for p in found)


def test_transformers_experts_get_no_ep_beside_tp_and_say_why() -> None:
    """transformers' Mixtral experts run ep without tp only: no tp x ep layout, one reason."""
    pytest.importorskip("transformers")
    from memfit.fitting.layout_space import layouts
    from memfit.fitting.layouts import model_shape

    model, _ = _moe(backend="transformers")
    rejected: list = []
    found = layouts(gpus=2, gpus_per_node=None, global_batch=8, shape=model_shape(model, 16),
                    space={}, rejected=rejected)
    assert any(p.ep > 1 for p in found) and not any(p.ep > 1 and p.tp > 1 for p in found)
    assert any(r.what == "ep beside tp 2" and "builtin MoE" in r.reason for r in rejected)


def test_search_traces_tp_ep_per_rank_as_memfit_estimate_does() -> None:
    """2 GPUs, tp 2 only, global batch 2 (one micro-batch of 2 x 16, no accumulation): the
    search offers tp 2 x ep 2 (the expert group is the tp group), traces it per rank, and the
    candidate's peak is the worst rank of an independent memfit.estimate(...,
    parallel=Parallel(gpus=2, tp=2, ep=2)) of the same step (0.5%: the search traces one step
    on the CPU and adds the states, Note: [one traced step on CPU] in
    memfit/fitting/traced.py)."""
    import memfit
    from memfit.fitting.config import layout_label

    model, batch = _moe()
    plan = memfit.fit(model, batch, global_batch=2, budget_bytes=2**30, device="cpu", gpus=2,
                      headroom=0.0, progress=False, top=10,
                      rates={"flops": 1e11, "bandwidth": 3e10, "launch_s": 6e-6},
                      space=FIXED | {"micro_batch": [2], "tp": [2], "pp": [1]})
    by_label = {layout_label(c.config.parallel): c for c in [plan.chosen, *plan.runners_up]}
    cand = by_label["tp 2, ep 2"]
    assert cand.config.parallel == Parallel(gpus=2, tp=2, ep=2)
    assert cand.per_rank
    meta = {k: torch.zeros_like(v[:2], device="meta") for k, v in batch.items()}
    est = memfit.estimate(model, meta, device="cpu", optimizer="adamw",
                          parallel=Parallel(gpus=2, tp=2, ep=2), steps=2)
    assert cand.peak_bytes == pytest.approx(est.peak_bytes, rel=0.005)
    # The experts split over the ranks: below tp 2 alone, which keeps every expert on each.
    assert cand.peak_bytes < by_label["tp 2"].peak_bytes
