"""``memfit.fit(..., tp_plan=...)``: the search's tensor-parallel layouts split a custom module
with the user's plan, the plan file carries it, and ``Plan.apply`` applies the same plan.

The custom decoder names its attention projections ``q``, ``k``, ``v``, ``proj`` and its MLP
``fc1`` / ``fc2`` (nanoGPT style): memfit's projection names find nothing there, so without the
plan fit searches no tensor parallelism at all. The truth is one set of 2 gloo ranks for the
whole module (tests/parallel/test_parallel_tp_plan.py's pattern): each rank measures the
fitted plan's step (memfit/parallel/measure.py), then loads the saved plan file and trains
through ``Plan.apply``, against one process.

Parity tolerance: fp32, ``rtol=1e-5, atol=5e-5`` on the loss, the gradients and the weights
after two AdamW steps (tests/fitting/test_fit_parallel.py's: the row-wise projections add
partial matmuls over split input features, a reordered fp32 sum; ``atol`` is 5% of one AdamW
step, lr 1e-3).
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
from memfit.errors import MemfitError
from memfit.fitting import Plan
from memfit.parallel import Parallel

VOCAB, HIDDEN, HEADS, BATCH, SEQ, STEPS = 128, 32, 4, 4, 16, 2
RTOL, ATOL = 1e-5, 5e-5



def Net() -> CustomDecoder:
    return CustomDecoder(VOCAB, HIDDEN, HEADS)


def make() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The custom model (real, CPU, seeded) and one batch of ``BATCH`` rows."""
    torch.manual_seed(0)
    model = Net()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return model, {"input_ids": ids, "labels": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)}


def _fit(tp_plan: Any = PLAN, **kwargs: Any) -> Plan:
    model, batch = make()
    args: dict[str, Any] = {
        "global_batch": BATCH, "budget_bytes": 64 * 2**20, "device": "cpu", "gpus": 2,
        "progress": False, "space": {"precision": ["fp32"], "checkpointing": ["none"],
                                     "micro_batch": [BATCH], "tp": [2]}}
    return memfit.fit(model, batch, tp_plan=tp_plan, **{**args, **kwargs})


@pytest.fixture(scope="module")
def fitted() -> Plan:
    return _fit()


# -- the search ----------------------------------------------------------------------------------


def test_without_a_plan_fit_finds_no_tensor_parallelism() -> None:
    """The premise: the custom names are not memfit's, so the layout search splits nothing
    (tp 1 only) without a plan, and with it every block has its planned linear layers."""
    from memfit.fitting.layout_space import layouts
    from memfit.fitting.layouts import model_shape

    model, _ = make()
    bare, planned = model_shape(model, SEQ), model_shape(model, SEQ, PLAN)
    assert bare is not None and not bare.tp_splittable
    assert planned is not None and planned.tp_splittable
    rejected: list = []
    found = layouts(gpus=2, gpus_per_node=None, global_batch=BATCH, shape=bare, space={},
                    rejected=rejected)
    assert {p.tp for p in found} == {1}
    assert any(r.what == "tensor parallelism" for r in rejected)
    # (elements split, elements kept) per block: the plan's weights and column-wise biases
    # (q, v, fc1) split; the row-wise biases (proj, fc2) and the two LayerNorms kept whole
    h = HIDDEN
    split = 4 * h * h + 2 * h + 4 * h * h + 4 * h + 4 * h * h
    assert planned.block_numels[0] == (split, 2 * h + 4 * h)


