"""Plan.apply of a custom module split at named submodules (``Parallel(pp_split_points=...)``)
and of a pipeline beside HSDP, under real gloo processes, against one process; fit's search of
pipeline x HSDP layouts.

Parity tolerance: tests/fitting/test_fit_pipeline.py's (fp32; the loss within ``rtol=1e-5``,
every weight after two AdamW steps within ``rtol=1e-5, atol=5e-5``): a pipeline adds each
micro-batch's token-loss sum in another order than one process's mean over the batch.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from _models import CustomDecoder
from memfit.errors import MemfitError
from memfit.fitting import FitConfig
from memfit.fitting.config import sharding_of
from memfit.parallel import Parallel

SEQ, VOCAB, D, STEPS = 16, 256, 32, 2
RTOL, ATOL = 1e-5, 5e-5


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "custom":
        return CustomDecoder(3, dim=D, hidden=2 * D, vocab=VOCAB)
    from memfit.models.build import build_model
    from memfit.parallel.measure import tiny_spec

    return build_model(tiny_spec(2), backend="builtin", device="cpu")


def _batch(rows: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
    labels[0, :5] = -100  # micro-batches with different token counts: the weighting matters
    return {"input_ids": ids, "labels": labels}


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _train(model: nn.Module, cfg: FitConfig, batch: dict[str, torch.Tensor], world: int,
           loss_fn: Any = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    import warnings

    from memfit.fitting.apply import apply_config
    from memfit.oom_guard import causal_lm_count

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, _, step = apply_config(model, cfg, num_gpus=world, log_recoveries=False,
                                  count_fn=causal_lm_count, loss_fn=loss_fn)
        losses = [float(step(batch)) for _ in range(STEPS)]
    return losses, {n: _full(p.detach()).clone() for n, p in model.named_parameters()
                    if p.numel()}


CASES: dict[str, tuple[str, dict[str, Any], int, int]] = {
    "custom split at blocks.1": ("custom", {"pp": 2, "pp_split_points": ["blocks.1"]}, 4, 2),
    "pp 2 x hsdp 2x2": ("builtin", {"pp": 2, "fsdp": 2}, 8, 8),
}
"""Each case's model, layout, global batch rows and world size."""


def _worker(rank: int, world: int, names: list[str], out: str) -> None:
    for name in names:
        kind, layout, rows, _ = CASES[name]
        par = Parallel(gpus=world, **layout)
        per = rows // par.dp
        dp_rank = rank % par.dp  # the (pp, replicate, shard) mesh: pp outermost
        mine = {k: v[dp_rank * per:(dp_rank + 1) * per] for k, v in _batch(rows).items()}
        micro = max(1, per // 2)
        cfg = FitConfig(precision="fp32", micro_batch=micro, accumulation=per // micro,
                        sharding=sharding_of(par), parallel=par)
        losses, weights = _train(_model(kind), cfg, mine, world)
        torch.save({"losses": losses, "weights": weights}, Path(out, f"{name}-rank{rank}.pt"))


@pytest.fixture(scope="module")
def gloo_runs() -> dict[str, list[dict[str, Any]]]:
    """Each case run once, the cases of one world size in one set of ranks, forked from a
    server that imported torch once (``start_method="forkserver"``: these ranks compare losses
    and weights, no memory peak, so the start method's one unexplained peak difference in
    memfit/parallel/gloo.py does not touch them)."""
    from memfit.parallel.gloo import spawn

    runs: dict[str, list[dict[str, Any]]] = {}
    for world in sorted({c[3] for c in CASES.values()}):
        names = [n for n, c in CASES.items() if c[3] == world]
        with tempfile.TemporaryDirectory() as out:
            spawn(_worker, world, names, out, start_method="forkserver")
            for n in names:
                runs[n] = [torch.load(Path(out, f"{n}-rank{r}.pt")) for r in range(world)]
    return runs


def _reference(kind: str, rows: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, one micro-batch of the whole batch, the pipeline's loss (the next-token
    cross-entropy mean over the labelled tokens)."""
    from memfit.parallel.pipeline import stage_loss

    def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return stage_loss(model(batch["input_ids"]), batch["labels"])

    cfg = FitConfig(precision="fp32", micro_batch=rows, accumulation=1)
    return _train(_model(kind), cfg, _batch(rows), 1,
                  loss_fn=loss_fn if kind == "custom" else None)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_split_and_hsdp_pipelines_train_like_one_process(name: str, gloo_runs: dict) -> None:
    """Two AdamW steps give the one-process run's loss and weights within fp32 reordering: the
    custom module split at blocks.1 (stage 0: the embedding and block 0; stage 1: blocks 1-2,
    the norm and the head) on 2 ranks; the tiny builtin decoder as pp 2 x HSDP (fsdp 2 x 2
    replicas) on 8. Every parameter is held by the ranks of exactly one stage (its dp ranks);
    the returned shares add up to the batch's mean loss."""
    kind, layout, rows, world = CASES[name]
    ranks = gloo_runs[name]
    want_losses, want = _reference(kind, rows)
    par = Parallel(gpus=world, **layout)
    for step in range(STEPS):
        got = sum(r["losses"][step] for r in ranks)
        assert got == pytest.approx(want_losses[step], rel=RTOL, abs=ATOL)
    holders: dict[str, int] = {}
    worst = 0.0
    for r in ranks:
        for param, w in r["weights"].items():
            torch.testing.assert_close(w, want[param], rtol=RTOL, atol=ATOL)
            worst = max(worst, float((w - want[param]).abs().max()))
            holders[param] = holders.get(param, 0) + 1
    assert holders == {param: par.dp for param in want}
    print(f"{name}: worst weight difference {worst:.3g}")
    assert worst < 1e-3  # no AdamW sign flip (2 lr = 2e-3)


def test_a_split_that_puts_a_tied_parameter_on_two_stages_is_refused() -> None:
    """A head tied to the embedding sits on the first and the last stage: one line."""
    from memfit.parallel.pipeline_split import check_untied_stages

    model = CustomDecoder(3, dim=D, hidden=2 * D, vocab=VOCAB)
    model.out.weight = model.tok.weight
    with pytest.raises(MemfitError, match="tied parameter") as info:
        check_untied_stages(model, Parallel(gpus=2, pp=2, pp_split_points=["blocks.1"]))
    assert "\n" not in str(info.value)


def test_fit_searches_pipelines_beside_hsdp() -> None:
    """Across nodes, fit's layouts of pp 2 include HSDP (sharded inside a node, replicas
    across), which the trace and Plan.apply run."""
    from memfit.fitting.layout_space import layouts
    from memfit.fitting.layouts import model_shape, pipeline_runs

    shape = model_shape(_model("builtin"), None)
    found = layouts(gpus=8, gpus_per_node=4, global_batch=8, shape=shape,
                    space={"pp": [2], "sharding": ["zero3", "hsdp"]}, rejected=[])
    hsdp = [p for p in found if p.pp == 2 and p.strategy == "hsdp"]
    assert hsdp and all(pipeline_runs(p) for p in hsdp)
    assert {(p.fsdp, p.replicate) for p in hsdp} == {(2, 2)}
