"""SGLang 0.5.23's KV pool from hand-written configs: expected bytes and tokens computed by hand
from the rules memfit.serving.sglang cites, and three published SGLang startup logs reproduced
from their own figures (no downloads, no torch)."""

from __future__ import annotations

from typing import Any

import pytest

from memfit.errors import MemfitError
from memfit.serving import (
    SGLANG_SOURCE,
    SGLANG_VERSION,
    LayerKV,
    SGLangKVPool,
    default_mem_fraction_static,
    gpu_memory_defaults,
    kv_spec,
    mamba_cache_per_req,
    sglang_cell_size,
    sglang_kv_tokens,
    sglang_log_lines,
    sglang_plan,
)

GIB, MIB = 2**30, 2**20
H100_MIB, H200_MIB = 81559, 143771  # nvidia-smi --query-gpu=memory.total (MiB)

LLAMA_3_8B = {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32,
              "num_key_value_heads": 8, "num_hidden_layers": 32, "torch_dtype": "bfloat16",
              "max_position_embeddings": 8192, "architectures": ["LlamaForCausalLM"]}
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "hidden_size": 7168, "num_attention_heads": 128,
               "num_key_value_heads": 128, "num_hidden_layers": 61, "kv_lora_rank": 512,
               "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
               "torch_dtype": "bfloat16", "max_position_embeddings": 163840}
GPT_OSS_20B = {"model_type": "gpt_oss", "hidden_size": 2880, "num_attention_heads": 64,
               "num_key_value_heads": 8, "head_dim": 64, "num_hidden_layers": 24,
               "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 12,
               "torch_dtype": "bfloat16", "max_position_embeddings": 131072,
               "architectures": ["GptOssForCausalLM"]}
QWEN3_30B_A3B = {"model_type": "qwen3_moe", "hidden_size": 2048, "num_attention_heads": 32,
                 "num_key_value_heads": 4, "head_dim": 128, "num_hidden_layers": 48,
                 "torch_dtype": "bfloat16"}


def tokens(layers: list[LayerKV], *, after: int, pre: int, fraction: float,
           **kw: Any) -> SGLangKVPool:
    kw.setdefault("max_running_requests", 1)
    return sglang_kv_tokens(layers, available_bytes_after_weights=after, total_bytes=pre,
                            mem_fraction_static=fraction, **kw)


def test_source_is_recorded() -> None:
    assert SGLANG_VERSION == "0.5.23"
    assert "00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937" in SGLANG_SOURCE


def test_llama_3_8b_cell_size_and_tokens_by_hand() -> None:
    layers = kv_spec(LLAMA_3_8B)
    assert sglang_cell_size(layers) == 32 * 8 * 128 * 2 * 2 == 131072
    # 64 GiB free after the weights, 80 GiB before, --mem-fraction-static 0.75:
    # rest = 64 - 80 x 0.25 = 44 GiB; 131072 B = 1/8 MiB, so 8192 tokens per GiB
    pool = tokens(layers, after=64 * GIB, pre=80 * GIB, fraction=0.75)
    assert pool.kv_budget_bytes == 44 * GIB
    assert pool.max_total_num_tokens == 44 * 8192 == 360448
    # one padding page: K = (tokens + 1) x 8 heads x 128 x 2 B x 32 layers
    assert pool.full_k_bytes == pool.full_v_bytes == 360449 * 65536


def test_page_size_floors_and_max_total_tokens_caps() -> None:
    layers = kv_spec(LLAMA_3_8B)
    # rest = 63.4 - 80 x 0.25 = 43.4 GiB -> 43.4 x 8192 = 355532.8 -> 355532 tokens
    assert tokens(layers, after=int(63.4 * GIB), pre=80 * GIB,
                  fraction=0.75).max_total_num_tokens == 355532
    paged = tokens(layers, after=int(63.4 * GIB), pre=80 * GIB, fraction=0.75, page_size=64)
    assert paged.max_total_num_tokens == 5555 * 64 == 355520
    assert paged.full_k_bytes == (355520 + 64) * 65536  # the padding is one page
    capped = tokens(layers, after=64 * GIB, pre=80 * GIB, fraction=0.75, max_total_tokens=1000,
                    page_size=64)
    assert capped.max_total_num_tokens == 960


