"""Helpers shared by the subcommands: number parsing and console output."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console

from memfit.errors import MemfitError


def positive_int(text: str | None, flag: str) -> int | None:
    """``--batch 4`` -> 4; anything not a positive integer is a MemfitError naming the flag."""
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        raise MemfitError(f"{flag} must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise MemfitError(f"{flag} must be a positive integer, got {text!r}")
    return value


def nonneg_int(text: str | None, flag: str) -> int | None:
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        raise MemfitError(f"{flag} must be an integer >= 0, got {text!r}") from None
    if value < 0:
        raise MemfitError(f"{flag} must be an integer >= 0, got {text!r}")
    return value


def console() -> Console:
    return Console(highlight=False, soft_wrap=False)


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2)
    sys.stdout.write("\n")


def print_fit_verdict(out: Console, capacity: int | None, total: int, margin: float,
                      method: str) -> None:
    """The one line that says whether a planned step fits, keeping ``margin`` of the GPU free
    (the method's worst under-prediction of published GPU measurements; see the README)."""
    from memfit.analytic.table import fit_verdict

    out.print(fit_verdict(capacity, total, margin, method))


def name_column(table: Any, header: str, **kwargs: Any) -> None:
    """Add the column a user copies from (a preset or GPU name): it never wraps or truncates;
    at a narrow width the other columns shrink or go (:func:`print_table`)."""
    table.add_column(header, no_wrap=True, overflow="ellipsis", **kwargs)


def print_table(table: Any, *, drop: tuple[str, ...] = (), out: Console | None = None) -> None:
    """Print ``table`` whole at the console's width: while any cell would be cut ("…"), drop
    the next column of ``drop`` (headers, least useful first) and say which went."""
    from memfit._tables import drop_until_whole

    out = out or console()
    dropped = drop_until_whole(table, out, drop)
    if dropped:
        table.caption = (f"hidden at {out.width} columns: {', '.join(dropped)} "
                         "(widen the terminal or use --json)")
    out.print(table)
