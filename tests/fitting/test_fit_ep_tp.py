"""memfit.fit searches expert parallelism beside tensor parallelism (memfit/fitting/layout_space.py:
_expert_tp_layouts; memfit/fitting/traced.py: per_rank_traced), the layout of
memfit/parallel/expert.py (Note: [expert parallelism beside tensor parallelism]: torchtitan's
etp = 1, ep over the dp * tp ranks in whole tp groups, FSDP2 over the data-parallel ranks), whose
per-rank trace tests/parallel/test_parallel_ep_tp.py checks against real gloo ranks.
"""

from __future__ import annotations

from typing import Any

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
    data-parallel ranks (zero2, zero3); beside tp 4 (dp 1) ep 4 alone; beside tp 2 x pp 2 (dp
    1, each stage's 2 ranks) ep 2, with 1F1B and GPipe (interleaved 1F1B needs 4 blocks). No
    DDP or ZeRO-1; each accepted by the per-rank trace and by Plan.apply's pipeline."""
    from memfit.fitting.layout_space import layouts
    from memfit.fitting.layouts import model_shape

    model, _ = _moe()
    found = layouts(gpus=4, gpus_per_node=None, global_batch=8, shape=model_shape(model, 16),
                    space={}, rejected=[])
    from memfit.fitting.apply_pipeline import pipeline_refusal
    from memfit.fitting.config import FitConfig, sharding_of
    from memfit.fitting.layouts import pipeline_runs
    from memfit.fitting.traced import per_rank_traced

    beside = [p for p in found if p.tp > 1 and p.ep > 1]
    assert {(p.tp, p.pp, p.ep, p.strategy, p.reshard_after_forward, p.pp_schedule)
            for p in beside} == {
        (2, 1, 2, "fsdp", True, "1f1b"), (2, 1, 2, "fsdp", False, "1f1b"),
        (2, 1, 4, "fsdp", True, "1f1b"), (2, 1, 4, "fsdp", False, "1f1b"),
        (4, 1, 4, "none", True, "1f1b"),
        (2, 2, 2, "none", True, "1f1b"), (2, 2, 2, "none", True, "gpipe")}
    for par in beside:
        assert per_rank_traced(par), par.describe()
        if par.pp > 1:
            cfg = FitConfig(precision="fp32", micro_batch=1, accumulation=2,
                            sharding=sharding_of(par), parallel=par)
            assert pipeline_runs(par) and pipeline_refusal(cfg) is None, par.describe()


def test_transformers_experts_get_ep_beside_tp_and_a_user_plan_does_not() -> None:
    """transformers' Mixtral experts get tp 2 x ep 2 on 2 GPUs as the builtin MoE does (its own
    tp plan less its expert entries); a tp_plan of the user's gets no tp x ep layout, and the
    search says why (check_experts refuses it)."""
    pytest.importorskip("transformers")
    from memfit.fitting.layout_space import layouts
    from memfit.fitting.layouts import model_shape

    model, _ = _moe(backend="transformers")
    found = layouts(gpus=2, gpus_per_node=None, global_batch=8, shape=model_shape(model, 16),
                    space={}, rejected=[])
    assert Parallel(gpus=2, tp=2, ep=2) in found
    plan = {"model.layers.*.self_attn.q_proj": "colwise",
            "model.layers.*.self_attn.o_proj": "rowwise"}
    rejected: list = []
    found = layouts(gpus=2, gpus_per_node=None, global_batch=8, tp_plan=plan,
                    shape=model_shape(model, 16, tp_plan=plan), space={}, rejected=rejected)
    assert any(p.ep > 1 for p in found) and not any(p.ep > 1 and p.tp > 1 for p in found)
    assert any(r.what == "ep beside tp 2" and "tp_plan of yours" in r.reason for r in rejected)


def _fitted(model: Any, batch: Any, gpus: int, pp: int) -> dict[str, Any]:
    """fit over ``gpus`` GPUs, tp 2 and ``pp`` only, micro-batches of 2 (a global batch of 2 a
    pipeline stage): each candidate of the top 10 by its layout's label."""
    import memfit
    from memfit.fitting.config import layout_label

    plan = memfit.fit(model, batch, global_batch=2 * pp, budget_bytes=2**30, device="cpu",
                      gpus=gpus, headroom=0.0, progress=False, top=10,
                      rates={"flops": 1e11, "bandwidth": 3e10, "launch_s": 6e-6},
                      space=FIXED | {"micro_batch": [2], "tp": [2], "pp": [pp]})
    return {layout_label(c.config.parallel): c for c in [plan.chosen, *plan.runners_up]}


def test_search_traces_tp_ep_per_rank_as_memfit_estimate_does() -> None:
    """2 GPUs, tp 2 only, global batch 2 (one micro-batch of 2 x 16, no accumulation): the
    search offers tp 2 x ep 2 (the expert group is the tp group), traces it per rank, and the
    candidate's peak is the worst rank of an independent memfit.estimate(...,
    parallel=Parallel(gpus=2, tp=2, ep=2)) of the same step (0.5%: the search traces one step
    on the CPU and adds the states, Note: [one traced step on CPU] in
    memfit/fitting/traced.py)."""
    import memfit

    model, batch = _moe()
    by_label = _fitted(model, batch, gpus=2, pp=1)
    cand = by_label["tp 2, ep 2"]
    assert cand.config.parallel == Parallel(gpus=2, tp=2, ep=2)
    assert cand.per_rank
    meta = {k: torch.zeros_like(v[:2], device="meta") for k, v in batch.items()}
    est = memfit.estimate(model, meta, device="cpu", optimizer="adamw",
                          parallel=Parallel(gpus=2, tp=2, ep=2), steps=2)
    assert cand.peak_bytes == pytest.approx(est.peak_bytes, rel=0.005)
    # The experts split over the ranks: below tp 2 alone, which keeps every expert on each.
    assert cand.peak_bytes < by_label["tp 2"].peak_bytes


def test_search_traces_tp_ep_beside_pp_per_rank_as_memfit_estimate_does() -> None:
    """4 GPUs, tp 2 x pp 2 only, global batch 4 in micro-batches of 2 (the pipeline's 2
    micro-batches): the search offers tp 2 x pp 2 x ep 2 (each stage's 2 ranks one expert group),
    and the candidate's peak is the worst rank of memfit.estimate(..., parallel=that layout) of
    the same step."""
    import dataclasses

    import memfit

    model, batch = _moe()
    by_label = _fitted(model, batch, gpus=4, pp=2)
    cand = by_label["tp 2, ep 2, pp 2"]
    par = cand.config.parallel
    assert (par.tp, par.pp, par.ep, par.dp) == (2, 2, 2, 1) and cand.per_rank
    meta = {k: torch.zeros_like(v, device="meta") for k, v in batch.items()}
    est = memfit.estimate(model, meta, device="cpu", optimizer="adamw", steps=2,
                          parallel=dataclasses.replace(par, microbatches=2))
    assert cand.peak_bytes == pytest.approx(est.peak_bytes, rel=0.005)
