"""One layout type for the house: ``memfit.Parallel``.

The formulas' run (``RunConfig``), the exporters' settings (``export.PlanSettings``) and fit's
plan (``Plan``) each hold a ``Parallel`` and no layout field of their own; the CLI turns its
layout flags into a ``Parallel`` in one place (``memfit/cli/layout.py: parallel_from_args``);
plan files written before the layout was one type (flat ``gpus``, ``zero``, ``tp``, ...) still
load. Expected layouts are written by hand from the flags (e.g. ``--gpus 16 --tp 2 --fsdp 4``:
16 / tp 2 = 8 data-parallel ranks, sharded in groups of 4, so 2 HSDP replicas).
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from memfit import Parallel, Recipe, RunConfig
from memfit.analytic.config import relayout
from memfit.cli import build_parser, main
from memfit.cli.layout import parallel_from_args
from memfit.cli.plan import run_config
from memfit.errors import MemfitError
from memfit.export import PlanSettings, export_plan
from memfit.export.settings import settings_from_dict
from memfit.fitting.config import FitConfig
from memfit.fitting.cost import StepCost
from memfit.fitting.plan import Candidate, Plan

OLD_LAYOUT_FIELDS = {"gpus", "gpus_per_node", "tp", "pp", "ep", "zero", "replicate",
                     "sequence_parallel", "fsdp", "dp"}


def fit_plan(config: FitConfig, num_gpus: int, global_batch: int) -> Plan:
    cost = StepCost(compute_s=1.0, traffic_s=0.0, transfer_s=0.0, comm_s=0.0, dispatch_s=0.0,
                    optimizer_s=0.0)
    return Plan(chosen=Candidate(config=config, peak_bytes=2**30, cost=cost), runners_up=(),
                rejected=(), budget_bytes=2**31, global_batch=global_batch, num_gpus=num_gpus,
                device="cuda", gpu="h100-80gb", rates_source="test")


def test_run_settings_and_plan_hold_a_parallel_and_no_layout_fields_of_their_own():
    for cls in (RunConfig, PlanSettings, Recipe):
        names = {f.name for f in dataclasses.fields(cls)}
        assert "parallel" in names or "recipe" in names  # PlanSettings: its recipe's
        assert not names & OLD_LAYOUT_FIELDS, cls.__name__
    assert RunConfig().parallel == Parallel(gpus=1)
    assert PlanSettings(source="plan").parallel == Parallel(gpus=1)
    layout = Parallel(gpus=16, gpus_per_node=8, tp=2, fsdp=4)
    run = RunConfig(parallel=layout)
    assert type(run.parallel) is Parallel and run.parallel is layout
    # The formulas' views read it: 16 / tp 2 = 8 data-parallel ranks.
    assert (run.gpus, run.tp, run.pp, run.dp, run.zero, run.sequence_parallel) == (
        16, 2, 1, 8, 0, False)
    plan = fit_plan(FitConfig(precision="bf16-mixed", micro_batch=2, sharding="hsdp",
                              parallel=layout), num_gpus=16, global_batch=2 * 8)
    assert type(plan.parallel) is Parallel and plan.parallel == layout
    one = fit_plan(FitConfig(), num_gpus=1, global_batch=1)
    assert one.parallel == Parallel(gpus=1)
    s = export_plan(plan, "deepspeed")  # reads PlanSettings(parallel=plan.parallel)
    assert s.target == "deepspeed"
    from memfit.export.settings import settings_from_plan

    assert settings_from_plan(plan).parallel == layout


# (plan flags, the Parallel they name, written by hand)
FLAG_SETS = [
    (["--gpus", "8", "--fsdp"], Parallel(gpus=8, zero=3, fsdp=8)),
    (["--gpus", "8", "--zero", "3"], Parallel(gpus=8, zero=3, fsdp=8)),
    (["--gpus", "8", "--zero", "1"], Parallel(gpus=8, zero=1)),
    (["--gpus", "16", "--tp", "2", "--fsdp", "4", "--gpus-per-node", "8"],
     Parallel(gpus=16, gpus_per_node=8, tp=2, zero=3, fsdp=4)),
    (["--gpus", "8", "--pp", "4", "--pp-schedule", "gpipe", "--microbatches", "8"],
     Parallel(gpus=8, pp=4, pp_schedule="gpipe", microbatches=8)),
    (["--gpus", "4", "--tp", "2", "--sp", "--loss-parallel", "--gpus-per-node", "2"],
     Parallel(gpus=4, gpus_per_node=2, tp=2, sp=True, loss_parallel=True)),
    (["--gpus", "8", "--ep", "4", "--fsdp"], Parallel(gpus=8, ep=4, zero=3)),
    (["--gpus", "4", "--gpus-per-node", "8"], Parallel(gpus=4)),  # all on one node
    ([], Parallel(gpus=1)),
]


@pytest.mark.parametrize(("flags", "expected"), FLAG_SETS)
def test_plan_flags_name_the_parallel_the_python_api_builds(flags, expected):
    args = build_parser().parse_args(["plan", "gpt2", *flags])
    assert parallel_from_args(args) == expected
    args.precision = "bf16-mixed"
    assert run_config(args).parallel == expected


def test_fit_reads_its_flags_with_the_same_parser():
    args = build_parser().parse_args(["fit", "gpt2", "--global-batch", "8", "--gpus", "16",
                                      "--gpus-per-node", "8", "--tp", "2"])
    assert parallel_from_args(args) == Parallel(gpus=16, gpus_per_node=8, tp=2)
    args = build_parser().parse_args(["fit", "gpt2", "--global-batch", "8", "--gpus", "8",
                                      "--gpus-per-node", "3"])
    with pytest.raises(MemfitError, match="gpus_per_node=3"):
        parallel_from_args(args)


@pytest.mark.parametrize(("flags", "match"), [
    (["--gpus", "6", "--tp", "4"], "not divisible by tp x pp = 4"),
    (["--gpus", "8", "--zero", "1", "--fsdp"], "conflicts with --zero 1"),
    (["--gpus", "12", "--gpus-per-node", "8"], "partial node"),
    (["--gpus", "2", "--sp"], r"Parallel\(sp=True, tp=1\)"),
    (["--zero", "4"], "--zero must be 0, 1, 2 or 3"),
])
def test_bad_layout_flags_are_one_line(flags, match):
    args = build_parser().parse_args(["plan", "gpt2", *flags])
    with pytest.raises(MemfitError, match=match):
        parallel_from_args(args)


def test_plan_json_nests_the_layout_and_export_reads_it(capsys):
    """`memfit plan --json`'s run holds the layout as Parallel.to_dict; export reads it back."""
    assert main(["plan", "gpt2", "--method", "analytic", "--json", "--gpus", "16", "--tp", "2",
                 "--zero", "3", "--gpus-per-node", "8"]) == 0
    data = json.loads(capsys.readouterr().out)
    expected = Parallel(gpus=16, gpus_per_node=8, tp=2, zero=3)  # fsdp: 16 / tp 2 = 8
    assert not set(data["run"]) & OLD_LAYOUT_FIELDS
    assert Parallel.from_dict(data["run"]["parallel"]) == expected
    assert data["run"]["parallel"]["fsdp"] == 8
    run = dict(data["run"])
    run.pop("seq")
    assert RunConfig.from_dict(run).parallel == expected
    s = settings_from_dict(data)
    assert s.parallel == expected and (s.zero, s.nodes) == (3, 2)


