"""The analytic planner against first principles and the published formulas (shared facts)."""

from __future__ import annotations

import pytest

from memfit.analytic.activations import training_activations
from memfit.analytic.block_activations import layer_terms
from memfit.analytic.config import RunConfig
from memfit.analytic.kv_cache import kv_cache_bytes
from memfit.analytic.model_states import model_states
from memfit.analytic.planner import plan
from memfit.categories import MemoryCategory as C
from memfit.errors import MemfitError
from memfit.models.spec import ParamCountSpec, TransformerSpec
from memfit.parallel import Parallel

GB = 1e9

LLAMA3_8B = TransformerSpec(
    name="llama-3-8b", family="llama", arch="decoder", hidden_size=4096, num_layers=32,
    num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336, vocab_size=128256,
    max_position_embeddings=8192)

# A GPT-style block as Korthikanti et al. assume: LayerNorm, GeLU MLP of 4h, dropout, MHA.
# Korthikanti's GPT block: a fused QKV projection and a fused GeLU (GPT-NeoX's; Hugging Face's
# GPT-2 calls gelu_new, whose plain-PyTorch ops keep more: Note: [gelu_new])
GPT = TransformerSpec(
    name="gpt", family="gpt_neox", arch="decoder", hidden_size=1024, num_layers=4, num_heads=16,
    num_kv_heads=16, head_dim=64, intermediate_size=4096, vocab_size=1000,
    max_position_embeddings=2048, mlp="gelu", norm="layernorm", qkv_bias=True,
    attn_out_bias=True, mlp_bias=True, position="learned", tie_embeddings=True,
    dropout=0.1, attention_dropout=0.1)


def states_total(model, run) -> int:
    s = model_states(model, run)
    return s.weights + s.gradients + s.optimizer_states


