"""Every export loads in its own tool: DeepSpeed's config class, Accelerate's config loader and
launcher, ``TrainingArguments(**kwargs)``, LightningCLI's Trainer, torchtitan's tyro parser and
torchtune's recipe keys. Each test skips, with the reason, when its library is missing.

Expected values are written by hand from the plan (e.g. 2 micro x 4 accumulation x 8 ranks = 64
samples per step), never copied from the export under test.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import warnings
from pathlib import Path
from unittest import mock

import pytest

from memfit.export import PlanSettings, export_plan
from memfit.parallel import Parallel
from memfit.recipe import Recipe


def plan(engine: str | None = None, **recipe) -> PlanSettings:
    return PlanSettings(source="plan", engine=engine, recipe=Recipe(**recipe))


FSDP8 = plan(precision="bf16-mixed", checkpointing="full", micro_batch=2, accumulation=4,
             parallel=Parallel(gpus=8, zero=3))
ZERO2_OFFLOAD = plan(precision="bf16-mixed", micro_batch=2, accumulation=4,
                     parallel=Parallel(gpus=8, zero=2), offload_states=True)
ZERO3_OFFLOAD = plan(precision="fp16-mixed", micro_batch=1, accumulation=16,
                     parallel=Parallel(gpus=16, zero=3), offload_states=True,
                     offload_params=True, engine="deepspeed")
HSDP16 = plan(precision="bf16-mixed", micro_batch=1, accumulation=2,
              parallel=Parallel(gpus=16, zero=3, fsdp=8))  # 2 replicas of 8
DDP2 = plan(precision="fp16-mixed", micro_batch=4, parallel=Parallel(gpus=2))
ONE = plan(precision="fp32", micro_batch=4, accumulation=2)
TP = plan(precision="bf16-mixed", micro_batch=2, parallel=Parallel(gpus=8, tp=2, zero=3, sp=True))
PP = plan(precision="bf16", checkpointing="selective", micro_batch=1, accumulation=8,
          parallel=Parallel(gpus=8, pp=4, zero=3))


def needs(module: str, extra: str, why: str = ""):
    """Skip unless ``module`` imports; the reason names the extra that installs it (checked
    against pyproject.toml by tests/test_install_hints.py)."""
    return pytest.mark.skipif(importlib.util.find_spec(module) is None,
                              reason=f"{module} is not installed{why} (pip install "
                                     f"'memfit[{extra}]')")


# -- DeepSpeed ------------------------------------------------------------------------------

def ds_config(data: dict, world_size: int):
    """deepspeed.runtime.config.DeepSpeedConfig, read as rank 0 of ``world_size`` ranks (it
    asks deepspeed.comm; without a process group it would assume one rank)."""
    import deepspeed.runtime.config as dsc

    with mock.patch.object(dsc.dist, "get_rank", lambda *a, **k: 0), \
            mock.patch.object(dsc.dist, "get_world_size", lambda *a, **k: world_size):
        return dsc.DeepSpeedConfig(data)


@needs("deepspeed", "export")
def test_deepspeed_zero2_offload():
    """ZeRO-2 + optimizer offload on 8 ranks: DeepSpeed checks train_batch_size = micro x
    accumulation x world size (config.py: _batch_assertion): 2 x 4 x 8 = 64."""
    out = export_plan(ZERO2_OFFLOAD, "deepspeed")
    cfg = ds_config(json.loads(out.text), 8)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
            cfg.gradient_accumulation_steps) == (64, 2, 4)
    assert cfg.zero_optimization_stage == 2
    assert cfg.zero_config.offload_optimizer.device == "cpu"
    assert cfg.bfloat16_config.enabled and not cfg.float16_config.enabled
    assert cfg.optimizer_name == "adamw"


@needs("deepspeed", "export")
def test_deepspeed_zero3_offload_params_fp16_and_gaps():
    out = export_plan(ZERO3_OFFLOAD, "deepspeed")
    cfg = ds_config(out.data, 16)
    assert (cfg.train_batch_size, cfg.zero_optimization_stage) == (1 * 16 * 16, 3)
    assert cfg.zero_config.offload_param.device == "cpu"
    assert cfg.zero_config.offload_optimizer.device == "cpu"
    assert cfg.float16_config.enabled
    assert {g.setting for g in out.gaps} == set()


@needs("deepspeed", "export")
def test_deepspeed_tp_pp_and_checkpointing():
    """AutoTP carries tp; a pipeline and checkpointing are code, so gaps."""
    out = export_plan(TP, "deepspeed")
    cfg = ds_config(out.data, 4)  # 8 GPUs / tp 2 = 4 data-parallel ranks
    assert cfg.tensor_parallel_config.autotp_size == 2
    assert cfg.train_batch_size == 2 * 1 * 4
    assert "sequence_parallel" in {g.setting for g in out.gaps}
    out = export_plan(PP, "deepspeed")
    cfg = ds_config(out.data, 2)  # 8 / pp 4
    assert cfg.bfloat16_config.bf16_master_weights_and_grads  # pure bf16 under ZeRO
    assert {"pp", "checkpointing"} <= {g.setting for g in out.gaps}


@needs("deepspeed", "export")
def test_deepspeed_single_gpu_offload_runs_zero1():
    s = plan(precision="bf16-mixed", micro_batch=8, offload_states=True)
    cfg = ds_config(export_plan(s, "deepspeed").data, 1)
    assert cfg.zero_optimization_stage == 1
    assert cfg.zero_config.offload_optimizer.device == "cpu"


# -- Accelerate -------------------------------------------------------------------------------

def accelerate_launch_args(path: Path):
    """``accelerate launch --config_file path``'s arguments after it read the file
    (commands/launch.py: _validate_launch_command copies each nested key onto the launch
    argument of the same name)."""
    import yaml
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    load_config_from_file(str(path))  # raises on a key Accelerate does not know
    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    known = set(vars(args))
    data = yaml.safe_load(path.read_text())
    for section in ("deepspeed_config", "fsdp_config", "parallelism_config"):
        unknown = set(data.get(section, {})) - known
        assert not unknown, f"{section}: not accelerate launch arguments: {unknown}"
    return _validate_launch_command(args)[0]


@needs("accelerate", "export")
@needs("yaml", "export")
def test_accelerate_fsdp(tmp_path):
    path = export_plan(FSDP8, "accelerate", tmp_path / "a.yaml")
    args = accelerate_launch_args(tmp_path / "a.yaml")
    assert args.use_fsdp and args.num_processes == 8 and args.num_machines == 1
    assert args.mixed_precision == "bf16"
    assert int(args.fsdp_version) == 2 and args.fsdp_activation_checkpointing is True
    assert args.fsdp_offload_params is False
    assert {"micro_batch", "accumulation"} <= {g.setting for g in path.gaps}


@needs("accelerate", "export")
@needs("yaml", "export")
def test_accelerate_deepspeed_zero2_offload(tmp_path):
    export_plan(ZERO2_OFFLOAD, "accelerate", tmp_path / "a.yaml")
    args = accelerate_launch_args(tmp_path / "a.yaml")
    assert args.use_deepspeed and int(args.zero_stage) == 2
    assert args.offload_optimizer_device == "cpu" and args.offload_param_device == "none"
    assert int(args.gradient_accumulation_steps) == 4


@needs("accelerate", "export")
@needs("yaml", "export")
def test_accelerate_hsdp_over_two_nodes(tmp_path):
    """16 GPUs, 8 per node: 2 machines; 2 replicas x 8-way shards."""
    export_plan(HSDP16, "accelerate", tmp_path / "a.yaml")
    args = accelerate_launch_args(tmp_path / "a.yaml")
    assert (args.num_processes, args.num_machines) == (16, 2)
    assert (int(args.parallelism_config_dp_replicate_size),
            int(args.parallelism_config_dp_shard_size)) == (2, 8)


@needs("accelerate", "export")
@needs("yaml", "export")
def test_accelerate_fsdp_plugin_takes_the_fsdp_keys(tmp_path):
    """The FSDP keys also build Accelerate's FullyShardedDataParallelPlugin (fsdp_ stripped, as
    the launcher's environment variables do)."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    data = export_plan(FSDP8, "accelerate").data["fsdp_config"]
    kwargs = {(k if k == "fsdp_version" else k.removeprefix("fsdp_")): v
              for k, v in data.items()
              if k not in ("fsdp_auto_wrap_policy", "fsdp_state_dict_type")}
    kwargs["cpu_offload"] = kwargs.pop("offload_params")
    plugin = FullyShardedDataParallelPlugin(**kwargs)
    assert plugin.fsdp_version == 2 and plugin.activation_checkpointing is True


