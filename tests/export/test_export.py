"""memfit export: reading both kinds of plan, the gaps every target reports, bad input.

The exports' contents are checked by the tools' own parsers in tests/export/test_export_tools.py;
here the settings a plan carries are compared with values written by hand in each test.
"""

from __future__ import annotations

import json
import pickle

import pytest

from memfit.cli import main
from memfit.errors import MemfitError
from memfit.export import TARGETS, PlanSettings, export_plan, read_plan
from memfit.fitting.config import FitConfig
from memfit.fitting.cost import StepCost
from memfit.fitting.plan import Candidate, Plan
from memfit.parallel import Parallel
from memfit.recipe import Recipe


def fit_plan(*, num_gpus: int = 1, global_batch: int | None = None, device: str = "cuda",
             **config) -> Plan:
    if global_batch is None:
        global_batch = config.get("micro_batch", 1) * config.get("accumulation", 1) * num_gpus
    cost = StepCost(compute_s=1.0, traffic_s=0.1, transfer_s=0.0, comm_s=0.0, dispatch_s=0.01,
                    optimizer_s=0.05)
    return Plan(chosen=Candidate(config=FitConfig(**config), peak_bytes=2**30, cost=cost),
                runners_up=(), rejected=(), budget_bytes=2**31, global_batch=global_batch,
                num_gpus=num_gpus, device=device, gpu="a100-80gb" if device == "cuda" else None,
                rates_source="test")


def analytic_plan(**run) -> dict:
    """The shape `memfit plan --json` prints (cli/plan.py: MemoryPlan.to_dict + "run")."""
    base = {"mode": "train", "precision": "bf16-mixed", "optimizer": "adamw",
            "checkpointing": "none", "attention": "sdpa", "batch": 1, "seq": 1024,
            "grad_accum": 1, "gpus": 1, "zero": 0, "tp": 1, "pp": 1,
            "sequence_parallel": False, "offload_optimizer": False, "offload_params": False,
            "lora_rank": 16, "lora_targets": ["q", "k", "v", "o"], "weight_quant": "none",
            "kv_cache_dtype": None, "new_tokens": 0}
    return {"model": {"name": "gpt2", "params": 124439808}, "per_gpu": {"total_bytes": 1},
            "run": {**base, **run}}


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


# -- reading plans ------------------------------------------------------------------------------

def test_fit_plan_settings_round_trip_through_its_file(tmp_path):
    plan = fit_plan(num_gpus=4, global_batch=64, precision="bf16-mixed", checkpointing="full",
                    micro_batch=4, accumulation=4, sharding="zero2", offload_states=True,
                    optimizer="adamw-8bit")
    plan.save(tmp_path / "plan.json")
    s = read_plan(tmp_path / "plan.json")
    # 4 micro x 4 accumulation x 4 GPUs = 64, the plan's global batch.
    r = s.recipe
    assert (s.source, r.precision, r.checkpointing, r.micro_batch, r.accumulation) == (
        "fit", "bf16-mixed", "full", 4, 4)
    assert (s.parallel.gpus, s.parallel.dp, s.zero, r.offload_states, r.optimizer) == (
        4, 4, 2, True, "adamw-8bit")
    assert s.global_batch == 64


def test_settings_hold_the_plans_recipe_and_restate_none_of_its_fields(tmp_path):
    """PlanSettings is the plan's Recipe plus what only a plan has; a fit plan's recipe is the
    one its config chose, and an analytic run's is its RunConfig's, field for field."""
    import dataclasses

    own = {f.name for f in dataclasses.fields(PlanSettings)}
    # engine: the name a plan file gives (fsdp, hsdp, ...), reported as given, not the
    # recipe's vocabulary.
    assert own & {f.name for f in dataclasses.fields(Recipe)} == {"engine"}
    plan = fit_plan(num_gpus=2, precision="bf16-mixed", checkpointing="full", micro_batch=2,
                    accumulation=3, sharding="zero2", offload_states=True, optimizer="sgd",
                    chunked_loss=True)
    plan.save(tmp_path / "plan.json")
    assert read_plan(tmp_path / "plan.json").recipe == dataclasses.replace(
        plan.config.as_recipe(), parallel=plan.parallel)
    run = analytic_plan(precision="fp16-mixed", checkpointing="selective", batch=4,
                        grad_accum=2, optimizer="adamw-8bit", offload_optimizer=True)
    (tmp_path / "run.json").write_text(json.dumps(run))
    assert read_plan(tmp_path / "run.json").recipe == Recipe(
        precision="fp16-mixed", checkpointing="selective", micro_batch=4, accumulation=2,
        optimizer="adamw-8bit", offload_states=True, attention="sdpa",
        parallel=Parallel(gpus=1))


