"""One point of the fit search space: which techniques, at which micro-batch."""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any, ClassVar

from memfit import vocab
from memfit.errors import MemfitError
from memfit.parallel.config import Parallel
from memfit.recipe import Recipe
from memfit.units import format_bytes

__all__ = ["CHECKPOINTING", "LAYOUT_SHARDING", "PRECISIONS", "SHARDING", "FitConfig",
           "layout_label", "sharding_of"]

PRECISIONS = vocab.names("precision", "fit")  # ("fp32", "bf16-mixed", "fp16-mixed", "bf16")
CHECKPOINTING = vocab.names("checkpointing", "fit")  # simplest first: none, selective, full, budget
SHARDING = ("none", "zero1", "zero2", "zero3")
LAYOUT_SHARDING = (*SHARDING, "hsdp")
"""What a multi-GPU layout (:class:`memfit.Parallel`) does to the data-parallel ranks: none
(DDP, or one rank), zero1 (``ZeroRedundancyOptimizer``), zero2 / zero3 (FSDP2 without / with
resharding after forward), hsdp (FSDP2 within a shard group, replicas across)."""


def sharding_of(parallel: Parallel) -> str:
    """The :data:`LAYOUT_SHARDING` name of ``parallel``'s data-parallel strategy."""
    if parallel.strategy == "fsdp":
        return "zero3" if parallel.reshard_after_forward else "zero2"
    return {"hsdp": "hsdp", "zero1": "zero1"}.get(parallel.strategy, "none")


def layout_label(parallel: Parallel) -> str:
    """Short, e.g. ``fsdp x8``, ``hsdp 4x2``, ``zero1 x8``, ``ddp x8``, ``tp 2, fsdp x4``,
    ``pp 2, ddp x4`` (data-parallel ranks after an x)."""
    tp_notes = "".join(f" + {n}" for n, on in (("sp", parallel.sp),
                                               ("loss parallel", parallel.loss_parallel)) if on)
    parts = [f"tp {parallel.tp}{tp_notes}"] if parallel.tp > 1 else []
    parts += [f"ep {parallel.ep}"] if parallel.ep > 1 else []
    parts += [f"pp {parallel.pp}"] if parallel.pp > 1 else []
    names = {"zero3": "fsdp", "zero2": "zero2", "zero1": "zero1", "none": "ddp"}
    shard = sharding_of(parallel)
    if shard == "hsdp":
        parts.append(f"hsdp {parallel.fsdp}x{parallel.replicate}")
    elif parallel.dp > 1:
        parts.append(f"{names[shard]} x{parallel.dp}")
    return ", ".join(parts) or "1 GPU"


