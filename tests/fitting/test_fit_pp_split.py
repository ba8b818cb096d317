"""``memfit.fit(..., pp_split_points=[...])``: the search's pipeline layouts split any module at
the user's split points (with the user's tp plan in each stage: tp x pp), the plan file carries
them, and ``Plan.apply`` splits there.

The custom decoder (tests/_custom_decoder.py, returning its logits as a model split into stages
does) is one memfit's own pipeline rule does not split: without split points fit searches no
pipeline for it. The truth is one set of 2 gloo ranks for the whole module: each rank measures
the fitted layout's step (memfit/parallel/measure.py), then loads the saved plan file and trains
through ``Plan.apply``, against one process.

Parity tolerance: tests/fitting/test_fit_pipeline_split.py's (fp32; the loss within
``rtol=1e-5``, every weight after two AdamW steps within ``rtol=1e-5, atol=5e-5``): a pipeline
adds each micro-batch's token-loss sum in another order than one process's mean over the batch.
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
from _custom_decoder import PLAN, CustomDecoder
from _fit_cli import fit_cli
from _models import CustomDecoder as ThreeBlocks
from _pipeline import assert_trains_like_one_process
from memfit.errors import MemfitError
from memfit.fitting import Plan
from memfit.parallel import Parallel

VOCAB, HIDDEN, HEADS, BATCH, SEQ, STEPS = 128, 32, 4, 4, 16, 2
RTOL, ATOL = 1e-5, 5e-5
SPLIT = ["blocks.1"]


def make() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The custom model (real, CPU, seeded) and one batch of ``BATCH`` rows, some labels
    ignored (micro-batches with different token counts: the weighting matters)."""
    torch.manual_seed(0)
    model = CustomDecoder(VOCAB, HIDDEN, HEADS, logits=True)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels[0, :5] = -100
    return model, {"input_ids": ids, "labels": labels}


