"""User-facing errors.

A ``MemfitError`` is bad input the user can fix: the CLI prints its message on one line and exits
with code 2, never a traceback. Messages say what is wrong, the valid values, and how to fix it.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any


class MemfitError(ValueError):
    """Bad input: unknown names, impossible sizes, conflicting options, malformed files."""


class DoesNotFitError(MemfitError):
    """The model does not fit the GPU as asked (the engine would refuse to start), found before
    a plan exists: bad input, except where the caller gates on fit (``memfit serve-plan
    --check-fit`` exits 1 on it, as on a plan that does not fit)."""


def suggest(name: str, choices: Iterable[str], n: int = 3) -> str:
    """`` (did you mean 'a', 'b'?)`` for the closest choices, or an empty string."""
    close = difflib.get_close_matches(name.lower(), list(choices), n=n, cutoff=0.5)
    if not close:
        return ""
    return " (did you mean " + ", ".join(repr(c) for c in close) + "?)"


def read_json_file(path: str | Path, *, what: str, fix: str) -> Any:
    """Parse a user's JSON file (``json.loads`` only: never eval or unpickle).

    A missing, unreadable or malformed file is one MemfitError line naming ``what`` and the
    path, ending with ``fix`` (what the user should do).
    """
    path = Path(path)
    if not path.is_file():
        raise MemfitError(f"{what} {path} does not exist (no such file); {fix}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise MemfitError(f"cannot read {what} {path} ({exc}): it must be readable UTF-8 text; "
                          f"{fix}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise MemfitError(f"{what} {path} is not valid JSON ({exc.msg} at line {exc.lineno}, "
                          f"column {exc.colno}); {fix}") from None
