"""Pipeline (and sequence) parallelism on Hugging Face decoders (memfit/parallel/hf_pipeline.py).

A stage of a transformers ``LlamaForCausalLM`` / ``MistralForCausalLM`` / ``Qwen2ForCausalLM``
holds the model's own submodules, split as torchtitan splits its Llama
(torchtitan/distributed/pipeline_parallel.py: pipeline_module_split), and runs them as
transformers' own ``LlamaModel.forward`` does (transformers/models/llama/modeling_llama.py,
lines 369-402: embedding, ``position_ids = arange(seq)``, ``create_causal_mask``,
``rotary_emb(hidden_states, position_ids)``, each layer with ``attention_mask``,
``position_embeddings`` and ``position_ids``, the final norm), so the stages composed give the
unsplit model's loss exactly (one process, no gloo). The memory is checked against real gloo
ranks running torch.distributed.pipelining's PipelineStage and Schedule1F1B
(torch/distributed/pipelining/schedules.py: Schedule1F1B._step_microbatches) on the same
stages under the profiler (memfit/parallel/measure.py). Tiny configs with random weights; no
downloads.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import pytest
import torch

import memfit
from _pipeline import per_rank
from memfit.errors import MemfitError
from memfit.parallel import Parallel
from memfit.parallel.measure import Case, build, tiny_spec
from memfit.parallel.pipeline import stage_loss, stage_modules
from memfit.recipe import Recipe

transformers = pytest.importorskip("transformers")

SEQ = 64


def _hf_case(parallel: Parallel, batch: int = 8, layers: int = 4, spec: object = None,
             checkpointing: str = "none") -> Case:
    return Case(spec=spec or tiny_spec(layers), batch=batch, seq=SEQ, backend="transformers",
                recipe=Recipe(parallel=parallel, checkpointing=checkpointing))


def tiny_qwen3_spec(layers: int = 2) -> object:
    """:func:`tiny_spec` as a Qwen3 (its attention normalises each head's queries and keys:
    ``q_norm``, ``k_norm`` inside ``self_attn``, modeling_qwen3.py: Qwen3Attention)."""
    return dataclasses.replace(tiny_spec(layers), name="tiny-qwen3", family="qwen3",
                               qk_norm="head")


def _tiny_hf(kind: str) -> torch.nn.Module:
    """A tiny transformers decoder with random weights (seeded): Mistral with a sliding window
    shorter than the sequence, Qwen2 with sliding-window layers after two full ones (its
    ``layer_types``), so that their stages make the masks the models' forwards make."""
    torch.manual_seed(0)
    common = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "attn_implementation": "sdpa"}
    if kind == "mistral":
        config = transformers.MistralConfig(sliding_window=8, **common)
        return transformers.MistralForCausalLM(config)
    config = transformers.Qwen2Config(use_sliding_window=True, sliding_window=8,
                                      max_window_layers=2, **common)
    return transformers.Qwen2ForCausalLM(config)