@pytest.mark.parametrize(("zero", "expected_gb"), [(0, 120), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_example(zero: int, expected_gb: float) -> None:
    # ZeRO paper Fig. 1: Ψ = 7.5B, N_d = 64, K = 12, mixed-precision Adam.
    model = ParamCountSpec(name="7.5B", params=7_500_000_000)
    run = RunConfig(precision="fp16-mixed", optimizer="adam", parallel=Parallel(gpus=64,
                                                                                zero=zero or None))
    assert states_total(model, run) / GB == pytest.approx(expected_gb, abs=0.05)


def test_zero_formulas_exact() -> None:
    # Per-GPU bytes: 16Ψ; 4Ψ + 12Ψ/N; 2Ψ + 14Ψ/N; 16Ψ/N.
    psi, n = 7_500_000_000, 64
    model = ParamCountSpec(name="x", params=psi)
    got = [states_total(model, RunConfig(precision="bf16-mixed", optimizer="adamw",
                                         parallel=Parallel(gpus=n,
                                                           zero=z or None))) for z in range(4)]
    assert got == [16 * psi, 4 * psi + 12 * psi // n, 2 * psi + 14 * psi // n, 16 * psi // n]


def test_ten_billion_case() -> None:
    # Shared facts: 10B parameters = 20 GB of 16-bit weights; 160 GB of mixed-precision Adam state.
    model = ParamCountSpec(name="10B", params=10_000_000_000)
    inference = plan(model, RunConfig(mode="inference", precision="bf16"))
    assert inference.breakdown[C.WEIGHTS] == 20 * GB
    assert states_total(model, RunConfig(precision="bf16-mixed", optimizer="adam")) == 160 * GB


@pytest.mark.parametrize(("optimizer", "per_param"), [
    ("adamw", 8 + 4), ("sgd-momentum", 4 + 4), ("sgd", 0 + 4), ("lion", 4 + 4)])
def test_optimizer_bytes_per_param(optimizer: str, per_param: int) -> None:
    # Transformer Math 101: AdamW 8, SGD momentum 4 bytes/param (+4 fp32 master when mixed).
    model = ParamCountSpec(name="1B", params=10**9)
    s = model_states(model, RunConfig(precision="bf16-mixed", optimizer=optimizer))
    assert s.optimizer_states == per_param * 10**9


def test_adam_8bit_is_a_quarter_of_adam_states() -> None:
    # "8-bit Adam: optimizer state 75% smaller" (shared facts), plus blockwise absmax overhead.
    model = ParamCountSpec(name="1B", params=10**9)
    full = model_states(model, RunConfig(precision="fp32", optimizer="adamw")).optimizer_states
    small = model_states(model, RunConfig(precision="fp32", optimizer="adamw-8bit"))
    assert small.optimizer_states / full == pytest.approx(0.25, rel=0.02)


def test_fp32_training_is_16_bytes_per_param() -> None:
    model = ParamCountSpec(name="1B", params=10**9)
    s = model_states(model, RunConfig(precision="fp32", optimizer="adamw"))
    assert (s.weights, s.gradients, s.optimizer_states) == (4 * 10**9, 4 * 10**9, 8 * 10**9)


def test_kv_cache_llama3_8b_is_128_kib_per_token() -> None:
    run = RunConfig(mode="inference", precision="bf16", batch=1)
    assert kv_cache_bytes(LLAMA3_8B, run, tokens=1) == 128 * 1024
    # and it scales with tokens, batch and format: 2 x 32 x 8 x 128 x 2 B x 4096 x 4
    run4 = RunConfig(mode="inference", precision="bf16", batch=4)
    assert kv_cache_bytes(LLAMA3_8B, run4, tokens=4096) == 2 * 32 * 8 * 128 * 2 * 4096 * 4
    fp8 = RunConfig(mode="inference", precision="bf16", kv_cache_dtype="fp8")
    assert kv_cache_bytes(LLAMA3_8B, fp8, tokens=1) == 64 * 1024


def test_inference_plan_includes_prompt_and_new_tokens() -> None:
    run = RunConfig(mode="inference", precision="bf16", batch=2, seq=1000, new_tokens=24)
    p = plan(LLAMA3_8B, run)
    assert p.breakdown[C.KV_CACHE] == 128 * 1024 * 1024 * 2
    assert p.breakdown[C.WEIGHTS] == 2 * 8_030_261_248
    assert p.breakdown[C.GRADIENTS] == p.breakdown[C.OPTIMIZER_STATES] == 0


def test_korthikanti_no_parallelism() -> None:
    # sbh(34 + 5as/h) bytes per layer, 16-bit activations, eager attention with dropout.
    s, b = 2048, 2
    h, a = GPT.hidden_size, GPT.num_heads
    t = layer_terms(GPT, seq=s, batch=b, act_bytes=2, attention="eager")
    assert t.replicated + t.split == s * b * h * 34 + 5 * a * s * s * b


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_korthikanti_tensor_parallel(tp: int) -> None:
    # sbh(10 + 24/t + 5as/(ht)) per layer with tensor parallelism t (no sequence parallelism).
    s, b = 1024, 1
    h, a = GPT.hidden_size, GPT.num_heads
    t = layer_terms(GPT, seq=s, batch=b, act_bytes=2, attention="eager")
    expected = s * b * h * 10 + (s * b * h * 24 + 5 * a * s * s * b) // tp
    assert t.per_gpu(tp, sequence_parallel=False) == expected
    # with sequence parallelism everything is divided by t
    sp = (s * b * h * 34 + 5 * a * s * s * b) // tp
    assert t.per_gpu(tp, sequence_parallel=True) == sp


def test_korthikanti_recompute_policies() -> None:
    s, b, h, L = 512, 4, GPT.hidden_size, GPT.num_layers
    # pure bf16: Korthikanti assumes a 16-bit residual stream (under autocast it is fp32)
    base = dict(precision="bf16", attention="eager", batch=b, seq=s)
    full_layer = s * b * h * 34 + 5 * GPT.num_heads * s * s * b
    none = training_activations(GPT, RunConfig(**base), s)
    sel = training_activations(GPT, RunConfig(**base, checkpointing="selective-attn"), s)
    full = training_activations(GPT, RunConfig(**base, checkpointing="full"), s)
    assert none.per_layer == full_layer
    head = none.activations - L * full_layer
    # selective-attn: 34sbh per layer, one layer's scores are recomputed at a time
    assert sel.activations - head == L * 34 * s * b * h + 5 * GPT.num_heads * s * s * b
    # full: 2sbh per layer (the block input) + one block recomputed during backward
    assert full.activations - head == L * 2 * s * b * h + full_layer


def test_flash_attention_removes_the_score_term() -> None:
    s, b = 2048, 1
    eager = layer_terms(GPT, seq=s, batch=b, act_bytes=2, attention="eager")
    flash = layer_terms(GPT, seq=s, batch=b, act_bytes=2, attention="sdpa")
    a = GPT.num_heads
    # the 5as²b term goes; a fp32 logsumexp per row and head (4asb) comes
    assert eager.replicated + eager.split - (flash.replicated + flash.split) == (
        5 * a * s * s * b - 4 * a * s * b)


def test_lora_trainable_params_llama3_8b() -> None:
    # r(in + out) per adapted linear; r=16 on q,k,v,o of Llama-3-8B (GQA: k/v out = 1024):
    # 32 x 16 x ((4096+4096) + 2 x (4096+1024) + (4096+4096)) = 13,631,488 (peft reports this).
    run = RunConfig(mode="lora", precision="bf16-mixed", lora_rank=16)
    s = model_states(LLAMA3_8B, run)
    trainable = 13_631_488
    assert s.gradients == 2 * trainable
    assert s.optimizer_states == 12 * trainable
    assert s.weights == 2 * (8_030_261_248 + trainable)


def test_qlora_base_is_nf4() -> None:
    run = RunConfig(mode="qlora", precision="bf16-mixed", lora_rank=16)
    s = model_states(LLAMA3_8B, run)
    linear = 32 * (4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336)
    other = 8_030_261_248 - linear
    # NF4 + double quantization: 4.127 bits per parameter (QLoRA paper)
    expected = linear * 4.127 / 8 + other * 2 + 2 * 13_631_488
    assert s.weights == pytest.approx(expected, rel=1e-4)


def test_inference_int4_weights() -> None:
    p = plan(LLAMA3_8B, RunConfig(mode="inference", precision="bf16", weight_quant="int4"))
    linear = 32 * (4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336)
    # 4 bits + a 16-bit scale and zero per group of 128
    expected = linear * (0.5 + 4 / 128) + (8_030_261_248 - linear) * 2
    assert p.breakdown[C.WEIGHTS] == pytest.approx(expected, rel=1e-6)


def test_offload_moves_states_to_host() -> None:
    """ZeRO-Offload (DeepSpeed, the engine offload runs on): fp32 masters + AdamW states (12Ψ)
    and an fp32 gradient partition (4Ψ) on the host: 16Ψ, DeepSpeed's estimator's multiplier
    (stage_1_and_2.py: estimate_zero2_model_states_mem_needs); with the 16-bit parameters too
    18Ψ/N (stage3.py: estimate_zero3_model_states_mem_needs)."""
    model = ParamCountSpec(name="1B", params=10**9)
    p = plan(model, RunConfig(precision="bf16-mixed", offload_optimizer=True))
    assert p.breakdown[C.OPTIMIZER_STATES] == 0
    assert p.host_bytes == 16 * 10**9
    assert p.run.layout == "deepspeed" and "engine: DeepSpeed" in p.describe()
    p3 = plan(model, RunConfig(precision="bf16-mixed", parallel=Parallel(gpus=8, zero=3),
                               offload_optimizer=True, offload_params=True))
    assert p3.breakdown[C.WEIGHTS] == p3.breakdown[C.GRADIENTS] == 0
    assert p3.host_bytes == 18 * 10**9 // 8


def test_params_only_says_activations_unknown() -> None:
    p = plan(ParamCountSpec(name="7B", params=7 * 10**9), RunConfig())
    assert not p.activations_known
    assert p.to_dict()["per_gpu"]["breakdown"]["activations"] == 0
    assert any("activations unknown" in n for n in p.notes)


def test_pipeline_first_stage_holds_pp_microbatches() -> None:
    run1 = RunConfig(batch=1, seq=1024)
    piped = RunConfig(batch=1, seq=1024, parallel=Parallel(gpus=4, pp=4), grad_accum=8)
    per_layer = training_activations(LLAMA3_8B, run1, 1024).per_layer
    first = training_activations(LLAMA3_8B, piped, 1024, stage=0).activations
    last = training_activations(LLAMA3_8B, piped, 1024, stage=3).activations
    # 1F1B: the first stage keeps 4 micro-batches of its 8 layers = all 32 layers' worth
    # (+ the token ids and labels); the last stage keeps 1 micro-batch of 8 layers + the loss.
    assert first == 32 * per_layer + 4 * 2 * 8 * 1024
    assert 8 * per_layer < last < first


def test_optimizer_step_temporaries() -> None:
    # foreach AdamW takes exp_avg_sq.sqrt() out of place: one fp32 parameter-sized temporary,
    # the peak when no activations are known (torch/optim/adamw.py, _multi_tensor_adamw).
    model = ParamCountSpec(name="1B", params=10**9)
    p = plan(model, RunConfig(precision="fp32", optimizer="adamw"))
    assert p.breakdown[C.TEMPORARIES] == 4 * 10**9
    assert plan(model, RunConfig(precision="fp32", optimizer="sgd-momentum")).breakdown[
        C.TEMPORARIES] == 0
    offloaded = plan(model, RunConfig(precision="fp32", offload_optimizer=True))
    assert offloaded.breakdown[C.TEMPORARIES] == 0  # DeepSpeedCPUAdam steps on the host
    sharded = plan(model, RunConfig(precision="fp32", parallel=Parallel(gpus=8, zero=1)))
    assert sharded.breakdown[C.TEMPORARIES] == 4 * 10**9 // 8


def test_memory_shrinks_with_each_technique() -> None:
    base = RunConfig(batch=4, seq=2048, precision="bf16-mixed")
    total = plan(LLAMA3_8B, base).total_bytes
    from dataclasses import replace
    for change in ({"checkpointing": "full"}, {"optimizer": "adamw-8bit"}, {"mode": "lora"},
                   {"mode": "qlora"}, {"batch": 2}, {"offload_optimizer": True}):
        assert plan(LLAMA3_8B, replace(base, **change)).total_bytes < total, change


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"zero": 4}, "ZeRO|--zero"),
    ({"batch": 0}, "--batch"),
    ({"precision": "fp12"}, "precision"),
    ({"optimizer": "adamm"}, "adam"),
    ({"gpus": 6, "tp": 4}, "divisible"),
    ({"offload_params": True}, "--zero 3"),
    ({"mode": "inference", "zero": 1}, "inference"),
    ({"mode": "train", "weight_quant": "int4"}, "qlora"),
])
def test_bad_run_config(kwargs: dict, match: str) -> None:
    """Given flat, as plan files written before RunConfig held a Parallel name the layout
    (RunConfig.from_dict); the layout's own errors also come from Parallel directly."""
    with pytest.raises(MemfitError, match=match):
        RunConfig.from_dict(kwargs)