def test_max_running_requests_default_and_clamps() -> None:
    layers = kv_spec(LLAMA_3_8B)
    pool = tokens(layers, after=64 * GIB, pre=80 * GIB, fraction=0.75, max_running_requests=None,
                  context_len=8192)
    # int(360448 / 8192 x 512) = 22528, capped to 4096
    assert pool.max_running_requests == 4096
    small = tokens(layers, after=int(20.5 * GIB), pre=80 * GIB, fraction=0.75,
                   max_running_requests=None, context_len=131072)
    # 0.5 GiB -> 4096 tokens: int(4096 / 131072 x 512) = 16 -> floor 2048 = tokens // 2
    assert (small.max_total_num_tokens, small.max_running_requests) == (4096, 2048)
    assert tokens(layers, after=64 * GIB, pre=80 * GIB, fraction=0.75,
                  max_running_requests=10).max_running_requests == 10


def test_tp_shards_kv_heads_then_replicates() -> None:
    llama_70b = {**LLAMA_3_8B, "hidden_size": 8192, "num_attention_heads": 64,
                 "num_hidden_layers": 80}
    # 8 KV heads: one per rank at TP 8, still one (replicated) at TP 16
    assert sglang_cell_size(kv_spec(llama_70b, tp=8)) == 80 * 1 * 256 * 2 == 40960
    assert sglang_cell_size(kv_spec(llama_70b, tp=16)) == 40960
    assert sglang_cell_size(kv_spec(llama_70b, tp=2)) == 80 * 4 * 256 * 2


def test_fp8_kv_halves_the_cell_and_names_its_dtype() -> None:
    plan = sglang_plan(LLAMA_3_8B, total_bytes=80 * GIB, weights_bytes=16 * GIB,
                       mem_fraction_static=0.75, kv_cache_dtype="fp8_e4m3")
    assert plan.pool.cell_size == 32 * 8 * 256 * 1 == 65536
    # rest = 64 - 20 = 44 GiB, 16384 tokens per GiB
    assert plan.kv_cache_tokens == 44 * 16384
    assert "KV Cache is allocated. dtype: torch.float8_e4m3fn, #tokens: 720896, " in \
        plan.log_lines[0]
    # an FP8 checkpoint whose KV is quantized picks fp8 under "auto"
    quantized = {**LLAMA_3_8B, "quantization_config": {"kv_cache_quant_algo": "FP8"}}
    assert sglang_plan(quantized, total_bytes=80 * GIB, weights_bytes=16 * GIB,
                       mem_fraction_static=0.75).pool.cell_size == 65536
    with pytest.raises(MemfitError, match="fp8_e4m3"):  # vLLM's "fp8" is not SGLang's
        sglang_plan(LLAMA_3_8B, total_bytes=80 * GIB, weights_bytes=16 * GIB,
                    kv_cache_dtype="fp8")


def test_mla_latent_deepseek_v3() -> None:
    # (kv_lora_rank 512 + qk_rope_head_dim 64) x 61 layers x 2 bytes, not split by TP
    assert sglang_cell_size(kv_spec(DEEPSEEK_V3)) == 576 * 61 * 2 == 70272
    assert sglang_cell_size(kv_spec(DEEPSEEK_V3, tp=8)) == 70272
    fp8 = kv_spec(DEEPSEEK_V3, tp=8, kv_cache_dtype="fp8_e4m3")
    assert sglang_cell_size(fp8) == 576 * 61 == 35136
    pool = tokens(fp8, after=40 * GIB, pre=80 * GIB, fraction=0.75)  # rest 20 GiB
    assert pool.max_total_num_tokens == 20 * GIB // 35136 == 611191
    assert pool.full_v_bytes == 0  # one latent buffer: SGLang logs "KV size"
    assert sglang_log_lines(pool, dtype_name="torch.float8_e4m3fn") == [
        "KV Cache is allocated. dtype: torch.float8_e4m3fn, #tokens: 611191, "
        f"KV size: {611192 * 35136 / GIB:.2f} GB"]
    assert f"{611192 * 35136 / GIB:.2f}" == "20.00"


