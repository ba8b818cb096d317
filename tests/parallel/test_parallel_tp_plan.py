"""Tensor parallelism from a plan: ``Parallel(tp=..., tp_plan=...)`` on a module whose names are
not memfit's (memfit/parallel/tp_plans.py), and transformers' own plans.

The custom decoder names its attention projections ``q``, ``k``, ``v``, ``proj`` and its MLP
``fc1`` / ``fc2`` (GPT-2 / nanoGPT style), so memfit's projection names find nothing and the
user's plan (Megatron's split: q/k/v/fc1 column-wise, proj/fc2 row-wise) is the only one. The
truth is a real run: 2 gloo processes, each applying the same plan with ``parallelize_module``,
measuring its step's peak (memfit/parallel/measure.py), and the same plan through
``Plan.apply`` (memfit.fitting.apply.apply_config) training like one process.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import memfit
from _custom_decoder import PLAN, PLAN_ROOT, CustomDecoder
from _pipeline import measured_within_1_percent
from memfit.errors import MemfitError
from memfit.parallel import Parallel
from memfit.recipe import Recipe

VOCAB, HIDDEN, HEADS, BATCH, SEQ = 256, 64, 4, 2, 32



def Net(vocab: int = VOCAB) -> CustomDecoder:
    return CustomDecoder(vocab, HIDDEN, HEADS)


def make() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The custom model (real, CPU; the caller seeds) and one batch."""
    model = Net()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


def _estimate(parallel: Parallel) -> memfit.Estimate:
    model, batch = make()
    return memfit.estimate(model, batch, device="cpu", parallel=parallel)


# -- the layout and its one-line errors ---------------------------------------------------------


def test_plan_round_trips_and_old_layouts_load() -> None:
    """A string plan is saved and read back; a layout file written before tp_plan (no key) reads
    as None; ParallelStyle objects cannot be saved (one line)."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    par = Parallel(gpus=2, tp=2, tp_plan=PLAN)
    data = par.to_dict()
    assert data["tp_plan"] == PLAN and Parallel.from_dict(data) == par
    old = {k: v for k, v in data.items() if k != "tp_plan"}
    assert Parallel.from_dict(old).tp_plan is None
    assert "tp_plan" not in Parallel(gpus=2, tp=2).to_dict()
    hash(par)  # the layout stays hashable
    with pytest.raises(MemfitError, match="cannot be saved") as info:
        Parallel(gpus=2, tp=2, tp_plan={"blocks.*.fc1": ColwiseParallel()}).to_dict()
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"gpus": 2, "tp_plan": PLAN}, "set tp > 1"),
    ({"gpus": 2, "tp": 2, "tp_plan": {"blocks.*.fc1": "colwize"}},
     "unknown style 'colwize' \\(did you mean 'colwise'"),
    ({"gpus": 2, "tp": 2, "tp_plan": {}}, "non-empty dict"),
])
def test_bad_plans_are_one_line_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(MemfitError, match=match) as info:
        Parallel(**kwargs)
    assert "\n" not in str(info.value)


def test_plan_naming_a_missing_module_is_one_line() -> None:
    with pytest.raises(MemfitError, match=r"'blocks\.\*\.attn\.qq', which matches no module of "
                       r"CustomDecoder \(did you mean 'blocks\.[01]\.attn\.q'") as info:
        _estimate(Parallel(gpus=2, tp=2, tp_plan={**PLAN, "blocks.*.attn.qq": "colwise"}))
    assert "\n" not in str(info.value)


def test_plan_on_a_dim_tp_does_not_divide_is_one_line() -> None:
    """fc1's 256 output features split 3 ways would be 86, 85, 85 (torch.chunk)."""
    with pytest.raises(MemfitError, match=r"blocks\.0\.fc1 \(colwise\) has 256 output "
                                          r"features, which tp=3 does not divide") as info:
        _estimate(Parallel(gpus=3, tp=3, tp_plan={"blocks.*.fc1": "colwise"}))
    assert "\n" not in str(info.value)


def test_no_plan_applies_names_the_option() -> None:
    with pytest.raises(MemfitError, match="has no tp_plan of its own; pass tp_plan=") as info:
        _estimate(Parallel(gpus=2, tp=2))
    assert "\n" not in str(info.value)


