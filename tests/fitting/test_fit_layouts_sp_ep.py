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
MoE layer forward, their reverses backward. The parity tolerance is
tests/fitting/test_fit_parallel.py's (fp32 reordering, its module docstring).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from memfit.fitting import FitConfig
from memfit.fitting.config import sharding_of
from memfit.parallel import Parallel

SP_CASES = ({"tp": 2, "sp": True}, {"tp": 2, "sp": True, "loss_parallel": True})


def _sp_case(world: int, layout: dict[str, Any]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One SP layout on this rank: a fresh tiny Llama and batch (test_fit_parallel.tiny seeds
    both), two AdamW steps; the losses and full weights."""
    from test_fit_parallel import BATCH, _train, tiny

    par = Parallel(gpus=world, **layout)
    model, batch = tiny()
    cfg = FitConfig(precision="fp32", micro_batch=BATCH // 2, accumulation=2,
                    sharding=sharding_of(par), parallel=par)
    return _train(model, cfg, batch, world)


@pytest.mark.slow
def test_plan_apply_runs_sequence_and_loss_parallelism_like_one_process(gloo_runs: Any) -> None:
    """tp 2 + sequence parallelism and tp 2 + sequence + loss parallelism over 2 gloo ranks, two
    AdamW steps of 2 micro-batches each: the ranks' loss shares add up to the one-process loss
    and every rank's full weights equal the one-process weights (test_fit_parallel.py's
    tolerances). Loss parallelism runs the model's own cross-entropy on vocabulary-split logits
    inside ``loss_parallel()`` (Plan.apply's LossParallelStep)."""
    from test_fit_parallel import ATOL, RTOL, STEPS, _reference

    want_losses, want = _reference()
    for layout in SP_CASES:
        ranks = gloo_runs(2)[("sp", _key(layout))]
        for step in range(STEPS):
            got = sum(r[0][step] for r in ranks)
            assert got == pytest.approx(want_losses[step], rel=RTOL, abs=ATOL), layout
        for r in ranks:
            weights = r[1]
            assert set(weights) == set(want)
            for name, w in want.items():
                torch.testing.assert_close(weights[name], w, rtol=RTOL, atol=ATOL)


# -- expert parallelism under Plan.apply ---------------------------------------------------------

EP_BATCH, EP_SEQ = 4, 16
EP_CASES = {2: ({"ep": 2}, {"ep": 2, "zero": 3}), 4: ({"ep": 2, "zero": 3},)}
"""By world: over 2 ranks ep = dp, the experts on one rank each, outside DDP / FSDP2; over 4,
each rank's experts FSDP2-sharded over the 2 ranks that hold them (the "efsdp" mesh dim)."""


def _moe() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """memfit's tiny MoE decoder (4 experts, top 2, capacity factor 1.0) and a fixed batch."""
    from memfit.models.build import build_model
    from memfit.parallel.measure import tiny_moe_spec

    spec = tiny_moe_spec()
    torch.manual_seed(0)
    model = build_model(spec, backend="builtin", device="cpu")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, spec.vocab_size, (EP_BATCH, EP_SEQ), generator=g)
    labels = torch.randint(0, spec.vocab_size, (EP_BATCH, EP_SEQ), generator=g)
    return model, {"input_ids": ids, "labels": labels}


