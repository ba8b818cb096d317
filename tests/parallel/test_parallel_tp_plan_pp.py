"""A user's tensor-parallel plan inside each pipeline stage: ``Parallel(pp=2, tp=2,
pp_split_points=[...], tp_plan=...)`` on a custom module (memfit/parallel/tp_plans.py:
``stage_plan``; torchtitan's order: split into stages, then ``parallelize_module`` on each).

The custom decoder names its projections ``q``, ``k``, ``v``, ``proj``, ``fc1``, ``fc2`` (none
of memfit's names) and returns its logits, as a model split into stages does (the last stage's
loss is next-token cross-entropy on ``labels``). The truth is one set of 4 gloo ranks for the
whole module (the ``(pp, tp)`` mesh): each rank measures every case's step
(memfit/parallel/measure.py), then trains through ``Plan.apply`` against one process.

Parity tolerance: tests/fitting/test_fit_pipeline_split.py's (fp32; the loss within
``rtol=1e-5``, every weight after two AdamW steps within ``rtol=1e-5, atol=5e-5``): the pipeline
adds each micro-batch's token-loss sum, and the row-wise projections their partial matmuls, in
another order than one process.
"""

from __future__ import annotations

import json
import tempfile
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import memfit
from _custom_decoder import PLAN, PLAN_ROOT, CustomDecoder
from _pipeline import assert_trains_like_one_process, measured_within_1_percent
from memfit.errors import MemfitError
from memfit.parallel import Parallel

VOCAB, HIDDEN, HEADS, BATCH, SEQ, STEPS = 128, 32, 4, 4, 16, 2
RTOL, ATOL = 1e-5, 5e-5



def Net() -> CustomDecoder:
    return CustomDecoder(VOCAB, HIDDEN, HEADS, logits=True)


def make() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The custom model (real, CPU, seeded) and one batch of ``BATCH`` rows, some labels
    ignored (micro-batches with different token counts: the weighting matters)."""
    torch.manual_seed(0)
    model = Net()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels[0, :5] = -100
    return model, {"input_ids": ids, "labels": labels}


def _par(plan: dict[str, str] | None = PLAN, **kwargs: Any) -> Parallel:
    args: dict[str, Any] = {"gpus": 4, "pp": 2, "tp": 2, "microbatches": 2,
                            "pp_split_points": ["blocks.1"], "tp_plan": plan}
    return Parallel(**{**args, **kwargs})


def _estimate(parallel: Parallel, model: nn.Module | None = None) -> memfit.Estimate:
    made, batch = make()
    return memfit.estimate(model or made, batch, device="cpu", parallel=parallel)


# -- the layout and its one-line errors ---------------------------------------------------------


def test_each_stage_splits_its_own_part_of_the_plan() -> None:
    """From first principles, against the same split without tp: each stage's ranks hold half
    of the weights the plan splits on that stage (stage 0: the embedding's 128 x 32 rows and
    block 0's projections; stage 1: block 1's projections and the head's 32 x 128 weight and
    128 bias), fp32, and nothing else moves."""
    alone = _estimate(Parallel(gpus=2, pp=2, microbatches=2, pp_split_points=["blocks.1"]))
    split = _estimate(_par(PLAN_ROOT))
    weights = memfit.MemoryCategory.WEIGHTS
    h = HIDDEN
    block = 3 * h * h + 2 * h + h * h + 4 * h * h + 4 * h + 4 * h * h  # q k v proj fc1 fc2
    halves = [(VOCAB * h + block) // 2, (block + h * VOCAB + VOCAB) // 2]
    for stage, (one, tp2) in enumerate(zip(alone.per_rank, split.per_rank, strict=True)):
        assert one.breakdown[weights] - tp2.breakdown[weights] == 4 * halves[stage], stage


@pytest.mark.parametrize(("parallel", "match"), [
    (lambda: _par(None), r"use tp=1 or tp_plan="),
    (lambda: _par({**PLAN, "blocks.*.attn.qq": "colwise"}),
     r"'blocks\.\*\.attn\.qq', which matches no module of CustomDecoder"),
    (lambda: _par(PLAN, sp=True), r"no sp or loss_parallel"),
])
def test_bad_stage_plans_are_one_line(parallel: Any, match: str) -> None:
    with pytest.raises(MemfitError, match=match) as info:
        _estimate(parallel())
    assert "\n" not in str(info.value)


def test_a_user_plan_on_memfits_own_stages_names_the_split_points() -> None:
    """memfit's builtin decoder split by its own rule holds stages whose module names are not
    the model's (``layers.<i>``): a user plan there asks for split points, in one line."""
    from memfit.models.build import build_model
    from memfit.parallel.measure import tiny_spec

    model = build_model(tiny_spec(2), backend="builtin", device="meta")
    par = Parallel(gpus=4, pp=2, tp=2, microbatches=2,
                   tp_plan={"model.layers.*.self_attn.q_proj": "colwise"})
    with pytest.raises(MemfitError, match="name the split points too") as info:
        memfit.estimate(model, {"input_ids": torch.zeros(4, SEQ, dtype=torch.long,
                                                         device="meta")},
                        device="cpu", parallel=par)
    assert "\n" not in str(info.value)


