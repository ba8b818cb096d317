"""A Lightning Trainer config (``lightning_config.yaml``): the ``trainer:`` section that
``LightningCLI`` reads (``python train.py fit --config lightning_config.yaml``), with the
strategy as ``class_path``/``init_args`` (or a registered name).

Arguments follow ``lightning.pytorch.Trainer`` and the strategies' constructors
(``DeepSpeedStrategy``, ``FSDPStrategy``, ``ModelParallelStrategy``).
"""

from __future__ import annotations

from typing import Any

from memfit.export import _yaml
from memfit.export._base import Builder, Export, sharding_engine
from memfit.export.deepspeed import zero_stage
from memfit.export.settings import PlanSettings

_PRECISION = {"fp32": "32-true", "bf16-mixed": "bf16-mixed", "fp16-mixed": "16-mixed",
              "bf16": "bf16-true"}
_STRATEGIES = "lightning.pytorch.strategies."


def strategy(s: PlanSettings, b: Builder) -> str | dict[str, Any]:
    """The Trainer's ``strategy`` argument, as LightningCLI writes it."""
    engine = sharding_engine(s, b)
    if s.parallel.tp > 1:
        if engine == "deepspeed" or s.recipe.offload_params:
            b.gap("tp", s.parallel.tp, "Lightning's tensor parallelism (ModelParallelStrategy) "
                  "runs on FSDP2 without offload; this plan needs DeepSpeed or offload")
        else:
            b.note(f"tp {s.parallel.tp}: ModelParallelStrategy applies the TP plan your "
                   "LightningModule.configure_model() writes (parallelize_module)")
            if s.zero < 3 and s.parallel.dp > 1:
                b.gap("zero", s.zero, "ModelParallelStrategy shards parameters over the "
                      "data-parallel ranks (FSDP2) whenever data_parallel_size > 1")
            return {"class_path": _STRATEGIES + "ModelParallelStrategy",
                    "init_args": {"data_parallel_size": s.parallel.dp,
                                  "tensor_parallel_size": s.parallel.tp}}
    if engine == "deepspeed":
        args: dict[str, Any] = {"stage": zero_stage(s, b)}
        if s.recipe.offload_states:
            args.update(offload_optimizer=True, offload_optimizer_device=s.recipe.offload_to)
        if s.recipe.offload_params:
            args.update(offload_parameters=True, offload_params_device=s.recipe.offload_to)
        if s.recipe.offload_to == "nvme":
            b.gap("offload_device", "nvme", "the NVMe path is not in the plan; set nvme_path "
                  "(default /local_nvme)")
        if s.replicate > 1:
            b.gap("replicate", s.replicate, "DeepSpeedStrategy has no HSDP; use a DeepSpeed "
                  "config (memfit export --to deepspeed) for ZeRO++ hpZ")
        return {"class_path": _STRATEGIES + "DeepSpeedStrategy", "init_args": args}
    if engine == "fsdp":
        args = {"sharding_strategy": "HYBRID_SHARD" if s.replicate > 1 else "FULL_SHARD",
                "cpu_offload": s.recipe.offload_params}
        if s.replicate > 1:
            args["device_mesh"] = [s.replicate, s.shard]
        if s.recipe.offload_to == "nvme":
            b.gap("offload_device", "nvme", "FSDP offloads to CPU memory only")
        if s.recipe.offload_params and not s.recipe.offload_states:
            b.note("FSDP's cpu_offload moves optimizer states too")
        return {"class_path": _STRATEGIES + "FSDPStrategy", "init_args": args}
    return "ddp" if engine == "ddp" else "auto"


def export(s: PlanSettings) -> Export:
    b = Builder(s, "lightning")
    trainer: dict[str, Any] = {
        "accelerator": "cpu" if s.device == "cpu" else "gpu",
        "devices": s.parallel.gpus if s.nodes == 1 else s.gpus_per_node,
        "num_nodes": s.nodes,
        "precision": _PRECISION.get(s.recipe.precision, "32-true"),
        "accumulate_grad_batches": s.recipe.accumulation,
        "strategy": strategy(s, b),
    }
    if s.parallel.gpus % s.gpus_per_node and s.nodes > 1:
        b.gap("gpus", s.parallel.gpus, f"Lightning runs the same number of devices on every node; "
              f"{s.parallel.gpus} GPUs are not whole nodes of {s.gpus_per_node}")
    if s.recipe.precision not in _PRECISION:
        b.gap("precision", s.recipe.precision, "not a Lightning precision here (fp8: "
              "precision='transformer-engine' or torchao in configure_model)")
    if s.recipe.checkpointing != "none" and not b.budget_checkpointing():
        b.gap("checkpointing", s.recipe.checkpointing, "Lightning checkpoints the module "
              "classes you name (FSDPStrategy(activation_checkpointing_policy={Block})) or in "
              "configure_model(); the plan does not know your block class")
    if s.recipe.offload_activations:
        b.gap("offload_activations", True, "Lightning has no activation offload setting; use "
              "torch.autograd.graph.save_on_cpu in training_step")
    st = trainer["strategy"]
    on_deepspeed = isinstance(st, dict) and st["class_path"].endswith("DeepSpeedStrategy")
    if s.recipe.offload_gradients and not (s.recipe.offload_states and on_deepspeed):
        b.gap("offload_gradients", True, "only DeepSpeed's ZeRO-Offload moves gradients alone")
    b.gap("micro_batch", s.recipe.micro_batch, "the batch size is your DataLoader's "
          f"(batch_size={s.recipe.micro_batch}), not the Trainer's")
    b.gap("optimizer", s.recipe.optimizer, "the optimizer is built in "
          "LightningModule.configure_optimizers()")
    if s.parallel.pp > 1:
        b.gap("pp", s.parallel.pp, "Lightning has no pipeline-parallel strategy")
    if s.parallel.ep > 1:
        b.gap("ep", s.parallel.ep, "Lightning has no expert-parallel setting")
    if s.parallel.sp:
        b.gap("sequence_parallel", True, "sequence parallelism is in the TP plan your "
              "configure_model() applies (SequenceParallel)")
    b.model_code()
    header = ("Lightning Trainer settings from a memfit plan (LightningCLI: python train.py fit "
              "--config lightning_config.yaml)")
    out = {"trainer": trainer}
    return b.done(_yaml.dump(out, header), "lightning_config.yaml", out)
