"""Expert parallelism beside pipeline parallelism in memfit.fit and Plan.apply: each pipeline
stage's MoE layers split over the stage's ``ep`` ranks (memfit/parallel/pipeline_parallelize.py:
apply_ep_stages, torchtitan's (pp, efsdp, ep) sparse mesh), DDP (ep = dp) or FSDP2 for the rest.
memfit's tiny MoE decoder (hidden 64, 2 layers, 4 experts, top 2), random weights."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from memfit.fitting import FitConfig
from memfit.fitting.config import sharding_of
from memfit.parallel import Parallel

BATCH, SEQ = 4, 16
FIXED = {"precision": ["fp32"], "checkpointing": ["none"], "optimizer": ["adamw"],
         "chunked_loss": [False]}


def _moe() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    from memfit.models.build import build_model
    from memfit.parallel.measure import tiny_moe_spec

    spec = tiny_moe_spec()
    torch.manual_seed(0)
    model = build_model(spec, backend="builtin", device="cpu")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, spec.vocab_size, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, spec.vocab_size, (BATCH, SEQ), generator=g)
    return model, {"input_ids": ids, "labels": labels}


def test_search_offers_ep_beside_pp_as_apply_runs_it() -> None:
    """On 4 GPUs with pp 2 (dp 2 per stage), the search offers ep 2 with DDP (ep = dp) and with
    FSDP2 (zero2 / zero3), each with 1F1B and GPipe; each is traced per rank and accepted by
    Plan.apply's pipeline (no refusal)."""
    from memfit.fitting.apply_pipeline import _pipeline_parallel
    from memfit.fitting.layout_space import layouts
    from memfit.fitting.layouts import model_shape
    from memfit.fitting.search import per_rank_traced

    model, _ = _moe()
    found = layouts(gpus=4, gpus_per_node=None, global_batch=8,
                    shape=model_shape(model, SEQ), space={"tp": [1], "pp": [2]}, rejected=[])
    with_ep = [p for p in found if p.ep > 1]
    assert sorted((sharding_of(p), p.pp_schedule) for p in with_ep) == sorted(
        (z, s) for z in ("none", "zero2", "zero3") for s in ("1f1b", "gpipe"))
    assert all(p.pp == 2 and p.ep == 2 for p in with_ep)
    for par in with_ep:
        assert per_rank_traced(par), par.describe()
        cfg = FitConfig(precision="fp32", micro_batch=1, accumulation=2,
                        sharding=sharding_of(par), parallel=par)
        assert _pipeline_parallel(cfg, None, None, "mean").ep == 2


def test_search_chooses_ep_beside_pp_where_only_it_fits() -> None:
    """4 GPUs, pp 2, DDP on each stage: with ep 2 a rank keeps half its stage's experts (and
    their gradients and AdamW states). Under a budget between the best pp 2 x ep 2 candidate's
    traced peak and the best pp 2 one's without ep, the search chooses a pp 2 x ep 2 layout."""
    import memfit

    model, batch = _moe()
    space = FIXED | {"micro_batch": [1], "tp": [1], "pp": [2], "sharding": ["none"]}
    plan = memfit.fit(model, batch, global_batch=4, budget_bytes=2**30, device="cpu", gpus=4,
                      headroom=0.0, progress=False, top=50, space=space)
    cands = [plan.chosen, *plan.runners_up]
    ep = [c.peak_bytes for c in cands if c.config.parallel.ep == 2]
    plain = [c.peak_bytes for c in cands if c.config.parallel.ep == 1]
    assert ep and plain and min(ep) < min(plain)
    assert all(c.per_rank for c in cands)
    plan = memfit.fit(model, batch, global_batch=4, budget_bytes=(min(ep) + min(plain)) // 2,
                      device="cpu", gpus=4, headroom=0.0, progress=False, space=space)
    par = plan.chosen.config.parallel
    assert par is not None and (par.pp, par.ep) == (2, 2), par.describe()


# -- Plan.apply on real gloo ranks -------------------------------------------------------------


def _sgd(model: torch.nn.Module, cfg: FitConfig, batch: dict[str, torch.Tensor], world: int
         ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Two SGD steps of the plan; the losses and the weights this rank holds (full tensors)."""
    import warnings

    from memfit.fitting.apply import apply_config
    from memfit.oom_guard import causal_lm_count

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, _, step = apply_config(model, cfg, num_gpus=world, log_recoveries=False,
                                  count_fn=causal_lm_count)
        losses = [float(step(batch)) for _ in range(2)]
    out = {}  # the stage holds the model's own submodules; another stage's are emptied
    for name, p in model.named_parameters():
        full = p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()
        if full.numel():
            out[name] = full.clone()
    return losses, out


def _worker(rank: int, world: int, layouts: list[dict[str, Any]], out: str) -> None:
    for i, layout in enumerate(layouts):
        par = Parallel(gpus=world, **layout)
        model, batch = _moe()
        per = BATCH // par.dp
        dp_rank = rank % par.dp  # the (pp, dp) mesh
        mine = {k: v[dp_rank * per:(dp_rank + 1) * per] for k, v in batch.items()}
        cfg = FitConfig(precision="fp32", micro_batch=1, accumulation=per, optimizer="sgd",
                        sharding=sharding_of(par), parallel=par)
        losses, weights = _sgd(model, cfg, mine, world)
        torch.save({"losses": losses, "weights": weights}, Path(out, f"case{i}-rank{rank}.pt"))


LAYOUTS = [{"pp": 2, "ep": 2}, {"pp": 2, "ep": 2, "zero": 3}]


@pytest.mark.slow
def test_plan_apply_runs_ep_beside_pp_like_one_process() -> None:
    """pp 2 x ep 2 on 4 gloo ranks, DDP and FSDP2 for the dense parameters, two SGD steps of
    micro-batch 1 (the same micro-batches as one process, so the same expert capacities): the
    ranks' loss shares add up to the one-process loss, and every weight a rank holds (its
    stage's dense ones whole, its share of each stage's stacked experts: index rank % ep)
    equals the one-process run's. SGD, as tests/fitting/test_fit_layouts_sp_ep.py: an expert
    gradient not divided as the dense ones (Note: [expert gradients]) would change the step."""
    from memfit.parallel.gloo import spawn

    model, batch = _moe()
    ref = FitConfig(precision="fp32", micro_batch=1, accumulation=BATCH, optimizer="sgd")
    want_losses, want = _sgd(model, ref, batch, 1)
    with tempfile.TemporaryDirectory() as out:
        # forked from a server that imported torch once: losses and weights, no memory peak
        spawn(_worker, 4, LAYOUTS, out, start_method="forkserver")
        runs = [[torch.load(Path(out, f"case{i}-rank{r}.pt")) for r in range(4)]
                for i in range(len(LAYOUTS))]
    for layout, ranks in zip(LAYOUTS, runs, strict=True):
        for step in range(2):
            got = sum(r["losses"][step] for r in ranks)
            assert got == pytest.approx(want_losses[step], rel=1e-5), layout
        checked = 0
        for rank, r in enumerate(ranks):
            for name, w in r["weights"].items():
                whole = want[name.replace(".experts.", ".")]
                if ".experts." in name:
                    local, index = w.shape[0], rank % 2
                    whole = whole[index * local:(index + 1) * local]
                torch.testing.assert_close(w, whole, rtol=1e-4, atol=1e-6)
                checked += 1
        # every weight on the 2 ranks of its stage (pp 2 x dp 2)
        assert checked == 2 * len(want), layout
