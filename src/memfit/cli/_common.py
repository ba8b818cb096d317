"""Helpers shared by the subcommands: number parsing and console output."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable, Mapping
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


def given_flags(args: Any, dests: Iterable[str]) -> list[str]:
    """The flags among ``dests`` (argparse destinations) given on the command line, spelled as
    typed (``gpus_max`` -> ``--gpus-max``): those whose value is not None. A flag that only one
    kind of run reads has no argparse default, so that the other kind can refuse it."""
    return ["--" + d.replace("_", "-") for d in dests if getattr(args, d) is not None]


def fill_defaults(args: Any, defaults: Mapping[str, str]) -> None:
    """Set each flag of ``defaults`` that was not given to its default (see
    :func:`given_flags`)."""
    for dest, default in defaults.items():
        if getattr(args, dest) is None:
            setattr(args, dest, default)


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


class _Console(Console):
    """rich's Console, except that when stdout is not a terminal (piped or captured, where rich
    assumes 80 columns unless ``COLUMNS`` says) a line of text is never split: a script or
    ``grep`` gets each line whole. Tables, with their titles and captions, keep to the width."""

    def print(self, *objects: Any, soft_wrap: bool | None = None, **kwargs: Any) -> None:
        if soft_wrap is None and not self.is_terminal and all(isinstance(o, str)
                                                              for o in objects):
            soft_wrap = True
        super().print(*objects, soft_wrap=soft_wrap, **kwargs)


def console() -> Console:
    """The console a subcommand prints to: lines wrap at a terminal's width, and are whole
    when stdout is not a terminal (:class:`_Console`)."""
    return _Console(highlight=False, soft_wrap=False)


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2)
    sys.stdout.write("\n")


EXIT_DOES_NOT_FIT = 1
"""``memfit plan --check``'s exit code when the step does not fit (0: it fits; 2: bad input)."""


def exit_status(args: Any, capacity: int | None, total: int, margin: float) -> int:
    """A plan's exit code: :data:`EXIT_DOES_NOT_FIT` under ``--check`` when ``total`` leaves
    less than ``margin`` of ``capacity`` free, else 0 (without ``--check`` a plan that was
    answered exits 0, whatever its verdict)."""
    if not getattr(args, "check", False) or capacity is None:
        return 0
    return 0 if capacity - total >= margin * capacity else EXIT_DOES_NOT_FIT


def fit_status(args: Any, fits: bool) -> int:
    """``memfit serve-plan``'s exit code: :data:`EXIT_DOES_NOT_FIT` under ``--check-fit`` when
    the plan does not fit, else 0 (without ``--check-fit`` a plan that was answered exits 0;
    its ``--check`` is the startup log to compare with)."""
    return EXIT_DOES_NOT_FIT if getattr(args, "check_fit", False) and not fits else 0


def took(args: Any, traced_seconds: float) -> str:
    """How long a traced plan took, for its header: the command's wall time since ``memfit
    plan`` started (importing torch and transformers, building the model on meta, tracing),
    and the part of it spent tracing the step."""
    started = getattr(args, "started", None)
    if started is None:
        return f"in {traced_seconds:.1f} s (tracing the step)"
    return (f"in {time.perf_counter() - started:.1f} s ({traced_seconds:.1f} s of it tracing "
            "the step)")


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