def _composed_loss(model: torch.nn.Module, parallel: Parallel,
                   inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Every stage of ``parallel``, run one after the other on the whole batch, then the
    pipeline's loss (pipeline.stage_loss)."""
    x = inputs["input_ids"]
    stages = sorted((m for r in range(parallel.gpus) for m in stage_modules(model, parallel, r)),
                    key=lambda m: m.index)
    for stage in {m.index: m for m in stages}.values():
        x = stage(x)
    return stage_loss(x, inputs["labels"])


def test_hf_llama_stages_compose_to_the_unsplit_models_loss() -> None:
    """The two stages of a transformers LlamaForCausalLM (4 layers: embedding + layers 0-1 |
    layers 2-3 + norm + head, torchtitan's split of 6 effective layers), run one after the
    other, give exactly the loss of the whole model's own forward (``LlamaForCausalLM.forward``
    with labels: ``ForCausalLMLoss``, fp32 logits, labels shifted left); and the stages hold
    the model's own modules."""
    case = _hf_case(Parallel(gpus=2, pp=2))
    model, inputs = build(case)
    assert type(model).__name__ == "LlamaForCausalLM"
    first, = stage_modules(model, case.parallel, 0)
    last, = stage_modules(model, case.parallel, 1)
    assert list(first.layers) == ["0", "1"] and list(last.layers) == ["2", "3"]
    assert first.embed_tokens is model.model.embed_tokens and first.lm_head is None
    assert last.lm_head is model.lm_head and last.norm is model.model.norm
    with torch.no_grad():
        assert torch.equal(_composed_loss(model, case.parallel, inputs), model(**inputs).loss)


@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_hf_stages_make_the_sliding_window_masks_of_the_models_forward(kind: str) -> None:
    """Mistral with ``sliding_window`` (modeling_mistral.py: MistralModel.forward uses
    ``create_sliding_window_causal_mask``) and Qwen2 with full then sliding layers
    (modeling_qwen2.py: Qwen2Model.forward, ``causal_mask_mapping[config.layer_types[i]]``),
    window 8 on 32 tokens, so the mask matters: the composed stages (pp 2, and pp 4: one layer
    per stage but the last, which holds the head only) give the whole model's loss exactly."""
    model = _tiny_hf(kind)
    ids = torch.randint(0, 128, (2, 32))
    inputs = {"input_ids": ids, "labels": ids.clone()}
    with torch.no_grad():
        whole = model(**inputs).loss
        for pp in (2, 4):
            assert torch.equal(_composed_loss(model, Parallel(gpus=pp, pp=pp), inputs), whole)


def test_hf_stage_masks_take_the_installed_transformers_cache_keyword() -> None:
    """transformers 5.x renamed the mask functions' ``past_key_values`` to ``cache`` (the old
    name warns, FutureWarning, and goes in 5.40): a stage passes the name the installed
    version's signature has, so no warning; Qwen2 with full then sliding layers makes both
    kinds of mask, and the composed stages still give the whole model's loss."""
    import inspect
    import warnings

    from transformers import masking_utils

    model = _tiny_hf("qwen2")
    ids = torch.randint(0, 128, (2, 32))
    inputs = {"input_ids": ids, "labels": ids.clone()}
    with torch.no_grad():
        whole = model(**inputs).loss
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            assert torch.equal(_composed_loss(model, Parallel(gpus=1, pp=1), inputs), whole)
    from memfit.parallel.hf_pipeline import cache_keyword

    for make in (masking_utils.create_causal_mask,
                 masking_utils.create_sliding_window_causal_mask):
        assert cache_keyword(make) in inspect.signature(make).parameters


def test_hf_pipeline_is_refused_for_other_hf_models_in_one_line() -> None:
    """GPT-2 (``GPT2LMHeadModel``: learned positions, ``transformer.h``) is not split."""
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 64, (4, 16))
    with pytest.raises(MemfitError, match="not GPT2LMHeadModel") as info:
        memfit.estimate(model, {"input_ids": ids, "labels": ids}, device="cpu",
                        parallel=Parallel(gpus=2, pp=2))
    assert "\n" not in str(info.value)


# -- sequence parallelism ------------------------------------------------------------------------


def test_hf_sp_plan_all_gathers_the_attentions_keyword_input() -> None:
    """transformers' decoder layer calls its attention with keywords only
    (``self.self_attn(hidden_states=hidden_states, ...)``, modeling_llama.py:
    LlamaDecoderLayer.forward), so the plan's PrepareModuleInput for it takes the
    ``hidden_states`` keyword from Shard(1) to Replicate (a positional plan would find no
    argument); the norms are SequenceParallel, the projections as without sp, the root
    (model.embed_tokens, model.norm, lm_head) as torchtitan's."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel

    from memfit.parallel.apply import tp_plan

    model, _ = build(_hf_case(Parallel(gpus=2, tp=2, sp=True), batch=2, layers=2))
    plan = tp_plan(model, Parallel(gpus=2, tp=2, sp=True))
    attn = plan["model.layers.0.self_attn"]
    assert isinstance(attn, PrepareModuleInput) and attn.input_layouts is None
    assert attn.input_kwarg_layouts == {"hidden_states": Shard(1)}
    assert attn.desired_input_kwarg_layouts == {"hidden_states": Replicate()}
    assert isinstance(plan["model.layers.1.post_attention_layernorm"], SequenceParallel)
    assert isinstance(plan["model.norm"], SequenceParallel)
    assert {"model.embed_tokens", "lm_head", "model.layers.1.mlp.down_proj"} <= set(plan)


def test_hf_sp_refuses_tied_embeddings_in_one_line() -> None:
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 64, (2, 16))
    with pytest.raises(MemfitError, match="tied embeddings") as info:
        memfit.estimate(model, {"input_ids": ids, "labels": ids}, device="cpu",
                        optimizer="adamw", parallel=Parallel(gpus=2, tp=2, sp=True))
    assert "\n" not in str(info.value)


SP_CASES = {"sp": (False, False), "sp-loss-parallel": (True, False), "qwen3-sp": (False, True)}
"""Each parity case's (loss_parallel, qwen3)."""