# -- Hugging Face TrainingArguments -----------------------------------------------------------

def training_args(kwargs: dict):
    """``TrainingArguments(**kwargs)``. Its bf16 check asks for a bf16 GPU
    (training_args.py: is_torch_bf16_gpu_available); this machine has none, so the check is
    told one exists."""
    import transformers.training_args as ta

    with mock.patch.object(ta, "is_torch_bf16_gpu_available", lambda: True), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ta.TrainingArguments(**kwargs)


@needs("transformers", "hf")
def test_hf_trainer_fsdp():
    out = export_plan(FSDP8, "hf-trainer")
    args = training_args(json.loads(out.text))
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (2, 4)
    assert args.bf16 and args.fsdp
    assert args.fsdp_config["version"] == 2
    assert args.fsdp_config["activation_checkpointing"] is True
    assert args.optim == "adamw_torch"
    assert "gpus" in {g.setting for g in out.gaps}


@needs("transformers", "hf")
@needs("deepspeed", "export")
def test_hf_trainer_deepspeed_zero2():
    """The embedded DeepSpeed config goes through the Trainer's own DeepSpeed integration
    (HfTrainerDeepSpeedConfig), which refuses values that disagree with the arguments."""
    args = training_args(export_plan(ZERO2_OFFLOAD, "hf-trainer").data)
    ds = args.hf_deepspeed_config.config
    assert ds["zero_optimization"]["stage"] == 2
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["train_micro_batch_size_per_gpu"] == args.per_device_train_batch_size == 2


