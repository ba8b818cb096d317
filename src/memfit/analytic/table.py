"""The one "memory per GPU" table that both methods print (``memfit plan``, ``--method trace``,
``print(plan)``): the same rows, the caching allocator's reserve on its own row, and numbered
footnotes wherever a method counts a category differently.

Rendering only: the numbers come from :class:`memfit.analytic.planner.MemoryPlan` and the trace's
``Estimate``; units are formatted here, at the edge.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from memfit.categories import MemoryCategory
from memfit.units import format_bytes

RESERVE_ROW = "allocator reserve"
"""Bytes the caching allocator holds beyond live tensors at the peak (peak reserved - peak
allocated): cached free blocks and the unused tails of split segments."""

NOT_MODELLED = "not modelled"

CAPACITY_ROW = "usable on GPU"


@dataclass(frozen=True, kw_only=True)
class Column:
    """One method's numbers for the table."""

    name: str
    breakdown: dict[MemoryCategory, int]
    """Bytes per category; ``RUNTIME`` without the allocator's reserve."""
    allocator_reserve: int | None
    """Peak reserved - peak allocated; None where the method does not model it."""
    activations_known: bool = True

    @property
    def total(self) -> int:
        return sum(self.breakdown.values()) + (self.allocator_reserve or 0)


@dataclass(frozen=True, kw_only=True)
class Footnote:
    rows: tuple[str, ...]
    """Row labels the note's number is put next to."""
    text: str


@dataclass(frozen=True, kw_only=True)
class SuggestionRow:
    change: str
    saved_bytes: int
    total_bytes: int
    fits: bool | None