def test_a_fit_plans_nvme_offload_is_exported_as_nvme(tmp_path):
    """A fit plan names its offload target offload_to (the recipe's name); it was read as
    offload_device, so an NVMe plan exported as CPU offload with offload_to 'not carried'."""
    plan = fit_plan(num_gpus=2, sharding="zero3", offload_states=True, offload_to="nvme")
    plan.save(tmp_path / "plan.json")
    s = read_plan(tmp_path / "plan.json")
    assert (s.recipe.offload_to, s.unknown) == ("nvme", {})
    ds = json.loads(export_plan(s, "deepspeed").text)
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "nvme"


def test_analytic_plan_from_the_plan_command(tmp_path, capsys):
    """What `memfit plan --json` prints is a plan export reads (its "run" object)."""
    code, out, _ = cli(capsys, "plan", "gpt2", "--json", "--precision", "bf16-mixed",
                       "--checkpointing", "full", "--gpus", "8", "--zero", "3", "--batch", "2",
                       "--grad-accum", "4", "--offload-optimizer", "--offload-params")
    assert code == 0
    (tmp_path / "a.json").write_text(out)
    s = read_plan(tmp_path / "a.json")
    assert (s.source, s.parallel.gpus, s.parallel.dp, s.zero, s.recipe.micro_batch,
            s.recipe.accumulation) == ("plan", 8, 8, 3, 2, 4)
    assert s.recipe.offload_states and s.recipe.offload_params and s.recipe.checkpointing == "full"
    assert s.global_batch == 2 * 4 * 8


def test_plan_command_json_exports_without_unknown_fields(tmp_path, capsys):
    """Issue 20: every export of a `memfit plan --json` file reported "offload_to=cpu: this
    memfit version's exporter does not know this plan field" (RunConfig's name for the offload
    device), with no offload in the plan."""
    code, out, _ = cli(capsys, "plan", "gpt2", "--json")
    assert code == 0
    (tmp_path / "p.json").write_text(out)
    for target in TARGETS:
        gaps = export_plan(tmp_path / "p.json", target).gaps
        assert not [g for g in gaps if "does not know" in g.reason], (target, gaps)
    code, out, _ = cli(capsys, "plan", "gpt2", "--json", "--offload-optimizer", "--offload-to",
                       "nvme", "--engine", "deepspeed", "--zero", "3", "--gpus", "2")
    assert code == 0
    (tmp_path / "nvme.json").write_text(out)
    s = read_plan(tmp_path / "nvme.json")
    assert (s.recipe.offload_states, s.recipe.offload_to, s.unknown) == (True, "nvme", {})
    ds = json.loads(export_plan(s, "deepspeed").text)
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "nvme"


def test_cpu_fit_plan_exports_target_the_cpu(tmp_path):
    """A `memfit fit --device cpu` plan: the launchers run it on the CPU (they targeted a GPU:
    Lightning accelerator "gpu", torchtune device "cuda", Accelerate use_cpu false); a GPU
    plan still targets the GPU."""
    yaml = pytest.importorskip("yaml")
    for device, gpu in (("cpu", False), ("cuda", True)):
        path = tmp_path / f"{device}.json"
        fit_plan(device=device, precision="bf16-mixed", micro_batch=4, accumulation=2).save(path)
        lightning = yaml.safe_load(export_plan(path, "lightning").text)["trainer"]
        assert (lightning["accelerator"], lightning["devices"]) == (
            "gpu" if gpu else "cpu", 1)
        assert yaml.safe_load(export_plan(path, "torchtune").text)["device"] == device
        accelerate = yaml.safe_load(export_plan(path, "accelerate").text)
        assert (accelerate["use_cpu"], accelerate["distributed_type"]) == (not gpu, "NO")
        trainer = json.loads(export_plan(path, "hf-trainer").text)
        assert trainer.get("use_cpu", False) is (not gpu)
        titan = {g.setting for g in export_plan(path, "torchtitan").gaps}
        assert ("device" in titan) is (not gpu)
        assert read_plan(path).device == device


