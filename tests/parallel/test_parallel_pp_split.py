"""Pipeline parallelism of any module split at named submodules (``Parallel(pp_split_points=
...)``, memfit/parallel/pipeline_split.py), as torchtitan's ``pipeline_parallel_split_points``.

The model is a custom decoder whose names are in none of memfit's lists (``tok``, ``blocks``,
``ln_f``, ``out``; blocks of ``ln``, ``fc1``, ``fc2``). The truth is a real run: one gloo
process per rank running the same stages and ``torch.distributed.pipelining`` schedule under the
profiler (memfit/parallel/measure.py), and the stages' parameters counted by hand.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memfit
from _models import CustomDecoder
from _pipeline import per_rank
from memfit.errors import MemfitError
from memfit.models.build import example_inputs
from memfit.parallel import Parallel
from memfit.parallel.measure import Case, build, tiny_spec
from memfit.parallel.pipeline import stage_modules
from memfit.recipe import Recipe

SEQ, VOCAB, D = 64, 256, 64


def net(spec: object) -> nn.Module:
    """The measurement's builder (picklable: module level)."""
    return CustomDecoder(4, dim=D, hidden=4 * D, vocab=VOCAB)


def olmo2(spec: object) -> nn.Module:
    """A tiny transformers Olmo2 (not one of the decoders memfit's HFStageModule runs): its
    config's ``base_model_pp_plan`` names ``layers``, which the split takes."""
    import transformers

    cfg = transformers.Olmo2Config(hidden_size=D, intermediate_size=2 * D, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=4,
                                   vocab_size=VOCAB, tie_word_embeddings=False)
    return transformers.AutoModelForCausalLM.from_config(cfg)


BATCH = 8
"""2 samples in each of the 4 micro-batches."""


def make_net() -> tuple[nn.Module, object]:
    """The measurement's model and inputs (picklable: module level; seeded by the caller)."""
    return net(None), example_inputs(tiny_spec(4), batch=BATCH, seq=SEQ, device="cpu")


def make_olmo2() -> tuple[nn.Module, object]:
    """:func:`olmo2` and its inputs, as :func:`make_net`."""
    return olmo2(None), example_inputs(tiny_spec(4), batch=BATCH, seq=SEQ, device="cpu")


def _case(points: list[str] | None, schedule: str = "1f1b",
          make: object = make_net) -> Case:
    par = Parallel(gpus=2, pp=2, pp_schedule=schedule, microbatches=4, pp_split_points=points)
    return Case(spec=tiny_spec(4), batch=BATCH, seq=SEQ, recipe=Recipe(parallel=par),
                make=make)  # type: ignore[arg-type]


# -- the layout and the split --------------------------------------------------------------------


@pytest.mark.parametrize(("points", "match"), [
    (["blocks.9"], "'blocks.9' is not a submodule of CustomDecoder \\(did you mean 'blocks.3'"),
    (["blockz.2"], "'blockz.2' is not a submodule of CustomDecoder"),
    (["blocks.2.fc1"], "not an element of an nn.ModuleList or nn.Sequential"),
    (["ln_f"], "not an element of an nn.ModuleList"),
])
def test_a_split_point_that_is_not_an_element_gets_one_line_errors(
        points: list[str], match: str) -> None:
    model, inputs = build(_case(["blocks.2"]))
    with pytest.raises(MemfitError, match=match) as info:
        memfit.estimate(model, inputs, device="cpu",
                        parallel=Parallel(gpus=2, pp=2, pp_split_points=points))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"pp_split_points": ["blocks.1", "blocks.2"]}, "names 2 split point\\(s\\); 2 stages"),
    ({"pp_split_points": "blocks.2"}, "give a list of module names"),
    ({"pp_split_points": ["blocks.1"], "pp_schedule": "interleaved-1f1b"}, "4 stages"),
])
def test_bad_split_point_counts_get_one_line_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(MemfitError, match=match) as info:
        Parallel(gpus=2, pp=2, **kwargs)
    assert "\n" not in str(info.value)