@dataclass(frozen=True, kw_only=True)
class MemoryTable:
    """The table and what goes under it."""

    title: str
    columns: tuple[Column, ...]
    capacity: int | None
    capacity_is_driver_total: bool = False
    """The GPU's usable bytes are the driver's total, PyTorch's ``total_memory`` not measured."""
    footnotes: tuple[Footnote, ...] = ()
    suggestions: tuple[SuggestionRow, ...] = ()
    suggestions_title: str = "What would save memory (one change each)"
    lines_before: tuple[str, ...] = field(default=())
    lines_after: tuple[str, ...] = field(default=())
    closing: tuple[str, ...] = field(default=())
    """Lines after the suggestions: what to do when no single change will (more GPUs)."""

    def rich_table(self) -> Any:
        from rich.table import Table

        table = Table(title=self.title, title_justify="left")
        table.add_column("category")
        one = len(self.columns) == 1
        for col in self.columns:
            table.add_column(col.name, justify="right")
        if one:
            table.add_column("share", justify="right")
        marks: dict[str, list[int]] = {}
        for number, note in enumerate(self.all_footnotes(), start=1):
            for row in note.rows:
                marks.setdefault(row, []).append(number)

        def label(row: str) -> str:
            numbers = marks.get(row)
            return row + (" " + "".join(f"[{n}]" for n in numbers) if numbers else "")

        def cells(values: list[int | None], unknown: list[bool] | None = None) -> list[str]:
            out = []
            for i, value in enumerate(values):
                if unknown and unknown[i]:
                    out.append("unknown")
                else:
                    out.append(NOT_MODELLED if value is None else format_bytes(value))
            if one:
                total = self.columns[0].total
                value = values[0]
                out.append(f"{100 * value / total:.1f}%" if total and value is not None
                           and not (unknown and unknown[0]) else "")
            return out

        for category in MemoryCategory:
            values: list[int | None] = [c.breakdown[category] for c in self.columns]
            unknown = [category is MemoryCategory.ACTIVATIONS and not c.activations_known
                       for c in self.columns]
            table.add_row(label(category.value), *cells(values, unknown))
        table.add_row(label(RESERVE_ROW), *cells([c.allocator_reserve for c in self.columns]))
        table.add_section()
        totals = [f"[bold]{format_bytes(c.total)}[/bold]" for c in self.columns]
        table.add_row("[bold]total[/bold]", *totals, *([""] if one else []))
        if self.capacity is not None:
            table.add_row(label(CAPACITY_ROW), format_bytes(self.capacity),
                          *([""] * (len(self.columns) - 1 + one)))
        return table

    def suggestions_table(self) -> Any:
        from rich.table import Table

        sug = Table(title=self.suggestions_title, title_justify="left")
        sug.add_column("change")
        sug.add_column("saves", justify="right")
        sug.add_column("new total", justify="right")
        sug.add_column("fits", justify="center")
        for s in self.suggestions:
            fits = {True: "yes", False: "no", None: "?"}[s.fits]
            sug.add_row(s.change, format_bytes(s.saved_bytes), format_bytes(s.total_bytes), fits)
        return sug

    def all_footnotes(self) -> tuple[Footnote, ...]:
        if self.capacity is None or not self.capacity_is_driver_total:
            return self.footnotes
        return (*self.footnotes, Footnote(rows=(CAPACITY_ROW,), text=(
            "the driver's total; PyTorch's total_memory for this GPU is not in the catalog "
            "(1-2% less)")))

    def footnote_lines(self) -> list[str]:
        return [f"[{n}] {note.text}" for n, note in enumerate(self.all_footnotes(), start=1)]

    def print(self, out: Any, verdict: Any = None) -> None:
        """Print to a rich console: lines before, the table, footnotes, ``verdict(out)``, lines
        after, the suggestions (single changes), then the closing lines (more hardware)."""
        for line in self.lines_before:
            out.print(line)
        out.print(self.rich_table())
        for line in self.footnote_lines():
            out.print(line, markup=False)
        if verdict is not None:
            verdict(out)
        for line in self.lines_after:
            out.print(line, markup=False)
        if self.suggestions:
            out.print(self.suggestions_table())
        for line in self.closing:
            out.print(line, markup=False)

    def text(self, width: int = 100, verdict: Any = None) -> str:
        """Plain text, for ``__str__``."""
        from rich.console import Console

        buf = io.StringIO()
        console = Console(file=buf, width=width, force_terminal=False, color_system=None,
                          highlight=False, soft_wrap=False)
        self.print(console, verdict)
        return buf.getvalue().rstrip() + "\n"


def format_params(n: int) -> str:
    """``8.03B`` from a billion parameters up, ``2.7M`` below."""
    return f"{n / 1e9:.2f}B" if n >= 10**9 else f"{n / 1e6:.1f}M"


def reserve_not_modelled_note(margin: float, where: str = "here") -> Footnote:
    return Footnote(rows=(RESERVE_ROW,), text=(
        f"not modelled {where}: the {margin:.0%} fit margin covers the allocator's cache "
        "(--method trace models it)"))


def fit_verdict(capacity: int | None, total: int, margin: float, method: str) -> str:
    """The one line that says whether a planned step fits, keeping ``margin`` of the GPU free
    (the method's worst under-prediction of published GPU measurements); rich markup."""
    if capacity is None:
        return "no --gpu given: add one to see whether it fits"
    headroom = capacity - total
    if headroom >= margin * capacity:
        return f"[green]fits[/green] with {format_bytes(headroom)} headroom"
    if headroom >= 0:
        return (f"[red]does not fit[/red] with the {margin:.0%} margin memfit keeps for the "
                f"{method} (its worst under-prediction of published GPU measurements): "
                f"{format_bytes(headroom)} headroom")
    return f"[red]does not fit[/red]: {format_bytes(-headroom)} over"


def suggestion_rows(suggestions: Sequence[Any]) -> tuple[SuggestionRow, ...]:
    return tuple(SuggestionRow(change=s.change, saved_bytes=s.saved_bytes,
                               total_bytes=s.plan.total_bytes, fits=s.plan.fits)
                 for s in suggestions)