@needs("transformers", "hf")
def test_hf_trainer_one_gpu_and_8bit_optimizer():
    s = plan(precision="fp16-mixed", checkpointing="full", micro_batch=4, accumulation=2,
             optimizer="adamw-8bit")
    args = training_args(export_plan(s, "hf-trainer").data)
    assert args.fp16 and args.gradient_checkpointing
    assert args.optim == "adamw_bnb_8bit"
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (4, 2)


@needs("transformers", "hf")
def test_hf_trainer_json_file_parser(tmp_path):
    """HfArgumentParser(TrainingArguments).parse_json_file reads the file as written."""
    import transformers.training_args as ta
    from transformers import HfArgumentParser

    export_plan(DDP2, "hf-trainer", tmp_path / "args.json")
    (args,) = HfArgumentParser(ta.TrainingArguments).parse_json_file(tmp_path / "args.json")
    assert args.fp16 and args.per_device_train_batch_size == 4


# -- Lightning ----------------------------------------------------------------------------------

def lightning_trainer(path: Path):
    """LightningCLI reads the file and builds the Trainer. FSDP and the TP strategy refuse a
    machine without CUDA, so Lightning is told this one has 8 GPUs (the device count it
    checks: lightning/fabric/accelerators/cuda.py: num_cuda_devices)."""
    import lightning.fabric.accelerators.cuda as fabric_cuda
    import lightning.pytorch.accelerators.cuda as pl_cuda
    from lightning.pytorch import LightningModule
    from lightning.pytorch.cli import LightningCLI

    class Model(LightningModule):
        pass

    with mock.patch.object(fabric_cuda, "num_cuda_devices", lambda: 8), \
            mock.patch.object(pl_cuda, "num_cuda_devices", lambda: 8), \
            mock.patch.object(pl_cuda.CUDAAccelerator, "is_available",
                              staticmethod(lambda: True)), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LightningCLI(Model, args=["--config", str(path)], run=False,
                            save_config_callback=None).trainer


@needs("lightning", "export")
@needs("jsonargparse", "export", " (LightningCLI needs it)")
def test_lightning_fsdp(tmp_path):
    export_plan(FSDP8, "lightning", tmp_path / "l.yaml")
    trainer = lightning_trainer(tmp_path / "l.yaml")
    from lightning.pytorch.strategies import FSDPStrategy

    assert isinstance(trainer.strategy, FSDPStrategy)
    assert trainer.strategy.sharding_strategy.name == "FULL_SHARD"
    assert (trainer.num_devices, trainer.num_nodes, trainer.accumulate_grad_batches) == (8, 1, 4)
    assert trainer.precision == "bf16-mixed"