def _sgd_steps(model: torch.nn.Module, cfg: FitConfig, batch: dict[str, torch.Tensor],
               world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Two SGD steps of the plan; returns the losses and each weight's change (full tensors)."""
    import warnings

    from memfit.fitting.apply import apply_config
    from memfit.oom_guard import causal_lm_count

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _, step = apply_config(model, cfg, num_gpus=world, log_recoveries=False,
                                      count_fn=causal_lm_count)
        losses = [float(step(batch)) for _ in range(2)]
    inner = getattr(model, "module", model)
    after = {}
    for name, p in inner.named_parameters():
        full = p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()
        after[name] = full.clone()
    return losses, after | {f"{n}:before": w for n, w in before.items()}


def _ep_case(rank: int, world: int, layout: dict[str, Any]
             ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One EP layout on this rank: a fresh tiny MoE and batch (``_moe`` seeds both), its rows of
    the batch, two SGD steps (``_sgd_steps``)."""
    par = Parallel(gpus=world, **layout)
    model, batch = _moe()
    per = EP_BATCH // par.dp
    mine = {k: v[rank * per:(rank + 1) * per] for k, v in batch.items()}
    cfg = FitConfig(precision="fp32", micro_batch=1, accumulation=per, optimizer="sgd",
                    sharding=sharding_of(par), parallel=par)
    return _sgd_steps(model, cfg, mine, world)


# -- one set of gloo ranks per world size for both parity tests ----------------------------------

def _key(layout: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(layout.items()))


def _jobs(world: int) -> list[tuple[str, dict[str, Any]]]:
    """What one set of ``world`` ranks runs: the SP layouts (2 ranks) and EP_CASES[world]."""
    return ([("sp", layout) for layout in SP_CASES] if world == 2 else []) + [
        ("ep", layout) for layout in EP_CASES[world]]


def _worker(rank: int, world: int, out: str) -> None:
    """Each job of ``_jobs(world)`` in turn in this one set of ranks (a set costs each rank a
    fresh interpreter importing torch): a fresh model, batch and plan per job, so that one job's
    run cannot feed the next's."""
    for i, (kind, layout) in enumerate(_jobs(world)):
        result = _sp_case(world, layout) if kind == "sp" else _ep_case(rank, world, layout)
        torch.save(result, Path(out, f"{i}-rank{rank}.pt"))


@pytest.fixture(scope="module")
def gloo_runs() -> Callable[[int], dict[tuple[str, str], list[Any]]]:
    """``gloo_runs(world)``: every job of ``_jobs(world)`` run once in one set of ``world``
    ranks (started at the first test that asks for that world); per (kind, layout key), each
    rank's result."""
    from memfit.parallel.gloo import spawn

    runs: dict[int, dict[tuple[str, str], list[Any]]] = {}

    def get(world: int) -> dict[tuple[str, str], list[Any]]:
        if world not in runs:
            jobs = _jobs(world)
            with tempfile.TemporaryDirectory() as out:
                spawn(_worker, world, out, start_method="forkserver")  # parity, no peak
                runs[world] = {(kind, _key(layout)): [torch.load(Path(out, f"{i}-rank{r}.pt"))
                                                      for r in range(world)]
                               for i, (kind, layout) in enumerate(jobs)}
        return runs[world]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4], ids=["ep2-over-2", "ep2-fsdp4"])
def test_plan_apply_runs_expert_parallelism_like_one_process(world: int, gloo_runs: Any
                                                             ) -> None:
    """ep 2 over 2 gloo ranks, with DDP and with FSDP2 for the dense parameters, and over 4
    ranks with FSDP2 (each rank's experts sharded over the 2 ranks holding them), two SGD steps
    of micro-batch 1: the ranks' loss shares add up to the one-process loss (the same
    micro-batches, so the same expert capacities and routing), and each rank's experts (its
    share of each layer's stacked weights) and every dense weight change as in one process.
    SGD, not AdamW: AdamW divides each gradient by its own magnitude and would hide an expert
    gradient scaled by the ranks (Note: [expert gradients] in memfit/fitting/apply.py:
    torchtitan's divide factor, the data-parallel degree); the weight changes (lr 1e-2 times
    the gradient) are compared within rtol 1e-4 (fp32 reordering of sums of ~1e-3
    gradients)."""
    model, batch = _moe()
    ref_cfg = FitConfig(precision="fp32", micro_batch=1, accumulation=EP_BATCH, optimizer="sgd")
    want_losses, want = _sgd_steps(model, ref_cfg, batch, 1)
    for layout in EP_CASES[world]:
        ranks = gloo_runs(world)[("ep", _key(layout))]
        for step in range(2):
            got = sum(r[0][step] for r in ranks)
            assert got == pytest.approx(want_losses[step], rel=1e-5), layout
        for rank, r in enumerate(ranks):
            weights = r[1]
            checked = 0
            for name, w in weights.items():
                if name.endswith(":before"):
                    continue
                whole = name.replace(".experts.", ".")
                ref, ref0 = want[whole], want[f"{whole}:before"]
                if ".experts." in name:  # its expert group index's experts (ep innermost)
                    local, index = w.shape[0], rank % layout["ep"]
                    ref, ref0 = (t[index * local:(index + 1) * local] for t in (ref, ref0))
                torch.testing.assert_close(w - weights[f"{name}:before"] if
                                           f"{name}:before" in weights else w - ref0,
                                           ref - ref0, rtol=1e-4, atol=1e-8)
                checked += 1
            assert checked == len(want) // 2, layout


# -- the search offers and chooses them ----------------------------------------------------------

FIXED = {"precision": ["fp32"], "checkpointing": ["none"], "optimizer": ["adamw"],
         "chunked_loss": [False]}


def _meta(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v, device="meta") for k, v in batch.items()}


