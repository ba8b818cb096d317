"""memfit.fit's expert-parallel layouts on a transformers MoE model (memfit/fitting/layouts.py:
model_shape reads transformers' experts modules through memfit.parallel.expert.moe_shape): a tiny
Mixtral built by the installed transformers, random weights, no download."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import memfit
from memfit.parallel import Parallel

pytest.importorskip("transformers")

FIXED = {"precision": ["fp32"], "checkpointing": ["none"], "optimizer": ["adamw"],
         "chunked_loss": [False]}


def _mixtral() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """transformers' MixtralForCausalLM: 2 layers, hidden 64, 4 experts of 128, top 2."""
    from memfit.models.build import build_model
    from memfit.parallel.measure import tiny_moe_spec

    spec = dataclasses.replace(tiny_moe_spec(), name="tiny-mixtral")
    torch.manual_seed(0)
    model = build_model(spec, backend="transformers", device="cpu")
    ids = torch.randint(0, spec.vocab_size, (4, 32), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


def test_model_shape_reads_transformers_experts() -> None:
    """Each of the 2 layers routes to 4 experts (top 2); ep splits their fused gate_up_proj
    [4, 2 * 128, 64] and down_proj [4, 64, 128]: 2 * 4 * 3 * 64 * 128 parameters."""
    from memfit.fitting.layouts import model_shape

    model, _ = _mixtral()
    shape = model_shape(model, 32)
    assert shape is not None
    assert (shape.experts, shape.top_k, shape.expert_numel) == ((4, 4), 2, 2 * 4 * 3 * 64 * 128)
    assert shape.ep_degrees(2) == [2] and shape.ep_degrees(4) == [2, 4]


def test_search_offers_and_traces_ep_on_a_transformers_moe() -> None:
    """On 2 GPUs the search offers ep 2 with DDP and with FSDP2 (ZeRO-2/3) beside the plain
    data-parallel layouts, traces each per rank, and each candidate's peak is the worst rank of
    an independent memfit.estimate(..., parallel=...) of the same step (0.5%: the search traces
    one step and adds the states). Under a budget between the ep layouts' peaks and plain DDP's,
    the chosen layout is an expert-parallel one."""
    from memfit.fitting.config import layout_label

    model, batch = _mixtral()
    meta = {k: torch.zeros_like(v[:2], device="meta") for k, v in batch.items()}
    space = FIXED | {"micro_batch": [2], "tp": [1], "pp": [1]}
    plan = memfit.fit(model, batch, global_batch=4, budget_bytes=2**30, device="cpu", gpus=2,
                      headroom=0.0, progress=False, top=10, space=space)
    by_label = {layout_label(c.config.parallel): c for c in [plan.chosen, *plan.runners_up]}
    labels = ("ep 2, ddp x2", "ep 2, zero2 x2", "ep 2, fsdp x2")
    assert set(labels) <= set(by_label)
    peaks = {}
    for label in labels:
        c = by_label[label]
        assert c.per_rank
        est = memfit.estimate(model, meta, device="cpu", optimizer="adamw",
                              parallel=c.config.parallel, steps=2)
        assert c.peak_bytes == pytest.approx(est.peak_bytes, rel=0.005), label
        peaks[label] = est.peak_bytes
    ddp = memfit.estimate(model, meta, device="cpu", optimizer="adamw",
                          parallel=Parallel(gpus=2), steps=2).peak_bytes
    assert peaks["ep 2, ddp x2"] < ddp  # half the experts' weights, grads and states
    budget = (peaks["ep 2, ddp x2"] + ddp) // 2
    plan = memfit.fit(model, batch, global_batch=4, budget_bytes=budget, device="cpu", gpus=2,
                      headroom=0.0, progress=False,
                      space=space | {"sharding": ["none"]})
    chosen = plan.chosen.config.parallel
    assert chosen is not None and chosen.ep == 2, layout_label(chosen)


def test_selective_checkpointings_op_count_runs_transformers_experts_in_fp32() -> None:
    """fit's step time counts selective checkpointing's ops on fake tensors
    (``memfit.fitting.traced.selective_ops``); transformers' fp32 experts call
    ``aten._grouped_mm``, whose meta check takes bf16 only, so `memfit fit mixtral-8x7b` ended in
    a traceback there. The two identical blocks count the same ops each."""
    from memfit.fitting.traced import selective_ops

    model, batch = _mixtral()
    both = selective_ops(model, batch, ("selective", "selective"))
    first = selective_ops(model, batch, ("selective", "none"))
    assert both == 2 * first > 0
