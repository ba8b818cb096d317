"""memfit.fit over multi-GPU layouts (``gpus=N``) and Plan.apply of a layout under real gloo
processes.

Parity tolerance (the slow tests): fp32, the loss within ``rtol=1e-5`` and every weight after two
AdamW steps within ``rtol=1e-5, atol=5e-5`` (5% of one AdamW step, lr 1e-3). The sharded and split
steps compute the same sums in another order: DDP / FSDP2 / ZeRO-1 average the ranks' gradients
after each rank summed its half of the batch (gloo's all-reduce / reduce-scatter adds the
halves), and tensor parallelism's row-parallel projections add partial matmuls over the split
input features (``RowwiseParallel``'s all-reduce). A reordered fp32 sum differs by a few ulps
(2**-23 ~ 1.2e-7 relative each), and the loss agrees to that. AdamW then divides each gradient by
its running magnitude: a weight whose two steps' gradients nearly cancel magnifies that rounding
in its update. Measured (this machine; 2 ranks, 4 for fsdp 2 x tp 2; 115,008 weights per rank):
one weight per rank moves 6.6e-6 off the one-process run under DDP, ZeRO-1 and FSDP2, three per
rank under TP (worst 1.3e-5) and under fsdp 2 x tp 2 (worst 9.8e-6); every other weight is within
1e-6. A gradient whose sign flipped from rounding would move a weight by
up to 2 lr = 2e-3, which the tolerance catches.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

import memfit
from memfit.cli import main
from memfit.errors import MemfitError
from memfit.fitting import FitConfig, Plan
from memfit.fitting.config import sharding_of
from memfit.fitting.cost import INTER_NODE_GBPS, Rates, layout_comm
from memfit.fitting.layout_space import layouts
from memfit.fitting.layouts import activation_factor, model_shape
from memfit.parallel import Parallel
from memfit.parallel.measure import tiny_spec

BATCH, SEQ, STEPS = 4, 16, 2
RTOL, ATOL = 1e-5, 5e-5
"""fp32 tolerances of the parity tests (module docstring): ``ATOL`` is 5% of one AdamW step
(lr 1e-3)."""


def tiny() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The 2-block tiny Llama (hidden 64, 4 heads) with fixed weights, and a fixed batch."""
    from memfit.models.build import build_model

    spec = tiny_spec()
    torch.manual_seed(0)
    model = build_model(spec, backend="builtin", device="cpu")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, spec.vocab_size, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, spec.vocab_size, (BATCH, SEQ), generator=g)
    return model, {"input_ids": ids, "labels": labels}


# -- layouts and bad input ------------------------------------------------------------------------

def test_layouts_of_8_gpus_on_two_nodes() -> None:
    """tp runs over the divisors of the 4 heads within a 4-GPU node; every (tp, pp) gets the five
    data-parallel strategies where dp > 1 (HSDP only across nodes: shard group = node / (tp pp))."""
    model, _ = tiny()
    shape = model_shape(model, SEQ)
    found = layouts(gpus=8, gpus_per_node=4, global_batch=8, shape=shape, space={},
                    rejected=[])
    pairs = {(p.tp, p.pp) for p in found}
    # tp in {1, 2, 4} (divides 4 heads, <= 4 per node); pp in {1, 2} (2 blocks).
    assert pairs == {(t, p) for t in (1, 2, 4) for p in (1, 2)}
    tp1 = [p for p in found if (p.tp, p.pp) == (1, 1)]
    assert sorted(sharding_of(p) for p in tp1) == ["hsdp", "none", "zero1", "zero2", "zero3"]
    hsdp = next(p for p in tp1 if p.strategy == "hsdp")
    assert (hsdp.fsdp, hsdp.replicate) == (4, 2)


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"gpus": 8, "gpus_per_node": 3}, "gpus_per_node=3 must be a positive integer dividing"),
    ({"gpus": 8, "gpus_per_node": 4, "space": {"tp": [8]}}, "beyond a node of 4 GPUs"),
    ({"gpus": 6, "space": {"tp": [4]}}, "tp=4 does not divide gpus=6"),
    ({"gpus": 8, "space": {"tp": [2], "pp": [3]}}, "pp=3 does not divide gpus=8"),
    ({"gpus": 4, "num_gpus": 4}, "not both"),
    ({"gpus_per_node": 4}, "gpus_per_node needs gpus=N"),
])
def test_bad_layout_input_is_one_line(kwargs: dict[str, Any], words: str) -> None:
    model, batch = tiny()
    with pytest.raises(MemfitError, match=words) as info:
        memfit.fit(model, batch, global_batch=8, budget_bytes=2**30, device="cpu",
                   progress=False, **kwargs)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("argv", "words"), [
    (["--gpus", "8", "--gpus-per-node", "3"], "gpus_per_node=3"),
    (["--gpus", "8", "--gpus-per-node", "4", "--tp", "8"], "beyond a node"),
    (["--gpus", "6", "--tp", "4"], "not divisible by tp x pp = 4"),
])
def test_cli_bad_layout_exits_2_with_one_line(capsys: Any, argv: list[str], words: str) -> None:
    code = main(["fit", "llama-3.2-1b", "--gpu", "h100-80gb", "--global-batch", "48", "--seq",
                 "128", "--quiet", *argv])
    err = capsys.readouterr().err
    assert code == 2 and words in err and err.strip().count("\n") == 0, err


