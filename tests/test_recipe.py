"""memfit's one Recipe: validated once, saved in plan files, applied by apply_recipe and traced by
trace_recipe exactly as the techniques applied by hand."""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle

import pytest
import torch
from torch import nn

import memfit
from _models import Classifier
from memfit import MemfitError, Parallel, Recipe
from memfit.fitting import FitConfig
from memfit.models import get_preset

# The keys a fit plan's "config" held before the recipe (plan files written then must read the
# same, and plans written now without the recipe's new fields must look the same).
OLD_PLAN_KEYS = {"precision", "checkpointing", "checkpoint_budget_bytes", "checkpoint_modes",
                 "micro_batch", "accumulation", "optimizer", "offload_states",
                 "offload_activations", "chunked_loss", "attention", "sharding"}


def test_fit_config_is_a_recipe_and_round_trips_through_a_plan_file() -> None:
    cfg = FitConfig(precision="bf16-mixed", checkpointing="budget", checkpoint_budget_bytes=2**20,
                    checkpoint_modes=("full", None), micro_batch=2, accumulation=4,
                    offload_states=True, chunked_loss=True, attention="sdpa", sharding="zero3",
                    parallel=Parallel(gpus=4, fsdp=4))
    assert isinstance(cfg, Recipe)
    data = json.loads(json.dumps(cfg.to_dict()))
    assert set(data) == OLD_PLAN_KEYS | {"parallel"}  # nothing new in an old-shaped plan
    assert FitConfig.from_dict(data) == cfg
    # the recipe's own fields, when set, are written and read back
    lora = FitConfig(lora_rank=8, lora_targets=("q", "v"))
    data = json.loads(json.dumps(lora.to_dict()))
    assert data["lora_rank"] == 8 and data["lora_targets"] == ["q", "v"]
    assert FitConfig.from_dict(data) == lora
    assert FitConfig.from_dict(data).as_recipe() == Recipe(lora_rank=8, lora_targets=("q", "v"))


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"precision": "bf17"}, "unknown precision 'bf17'"),
    ({"optimizer": "adamz"}, "unknown optimizer 'adamz'"),
    ({"checkpointing": "fulll"}, "unknown checkpointing policy 'fulll'"),
    ({"micro_batch": 0}, "micro_batch must be a positive integer"),
    ({"accumulation": True}, "accumulation must be a positive integer"),
    ({"checkpointing": "budget"}, "needs a positive checkpoint_budget_bytes"),
    ({"checkpoint_modes": ("full", "half")}, "checkpoint_modes must be a list"),
    ({"offload_states": "yes"}, "offload_states must be true or false"),
    ({"attention": "flashy"}, "unknown attention 'flashy'"),
    ({"offload_to": "disk"}, "unknown offload target 'disk'"),
    ({"weight_quant": "int3"}, "unknown weight quantization 'int3'"),
    ({"kv_cache_dtype": "fp4"}, "unknown KV cache dtype 'fp4'"),
    ({"lora_rank": 0}, "lora_rank must be a positive integer"),
    ({"qlora": True}, "give lora_rank"),
    ({"lora_rank": 8, "lora_targets": ()}, "lora_targets must be a non-empty tuple"),
    ({"lora_rank": 8, "lora_targets": "q,v"}, "lora_targets must be a non-empty tuple"),
    ({"parallel": {"gpus": 2}}, "parallel must be a memfit.Parallel"),
])
def test_bad_values_are_one_line_errors(kwargs: dict, words: str) -> None:
    with pytest.raises(MemfitError) as info:
        Recipe(**kwargs)
    message = str(info.value)
    assert words in message and "\n" not in message, message


def test_run_config_and_validate_and_case_read_one_recipe() -> None:
    run = memfit.RunConfig(mode="lora", precision="bf16-mixed", batch=2, grad_accum=4,
                           lora_rank=8, checkpointing="full", offload_optimizer=True)
    assert run.recipe == Recipe(precision="bf16-mixed", micro_batch=2, accumulation=4,
                                lora_rank=8, checkpointing="full", offload_states=True,
                                attention="sdpa", parallel=Parallel(gpus=1))
    assert memfit.RunConfig(batch=2).recipe.lora_rank is None  # LoRA only in lora/qlora mode

    from memfit.validate import matrix

    states = next(c for c in matrix("tiny", quick=True) if c.offload == "states")
    assert states.recipe.offload_states and not states.recipe.offload_activations
    assert states.batch == states.recipe.micro_batch

    from memfit.parallel.measure import Case, tiny_spec

    recipe = Recipe(checkpointing="full", parallel=Parallel(gpus=2, fsdp=2))
    case = Case(spec=tiny_spec(), batch=2, seq=8, recipe=recipe)
    assert case.recipe is recipe and case.parallel == Parallel(gpus=2, fsdp=2)
    assert pickle.loads(pickle.dumps(case)) == case  # it travels to the gloo ranks
    for unmeasured in ({"precision": "bf16-mixed"}, {"offload_states": True},
                       {"accumulation": 2}):
        with pytest.raises(ValueError, match=f"do not run the recipe's {next(iter(unmeasured))}"):
            Case(spec=tiny_spec(), batch=2, seq=8,
                 recipe=dataclasses.replace(recipe, **unmeasured))
    with pytest.raises(ValueError, match="with a layout"):
        Case(spec=tiny_spec(), batch=2, seq=8, recipe=Recipe())


def _wrapped_blocks(model: nn.Module) -> list[str]:
    """The blocks whose forward memfit's checkpointing replaced (an instance attribute)."""
    return [name for name, mod in model.named_modules() if "forward" in vars(mod)]