def _parallel_from(data: dict[str, Any], sharding: str, gpus: int | None) -> Parallel:
    """A plan file's ``"parallel"`` object (the exporters' vocabulary: tp, pp, ep,
    gpus_per_node, replicate) and ``sharding`` back into a :class:`Parallel` of ``gpus``."""
    if not isinstance(data, dict):
        raise MemfitError("plan config: parallel must be a JSON object")
    unknown = sorted(set(data) - {"tp", "pp", "ep", "gpus_per_node", "replicate"})
    if unknown:
        raise MemfitError(f"plan config: unknown parallel field(s) {', '.join(unknown)}; valid: "
                          "tp, pp, ep, gpus_per_node, replicate")
    if gpus is None:
        raise MemfitError("plan config: a parallel layout needs the plan's GPU count")
    tp, pp, ep = (int(data.get(k, 1)) for k in ("tp", "pp", "ep"))
    dp = gpus // (tp * pp) if tp * pp and gpus % (tp * pp) == 0 else 0
    replicate = int(data.get("replicate", 1))
    kwargs: dict[str, Any] = {"zero": {"zero1": 1, "zero2": 2, "zero3": 3}.get(sharding)}
    if sharding == "hsdp":
        if not dp or replicate < 2 or dp % replicate:
            raise MemfitError(f"plan config: hsdp needs replicate > 1 dividing the {dp} "
                              "data-parallel ranks")
        kwargs = {"fsdp": dp // replicate}
    return Parallel(gpus=gpus, gpus_per_node=data.get("gpus_per_node"), tp=tp, pp=pp, ep=ep,
                    **kwargs)


# Recipe fields a fit plan file holds only when set: plans written before the recipe had no
# such keys, and the exporters report any key they do not read.
_NEW_FIELDS = ("offload_params", "offload_gradients", "offload_to", "weight_quant", "lora_rank",
               "lora_targets", "qlora", "kv_cache_dtype", "engine")


@dataclass(frozen=True, kw_only=True)
class FitConfig(Recipe):
    """A training configuration the search considers: a :class:`memfit.Recipe` (the search
    varies its precision, checkpointing, micro-batch, optimizer, offload, chunked loss,
    attention and layout) plus its ZeRO ``sharding``; ``global_batch = micro_batch *
    accumulation`` (per GPU: ``global_batch / num_gpus``)."""

    where: ClassVar[str] = "plan config"

    sharding: str = "none"
    """With several GPUs: ZeRO stage (zero1: optimizer states, zero2: + gradients, zero3/FSDP: +
    parameters sharded across GPUs; hsdp: zero3 within a shard group, replicas across). With a
    ``parallel`` layout it is the layout's strategy; without one (a legacy ``num_gpus`` plan)
    ZeRO over every GPU."""

    def __post_init__(self) -> None:
        super().__post_init__()  # the recipe's checks; then what the search takes of it
        for name, valid in (("precision", PRECISIONS), ("checkpointing", CHECKPOINTING),
                            ("sharding", LAYOUT_SHARDING), ("attention", ("model", "sdpa"))):
            if getattr(self, name) not in valid:
                raise MemfitError(f"plan config: {name}={getattr(self, name)!r} is not one of "
                                  f"{', '.join(valid)}")
        if self.parallel is not None:
            if sharding_of(self.parallel) != self.sharding:
                raise MemfitError(f"plan config: sharding={self.sharding!r} but the layout "
                                  f"{self.parallel.describe()} is {sharding_of(self.parallel)!r}")
        elif self.sharding == "hsdp":
            raise MemfitError("plan config: sharding='hsdp' needs a parallel layout")

    @property
    def techniques(self) -> tuple[Any, ...]:
        """Everything but the micro-batch: the key memory traces are cached under (with it)."""
        return (self.precision, self.checkpointing, self.checkpoint_budget_bytes, self.optimizer,
                self.offload_states, self.offload_activations, self.chunked_loss, self.attention,
                self.sharding, self.parallel)

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
        if self.parallel is not None and self.parallel.gpus > 1:
            parts.append(layout_label(self.parallel))
        elif self.sharding != "none":
            parts.append(self.sharding)
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for name in _NEW_FIELDS:
            if data[name] == _DEFAULTS[name]:
                del data[name]
        if "lora_targets" in data:
            data["lora_targets"] = list(self.lora_targets)
        if self.checkpoint_modes is not None:
            data["checkpoint_modes"] = list(self.checkpoint_modes)
        data.pop("parallel")
        if self.parallel is not None:
            data["parallel"] = self.parallel.to_dict()  # the one layout shape (memfit.Parallel)
        return data

    @classmethod
    def from_dict(cls, data: Any, *, gpus: int | None = None) -> FitConfig:
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
        if isinstance(data.get("lora_targets"), list):
            data["lora_targets"] = tuple(data["lora_targets"])
        par = data.get("parallel")
        if isinstance(par, dict) and "gpus" in par:
            data["parallel"] = Parallel.from_dict(par, where="plan config: parallel")
        elif par is not None:
            # Plans written before the layout had one JSON shape: tp, pp, ep, gpus_per_node and
            # replicate, the GPU count from the plan and the strategy from ``sharding``.
            data["parallel"] = _parallel_from(par, data.get("sharding", "none"), gpus)
        return cls(**data)


_DEFAULTS = {f.name: f.default for f in fields(FitConfig) if f.default is not MISSING}
