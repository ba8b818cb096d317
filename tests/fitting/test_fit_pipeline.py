"""Plan.apply of pipeline layouts under real gloo processes (``torch.distributed.pipelining``'s
schedules over memfit/parallel/pipeline.py's stages), and fit's per-rank trace of pipeline
candidates.

Parity tolerance: as tests/fitting/test_fit_parallel.py (fp32; the loss within ``rtol=1e-5``, every
weight after two AdamW steps within ``rtol=1e-5, atol=5e-5``, 5% of one AdamW step). A pipeline
adds each micro-batch's token-loss sum in another order than one process's mean over the batch,
and FSDP2 / tensor parallelism reorder their sums as in the other layouts' tests. Measured (this
machine): the worst weight differs by 6.2e-6 (pp 2, 1F1B), 1.8e-5 (interleaved 1F1B, 4 blocks),
7.5e-6 (pp 2 x fsdp 2), 3.9e-6 (pp 2 x tp 2), 7.5e-6 (pp 2 x ddp 2 and pp 2 x zero1 2) from the
one-process run.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from memfit.fitting import FitConfig
from memfit.fitting.config import sharding_of
from memfit.parallel import Parallel
from memfit.parallel.measure import tiny_spec

BATCH, SEQ, STEPS = 4, 16, 2
RTOL, ATOL = 1e-5, 5e-5


def tiny(layers: int = 2) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The tiny Llama (hidden 64, 4 heads, ``layers`` blocks) with fixed weights, and a fixed
    batch."""
    from memfit.models.build import build_model

    spec = tiny_spec(layers)
    torch.manual_seed(0)
    model = build_model(spec, backend="builtin", device="cpu")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, spec.vocab_size, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, spec.vocab_size, (BATCH, SEQ), generator=g)
    labels[0, :5] = -100  # micro-batches with different token counts: the weighting matters
    return model, {"input_ids": ids, "labels": labels}


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _train(model: torch.nn.Module, cfg: FitConfig, batch: dict[str, torch.Tensor], world: int
           ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Two steps; the losses returned and the full weights this rank holds (another stage's
    parameters are freed on it: zero elements)."""
    import warnings

    from memfit.fitting.apply import apply_config
    from memfit.oom_guard import causal_lm_count

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, _, step = apply_config(model, cfg, num_gpus=world, log_recoveries=False,
                                  count_fn=causal_lm_count)
        losses = [float(step(batch)) for _ in range(STEPS)]
    return losses, {n: _full(p.detach()).clone() for n, p in model.named_parameters()
                    if p.numel()}


def _worker(rank: int, world: int, cases: list[tuple[dict[str, Any], int]], out: str) -> None:
    for i, (layout, layers) in enumerate(cases):
        par = Parallel(gpus=world, **layout)
        model, batch = tiny(layers)
        per = BATCH // par.dp
        dp_rank = (rank // par.tp) % par.dp  # the (pp, dp, tp) mesh: tp innermost
        mine = {k: v[dp_rank * per:(dp_rank + 1) * per] for k, v in batch.items()}
        micro = max(1, per // 2)
        cfg = FitConfig(precision="fp32", micro_batch=micro, accumulation=per // micro,
                        sharding=sharding_of(par), parallel=par)
        losses, weights = _train(model, cfg, mine, world)
        torch.save({"losses": losses, "weights": weights}, Path(out, f"case{i}-rank{rank}.pt"))


def _run(cases: list[tuple[dict[str, Any], int]], world: int) -> list[list[dict[str, Any]]]:
    """Every case in one set of ``world`` gloo processes (one start-up for all)."""
    from memfit.parallel.gloo import spawn

    with tempfile.TemporaryDirectory() as out:
        spawn(_worker, world, cases, out, start_method="forkserver")  # no peak: losses, weights
        return [[torch.load(Path(out, f"case{i}-rank{r}.pt")) for r in range(world)]
                for i in range(len(cases))]


def _reference(layers: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model, batch = tiny(layers)
    cfg = FitConfig(precision="fp32", micro_batch=BATCH, accumulation=1)
    return _train(model, cfg, batch, 1)


GROUPS: dict[str, tuple[list[tuple[dict[str, Any], int]], int]] = {
    "pp2-1f1b+interleaved": ([({"pp": 2}, 2),
                              ({"pp": 2, "pp_schedule": "interleaved-1f1b"}, 4)], 2),
    "pp2xfsdp2+pp2xtp2": ([({"pp": 2, "fsdp": 2}, 2), ({"pp": 2, "tp": 2}, 2)], 4),
    "pp2xddp2+pp2xzero1+gpipe": ([({"pp": 2}, 2), ({"pp": 2, "zero": 1}, 2),
                                  ({"pp": 2, "pp_schedule": "gpipe"}, 2)], 4),
}
"""Each test case's (layout, blocks) cases and its world size."""


@pytest.fixture(scope="module")
def gloo_runs() -> dict[str, list[list[dict[str, Any]]]]:
    """Every group of GROUPS run once, all the groups of one world size in one set of ranks (a
    fresh model, batch and plan per case: see ``_worker``); per group, per case, each rank's
    losses and weights."""
    runs: dict[str, list[list[dict[str, Any]]]] = {}
    for world in sorted({w for _, w in GROUPS.values()}):
        names = [n for n, (_, w) in GROUPS.items() if w == world]
        results = iter(_run([c for n in names for c in GROUPS[n][0]], world))
        runs.update((n, [next(results) for _ in GROUPS[n][0]]) for n in names)
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("group", list(GROUPS))
def test_pipeline_plan_trains_like_one_process(group: str, gloo_runs: dict) -> None:
    """Two AdamW steps of a pipeline plan over gloo ranks give the one-process run's loss and
    weights within fp32 reordering (module docstring): pp 2 with 1F1B and with interleaved 1F1B
    (4 blocks, two stages per rank) on 2 ranks; pp 2 x FSDP2 2 and pp 2 x tp 2 on 4; pp 2 x DDP 2
    and pp 2 x ZeRO-1 2 on 4, and pp 2 x DDP 2 with GPipe (a DDP wrapper per stage over its
    data-parallel group, which torch's schedule runs under ``no_sync`` for every micro-batch but
    the last: ``torch/distributed/pipelining/stage.py:
    _PipelineStageBase.backward_maybe_with_nosync``;
    ZeRO-1's ``ZeroRedundancyOptimizer`` over that group: a rank whose DDP did not average the
    gradients, or whose optimizer partitioned over the wrong ranks, would differ). Every
    parameter is held by the ranks of exactly one stage (its tp / dp peers), full on each after
    gathering; the returned losses are each rank's share (0.0 off the last stage), which add up
    to the batch's mean loss."""
    cases, world = GROUPS[group]
    for (layout, layers), ranks in zip(cases, gloo_runs[group], strict=True):
        want_losses, want = _reference(layers)
        par = Parallel(gpus=world, **layout)
        for step in range(STEPS):
            got = sum(r["losses"][step] for r in ranks)
            assert got == pytest.approx(want_losses[step], rel=RTOL, abs=ATOL), layout
        last = [r for r in range(world) if r // (par.dp * par.tp) == par.pp - 1]
        assert all(ranks[r]["losses"] == [0.0] * STEPS for r in range(world) if r not in last)
        holders: dict[str, int] = {}
        worst = 0.0
        for r in ranks:
            for name, w in r["weights"].items():
                torch.testing.assert_close(w, want[name], rtol=RTOL, atol=ATOL)
                worst = max(worst, float((w - want[name]).abs().max()))
                holders[name] = holders.get(name, 0) + 1
        # Each parameter on the dp * tp ranks of one stage (two stages per rank when
        # interleaved).
        assert holders == {name: par.dp * par.tp for name in want}, layout
        print(f"{layout}: worst weight difference {worst:.3g}")
        assert worst < 1e-3  # no AdamW sign flip (2 lr = 2e-3)


# -- fit's pipeline candidates -------------------------------------------------------------------

@pytest.mark.parametrize(("gpus", "shardings"), [(2, ["none"]), (4, ["none", "zero1"])],
                         ids=["pp2", "pp2xddp2+pp2xzero1"])
def test_pipeline_candidates_peak_is_their_worst_stage_traced(gpus: int,
                                                              shardings: list[str]) -> None:
    """Each pipeline candidate's peak is the worst rank's peak of memfit.estimate(...,
    parallel=Parallel(pp=2, microbatches=accumulation)) over the per-rank batch (on 4 GPUs: pp 2
    beside DDP 2 and beside ZeRO-1 2, a DDP wrapper per stage, ZeRO-1 over its dp group), two steps
    (the second holds the optimizer states; the search traces one step on the CPU and adds
    them, Note: [one traced step on CPU] in memfit/fitting/traced.py), not the formulas'
    derivation. The stages differ: the first holds more micro-batches in flight (1F1B), the
    last the head; which one is worst depends on the micro-batch."""
    import memfit
    from memfit._tensors import meta_batch

    model, batch = tiny()
    plan = memfit.fit(model, batch, global_batch=8, budget_bytes=64 * 2**20, device="cpu",
                      gpus=gpus, progress=False, space={"precision": ["fp32"], "tp": [1],
                                                        "checkpointing": ["none"], "pp": [2],
                                                        "sharding": shardings})
    shown = [plan.chosen, *plan.runners_up]
    assert {c.config.accumulation for c in shown} >= {2, 4}  # 1F1B: at least pp micro-batches
    assert {c.config.sharding for c in shown} == set(shardings)
    for c in shown:
        cfg = c.config
        assert cfg.parallel is not None and cfg.parallel.pp == 2 and c.per_rank
        par = Parallel(gpus=gpus, pp=2, zero=1 if cfg.sharding == "zero1" else None,
                       microbatches=cfg.accumulation, pp_schedule=cfg.parallel.pp_schedule)
        assert cfg.parallel.strategy == par.strategy
        est = memfit.estimate(model, meta_batch(batch, cfg.micro_batch * cfg.accumulation),
                              device="cpu", optimizer="adamw", parallel=par, steps=2)
        stages = [e.peak_bytes for e in est.per_rank]
        assert len(stages) >= 2 and est.peak_bytes == max(stages)
        print(cfg.label(), cfg.parallel.describe(), c.peak_bytes, est.peak_bytes)
        assert c.peak_bytes == pytest.approx(est.peak_bytes, rel=0.005), cfg.label()


def test_pipeline_layouts_are_the_ones_apply_runs() -> None:
    """fit offers a pipeline beside DDP, ZeRO-1, FSDP (zero2 / zero3) and HSDP, the layouts
    apply_pipeline runs (test_pipeline_plan_trains_like_one_process; HSDP:
    tests/fitting/test_fit_pipeline_split.py), and with tp only FSDP stays beside the pipeline
    (DDP beside tp is refused; pp x HSDP x tp is left out with why)."""
    from memfit.fitting.apply_pipeline import _pipeline_parallel
    from memfit.fitting.layout_space import layouts
    from memfit.fitting.layouts import model_shape
    from memfit.fitting.search import per_rank_traced

    model, _ = tiny()
    shape = model_shape(model, SEQ)
    rejected: list[Any] = []
    found = layouts(gpus=8, gpus_per_node=4, global_batch=8, shape=shape,
                    space={"tp": [1], "pp": [2]}, rejected=rejected)
    one_f = [p for p in found if p.pp_schedule == "1f1b"]
    assert sorted(sharding_of(p) for p in one_f) == ["hsdp", "none", "zero1", "zero2", "zero3"]
    assert sorted(p.strategy for p in one_f) == ["ddp", "fsdp", "fsdp", "hsdp", "zero1"]
    # each with GPipe too; interleaved 1F1B needs 2 pp = 4 stages of the 2 blocks: not offered
    assert sorted(p.pp_schedule for p in found) == ["1f1b"] * 5 + ["gpipe"] * 5
    for par in found:  # traced per rank, and applied without a refusal
        assert per_rank_traced(par), par.describe()
        cfg = FitConfig(precision="fp32", micro_batch=1, accumulation=2,
                        sharding=sharding_of(par), parallel=par)
        assert _pipeline_parallel(cfg, None, None, "mean").pp == 2
    rejected = []
    with_tp = layouts(gpus=8, gpus_per_node=4, global_batch=8, shape=shape,
                      space={"tp": [2], "pp": [2]}, rejected=rejected)
    assert {p.strategy for p in with_tp} == {"fsdp"}
    assert any("beside HSDP without tp" in r.reason for r in rejected)
    four = layouts(gpus=2, gpus_per_node=None, global_batch=8,
                   shape=model_shape(tiny(4)[0], SEQ), space={"tp": [1], "pp": [2]},
                   rejected=[])
    assert sorted(p.pp_schedule for p in four) == ["1f1b", "gpipe", "interleaved-1f1b"]


def test_pipeline_schedules_searched_and_their_bubbles() -> None:
    """Note: [pipeline schedules] in memfit/fitting/layouts.py. GPipe is searched only below pp
    micro-batches (1F1B cannot run there; from pp on it has 1F1B's bubble and keeps every
    micro-batch's activations), interleaved 1F1B where pp divides them. The compute of a rank
    is stretched by the bubble, (p - 1) / m of the step under GPipe / 1F1B and (p - 1) / (v m)
    with v = 2 stages a rank (Narayanan et al. 2021, §2.2): p = 4, m = 4 gives 1 + 3/4 and
    1 + 3/8. The first rank's micro-batches in flight: GPipe every one (m), 1F1B min(p, m),
    interleaved (rank 0's warm-up forwards of torch's _get_warmup_ops, (v - 1) p + 2 (p - 1),
    plus one, over v): p = 4 gives (4 + 6 + 1) / 2 = 5.5."""
    from memfit.fitting.cost import cpu_rates, step_cost
    from memfit.fitting.layouts import pipeline_in_flight, schedule_searched

    def par(s: str) -> Parallel:
        return Parallel(gpus=4, pp=4, pp_schedule=s)

    assert [schedule_searched(par("gpipe"), n) for n in (2, 3, 4, 8)] == [True, True, False,
                                                                            False]
    assert [schedule_searched(par("interleaved-1f1b"), n) for n in (2, 4, 6, 8)] == [
        False, True, False, True]
    assert schedule_searched(par("1f1b"), 2)  # refused later, with its reason
    assert [pipeline_in_flight(par("gpipe"), n) for n in (2, 8)] == [2, 8]
    assert [pipeline_in_flight(par("1f1b"), n) for n in (2, 8)] == [2, 4]
    assert [pipeline_in_flight(par("interleaved-1f1b"), n) for n in (4, 8)] == [4, 5.5]
    rates = cpu_rates()

    def compute(s: str) -> float:
        return step_cost(rates, precision="fp32", micro_flops=1e9, accumulation=4,
                         activation_traffic_bytes=0, offloaded_bytes=0, ops_per_micro=0,
                         param_bytes=0, grad_bytes=0, state_bytes=0,
                         offload_activations=False, offload_states=False, sharding="none",
                         num_gpus=4, parallel=par(s)).compute_s

    base = 4 * 1e9 / rates.flops["fp32"] / 4  # each rank: 1/pp of 4 micro-batches' FLOPs
    assert compute("1f1b") == pytest.approx(base * (1 + 3 / 4))
    assert compute("gpipe") == pytest.approx(base * (1 + 3 / 4))
    assert compute("interleaved-1f1b") == pytest.approx(base * (1 + 3 / 8))


def test_zero1_states_are_traced_as_optimizer_states() -> None:
    """ZeRO-1 on 2 ranks (tiny_spec(2): 115,008 fp32 parameters in 21 tensors): the states of
    ``ZeroRedundancyOptimizer``'s local optimizer (``torch/distributed/optim/
    zero_redundancy_optimizer.py``: ``self.optim``, the rank's partition) are tagged optimizer
    states, so that fit's one traced CPU step adds them (Note: [one traced step on CPU] in
    memfit/fitting/traced.py). Over both ranks AdamW's exp_avg and exp_avg_sq of every
    parameter, once (2 x 4 bytes an element) and its 21 fp32 ``step`` scalars (4 bytes each;
    CPU: no rounding)."""
    import memfit
    from memfit._tensors import meta_batch
    from memfit.categories import MemoryCategory

    model, batch = tiny()
    assert sum(p.numel() for p in model.parameters()) == 115_008
    est = memfit.estimate(model, meta_batch(batch, 2), device="cpu", optimizer="adamw",
                          parallel=Parallel(gpus=2, zero=1), steps=1)
    states = [max(p.by_category()[MemoryCategory.OPTIMIZER_STATES] for p in e.timeline)
              for e in est.per_rank]
    assert len(states) == 2 and all(s > 0 for s in states)
    assert sum(states) == 2 * 4 * 115_008 + 4 * 21