def test_plan_splits_the_named_weights() -> None:
    """From first principles: each rank holds half of every planned projection's weights
    (q/k/v/proj: 64x64, fc1/fc2: 64x256 and 256x64; colwise halves the biases too, rowwise
    keeps its bias whole), the rest whole; fp32, 4 bytes each."""
    est = _estimate(Parallel(gpus=2, tp=2, tp_plan=PLAN))
    whole = sum(p.numel() for p in Net().parameters())
    per_block_split = (2 * (64 * 64 + 64) + 2 * 64 * 64  # q, v (+bias), k, proj weight
                       + (64 * 256 + 256) + 256 * 64)  # fc1 (+bias), fc2 weight
    held = whole - 2 * per_block_split // 2
    assert len(est.per_rank) == 1 and est.per_rank[0].ranks == (0, 1)
    assert est.per_rank[0].breakdown[memfit.MemoryCategory.WEIGHTS] == 4 * held


# -- the truth: 2 gloo ranks --------------------------------------------------------------------

CASES = {"plan": Parallel(gpus=2, tp=2, tp_plan=PLAN),
         "plan-with-root": Parallel(gpus=2, tp=2, tp_plan=PLAN_ROOT)}


def _case(parallel: Parallel) -> Any:
    from memfit.parallel.measure import Case

    return Case(spec=None, batch=BATCH, seq=SEQ, recipe=Recipe(parallel=parallel), make=make)


@pytest.fixture(scope="module")
def traced() -> dict[str, memfit.Estimate]:
    return {name: _estimate(par) for name, par in CASES.items()}


@pytest.fixture(scope="module")
def gloo_runs() -> tuple[list[list[dict]], list[dict[str, Any]]]:
    """One set of 2 gloo ranks for the whole module (as tests/parallel/test_parallel_combos.py
    and tests/fitting/test_fit_parallel.py share theirs): each rank measures every case's step
    first, in a fresh process as measure() would, then runs the Plan.apply parity training.
    Returns the first measurement (per case, per rank) and each rank's parity run."""
    import json

    from memfit.parallel.gloo import spawn

    with tempfile.TemporaryDirectory() as out:
        spawn(_gloo_worker, 2, out)
        peaks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]
        parity = [torch.load(Path(out, f"rank{r}.pt")) for r in range(2)]
    return [[peaks[r][i] for r in range(2)] for i in range(len(CASES))], parity


@pytest.fixture(scope="module")
def measured(traced: dict[str, memfit.Estimate], gloo_runs: tuple) -> dict[str, list[dict]]:
    return measured_within_1_percent(traced, CASES, _case, 2, gloo_runs[0])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_user_plan_matches_real_gloo_runs_within_1_percent(name: str, traced: dict,
                                                          measured: dict) -> None:
    """Per rank, the trace's peak of the custom model's step under the user's plan is within
    1% of the real rank's (2 gloo processes, AdamW, 2 steps, the same plan)."""
    for est in traced[name].per_rank:
        for r in est.ranks:
            real = measured[name][r]["peak"]
            assert abs(est.peak_bytes - real) <= 0.01 * real, (
                f"{name} rank {r}: predicted {est.peak_bytes:,} bytes, measured {real:,}")


# -- Plan.apply: the same plan trains like one process ------------------------------------------

STEPS, RTOL, ATOL = 2, 1e-5, 5e-5
"""tests/fitting/test_fit_parallel.py's tolerance: fp32 sums in another order (the row-wise
all-reduce), each weight after two AdamW steps (lr 1e-3) within 5% of one step."""


def _train(parallel: Parallel | None, world: int) -> dict[str, Any]:
    import warnings

    from memfit.fitting import FitConfig
    from memfit.fitting.apply import apply_config
    from memfit.oom_guard import causal_lm_count

    torch.manual_seed(0)
    model, batch = make()
    cfg = FitConfig(precision="fp32", micro_batch=BATCH, accumulation=1, parallel=parallel)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _, step = apply_config(model, cfg, num_gpus=world, log_recoveries=False,
                                      count_fn=causal_lm_count)
        losses = [float(step(batch)) for _ in range(STEPS)]
    full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}
    return {"losses": losses, "weights": full}


