"""User-facing errors.

A ``MemfitError`` is bad input the user can fix: the CLI prints its message on one line and exits
with code 2, never a traceback. Messages say what is wrong, the valid values, and how to fix it.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class MemfitError(ValueError):
    """Bad input: unknown names, impossible sizes, conflicting options, malformed files."""


def suggest(name: str, choices: Iterable[str], n: int = 3) -> str:
    """`` (did you mean 'a', 'b'?)`` for the closest choices, or an empty string."""
    close = difflib.get_close_matches(name.lower(), list(choices), n=n, cutoff=0.5)
    if not close:
        return ""
    return " (did you mean " + ", ".join(repr(c) for c in close) + "?)"
