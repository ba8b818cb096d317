"""CLI tables at narrow terminals: the names a user copies are never cut (issue 12)."""

from __future__ import annotations

import re

import pytest
from rich.table import Table

from memfit.cli import main
from memfit.cli._common import console, name_column, print_table
from memfit.gpus import list_gpus
from memfit.models.presets import list_presets


def _whole(name: str, text: str) -> bool:
    """``name`` appears as a whole cell value: not inside a longer name (gpt2 vs gpt2-xl)."""
    return re.search(rf"(?<![\w.-]){re.escape(name)}(?![\w.-])", text) is not None


@pytest.mark.parametrize("columns", [80, 60])
def test_models_names_whole_at_narrow_width(capsys, monkeypatch, columns) -> None:
    monkeypatch.setenv("COLUMNS", str(columns))
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    names = [m.name for m in list_presets()]
    assert names and all(_whole(n, out) for n in names), [n for n in names if not _whole(n, out)]
    assert "…" not in out
    assert max(len(line) for line in out.splitlines()) <= columns


@pytest.mark.parametrize("columns", [80, 60])
def test_gpus_names_whole_at_narrow_width(capsys, monkeypatch, columns) -> None:
    monkeypatch.setenv("COLUMNS", str(columns))
    assert main(["gpus"]) == 0
    out = capsys.readouterr().out
    names = [g.name for g in list_gpus()]
    assert names and all(_whole(n, out) for n in names), [n for n in names if not _whole(n, out)]
    assert "…" not in out
    assert max(len(line) for line in out.splitlines()) <= columns


def test_print_table_drops_columns_in_order_and_says_so(capsys, monkeypatch) -> None:
    """A 30-column table at width 40 must lose its least useful columns, named in the caption,
    and keep the name column whole."""
    monkeypatch.setenv("COLUMNS", "40")
    table = Table()
    name_column(table, "name")
    for col in ("a-long-header", "b-long-header", "c-long-header"):
        table.add_column(col, no_wrap=True)
    table.add_row("a-rather-long-name-x", "1" * 12, "2" * 12, "3" * 12)
    print_table(table, drop=("c-long-header", "b-long-header"), out=console())
    out = capsys.readouterr().out
    assert "a-rather-long-name-x" in out and "…" not in out
    header = next(line for line in out.splitlines() if " name " in line)
    assert "a-long-header" in header and "c-long-header" not in header
    assert "hidden at 40 columns: c-long-header, b-long-header" in " ".join(out.split())