def test_activation_factor_is_korthikantis() -> None:
    """Korthikanti et al. 2022: per layer sbh(10 + 24/t) with flash attention against 34 sbh;
    t = 2 keeps 22/34 of the activations."""
    assert activation_factor(2, eager=False, shape=None) == pytest.approx(22 / 34)
    assert activation_factor(1, eager=True, shape=None) == 1.0


def test_layout_communication_from_first_principles() -> None:
    """Ring all-reduce of G gradient bytes over 8 ranks in a node: 2 * 7/8 * G at the GPU link;
    FSDP adds the parameters' all-gather in forward and backward, 2 * 7/8 * P (nothing hidden
    with no compute to hide under); across two 4-GPU nodes the ring runs at
    the inter-node rate (50 GB/s per GPU: one 400 Gb/s port per GPU)."""
    rates = Rates(flops={"fp32": 1e12}, bandwidth=1e12, host_link=25e9, gpu_link=450e9,
                  launch_s=0.0, source="test")
    g, p = 8 * 10**9, 4 * 10**9
    ddp = layout_comm(rates, Parallel(gpus=8), sharding="none", param_bytes=p, grad_bytes=g,
                      boundary_bytes=0, layers=1, accumulation=1)
    assert ddp == pytest.approx(2 * 7 / 8 * g / 450e9)
    fsdp = layout_comm(rates, Parallel(gpus=8, zero=3), sharding="zero3", param_bytes=p,
                       grad_bytes=g, boundary_bytes=0, layers=1, accumulation=1)
    assert fsdp == pytest.approx(2 * 7 / 8 * (g + p) / 450e9)
    # The gradients' reduction hides under the last micro-batch's backward (2/3 of its
    # compute): with 2 micro-batches of 0.03 s each, 0.02 s of it.
    hidden = layout_comm(rates, Parallel(gpus=8), sharding="none", param_bytes=p, grad_bytes=g,
                         boundary_bytes=0, layers=1, accumulation=2, compute_s=0.06)
    assert hidden == pytest.approx(2 * 7 / 8 * g / 450e9 - 2 / 3 * 0.03)
    # ZeRO-1 then broadcasts the updated parameters, (dp-1)/dp of them, after the step.
    zero1 = layout_comm(rates, Parallel(gpus=8, zero=1), sharding="zero1", param_bytes=p,
                        grad_bytes=g, boundary_bytes=0, layers=1, accumulation=1)
    assert zero1 == pytest.approx(2 * 7 / 8 * g / 450e9 + 7 / 8 * p / 450e9)
    two_nodes = layout_comm(rates, Parallel(gpus=8, gpus_per_node=4), sharding="none",
                            param_bytes=p, grad_bytes=g, boundary_bytes=0, layers=1,
                            accumulation=1)
    assert two_nodes == pytest.approx(2 * 7 / 8 * g / (INTER_NODE_GBPS * 1e9))
    # tp 2 inside a node: 4 all-reduces of the block input per block and micro-batch.
    tp = layout_comm(rates, Parallel(gpus=2, tp=2), sharding="none", param_bytes=p,
                     grad_bytes=g, boundary_bytes=10**6, layers=3, accumulation=2)
    assert tp == pytest.approx(2 * 3 * 4 * 2 * (1 / 2) * 10**6 / 450e9)