def test_gpt_oss_hybrid_swa_pools() -> None:
    layers = kv_spec(GPT_OSS_20B)
    per_layer = 8 * 64 * 2 * 2  # 2048 B per token per layer
    # HybridSWAPoolConfigurator: 12 full layers + 0.8 x 12 sliding layers
    assert sglang_cell_size(layers, hybrid_swa=True) == pytest.approx(
        12 * per_layer * 1.8)
    plan = sglang_plan(GPT_OSS_20B, total_bytes=80 * GIB, weights_bytes=14 * GIB,
                       mem_fraction_static=0.75)
    assert plan.hybrid_swa
    # rest = 66 - 20 = 46 GiB; cell 44236.8 B = 442368 / 10
    full = 46 * GIB * 10 // 442368
    assert plan.pool.full_tokens == plan.kv_cache_tokens == full == 1116539
    assert plan.pool.swa_tokens == full * 4 // 5 == 893231
    assert plan.log_lines[0] == ("Use sliding window memory pool. full_layer_tokens=1116539, "
                                 "swa_layer_tokens=893231")
    assert plan.log_lines[1].startswith("Full KV Cache is allocated. dtype: torch.bfloat16, "
                                        "#tokens: 1116539, K size: ")
    assert plan.log_lines[2].startswith("SWA KV Cache is allocated. dtype: torch.bfloat16, "
                                        "#tokens: 893231, K size: ")
    assert plan.pool.swa_k_bytes == (893231 + 1) * 12 * 8 * 64 * 2
    # --disable-hybrid-swa-memory: every layer full size in one pool
    one = sglang_plan(GPT_OSS_20B, total_bytes=80 * GIB, weights_bytes=14 * GIB,
                      mem_fraction_static=0.75, disable_hybrid_swa_memory=True)
    assert (one.pool.cell_size, one.pool.swa_tokens) == (24 * per_layer, 0)


def test_swa_pool_too_small_for_one_window_is_refused() -> None:
    # 0.1 GiB of KV: 2427 full tokens, 1941 SWA tokens; a 4096-token window cannot fit
    config = {**GPT_OSS_20B, "sliding_window": 4096}
    with pytest.raises(MemfitError, match="swa-full-tokens-ratio"):
        sglang_plan(config, total_bytes=80 * GIB, weights_bytes=int(59.9 * GIB),
                    mem_fraction_static=0.75)
    # the same budget serves gpt-oss's own 128-token window
    no_archs = {k: v for k, v in GPT_OSS_20B.items() if k != "architectures"}
    plan = sglang_plan(no_archs, total_bytes=80 * GIB, weights_bytes=int(59.9 * GIB),
                       mem_fraction_static=0.75)
    assert plan.hybrid_swa and plan.pool.swa_tokens == int(plan.pool.full_tokens * 0.8)


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"weights_bytes": 80 * GIB}, "fill the GPU"),
    ({"weights_bytes": -1}, "weights_bytes"),
    ({"page_size": 0}, "--page-size"),
    ({"max_model_len": 0}, "--max-model-len"),
    ({"swa_full_tokens_ratio": 1.5}, "swa-full-tokens-ratio"),
    ({"mem_fraction_static": 0}, "mem-fraction-static"),
    ({"tp": 3}, "--tp 3"),
])
def test_sglang_plan_bad_input_is_one_line(kwargs: dict[str, Any], words: str) -> None:
    args = {"total_bytes": 80 * GIB, "weights_bytes": 16 * GIB, **kwargs}
    with pytest.raises(MemfitError, match=words) as info:
        sglang_plan(LLAMA_3_8B, **args)
    assert "\n" not in str(info.value)