def old_analytic_plan(**layout) -> dict:
    """A `memfit plan --json` file as memfit wrote it before RunConfig held a Parallel: the
    layout flat in "run" (written by hand)."""
    run = {"mode": "train", "precision": "bf16-mixed", "optimizer": "adamw",
           "checkpointing": "full", "attention": "sdpa", "batch": 2, "seq": 1024,
           "grad_accum": 4, "gpus": 1, "zero": 0, "tp": 1, "pp": 1,
           "sequence_parallel": False, "offload_optimizer": False, "offload_params": False,
           "offload_to": "cpu", "engine": "auto", "lora_rank": 16,
           "lora_targets": ["q", "k", "v", "o"], "weight_quant": "none",
           "kv_cache_dtype": None, "new_tokens": 0}
    return {"model": {"name": "gpt2", "params": 124439808}, "per_gpu": {"total_bytes": 1},
            "run": {**run, **layout}}


def test_an_old_flat_plan_file_still_loads(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old_analytic_plan(gpus=16, tp=2, pp=2, zero=3)))
    s = settings_from_dict(json.loads(path.read_text()))
    # 16 / (tp 2 x pp 2) = 4 data-parallel ranks, all sharding (ZeRO-3).
    assert s.parallel == Parallel(gpus=16, tp=2, pp=2, zero=3, fsdp=4)
    assert (s.parallel.dp, s.zero, s.replicate, s.global_batch) == (4, 3, 1, 2 * 4 * 4)
    assert export_plan(str(path), "deepspeed").data["zero_optimization"]["stage"] == 3
    # The formulas' run reads the same flat fields (bench/published.py's cases are flat).
    old = old_analytic_plan(gpus=8, zero=1)["run"]
    assert RunConfig.from_dict(old) == RunConfig(
        precision="bf16-mixed", checkpointing="full", batch=2, seq=1024, grad_accum=4,
        parallel=Parallel(gpus=8, zero=1))
    # An old run could carry --sp without --tp (it did nothing): it loads, without sp.
    s = settings_from_dict(old_analytic_plan(gpus=4, sequence_parallel=True))
    assert s.parallel == Parallel(gpus=4)


