"""memfit's one vocabulary: the precisions, optimizers and checkpointing policies, and which
part of memfit takes each. Torch-free, so the analytic CLI can read it.

Each layer's tuple (``estimate.config.PRECISIONS``, ``fit.config.PRECISIONS``,
``trace.engine.PRECISIONS``, ``techniques.precision.PRECISIONS``, the optimizer and
checkpointing lists) is derived from here with :func:`names`, in this module's order, and
:func:`check` gives one error for a name a layer does not take: the closest name when it is
unknown, and where it works when it is known but not there (fp8 is planned and applied, not
searched by ``fit`` nor traced).

Layers: ``plan`` (the analytic planner, ``memfit plan``), ``trace`` (``memfit.estimate``),
``fit`` (the search), ``apply`` (``memfit.techniques``).
"""

from __future__ import annotations

from memfit.errors import MemfitError, suggest

__all__ = ["CHECKPOINTING", "LAYERS", "OPTIMIZERS", "PRECISIONS", "check", "names"]

LAYERS = ("plan", "trace", "fit", "apply")
_ALL = frozenset(LAYERS)

PRECISIONS: dict[str, frozenset[str]] = {
    "fp32": _ALL,
    "bf16-mixed": _ALL,  # torch.autocast(bf16), fp32 parameters
    "fp16-mixed": _ALL,  # torch.autocast(fp16), fp32 parameters, loss scaling
    "bf16": _ALL,  # parameters and compute in bf16
    "fp16": frozenset({"plan", "trace"}),  # pure fp16 (inference; training diverges unscaled)
    "fp8": frozenset({"plan", "apply"}),  # torchao float8 training; needs an fp8 GPU
}
"""Precision name -> the layers that take it, in memfit's order (fit searches in this order)."""

OPTIMIZERS: dict[str, frozenset[str]] = {
    "adamw": _ALL,
    "adam": _ALL,
    "sgd": _ALL,
    "sgd-momentum": frozenset({"plan", "trace"}),
    "adafactor": _ALL,
    "adamw-8bit": _ALL,
    "adam-8bit": frozenset({"apply"}),
    "lion": frozenset({"plan", "trace"}),
}
"""Optimizer name -> the layers that take it (``fit`` applies its plan, so it takes what both
the trace and ``memfit.techniques`` take)."""

CHECKPOINTING: dict[str, frozenset[str]] = {
    "none": _ALL,
    "selective": _ALL,  # op-level SAC: keep matmul/attention outputs (memfit.techniques)
    # Korthikanti et al. 2022's selective recompute (attention scores only): a planner formula
    "selective-attn": frozenset({"plan"}),
    "full": _ALL,
    "budget": frozenset({"fit", "apply"}),  # a byte budget resolved per block
}
"""Checkpointing policy -> the layers that take it, simplest first (fit's tie order)."""

_KINDS = {"precision": PRECISIONS, "optimizer": OPTIMIZERS, "checkpointing": CHECKPOINTING}


def names(kind: str, layer: str) -> tuple[str, ...]:
    """The names of ``kind`` (precision, optimizer, checkpointing) that ``layer`` takes, in
    order: ``names("precision", "fit") == ("fp32", "bf16-mixed", "fp16-mixed", "bf16")``."""
    return tuple(n for n, layers in _KINDS[kind].items() if layer in layers)


def check(kind: str, name: str, layer: str, *, what: str | None = None) -> None:
    """Raise MemfitError unless ``layer`` takes ``name``: an unknown name gets the closest
    ones; a known one names the layers that take it."""
    table = _KINDS[kind]
    valid = names(kind, layer)
    if name in valid:
        return
    label = what or kind
    if name in table:
        where = ", ".join(sorted(table[name], key=LAYERS.index))
        raise MemfitError(f"{label} {name!r} is not available here ({layer}); it works in: "
                          f"{where}. Valid here: {', '.join(valid)}")
    raise MemfitError(f"unknown {label} {name!r}{suggest(name, valid)}; valid: "
                      f"{', '.join(valid)}")