def test_torchtitan_checkpointing_line_is_its_subcommand_under_a_comment():
    """Every other line is a --section.field[=value] override; the activation-checkpointing
    policy is a tyro subcommand, written as torchtitan spells it (activation-checkpoint:full)
    under a comment saying so (it ended with a bare `activation_checkpoint:none`)."""
    import re

    for ckpt in ("none", "full", "selective"):
        settings = PlanSettings(source="plan", recipe=Recipe(checkpointing=ckpt))
        text = export_plan(settings, "torchtitan").text
        lines = text.splitlines()
        assert lines[-1] == f"activation-checkpoint:{ckpt}"
        assert lines[-2].startswith("# activation checkpointing: a subcommand")
        overrides = [line for line in lines[:-1] if not line.startswith("#")]
        assert overrides and all(re.fullmatch(r"--[a-z_]+\.[a-z_-]+(=\S+)?", line)
                                 for line in overrides), overrides


def test_parallel_fields_flat_or_nested():
    """Issue 14's layouts: 16 GPUs = tp 2 x pp 2 x dp 4; fsdp 2 shards groups of 2, so 2
    HSDP replicas. Given nested ("parallel") or flat, the same settings."""
    nested = analytic_plan(gpus=16, batch=1, grad_accum=2,
                           parallel={"tp": 2, "pp": 2, "fsdp": 2, "gpus_per_node": 4})
    flat = analytic_plan(gpus=16, batch=1, grad_accum=2, tp=2, pp=2, fsdp=2, gpus_per_node=4)
    for data in (nested, flat):
        s = export_plan(data, "deepspeed")  # reads; the text is checked elsewhere
        assert s.target == "deepspeed"
    from memfit.export.settings import settings_from_dict

    s = settings_from_dict(nested)
    assert (s.parallel.dp, s.parallel.tp, s.parallel.pp, s.zero, s.replicate, s.shard,
            s.nodes) == (4, 2, 2, 3, 2, 2, 4)
    assert settings_from_dict(flat) == s


def test_a_field_the_exporter_does_not_know_is_reported_by_every_target():
    data = analytic_plan(cp=2)  # e.g. context parallelism, added by a later memfit
    for target in TARGETS:
        gaps = {g.setting: g.value for g in export_plan(data, target).gaps}
        assert gaps.get("cp") == 2, target


# -- gaps: nothing dropped silently -------------------------------------------------------------

def test_model_code_settings_are_gaps_in_every_target():
    plan = fit_plan(precision="bf16-mixed", chunked_loss=True, attention="sdpa",
                    checkpointing="budget", checkpoint_budget_bytes=2**30,
                    checkpoint_modes=("full", "full", None))
    for target in TARGETS:
        gaps = {g.setting: g.value for g in export_plan(plan, target).gaps}
        assert gaps["chunked_loss"] is True, target
        assert gaps["attention"] == "sdpa", target
        assert gaps["checkpointing"] == "budget", target
        reason = next(g.reason for g in export_plan(plan, target).gaps
                      if g.setting == "checkpointing")
        assert "2 full, 1 none" in reason


def test_pipeline_parallel_is_a_gap_where_the_tool_has_none():
    data = analytic_plan(gpus=4, pp=4, batch=1, grad_accum=8)
    for target in TARGETS:
        gaps = {g.setting for g in export_plan(data, target).gaps}
        assert ("pp" in gaps) == (target != "torchtitan"), target


def test_lora_plan_reports_the_adapters():
    data = analytic_plan(mode="lora", lora_rank=8)
    for target in TARGETS:
        gaps = {g.setting: g.value for g in export_plan(data, target).gaps}
        assert gaps["mode"] == "lora", target


# -- the command -------------------------------------------------------------------------------

def test_cli_writes_stdout_and_lists_gaps_on_stderr(tmp_path, capsys):
    fit_plan(precision="bf16-mixed", checkpointing="full", micro_batch=2, accumulation=4,
             ).save(tmp_path / "p.json")
    code, out, err = cli(capsys, "export", str(tmp_path / "p.json"), "--to", "deepspeed")
    assert code == 0
    ds = json.loads(out)  # stdout is the file alone
    assert ds["train_micro_batch_size_per_gpu"] == 2 and ds["gradient_accumulation_steps"] == 4
    assert "checkpointing=full" in err


def test_cli_output_file_and_json_report(tmp_path, capsys):
    fit_plan(checkpointing="selective", micro_batch=8).save(tmp_path / "p.json")
    target = tmp_path / "ta.json"
    code, out, _ = cli(capsys, "export", str(tmp_path / "p.json"), "--to", "hf-trainer",
                       "--output", str(target), "--json")
    assert code == 0
    report = json.loads(out)
    assert report["output"] == str(target) and "text" not in report
    assert {"setting": "checkpointing", "value": "selective"}.items() <= \
        report["gaps"][0].items()
    assert json.loads(target.read_text())["per_device_train_batch_size"] == 8


