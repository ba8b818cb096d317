"""The fit search object (``memfit.fitting.search.Search``): its traffic bound is a true lower
bound of every candidate it prunes for, and pruning by it changes no plan."""

from __future__ import annotations

import warnings

import pytest
import torch

from memfit.fitting.search import Search, SearchOptions
from test_fit import make


def _search(**kw: object) -> Search:
    model, batch = make(16)
    args = dict(optimizer="adamw", global_batch=16, gpu=None, budget_bytes=2**30,
                device="cpu", loss_fn=None, reduction="mean", count_fn=None, num_gpus=1,
                measure=False, space=None, progress=False, top=5, headroom=None)
    args.update(kw)
    return Search(model, batch, **args)  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def _quiet() -> None:
    warnings.simplefilter("ignore")


def test_traffic_bound_is_below_every_candidate_of_its_combination() -> None:
    # Note: [traffic bound]: compute + activation traffic, minimised over the micro-batches,
    # never exceeds a candidate's predicted step (which adds dispatch, optimizer, transfers).
    # A tight budget makes several micro-batches and checkpointing policies candidates.
    s = _search(budget_bytes=6 * 2**20)
    s.run()
    assert s.candidates
    checked = 0
    for c in s.candidates:
        cfg = c.config
        combo = (cfg.precision, cfg.checkpointing, cfg.optimizer, cfg.chunked_loss,
                 cfg.attention)
        bound = s.tighter_bound(combo, s.lower_bound(combo))
        assert bound <= c.cost.total_s, (cfg.label(), bound, c.cost.total_s)
        if s.plain_sibling(combo) is not None:
            checked += 1
            # the bound is the cost's own compute + traffic at the best micro-batch
            assert bound >= s.lower_bound(combo)
    assert checked > 0  # the traffic term was in play, not only the FLOP bound


def test_traffic_bound_does_not_change_the_plan() -> None:
    torch.manual_seed(0)
    after = _search(budget_bytes=6 * 2**20).run()
    before = _search(budget_bytes=6 * 2**20,
                     options=SearchOptions(traffic_bound=False)).run()
    shown = [c.config for c in (after.chosen, *after.runners_up)]
    assert shown == [c.config for c in (before.chosen, *before.runners_up)]
    assert [c.peak_bytes for c in (after.chosen, *after.runners_up)] == \
        [c.peak_bytes for c in (before.chosen, *before.runners_up)]
    assert after.traces <= before.traces
