"""``memfit.fit(..., pp_split_points=[...])`` with interleaved 1F1B: split points that make
``2 pp`` stages give layouts of two stages a rank over ``pp`` ranks (rank ``r`` holds stages
``r`` and ``r + pp``, torchtitan's "loop" placement, memfit/parallel/pipeline.py:
stage_modules), beside the one-stage-a-rank layouts of 1F1B and GPipe; and ep beside a split.

The model is tests/_models.py's custom decoder (4 MLP blocks, names in none of memfit's lists).
The truth for a fitted layout's peak is the per-rank trace of the same layout
(``memfit.estimate(..., parallel=...)``), itself checked against real gloo ranks for
interleaved schedules (tests/parallel/test_parallel_pp.py) and named splits
(tests/parallel/test_parallel_pp_split.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import memfit
from _fit_cli import fit_cli
from _models import CustomDecoder, CustomMoE
from memfit.errors import MemfitError
from memfit.fitting import Plan

VOCAB, DIM, HIDDEN, BATCH, SEQ = 128, 32, 64, 8, 16
POINTS = ("blocks.1", "blocks.2", "blocks.3")
"""4 stages of one block each: pp 4 one a rank, or pp 2 two a rank (interleaved)."""


class Net(CustomDecoder):
    """tests/_models.py's custom decoder called as fit calls a model (``model(**batch)``): the
    labels ignored, the logits returned (fit's loss and the pipeline's last stage take them)."""

    def forward(self, input_ids: torch.Tensor,  # type: ignore[override]
                labels: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(input_ids)


def make(layers: int = 4) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The custom model (real, CPU, seeded) and one batch of ``BATCH`` rows."""
    torch.manual_seed(0)
    model = Net(layers, dim=DIM, hidden=HIDDEN, vocab=VOCAB)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids.clone()}


def _layouts(gpus: int, points: tuple[str, ...] = POINTS, space: dict | None = None,
             shape: Any = None) -> tuple[list, list]:
    from memfit.fitting.layout_space import layouts
    from memfit.fitting.layouts import model_shape

    rejected: list = []
    shape = shape or model_shape(make()[0], SEQ, None, points)
    found = layouts(gpus=gpus, gpus_per_node=None, global_batch=BATCH, shape=shape,
                    space=space or {}, rejected=rejected, pp_split_points=points)
    return found, rejected


def _fit(**kwargs: Any) -> Plan:
    model, batch = make()
    args: dict[str, Any] = {
        "global_batch": BATCH, "budget_bytes": 64 * 2**20, "device": "cpu", "gpus": 2,
        "progress": False, "pp_split_points": list(POINTS),
        "space": {"precision": ["fp32"], "checkpointing": ["none"], "micro_batch": [2],
                  "pp": [2]}}
    return memfit.fit(model, batch, **{**args, **kwargs})


# -- the search ----------------------------------------------------------------------------------


def test_four_stages_give_interleaved_pp_2_and_one_a_rank_pp_4() -> None:
    """3 split points on 4 GPUs: pp 4 with 1F1B and GPipe (one stage a rank), pp 2 with
    interleaved 1F1B only (two a rank), every pipeline layout split at the points, nothing
    recorded against interleaved; on 2 GPUs pp 2 interleaved alone."""
    found, rejected = _layouts(4)
    piped = {(p.pp, p.pp_schedule) for p in found if p.pp > 1}
    assert piped == {(4, "1f1b"), (4, "gpipe"), (2, "interleaved-1f1b")}
    assert all(p.pp_split_points == POINTS for p in found if p.pp > 1)
    assert not any("interleaved" in r.what for r in rejected)
    found, _ = _layouts(2)
    assert {(p.pp, p.pp_schedule) for p in found if p.pp > 1} == {(2, "interleaved-1f1b")}


def test_an_odd_number_of_stages_records_why_interleaved_is_not_searched() -> None:
    """2 split points (3 stages) on 3 GPUs: pp 3 one a rank; 3 stages do not halve, so
    interleaved 1F1B (searched by memfit's own rule at pp 3 for 6 blocks) is left out, with
    why."""
    points = ("blocks.2", "blocks.4")
    from memfit.fitting.layouts import model_shape

    shape = model_shape(make(6)[0], SEQ, None, points)
    found, rejected = _layouts(3, points, shape=shape)
    assert {(p.pp, p.pp_schedule) for p in found if p.pp > 1} == {(3, "1f1b"), (3, "gpipe")}
    assert any(r.what == "interleaved 1F1B with pp_split_points" for r in rejected)


def test_interleaved_param_share_counts_both_stages_of_a_rank() -> None:
    """6 blocks split at blocks.1, 2, 3 (stages of 1, 1, 1, 3 blocks), interleaved over 2
    ranks: rank 0 holds stages 0 and 2 (the embedding, blocks 0 and 2), rank 1 stages 1 and 3
    (blocks 1, 3, 4, 5, the norm and the head), counted by hand (an even split would put 3
    blocks on each)."""
    from memfit.fitting.layouts import model_shape

    shape = model_shape(make(6)[0], SEQ, None, POINTS)
    assert shape is not None and shape.stage_blocks == (1, 1, 1, 3)
    block = 2 * DIM + (DIM * HIDDEN + HIDDEN) + (HIDDEN * DIM + DIM)
    first, last = VOCAB * DIM + 2 * block, 4 * block + 2 * DIM + DIM * VOCAB
    assert shape.param_share(1, 2) == pytest.approx(max(first, last) / (first + last),
                                                    rel=1e-12)


