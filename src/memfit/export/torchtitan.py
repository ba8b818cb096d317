"""torchtitan command-line overrides (``torchtitan_overrides.txt``).

torchtitan 0.3 reads no TOML: a job is a ``config_registry`` function (``--module llama3
--config llama3_8b``) plus ``--section.field=value`` overrides that ``ConfigManager`` parses with
tyro into ``Trainer.Config`` (``torchtitan/config/manager.py``; fields in
``torchtitan/config/configs.py`` and ``torchtitan/distributed/activation_checkpoint.py``).
This export is those overrides, one per line. The activation-checkpointing policy is not an
override but a tyro subcommand, written last as torchtitan's own messages spell it
(``activation-checkpoint:full``; ``torchtitan/distributed/activation_checkpoint.py``:
``ActivationCheckpointingConfig``, a union of ``selective``, ``full``, ``memory-budget`` and
``none``), under a comment saying so.
"""

from __future__ import annotations

from typing import Any

from memfit.export._base import Builder, Export
from memfit.export.settings import PlanSettings

# torchtitan's "selective" (op) is its every-second-mm policy: memfit's "torchtitan" exactly;
# memfit's "selective" (every matmul kept) is the nearest torchtitan has
_AC = {"none": "none", "selective": "selective", "torchtitan": "selective", "full": "full"}


def overrides(s: PlanSettings, b: Builder) -> dict[str, dict[str, Any]]:
    """``{section: {field: value}}``; the key ``activation_checkpoint`` holds the subcommand."""
    training: dict[str, Any] = {"global_batch_size": s.global_batch}
    par: dict[str, Any] = {}
    if s.parallel.pp > 1:
        # With pipelining the local batch is split into pipeline micro-batches: memfit's
        # micro-batches in flight are torchtitan's pipeline_parallel_microbatch_size.
        training["local_batch_size"] = s.recipe.micro_batch * s.recipe.accumulation
        par["pipeline_parallel_microbatch_size"] = s.recipe.micro_batch
    else:
        training["local_batch_size"] = s.recipe.micro_batch
    if s.recipe.precision == "bf16":
        training["dtype"] = "bfloat16"
    elif s.recipe.precision in ("fp32", "bf16-mixed"):
        training["dtype"] = "float32"
        training["mixed_precision_param"] = "bfloat16" if s.recipe.precision == "bf16-mixed" \
            else "float32"
    else:
        b.gap("precision", s.recipe.precision, "torchtitan trains in float32, bfloat16 or "
              "bf16 mixed precision (fp8: a float8 model converter in the config_registry "
              "function)")
    if s.zero == 3:
        par["data_parallel_shard_degree"] = s.shard
        par["data_parallel_replicate_degree"] = s.replicate
    elif s.zero in (1, 2):
        par["data_parallel_shard_degree"] = s.parallel.dp
        par["data_parallel_replicate_degree"] = 1
        par["fsdp_reshard_after_forward"] = "never"
        b.gap("zero", s.zero, f"torchtitan has no ZeRO-{s.zero}: exported as FSDP2 that keeps "
              "parameters unsharded from forward to backward (reshard_after_forward=never); "
              "parameters are also sharded at rest, so it holds less than planned")
    else:
        par["data_parallel_shard_degree"] = 1
        par["data_parallel_replicate_degree"] = s.parallel.dp
    if s.recipe.offload_states or s.recipe.offload_params:
        if par["data_parallel_shard_degree"] > 1:
            training["enable_cpu_offload"] = True
            if not (s.recipe.offload_states and s.recipe.offload_params):
                b.note("enable_cpu_offload (FSDP2 CPUOffloadPolicy) moves parameters, "
                       "gradients and optimizer states to the host")
        else:
            b.gap("offload", "optimizer" if s.recipe.offload_states else "params",
                  "torchtitan offloads only through FSDP (enable_cpu_offload needs "
                  "data_parallel_shard_degree > 1)")
    if s.recipe.offload_to == "nvme":
        b.gap("offload_device", "nvme", "torchtitan offloads to CPU memory only")
    par["tensor_parallel_degree"] = s.parallel.tp
    if s.parallel.tp > 1:
        par["enable_sequence_parallel"] = s.parallel.sp
    elif s.parallel.sp:
        b.gap("sequence_parallel", True, "sequence parallelism needs tp > 1")
    par["pipeline_parallel_degree"] = s.parallel.pp
    if s.parallel.pp > 1:
        par["pipeline_parallel_schedule"] = "1F1B"
    par["expert_parallel_degree"] = s.parallel.ep
    out: dict[str, dict[str, Any]] = {"training": training, "parallelism": par}
    if s.recipe.checkpointing in _AC:
        out["activation_checkpoint"] = {"mode": _AC[s.recipe.checkpointing]}
    else:
        b.budget_checkpointing()
    if s.recipe.offload_activations:
        b.gap("offload_activations", True, "torchtitan has no activation offload setting")
    if s.device == "cpu":
        b.gap("device", "cpu", "torchtitan trains on accelerators (CUDA, ROCm, XPU); it has "
              "no CPU setting")
    b.gap("optimizer", s.recipe.optimizer, "torchtitan's optimizer is set by the config_registry "
          "function (optimizer.param_groups: Adam, AdamW or DistMuon)")
    if s.engine not in (None, "fsdp", "fsdp2", "hsdp", "ddp"):
        b.note(f"the plan names engine {s.engine!r}; torchtitan runs FSDP2/DDP (memory "
               "layouts differ)")
    b.model_code()
    return out


def export(s: PlanSettings) -> Export:
    b = Builder(s, "torchtitan")
    data = overrides(s, b)
    lines = ["# torchtitan overrides from a memfit plan; run with:",
             f"#   torchrun --nproc-per-node={min(s.parallel.gpus, s.gpus_per_node)}"
             + (f" --nnodes={s.nodes}" if s.nodes > 1 else "")
             + " -m torchtitan.train --module MODEL --config CONFIG"
             " $(grep -v '^#' torchtitan_overrides.txt)"]
    for section in ("training", "parallelism"):
        for key, value in data[section].items():
            if isinstance(value, bool):  # tyro's boolean flags: --a.b / --a.no-b
                lines.append(f"--{section}.{'' if value else 'no-'}{key}")
            else:
                lines.append(f"--{section}.{key}={value}")
    if "activation_checkpoint" in data:
        # Not a --section.field=value override: the policy is a tyro subcommand (a union
        # field), chosen by name after the overrides.
        lines += ["# activation checkpointing: a subcommand (the policy's name), not an override",
                  f"activation-checkpoint:{data['activation_checkpoint']['mode']}"]
    return b.done("\n".join(lines) + "\n", "torchtitan_overrides.txt", data)
