"""memfit's one vocabulary: the precisions, optimizers and checkpointing policies, and which
part of memfit takes each. Torch-free, so the analytic CLI can read it.

Each layer's tuple (``estimate.config.PRECISIONS``, ``fit.config.PRECISIONS``,
``trace.options.PRECISIONS``, ``techniques.precision.PRECISIONS``, the optimizer and
checkpointing lists) is derived from here with :func:`names`, in this module's order, and
:func:`check` gives one error for a name a layer does not take: the closest name when it is
unknown, and where it works when it is known but not there (fp8 is planned and applied, not
searched by ``fit`` nor traced).

What a precision means (its formats, bytes per parameter, loss scaling, hardware) is one
:class:`Precision` record per name in :data:`PRECISIONS`, read with :func:`precision`; every
part of memfit reads it rather than keeping its own table (``torch.dtype``s come from
:func:`memfit.dtypes.torch_dtype`).

Layers: ``plan`` (the analytic planner, ``memfit plan``), ``trace`` (``memfit.estimate``),
``fit`` (the search), ``apply`` (``memfit.techniques``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from memfit.errors import MemfitError, suggest

__all__ = ["CHECKPOINTING", "LAYERS", "OPTIMIZERS", "PRECISIONS", "Precision", "check", "names",
           "precision"]

LAYERS = ("plan", "trace", "fit", "apply")
_ALL = frozenset(LAYERS)

@dataclass(frozen=True, kw_only=True)
class Precision:
    """What one precision name means for memory: the number formats of the parameters, of the
    compute and of autocast, the bytes per parameter they cost, and what the run needs.

    Number formats are the names of :data:`memfit.dtypes.BYTES_PER_ELEMENT` (``"fp32"``,
    ``"bf16"``, ...); :func:`memfit.dtypes.torch_dtype` turns one into a ``torch.dtype``.

    >>> precision("bf16-mixed").autocast, precision("bf16-mixed").weight_bytes
    ('bf16', 4)
    """

    name: str
    """The name users pass (``--precision``, ``precision=``)."""
    autocast: str | None
    """The format ``torch.autocast`` runs the forward and the loss in; None: no autocast."""
    params: str
    """The format PyTorch holds the parameters in while training: fp32 under autocast (it
    casts copies for each op), the low format itself for pure ``bf16``/``fp16``."""
    compute: str
    """The format of the activations and of the working (16-bit) copies of the weights: the
    analytic planner's ``compute_format``."""
    matmul: str
    """The format of the matmul inputs: which of a GPU's peak rates a step runs at (fp8's
    matmuls are fp8 under a bf16 autocast)."""
    compute_bytes: int
    """Bytes per element of the ``compute`` format (activations, logits, working copies)."""
    weight_bytes: int
    """Bytes per parameter of the weights as PyTorch holds them (the ``params`` format)."""
    grad_bytes: int
    """Bytes per parameter of the gradients (PyTorch's match their parameters)."""
    master_bytes: int
    """Bytes per trainable parameter of the fp32 master copy that the optimizer updates while
    the compute runs in a lower format; 0: none (fp32 trains its parameters directly; pure
    bf16/fp16 has none unless ``MasterWeights`` adds it). Under autocast the master is the fp32
    parameter itself (in ``weight_bytes``, not counted twice); an engine holding 16-bit
    working weights (the ZeRO paper, DeepSpeed) keeps it as an optimizer state."""
    grad_scaler: bool
    """Whether training scales the loss (``torch.amp.GradScaler``): fp16's 5-bit exponent
    underflows small gradients otherwise. Adds two scalars, no per-parameter bytes."""
    needs: str | None
    """The GPU feature it needs (``"bf16"``: compute capability 8.0; ``"fp8"``: 8.9), as
    :meth:`memfit.gpus.GpuSpec.supports` names it; None: every GPU runs it."""
    layers: frozenset[str]
    """The parts of memfit that take it (:data:`LAYERS`)."""

    @property
    def mixed(self) -> bool:
        """Mixed precision: lower-format compute over fp32 master weights."""
        return self.master_bytes > 0


def _precisions(*records: Precision) -> dict[str, Precision]:
    return {p.name: p for p in records}


