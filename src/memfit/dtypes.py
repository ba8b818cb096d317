"""Bytes per element of the number formats memfit plans with: one table, not if/elif."""

from __future__ import annotations

from fractions import Fraction
from typing import TYPE_CHECKING

from memfit.errors import MemfitError, suggest

if TYPE_CHECKING:
    import torch

# Fractions keep 4-bit formats exact: count * BYTES[fmt] is integral for even counts.
BYTES_PER_ELEMENT: dict[str, Fraction] = {
    "fp32": Fraction(4),
    "tf32": Fraction(4),
    "fp16": Fraction(2),
    "bf16": Fraction(2),
    "fp8": Fraction(1),
    "int8": Fraction(1),
    "int4": Fraction(1, 2),
    "nf4": Fraction(1, 2),
}


def nbytes(count: int, fmt: str) -> int:
    """Bytes of ``count`` elements stored as ``fmt`` (rounded up to whole bytes)."""
    try:
        per = BYTES_PER_ELEMENT[fmt]
    except KeyError:
        raise MemfitError(
            f"unknown number format {fmt!r}{suggest(fmt, BYTES_PER_ELEMENT)}; "
            f"valid: {', '.join(BYTES_PER_ELEMENT)}") from None
    if per.denominator == 1 and isinstance(count, int):  # whole bytes: no Fraction arithmetic
        return count * per.numerator
    total = count * per
    return int(-(-total.numerator // total.denominator))


# torch's names of the formats that have a torch dtype memfit uses (the name, not the dtype:
# this module stays torch-free for the analytic CLI; torch_dtype imports torch when called).
_TORCH_NAMES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def torch_dtype(fmt: str) -> torch.dtype:
    """The ``torch.dtype`` of number format ``fmt``: ``torch_dtype("bf16") is torch.bfloat16``.

    For callers that already run torch (the trace, the techniques, validation)."""
    import torch

    try:
        return getattr(torch, _TORCH_NAMES[fmt])
    except KeyError:
        raise MemfitError(
            f"number format {fmt!r} has no torch dtype here{suggest(fmt, _TORCH_NAMES)}; "
            f"valid: {', '.join(_TORCH_NAMES)}") from None