def test_fit_picks_interleaved_and_its_peak_is_the_per_rank_trace() -> None:
    """fit on 2 GPUs with pp 2: the chosen layout is interleaved 1F1B over the 4 named stages,
    traced per rank, and its peak is ``memfit.estimate``'s per-rank trace of the same layout
    (4 micro-batches of 2 rows: the schedule's rounds of pp)."""
    from memfit.fitting.layouts import traced_step

    plan = _fit()
    par = plan.parallel
    assert par is not None and (par.pp, par.pp_schedule) == (2, "interleaved-1f1b")
    assert par.pp_split_points == POINTS and plan.chosen.per_rank
    rows, traced = traced_step(plan.chosen.config)
    model, batch = make()
    inputs = {k: v[:rows] for k, v in batch.items()}
    est = memfit.estimate(model, inputs, device="cpu", parallel=traced)
    assert len(est.per_rank) == 2
    assert plan.chosen.peak_bytes == est.peak_bytes


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"gpus": 6, "space": {"precision": ["fp32"], "pp": [3]}},
     r"space pp 3: pp_split_points make 4 stages, not a multiple of pp=3"),
    ({"gpus": 3, "space": {"precision": ["fp32"]}},
     r"make 4 pipeline stages, which do not divide gpus=3 \(nor half of them"),
])
def test_stages_that_are_no_multiple_of_pp_are_one_line(kwargs: dict, match: str) -> None:
    with pytest.raises(MemfitError, match=match) as info:
        _fit(**kwargs)
    assert "\n" not in str(info.value)


def test_more_than_two_stages_a_rank_is_one_line() -> None:
    """6 one-block stages at pp 2 would be 3 a rank; memfit's interleaved 1F1B runs 2."""
    points = ("blocks.1", "blocks.2", "blocks.3", "blocks.4", "blocks.5")
    model, batch = make(6)
    with pytest.raises(MemfitError, match=r"6 stages, 3 a rank; .* name 3 split points, or "
                                          r"ask for pp 6") as info:
        memfit.fit(model, batch, global_batch=BATCH, budget_bytes=64 * 2**20, device="cpu",
                   gpus=6, progress=False, pp_split_points=list(points),
                   space={"precision": ["fp32"], "pp": [2]})
    assert "\n" not in str(info.value)


def test_ep_is_searched_beside_the_split() -> None:
    """A model with experts (its shape says 4 a layer) on 4 GPUs split at one point: ep 2 is
    searched on the 2 stages' 2 data-parallel ranks as well as alone, and nothing is recorded
    against it."""
    from memfit.fitting.layouts import model_shape

    points = ("blocks.2",)
    shape = model_shape(make()[0], SEQ, None, points)
    assert shape is not None
    moe = dataclasses.replace(shape, experts=(4,) * 4, top_k=2, expert_numel=1)
    found, rejected = _layouts(4, points, shape=moe)
    assert any(p.ep == 2 and p.pp == 2 and p.pp_split_points == points for p in found)
    assert any(p.ep == 2 and p.pp == 1 for p in found)
    assert not any(r.what == "ep with pp_split_points" for r in rejected)


def test_fit_picks_ep_beside_the_split_and_its_peak_is_the_per_rank_trace() -> None:
    """A custom MoE module (4 blocks of 4 experts) on 4 GPUs split at blocks.2: fit picks
    pp 2 x ep 2 (each stage's 2 ranks keeping half the experts: the least memory), traced per
    rank, its peak ``memfit.estimate``'s per-rank trace of the same layout."""
    from memfit.fitting.layouts import traced_step

    torch.manual_seed(0)
    model = CustomMoE(4)
    ids = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids.clone()}
    plan = memfit.fit(model, batch, global_batch=BATCH, budget_bytes=64 * 2**20, device="cpu",
                      gpus=4, progress=False, pp_split_points=["blocks.2"],
                      space={"precision": ["fp32"], "checkpointing": ["none"],
                             "micro_batch": [2], "pp": [2]})
    par = plan.parallel
    assert par is not None and (par.pp, par.ep) == (2, 2) and plan.chosen.per_rank
    assert par.pp_split_points == ("blocks.2",)
    rows, traced = traced_step(plan.chosen.config)
    est = memfit.estimate(model, {k: v[:rows] for k, v in batch.items()}, device="cpu",
                          parallel=traced)
    assert plan.chosen.peak_bytes == est.peak_bytes


# -- the CLI -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_fit_takes_2_pp_stages_as_interleaved(capsys: Any, tmp_path: Path,
                                                  monkeypatch: Any) -> None:
    """``memfit fit --gpus 2 --pp 2 --pp-split`` with 3 names: 4 stages over 2 ranks, the
    saved plan interleaved 1F1B split there."""
    code, _, err = fit_cli(__file__, BATCH, capsys, tmp_path, monkeypatch, "--gpus", "2",
                           "--pp", "2", "--pp-split", ",".join(POINTS), "--save",
                           str(tmp_path / "plan.json"), "--flops", "1e9",
                           "--mem-bandwidth", "1GB/s")
    assert code == 0, err
    saved = Plan.load(tmp_path / "plan.json")
    assert saved.parallel is not None
    assert (saved.parallel.pp, saved.parallel.pp_schedule) == (2, "interleaved-1f1b")
    assert saved.parallel.pp_split_points == POINTS