# -- the search --------------------------------------------------------------------------------

def test_search_records_a_parallel_and_traces_the_winners_per_rank(tmp_path: Path) -> None:
    """The chosen layout is a memfit.Parallel; a data-parallel winner's peak is the worst rank of
    memfit.estimate(..., parallel=...) for the same step, not the formulas' derivation."""
    model, batch = tiny()
    plan = memfit.fit(model, batch, global_batch=8, budget_bytes=64 * 2**20, device="cpu",
                      gpus=2, progress=False, space={"precision": ["fp32"],
                                                     "checkpointing": ["none"]})
    par = plan.parallel
    assert isinstance(par, Parallel) and par.gpus == 2
    chosen = plan.chosen
    assert chosen.per_rank
    cfg = chosen.config
    from memfit._tensors import meta_batch

    # Two steps: the second holds the optimizer states through forward and backward (the
    # search traces one step on the CPU and adds them, Note: [one traced step on CPU]).
    est = memfit.estimate(model, meta_batch(batch, cfg.micro_batch), device="cpu",
                          optimizer="adamw", parallel=par, steps=2)
    assert cfg.accumulation == 1  # the whole per-rank batch fits in 64 MiB
    assert chosen.peak_bytes == pytest.approx(est.peak_bytes, rel=0.005)
    assert len(est.per_rank) >= 1
    # The plan file keeps the layout.
    plan.save(tmp_path / "plan.json")
    again = Plan.load(tmp_path / "plan.json")
    assert again.parallel == par and again == plan
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["chosen"]["config"]["parallel"]["tp"] == par.tp


def test_export_reads_the_layout() -> None:
    """An HSDP x tp plan exports its sizes (the exporter's reader: memfit.export.settings)."""
    from memfit.export.settings import settings_from_plan
    from memfit.fitting import Candidate, StepCost

    par = Parallel(gpus=16, gpus_per_node=8, tp=2, fsdp=4)
    cfg = FitConfig(precision="bf16-mixed", micro_batch=2, accumulation=2, sharding="hsdp",
                    parallel=par)
    cost = StepCost(compute_s=1, traffic_s=0, transfer_s=0, comm_s=0, dispatch_s=0,
                    optimizer_s=0)
    plan = Plan(chosen=Candidate(config=cfg, peak_bytes=1, cost=cost), runners_up=(),
                rejected=(), budget_bytes=2, global_batch=2 * 2 * 8, num_gpus=16,
                device="cuda", gpu="h100-80gb", rates_source="test")
    s = settings_from_plan(plan)
    assert s.parallel == par
    assert (s.parallel.gpus, s.parallel.tp, s.parallel.pp, s.parallel.dp, s.zero, s.replicate,
            s.gpus_per_node) == (
        16, 2, 1, 8, 3, 2, 8)
    assert s.unknown == {}
    assert Plan.from_dict(plan.to_dict()).parallel == par


def test_sharding_must_match_the_layout() -> None:
    with pytest.raises(MemfitError, match="sharding='zero1' but the layout"):
        FitConfig(sharding="zero1", parallel=Parallel(gpus=4, zero=3))


# -- Plan.apply under gloo ----------------------------------------------------------------------

