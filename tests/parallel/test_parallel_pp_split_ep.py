"""Expert parallelism beside a named pipeline split (``Parallel(pp=2, ep=2, pp_split_points=
...)``, memfit/parallel/pipeline_split.py + pipeline_parallelize.py: apply_ep_stages), and
transformers' MoE models (Mixtral, Qwen3-MoE) under pp x ep, split where their config's
``base_model_pp_plan`` says or at named points.

The custom model (tests/_models.py: CustomMoE) has names in none of memfit's lists (``tok``,
``blocks``, ``ln_f``, ``out``; blocks of ``ln`` and ``moe``, the MoE being memfit's builtin
capacity-dispatch layer). The truth is a real run: one gloo process per rank (4: 2 stages x 2
expert-parallel ranks) running the same stages, expert exchange and
``torch.distributed.pipelining`` schedule under the profiler (memfit/parallel/measure.py); the
weights each rank drops are counted by hand.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import memfit
from _models import CustomMoE
from _pipeline import per_rank
from memfit.categories import MemoryCategory
from memfit.models.build import example_inputs
from memfit.parallel import Parallel
from memfit.parallel.measure import Case, build, tiny_moe_spec
from memfit.recipe import Recipe

pytest.importorskip("transformers")

SEQ, VOCAB, D, LAYERS, EXPERTS = 32, 256, 64, 4, 4
"""tests/_models.py's CustomMoE: hidden 64, 4 blocks of 4 experts, vocabulary 256."""
BATCH = 8
"""2 samples in each of the 4 micro-batches."""


def make_custom() -> tuple[nn.Module, object]:
    """The measurement's model and inputs (picklable: module level; seeded by the caller)."""
    model = CustomMoE(LAYERS, dim=D, vocab=VOCAB, experts=EXPERTS)
    return model, example_inputs(tiny_moe_spec(LAYERS), batch=BATCH, seq=SEQ, device="cpu")


def _hf_spec(kind: str):  # type: ignore[no-untyped-def]
    """A 4-layer Mixtral or Qwen3-MoE (hidden 64, 4 experts, top 2), built by transformers."""
    spec = dataclasses.replace(tiny_moe_spec(LAYERS, EXPERTS), name=f"tiny-{kind}")
    if kind == "qwen3_moe":
        spec = dataclasses.replace(spec, family="qwen3_moe", qk_norm="head")
    return spec


def _custom(points: list[str], **layout: object) -> Case:
    par = Parallel(gpus=4, pp=2, ep=2, microbatches=4, pp_split_points=points,
                   **layout)  # type: ignore[arg-type]
    return Case(spec=tiny_moe_spec(LAYERS), batch=BATCH, seq=SEQ, recipe=Recipe(parallel=par),
                make=make_custom)


def _hf(kind: str, points: list[str] | None, **layout: object) -> Case:
    par = Parallel(gpus=4, pp=2, ep=2, microbatches=4, pp_split_points=points,
                   **layout)  # type: ignore[arg-type]
    return Case(spec=_hf_spec(kind), batch=BATCH, seq=SEQ, backend="transformers",
                recipe=Recipe(parallel=par))


GLOO_CASES = {
    "custom, 1f1b at blocks.1, DDP": _custom(["blocks.1"]),
    "mixtral by its base_model_pp_plan, gpipe, FSDP2": _hf("mixtral", None, fsdp=2,
                                                          pp_schedule="gpipe"),
    "qwen3-moe at model.layers.1, DDP": _hf("qwen3_moe", ["model.layers.1"]),
}


# -- first principles ----------------------------------------------------------------------------


def test_each_stage_keeps_half_of_its_own_blocks_experts() -> None:
    """Split at blocks.1 (stage 0: block 0; stage 1: blocks 1-3), DDP over each stage's 2 ranks
    with ep 2: against the same split without ep, a rank's weights are short by half of the
    stacked experts of each of its stage's blocks (gate, up: [E, F, D]; down: [E, D, F]; 3 D F
    fp32 numbers an expert, E / 2 experts dropped), the routers staying whole."""
    spec = tiny_moe_spec(LAYERS, EXPERTS)
    with_ep = per_rank(_custom(["blocks.1"]))
    dense = per_rank(dataclasses.replace(_custom(["blocks.1"]), recipe=Recipe(
        parallel=Parallel(gpus=4, pp=2, microbatches=4, pp_split_points=["blocks.1"]))))
    assert [e.ranks for e in with_ep] == [(0, 1), (2, 3)]
    dropped = EXPERTS // 2 * 3 * D * spec.intermediate_size * 4
    for blocks, ep, without in zip((1, 3), with_ep, dense, strict=True):
        assert (without.breakdown[MemoryCategory.WEIGHTS]
                - ep.breakdown[MemoryCategory.WEIGHTS]) == blocks * dropped


