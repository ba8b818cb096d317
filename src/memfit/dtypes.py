"""Bytes per element of the number formats memfit plans with: one table, not if/elif."""

from __future__ import annotations

from fractions import Fraction

from memfit.errors import MemfitError, suggest

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
    total = count * per
    return int(-(-total.numerator // total.denominator))