def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _train(model: torch.nn.Module, cfg: FitConfig, batch: dict[str, torch.Tensor],
           world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    import warnings

    from memfit.fitting.apply import apply_config
    from memfit.oom_guard import causal_lm_count

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _, step = apply_config(model, cfg, num_gpus=world, log_recoveries=False,
                                      count_fn=causal_lm_count)
        losses = [float(step(batch)) for _ in range(STEPS)]
    inner = getattr(model, "module", model)  # DDP wraps; FSDP2 and TP change in place
    return losses, {n: _full(p.detach()).clone() for n, p in inner.named_parameters()}


def _worker(rank: int, world: int, layouts: list[dict[str, Any]], out: str) -> None:
    """Each layout in turn in this one set of ranks (a set costs each rank a fresh interpreter
    importing torch): a fresh model, batch and plan per layout, so that one layout's run cannot
    feed the next's."""
    for i, layout in enumerate(layouts):
        par = Parallel(gpus=world, **layout)
        model, batch = tiny()
        # Each data-parallel rank takes its rows; the ranks of a tensor-parallel group the same.
        per = BATCH // par.dp
        dp_rank = rank // par.tp
        mine = {k: v[dp_rank * per:(dp_rank + 1) * per] for k, v in batch.items()}
        cfg = FitConfig(precision="fp32", micro_batch=max(1, per // 2),
                        accumulation=per // max(1, per // 2), sharding=sharding_of(par),
                        parallel=par)
        losses, weights = _train(model, cfg, mine, world)
        torch.save({"losses": losses, "weights": weights}, Path(out, f"{i}-rank{rank}.pt"))


def _run(layouts: list[dict[str, Any]], world: int) -> list[list[dict[str, Any]]]:
    """Per layout, each rank's losses and full weights."""
    from memfit.parallel.gloo import spawn

    with tempfile.TemporaryDirectory() as out:
        spawn(_worker, world, layouts, out, start_method="forkserver")  # no peak: parity
        return [[torch.load(Path(out, f"{i}-rank{r}.pt")) for r in range(world)]
                for i in range(len(layouts))]


LAYOUTS: dict[str, tuple[dict[str, Any], int]] = {
    "fsdp2": ({"fsdp": 2}, 2), "tp2": ({"tp": 2}, 2), "ddp2": ({}, 2), "zero1": ({"zero": 1}, 2),
    "fsdp2xtp2": ({"tp": 2, "fsdp": 2}, 4)}


@pytest.fixture(scope="module")
def gloo_runs() -> dict[str, list[dict[str, Any]]]:
    """Every layout of LAYOUTS run once, in one set of ranks per world size."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for world in sorted({w for _, w in LAYOUTS.values()}):
        names = [n for n, (_, w) in LAYOUTS.items() if w == world]
        runs.update(zip(names, _run([LAYOUTS[n][0] for n in names], world), strict=True))
    return runs


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model, batch = tiny()
    cfg = FitConfig(precision="fp32", micro_batch=BATCH, accumulation=1)
    return _train(model, cfg, batch, 1)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_plan_apply_trains_like_one_process(name: str, gloo_runs: dict) -> None:
    """Two AdamW steps of the plan's layout over gloo ranks give the one-process run's loss and
    weights within fp32 reordering (module docstring); every rank holds the same full weights."""
    layout = LAYOUTS[name][0]
    want_losses, want = _reference()
    ranks = gloo_runs[name]
    for step in range(STEPS):
        # The step returns this rank's share of the batch's mean loss: memfit.oom_guard counts
        # the items over every rank (memfit/_guard_dist.py: global_item_count), the ranks of a
        # tensor-parallel group counting their shared rows once each, so the ranks' losses add
        # up to the batch's mean.
        got = sum(r["losses"][step] for r in ranks)
        assert got == pytest.approx(want_losses[step], rel=RTOL, abs=ATOL)
    worst, beyond, total = 0.0, 0, 0
    for r in ranks:
        assert set(r["weights"]) == set(want)
        for key, w in want.items():
            torch.testing.assert_close(r["weights"][key], w, rtol=RTOL, atol=ATOL)
            diff = (r["weights"][key] - w).abs()
            worst = max(worst, float(diff.max()))
            beyond += int((diff > 1e-6).sum())
            total += diff.numel()
    print(f"{layout or 'ddp'}: worst weight difference {worst:.3g}; {beyond} of {total} "
          "elements (all ranks) beyond 1e-6")
    assert worst < 1e-3  # no AdamW sign flip (2 lr = 2e-3)


def test_apply_needs_torchrun_and_names_what_it_cannot_run_yet() -> None:
    """Without torch.distributed: how to start the ranks. A pipeline beside HSDP and tp, which
    Plan.apply does not run (pipelines run alone, with tp and FSDP2, and with DDP, ZeRO-1, FSDP2
    or HSDP without tp: tests/fitting/test_fit_pipeline.py, test_fit_pipeline_split.py): one
    line saying so and the way out (over a fake 16-rank process group,
    memfit/parallel/trace.py: fake_world)."""
    from memfit.fitting.apply import apply_config
    from memfit.parallel.trace import fake_world

    par = Parallel(gpus=16, pp=2, tp=2, fsdp=2)  # dp 4: 2 replicas of 2 shards (HSDP), tp 2
    cfg = FitConfig(micro_batch=1, accumulation=2, sharding="hsdp", parallel=par)
    model, _ = tiny()
    with pytest.raises(MemfitError, match="torchrun --nproc-per-node 16") as info:
        apply_config(model, cfg, num_gpus=16)
    assert "\n" not in str(info.value)
    with fake_world(16, 0), pytest.raises(MemfitError, match="cannot run this pipeline plan") \
            as info:
        apply_config(model, cfg, num_gpus=16)
    assert "\n" not in str(info.value) and "fsdp = gpus / (pp * tp)" in str(info.value)


def test_cli_fit_over_gpus_saves_the_layout(tmp_path: Path, monkeypatch: Any,
                                            capsys: Any) -> None:
    (tmp_path / "tinyfactory.py").write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from test_fit_parallel import tiny\n"
        "def make():\n"
        "    return tiny()\n")
    monkeypatch.chdir(tmp_path)
    code = main(["fit", "tinyfactory:make", "--budget", "64MiB", "--device", "cpu",
                 "--global-batch", "8", "--gpus", "2", "--tp", "1", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    chosen = out["chosen"]
    assert chosen["config"]["parallel"]["tp"] == 1 and out["num_gpus"] == 2
    assert chosen["per_rank"] is True  # a data-parallel layout: traced rank by rank
    assert chosen["config"]["micro_batch"] * chosen["config"]["accumulation"] * 2 == 8


def test_derived_layout_peaks_follow_the_per_rank_trace() -> None:
    """The formulas that rank layouts before any per-rank trace (derive.py: derive_layout)
    against the per-rank trace of the same step (PyTorch's DDP / ZeroRedundancyOptimizer /
    FSDP2 on the fake model): fp32, 4 ranks, micro-batch 2, within 3%. Without the engines'
    buffers (DDP's buckets, FSDP2's gathered units) they were 19-52% under."""
    from memfit.fitting.search import Search, per_rank_traced

    model, batch = tiny()
    search = Search(model, batch, optimizer="adamw", global_batch=8, gpu=None,
                    budget_bytes=2**30, device="cpu", loss_fn=None, reduction="mean",
                    count_fn=None, num_gpus=1, measure=False, space={"precision": ["fp32"]},
                    progress=False, top=5, headroom=None, gpus=4)
    m = 2
    one_gpu = search.trace(("fp32", "none", "adamw", False, "model"), m)
    assert not isinstance(one_gpu, str)
    checked = set()
    for par in search.layouts or []:
        if par.dp != 4 or not per_rank_traced(par):
            continue
        shard = sharding_of(par)
        derived = search.derive(one_gpu, m, m, False, False, shard, par, 2, "model")
        cfg = FitConfig(precision="fp32", micro_batch=m, sharding=shard, parallel=par)
        traced = search.rank_trace(cfg)
        assert traced is not None and not isinstance(traced, str)
        assert derived == pytest.approx(traced.peak, rel=0.03), par.describe()
        checked.add(shard)
    assert checked == {"none", "zero1", "zero2", "zero3"}
