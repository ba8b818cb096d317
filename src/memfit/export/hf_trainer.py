"""Hugging Face ``TrainingArguments`` keyword arguments (``training_args.json``), read by
``TrainingArguments(**json.load(f))`` or ``HfArgumentParser(TrainingArguments)
.parse_json_file(path)``.

Names follow ``transformers/training_args.py`` (``TrainingArguments``, ``OptimizerNames``,
``FSDPOption``); the FSDP keys are the FSDP2 ones (``fsdp_config["version"] = 2``).
"""

from __future__ import annotations

from typing import Any

from memfit.export import deepspeed
from memfit.export._base import Builder, Export, dump_json, sharding_engine
from memfit.export.settings import PlanSettings

# memfit optimizer -> TrainingArguments.optim (transformers.training_args.OptimizerNames).
_OPTIM = {"adamw": "adamw_torch", "adam": "adamw_torch", "sgd": "sgd", "sgd-momentum": "sgd",
          "adafactor": "adafactor", "adamw-8bit": "adamw_bnb_8bit",
          "adam-8bit": "adamw_bnb_8bit", "lion": "lion_32bit"}


def export(s: PlanSettings) -> Export:
    b = Builder(s, "hf-trainer")
    engine = sharding_engine(s, b)
    out: dict[str, Any] = {
        "per_device_train_batch_size": s.recipe.micro_batch,
        "gradient_accumulation_steps": s.recipe.accumulation,
    }
    if s.device == "cpu":
        out["use_cpu"] = True
    if s.recipe.precision == "bf16-mixed":
        out["bf16"] = True
    elif s.recipe.precision == "fp16-mixed":
        out["fp16"] = True
    elif s.recipe.precision == "bf16":
        b.gap("precision", "bf16", "TrainingArguments' bf16 is autocast over fp32 weights; for "
              "pure bf16 load the model with from_pretrained(dtype=torch.bfloat16)")
    elif s.recipe.precision != "fp32":
        b.gap("precision", s.recipe.precision, "TrainingArguments has no switch for it (fp8: "
              "Accelerate's fp8 recipe or torchao in code)")
    optim = _OPTIM.get(s.recipe.optimizer)
    if optim is None:
        b.gap("optimizer", s.recipe.optimizer, "not a TrainingArguments optim name; pass "
              "Trainer(optimizers=(optimizer, scheduler))")
    else:
        out["optim"] = optim
        if s.recipe.optimizer == "adam":
            out["weight_decay"] = 0.0
            b.note("adam: exported as adamw_torch with weight_decay 0.0, which is Adam")
        if s.recipe.optimizer == "sgd-momentum":
            out["optim_args"] = "momentum=0.9"
            b.note("sgd-momentum: exported as sgd with optim_args momentum=0.9 (the value is "
                   "yours)")
    full = s.recipe.checkpointing == "full"
    if engine == "deepspeed":
        out["deepspeed"] = deepspeed.config(s, b, standalone=False)
    elif engine == "fsdp":
        # transformers 5: fsdp=True, everything in fsdp_config (the option string is
        # deprecated: training_args.py _apply_legacy_fsdp_to_config).
        out["fsdp"] = True
        out["fsdp_config"] = {"version": 2, "reshard_after_forward": True,
                              "cpu_offload": s.recipe.offload_params,
                              "activation_checkpointing": full}
        if s.replicate > 1:
            b.gap("replicate", s.replicate, "HSDP with FSDP2 needs TrainingArguments("
                  "parallelism_config=accelerate.ParallelismConfig(dp_replicate_size="
                  f"{s.replicate}, dp_shard_size={s.shard})), an object a JSON file cannot hold")
        if s.recipe.offload_to == "nvme":
            b.gap("offload_device", "nvme", "FSDP offloads to CPU memory only")
        if s.recipe.offload_gradients and not s.recipe.offload_params:
            b.gap("offload_gradients", True, "FSDP offloads gradients only with parameters")
    if full and engine != "fsdp":
        out["gradient_checkpointing"] = True
    if s.recipe.offload_activations:
        b.gap("offload_activations", True, "TrainingArguments has no activation offload in "
              "every transformers version; use torch.autograd.graph.save_on_cpu in code")
    if s.recipe.checkpointing not in ("none", "full") and not b.budget_checkpointing():
        b.gap("checkpointing", s.recipe.checkpointing, "TrainingArguments checkpoints whole layers "
              "only (gradient_checkpointing); apply selective checkpointing with "
              "memfit.techniques")
    if s.parallel.tp > 1:
        b.gap("tp", s.parallel.tp, "tensor parallelism needs TrainingArguments(parallelism_config="
              f"accelerate.ParallelismConfig(tp_size={s.parallel.tp})), an object a JSON file "
              "cannot hold, and a model with a tp_plan")
    if s.parallel.sp:
        b.gap("sequence_parallel", True, "the Trainer has no Megatron-style sequence "
              "parallelism")
    if s.parallel.pp > 1:
        b.gap("pp", s.parallel.pp, "the Trainer has no pipeline parallelism")
    if s.parallel.ep > 1:
        b.gap("ep", s.parallel.ep, "TrainingArguments has no expert parallelism")
    if s.parallel.gpus > 1:
        b.gap("gpus", s.parallel.gpus, "the number of processes is not a TrainingArguments "
              f"setting: launch {s.parallel.gpus} (torchrun --nproc-per-node / --nnodes, or "
              "accelerate launch)")
    b.model_code()
    return b.done(dump_json(out), "training_args.json", out)