def _sp_parity_case(world: int, loss_parallel: bool, qwen3: bool) -> dict[str, torch.Tensor]:
    """One case on this rank, from a fresh seeded model (measure.build): the split model's loss
    and its first layer's down projection's full gradient, and the unsplit model's."""
    from memfit._loss import model_loss
    from memfit.parallel.apply import apply_model, loss_context

    case = _hf_case(Parallel(gpus=world, tp=world, sp=True, loss_parallel=loss_parallel),
                    batch=2, spec=tiny_qwen3_spec() if qwen3 else tiny_spec(2))
    full, inputs = build(case)
    split = apply_model(build(case)[0], case.parallel, "cpu")
    with loss_context(case.parallel):
        loss = model_loss(split, inputs)
        loss.backward()
    ref = model_loss(full, inputs)
    ref.backward()
    return {"loss": (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach(),
            "ref": ref.detach(),
            "grad": split.model.layers[0].mlp.down_proj.weight.grad.full_tensor(),
            "ref_grad": full.model.layers[0].mlp.down_proj.weight.grad}


def _sp_parity_worker(rank: int, world: int, out: str) -> None:
    """Every case of SP_CASES in turn in this one set of ranks (a set costs each rank a fresh
    interpreter importing torch and transformers), a fresh model and plan per case."""
    for name, (loss_parallel, qwen3) in SP_CASES.items():
        torch.save(_sp_parity_case(world, loss_parallel, qwen3),
                   Path(out, f"{name}-rank{rank}.pt"))


@pytest.fixture(scope="module")
def sp_parity_runs() -> dict[str, list[dict[str, torch.Tensor]]]:
    """Every case of SP_CASES run once, in one set of 2 gloo ranks; per case, each rank's
    results."""
    from memfit.parallel.gloo import spawn

    with tempfile.TemporaryDirectory() as out:
        spawn(_sp_parity_worker, 2, out)
        return {name: [torch.load(Path(out, f"{name}-rank{r}.pt")) for r in range(2)]
                for name in SP_CASES}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SP_CASES))
def test_hf_sp_step_computes_what_one_process_computes(name: str, sp_parity_runs: dict) -> None:
    """tp 2 with sequence parallelism (and loss parallelism) on a transformers
    LlamaForCausalLM (and a Qwen3ForCausalLM, whose per-head q_norm / k_norm sit inside the
    attention the plan all-gathers for) over 2 gloo processes: the loss and a row-wise
    projection's gradient equal the unsplit model's in one process. Without the whole
    sequence's position ids (hf_pipeline.full_positions) transformers' LlamaModel.forward would
    make ``seq / tp`` rotary positions (modeling_llama.py line 377) for the all-gathered
    ``seq`` queries."""
    for r in sp_parity_runs[name]:
        loss, ref = r["loss"], r["ref"]
        assert torch.allclose(loss, ref, rtol=1e-5, atol=1e-6), (float(loss), float(ref))
        assert torch.allclose(r["grad"], r["ref_grad"], atol=1e-6)


# -- the truth: real gloo ranks -----------------------------------------------------------------

GLOO_CASES = {
    "pp2-1f1b": _hf_case(Parallel(gpus=2, pp=2, microbatches=4)),
    "pp2-1f1b-full-ac": _hf_case(Parallel(gpus=2, pp=2, microbatches=4), checkpointing="full"),
    "tp2-sp": _hf_case(Parallel(gpus=2, tp=2, sp=True), batch=2, layers=2),
    "tp2-sp-loss-parallel": _hf_case(Parallel(gpus=2, tp=2, sp=True, loss_parallel=True),
                                     batch=2, layers=2),
    "qwen3-tp2-sp": _hf_case(Parallel(gpus=2, tp=2, sp=True), batch=2, spec=tiny_qwen3_spec()),
}


_per_rank = per_rank  # traced once per case (tests/_pipeline.py)


@pytest.fixture(scope="module")
def measured() -> dict[str, list[dict]]:
    from memfit.parallel.measure import measure_until

    def off(case: Case, got: list[dict]) -> bool:
        return any(abs(est.peak_bytes - got[r]["peak"]) > 0.01 * got[r]["peak"]
                   for est in _per_rank(case) for r in est.ranks)

    peaks = measure_until(list(GLOO_CASES.values()), 2, off)
    return dict(zip(GLOO_CASES, peaks, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(GLOO_CASES))
def test_hf_layouts_match_real_gloo_runs_within_1_percent(name: str, measured: dict) -> None:
    """Per rank, the trace's peak of the transformers LlamaForCausalLM's step is within 1% of
    the real rank's (2 gloo processes, AdamW, 2 steps): pp 2 with Schedule1F1B over 4
    micro-batches of 2 rows of 64 tokens (each rank its HFStageModule in a PipelineStage), also
    with full activation checkpointing of the decoder layers (memfit.techniques); tp 2
    with sequence parallelism, and with loss parallelism (parallelize_module with torchtitan's
    plan on the HF names, the loss under torch's loss_parallel())."""
    for est in _per_rank(GLOO_CASES[name]):
        real = measured[name][est.ranks[0]]["peak"]
        assert abs(est.peak_bytes - real) <= 0.01 * real, (
            f"{name} ranks {est.ranks}: predicted {est.peak_bytes:,} bytes, measured {real:,}")
