"""Expert parallelism on transformers' MoE models (memfit/parallel/hf_expert.py): Mixtral,
Qwen3-MoE, DeepSeek-V3 and gpt-oss as the installed transformers builds them, from tiny configs
with random weights (no download).

Sources: transformers 5 stores a layer's experts as one module of fused 3-D parameters
(transformers/models/mixtral/modeling_mixtral.py: MixtralExperts, gate_up_proj
[experts, 2 * intermediate, hidden] and down_proj [experts, hidden, intermediate]; the same in
Qwen3MoeExperts and DeepseekV3Experts, whose DeepseekV3MoE adds shared experts, a plain MLP;
gpt_oss/modeling_gpt_oss.py: GptOssExperts, transposed [experts, hidden, 2 * intermediate] with
biases, gate and up interleaved);
expert parallelism keeps dim 0's slice of each rank (torchtitan's Shard(0)) and exchanges tokens
with all_to_all_single, whose backward is the reverse all-to-all; DDP leaves the experts out
(DistributedDataParallel._set_params_and_buffers_to_ignore_for_model) and keeps one flat bucket
copy of every other gradient; AdamW keeps exp_avg and exp_avg_sq per parameter and a 4-byte step
per parameter tensor (torch/optim/adam.py: _init_group).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import memfit
from memfit.categories import MemoryCategory
from memfit.errors import MemfitError
from memfit.parallel import Parallel
from memfit.recipe import Recipe

pytest.importorskip("transformers")

HIDDEN, EXPERTS, MOE_INTERMEDIATE = 64, 4, 128


def _spec(kind: str):  # type: ignore[no-untyped-def]
    """A 2-layer model of ``kind``, hidden 64, 4 experts (top 2): Mixtral and Qwen3-MoE as
    memfit's specs (built by transformers), DeepSeek-V3 from a config.json's keys (its first
    layer dense, ``first_k_dense_replace=1``; multi-head latent attention; one shared expert)."""
    from memfit.models.hf_auto import hf_model_spec
    from memfit.parallel.measure import tiny_moe_spec

    if kind == "mixtral":
        return dataclasses.replace(tiny_moe_spec(), name="tiny-mixtral")
    if kind == "qwen3_moe":
        return dataclasses.replace(tiny_moe_spec(), name="tiny-qwen3-moe", family="qwen3_moe",
                                   qk_norm="head")
    if kind == "gpt_oss":  # experts transposed, with biases, gate and up interleaved
        return hf_model_spec({
            "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "vocab_size": 256,
            "hidden_size": HIDDEN, "intermediate_size": MOE_INTERMEDIATE,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "num_local_experts": EXPERTS, "num_experts_per_tok": 2,
            "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"],
            "max_position_embeddings": 512}, name="tiny-gpt-oss")
    return hf_model_spec({
        "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
        "vocab_size": 256, "hidden_size": HIDDEN, "intermediate_size": 128,
        "moe_intermediate_size": MOE_INTERMEDIATE, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": EXPERTS,
        "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
        "first_k_dense_replace": 1, "q_lora_rank": 32, "kv_lora_rank": 16,
        "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
        "max_position_embeddings": 512}, name="tiny-deepseek-v3")


KINDS = ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss")
MOE_LAYERS = {"mixtral": 2, "qwen3_moe": 2, "deepseek_v3": 1, "gpt_oss": 2}
EXPERT_TENSORS = {"mixtral": 2, "qwen3_moe": 2, "deepseek_v3": 2, "gpt_oss": 4}
"""Per MoE layer: gate_up_proj and down_proj (gpt-oss: and their biases)."""


def _expert_numel(kind: str) -> int:
    """Every layer's experts: E x (gate_up 2 I H + down H I), + gpt-oss's biases (2 I + H)."""
    per_expert = 3 * HIDDEN * MOE_INTERMEDIATE + (
        2 * MOE_INTERMEDIATE + HIDDEN if kind == "gpt_oss" else 0)
    return MOE_LAYERS[kind] * EXPERTS * per_expert


def _case(kind: str, parallel: Parallel):  # type: ignore[no-untyped-def]
    from memfit.parallel.measure import Case

    return Case(spec=_spec(kind), batch=2, seq=32, backend="transformers",
                recipe=Recipe(parallel=parallel))


def _estimate(case) -> memfit.Estimate:  # type: ignore[no-untyped-def]
    from memfit.parallel.measure import build

    model, inputs = build(case)
    return memfit.estimate(model, inputs, device="cpu", parallel=case.parallel)


# -- bad layouts ---------------------------------------------------------------------------------


def test_a_dense_transformers_model_is_refused_in_one_line() -> None:
    from _hf import tiny_hf_llama

    model = tiny_hf_llama()
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    with pytest.raises(MemfitError, match=r"ep=2\) needs a mixture-of-experts model") as info:
        memfit.estimate(model, {"input_ids": ids, "labels": ids}, device="cpu",
                        parallel=Parallel(gpus=2, ep=2))
    assert "\n" not in str(info.value)


def test_ep_that_does_not_divide_the_experts_is_refused_in_one_line() -> None:
    from memfit.parallel.measure import build

    model, inputs = build(_case("mixtral", Parallel(gpus=1)))
    with pytest.raises(MemfitError, match=r"ep=8\) does not divide the 4 experts of "
                                          r"model.layers.0.mlp") as info:
        memfit.estimate(model, inputs, device="cpu", parallel=Parallel(gpus=8, ep=8))
    assert "\n" not in str(info.value)


# -- first principles ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_each_rank_holds_half_the_experts(kind: str) -> None:
    """ep=2 over 2 ranks (DDP for the rest), fp32, AdamW. Each MoE layer's experts hold
    E * 3 * hidden * intermediate parameters (gate_up: 2 * intermediate * hidden, down:
    hidden * intermediate per expert; gpt-oss adds 2 * intermediate + hidden of biases), so a
    rank holds dense + experts / 2: weights 4 bytes each
    (+ buffers), optimizer states exp_avg + exp_avg_sq of each local parameter + a 4-byte step
    per parameter tensor (high points over the step)."""
    from memfit.parallel.measure import build

    case = _case(kind, Parallel(gpus=2, ep=2))
    model, _ = build(case)
    experts = _expert_numel(kind)
    total = sum(p.numel() for p in model.parameters())
    local = total - experts // 2
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    tensors = len(list(model.parameters()))
    est = _estimate(case)
    assert [e.ranks for e in est.per_rank] == [(0, 1)]
    high = {c: max(s.by_category().get(c, 0) for s in est.timeline) for c in MemoryCategory}
    assert high[MemoryCategory.WEIGHTS] == 4 * local + buffers
    assert high[MemoryCategory.OPTIMIZER_STATES] == 2 * 4 * local + 4 * tensors


# -- the math: with room for every token, transformers' own experts' result ---------------------


def _parity_worker(rank: int, world: int) -> None:
    from memfit._loss import model_loss
    from memfit.parallel.apply import apply_model
    from memfit.parallel.hf_expert import HFExpertParallel
    from memfit.parallel.measure import build

    for kind in KINDS:
        case = _case(kind, Parallel(gpus=world, ep=world))
        full, inputs = build(case)
        sharded = apply_model(build(case)[0], case.parallel, "cpu")
        for module in sharded.modules():
            if isinstance(module, HFExpertParallel):
                module.capacity_factor = None  # room for every token: no drop
        vocab = full.config.vocab_size
        per_rank = [torch.randint(0, vocab, inputs["input_ids"].shape,
                                  generator=torch.Generator().manual_seed(r))
                    for r in range(world)]
        mine = {**inputs, "input_ids": per_rank[rank], "labels": per_rank[rank]}
        loss = model_loss(sharded, mine)
        loss.backward()
        ref = sum(model_loss(full, {**inputs, "input_ids": ids, "labels": ids})
                  for ids in per_rank)
        ref.backward()
        assert torch.allclose(loss, model_loss(full, mine), atol=1e-5), kind
        checked = 0
        for name, param in sharded.module.named_parameters():
            if ".experts." in name:
                whole = full.get_parameter(name).grad
                local = whole.shape[0] // world
                assert torch.allclose(param.grad, whole[rank * local:(rank + 1) * local],
                                      atol=1e-5), (kind, name)
                checked += 1
        assert checked == EXPERT_TENSORS[kind] * MOE_LAYERS[kind], kind


@pytest.mark.slow
def test_expert_parallel_step_computes_what_transformers_computes(gloo_runs: tuple) -> None:
    """With capacity = tokens (capacity_factor=None, no assignment dropped), each rank's loss on
    its own tokens equals the unsharded transformers model's, and its experts' gradients equal
    that model's gradients of those experts for the sum of both ranks' losses (the reverse
    all-to-all brings the other rank's tokens' gradients home)."""
    failures = [f"rank {r}: {text}" for r, text in enumerate(gloo_runs[1]) if text]
    assert not failures, "\n".join(failures)


# -- the truth: real ranks over gloo -------------------------------------------------------------


def _gloo_cases() -> list:
    return [_case(kind, Parallel(gpus=2, ep=2)) for kind in KINDS]


def _gloo_worker(rank: int, world: int, out: str) -> None:
    """A rank of :func:`gloo_runs`: every kind's measurement (memfit.parallel.measure's own
    worker's work, first, in a fresh process), then :func:`_parity_worker`, whose failed
    assertion (raised after its last collective) is written for the parity test to report."""
    import json
    import traceback

    from memfit.parallel.measure import rank_peaks

    Path(out, f"rank{rank}.json").write_text(json.dumps(rank_peaks(_gloo_cases())))
    try:
        _parity_worker(rank, world)
        failure = ""
    except AssertionError:
        failure = traceback.format_exc()
    Path(out, f"rank{rank}.parity.txt").write_text(failure)


@pytest.fixture(scope="module")
def gloo_runs() -> tuple[list[list[dict]], list[str]]:
    """One set of 2 gloo ranks for the module (as tests/parallel/test_parallel_combos.py and
    tests/fitting/test_fit_parallel.py share theirs): the measurement's first run, per case and
    rank, and each rank's parity failure ("" if it passed)."""
    import json
    import tempfile

    from memfit.parallel.gloo import spawn

    with tempfile.TemporaryDirectory() as out:
        spawn(_gloo_worker, 2, out)
        peaks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]
        parity = [Path(out, f"rank{r}.parity.txt").read_text() for r in range(2)]
    return [[peaks[r][i] for r in range(2)] for i in range(len(KINDS))], parity