@needs("lightning", "export")
@needs("jsonargparse", "export", " (LightningCLI needs it)")
@needs("deepspeed", "export")
def test_lightning_deepspeed_zero3_offload(tmp_path):
    out = export_plan(ZERO3_OFFLOAD, "lightning", tmp_path / "l.yaml")
    trainer = lightning_trainer(tmp_path / "l.yaml")
    zero = trainer.strategy.config["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["offload_optimizer"]["device"] == "cpu" and zero["offload_param"]["device"] == "cpu"
    # 16 GPUs = 2 nodes of 8
    assert (trainer.num_devices, trainer.num_nodes, trainer.accumulate_grad_batches) == (8, 2, 16)
    assert trainer.precision == "16-mixed"
    assert {"micro_batch", "optimizer"} <= {g.setting for g in out.gaps}


@needs("lightning", "export")
@needs("jsonargparse", "export", " (LightningCLI needs it)")
def test_lightning_hsdp_and_tp(tmp_path):
    export_plan(HSDP16, "lightning", tmp_path / "h.yaml")
    trainer = lightning_trainer(tmp_path / "h.yaml")
    assert trainer.strategy.sharding_strategy.name == "HYBRID_SHARD"
    assert tuple(trainer.strategy.kwargs["device_mesh"]) == (2, 8)
    export_plan(TP, "lightning", tmp_path / "t.yaml")
    trainer = lightning_trainer(tmp_path / "t.yaml")
    from lightning.pytorch.strategies import ModelParallelStrategy

    assert isinstance(trainer.strategy, ModelParallelStrategy)
    assert (trainer.strategy._data_parallel_size, trainer.strategy._tensor_parallel_size) == (4, 2)


# -- torchtitan ---------------------------------------------------------------------------------

@needs("torchtitan", "export-torchtitan")
@needs("tyro", "export-torchtitan")
def test_torchtitan_overrides_parse_with_its_tyro_rules(tmp_path):
    """torchtitan 0.3's ConfigManager parses ``--section.field=value`` overrides with tyro into
    Trainer.Config. Its model registries import triton (absent from CPU torch builds), so the
    overrides are parsed into a config of the same sections (checked against Trainer.Config's
    source), with ConfigManager's own tyro registry."""
    from dataclasses import field, make_dataclass

    import tyro
    from torchtitan.config.configs import ParallelismConfig, TrainingConfig
    from torchtitan.config.manager import custom_registry
    from torchtitan.distributed.activation_checkpoint import (
        ActivationCheckpointingConfig,
        FullAC,
        SelectiveAC,
    )

    source = Path(importlib.util.find_spec("torchtitan.trainer").origin).read_text()
    fields = {node.target.id: ast.unparse(node.annotation)
              for node in ast.walk(ast.parse(source))
              if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}
    assert fields["training"] == "TrainingConfig"
    assert fields["parallelism"] == "ParallelismConfig"
    assert fields["activation_checkpoint"] == "ActivationCheckpointingConfig"

    # Built with real types: this module's annotations are strings (future import).
    sections = make_dataclass("Sections", [
        ("training", TrainingConfig, field(default_factory=TrainingConfig)),
        ("parallelism", ParallelismConfig, field(default_factory=ParallelismConfig)),
        ("activation_checkpoint", ActivationCheckpointingConfig,
         field(default_factory=SelectiveAC.Config))], kw_only=True)

    def parse(settings):
        out = export_plan(settings, "torchtitan", tmp_path / "o.txt")
        argv = [line for line in (tmp_path / "o.txt").read_text().splitlines()
                if line and not line.startswith("#")]
        return tyro.cli(sections, args=argv, registry=custom_registry), out

    cfg, _ = parse(HSDP16)
    t, p = cfg.training, cfg.parallelism
    assert (t.local_batch_size, t.global_batch_size) == (1, 1 * 2 * 16)
    assert (t.dtype, t.mixed_precision_param) == ("float32", "bfloat16")
    assert (p.data_parallel_shard_degree, p.data_parallel_replicate_degree) == (8, 2)
    assert cfg.activation_checkpoint is None  # checkpointing none

    cfg, out = parse(PP)  # 8 GPUs = pp 4 x dp 2; pure bf16; selective (op-level) SAC
    t, p = cfg.training, cfg.parallelism
    assert (p.pipeline_parallel_degree, p.pipeline_parallel_schedule) == (4, "1F1B")
    # a pipeline runs the 8 micro-batches of 1 in flight: local batch 8, global 8 x dp 2
    assert (t.local_batch_size, p.pipeline_parallel_microbatch_size) == (8, 1)
    assert t.global_batch_size == 16 and t.dtype == "bfloat16"
    assert isinstance(cfg.activation_checkpoint, SelectiveAC.Config)
    assert "pp" not in {g.setting for g in out.gaps}

    cfg, _ = parse(TP)
    assert (cfg.parallelism.tensor_parallel_degree, cfg.parallelism.enable_sequence_parallel,
            cfg.parallelism.data_parallel_shard_degree) == (2, True, 4)
    cfg, _ = parse(plan(parallel=Parallel(gpus=8, tp=2, zero=3)))  # TP without SP
    assert cfg.parallelism.enable_sequence_parallel is False

    cfg, out = parse(ZERO3_OFFLOAD)  # fp16-mixed: torchtitan has no fp16
    assert cfg.training.enable_cpu_offload is True
    assert cfg.parallelism.data_parallel_shard_degree == 16
    assert "precision" in {g.setting for g in out.gaps}

    cfg, _ = parse(FSDP8)
    assert isinstance(cfg.activation_checkpoint, FullAC.Config)


# -- torchtune ----------------------------------------------------------------------------------

def recipe_keys(recipe: str) -> set[str]:
    """The config keys a shipped torchtune recipe reads: ``cfg.key`` and ``cfg.get("key")``."""
    source = Path(importlib.util.find_spec("recipes").submodule_search_locations[0],
                  f"{recipe}.py").read_text()
    keys = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id == "cfg":
            keys.add(node.attr)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "get" and isinstance(node.func.value, ast.Name) \
                and node.func.value.id == "cfg" and node.args \
                and isinstance(node.args[0], ast.Constant):
            keys.add(node.args[0].value)
    return keys


@needs("recipes", "export-torchtune", " (torchtune's recipes ship with torchtune)")
@needs("omegaconf", "export-torchtune")
def test_torchtune_keys_are_what_its_recipes_read(tmp_path):
    """torchtune loads configs with OmegaConf (torchtune/config/_parse.py). ``import torchtune``
    itself fails with torchao >= 0.14 (torchtune 0.6.1 imports torchao.dtypes.nf4tensor), so
    the file is loaded with OmegaConf, merged over the recipe config torchtune ships, and every
    key is checked against the keys the shipped recipe reads."""
    from omegaconf import OmegaConf

    spec = importlib.util.find_spec("recipes")
    base = OmegaConf.load(Path(spec.submodule_search_locations[0], "configs", "llama3_1",
                               "8B_full.yaml"))
    for settings, recipe in ((FSDP8, "full_finetune_distributed"),
                             (ONE, "full_finetune_single_device")):
        export_plan(settings, "torchtune", tmp_path / "t.yaml")
        ours = OmegaConf.load(tmp_path / "t.yaml")
        unread = set(ours) - recipe_keys(recipe)
        assert not unread, f"{recipe} does not read {unread}"
        merged = OmegaConf.merge(base, ours)
        assert merged.batch_size == settings.recipe.micro_batch
        assert merged.gradient_accumulation_steps == settings.recipe.accumulation
        assert merged.optimizer._component_ == "torch.optim.AdamW"
    merged = OmegaConf.merge(base, OmegaConf.load(tmp_path / "t.yaml"))
    assert (merged.dtype, merged.enable_activation_checkpointing) == ("fp32", False)
    export_plan(FSDP8, "torchtune", tmp_path / "t.yaml")
    ours = OmegaConf.load(tmp_path / "t.yaml")
    assert ours.fsdp_reshard_after_forward is True and ours.enable_activation_checkpointing
