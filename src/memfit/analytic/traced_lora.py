"""LoRA on a model type the formulas do not cover (``memfit plan <config.json> --mode lora``):
which linear layers get adapters, resolved on the model built on meta before it is traced
(:func:`lora_for`), so the plan can say which and how many parameters train."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from memfit.analytic.config import RunConfig
from memfit.models.hf_auto import HFModelSpec
from memfit.models.spec import TransformerSpec

__all__ = ["LoraLayers", "lora_for"]


@dataclass(frozen=True, kw_only=True)
class LoraLayers:
    """The linear layers a LoRA run adapts, and where their names came from.

    Known limitations: adapters go on ``nn.Linear`` only
    (:func:`memfit.techniques.recipe.lora_layers`)."""

    targets: tuple[str, ...]
    """The run's ``lora_targets`` (``("all-linear",)``, memfit's short names or the model's)."""
    source: str
    """Where they came from: ``--lora-targets``, peft's default for the model type, or every
    linear layer but the head where peft has none."""
    rank: int
    layers: tuple[tuple[str, int, int], ...]
    """``(dotted name, in_features, out_features)`` of each adapted layer, in module order."""

    @property
    def names(self) -> tuple[str, ...]:
        """The adapted layers' own names (their last component), first appearance first."""
        return tuple(dict.fromkeys(name.rsplit(".", 1)[-1] for name, _, _ in self.layers))

    @property
    def trainable_params(self) -> int:
        """``r * (in + out)`` per adapted layer (A is ``r x in``, B is ``out x r``; Hu et al.
        2021): the parameters that train, with their gradients and optimizer states."""
        return sum(self.rank * (fan_in + fan_out) for _, fan_in, fan_out in self.layers)

    def to_dict(self) -> dict[str, object]:
        return {"targets": list(self.names), "requested": list(self.targets),
                "source": self.source, "rank": self.rank, "layers": len(self.layers),
                "trainable_params": self.trainable_params}

    def describe(self) -> str:
        """One line for the plan's header."""
        return (f"LoRA rank {self.rank} on {len(self.layers)} linear layers "
                f"({', '.join(self.names)}: {self.source}); {self.trainable_params:,} trainable "
                "parameters")


def lora_for(spec: TransformerSpec | HFModelSpec, run: RunConfig, *,
             targets_given: bool) -> tuple[RunConfig, LoraLayers]:
    """``run`` with the LoRA targets of ``spec`` (``targets_given``: ``run.lora_targets`` as
    the user named them; otherwise, for a model type the formulas do not cover, peft's default
    ``target_modules`` for it, else every linear layer but the head:
    :func:`memfit.techniques.peft.default_targets`), and the layers they adapt in the model
    built on meta. A name that matches no linear layer is refused in one line, before the
    trace."""
    from memfit.models.build import build_model
    from memfit.techniques.peft import default_targets
    from memfit.techniques.recipe import lora_layers

    source = ("--lora-targets all: every linear layer but the head"
              if run.lora_targets == ("all-linear",) else "--lora-targets")
    if not targets_given and isinstance(spec, HFModelSpec):
        targets, source = default_targets(spec.model_type)
        run = dataclasses.replace(run, lora_targets=targets)
    elif not targets_given:
        source = "memfit's default"
    if isinstance(spec, HFModelSpec):
        model = spec.build(device="meta")
    else:
        model = build_model(spec, device="meta")
    names = lora_layers(model, run.lora_targets, mode=run.mode)
    shapes = {name: mod for name, mod in model.named_modules()}
    layers = tuple((name, shapes[name].in_features, shapes[name].out_features) for name in names)
    return run, LoraLayers(targets=run.lora_targets, source=source, rank=run.lora_rank,
                           layers=layers)
