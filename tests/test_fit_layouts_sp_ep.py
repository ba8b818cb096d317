"""Sequence, loss and expert parallelism in memfit.fit's layout search (memfit/fitting/layouts.py)
and in Plan.apply (memfit/fitting/apply.py).

Sources: Korthikanti et al. 2022 (arXiv 2205.05198) Eq. 2 and Eq. 4 (a tensor-parallel rank's
activations without and with sequence parallelism) and §4.2.2 (sequence parallelism's all-gather
and reduce-scatter move the bytes of the all-reduce they replace); torch's ``loss_parallel()``
(torch/distributed/tensor/parallel/loss.py: ``_log_softmax`` all-reduces the max and the sum of
exponentials, ``_nll_loss_forward`` the picked log-probability; "the corresponding backward()
call ... also needs to happen under this context manager"); torchtitan's train context
(torchtitan/distributed/utils.py: get_train_context) entering it around forward and backward;
GShard (Lepikhin et al. 2020, §2.2) and torchtitan's AllToAllTokenDispatcher: two all-to-alls per
MoE layer forward, their reverses backward. The parity tolerance is tests/test_fit_parallel.py's
(fp32 reordering, its module docstring).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from memfit.fitting import FitConfig
from memfit.fitting.config import sharding_of
from memfit.parallel import Parallel

SP_CASES = ({"tp": 2, "sp": True}, {"tp": 2, "sp": True, "loss_parallel": True})


def _sp_worker(rank: int, world: int, out: str) -> None:
    from test_fit_parallel import BATCH, _train, tiny

    results = []
    for layout in SP_CASES:  # one set of processes for both layouts
        par = Parallel(gpus=world, **layout)
        model, batch = tiny()
        cfg = FitConfig(precision="fp32", micro_batch=BATCH // 2, accumulation=2,
                        sharding=sharding_of(par), parallel=par)
        results.append(_train(model, cfg, batch, world))
    torch.save(results, Path(out, f"rank{rank}.pt"))


@pytest.mark.slow
def test_plan_apply_runs_sequence_and_loss_parallelism_like_one_process() -> None:
    """tp 2 + sequence parallelism and tp 2 + sequence + loss parallelism over 2 gloo ranks, two
    AdamW steps of 2 micro-batches each: the ranks' loss shares add up to the one-process loss
    and every rank's full weights equal the one-process weights (test_fit_parallel.py's
    tolerances). Loss parallelism runs the model's own cross-entropy on vocabulary-split logits
    inside ``loss_parallel()`` (Plan.apply's LossParallelStep)."""
    from memfit.parallel.gloo import spawn
    from test_fit_parallel import ATOL, RTOL, STEPS, _reference

    want_losses, want = _reference()
    with tempfile.TemporaryDirectory() as out:
        spawn(_sp_worker, 2, out)
        ranks = [torch.load(Path(out, f"rank{r}.pt")) for r in range(2)]
    for case, layout in enumerate(SP_CASES):
        for step in range(STEPS):
            got = sum(r[case][0][step] for r in ranks)
            assert got == pytest.approx(want_losses[step], rel=RTOL, abs=ATOL), layout
        for r in ranks:
            weights = r[case][1]
            assert set(weights) == set(want)
            for name, w in want.items():
                torch.testing.assert_close(weights[name], w, rtol=RTOL, atol=ATOL)