@pytest.mark.parametrize(("layout", "match"), [
    ({"gpus": 1, "zero": 4}, r"Parallel\(zero=4\)"),
    ({"gpus": 6, "tp": 4}, "does not divide gpus=6"),
])
def test_bad_parallel_in_run_config(layout: dict, match: str) -> None:
    with pytest.raises(MemfitError, match=match):
        RunConfig(parallel=Parallel(**layout))
    with pytest.raises(MemfitError, match=r"memfit\.Parallel"):
        RunConfig(parallel=layout)  # type: ignore[arg-type]


def test_tp_must_divide_heads() -> None:
    with pytest.raises(MemfitError, match="heads"):
        plan(LLAMA3_8B, RunConfig(parallel=Parallel(gpus=3, tp=3)))


def test_lora_needs_architecture() -> None:
    with pytest.raises(MemfitError, match="architecture"):
        plan(ParamCountSpec(name="7B", params=7 * 10**9), RunConfig(mode="lora"))


def test_every_preset_plans_in_every_mode() -> None:
    # The "well under 100 ms" per preset is timed in bench/speed_targets.py.
    from memfit.gpus import get_gpu
    from memfit.models import list_presets

    gpu = get_gpu("h100-80gb")
    runs = [RunConfig(), RunConfig(mode="lora"), RunConfig(mode="qlora", checkpointing="full"),
            RunConfig(mode="inference", precision="bf16", new_tokens=128),
            RunConfig(parallel=Parallel(gpus=8, zero=3), checkpointing="selective")]
    for spec in list_presets():
        for run in runs:
            p = plan(spec, run, gpu)
            assert p.total_bytes == sum(p.breakdown.values()) > 0


@pytest.mark.parametrize(("mode", "fix"), [("train", "fp16-mixed"), ("inference", "fp16")])
def test_bf16_on_a_t4_from_python_names_runconfigs_fix(mode: str, fix: str) -> None:
    # The planner cannot know its caller: the message keeps the CLI's flag and adds the
    # Python spelling, with the precision the T4 runs for this mode; that fix then plans.
    from memfit.gpus import get_gpu

    model = ParamCountSpec(name="1B", params=10**9)
    t4 = get_gpu("t4")
    with pytest.raises(MemfitError, match="no bf16 support") as info:
        plan(model, RunConfig(mode=mode), t4)
    assert f'RunConfig(precision="{fix}")' in str(info.value)
    assert "--precision fp16-mixed (fp16 for inference)" in str(info.value)
    assert plan(model, RunConfig(mode=mode, precision=fix), t4).total_bytes > 0