def _fit(pp_split_points: Any = SPLIT, **kwargs: Any) -> Plan:
    model, batch = make()
    args: dict[str, Any] = {
        "global_batch": BATCH, "budget_bytes": 64 * 2**20, "device": "cpu", "gpus": 2,
        "progress": False, "space": {"precision": ["fp32"], "checkpointing": ["none"],
                                     "micro_batch": [BATCH // 2], "pp": [2]}}
    return memfit.fit(model, batch, pp_split_points=pp_split_points, **{**args, **kwargs})


@pytest.fixture(scope="module")
def fitted() -> Plan:
    return _fit()


def _traced(plan: Plan) -> Parallel:
    """The layout the plan's step runs (its accumulation as the schedule's micro-batches:
    memfit.fitting.layouts.traced_step)."""
    from memfit.fitting.layouts import traced_step

    return traced_step(plan.chosen.config)[1]


# -- the search ----------------------------------------------------------------------------------


def test_without_split_points_fit_finds_no_pipeline() -> None:
    """The premise: memfit's pipeline rule splits its builtin decoders, so the custom module
    gets pp 1 only (the reason recorded), and with split points pp 2 (1F1B and GPipe)."""
    from memfit.fitting.layout_space import layouts
    from memfit.fitting.layouts import model_shape

    model, _ = make()
    rejected: list = []
    found = layouts(gpus=2, gpus_per_node=None, global_batch=BATCH,
                    shape=model_shape(model, SEQ), space={}, rejected=rejected)
    assert {p.pp for p in found} == {1}
    assert any(r.what == "pipeline parallelism" for r in rejected)
    found = layouts(gpus=2, gpus_per_node=None, global_batch=BATCH,
                    shape=model_shape(model, SEQ, None, ("blocks.1",)), space={},
                    rejected=[], pp_split_points=("blocks.1",))
    staged = [p for p in found if p.pp == 2]
    assert sorted(p.pp_schedule for p in staged) == ["1f1b", "gpipe"]
    assert all(p.pp_split_points == ("blocks.1",) for p in staged)


def test_fit_searches_the_users_split_and_saves_it(fitted: Plan, tmp_path: Path) -> None:
    """The chosen layout is pp 2 split at blocks.1, traced per rank, and the plan file
    round-trips the split points."""
    par = fitted.parallel
    assert par is not None and par.pp == 2 and par.pp_split_points == ("blocks.1",)
    assert fitted.chosen.per_rank
    fitted.save(tmp_path / "plan.json")
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["chosen"]["config"]["parallel"]["pp_split_points"] == ["blocks.1"]
    again = Plan.load(tmp_path / "plan.json")
    assert again.parallel == par


def test_tp_x_pp_layouts_take_the_plan_in_each_stage() -> None:
    """With a tp plan and split points, 4 GPUs: tp 2 x pp 2 layouts are searched with both (no
    more 'tp_plan under a pipeline'), interleaved 1F1B is left out with why, and fit picks a
    tp 2 x pp 2 layout whose peak is its per-rank trace's."""
    from memfit.fitting.layout_space import layouts
    from memfit.fitting.layouts import model_shape

    model, _ = make()
    points = ("blocks.1",)
    rejected: list = []
    found = layouts(gpus=4, gpus_per_node=None, global_batch=BATCH,
                    shape=model_shape(model, SEQ, PLAN, points), space={}, rejected=rejected,
                    tp_plan=PLAN, pp_split_points=points)
    both = [p for p in found if p.tp == 2 and p.pp == 2]
    assert both and all(p.tp_plan == PLAN and p.pp_split_points == points for p in both)
    assert {p.pp for p in found} == {1, 2}
    assert not any(r.what == "tp_plan under a pipeline" for r in rejected)
    plan = _fit(gpus=4, tp_plan=PLAN, space={"precision": ["fp32"], "checkpointing": ["none"],
                                             "micro_batch": [BATCH // 2], "tp": [2],
                                             "pp": [2]})
    par = plan.parallel
    assert par is not None and (par.tp, par.pp) == (2, 2) and plan.chosen.per_rank
    assert par.tp_plan == PLAN and par.pp_split_points == points
    est = memfit.estimate(*make(), device="cpu", parallel=_traced(plan))
    assert plan.chosen.peak_bytes == est.peak_bytes


def test_uneven_split_sets_the_stage_shares() -> None:
    """3 blocks split at blocks.1: stage 0 the embedding and one block, stage 1 two blocks, the
    norm and the head; the most loaded rank's parameter share counted by hand (memfit's even
    split would put two blocks on stage 0)."""
    from memfit.fitting.layouts import model_shape

    d, hidden, vocab = 32, 64, 256
    shape = model_shape(ThreeBlocks(3, dim=d, hidden=hidden, vocab=vocab), SEQ, None,
                        ("blocks.1",))
    assert shape is not None and shape.stage_blocks == (1, 2)
    block = 2 * d + (d * hidden + hidden) + (hidden * d + d)
    first, last = vocab * d + block, 2 * block + 2 * d + d * vocab
    assert shape.param_share(1, 2) == pytest.approx(max(first, last) / (first + last), rel=1e-12)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"pp_split_points": ["blocks.9"]}, r"'blocks\.9' is not a submodule of CustomDecoder"),
    ({"pp_split_points": ["blocks.1", "blocks.1"]}, "give increasing elements"),
    ({"gpus": 3, "space": {"precision": ["fp32"]}},
     r"make 2 pipeline stages, which do not divide gpus=3"),
    ({"pp_split_points": "blocks.1"}, "give a list of module names"),
    ({"gpus": None}, "search them with gpus=N"),
    ({"space": {"precision": ["fp32"], "pp": [4]}, "gpus": 4},
     r"space pp 4: pp_split_points make 2 stages, not a multiple of pp=4"),
])
def test_bad_fit_split_points_are_one_line(kwargs: dict, match: str) -> None:
    with pytest.raises(MemfitError, match=match) as info:
        _fit(**kwargs)
    assert "\n" not in str(info.value)


# -- the truth: 2 gloo ranks ----------------------------------------------------------------------


def _case(par: Parallel) -> Any:
    from memfit.parallel.measure import Case
    from memfit.recipe import Recipe

    return Case(spec=None, batch=BATCH, seq=SEQ, recipe=Recipe(parallel=par), make=make)