def _decoder(seq: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    from memfit.models.build import build_model
    from memfit.parallel.measure import tiny_spec

    torch.manual_seed(0)
    model = build_model(tiny_spec(), backend="builtin", device="cpu")
    ids = torch.zeros(4, seq, dtype=torch.long)
    return model, {"input_ids": ids, "labels": ids}


def test_layouts_offer_sp_and_loss_parallel_variants_of_each_tp_layout() -> None:
    """Each tp > 1 layout of the builtin decoder comes plain, with sp, and with sp + loss
    parallelism (not under a pipeline, where Plan.apply refuses loss parallelism); a model
    tying its head to its embedding (which tp_plan cannot split two ways) gets plain tp only."""
    import dataclasses

    from memfit.fitting.layout_space import layouts
    from memfit.fitting.layouts import model_shape
    from memfit.models.build import build_model
    from memfit.parallel.measure import tiny_spec

    model, _ = _decoder(16)
    found = layouts(gpus=4, gpus_per_node=None, global_batch=8, shape=model_shape(model, 16),
                    space={}, rejected=[])
    tp_layouts = [p for p in found if p.tp > 1 and not p.sp]
    assert tp_layouts
    for par in tp_layouts:
        assert dataclasses.replace(par, sp=True) in found
        assert (dataclasses.replace(par, sp=True, loss_parallel=True) in found) == (par.pp == 1)
    assert not any(p.loss_parallel and not p.sp for p in found)
    tied = build_model(dataclasses.replace(tiny_spec(), tie_embeddings=True), backend="builtin",
                       device="meta")
    found = layouts(gpus=4, gpus_per_node=None, global_batch=8, shape=model_shape(tied, 16),
                    space={}, rejected=[])
    assert any(p.tp > 1 for p in found) and not any(p.sp or p.loss_parallel for p in found)


def test_search_chooses_sequence_parallelism_when_plain_tp_does_not_fit() -> None:
    """tp 2 on 2 GPUs (dp 1), micro-batch 4 x 64 tokens, fp32, AdamW. The budget is set from
    independent per-rank traces of the three tp 2 layouts (memfit.estimate(parallel=...), two
    steps): between tp 2 + sp + loss parallel's peak and tp 2 + sp's, only the first fits and is
    chosen; between tp 2 + sp's and plain tp 2's, both sp layouts fit and the search picks one
    of them (plain tp, faster, is rejected over budget). The chosen peak is the worst rank's
    traced peak (0.5%: the search traces one step on the CPU and adds the states)."""
    import memfit

    model, batch = _decoder(64)
    peaks = {}
    for kw in ({}, {"sp": True}, {"sp": True, "loss_parallel": True}):
        par = Parallel(gpus=2, tp=2, **kw)
        peaks[(par.sp, par.loss_parallel)] = memfit.estimate(
            model, _meta(batch), device="cpu", optimizer="adamw", parallel=par,
            steps=2).peak_bytes
    plain, sp, lp = peaks[(False, False)], peaks[(True, False)], peaks[(True, True)]
    assert lp < sp < plain  # logits split < gathered; Korthikanti Eq. 4 < Eq. 2
    space = FIXED | {"micro_batch": [4], "tp": [2]}
    for budget, want in (((lp + sp) // 2, {(True, True)}),
                         ((sp + plain) // 2, {(True, True), (True, False)})):
        plan = memfit.fit(model, batch, global_batch=4, budget_bytes=budget, device="cpu",
                          gpus=2, headroom=0.0, progress=False, space=space)
        par = plan.chosen.config.parallel
        assert par is not None and (par.sp, par.loss_parallel) in want, par.describe()
        assert plan.chosen.per_rank
        assert plan.chosen.peak_bytes == pytest.approx(peaks[(par.sp, par.loss_parallel)],
                                                       rel=0.005)
        assert any(r.what.endswith("adamw, tp 2") for r in plan.rejected)


def test_search_traces_expert_parallel_layouts_per_rank() -> None:
    """The builtin MoE (4 experts) on 2 GPUs: the search offers ep 2 with DDP and with FSDP2
    (ZeRO-2/3), traces each per rank, and each candidate's peak is the worst rank of an
    independent memfit.estimate(..., parallel=Parallel(gpus=2, ep=2, ...)) of the same step
    (0.5%); its communication includes the all-to-alls (more than the same layout without ep
    for FSDP2, whose collectives otherwise match)."""
    import memfit
    from memfit.fitting.config import layout_label

    model, batch = _moe()
    # Rates pinned (about what this 2-core Xeon measures): which 10 candidates are listed, and
    # the comm comparison below (latency against bytes), must not follow the machine's load.
    plan = memfit.fit(model, batch, global_batch=4, budget_bytes=2**30, device="cpu", gpus=2,
                      headroom=0.0, progress=False, top=10,
                      rates={"flops": 1e11, "bandwidth": 3e10, "launch_s": 6e-6},
                      space=FIXED | {"micro_batch": [2], "tp": [1], "pp": [1]})
    cands = [plan.chosen, *plan.runners_up]
    by_label = {layout_label(c.config.parallel): c for c in cands}
    assert {"ep 2, ddp x2", "ep 2, zero2 x2", "ep 2, fsdp x2"} <= set(by_label)
    for label in ("ep 2, ddp x2", "ep 2, zero2 x2", "ep 2, fsdp x2"):
        c = by_label[label]
        assert c.per_rank
        est = memfit.estimate(model, _meta({k: v[:2] for k, v in batch.items()}), device="cpu",
                              optimizer="adamw", parallel=c.config.parallel, steps=2)
        assert c.peak_bytes == pytest.approx(est.peak_bytes, rel=0.005), label
    assert by_label["ep 2, fsdp x2"].cost.comm_s > by_label["fsdp x2"].cost.comm_s


def test_layout_comm_of_sp_loss_parallel_and_ep_from_first_principles() -> None:
    """One micro-batch, tp 2 on one node (450 GB/s), a block input of B bytes over L blocks:
    plain tp 4 all-reduces of 2 (t-1)/t B per block; sp adds the embedding's reduce-scatter and
    all-gather and the head's all-gather and reduce-scatter, (t-1)/t B each, and the logits'
    all-gather, (t-1)/t of them; loss parallelism replaces that with three fp32 all-reduces per
    token. ep 2 over 2 ranks: 4 all-to-alls per MoE layer of (ep-1)/ep of the buffers, and the
    experts leave the gradient all-reduce (ep = dp)."""
    from memfit.fitting.cost import Rates, layout_comm

    link = 450e9
    rates = Rates(flops={"fp32": 1e12}, bandwidth=1e12, host_link=25e9, gpu_link=link,
                  launch_s=0.0, source="test")
    b, layers, logits, tokens = 10**6, 3, 8 * 10**6, 1000

    def comm(par: Parallel, **kw: Any) -> float:
        return layout_comm(rates, par, sharding="none", param_bytes=0, grad_bytes=0,
                           boundary_bytes=b, layers=layers, accumulation=1, logits_bytes=logits,
                           tokens=tokens, **kw)

    blocks = layers * 4 * 2 * 0.5 * b / link
    assert comm(Parallel(gpus=2, tp=2)) == pytest.approx(blocks)
    assert comm(Parallel(gpus=2, tp=2, sp=True)) == pytest.approx(
        blocks + (4 * 0.5 * b + 0.5 * logits) / link)
    assert comm(Parallel(gpus=2, tp=2, sp=True, loss_parallel=True)) == pytest.approx(
        blocks + (4 * 0.5 * b + 3 * 2 * 0.5 * 4 * tokens) / link)
    g, exchange = 4 * 10**9, 2 * 10**6
    ep = layout_comm(rates, Parallel(gpus=2, ep=2), sharding="none", param_bytes=0,
                     grad_bytes=g, boundary_bytes=0, layers=2, accumulation=1, moe_layers=2,
                     exchange_bytes=exchange, expert_share=0.75)
    assert ep == pytest.approx(2 * 0.5 * 0.25 * g / link + 4 * 2 * 0.5 * exchange / link)


def test_derived_tp_peaks_follow_the_per_rank_trace() -> None:
    """The formulas that rank the tp 2 layouts before their per-rank traces (derive.py:
    derive_layout with layouts.activation_factor; sp: Korthikanti's Eq. 4 less the inputs
    DTensor's column-parallel projections save all-gathered, (30/t + 4)/34 = 19/34 at t = 2,
    and the embedding and head split; without loss parallelism the logits whole) against the
    per-rank trace of the same step: the tiny decoder, fp32, micro-batch 4 x 64 tokens, within
    8% (measured 4.2-5.5% under on every one; derived peaks under the truth get traced, never
    wrongly rejected)."""
    from memfit.fitting.layouts import activation_factor
    from memfit.fitting.search import Search

    assert activation_factor(2, eager=False, shape=None, sp=True) == pytest.approx(19 / 34)
    model, batch = _decoder(64)
    search = Search(model, batch, optimizer="adamw", global_batch=4, gpu=None,
                    budget_bytes=2**30, device="cpu", loss_fn=None, reduction="mean",
                    count_fn=None, num_gpus=1, measure=False,
                    space={"precision": ["fp32"], "tp": [2], "pp": [1]}, progress=False,
                    top=5, headroom=0.0, gpus=2)
    one_gpu = search.trace(("fp32", "none", "adamw", False, "model"), 4)
    assert not isinstance(one_gpu, str)
    kinds = set()
    for par in search.layouts or []:
        derived = search.derive(one_gpu, 4, 4, False, False, "none", par, 4, "model")
        traced = search.rank_trace(FitConfig(precision="fp32", micro_batch=4, parallel=par))
        assert traced is not None and not isinstance(traced, str)
        assert derived == pytest.approx(traced.peak, rel=0.08), par.describe()
        kinds.add((par.sp, par.loss_parallel))
    assert kinds == {(False, False), (True, False), (True, True)}