def test_run_and_fit_plan_round_trip_through_json():
    run = RunConfig(mode="lora", batch=4, seq=512, grad_accum=2,
                    parallel=Parallel(gpus=16, gpus_per_node=8, tp=2, pp=2, sp=True, zero=1,
                                      pp_schedule="gpipe", microbatches=4))
    assert RunConfig.from_dict(json.loads(json.dumps(run.to_dict()))) == run
    layout = Parallel(gpus=16, gpus_per_node=8, tp=2, fsdp=4)
    plan = fit_plan(FitConfig(precision="bf16-mixed", micro_batch=2, sharding="hsdp",
                              parallel=layout), num_gpus=16, global_batch=2 * 8)
    back = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert back == plan and back.parallel == layout


def test_an_old_fit_plan_without_a_layout_still_loads():
    """A fit plan of before fit searched layouts: num_gpus and a ZeRO stage (written by hand)."""
    cost = {"compute_s": 1.0, "traffic_s": 0.0, "transfer_s": 0.0, "comm_s": 0.0,
            "dispatch_s": 0.0, "optimizer_s": 0.0}
    config = {"precision": "bf16-mixed", "checkpointing": "none", "micro_batch": 2,
              "accumulation": 1, "optimizer": "adamw", "offload_states": False,
              "offload_activations": False, "chunked_loss": False, "attention": "model",
              "sharding": "zero2"}
    data = {"format": "memfit-plan/1", "chosen": {"config": config, "peak_bytes": 1,
                                                  "cost": cost},
            "budget_bytes": 2, "global_batch": 2 * 4, "num_gpus": 4, "device": "cuda",
            "gpu": "a100-80gb"}
    plan = Plan.from_dict(data)
    assert plan.parallel == Parallel(gpus=4, zero=2)
    s = settings_from_dict(data)
    assert s.parallel == Parallel(gpus=4, zero=2) and s.zero == 2


def test_a_fit_plan_keeps_its_whole_layout_and_old_ones_still_load():
    """A fit plan's config holds the whole Parallel (a pipeline's schedule and micro-batches
    included); a plan written when it held only tp, pp, ep, gpus_per_node and replicate (the GPU
    count from the plan, the strategy from ``sharding``; written by hand) still loads."""
    layout = Parallel(gpus=8, gpus_per_node=8, pp=2, fsdp=4, pp_schedule="gpipe",
                      microbatches=4)
    cfg = FitConfig(precision="bf16-mixed", micro_batch=1, accumulation=4, sharding="zero3",
                    parallel=layout)
    data = json.loads(json.dumps(cfg.to_dict()))
    assert data["parallel"]["pp_schedule"] == "gpipe" and data["parallel"]["microbatches"] == 4
    assert FitConfig.from_dict(data).parallel == layout
    old = {**data, "parallel": {"tp": 2, "pp": 1, "ep": 1, "gpus_per_node": 8, "replicate": 1}}
    assert FitConfig.from_dict(old, gpus=8).parallel == Parallel(gpus=8, gpus_per_node=8, tp=2,
                                                                 zero=3)


def test_relayout_derives_zero_sharding_again():
    # ZeRO-3 shards over every data-parallel rank: 16 of them on 16 GPUs, not the old 8.
    assert relayout(Parallel(gpus=8, zero=3), gpus=16).fsdp == 16
    # HSDP's explicit shard group stays.
    assert relayout(Parallel(gpus=8, zero=3, fsdp=4), gpus=16).fsdp == 4
    assert relayout(Parallel(gpus=8, zero=3), zero=0) == Parallel(gpus=8)
    assert relayout(Parallel(gpus=8, tp=2, sp=True), tp=1) == Parallel(gpus=8)
    assert relayout(Parallel(gpus=16, gpus_per_node=8), gpus=4).gpus_per_node is None
    run = RunConfig(parallel=Parallel(gpus=8, zero=2)).relayout(gpus=32)
    assert (run.gpus, run.zero, run.parallel.fsdp, run.parallel.reshard_after_forward) == (
        32, 2, 32, False)


def test_parallel_from_dict_errors_are_one_line():
    with pytest.raises(MemfitError, match=r"unknown parallel field.*replicas"):
        Parallel.from_dict({"gpus": 8, "replicas": 2})
    with pytest.raises(MemfitError, match="needs gpus"):
        Parallel.from_dict({"tp": 2})
    with pytest.raises(MemfitError, match="run: tp beside"):
        RunConfig.from_dict({"tp": 2, "parallel": {"gpus": 2, "tp": 2}})


def test_a_traced_runs_hsdp_and_ep_reach_the_export():
    """A traced plan's run (cli/parallel_plan.py writes RunConfig's fields) names HSDP and ep
    in its Parallel; the flat fields of before could not (they said zero 3 over every rank)."""
    run = RunConfig(parallel=Parallel(gpus=8, zero=3, fsdp=2, ep=4))
    data = {"per_gpu": {"total_bytes": 1}, "run": {**run.to_dict(), "seq": 512}}
    s = settings_from_dict(data)
    # 8 data-parallel ranks in shard groups of 2: 4 replicas.
    assert (s.zero, s.shard, s.replicate, s.parallel.ep) == (3, 2, 4, 4)
    gaps = {g.setting for g in export_plan(data, "deepspeed").gaps}
    assert "ep" in gaps