def _train(plan: Plan | None) -> dict[str, Any]:
    """Two steps of ``plan.apply`` (one process with the pipeline's loss, next-token
    cross-entropy over the labelled tokens, without a plan): the losses and the weights."""
    from memfit.fitting import FitConfig
    from memfit.fitting.apply import apply_config
    from memfit.oom_guard import causal_lm_count
    from memfit.parallel.pipeline import stage_loss

    model, batch = make()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if plan is None:
            def loss_fn(m: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
                return stage_loss(m(b["input_ids"]), b["labels"])
            cfg = FitConfig(precision="fp32", micro_batch=BATCH, accumulation=1)
            _, _, step = apply_config(model, cfg, num_gpus=1, log_recoveries=False,
                                      count_fn=causal_lm_count, loss_fn=loss_fn)
        else:
            _, _, step = plan.apply(model, count_fn=causal_lm_count, log=False)
        losses = [float(step(batch)) for _ in range(STEPS)]
    return {"losses": losses,
            "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _gloo_worker(rank: int, world: int, plan_file: str, out: str) -> None:
    """A rank: the fitted layout's step measured, then the saved plan trained via Plan.apply."""
    from memfit.parallel.measure import rank_peaks

    plan = Plan.load(plan_file)
    Path(out, f"rank{rank}.json").write_text(json.dumps(rank_peaks([_case(_traced(plan))])))
    torch.save(_train(plan), Path(out, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def gloo_runs(fitted: Plan) -> tuple[list[list[dict]], list[dict[str, Any]]]:
    """The one set of 2 gloo ranks of this module: (the measured peaks, per rank; each rank's
    Plan.apply run)."""
    from memfit.parallel.gloo import spawn

    with tempfile.TemporaryDirectory() as out:
        plan_file = str(Path(out, "plan.json"))
        fitted.save(plan_file)
        spawn(_gloo_worker, 2, plan_file, out)
        peaks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]
        runs = [torch.load(Path(out, f"rank{r}.pt")) for r in range(2)]
    return [[peaks[r][0] for r in range(2)]], runs


@pytest.mark.slow
def test_fitted_stages_match_real_gloo_ranks_within_1_percent(fitted: Plan,
                                                              gloo_runs: tuple) -> None:
    """Each stage's per-rank trace of the fitted layout is within 1% of its real rank's
    measured peak, and the plan's peak (the worst rank's) within 1% of the worst real rank
    (2 gloo processes, 1F1B over 2 micro-batches, AdamW, 2 steps)."""
    from memfit.parallel.measure import measure_until

    par = _traced(fitted)
    est = memfit.estimate(*make(), device="cpu", parallel=par)

    def off(_case: Any, got: list[dict]) -> bool:
        return any(abs(e.peak_bytes - got[r]["peak"]) > 0.01 * got[r]["peak"]
                   for e in est.per_rank for r in e.ranks)

    [measured] = measure_until([_case(par)], 2, off, first=gloo_runs[0])
    for e in est.per_rank:
        for r in e.ranks:
            real = measured[r]["peak"]
            print(f"rank {r}: traced {e.peak_bytes:,} bytes, measured {real:,}")
            assert abs(e.peak_bytes - real) <= 0.01 * real, (r, e.peak_bytes, real)
    worst = max(m["peak"] for m in measured)
    assert abs(fitted.chosen.peak_bytes - worst) <= 0.01 * worst


@pytest.mark.slow
def test_plan_apply_of_the_fitted_split_trains_like_one_process(gloo_runs: tuple) -> None:
    """The saved plan through Plan.apply on 2 gloo ranks: the ranks' returned losses add up to
    the one-process loss, and each parameter, held by the rank of its one stage, equals the
    one-process run's after two AdamW steps (module docstring's tolerance)."""
    assert_trains_like_one_process(gloo_runs[1], _train(None), STEPS, RTOL, ATOL, 1)


# -- the CLI: memfit fit --pp-split ---------------------------------------------------------------


def _cli(capsys: Any, tmp_path: Path, monkeypatch: Any, *extra: str) -> tuple[int, str, str]:
    return fit_cli(__file__, BATCH, capsys, tmp_path, monkeypatch, *extra)


@pytest.mark.slow
def test_cli_fit_takes_split_points_and_saves_them(capsys: Any, tmp_path: Path,
                                                   monkeypatch: Any) -> None:
    code, _, err = _cli(capsys, tmp_path, monkeypatch, "--gpus", "2", "--pp", "2",
                        "--pp-split", "blocks.1", "--save", str(tmp_path / "plan.json"),
                        "--flops", "1e9", "--mem-bandwidth", "1GB/s")
    assert code == 0, err
    saved = Plan.load(tmp_path / "plan.json")
    assert saved.parallel is not None and saved.parallel.pp == 2
    assert saved.parallel.pp_split_points == ("blocks.1",)


@pytest.mark.parametrize(("extra", "needle"), [
    (["--pp-split", "blocks.1"], "add --gpus N"),
    (["--gpus", "2", "--pp-split", "blocks.9"], "'blocks.9' is not a submodule"),
    (["--gpus", "2", "--pp", "2", "--pp-split", "blocks.1,blocks.2"],
     "--pp-split names 2 split point(s); --pp 2"),
    (["--gpus", "2", "--pp-split", "blocks.1,"], "an empty name"),
])
def test_cli_fit_bad_split_is_one_line_exit_2(capsys: Any, tmp_path: Path, monkeypatch: Any,
                                              extra: list[str], needle: str) -> None:
    code, _, err = _cli(capsys, tmp_path, monkeypatch, *extra)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