# -- the truth: 4 gloo ranks ---------------------------------------------------------------------

CASES = {"plan": _par(PLAN), "plan-with-root": _par(PLAN_ROOT)}


def _case(parallel: Parallel) -> Any:
    from memfit.parallel.measure import Case
    from memfit.recipe import Recipe

    return Case(spec=None, batch=BATCH, seq=SEQ, recipe=Recipe(parallel=parallel), make=make)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _train(parallel: Parallel | None, world: int) -> dict[str, Any]:
    """Two steps through Plan.apply's path (memfit.fitting.apply.apply_config); without a
    layout, one process with the pipeline's loss (next-token cross-entropy, mean over the
    labelled tokens)."""
    from memfit.fitting import FitConfig
    from memfit.fitting.apply import apply_config
    from memfit.oom_guard import causal_lm_count
    from memfit.parallel.pipeline import stage_loss

    model, batch = make()
    loss_fn = None
    if parallel is None:
        def loss_fn(m: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
            return stage_loss(m(b["input_ids"]), b["labels"])
        cfg = FitConfig(precision="fp32", micro_batch=BATCH, accumulation=1)
    else:
        cfg = FitConfig(precision="fp32", micro_batch=BATCH // 2, accumulation=2,
                        parallel=parallel)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, _, step = apply_config(model, cfg, num_gpus=world, log_recoveries=False,
                                  count_fn=causal_lm_count, loss_fn=loss_fn)
        losses = [float(step(batch)) for _ in range(STEPS)]
    return {"losses": losses,
            "weights": {n: _full(p) for n, p in model.named_parameters() if p.numel()}}


def _gloo_worker(rank: int, world: int, out: str) -> None:
    """A rank of :func:`gloo_runs`: every case's step measured, then the Plan.apply run."""
    from memfit.parallel.measure import rank_peaks

    peaks = rank_peaks([_case(p) for p in CASES.values()])
    Path(out, f"rank{rank}.json").write_text(json.dumps(peaks))
    torch.save(_train(CASES["plan-with-root"], world), Path(out, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def traced() -> dict[str, memfit.Estimate]:
    return {name: _estimate(par) for name, par in CASES.items()}


@pytest.fixture(scope="module")
def gloo_runs() -> tuple[list[list[dict]], list[dict[str, Any]]]:
    """The one set of 4 gloo ranks of this module: (the measured peaks per case per rank; each
    rank's Plan.apply run)."""
    from memfit.parallel.gloo import spawn

    with tempfile.TemporaryDirectory() as out:
        spawn(_gloo_worker, 4, out)
        peaks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(4)]
        runs = [torch.load(Path(out, f"rank{r}.pt")) for r in range(4)]
    return [[peaks[r][i] for r in range(4)] for i in range(len(CASES))], runs


@pytest.fixture(scope="module")
def measured(traced: dict[str, memfit.Estimate], gloo_runs: tuple) -> dict[str, list[dict]]:
    return measured_within_1_percent(traced, CASES, _case, 4, gloo_runs[0])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_stage_plans_match_real_gloo_ranks_within_1_percent(name: str, traced: dict,
                                                            measured: dict) -> None:
    """Per rank of the (pp 2, tp 2) mesh, the trace's peak is within 1% of the real rank's
    (4 gloo processes, 1F1B over 2 micro-batches, AdamW, 2 steps, the same stages and plan)."""
    for est in traced[name].per_rank:
        for r in est.ranks:
            real = measured[name][r]["peak"]
            print(f"{name} rank {r}: traced {est.peak_bytes:,} bytes, measured {real:,}")
            assert abs(est.peak_bytes - real) <= 0.01 * real, (
                f"{name} rank {r}: predicted {est.peak_bytes:,} bytes, measured {real:,}")


@pytest.mark.slow
def test_plan_apply_with_stage_plans_trains_like_one_process(gloo_runs: tuple) -> None:
    """Two AdamW steps of the split model under the user's plan (embedding, projections and
    head split) through Plan.apply on the 4 ranks: the ranks' losses add up to the one-process
    loss, and each parameter, held by the 2 tensor-parallel ranks of its one stage, equals the
    one-process run's (module docstring's tolerance)."""
    assert_trains_like_one_process(gloo_runs[1], _train(None, 1), STEPS, RTOL, ATOL, 2)