def test_fit_searches_tp_with_the_users_plan_and_saves_it(fitted: Plan, tmp_path: Path) -> None:
    """The chosen tp 2 layout carries the plan, its peak is the per-rank trace's, and the plan
    file round-trips it (string styles); from first principles each rank's weights are the
    whole model's less half of every planned projection (q, v, proj, fc1 with biases split
    column-wise, the row-wise biases whole), fp32."""
    par = fitted.parallel
    assert par is not None and par.tp == 2 and par.tp_plan == PLAN
    assert fitted.chosen.per_rank
    fitted.save(tmp_path / "plan.json")
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["chosen"]["config"]["parallel"]["tp_plan"] == PLAN
    again = Plan.load(tmp_path / "plan.json")
    assert again.parallel == par and again == fitted
    est = memfit.estimate(*make(), device="cpu", parallel=par)
    whole = sum(p.numel() for p in Net().parameters())
    h = HIDDEN
    per_block_split = (2 * (h * h + h) + h * h + h * h  # q, v (+bias), k, proj's weight
                       + (h * 4 * h + 4 * h) + 4 * h * h)  # fc1 (+bias), fc2's weight
    assert est.per_rank[0].breakdown[memfit.MemoryCategory.WEIGHTS] == \
        4 * (whole - 2 * per_block_split // 2)


def test_fit_with_style_objects_refuses_to_save_in_one_line(tmp_path: Path) -> None:
    """torch's ParallelStyle objects run in the search and the chosen layout, but a plan file
    holds names only: saving says so in one line."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    objects = {k: ColwiseParallel() if v == "colwise" else RowwiseParallel()
               for k, v in PLAN.items()}
    plan = _fit(objects)
    assert plan.parallel is not None and plan.parallel.tp_plan == objects
    with pytest.raises(MemfitError, match="cannot be saved; name the styles") as info:
        plan.save(tmp_path / "plan.json")
    assert "\n" not in str(info.value)


def test_layouts_keep_the_plan_off_pipelines() -> None:
    """memfit's builtin decoder under a user plan of its own names: tp > 1 layouts carry it,
    tp x pp ones are left out with the reason (apply.tp_plan splits stages by memfit's names)."""
    from memfit.fitting.layout_space import layouts
    from memfit.fitting.layouts import model_shape
    from memfit.models.build import build_model
    from memfit.parallel.measure import tiny_spec

    model = build_model(tiny_spec(), backend="builtin", device="meta")
    plan = {"model.layers.*.self_attn.[qkv]_proj": "colwise",
            "model.layers.*.self_attn.o_proj": "rowwise"}
    shape = model_shape(model, SEQ, plan)
    assert shape is not None and shape.tp_splittable and not shape.sp_splittable
    rejected: list = []
    found = layouts(gpus=4, gpus_per_node=None, global_batch=8, shape=shape, space={},
                    rejected=rejected, tp_plan=plan)
    assert {(p.tp, p.pp) for p in found} == {(1, 1), (1, 2), (1, 4), (2, 1), (4, 1)} - {(1, 4)}
    assert all(p.tp_plan == plan for p in found if p.tp > 1)
    assert all(p.tp_plan is None for p in found if p.tp == 1)
    assert any(r.what == "tp_plan under a pipeline" for r in rejected)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"tp_plan": {**PLAN, "blocks.*.attn.qq": "colwise"}},
     r"'blocks\.\*\.attn\.qq', which matches no module of CustomDecoder"),
    ({"tp_plan": {"blocks.*.fc1": "colwize"}}, "unknown style 'colwize'"),
    ({"gpus": None}, "search several GPUs with gpus=N"),
    ({"space": {"precision": ["fp32"], "tp": [1]}}, "leaves no tp > 1 layout"),
])
def test_bad_fit_plans_are_one_line(kwargs: dict, match: str) -> None:
    with pytest.raises(MemfitError, match=match) as info:
        _fit(**kwargs)
    assert "\n" not in str(info.value)


# -- the truth: 2 gloo ranks ----------------------------------------------------------------------


def _case(par: Parallel) -> Any:
    from memfit.parallel.measure import Case
    from memfit.recipe import Recipe

    return Case(spec=None, batch=BATCH, seq=SEQ, recipe=Recipe(parallel=par), make=make)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _train(plan: Plan | None) -> dict[str, Any]:
    """Two steps of ``plan.apply`` (one process's plain AdamW step without a plan): the losses,
    the first step's full gradients and the full weights after the steps."""
    from memfit.fitting import FitConfig
    from memfit.fitting.apply import apply_config
    from memfit.oom_guard import causal_lm_count

    model, batch = make()
    grads: list[dict[str, torch.Tensor]] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if plan is None:
            cfg = FitConfig(precision="fp32", micro_batch=BATCH, accumulation=1)
            model, opt, step = apply_config(model, cfg, num_gpus=1, log_recoveries=False,
                                            count_fn=causal_lm_count)
        else:
            model, opt, step = plan.apply(model, count_fn=causal_lm_count, log=False)
        # every rank runs the hook at the same point: full_tensor's all-gather lines up
        opt.register_step_pre_hook(lambda *_: grads.append(
            {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}))
        losses = [float(step(batch)) for _ in range(STEPS)]
    return {"losses": losses, "grads": grads[0],
            "weights": {n: _full(p) for n, p in model.named_parameters()}}