def test_gemma3_sliding_layers_stay_full_size_in_sglang() -> None:
    gemma3_27b = {"model_type": "gemma3_text", "hidden_size": 5376, "num_attention_heads": 32,
                  "num_key_value_heads": 16, "head_dim": 128, "num_hidden_layers": 62,
                  "sliding_window": 1024, "torch_dtype": "bfloat16",
                  "architectures": ["Gemma3ForCausalLM"], "max_position_embeddings": 131072}
    layers = kv_spec(gemma3_27b)
    assert sum(x.kind == "sliding" for x in layers) == 52
    # Gemma-3 is not a hybrid-SWA architecture in SGLang: all 62 layers at full size
    assert sglang_cell_size(layers) == 62 * 16 * 256 * 2 == 507904
    plan = sglang_plan(gemma3_27b, total_bytes=80 * GIB, weights_bytes=56 * GIB,
                       mem_fraction_static=0.75)
    assert not plan.hybrid_swa and plan.pool.swa_tokens == 0
    assert plan.kv_cache_tokens == 4 * GIB // 507904 == 8456


def test_gemma3n_shared_kv_layers_are_allocated() -> None:
    kinds = ["sliding_attention"] * 4 + ["full_attention"]
    config = {"model_type": "gemma3n", "torch_dtype": "bfloat16",
              "text_config": {"model_type": "gemma3n_text", "hidden_size": 2048,
                              "num_attention_heads": 8, "num_key_value_heads": 2,
                              "head_dim": 256, "num_hidden_layers": 10,
                              "layer_types": kinds * 2, "sliding_window": 512,
                              "num_kv_shared_layers": 5}}
    layers = kv_spec(config)
    assert sum(x.bytes_per_token for x in layers) == 5 * 2 * 512 * 2  # vLLM: 5 layers
    # SGLang's pool has a slot for every layer (layer_setup.py: resolve_layer_indices)
    assert sglang_cell_size(layers) == 10 * 2 * 512 * 2 == 20480


QWEN3_NEXT = {"model_type": "qwen3_next", "hidden_size": 2048, "num_attention_heads": 16,
              "num_key_value_heads": 2, "head_dim": 256, "num_hidden_layers": 8,
              "full_attention_interval": 4, "linear_num_key_heads": 16,
              "linear_num_value_heads": 32, "linear_key_head_dim": 128,
              "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
              "torch_dtype": "bfloat16"}


def test_hybrid_linear_state_pool_then_kv() -> None:
    layers = kv_spec(QWEN3_NEXT)
    # 6 linear layers: conv (2 x 16 x 128 + 32 x 128) x 3 in bf16 + SSM 32 x 128 x 128 in
    # float32 (SGLang's default mamba_ssm_dtype, not the model's)
    per_req = 6 * (8192 * 3 * 2 + 32 * 128 * 128 * 4)
    assert mamba_cache_per_req(layers) == per_req == 12877824
    assert sglang_cell_size(layers) == 2 * 2 * 512 * 2 == 4096  # the 2 full layers only
    # rest = 30 - 40 x 0.25 = 20 GiB; ratio 1 -> a 10 GiB Mamba budget:
    # (10 GiB - per_req) // per_req = 832 slots, 833 allocated with the padding slot
    pool = tokens(layers, after=30 * GIB, pre=40 * GIB, fraction=0.75,
                  mamba_full_memory_ratio=1.0, max_running_requests=None, context_len=262144)
    assert pool.max_mamba_cache_size == 832
    assert pool.kv_budget_bytes == 20 * GIB - 833 * per_req == 10747609088
    assert pool.max_total_num_tokens == 10747609088 // 4096 == 2623928
    assert pool.max_running_requests == 832 // 3  # 3 state slots per request
    assert pool.mamba_ssm_bytes == 833 * 6 * 32 * 128 * 128 * 4
    assert sglang_log_lines(pool)[0] == (
        "Mamba Cache is allocated. max_mamba_cache_size: 832, conv_state size: "
        f"{833 * 6 * 8192 * 3 * 2 / GIB:.2f}GB, ssm_state size: "
        f"{833 * 6 * 32 * 128 * 128 * 4 / GIB:.2f}GB ")


