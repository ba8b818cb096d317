"""The pipeline tests' tiny case and per-rank trace (one builder, not one per file)."""

from __future__ import annotations

import functools

import memfit
from memfit.parallel import Parallel
from memfit.parallel.measure import Case, build, tiny_spec
from memfit.recipe import Recipe

SEQ = 64


def pp_case(parallel: Parallel) -> Case:
    """``tiny_spec(4)`` (4 blocks: two per stage at pp 2), batch 8 x 64 tokens."""
    return Case(spec=tiny_spec(4), batch=8, seq=SEQ, recipe=Recipe(parallel=parallel))


@functools.cache
def per_rank(case: Case) -> tuple[memfit.Estimate, ...]:
    """The CPU-target per-rank trace of ``case``, its roles covering every rank once.

    Traced once per process and case (a ``Case`` is frozen, so equal cases are one key): the
    trace is deterministic (tests/parallel/test_parallel_pp.py: the first pipeline trace of a
    process equals the later ones, checked in a fresh process) and the tests only read the
    estimates, so a layout that several tests compare, or that a gloo check's retry reads twice
    (``measure_until``), is traced once."""
    model, inputs = build(case)
    est = memfit.estimate(model, inputs, device="cpu", parallel=case.parallel)
    assert sorted(r for e in est.per_rank for r in e.ranks) == list(range(case.parallel.gpus))
    return est.per_rank