def _classifier() -> nn.Module:
    torch.manual_seed(0)
    return Classifier(inp=8, d=16, h=32, blocks=2, classes=4)


def test_apply_recipe_is_the_techniques_applied_by_hand() -> None:
    from memfit.techniques import apply_activation_checkpointing, make_optimizer

    torch.manual_seed(1)
    batch = (torch.randn(4, 8), torch.randint(0, 4, (4,)))
    recipe = Recipe(optimizer="sgd", checkpointing="full", micro_batch=2)
    model, optimizer, step = memfit.apply_recipe(_classifier(), recipe, log_recoveries=False)
    loss = step(batch)

    # By hand: full checkpointing of each block, the optimizer, then two micro-batches of 2
    # whose mean losses are averaged (the guard's mean over the batch).
    hand = _classifier()
    apply_activation_checkpointing(hand, "full")
    hand_opt = make_optimizer([p for p in hand.parameters() if p.requires_grad], "sgd")
    total = 0.0
    for rows in (slice(0, 2), slice(2, 4)):
        part = hand(batch[0][rows], batch[1][rows]) / 2
        part.backward()
        total += part.item()
    hand_opt.step()

    assert _wrapped_blocks(model) == _wrapped_blocks(hand) == ["blocks.0", "blocks.1"]
    assert type(optimizer) is type(hand_opt)
    assert loss == pytest.approx(total, rel=1e-6)
    for mine, theirs in zip(model.parameters(), hand.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs)


def test_apply_recipe_refuses_what_it_does_not_apply_in_one_line() -> None:
    with pytest.raises(MemfitError) as info:
        memfit.apply_recipe(_classifier(), Recipe(offload_gradients=True))
    assert "apply_recipe cannot apply offload_gradients" in str(info.value)
    assert "\n" not in str(info.value)


def test_trace_recipe_is_the_estimate_of_the_techniques_applied_by_hand() -> None:
    from memfit.techniques import apply_activation_checkpointing
    from memfit.techniques.optim import offloaded

    batch = (torch.randn(64, 8, device="meta"), torch.zeros(64, dtype=torch.long, device="meta"))
    with torch.device("meta"):
        base = Classifier(inp=8, d=64, h=256, blocks=3, classes=4)
    recipe = Recipe(precision="bf16-mixed", checkpointing="full", offload_states=True)
    est = memfit.trace_recipe(copy.deepcopy(base), batch, recipe, device="cuda", steps=1)

    hand = copy.deepcopy(base)
    apply_activation_checkpointing(hand, "full")
    hand_est = memfit.estimate(hand, batch, optimizer=offloaded("adamw"), precision="bf16-mixed",
                               device="cuda", steps=1)
    plain = memfit.trace_recipe(copy.deepcopy(base), batch, Recipe(precision="bf16-mixed"),
                                device="cuda", steps=1)

    assert est.peak_bytes == hand_est.peak_bytes
    assert est.host_peak_bytes == hand_est.host_peak_bytes > 0  # the states are on the host
    assert plain.peak_bytes > est.peak_bytes  # the recipe's techniques did act


def _plan_file(tmp_path, config: FitConfig, **changes: object):
    """A fit plan file of ``config`` (built, not searched), its config's keys then changed."""
    from memfit.fitting import Candidate, Plan, StepCost

    cost = StepCost(compute_s=1.0, traffic_s=0.0, transfer_s=0.0, comm_s=0.0, dispatch_s=0.0,
                    optimizer_s=0.0)
    plan = Plan(chosen=Candidate(config=config, peak_bytes=2**20, cost=cost), runners_up=(),
                rejected=(), budget_bytes=2**30, global_batch=config.global_batch_per_rank,
                num_gpus=1, device="cuda", gpu=None, rates_source="test")
    data = plan.to_dict()
    data["chosen"]["config"].update(changes)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    return path


def test_a_plan_file_keeps_its_recipe_and_the_cli_exit_2(tmp_path, capsys) -> None:
    from memfit.cli import main
    from memfit.fitting import Plan

    cfg = FitConfig(precision="bf16-mixed", checkpointing="full", micro_batch=2, accumulation=2)
    assert Plan.load(_plan_file(tmp_path, cfg)).config == cfg
    path = _plan_file(tmp_path, cfg, precision="bf17")
    code = main(["export", str(path), "--to", "accelerate"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "unknown precision 'bf17'" in err, err


def test_run_config_names_are_checked_by_its_recipe_for_the_plan_layer() -> None:
    """RunConfig restates no check of the recipe's names: its Recipe checks them, for the
    plan layer, so a policy only fit applies says where it works (it was 'unknown')."""
    with pytest.raises(MemfitError, match=r"'budget' is not available here \(plan\); it works "
                                          r"in: fit, apply"):
        memfit.RunConfig(checkpointing="budget")
    with pytest.raises(MemfitError, match=r"^unknown precision 'bf17'.*valid: fp32, "):
        memfit.RunConfig(precision="bf17")
    # A LoRA target is a layer name the recipe cannot check without the model: the formulas
    # refuse one they do not price (a config.json of another model type names its own layers).
    run = memfit.RunConfig(mode="lora", lora_targets=("q", "qkv"))
    with pytest.raises(MemfitError, match=r"^unknown LoRA target\(s\) qkv for llama-3-8b"):
        memfit.plan(get_preset("llama-3-8b"), run)
    assert memfit.RunConfig(mode="lora", lora_rank=8).recipe.lora_rank == 8