@pytest.fixture(scope="module")
def measured(gloo_runs: tuple) -> dict[str, list]:
    """Every kind's ep=2 step on one set of 2 gloo ranks; a case whose trace is off by more than
    1% is measured again and each rank's lowest kept (Note: [gloo's timing] in
    memfit/parallel/measure.py: a free on gloo's thread the profiler misses only adds bytes)."""
    from memfit.parallel.measure import measure_until

    cases = _gloo_cases()
    roles = {id(c): _estimate(c).per_rank[0] for c in cases}

    def off(case, got) -> bool:  # type: ignore[no-untyped-def]
        role = roles[id(case)]
        return any(not _close(role.peak_bytes, r["peak"]) or any(
            not _close(role.phase_peaks[(int(k.split(":")[0]), k.split(":")[1])], v)
            for k, v in r["phases"].items()) for r in got)

    results = measure_until(cases, world=2, off=off, first=gloo_runs[0])
    return {kind: [roles[id(c)], got] for kind, c, got in zip(KINDS, cases, results, strict=True)}


def _close(pred: int, real: int) -> bool:
    return abs(pred - real) <= 0.01 * real


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_each_rank_matches_a_real_gloo_run_within_1_percent(kind: str, measured: dict) -> None:
    """ep=2 on 2 gloo processes, the dense parameters under DDP, the profiler's allocator events
    per rank (memfit/parallel/measure.py): each rank's peak, and its high point in each phase,
    within 1% of the per-rank trace."""
    role, got = measured[kind]
    for rank in role.ranks:
        real = got[rank]["peak"]
        assert _close(role.peak_bytes, real), (
            f"{kind} rank {rank}: predicted {role.peak_bytes:,} bytes, measured {real:,}")
        for key, real_phase in got[rank]["phases"].items():
            step, phase = key.split(":")
            pred = role.phase_peaks[(int(step), phase)]
            assert _close(pred, real_phase), (
                f"{kind} rank {rank} {key}: predicted {pred:,} bytes, measured {real_phase:,}")


# -- the CLI -------------------------------------------------------------------------------------


def test_plan_traces_ep_on_a_deepseek_v3_config(capsys: pytest.CaptureFixture[str],
                                                tmp_path: Path) -> None:
    """`memfit plan <deepseek_v3 config.json> --gpus 2 --ep 2` traces transformers' own
    DeepseekV3ForCausalLM per rank (a model_type memfit's formulas do not cover, so no builtin
    decoder could stand in; it was refused before): exit 0, the layout's ep, the backend."""
    import json

    from memfit.cli import main

    spec = _spec("deepseek_v3")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(spec.config | {"model_type": "deepseek_v3"}))
    code = main(["plan", str(path), "--gpus", "2", "--ep", "2", "--gpu", "h100-80gb",
                 "--batch", "2", "--seq", "32", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    data = json.loads(out)
    assert data["parallel"]["ep"] == 2 and data["model"]["backend"] == "transformers"