def _gloo_worker(rank: int, world: int, out: str) -> None:
    """A rank of :func:`gloo_runs`: the measurement (memfit.parallel.measure's own worker's
    work), then the parity run."""
    import json

    from memfit.parallel.measure import rank_peaks

    peaks = rank_peaks([_case(p) for p in CASES.values()])
    Path(out, f"rank{rank}.json").write_text(json.dumps(peaks))
    torch.save(_train(CASES["plan-with-root"], world), Path(out, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def parity_runs(gloo_runs: tuple) -> list[dict[str, Any]]:
    return gloo_runs[1]


@pytest.mark.slow
def test_plan_apply_with_a_user_plan_trains_like_one_process(parity_runs: list) -> None:
    """Two AdamW steps of the custom model under the user's plan (embedding, projections and
    head split) through Plan.apply on 2 gloo ranks: the ranks' losses add up to the one-process
    loss (each tensor-parallel rank counts the shared rows once: memfit/_guard_dist.py) and
    every rank's full weights equal the one-process run's, within fp32 reordering."""
    want = _train(None, 1)
    for step in range(STEPS):
        got = sum(r["losses"][step] for r in parity_runs)
        assert got == pytest.approx(want["losses"][step], rel=RTOL, abs=ATOL)
    for r in parity_runs:
        assert set(r["weights"]) == set(want["weights"])
        for key, w in want["weights"].items():
            torch.testing.assert_close(r["weights"][key], w, rtol=RTOL, atol=ATOL)


# -- transformers' own plans --------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["llama", "mixtral", "phi3", "qwen3_next"])
def test_transformers_own_plan_traces_under_tp2(model_type: str) -> None:
    """A sample of bench/tp_sweep.py (every installed decoder with a base_model_tp_plan): the
    model's own plan applies without tp_plan= (dense, a MoE with transformers' moe_tp_experts,
    a fused gate_up packed_colwise, a gated-delta-net hybrid whose conv1d the plan leaves
    whole), and each rank holds less than the whole model's fp32 weights; Llama's, exactly
    what transformers' plan splits."""
    import sys

    sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
    from tp_sweep import run_one

    row = run_one(model_type)
    assert row["result"] == "ok", row["result"]
    assert all(0 < w < row["whole_weights"] for w in row["weights"]), row
    if model_type == "llama":
        # transformers' plan splits the embedding (embedding_rowwise), every projection and
        # the head (colwise_gather_output) in half; the norms and the rotary buffers stay whole
        from arch_sweep import tiny_config
        from transformers import LlamaForCausalLM

        with torch.device("meta"):
            model = LlamaForCausalLM(tiny_config("llama"))
        params = sum(p.numel() for p in model.parameters())
        norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
        buffers = sum(b.numel() for b in model.buffers())
        assert row["weights"] == [4 * ((params - norms) // 2 + norms + buffers)]


# -- the CLI: --tp-plan --------------------------------------------------------------------------


def _cli(capsys: Any, tmp_path: Path, *extra: str, ffn: int = 96) -> tuple[int, str, str]:
    import json

    from memfit.cli import main

    cfg = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": ffn,
           "vocab_size": 256, "max_position_embeddings": 256, "tie_word_embeddings": False}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    try:
        code = main(["plan", str(path), "--gpus", "2", "--tp", "2", "--seq", "32", "--json",
                     *extra])
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_tp_plan_splits_what_it_names(capsys: Any, tmp_path: Path) -> None:
    """``memfit plan --tp-plan FILE`` on a tiny Llama config: the plan splits the attention
    only, so each rank holds the one-GPU trace's weights less half of q/k/v/o (64x64, 64x32,
    64x32, 64x64 in each of 2 layers), 4 bytes each (fp32)."""
    import json

    from memfit.cli import main

    plan = tmp_path / "tp.json"
    plan.write_text(json.dumps({"model.layers.*.self_attn.[qkv]_proj": "colwise",
                                "model.layers.*.self_attn.o_proj": "rowwise"}))
    code, out, err = _cli(capsys, tmp_path, "--tp-plan", str(plan), "--precision", "fp32")
    assert code == 0, err
    split = json.loads(out)["per_gpu"]["breakdown"]["weights"]
    assert main(["plan", str(tmp_path / "config.json"), "--seq", "32", "--json", "--precision",
                 "fp32", "--method", "trace"]) == 0
    whole = json.loads(capsys.readouterr().out)["per_gpu"]["breakdown"]["weights"]
    attention = 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64)
    assert split == whole - 4 * attention // 2


@pytest.mark.parametrize(("plan", "needle"), [
    ('{"model.layers.*.attn.q_proj": "colwise"}', "matches no module of LlamaForCausalLM"),
    ('{"model.layers.*.self_attn.q_proj": "colwize"}', "unknown style 'colwize'"),
    ("not json", "cannot read it"),
    ("{not json", "--tp-plan: not JSON"),
])
def test_cli_bad_tp_plan_is_one_line_exit_2(capsys: Any, tmp_path: Path, plan: str,
                                            needle: str) -> None:
    code, _, err = _cli(capsys, tmp_path, "--tp-plan", plan)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err


def test_cli_tp_plan_on_a_dim_tp_does_not_divide_is_exit_2(capsys: Any, tmp_path: Path) -> None:
    """An MLP of 97 features: gate_proj column-wise over 2 ranks would split it 49 / 48."""
    code, _, err = _cli(capsys, tmp_path, "--tp-plan",
                        '{"model.layers.*.mlp.gate_proj": "colwise"}', ffn=97)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "gate_proj (colwise) has 97 output features, which tp=2 does not divide" in err