def test_a_custom_module_without_split_points_names_the_option() -> None:
    model, inputs = build(_case(["blocks.2"]))
    with pytest.raises(MemfitError, match="pp_split_points=") as info:
        memfit.estimate(model, inputs, device="cpu", parallel=Parallel(gpus=2, pp=2))
    assert "\n" not in str(info.value)


def test_stages_hold_the_modules_before_in_and_after_their_elements() -> None:
    """Split at blocks.1: stage 0 holds the embedding and block 0, stage 1 blocks 1-3, the norm
    and the head, each parameter on exactly one stage under its own name; the stages run the
    model's own forward (the stage 1 forward of stage 0's output is the model's output)."""
    torch.manual_seed(0)
    model = net(None)
    par = Parallel(gpus=2, pp=2, pp_split_points=["blocks.1"])
    first, = stage_modules(model, par, 0)
    last, = stage_modules(model, par, 1)
    block = 2 * D + (D * 4 * D + 4 * D) + (4 * D * D + D)  # ln, fc1, fc2
    assert sum(p.numel() for p in first.parameters()) == VOCAB * D + block
    assert sum(p.numel() for p in last.parameters()) == 3 * block + 2 * D + D * VOCAB
    names = {n.removeprefix("inner.") for m in (first, last) for n, _ in m.named_parameters()}
    assert names == {n for n, _ in model.named_parameters()}
    ids = torch.randint(0, VOCAB, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(last(first(ids)), model(ids), rtol=0, atol=0)


# -- the truth: real ranks over gloo --------------------------------------------------------------

def test_transformers_base_model_pp_plan_splits_a_model_without_split_points() -> None:
    """An Olmo2 without split points is split at its ``base_model_pp_plan``'s ``layers``
    (``model.layers``), evenly as memfit splits a decoder (4 blocks: 2 | 2), and the two stages
    compose to the model's own logits."""
    torch.manual_seed(0)
    model = olmo2(None)
    par = Parallel(gpus=2, pp=2)
    first, = stage_modules(model, par, 0)
    last, = stage_modules(model, par, 1)
    assert (list(first.layers), list(last.layers)) == (["0", "1"], ["2", "3"])
    assert first.block_names() == ["inner.model.layers.0", "inner.model.layers.1"]
    ids = torch.randint(0, VOCAB, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(last(first(ids)), model(ids).logits, rtol=0, atol=0)


GLOO_CASES = {"1f1b at blocks.1": _case(["blocks.1"]),
              "gpipe at blocks.3": _case(["blocks.3"], "gpipe"),
              "olmo2 by its base_model_pp_plan": _case(None, make=make_olmo2)}


@pytest.fixture(scope="module")
def measured() -> dict[str, list[dict[str, int]]]:
    from memfit.parallel.measure import measure_until

    def off(case: Case, got: list[dict[str, int]]) -> bool:
        return any(abs(e.peak_bytes - got[e.ranks[0]]["peak"]) > 0.01 * got[e.ranks[0]]["peak"]
                   for e in per_rank(case))

    cases = list(GLOO_CASES.values())
    return dict(zip(GLOO_CASES, measure_until(cases, world=2, off=off), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(GLOO_CASES))
def test_each_stage_of_a_custom_split_matches_a_real_gloo_run_within_1_percent(
        name: str, measured: dict) -> None:
    """Per stage (rank) of the custom module split at the named block, the trace's peak is
    within 1% of the real rank's: 2 gloo processes, 4 micro-batches of 2 rows, AdamW, 2 steps,
    1F1B split 1 | 3 blocks and GPipe split 3 | 1 (the stages hold different parameters, so the
    two ranks' peaks differ); a transformers Olmo2 split where its ``base_model_pp_plan``
    says."""
    estimates = per_rank(GLOO_CASES[name])
    assert len({e.peak_bytes for e in estimates}) == 2
    for est in estimates:
        real = measured[name][est.ranks[0]]["peak"]
        print(f"{name} rank {est.ranks[0]}: predicted {est.peak_bytes:,}, measured {real:,}")
        assert abs(est.peak_bytes - real) <= 0.01 * real, (
            f"{name} stage {est.ranks}: predicted {est.peak_bytes:,} bytes, measured {real:,}")