PRECISIONS: dict[str, Precision] = _precisions(
    Precision(name="fp32", autocast=None, params="fp32", compute="fp32", matmul="fp32",
              compute_bytes=4, weight_bytes=4, grad_bytes=4, master_bytes=0,
              grad_scaler=False, needs=None, layers=_ALL),
    # torch.autocast(bf16), fp32 parameters
    Precision(name="bf16-mixed", autocast="bf16", params="fp32", compute="bf16", matmul="bf16",
              compute_bytes=2, weight_bytes=4, grad_bytes=4, master_bytes=4,
              grad_scaler=False, needs="bf16", layers=_ALL),
    # torch.autocast(fp16), fp32 parameters, loss scaling
    Precision(name="fp16-mixed", autocast="fp16", params="fp32", compute="fp16", matmul="fp16",
              compute_bytes=2, weight_bytes=4, grad_bytes=4, master_bytes=4,
              grad_scaler=True, needs=None, layers=_ALL),
    # parameters and compute in bf16
    Precision(name="bf16", autocast=None, params="bf16", compute="bf16", matmul="bf16",
              compute_bytes=2, weight_bytes=2, grad_bytes=2, master_bytes=0,
              grad_scaler=False, needs="bf16", layers=_ALL),
    # pure fp16 (inference; training diverges unscaled)
    Precision(name="fp16", autocast=None, params="fp16", compute="fp16", matmul="fp16",
              compute_bytes=2, weight_bytes=2, grad_bytes=2, master_bytes=0,
              grad_scaler=False, needs=None, layers=frozenset({"plan", "trace"})),
    # torchao float8 training: fp8 matmuls under bf16 autocast, fp32 parameters
    Precision(name="fp8", autocast="bf16", params="fp32", compute="bf16", matmul="fp8",
              compute_bytes=2, weight_bytes=4, grad_bytes=4, master_bytes=4,
              grad_scaler=False, needs="fp8", layers=frozenset({"plan", "apply"})),
)
"""Precision name -> its :class:`Precision`, in memfit's order (fit searches in this order)."""


def precision(name: str) -> Precision:
    """The :class:`Precision` named ``name``; MemfitError naming the valid ones and the closest
    for an unknown name. ``precision("fp16-mixed").grad_scaler is True``."""
    try:
        return PRECISIONS[name]
    except KeyError:
        raise MemfitError(f"unknown precision {name!r}{suggest(str(name), PRECISIONS)}; valid: "
                          f"{', '.join(PRECISIONS)}") from None


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
    # torchtitan's op-level SAC: the same, but every second mm of a block is recomputed
    "torchtitan": _ALL,
    # Korthikanti et al. 2022's selective recompute (attention scores only): a planner formula
    "selective-attn": frozenset({"plan"}),
    "full": _ALL,
    "budget": frozenset({"fit", "apply"}),  # a byte budget resolved per block
}
"""Checkpointing policy -> the layers that take it, simplest first (fit's tie order)."""

_KINDS: dict[str, dict[str, frozenset[str]]] = {
    "precision": {name: p.layers for name, p in PRECISIONS.items()},
    "optimizer": OPTIMIZERS,
    "checkpointing": CHECKPOINTING,
}


@functools.cache
def names(kind: str, layer: str | None) -> tuple[str, ...]:
    """The names of ``kind`` (precision, optimizer, checkpointing) that ``layer`` takes, in
    order: ``names("precision", "fit") == ("fp32", "bf16-mixed", "fp16-mixed", "bf16")``;
    ``layer=None``: every name of ``kind`` (what a :class:`memfit.Recipe` may hold). Cached:
    the tables are constants, and every run config checks its names through here."""
    return tuple(n for n, layers in _KINDS[kind].items() if layer is None or layer in layers)


def check(kind: str, name: str, layer: str | None, *, what: str | None = None) -> None:
    """Raise MemfitError unless ``layer`` takes ``name`` (``None``: unless some layer does):
    an unknown name gets the closest ones; a known one names the layers that take it."""
    table = _KINDS[kind]
    valid = names(kind, layer)
    if name in valid:
        return
    label = what or kind
    if name in table and layer is not None:
        where = ", ".join(sorted(table[name], key=LAYERS.index))
        raise MemfitError(f"{label} {name!r} is not available here ({layer}); it works in: "
                          f"{where}. Valid here: {', '.join(valid)}")
    raise MemfitError(f"unknown {label} {name!r}{suggest(name, valid)}; valid: "
                      f"{', '.join(valid)}")
