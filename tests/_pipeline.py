"""The pipeline and per-rank tests' shared pieces: the tiny case, the per-rank trace, the gloo
measurement against the trace and the one-process parity check (one of each, not one per file)."""

from __future__ import annotations

import functools
from typing import Any

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


def assert_trains_like_one_process(runs: list[dict], want: dict, steps: int, rtol: float,
                                   atol: float, holders_each: int) -> None:
    """A pipeline's ``Plan.apply`` runs (one dict per rank: ``losses`` per step, ``weights`` by
    name) against one process's ``want``: the ranks' losses add up to its loss at every step,
    and each parameter is held (a non-empty tensor) by ``holders_each`` ranks, each equal to
    its weight after the steps."""
    import pytest
    import torch

    for step in range(steps):
        got = sum(r["losses"][step] for r in runs)
        assert got == pytest.approx(want["losses"][step], rel=rtol, abs=atol)
    holders: dict[str, int] = {}
    for r in runs:
        for key, w in r["weights"].items():
            if not w.numel():
                continue
            torch.testing.assert_close(w, want["weights"][key], rtol=rtol, atol=atol,
                                       msg=lambda m, k=key: f"{k}: {m}")
            holders[key] = holders.get(key, 0) + 1
    assert holders == dict.fromkeys(want["weights"], holders_each)


def measured_within_1_percent(traced: dict, cases: dict, make_case: Any, world: int,
                              first: Any) -> dict[str, list[dict]]:
    """Each layout of ``cases`` (name -> Parallel) measured on ``world`` gloo ranks, starting
    from the module's shared set's peaks (``first``), measured again while a rank is more than
    1% off its traced peak (``memfit.parallel.measure.measure_until``): name -> each rank's
    peaks."""
    from memfit.parallel.measure import measure_until

    def off(case: Case, got: list[dict]) -> bool:
        name = next(n for n, p in cases.items() if p == case.parallel)
        return any(abs(est.peak_bytes - got[r]["peak"]) > 0.01 * got[r]["peak"]
                   for est in traced[name].per_rank for r in est.ranks)

    peaks = measure_until([make_case(p) for p in cases.values()], world, off, first=first)
    return dict(zip(cases, peaks, strict=True))
