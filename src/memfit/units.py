"""Formatting and parsing of byte sizes, durations and counts; units appear only at the edges."""

from __future__ import annotations

import math
import re

from memfit.errors import MemfitError

GB = 10**9
GiB = 2**30
MiB = 2**20

_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def plural(count: int, noun: str) -> str:
    """``count`` and ``noun``, with an ``s`` unless ``count`` is 1: ``1 GPU``, ``4 GPUs``."""
    return f"{count} {noun}" + ("" if count == 1 else "s")


def format_bytes(n: int | None, *, binary: bool = True) -> str:
    """``1.50 GiB`` (binary) or ``1.61 GB`` (decimal); ``unknown`` for None."""
    if n is None:
        return "unknown"
    base, units = (1024, ["B", "KiB", "MiB", "GiB", "TiB"]) if binary else (
        1000, ["B", "kB", "MB", "GB", "TB"])
    sign = "-" if n < 0 else ""
    value = float(abs(n))
    for unit in units:
        if value < base or unit == units[-1]:
            return f"{sign}{value:.0f} {unit}" if unit == "B" else f"{sign}{value:.2f} {unit}"
        value /= base
    raise AssertionError("unreachable")


def format_seconds(s: float | None) -> str:
    """One way to print a duration: ``850 µs``, ``12.5 ms``, ``4.20 s``, ``41 min 31 s``,
    ``2 h 05 min``; ``unknown`` for None."""
    if s is None:
        return "unknown"
    if not math.isfinite(s):
        return f"{s} s"
    sign, s = ("-" if s < 0 else ""), abs(s)
    if s == 0:
        return "0 s"
    # Each unit while its rounded value stays below the next unit (999.96 ms is "1.00 s").
    if round(s * 1e6) < 1000:
        return f"{sign}{s * 1e6:.0f} µs"
    if round(s * 1e3, 1) < 1000:
        return f"{sign}{s * 1e3:.1f} ms"
    if round(s, 2) < 60:
        return f"{sign}{s:.2f} s"
    whole = round(s)
    if whole < 3600:
        return f"{sign}{whole // 60} min {whole % 60:02d} s"
    minutes = round(s / 60)
    return f"{sign}{minutes // 60} h {minutes % 60:02d} min"


def parse_bytes(text: str, *, what: str = "size") -> int:
    """Parse ``24GB``, ``80 GiB``, ``1.5e9``; raises MemfitError on anything else."""
    match = _SIZE_RE.match(str(text))
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _SIZE_UNITS:
        raise MemfitError(
            f"{what} {text!r} is not a size; write a number of bytes or use a unit such as "
            "24GB or 80GiB")
    value = float(match.group(1)) * _SIZE_UNITS[unit]
    if not math.isfinite(value) or value <= 0:
        raise MemfitError(f"{what} must be positive, got {text!r}")
    return int(value)


def parse_count(text: str | float | int, *, what: str) -> int:
    """Parse a positive count such as ``7.5e9``, ``7.5B``, ``350M``; raises MemfitError."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        s = str(text).strip().lower().replace("_", "").replace(",", "")
        scale = 1.0
        for suffix, factor in (("t", 1e12), ("b", 1e9), ("m", 1e6), ("k", 1e3)):
            if s.endswith(suffix):
                s, scale = s[:-1], factor
                break
        try:
            value = float(s) * scale
        except ValueError:
            raise MemfitError(
                f"{what} {text!r} is not a number; write e.g. 7.5e9 or 7.5B") from None
    if not math.isfinite(value) or value <= 0:
        raise MemfitError(f"{what} must be a positive number, got {text!r}")
    if value < 1:  # rounded, 0.5 was 0 and the refusal said "got 0"
        raise MemfitError(f"{what} is a count of at least 1, got {text!r}; write a suffix for "
                          "billions, millions or thousands: 0.5B is 500,000,000")
    return round(value)


_RATE_PREFIX = {"": 1.0, "n": 1e-9, "u": 1e-6, "µ": 1e-6, "m": 1e-3, "k": 1e3, "K": 1e3,
                "M": 1e6, "G": 1e9, "g": 1e9, "T": 1e12, "t": 1e12, "P": 1e15}
_RATE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([nuµmkKMGgTtP]?)"
                      r"\s*([A-Za-z/]*)\s*$")
_RATE_UNITS = {"FLOP/s": ("flop/s", "flops"), "B/s": ("b/s",), "s": ("s",)}


def parse_rate(text: str | float | int, *, what: str, unit: str) -> float:
    """Parse a positive rate or duration in ``unit`` (``FLOP/s``, ``B/s`` or ``s``): a number
    (``113e9``) or a number with an SI prefix and, optionally, the unit (``113G``,
    ``113 GFLOP/s``, ``20GB/s``, ``8us``); raises MemfitError on anything else.

    >>> parse_rate("20GB/s", what="--mem-bandwidth", unit="B/s")
    20000000000.0
    """
    example = {"FLOP/s": "113e9 or 113G", "B/s": "20e9 or 20GB/s", "s": "8e-6 or 8us"}[unit]
    if isinstance(text, bool) or not isinstance(text, str | int | float):
        raise MemfitError(f"{what} must be a number in {unit}, e.g. {example}; got {text!r}")
    if isinstance(text, int | float):
        value = float(text)
    else:
        match = _RATE_RE.match(text)
        if not match or (match.group(3) and match.group(3).lower() not in _RATE_UNITS[unit]):
            raise MemfitError(f"{what} {text!r} is not a rate in {unit}; write e.g. {example}")
        if unit == "B/s" and match.group(3).startswith("b"):  # b/s is bits, 8x fewer bytes
            raise MemfitError(f"{what} {text!r} reads as bits per second; give bytes per "
                              f"second (capital B: 8 Gb/s = 1 GB/s), e.g. {example}")
        value = float(match.group(1)) * _RATE_PREFIX[match.group(2)]
    if not math.isfinite(value) or value <= 0:
        raise MemfitError(f"{what} must be a positive number in {unit}, e.g. {example}; "
                          f"got {text!r}")
    return value