def _gloo_worker(rank: int, world: int, plan_file: str, out: str) -> None:
    """A rank: the fitted layout's step measured (memfit.parallel.measure's worker's work),
    then the saved plan trained through Plan.apply."""
    from memfit.parallel.measure import rank_peaks

    plan = Plan.load(plan_file)
    assert plan.parallel is not None
    Path(out, f"rank{rank}.json").write_text(json.dumps(rank_peaks([_case(plan.parallel)])))
    torch.save(_train(plan), Path(out, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def gloo_runs(fitted: Plan) -> tuple[list[list[dict]], list[dict[str, Any]]]:
    """The one set of 2 gloo ranks of this module: (the measured peaks, per case per rank;
    each rank's Plan.apply run)."""
    from memfit.parallel.gloo import spawn

    with tempfile.TemporaryDirectory() as out:
        plan_file = str(Path(out, "plan.json"))
        fitted.save(plan_file)
        spawn(_gloo_worker, 2, plan_file, out)
        peaks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]
        runs = [torch.load(Path(out, f"rank{r}.pt")) for r in range(2)]
    return [[peaks[r][0] for r in range(2)]], runs


@pytest.mark.slow
def test_fitted_peak_matches_real_gloo_ranks_within_1_percent(fitted: Plan,
                                                              gloo_runs: tuple) -> None:
    """The plan's peak (the per-rank trace of its step under the user's plan, the worst rank)
    is within 1% of each real rank's measured peak (2 gloo processes, AdamW, 2 steps)."""
    from memfit.parallel.measure import measure_until

    predicted = fitted.chosen.peak_bytes

    def off(_case: Any, got: list[dict]) -> bool:
        return any(abs(predicted - r["peak"]) > 0.01 * r["peak"] for r in got)

    assert fitted.parallel is not None
    [measured] = measure_until([_case(fitted.parallel)], 2, off, first=gloo_runs[0])
    for r, got in enumerate(measured):
        print(f"rank {r}: planned {predicted:,} bytes, measured {got['peak']:,}")
        assert abs(predicted - got["peak"]) <= 0.01 * got["peak"], (
            f"rank {r}: planned {predicted:,} bytes, measured {got['peak']:,}")


@pytest.mark.slow
def test_plan_apply_of_the_fitted_plan_trains_like_one_process(gloo_runs: tuple) -> None:
    """The saved plan through Plan.apply on 2 gloo ranks: the ranks' losses add up to the
    one-process loss (each tensor-parallel rank counts the shared rows once:
    memfit/_guard_dist.py), and every rank's full gradients of the first step and full weights
    after two AdamW steps equal the one-process run's (module docstring's tolerance)."""
    want = _train(None)
    runs = gloo_runs[1]
    for step in range(STEPS):
        got = sum(r["losses"][step] for r in runs)
        assert got == pytest.approx(want["losses"][step], rel=RTOL, abs=ATOL)
    assert len(want["grads"]) == len(want["weights"])  # every parameter got a gradient
    for r in runs:
        for what in ("grads", "weights"):
            assert set(r[what]) == set(want[what])
            for key, w in want[what].items():
                torch.testing.assert_close(r[what][key], w, rtol=RTOL, atol=ATOL,
                                           msg=lambda m, k=key, x=what: f"{x} {k}: {m}")


# -- the CLI: memfit fit --tp-plan ----------------------------------------------------------------


def _cli(capsys: Any, tmp_path: Path, monkeypatch: Any, *extra: str) -> tuple[int, str, str]:
    return fit_cli(__file__, BATCH, capsys, tmp_path, monkeypatch, *extra)


@pytest.mark.slow
def test_cli_fit_takes_a_tp_plan_and_saves_it(capsys: Any, tmp_path: Path,
                                              monkeypatch: Any) -> None:
    plan_file = tmp_path / "tp.json"
    plan_file.write_text(json.dumps(PLAN))
    code, _, err = _cli(capsys, tmp_path, monkeypatch, "--gpus", "2", "--tp", "2",
                        "--tp-plan", str(plan_file), "--save", str(tmp_path / "plan.json"),
                        "--flops", "1e9", "--mem-bandwidth", "1GB/s")
    assert code == 0, err
    saved = Plan.load(tmp_path / "plan.json")
    assert saved.parallel is not None and saved.parallel.tp == 2
    assert saved.parallel.tp_plan == PLAN


@pytest.mark.parametrize(("extra", "needle"), [
    (["--gpus", "2", "--tp-plan", '{"blocks.*.attn.qq": "colwise"}'],
     "matches no module of CustomDecoder"),
    (["--gpus", "2", "--tp-plan", "{nope"], "--tp-plan: not JSON"),
    (["--tp-plan", json.dumps(PLAN)], "add --gpus N"),
])
def test_cli_fit_bad_tp_plan_is_one_line_exit_2(capsys: Any, tmp_path: Path, monkeypatch: Any,
                                                extra: list[str], needle: str) -> None:
    code, _, err = _cli(capsys, tmp_path, monkeypatch, *extra)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
