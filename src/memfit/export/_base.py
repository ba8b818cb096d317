"""What an export returns: the file's text, and every setting the tool could not express."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memfit.export.settings import PlanSettings

__all__ = ["Export", "Gap"]


@dataclass(frozen=True, kw_only=True)
class Gap:
    """A setting the plan chose that the target's file cannot carry, and what to do instead."""

    setting: str
    value: Any
    reason: str

    def line(self, target: str) -> str:
        return f"not in the {target} export: {self.setting}={self.value}: {self.reason}"


@dataclass(frozen=True, kw_only=True)
class Export:
    """One plan written for one tool (:func:`memfit.export.export_plan`).

    ``text`` is the file; ``gaps`` the settings it could not carry (printed on stderr by
    ``memfit export``, and in its ``--json`` report); ``notes`` how a setting was mapped where
    the tool's meaning differs from memfit's.
    """

    target: str
    text: str
    filename: str
    """The name the tool's docs use for this file (a suggestion for ``--output``)."""
    gaps: tuple[Gap, ...] = ()
    notes: tuple[str, ...] = ()
    data: Any = None
    """The exported structure before it was written as text (dict for JSON/YAML targets)."""

    def write(self, path: str | Path) -> Path:
        from memfit._files import write_atomic

        path = Path(path)
        write_atomic(path, self.text)
        return path

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target, "filename": self.filename,
                "gaps": [{"setting": g.setting, "value": g.value, "reason": g.reason}
                         for g in self.gaps],
                "notes": list(self.notes)}

    def __str__(self) -> str:
        return self.text


@dataclass
class Builder:
    """Collects the gaps and notes while an exporter maps the settings."""

    settings: PlanSettings
    target: str
    gaps: list[Gap] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def gap(self, setting: str, value: Any, reason: str) -> None:
        self.gaps.append(Gap(setting=setting, value=value, reason=reason))

    def note(self, text: str) -> None:
        self.notes.append(text)

    def done(self, text: str, filename: str, data: Any) -> Export:
        return Export(target=self.target, text=text, filename=filename, gaps=tuple(self.gaps),
                      notes=tuple(self.notes), data=data)

    # -- gaps every target shares ---------------------------------------------------------

    def model_code(self) -> None:
        """Settings that live in the model or training code, never in a launcher's config."""
        s = self.settings
        if s.mode in ("lora", "qlora"):
            self.gap("mode", s.mode, f"LoRA adapters (rank {s.recipe.lora_rank}) are added in "
                     "code: peft.get_peft_model(model, LoraConfig(r=...))")
        if s.recipe.weight_quant != "none":
            self.gap("weight_quant", s.recipe.weight_quant, "weights are quantized when the "
                     "model is loaded (e.g. BitsAndBytesConfig), not by this config")
        if s.recipe.chunked_loss:
            self.gap("chunked_loss", True, "the chunked cross-entropy is in the loss code: "
                     "memfit.techniques.apply_chunked_loss")
        # fit: "model" keeps the model's attention; plan: the kernel the formulas assumed.
        attention = s.recipe.attention
        if attention not in ("model", "sdpa") or (s.source == "fit" and attention != "model"):
            self.gap("attention", attention, "the attention kernel is chosen in model code "
                     "(Hugging Face: from_pretrained(attn_implementation=...))")
        for key, value in sorted(s.unknown.items()):
            self.gap(key, value, "this memfit version's exporter does not know this plan "
                     "field; apply it by hand")

    def budget_checkpointing(self) -> bool:
        """Report ``checkpointing=budget`` (a per-block mix no tool's config names); True if
        it was reported."""
        s = self.settings
        if s.recipe.checkpointing != "budget":
            return False
        modes = s.recipe.checkpoint_modes or ()
        mix = ", ".join(f"{modes.count(m)} {m or 'none'}" for m in ("full", "selective", None)
                        if m in modes) or "per block"
        self.gap("checkpointing", "budget", f"a per-block mix ({mix}); apply it with "
                 "memfit.techniques (Plan.apply) or checkpoint those blocks in code")
        return True


def dump_json(data: Any) -> str:
    return json.dumps(data, indent=2) + "\n"


def sharding_engine(s: PlanSettings, b: Builder) -> str:
    """Which engine a launcher that offers both (Accelerate, the HF Trainer, Lightning) runs
    the plan's data parallelism on: ``none`` (one rank), ``ddp``, ``fsdp`` (PyTorch FSDP2) or
    ``deepspeed``.

    The plan's own engine wins. Otherwise ZeRO-1/2, and optimizer offload without parameter
    offload, go to DeepSpeed: FSDP has no stage that shards only states/gradients, and its
    CPUOffloadPolicy moves parameters, gradients and states together. ZeRO-3 goes to FSDP2.
    """
    if s.engine == "deepspeed":
        return "deepspeed"
    if s.engine in ("fsdp", "fsdp2", "hsdp"):
        if s.zero in (1, 2) or (s.recipe.offload_states and not s.recipe.offload_params):
            b.note(f"the plan names engine {s.engine!r} with ZeRO-{s.zero}"
                   f"{' and optimizer offload' if s.recipe.offload_states else ''}: FSDP cannot "
                   "do that; exported for DeepSpeed")
            return "deepspeed"
        return "fsdp" if s.zero == 3 else ("ddp" if s.parallel.dp > 1 else "none")
    if s.engine not in (None, "ddp"):
        b.note(f"the plan names engine {s.engine!r}, which this tool does not run; exported "
               "with the closest engine (memory layouts differ)")
    if s.zero in (1, 2) or (s.recipe.offload_states and not s.recipe.offload_params):
        if s.zero:
            b.note(f"ZeRO-{s.zero}: exported for DeepSpeed (FSDP has no stage {s.zero})")
        return "deepspeed"
    if s.zero == 3:
        b.note("ZeRO-3: exported as PyTorch FSDP (full sharding); name --engine deepspeed "
               "in the plan for DeepSpeed ZeRO-3")
        return "fsdp"
    return "ddp" if s.parallel.dp > 1 else "none"
