"""Rich tables that stay whole at the terminal's width: columns go before cells are cut."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def drop_until_whole(table: Any, console: Any, drop: Sequence[str]) -> list[str]:
    """While printing ``table`` on ``console`` would cut a cell ("…"), remove the next column
    of ``drop`` (headers, least useful first). Returns the headers removed."""
    dropped: list[str] = []
    for header in (*drop, None):
        with console.capture() as captured:
            console.print(table)
        if "…" not in captured.get() or header is None:
            break
        column = next((c for c in table.columns if c.header == header), None)
        if column is not None and len(table.columns) > 1:
            table.columns.remove(column)
            dropped.append(header)
    return dropped
