"""torchtune recipe settings (``torchtune_config.yaml``), to merge into a recipe config
(``tune cp llama3_1/8B_full my.yaml``) that ``tune run`` loads with OmegaConf.

Keys are the ones torchtune's recipes read (``recipes/full_finetune_distributed.py``,
``recipes/full_finetune_single_device.py``: ``cfg.batch_size``, ``cfg.get("fsdp_cpu_offload")``,
...); components are written as ``_component_`` dotted paths.
"""

from __future__ import annotations

from typing import Any

from memfit.export import _yaml
from memfit.export._base import Builder, Export
from memfit.export.settings import PlanSettings

# memfit optimizer -> torchtune optimizer component (torch.optim or bitsandbytes classes).
_OPTIMIZERS = {"adamw": "torch.optim.AdamW", "adam": "torch.optim.Adam",
               "sgd": "torch.optim.SGD", "sgd-momentum": "torch.optim.SGD",
               "adafactor": "torch.optim.Adafactor", "adamw-8bit": "bitsandbytes.optim.AdamW8bit",
               "adam-8bit": "bitsandbytes.optim.Adam8bit"}


def config(s: PlanSettings, b: Builder) -> dict[str, Any]:
    out: dict[str, Any] = {"batch_size": s.recipe.micro_batch,
                           "gradient_accumulation_steps": s.recipe.accumulation, "device": s.device}
    if s.recipe.precision in ("fp32", "bf16"):
        out["dtype"] = "fp32" if s.recipe.precision == "fp32" else "bf16"
    else:
        out["dtype"] = "fp32"
        b.gap("precision", s.recipe.precision, "torchtune trains in one dtype (fp32 or bf16, no "
              "autocast); exported as dtype fp32, the planned weights (dtype bf16 would halve "
              "the model states instead)")
    full = s.recipe.checkpointing == "full"
    out["enable_activation_checkpointing"] = full
    if s.recipe.checkpointing in ("selective", "torchtitan"):
        b.gap("checkpointing", s.recipe.checkpointing, "torchtune's selective mode (ac_mode/"
              "ac_option) checkpoints every n-th layer, not op-level; exported without "
              "checkpointing")
    else:
        b.budget_checkpointing()
    out["enable_activation_offloading"] = s.recipe.offload_activations and full
    if s.recipe.offload_activations and not full:
        b.gap("offload_activations", True, "torchtune offloads activations only with "
              "enable_activation_checkpointing")
    name = _OPTIMIZERS.get(s.recipe.optimizer)
    if name is None:
        b.gap("optimizer", s.recipe.optimizer, "no torchtune component for it; set "
              "optimizer._component_ yourself")
    else:
        opt: dict[str, Any] = {"_component_": name}
        if s.recipe.optimizer == "sgd-momentum":
            opt["momentum"] = 0.9
        out["optimizer"] = opt
        b.note("optimizer: lr and the other hyperparameters are not in the plan; keep the "
               "recipe's")
    if s.parallel.gpus > 1:
        per_node = min(s.parallel.gpus, s.gpus_per_node)
        b.note(f"recipe: a distributed one (tune run --nproc_per_node {per_node}"
               + (f" --nnodes {s.nodes}" if s.nodes > 1 else "")
               + " full_finetune_distributed)")
        offload = s.recipe.offload_params or s.recipe.offload_states
        out["fsdp_cpu_offload"] = offload
        if offload and not (s.recipe.offload_params and s.recipe.offload_states):
            b.note("fsdp_cpu_offload (FSDP2 CPUOffloadPolicy) moves parameters, gradients "
                   "and optimizer states to the host")
        out["fsdp_reshard_after_forward"] = s.zero == 3
        if s.zero != 3:
            b.gap("zero", s.zero, "torchtune's distributed recipes always shard parameters with "
                  "FSDP2; exported with fsdp_reshard_after_forward false (parameters stay "
                  "gathered from forward to backward)")
        if s.replicate > 1:
            b.gap("replicate", s.replicate, "torchtune's recipes shard over every "
                  "data-parallel rank (no HSDP)")
        if s.parallel.tp > 1:
            out["tensor_parallel_dim"] = s.parallel.tp
            b.note("tensor_parallel_dim needs a tensor_parallel_plan component for your model")
    elif s.recipe.offload_states:
        b.gap("offload_optimizer", True, "torchtune's single-device recipe has no optimizer "
              "offload (torchao.optim.CPUOffloadOptimizer as the optimizer component does it)")
    if s.recipe.offload_to == "nvme":
        b.gap("offload_device", "nvme", "torchtune offloads to CPU memory only")
    if s.recipe.offload_gradients and s.parallel.gpus == 1:
        b.gap("offload_gradients", True, "torchtune offloads gradients only with FSDP")
    if s.parallel.sp:
        b.gap("sequence_parallel", True, "sequence parallelism comes with the "
              "tensor_parallel_plan, not a setting")
    if s.parallel.pp > 1:
        b.gap("pp", s.parallel.pp, "torchtune has no pipeline parallelism")
    if s.parallel.ep > 1:
        b.gap("ep", s.parallel.ep, "torchtune's recipes have no expert-parallel setting")
    if s.engine not in (None, "fsdp", "fsdp2"):
        b.note(f"the plan names engine {s.engine!r}; torchtune runs FSDP2")
    b.model_code()
    return out


def export(s: PlanSettings) -> Export:
    b = Builder(s, "torchtune")
    data = config(s, b)
    header = ("torchtune settings from a memfit plan: merge into your recipe config "
              "(tune cp <recipe config> my.yaml),\nor pass each as key=value to tune run")
    return b.done(_yaml.dump(data, header), "torchtune_config.yaml", data)
