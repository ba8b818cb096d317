"""A small YAML writer for JSON-like data (dicts, lists, strings, numbers, booleans, None).

Strings are written double-quoted with JSON escapes, which YAML 1.1 and 1.2 read the same way,
so no value changes type on the way back (``"no"`` stays a string; PyYAML and OmegaConf agree).
"""

from __future__ import annotations

import json
from typing import Any


def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return json.dumps(value)
    if isinstance(value, str):
        return json.dumps(value)
    raise TypeError(f"cannot write {type(value).__name__} as YAML")


def _lines(value: Any, indent: int) -> list[str]:
    pad = "  " * indent
    out: list[str] = []
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(item, dict | list) and item:
                out.append(f"{pad}{key}:")
                out += _lines(item, indent + 1)
            else:
                out.append(f"{pad}{key}: {_empty(item)}")
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, dict | list) and item:
                inner = _lines(item, indent + 1)
                out.append(f"{pad}- {inner[0].lstrip()}")
                out += inner[1:]
            else:
                out.append(f"{pad}- {_empty(item)}")
    return out


def _empty(value: Any) -> str:
    if isinstance(value, dict):
        return "{}"
    if isinstance(value, list):
        return "[]"
    return _scalar(value)


def dump(data: dict[str, Any], header: str = "") -> str:
    """``data`` as block-style YAML, after ``header`` comment lines."""
    comments = [f"# {line}".rstrip() for line in header.splitlines()]
    return "\n".join([*comments, *_lines(data, 0)]) + "\n"
