"""GPU prices with their date and source: the catalog's (``memfit/data/gpus.json``), overridden
by a user's prices file, and flagged when older than a stated age.

A prices file maps catalog GPU names to ``{price_per_hour, source, date}`` (JSON through
``json.loads``, YAML through ``yaml.safe_load`` only)::

    h100-sxm-80gb: {price_per_hour: 2.99, source: "my provider's list", date: 2026-11-01}

A name the catalog does not know is refused (one line naming the closest ones), and so is a date
after today (a typo: 2062 for 2026).
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit.errors import MemfitError

__all__ = ["DEFAULT_MAX_PRICE_AGE_DAYS", "GpuPrice", "catalog_prices", "load_prices",
           "price_is_stale"]

DEFAULT_MAX_PRICE_AGE_DAYS = 365
"""A price older than this many days is flagged (GPU prices moved 2-3x within a year)."""

_FIELDS = ("price_per_hour", "source", "date")


@dataclass(frozen=True, kw_only=True)
class GpuPrice:
    """One GPU's on-demand price in US dollars per GPU-hour, where it came from and when."""

    price_per_hour: float
    source: str | None
    date: str | None
    """``YYYY-MM-DD`` or ``YYYY-MM`` (None: undated, always flagged stale)."""


def _parse_date(text: str) -> dt.date:
    """``YYYY-MM-DD``, or ``YYYY-MM`` read as the month's first day (the oldest it can be)."""
    try:
        if len(text) == 7:
            return dt.date.fromisoformat(text + "-01")
        return dt.date.fromisoformat(text)
    except ValueError:
        raise MemfitError(f"price date {text!r} is not a date; write YYYY-MM-DD") from None


def price_is_stale(price: GpuPrice, *, today: dt.date,
                   max_age_days: int = DEFAULT_MAX_PRICE_AGE_DAYS) -> bool:
    """Whether ``price`` is older than ``max_age_days`` on ``today`` (an undated one is)."""
    if price.date is None:
        return True
    return (today - _parse_date(price.date)).days > max_age_days


def catalog_prices(extra_gpu_file: str | Path | None = None) -> dict[str, GpuPrice]:
    """The catalog's priced GPUs by canonical name, in catalog order."""
    from memfit.gpus import list_gpus

    return {g.name: GpuPrice(price_per_hour=g.price_per_hour, source=g.price_source,
                             date=g.price_date)
            for g in list_gpus(extra_gpu_file) if g.price_per_hour is not None}


def _read(path: Path) -> Any:
    if not path.is_file():
        raise MemfitError(f"prices file {str(path)!r} not found; pass a JSON or YAML file of "
                          "{gpu: {price_per_hour, source, date}}")
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise MemfitError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}); fix "
                              "the file") from None
    try:
        import yaml  # type: ignore[import-untyped]
    except ImportError:
        raise MemfitError("reading YAML needs PyYAML: pip install pyyaml (or pass the prices "
                          "as a .json file)") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        raise MemfitError(f"{path}: not valid YAML; fix the file") from None


def load_prices(source: str | Path | Mapping[str, Any],
                extra_gpu_file: str | Path | None = None, *,
                today: dt.date | None = None) -> dict[str, GpuPrice]:
    """The prices of a prices file (or its parsed mapping) by canonical GPU name. Each entry
    needs ``price_per_hour`` (>= 0); ``source`` and ``date`` (YYYY-MM-DD) are optional (an
    undated price is flagged stale). An unknown GPU or field, or a date after ``today``
    (default: today's), is a MemfitError."""
    from memfit.gpus import get_gpu

    where = "prices"
    data: Any = source
    if isinstance(source, (str, Path)):
        path = Path(source).expanduser()
        where = str(path)
        data = _read(path)
    if not isinstance(data, Mapping) or not data:
        raise MemfitError(f"{where}: expected a mapping of GPU names to "
                          "{price_per_hour, source, date}")
    today = today or dt.date.today()
    out: dict[str, GpuPrice] = {}
    for name, entry in data.items():
        try:
            gpu = get_gpu(str(name), extra_gpu_file)
        except MemfitError as exc:
            raise MemfitError(f"{where}: {exc}") from None
        if not isinstance(entry, Mapping):
            raise MemfitError(f"{where}: {name}: expected {{price_per_hour, source, date}}, got "
                              f"{entry!r}")
        unknown = set(entry) - set(_FIELDS)
        if unknown:
            raise MemfitError(f"{where}: {name}: unknown field(s) {sorted(unknown)}; valid: "
                              f"{', '.join(_FIELDS)}")
        price = entry.get("price_per_hour")
        if isinstance(price, bool) or not isinstance(price, (int, float)) or not price >= 0:
            raise MemfitError(f"{where}: {name}: price_per_hour must be US dollars >= 0, got "
                              f"{price!r}")
        date = entry.get("date")
        if isinstance(date, dt.date):  # YAML reads 2026-11-01 as a date
            date = date.isoformat()
        if date is not None and _parse_date(str(date)) > today:
            raise MemfitError(f"{where}: {name}: price date {date} is after today ({today}); "
                              "write the date the price was quoted (a typo for a past year?)")
        src = entry.get("source")
        out[gpu.name] = GpuPrice(price_per_hour=float(price),
                                 source=None if src is None else str(src),
                                 date=None if date is None else str(date))
    return out