@pytest.mark.parametrize("argv, words", [
    (["--to", "deepspeeed"], ["unknown export target 'deepspeeed'", "did you mean"]),
    (["--to", "megatron"], ["unknown export target 'megatron'", "valid: deepspeed"]),
])
def test_unknown_target_is_one_line_exit_2(tmp_path, capsys, argv, words):
    fit_plan().save(tmp_path / "p.json")
    code, out, err = cli(capsys, "export", str(tmp_path / "p.json"), *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1
    for word in words:
        assert word in err


@pytest.mark.parametrize("content, words", [
    (b"{not json", ["not valid JSON"]),
    (pickle.dumps({"format": "memfit-plan/1"}), ["cannot read plan file"]),
    (b"[1, 2]", ["not a memfit plan"]),
    (json.dumps({"train_batch_size": 8, "zero_optimization": {"stage": 2}}).encode(),
     ["not a memfit plan", "memfit fit --save"]),
    (json.dumps({"format": "memfit-plan/9"}).encode(), ["format 'memfit-plan/9'"]),
    (json.dumps({"format": "memfit-plan/1", "chosen": {}}).encode(), ["malformed"]),
])
def test_bad_plan_files_are_one_line_exit_2(tmp_path, capsys, content, words):
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    code, out, err = cli(capsys, "export", str(path), "--to", "accelerate")
    assert code == 2 and out == ""
    assert err.count("\n") == 1, err
    for word in words:
        assert word in err


@pytest.mark.parametrize("run, words", [
    ({"gpus": 6, "tp": 4}, ["6 GPUs do not split into tp 4"]),
    ({"gpus": 8, "zero": 2, "offload_params": True}, ["parameter offload needs ZeRO-3"]),
    ({"gpus": 8, "zero": 2, "fsdp": True}, ["conflicts with zero 2"]),
    ({"gpus": 8, "dp": 4}, ["dp 4 x tp 1 x pp 1 = 4", "8 GPUs"]),
    ({"gpus": 8, "fsdp": 3}, ["fsdp 3 must divide"]),
    ({"mode": "inference"}, ["trains nothing"]),
    ({"batch": 0}, ["batch must be a positive integer"]),
])
def test_conflicting_settings_are_one_line_exit_2(tmp_path, capsys, run, words):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(analytic_plan(**run)))
    code, out, err = cli(capsys, "export", str(path), "--to", "torchtitan")
    assert code == 2 and out == ""
    assert err.count("\n") == 1, err
    for word in words:
        assert word in err, err


def test_fit_plan_whose_batch_does_not_add_up(tmp_path, capsys):
    """3 x 1 x 2 GPUs = 6, but the file says 8: edited by hand, refused."""
    data = fit_plan(num_gpus=2, global_batch=6, micro_batch=3).to_dict()
    data["global_batch"] = 8
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    code, _, err = cli(capsys, "export", str(path), "--to", "deepspeed")
    assert code == 2 and "= 6, but the plan's global batch is 8" in err


def test_export_api_takes_plan_dict_settings_or_path(tmp_path):
    plan = fit_plan(micro_batch=2, accumulation=4)
    plan.save(tmp_path / "p.json")
    texts = {export_plan(p, "torchtune").text for p in (
        plan, plan.to_dict(), tmp_path / "p.json", str(tmp_path / "p.json"))}
    assert len(texts) == 1
    with pytest.raises(MemfitError, match="cannot export a int"):
        export_plan(3, "deepspeed")
    written = export_plan(plan, "torchtune", tmp_path / "tt.yaml")
    assert (tmp_path / "tt.yaml").read_text() == written.text


def test_target_names_take_case_and_underscores():
    assert export_plan(fit_plan(), "HF_Trainer").target == "hf-trainer"


def test_settings_validate_directly():
    with pytest.raises(MemfitError, match="HSDP replicas need sharded"):
        PlanSettings(source="plan",  # 2 replicas
                     recipe=Recipe(parallel=Parallel(gpus=8, zero=2, fsdp=4)))


def test_torchtitan_checkpointing_exports_as_torchtitans_selective():
    """memfit's ``torchtitan`` policy is torchtitan's op-level ``selective`` exactly; torchtune
    has no op-level policy and says so rather than dropping it silently."""
    settings = PlanSettings(source="plan", recipe=Recipe(checkpointing="torchtitan"))
    assert export_plan(settings, "torchtitan").text.splitlines()[-1] == \
        "activation-checkpoint:selective"
    gaps = {g.setting: g.value for g in export_plan(settings, "torchtune").gaps}
    assert gaps["checkpointing"] == "torchtitan"
