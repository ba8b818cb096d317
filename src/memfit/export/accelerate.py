"""An Accelerate config (``accelerate_config.yaml``), read by ``accelerate launch
--config_file`` (``accelerate/commands/config/config_args.py: load_config_from_file``).

Nested keys are the ones ``accelerate config`` writes; ``accelerate launch`` copies each onto
its own command-line argument of the same name (``commands/launch.py:
_validate_launch_command``).
"""

from __future__ import annotations

from typing import Any

from memfit.export import _yaml
from memfit.export._base import Builder, Export, sharding_engine
from memfit.export.deepspeed import zero_stage
from memfit.export.settings import PlanSettings

_MIXED = {"fp32": "no", "bf16-mixed": "bf16", "fp16-mixed": "fp16", "fp8": "fp8"}


def export(s: PlanSettings) -> Export:
    """``accelerate_config.yaml`` for the plan, and the gaps it cannot express."""
    b = Builder(s, "accelerate")
    engine = _engine(s, b)
    out = _launch_settings(s, engine)
    _device_and_precision(s, b, engine)
    if engine == "deepspeed":
        out["deepspeed_config"] = _deepspeed_config(s, b)
    elif s.recipe.accumulation > 1:
        steps = s.recipe.accumulation
        b.gap("accumulation", steps, "Accelerate's config file has no accumulation "
              f"outside DeepSpeed: Accelerator(gradient_accumulation_steps={steps}) or "
              f"accelerate launch --gradient_accumulation_steps {s.recipe.accumulation}")
    if engine == "fsdp":
        _fsdp_config(s, b, out)
    _in_code(s, b, out, engine)
    b.model_code()
    header = ("Accelerate config from a memfit plan: accelerate launch --config_file "
              "accelerate_config.yaml train.py")
    return b.done(_yaml.dump(out, header), "accelerate_config.yaml", out)


def _engine(s: PlanSettings, b: Builder) -> str:
    """The sharding engine (``none``, ``ddp``, ``fsdp`` or ``deepspeed``); FSDP2 with tensor
    parallelism, which Accelerate runs only through FSDP2's ``parallelism_config``."""
    engine = sharding_engine(s, b)
    if s.parallel.tp > 1 and engine == "deepspeed":
        b.gap("tp", s.parallel.tp, "Accelerate runs tensor parallelism only with FSDP2 "
              "(parallelism_config); this plan needs DeepSpeed for its sharding/offload")
    elif s.parallel.tp > 1:
        engine = "fsdp"  # Accelerate's parallelism_config needs FSDP2 (launch.py)
    return engine


def _launch_settings(s: PlanSettings, engine: str) -> dict[str, Any]:
    """The top-level keys ``accelerate launch`` reads: processes, machines, distributed type,
    mixed precision."""
    cpu = s.device == "cpu"
    return {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "distributed_type": {"none": "NO", "ddp": "MULTI_CPU" if cpu else "MULTI_GPU",
                             "fsdp": "FSDP", "deepspeed": "DEEPSPEED"}[engine],
        "downcast_bf16": "no",
        "machine_rank": 0,
        "main_training_function": "main",
        "mixed_precision": _MIXED.get(s.recipe.precision, "no"),
        "num_machines": s.nodes,
        "num_processes": s.parallel.gpus,
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": cpu,
    }


def _device_and_precision(s: PlanSettings, b: Builder, engine: str) -> None:
    """Gaps of the device (sharding on the CPU) and of a precision that is not an Accelerate
    ``mixed_precision``."""
    if s.device == "cpu" and engine in ("fsdp", "deepspeed"):
        b.gap("device", "cpu", f"Accelerate runs {engine} on GPUs; on the CPU it runs plain "
              "or data-parallel (MULTI_CPU) training")
    if s.recipe.precision == "bf16":
        b.gap("precision", "bf16", "Accelerate's mixed_precision is autocast over fp32 "
              "weights; for pure bf16 load the model in bf16 (model.to(torch.bfloat16))")
    elif s.recipe.precision not in _MIXED:
        b.gap("precision", s.recipe.precision, "not an Accelerate mixed_precision (no, fp16, bf16, "
              "fp8)")