def test_weights_that_leave_nothing_are_refused_with_the_minimum_fraction() -> None:
    # 70 GiB of weights from 80 GiB: 1 - 10 / 80 = 0.875 is the least SGLang accepts
    with pytest.raises(MemfitError, match=r"above 0\.875"):
        tokens(kv_spec(LLAMA_3_8B), after=10 * GIB, pre=80 * GIB, fraction=0.8)
    with pytest.raises(MemfitError, match="mem-fraction-static"):
        tokens(kv_spec(LLAMA_3_8B), after=10 * GIB, pre=80 * GIB, fraction=1.5)


@pytest.mark.parametrize(("mib", "tp", "expected"), [
    (15360, 1, (2048, 8)),        # T4
    (23028, 1, (4096, 48)),       # A10
    (23028, 4, (4096, 160)),
    (40960, 1, (4096, 32)),       # A100 40GB
    (H100_MIB, 1, (8192, 256)),
    (H100_MIB, 4, (8192, 512)),
    (H200_MIB, 2, (8192, 256)),
    (183359, 8, (16384, 512)),    # B200
])
def test_chunked_prefill_and_cuda_graph_defaults_by_gpu(mib: int, tp: int,
                                                         expected: tuple[int, int]) -> None:
    assert gpu_memory_defaults(mib * MIB, tp) == expected


@pytest.mark.parametrize(("mib", "tp", "mla", "expected"), [
    # 512 + 1.5 x 8192 + 1 x 1024 / 8 + 2 x 256 + 8 x 58 prefill graphs = 13904 MiB
    (H100_MIB, 1, False, round((81559 - 13904) / 81559, 3)),
    # TP 8: + 1024 parallel slack, max_bs 512
    (H100_MIB, 8, False, round((81559 - (512 + 12288 + 1024 + 1024 + 464)) / 81559, 3)),
    # MLA: prefill graphs reserve a flat 1536 MiB
    (H100_MIB, 8, True, round((81559 - (512 + 12288 + 1024 + 1024 + 1536)) / 81559, 3)),
    (H200_MIB, 1, False, round((143771 - 13904) / 143771, 3)),
    # A10: 512 + 1.5 x 4096 + 128 + 2 x 48 + 8 x 50 = 7280 MiB, no 10 GiB floor below 60 GiB
    (23028, 1, False, round((23028 - 7280) / 23028, 3)),
    # T4: 512 + 1.5 x 2048 + 128 + 2 x 8 + 8 x 42 = 4064 MiB
    (15360, 1, False, round((15360 - 4064) / 15360, 3)),
])
def test_default_mem_fraction_static(mib: int, tp: int, mla: bool, expected: float) -> None:
    assert default_mem_fraction_static(mib * MIB, tp, mla=mla) == expected


def test_default_mem_fraction_static_values() -> None:
    assert default_mem_fraction_static(H100_MIB * MIB, 1) == 0.83
    assert default_mem_fraction_static(H200_MIB * MIB, 1) == 0.903
    # a small --cuda-graph-max-bs and no prefill graphs hit the 10 GiB floor on an H100
    assert default_mem_fraction_static(H100_MIB * MIB, 1, chunked_prefill_size=2048,
                                       cuda_graph_max_bs=8, prefill_cuda_graph=False) == \
        round((81559 - 10240) / 81559, 3)
    # max_running_requests lowers a default max_bs: 512 + 12288 + 128 + 2 x 16 + 464
    assert default_mem_fraction_static(H100_MIB * MIB, 1, max_running_requests=16) == \
        round((81559 - 13424) / 81559, 3)


def test_sglang_plan_on_an_h100_with_the_default_fraction() -> None:
    # 500 MiB outside torch, 15 GiB of weights: in MiB, 81059 free before the weights,
    # 65699 after; rest = 65699 - 0.17 x 81059 = 51918.97 MiB, 8 tokens per MiB
    plan = sglang_plan(LLAMA_3_8B, total_bytes=H100_MIB * MIB, weights_bytes=15 * GIB,
                       non_torch_bytes=500 * MIB, tp=1)
    assert (plan.mem_fraction_static, plan.mem_fraction_static_is_default) == (0.83, True)
    assert plan.kv_cache_tokens == 415351
    assert plan.log_lines == (
        "KV Cache is allocated. dtype: torch.bfloat16, #tokens: 415351, "
        f"K size: {415352 * 65536 / GIB:.2f} GB, V size: {415352 * 65536 / GIB:.2f} GB",
        "max_total_num_tokens=415351, chunked_prefill_size=8192, max_prefill_tokens=16384, "
        "max_running_requests=4096, context_len=8192")
    assert plan.to_json()["kv_cache_tokens"] == 415351