def test_interleaved_stages_of_a_split_run_with_ep() -> None:
    """Interleaved 1F1B over 4 stages of the custom model (2 a rank: 0 and 2, 1 and 3), ep 2
    beside FSDP2 (the experts left out of it): each rank's weights before the first step are
    its 2 blocks (one a stage) with half their experts, its dense parameters in halves (FSDP2
    over the stage's 2 ranks: every dim 0 here is even), all fp32."""
    spec = tiny_moe_spec(LAYERS, EXPERTS)
    case = _custom(["blocks.1", "blocks.2", "blocks.3"], pp_schedule="interleaved-1f1b",
                   fsdp=2)
    model, inputs = build(case)
    est = memfit.estimate(model, inputs, device="cpu", parallel=case.parallel)
    assert [e.ranks for e in est.per_rank] == [(0, 1), (2, 3)]
    block_dense = 2 * D + EXPERTS * D  # ln, router
    experts = EXPERTS // 2 * 3 * D * spec.intermediate_size
    ends = {0: VOCAB * D, 1: 2 * D + D * VOCAB}  # stage 0's embedding, stage 3's norm, head
    for e in est.per_rank:
        want = 2 * experts + (2 * block_dense + ends[e.ranks[0] // 2]) // 2
        start = next(s for s in e.timeline if s.step == 0)
        assert start.by_category()[MemoryCategory.WEIGHTS] == 4 * want


def test_a_transformers_moe_split_has_its_stage_shapes_without_a_fake_mode() -> None:
    """The stages' boundary shapes come from a forward of a plain meta copy of the model (the
    real ranks have no fake mode): Mixtral's experts run ``aten._grouped_mm`` in fp32, which
    torch's meta function refuses (Note: [grouped_mm on fake tensors]). Stage 0 of 2 takes the
    micro-batch's ids and sends hidden states ``[2, SEQ, D]``."""
    from memfit.parallel.pipeline import stage_modules

    case = _hf("mixtral", None)
    model, _ = build(case)
    first, = stage_modules(model, case.parallel, 0)
    ids, states = first.io_metas(2, SEQ, None)
    assert (ids.shape, ids.dtype) == ((2, SEQ), torch.long)
    assert (states.shape, states.dtype) == ((2, SEQ, D), torch.float32)


# -- the truth: real ranks over gloo --------------------------------------------------------------


@pytest.fixture(scope="module")
def measured() -> dict[str, list[dict[str, int]]]:
    """Every case in one set of 4 gloo ranks, a case more than 1% off measured again."""
    from memfit.parallel.measure import measure_until

    def off(case: Case, got: list[dict[str, int]]) -> bool:
        return any(abs(e.peak_bytes - got[r]["peak"]) > 0.01 * got[r]["peak"]
                   for e in per_rank(case) for r in e.ranks)

    cases = list(GLOO_CASES.values())
    return dict(zip(GLOO_CASES, measure_until(cases, world=4, off=off), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(GLOO_CASES))
def test_each_rank_of_pp_by_ep_on_a_split_matches_a_real_gloo_run_within_1_percent(
        name: str, measured: dict) -> None:
    """Per rank of pp 2 x ep 2 (4 gloo processes, 4 micro-batches of 2 rows, AdamW, 2 steps),
    the trace's peak is within 1% of the real rank's: the custom MoE model split at a named
    block (1F1B beside DDP, which leaves the experts out), a Mixtral split where its
    ``base_model_pp_plan`` says (GPipe beside FSDP2, the experts in ``ignored_params``) and a
    Qwen3-MoE at a named layer (1F1B beside DDP)."""
    for est in per_rank(GLOO_CASES[name]):
        for r in est.ranks:
            real = measured[name][r]["peak"]
            print(f"{name} rank {r}: predicted {est.peak_bytes:,}, measured {real:,}")
            assert abs(est.peak_bytes - real) <= 0.01 * real, (
                f"{name} rank {r}: predicted {est.peak_bytes:,} bytes, measured {real:,}")
