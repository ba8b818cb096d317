"""Write a plan as the config file each training tool reads.

>>> plan = memfit.fit(model, batch, global_batch=64, gpu="a100-80gb")
>>> out = memfit.export.export_plan(plan, "deepspeed", "ds_config.json")
>>> for gap in out.gaps:                # what the DeepSpeed config could not carry
...     print(gap.setting, gap.value, gap.reason)

``memfit export plan.json --to deepspeed`` does the same from a saved plan (``memfit fit
--save``) or an analytic one (``memfit plan ... --json``). Targets: deepspeed (ds_config.json),
accelerate (accelerate_config.yaml), hf-trainer (TrainingArguments keyword arguments as JSON),
lightning (LightningCLI trainer YAML), torchtitan (command-line overrides), torchtune (recipe
YAML keys). A serve plan (``memfit serve-plan ... --json``) exports to vllm (the ``vllm serve``
command, or ``vllm.LLM`` keywords with ``form="python"``) and sglang
(``python -m sglang.launch_server``, or ``sglang.Engine`` keywords).

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

__all__ = ["SERVING_TARGETS", "TARGETS", "Export", "Gap", "PlanSettings", "export_plan",
           "read_plan"]

TARGETS = ("deepspeed", "accelerate", "lightning", "hf-trainer", "torchtitan", "torchtune")
SERVING_TARGETS = ("vllm", "sglang")
"""Targets that take a serve plan (``memfit serve-plan ... --json``), not a training plan."""
FORMS = ("command", "python")


def read_plan(path: str | Path) -> PlanSettings:
    """The settings of a plan file (JSON only: never eval'd or unpickled)."""
    data = read_json_file(path, what="plan file", fix="write one with memfit fit --save "
                          "plan.json or memfit plan ... --json > plan.json")
    return settings_from_dict(data, source=f"plan file {path}")


def _target(to: str) -> str:
    to = str(to).strip().lower().replace("_", "-")  # HF_Trainer, hf_trainer: hf-trainer
    valid = TARGETS + SERVING_TARGETS
    if to not in valid:
        raise MemfitError(f"unknown export target {to!r}{suggest(str(to), valid)}; valid: "
                          f"{', '.join(valid)}")
    return to


def _exporter(to: str) -> Any:
    from importlib import import_module

    return import_module(f"memfit.export.{_target(to).replace('-', '_')}")


def _export_serving(plan: Any, to: str, form: str) -> Export:
    from memfit.export._serve import is_serve_plan, serve_settings

    source = "plan"
    if isinstance(plan, str | Path):
        source = f"plan file {plan}"
        plan = read_json_file(plan, what="plan file", fix="write one with memfit serve-plan "
                              "MODEL ... --json > serve.json")
    elif hasattr(plan, "to_json") and not isinstance(plan, dict):
        plan = plan.to_json()
    if not is_serve_plan(plan):
        raise MemfitError(f"{source}: --to {to} exports a serve plan, and this is not one (a "
                          "training plan goes --to " + "/".join(TARGETS) + "); write one with "
                          "memfit serve-plan MODEL ... --json > serve.json")
    return _exporter(to).export(serve_settings(plan, source), form)


def export_plan(plan: Any, to: str, path: str | Path | None = None, *,
                form: str = "command") -> Export:
    """Export ``plan`` (a :class:`memfit.fitting.Plan`, :class:`PlanSettings`, a plan's JSON
    dict, or a plan file's path; for ``to`` vllm or sglang, a serve plan, its JSON or its
    file) for the tool ``to``; write it to ``path`` when given. ``form`` ``python`` gives a
    serving engine's Python keywords instead of its command line."""
    to = _target(to)
    if form not in FORMS:
        raise MemfitError(f"unknown export format {form!r}; valid: {', '.join(FORMS)}")
    if to in SERVING_TARGETS:
        out = _export_serving(plan, to, form)
        if path is not None:
            out.write(path)
        return out
    if form != "command":
        raise MemfitError(f"--format {form} is for --to vllm and --to sglang; --to {to} writes "
                          "its own config file")
    module = _exporter(to)
    if isinstance(plan, PlanSettings):
        settings = plan
    elif isinstance(plan, str | Path):
        data = read_json_file(plan, what="plan file", fix="write one with memfit fit --save "
                              "plan.json or memfit plan ... --json > plan.json")
        _not_serving(data, to, f"plan file {plan}")
        settings = settings_from_dict(data, source=f"plan file {plan}")
    elif isinstance(plan, dict):
        _not_serving(plan, to, "plan")
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


def _not_serving(data: Any, to: str, source: str) -> None:
    from memfit.export._serve import is_serve_plan

    if is_serve_plan(data):
        raise MemfitError(f"{source}: a serve plan (memfit serve-plan) exports --to vllm or "
                          f"--to sglang, not --to {to}; a training plan comes from memfit fit "
                          "--save or memfit plan --json")