# Published SGLang startup logs, reproduced from their own stated figures.

def test_published_log_sglang_pr_18263_budget_to_tokens() -> None:
    """https://github.com/sgl-project/sglang/pull/18263 (Qwen3-30B-A3B-Instruct-2507-FP8, TP 1,
    MI355X, with that PR's budget): "Case 2: candidate_kv_budget 164149629787 / 152.88 GB" then
    "KV Cache is allocated. dtype: torch.bfloat16, #tokens: 1669816, K size: 76.44 GB, V size:
    76.44 GB". The FP8 checkpoint keeps a bf16 KV: 48 layers x 4 KV heads x (128 + 128) x 2 B."""
    layers = kv_spec(QWEN3_30B_A3B)
    assert sglang_cell_size(layers) == 48 * 4 * 256 * 2 == 98304
    budget = 164149629787
    # --mem-fraction-static 1 leaves no slack: the budget is the bytes given
    pool = tokens(layers, after=budget, pre=budget, fraction=1.0)
    assert pool.max_total_num_tokens == 1669816
    assert sglang_log_lines(pool) == [
        "KV Cache is allocated. dtype: torch.bfloat16, #tokens: 1669816, K size: 76.44 GB, "
        "V size: 76.44 GB"]


def test_published_log_sglang_pr_18263_rest_memory() -> None:
    """Same log: "Load weight end. ... avail mem=230.20 GB, mem usage=56.98 GB.",
    "self.server_args.mem_fraction_static 0.911", "initial available_bytes 219721119039 /
    204.63 GB". The free memory before the weights is 230.20 + 56.98 GB; both figures are
    rounded to 0.01 GB and measured a moment apart from SGLang's own, so within 0.02 GiB."""
    after, pre = int(230.20 * GIB), int((230.20 + 56.98) * GIB)
    pool = tokens(kv_spec(QWEN3_30B_A3B), after=after, pre=pre, fraction=0.911)
    assert abs(pool.kv_budget_bytes - 219721119039) < 0.02 * GIB


def test_published_log_sglang_issue_18262_k_size_from_tokens() -> None:
    """https://github.com/sgl-project/sglang/issues/18262 (a 5-layer Qwen3-30B-A3B, TP 1):
    "KV Cache is allocated. #tokens: 21985288, K size: 104.83 GB, V size: 104.83 GB"."""
    layers = kv_spec({**QWEN3_30B_A3B, "num_hidden_layers": 5})
    pool = tokens(layers, after=21985288 * 10240, pre=21985288 * 10240, fraction=1.0)
    assert pool.max_total_num_tokens == 21985288
    assert sglang_log_lines(pool)[0].endswith("#tokens: 21985288, K size: 104.83 GB, "
                                              "V size: 104.83 GB")


def test_published_log_vllm_issue_21348_qwen3_235b_tp4() -> None:
    """https://github.com/vllm-project/vllm/issues/21348 (Qwen3-235B-A22B-FP8, --tp 4, 4xH100,
    --mem-fraction-static 0.93): "KV Cache is allocated. #tokens: 367404, K size: 8.23 GB,
    V size: 8.23 GB". 94 layers, 4 KV heads -> 1 per rank, head_dim 128, bf16 KV."""
    qwen3_235b = {**QWEN3_30B_A3B, "hidden_size": 4096, "num_attention_heads": 64,
                  "num_hidden_layers": 94}
    layers = kv_spec(qwen3_235b, tp=4)
    assert sglang_cell_size(layers) == 94 * 1 * 256 * 2 == 48128
    pool = tokens(layers, after=367404 * 48128, pre=367404 * 48128, fraction=1.0)
    assert sglang_log_lines(pool)[0].endswith("#tokens: 367404, K size: 8.23 GB, "
                                              "V size: 8.23 GB")
