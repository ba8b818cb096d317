"""Requests for the serving simulator: generated (Poisson arrivals, seeded lengths) or read from a
trace file (JSONL or CSV, parsed with :mod:`json` / :mod:`csv` only).

A request is an arrival time (seconds from the start), its prompt tokens and the output tokens
it asks for (vLLM's ``max_tokens`` with ``ignore_eos``: it generates exactly that many).
"""

from __future__ import annotations

import csv
import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from memfit.errors import MemfitError

__all__ = ["LENGTHS", "Request", "check_requests", "percentile", "poisson_requests",
           "read_trace"]

Lengths = Literal["fixed", "uniform", "lognormal"]
LENGTHS: tuple[str, ...] = ("fixed", "uniform", "lognormal")
TRACE_FIELDS = ("arrival_time", "prompt_tokens", "output_tokens")
"""The fields of a trace row (JSONL keys, or the CSV header)."""


@dataclass(frozen=True, kw_only=True)
class Request:
    """One request: when it arrives and how long it is."""

    arrival_time: float
    """Seconds from the start of the run."""
    prompt_tokens: int
    output_tokens: int

    def __post_init__(self) -> None:
        if not (isinstance(self.arrival_time, (int, float)) and math.isfinite(self.arrival_time)
                and self.arrival_time >= 0):
            raise MemfitError(f"a request's arrival_time must be a number of seconds >= 0, got "
                              f"{self.arrival_time!r}")
        for name in ("prompt_tokens", "output_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MemfitError(f"a request's {name} must be an integer >= 1, got {value!r}")


def _lengths(rng: random.Random, n: int, mean: int, kind: str, spread: float) -> list[int]:
    """``n`` token counts around ``mean``: ``fixed``; ``uniform`` on ``[mean (1 - spread),
    mean (1 + spread)]`` (vLLM's random dataset's ``--random-range-ratio``); ``lognormal`` with
    ``sigma = spread`` and the mean kept (``mu = ln mean - sigma^2 / 2``). Each at least 1."""
    if kind == "fixed":
        return [mean] * n
    if kind == "uniform":
        if not 0 <= spread < 1:
            raise MemfitError(f"uniform lengths need a spread in [0, 1), got {spread}")
        lo, hi = mean * (1 - spread), mean * (1 + spread)
        return [max(1, round(rng.uniform(lo, hi))) for _ in range(n)]
    if kind == "lognormal":
        if not spread > 0:
            raise MemfitError(f"lognormal lengths need a spread (sigma) > 0, got {spread}")
        mu = math.log(mean) - spread * spread / 2
        return [max(1, round(rng.lognormvariate(mu, spread))) for _ in range(n)]
    raise MemfitError(f"unknown length distribution {kind!r}; valid: {', '.join(LENGTHS)}")


def poisson_requests(num_requests: int, qps: float, *, prompt_tokens: int, output_tokens: int,
                     lengths: str = "fixed", spread: float = 0.5, seed: int = 0,
                     max_total_tokens: int | None = None) -> list[Request]:
    """``num_requests`` requests arriving as a Poisson process at ``qps`` per second (``inf``:
    all at time 0, as ``vllm bench serve --request-rate inf``), with lengths from ``lengths``
    around ``prompt_tokens`` / ``output_tokens``, seeded. ``max_total_tokens`` (the engine's
    ``max_model_len``) clips a prompt to one less and the output to what is left.

    >>> max(r.arrival_time for r in poisson_requests(2, math.inf, prompt_tokens=8,
    ...                                              output_tokens=4))
    0.0
    """
    if isinstance(num_requests, bool) or not isinstance(num_requests, int) or num_requests < 1:
        raise MemfitError(f"the number of requests must be an integer >= 1, got {num_requests!r}")
    if not (isinstance(qps, (int, float)) and qps > 0):
        raise MemfitError(f"--qps must be a rate > 0 requests per second (or inf), got {qps!r}")
    for name, value in (("prompt tokens", prompt_tokens), ("output tokens", output_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise MemfitError(f"{name} must be an integer >= 1, got {value!r}")
    rng = random.Random(seed)
    prompts = _lengths(rng, num_requests, prompt_tokens, lengths, spread)
    outputs = _lengths(rng, num_requests, output_tokens, lengths, spread)
    t = 0.0
    out = []
    for p, o in zip(prompts, outputs, strict=True):
        if max_total_tokens is not None:
            p = min(p, max_total_tokens - 1)
            o = min(o, max_total_tokens - p)
        out.append(Request(arrival_time=t, prompt_tokens=p, output_tokens=o))
        if math.isfinite(qps):
            t += rng.expovariate(qps)
    return out


def _row(values: dict[str, object], where: str) -> Request:
    missing = [k for k in TRACE_FIELDS if k not in values or values[k] in (None, "")]
    if missing:
        raise MemfitError(f"{where}: missing {', '.join(missing)}; each row needs "
                          f"{', '.join(TRACE_FIELDS)}")
    try:
        arrival = float(values["arrival_time"])  # type: ignore[arg-type]
        prompt = _integer(values["prompt_tokens"])
        output = _integer(values["output_tokens"])
    except (TypeError, ValueError):
        raise MemfitError(f"{where}: arrival_time must be a number and prompt_tokens, "
                          f"output_tokens integers, got {values!r}") from None
    try:
        return Request(arrival_time=arrival, prompt_tokens=prompt, output_tokens=output)
    except MemfitError as exc:
        raise MemfitError(f"{where}: {exc}") from None


def _integer(value: object) -> int:
    if isinstance(value, bool):
        raise TypeError(value)
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(value)
        return int(value)
    if isinstance(value, (int, str)):
        return int(value)
    raise TypeError(value)


def read_trace(path: str | Path) -> list[Request]:
    """The requests of a trace file, sorted by arrival: ``.jsonl`` (one JSON object a line) or
    ``.csv`` (a header row), each row with ``arrival_time`` (seconds), ``prompt_tokens`` and
    ``output_tokens``. An empty or malformed file is one MemfitError line naming the row."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise MemfitError(f"cannot read trace {p}: {exc}") from None
    fix = f"pass a .jsonl or .csv file whose rows have {', '.join(TRACE_FIELDS)}"
    rows: list[Request] = []
    if p.suffix.lower() == ".csv":
        reader = csv.DictReader(text.splitlines())
        if reader.fieldnames is None:
            raise MemfitError(f"{p}: empty trace; {fix}")
        for n, record in enumerate(reader, start=2):
            rows.append(_row(dict(record), f"{p}:{n}"))
    elif p.suffix.lower() in (".jsonl", ".json", ".ndjson"):
        for n, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise MemfitError(f"{p}:{n}: not JSON ({exc.msg}); {fix}") from None
            if not isinstance(record, dict):
                raise MemfitError(f"{p}:{n}: expected a JSON object; {fix}")
            rows.append(_row(record, f"{p}:{n}"))
    else:
        raise MemfitError(f"{p}: unknown trace format {p.suffix or '(no suffix)'!r}; {fix}")
    if not rows:
        raise MemfitError(f"{p}: empty trace (no requests); {fix}")
    return sorted(rows, key=lambda r: r.arrival_time)


def check_requests(requests: Sequence[Request]) -> list[Request]:
    """The requests as a list sorted by arrival; none is a MemfitError."""
    reqs = list(requests)
    if not reqs:
        raise MemfitError("no requests to simulate; pass --qps with --num-requests >= 1, or a "
                          "non-empty --trace")
    for r in reqs:
        if not isinstance(r, Request):
            raise MemfitError(f"expected memfit.serving.Request items, got {type(r).__name__}")
    return sorted(reqs, key=lambda r: r.arrival_time)


def percentile(values: Sequence[float], q: float) -> float:
    """``numpy.percentile``'s default (linear between the closest ranks), which vLLM's
    benchmark reports."""
    s = sorted(values)
    if not s:
        return math.nan
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)