def _deepspeed_config(s: PlanSettings, b: Builder) -> dict[str, Any]:
    """``deepspeed_config``: the ZeRO stage, offload devices and accumulation."""
    ds: dict[str, Any] = {
        "gradient_accumulation_steps": s.recipe.accumulation,
        "offload_optimizer_device": s.recipe.offload_to if s.recipe.offload_states else "none",
        "offload_param_device": s.recipe.offload_to if s.recipe.offload_params else "none",
        "zero_stage": zero_stage(s, b),
    }
    if ds["zero_stage"] == 3:
        ds["zero3_init_flag"] = True
    if s.recipe.offload_to == "nvme":
        b.gap("offload_device", "nvme", "the NVMe path is not in the plan: add "
              "offload_optimizer_nvme_path / offload_param_nvme_path")
    if s.replicate > 1:
        b.gap("replicate", s.replicate, "HSDP needs FSDP2 in Accelerate; use a DeepSpeed "
              "config file (memfit export --to deepspeed) for ZeRO++ hpZ")
    return ds


def _fsdp_config(s: PlanSettings, b: Builder, out: dict[str, Any]) -> None:
    """``fsdp_config`` (FSDP2), and the ``parallelism_config`` of replicas and tensor
    parallelism."""
    full = s.recipe.checkpointing == "full"
    fsdp: dict[str, Any] = {
        "fsdp_activation_checkpointing": full,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_cpu_ram_efficient_loading": True,
        "fsdp_offload_params": s.recipe.offload_params,
        "fsdp_reshard_after_forward": True,
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_version": 2,
    }
    if s.recipe.offload_activations and full:
        fsdp["fsdp_activation_checkpointing_offload"] = True
    if s.recipe.offload_params and not s.recipe.offload_states:
        b.note("FSDP's CPU offload (fsdp_offload_params) moves optimizer states too")
    if s.recipe.offload_to == "nvme":
        b.gap("offload_device", "nvme", "FSDP offloads to CPU memory only")
    out["fsdp_config"] = fsdp
    if s.parallel.tp > 1 or s.replicate > 1 or s.zero < 3:
        # With the parallelism_config, Accelerate's FSDP shards over dp_shard_size ranks
        # (1: no sharding, plain replicas).
        out["parallelism_config"] = {
            "parallelism_config_dp_replicate_size": (s.replicate if s.zero == 3
                                                     else s.parallel.dp),
            "parallelism_config_dp_shard_size": s.shard if s.zero == 3 else 1,
            "parallelism_config_tp_size": s.parallel.tp,
            "parallelism_config_cp_size": 1,
        }


def _in_code(s: PlanSettings, b: Builder, out: dict[str, Any], engine: str) -> None:
    """Gaps of what Accelerate's config file cannot say and the training script does:
    checkpointing and activation offload outside FSDP2, the batch, the optimizer, pipeline,
    expert and sequence parallelism."""
    checkpointing = s.recipe.checkpointing
    if checkpointing != "none" and not (engine == "fsdp" and checkpointing == "full"):
        if not b.budget_checkpointing():
            b.gap("checkpointing", s.recipe.checkpointing, "Accelerate's config turns on full "
                  "checkpointing only under FSDP (fsdp_activation_checkpointing); do it in code "
                  "(model.gradient_checkpointing_enable() or torch.utils.checkpoint)")
    if s.recipe.offload_activations and "fsdp_activation_checkpointing_offload" not in out.get(
            "fsdp_config", {}):
        b.gap("offload_activations", True, "Accelerate offloads activations only with FSDP2 "
              "and full checkpointing; use torch.autograd.graph.save_on_cpu in code")
    if s.recipe.offload_gradients and engine != "deepspeed":
        b.gap("offload_gradients", True, "only DeepSpeed's ZeRO-Offload moves gradients alone")
    b.gap("micro_batch", s.recipe.micro_batch, "Accelerate's config has no batch size: "
          f"DataLoader(batch_size={s.recipe.micro_batch})")
    b.gap("optimizer", s.recipe.optimizer, "the optimizer is built in code (Accelerate prepares "
          "the one you pass)")
    if s.parallel.pp > 1:
        b.gap("pp", s.parallel.pp, "Accelerate's config has no pipeline parallelism "
              "(accelerate.inference.prepare_pippy is inference-only)")
    if s.parallel.ep > 1:
        b.gap("ep", s.parallel.ep, "Accelerate's config has no expert parallelism")
    if s.parallel.sp:
        b.gap("sequence_parallel", True, "Accelerate's TP plan comes from the model "
              "(tp_plan); sequence parallelism is not a config setting")
