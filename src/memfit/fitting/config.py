"""One point of the fit search space: which techniques, at which micro-batch."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from memfit import vocab
from memfit.errors import MemfitError
from memfit.units import format_bytes

__all__ = ["CHECKPOINTING", "PRECISIONS", "SHARDING", "FitConfig"]

PRECISIONS = vocab.names("precision", "fit")  # ("fp32", "bf16-mixed", "fp16-mixed", "bf16")
CHECKPOINTING = vocab.names("checkpointing", "fit")  # simplest first: none, selective, full, budget
SHARDING = ("none", "zero1", "zero2", "zero3")


@dataclass(frozen=True, kw_only=True)
class FitConfig:
    """A training configuration the search considers; ``global_batch = micro_batch * accumulation``
    (per GPU: ``global_batch / num_gpus``)."""

    precision: str = "fp32"
    """fp32, bf16-mixed, fp16-mixed (autocast; fp32 weights) or bf16 (weights, grads and states in
    bf16: half the model-state memory, less precise updates)."""
    checkpointing: str = "none"
    """none, selective (recompute cheap ops), full (recompute each block) or budget (the fewest
    blocks that keep activations under ``checkpoint_budget_bytes``)."""
    checkpoint_budget_bytes: int | None = None
    """The activation budget of ``checkpointing="budget"``."""
    checkpoint_modes: tuple[str | None, ...] | None = None
    """Per block, what the search resolved ``budget`` to (``full``/``selective``/None), so that
    applying the plan needs no profiling."""
    micro_batch: int = 1
    """Samples per forward/backward; smaller holds fewer activations, runs less efficiently."""
    accumulation: int = 1
    """Micro-batches per optimizer step."""
    optimizer: str = "adamw"
    """The optimizer the user asked for, or its 8-bit variant (2 bytes/param of state, not 8)."""
    offload_states: bool = False
    """Optimizer states and step on the host: no state memory on the device, two parameter
    transfers per step."""
    offload_activations: bool = False
    """Saved activations to host memory during the forward, back for the backward."""
    chunked_loss: bool = False
    """Cross-entropy computed over sequence chunks (the full logits are never materialized)."""
    attention: str = "model"
    """``model``: the model's own attention; ``sdpa``: switched to scaled_dot_product_attention."""
    sharding: str = "none"
    """With several GPUs: ZeRO stage (zero1: optimizer states, zero2: + gradients, zero3/FSDP: +
    parameters sharded across GPUs)."""

    def __post_init__(self) -> None:
        for name, valid in (("precision", PRECISIONS), ("checkpointing", CHECKPOINTING),
                            ("sharding", SHARDING), ("attention", ("model", "sdpa"))):
            if getattr(self, name) not in valid:
                raise MemfitError(f"plan config: {name}={getattr(self, name)!r} is not one of "
                                  f"{', '.join(valid)}")
        for name in ("micro_batch", "accumulation"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MemfitError(f"plan config: {name} must be a positive integer, got {value!r}")
        if self.checkpointing == "budget" and not (isinstance(self.checkpoint_budget_bytes, int)
                                                    and self.checkpoint_budget_bytes > 0):
            raise MemfitError("plan config: checkpointing='budget' needs a positive "
                              "checkpoint_budget_bytes")
        if not isinstance(self.optimizer, str) or not self.optimizer:
            raise MemfitError(f"plan config: optimizer must be a name, got {self.optimizer!r}")
        for name in ("offload_states", "offload_activations", "chunked_loss"):
            if not isinstance(getattr(self, name), bool):
                raise MemfitError(f"plan config: {name} must be true or false")

    @property
    def techniques(self) -> tuple[Any, ...]:
        """Everything but the micro-batch: the key memory traces are cached under (with it)."""
        return (self.precision, self.checkpointing, self.checkpoint_budget_bytes, self.optimizer,
                self.offload_states, self.offload_activations, self.chunked_loss, self.attention,
                self.sharding)

    def label(self) -> str:
        """Short human description, e.g. ``bf16-mixed, ckpt=full, mb=8x4, adamw-8bit``."""
        parts = [self.precision]
        if self.checkpointing != "none":
            ckpt = self.checkpointing
            if ckpt == "budget" and self.checkpoint_budget_bytes:
                # What the budget resolved to, e.g. "budget(3.41 GiB: 10 selective + 2 none)".
                modes = self.checkpoint_modes or ()
                mix = " + ".join(f"{modes.count(m)} {m or 'none'}"
                                 for m in ("full", "selective", None) if m in modes)
                ckpt += f"({format_bytes(self.checkpoint_budget_bytes)}"
                ckpt += f": {mix})" if mix else ")"
            parts.append(f"ckpt={ckpt}")
        parts.append(f"mb={self.micro_batch}x{self.accumulation}")
        parts.append(self.optimizer + ("+offload" if self.offload_states else ""))
        if self.offload_activations:
            parts.append("act-offload")
        if self.chunked_loss:
            parts.append("chunked-loss")
        if self.attention != "model":
            parts.append(self.attention)
        if self.sharding != "none":
            parts.append(self.sharding)
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if self.checkpoint_modes is not None:
            data["checkpoint_modes"] = list(self.checkpoint_modes)
        return data

    @classmethod
    def from_dict(cls, data: Any) -> FitConfig:
        if not isinstance(data, dict):
            raise MemfitError(f"plan config must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise MemfitError(f"plan config: unknown field(s) {', '.join(unknown)}; valid: "
                              f"{', '.join(sorted(known))}")
        data = dict(data)
        modes = data.get("checkpoint_modes")
        if modes is not None:
            if not isinstance(modes, list) or any(m not in ("full", "selective", None)
                                                  for m in modes):
                raise MemfitError("plan config: checkpoint_modes must be a list of 'full', "
                                  "'selective' or null")
            data["checkpoint_modes"] = tuple(modes)
        return cls(**data)
