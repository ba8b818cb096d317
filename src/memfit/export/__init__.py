"""Write a plan as the config file each training tool reads.

>>> plan = memfit.fit(model, batch, global_batch=64, gpu="a100-80gb")
>>> out = memfit.export.export_plan(plan, "deepspeed", "ds_config.json")
>>> for gap in out.gaps:                # what the DeepSpeed config could not carry
...     print(gap.setting, gap.value, gap.reason)

``memfit export plan.json --to deepspeed`` does the same from a saved plan (``memfit fit
--save``) or an analytic one (``memfit plan ... --json``). Targets: deepspeed (ds_config.json),
accelerate (accelerate_config.yaml), hf-trainer (TrainingArguments keyword arguments as JSON),
lightning (LightningCLI trainer YAML), torchtitan (command-line overrides), torchtune (recipe
YAML keys).

Known limitations: the files carry what the plan chose (precision, checkpointing, batch
split, sharding, offload, parallel sizes); learning rates, models and data are yours. A
setting a tool cannot express is returned in ``Export.gaps`` (and printed by the CLI), never
dropped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memfit.errors import MemfitError, read_json_file, suggest
from memfit.export._base import Export, Gap
from memfit.export.settings import PlanSettings, settings_from_dict, settings_from_plan

__all__ = ["TARGETS", "Export", "Gap", "PlanSettings", "export_plan", "read_plan"]

TARGETS = ("deepspeed", "accelerate", "lightning", "hf-trainer", "torchtitan", "torchtune")


def read_plan(path: str | Path) -> PlanSettings:
    """The settings of a plan file (JSON only: never eval'd or unpickled)."""
    data = read_json_file(path, what="plan file", fix="write one with memfit fit --save "
                          "plan.json or memfit plan ... --json > plan.json")
    return settings_from_dict(data, source=f"plan file {path}")


def _exporter(to: str) -> Any:
    to = str(to).strip().lower().replace("_", "-")  # HF_Trainer, hf_trainer: hf-trainer
    if to not in TARGETS:
        raise MemfitError(f"unknown export target {to!r}{suggest(str(to), TARGETS)}; valid: "
                          f"{', '.join(TARGETS)}")
    from importlib import import_module

    return import_module(f"memfit.export.{to.replace('-', '_')}")


def export_plan(plan: Any, to: str, path: str | Path | None = None) -> Export:
    """Export ``plan`` (a :class:`memfit.fitting.Plan`, :class:`PlanSettings`, a plan's JSON
    dict, or a plan file's path) for the tool ``to``; write it to ``path`` when given."""
    module = _exporter(to)
    if isinstance(plan, PlanSettings):
        settings = plan
    elif isinstance(plan, str | Path):
        settings = read_plan(plan)
    elif isinstance(plan, dict):
        settings = settings_from_dict(plan)
    elif hasattr(plan, "to_dict") and hasattr(plan, "chosen"):
        settings = settings_from_plan(plan)
    else:
        raise MemfitError(f"cannot export a {type(plan).__name__}: give a memfit Plan, a "
                          "plan's JSON dict or a plan file's path")
    out = module.export(settings)
    if path is not None:
        out.write(path)
    return out
