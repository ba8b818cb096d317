"""A DeepSpeed config (``ds_config.json``), read by ``deepspeed.initialize(config=...)`` and
``deepspeed.runtime.config.DeepSpeedConfig``.

Keys follow DeepSpeed's config reference (deepspeed.ai/docs/config-json) and its pydantic
models (``deepspeed/runtime/zero/config.py``, ``zero/offload_config.py``,
``precision_config.py``, ``tensor_parallel/config.py``).
"""

from __future__ import annotations

from typing import Any

from memfit.export._base import Builder, Export, dump_json
from memfit.export.settings import PlanSettings

# memfit optimizer -> DeepSpeed's "optimizer.type" (DeepSpeed's own optimizers, else a
# torch.optim class name: deepspeed/runtime/engine.py: _configure_basic_optimizer).
_OPTIMIZERS = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD", "sgd-momentum": "SGD",
               "lion": "Lion", "adafactor": None, "adamw-8bit": None, "adam-8bit": None}


def zero_stage(s: PlanSettings, b: Builder) -> int:
    """The ZeRO stage DeepSpeed runs: the plan's, or 1 where the plan offloads optimizer states
    without sharding (DeepSpeed offloads only through ZeRO; on one GPU ZeRO-1 shards nothing)."""
    if s.recipe.offload_states and s.zero == 0:
        b.note("offload_optimizer without sharding: exported as ZeRO stage 1 with "
               "offload_optimizer (DeepSpeed offloads only through ZeRO)"
               + ("; with one data-parallel rank stage 1 shards nothing" if s.parallel.dp == 1 else
                  "; stage 1 also shards the optimizer states over the data-parallel ranks"))
        return 1
    return s.zero


def config(s: PlanSettings, b: Builder, *, standalone: bool = True) -> dict[str, Any]:
    """The DeepSpeed config dict. ``standalone=False``: embedded in another tool's config (the
    Hugging Face Trainer's), which carries the optimizer, checkpointing and model-code settings
    itself."""
    out: dict[str, Any] = {
        "train_batch_size": s.global_batch,
        "train_micro_batch_size_per_gpu": s.recipe.micro_batch,
        "gradient_accumulation_steps": s.recipe.accumulation,
    }
    stage = zero_stage(s, b)
    if s.recipe.precision == "bf16-mixed":
        out["bf16"] = {"enabled": True}
        if s.source == "fit":
            b.note("bf16-mixed: DeepSpeed's bf16 mode keeps 16-bit weights with fp32 masters "
                   "in the optimizer; the fit plan traced torch.autocast over fp32 weights")
    elif s.recipe.precision == "fp16-mixed":
        out["fp16"] = {"enabled": True, "loss_scale": 0}  # 0: dynamic loss scaling
    elif s.recipe.precision == "bf16":
        if stage >= 1:
            out["bf16"] = {"enabled": True, "bf16_master_weights_and_grads": True,
                           "bf16_optimizer_states": True}
        else:
            out["bf16"] = {"enabled": True}
            b.gap("precision", "bf16", "DeepSpeed keeps fp32 master weights unless ZeRO (stage "
                  ">= 1) runs bf16_master_weights_and_grads; exported as bf16 with fp32 "
                  "masters")
    elif s.recipe.precision != "fp32":
        b.gap("precision", s.recipe.precision, "DeepSpeed's config has no switch for it (fp8: "
              "apply torchao's float8 in code); exported without mixed precision")
    zero: dict[str, Any] = {"stage": stage}
    if s.recipe.offload_states:
        zero["offload_optimizer"] = {"device": s.recipe.offload_to, "pin_memory": True}
    if s.recipe.offload_params:
        zero["offload_param"] = {"device": s.recipe.offload_to, "pin_memory": True}
    if s.recipe.offload_to == "nvme" and (s.recipe.offload_states or s.recipe.offload_params):
        for key in ("offload_optimizer", "offload_param"):
            if key in zero:
                zero[key]["nvme_path"] = "/local_nvme"
        b.gap("offload_device", "nvme", "the NVMe path is not in the plan; exported as "
              "/local_nvme: set nvme_path to your NVMe mount")
    if s.recipe.offload_gradients and not s.recipe.offload_states:
        b.gap("offload_gradients", True, "DeepSpeed moves gradients to the host only with "
              "offload_optimizer (ZeRO-Offload)")
    if s.replicate > 1:
        zero["zero_hpz_partition_size"] = s.shard
        b.note(f"HSDP ({s.replicate} replicas x {s.shard}): exported as ZeRO++ hierarchical "
               "partitioning (zero_hpz_partition_size), which keeps a secondary copy of the "
               "parameters within each group")
    if stage or s.recipe.offload_states:
        out["zero_optimization"] = zero
    name = _OPTIMIZERS.get(s.recipe.optimizer)
    if not standalone:
        pass
    elif name is not None:
        opt: dict[str, Any] = {"type": name, "params": {}}
        if s.recipe.optimizer == "sgd-momentum":
            opt["params"]["momentum"] = 0.9
            b.note("sgd-momentum: exported as SGD with momentum 0.9 (memfit counts one "
                   "momentum buffer; its value is yours)")
        out["optimizer"] = opt
        b.note("optimizer hyperparameters (lr, betas, weight_decay) are not in the plan: add "
               "them under optimizer.params")
    else:
        out["zero_allow_untested_optimizer"] = True
        b.gap("optimizer", s.recipe.optimizer, "not a DeepSpeed optimizer: pass it to "
              "deepspeed.initialize(optimizer=...) (zero_allow_untested_optimizer is set)")
    if s.parallel.tp > 1:
        out["tensor_parallel"] = {"autotp_size": s.parallel.tp}
        b.note(f"tp {s.parallel.tp}: exported as DeepSpeed AutoTP training "
               "(tensor_parallel.autotp_size)")
    if s.parallel.sp:
        b.gap("sequence_parallel", True, "AutoTP has no Megatron-style sequence parallelism; "
              "activations are not sharded along the sequence")
    if s.parallel.pp > 1:
        b.gap("pp", s.parallel.pp, "DeepSpeed's pipeline is built in code: "
              f"deepspeed.pipe.PipelineModule(layers, num_stages={s.parallel.pp})")
    if s.parallel.ep > 1:
        b.gap("ep", s.parallel.ep, "expert parallelism is set in code: "
              f"deepspeed.moe.layer.MoE(..., ep_size={s.parallel.ep})")
    if s.engine not in (None, "deepspeed"):
        b.note(f"the plan names engine {s.engine!r}: DeepSpeed lays out memory its own way "
               "(re-plan with --engine deepspeed to predict it)")
    if not standalone:
        return out
    if not b.budget_checkpointing() and s.recipe.checkpointing != "none":
        b.gap("checkpointing", s.recipe.checkpointing, "DeepSpeed's config cannot turn activation "
              "checkpointing on; do it in code (model.gradient_checkpointing_enable() or "
              "deepspeed.checkpointing.checkpoint)")
    if s.recipe.offload_activations:
        b.gap("offload_activations", True, "DeepSpeed offloads activations only for its own "
              "deepspeed.checkpointing (activation_checkpointing.cpu_checkpointing); use "
              "torch.autograd.graph.save_on_cpu in code")
    b.model_code()
    return out


def export(s: PlanSettings) -> Export:
    b = Builder(s, "deepspeed")
    data = config(s, b)
    if s.device == "cpu":
        b.note("device cpu: the config names no device; DeepSpeed picks its accelerator from "
               "the environment (DS_ACCELERATOR=cpu)")
    return b.done(dump_json(data), "ds_config.json", data)
