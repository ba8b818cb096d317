"""Each layer's KV cache from hand-written config dicts; expected bytes computed by hand from the
formulas the module cites (no downloads, no torch)."""

from __future__ import annotations

import pytest

from memfit.errors import MemfitError
from memfit.serving import kv_spec, model_context_length

LLAMA_3_8B = {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32,
              "num_key_value_heads": 8, "num_hidden_layers": 32, "torch_dtype": "bfloat16",
              "max_position_embeddings": 8192}


def per_token(layers) -> int:
    return sum(layer.bytes_per_token for layer in layers)


def test_llama_3_8b_gqa() -> None:
    layers = kv_spec(LLAMA_3_8B)
    # 32 layers x 8 KV heads x 128 head_dim x 2 (K, V) x 2 bytes
    assert per_token(layers) == 32 * 8 * 128 * 2 * 2 == 131072
    assert {(x.kind, x.num_kv_heads, x.head_size) for x in layers} == {("full", 8, 128)}


def test_mqa_and_fp8() -> None:
    mqa = {**LLAMA_3_8B, "num_key_value_heads": 1}
    assert per_token(kv_spec(mqa)) == 32 * 1 * 128 * 2 * 2
    assert per_token(kv_spec(LLAMA_3_8B, kv_cache_dtype="fp8")) == 32 * 8 * 128 * 2 * 1


def test_qwen3_explicit_head_dim() -> None:
    # Qwen3-0.6B: hidden 1024 / 16 heads is 64, but head_dim is 128
    qwen3 = {"model_type": "qwen3", "hidden_size": 1024, "num_attention_heads": 16,
             "num_key_value_heads": 8, "num_hidden_layers": 28, "head_dim": 128,
             "torch_dtype": "bfloat16"}
    assert per_token(kv_spec(qwen3)) == 28 * 8 * 128 * 2 * 2 == 114688
    # without the key, Qwen3Config's default (128), not hidden / heads
    del qwen3["head_dim"]
    assert per_token(kv_spec(qwen3)) == 114688


def test_tp_splits_then_replicates_kv_heads() -> None:
    assert per_token(kv_spec(LLAMA_3_8B, tp=2)) == 32 * 4 * 128 * 2 * 2
    assert per_token(kv_spec(LLAMA_3_8B, tp=8)) == 32 * 1 * 128 * 2 * 2
    # tp 16 > 8 KV heads: one head per rank, replicated twice
    assert per_token(kv_spec(LLAMA_3_8B, tp=16)) == 32 * 1 * 128 * 2 * 2


@pytest.mark.parametrize(("heads", "kv_heads", "tp", "words"), [
    (32, 8, 3, "num_attention_heads (32)"),   # verify_with_parallel_config
    (24, 8, 6, "KV heads (8)"),                # divide(8, 6)
    (24, 8, 12, "multiple of the 8 KV heads"),  # divide(12, 8)
])
def test_tp_the_engine_refuses(heads: int, kv_heads: int, tp: int, words: str) -> None:
    config = {**LLAMA_3_8B, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "hidden_size": heads * 128}
    with pytest.raises(MemfitError, match=words.replace("(", r"\(").replace(")", r"\)")):
        kv_spec(config, tp=tp)


def test_unknown_kv_dtype() -> None:
    with pytest.raises(MemfitError, match="unknown --kv-cache-dtype 'int4'"):
        kv_spec(LLAMA_3_8B, kv_cache_dtype="int4")


def test_mistral_window_on_every_layer() -> None:
    # no layer_types: vLLM's CacheConfig.sliding_window applies to every layer
    config = {**LLAMA_3_8B, "model_type": "mistral", "sliding_window": 4096}
    assert {(x.kind, x.sliding_window) for x in kv_spec(config)} == {("sliding", 4096)}
    assert {x.kind for x in kv_spec({**config, "sliding_window": None})} == {"full"}


def test_qwen_window_only_with_use_sliding_window() -> None:
    # Qwen2.5 configs carry sliding_window 131072 with use_sliding_window false: no window
    config = {"model_type": "qwen2", "hidden_size": 3584, "num_attention_heads": 28,
              "num_key_value_heads": 4, "num_hidden_layers": 4, "sliding_window": 131072,
              "use_sliding_window": False}
    assert {x.kind for x in kv_spec(config)} == {"full"}


def test_mistral_style_window_on_every_layer_via_layer_types() -> None:
    config = {**LLAMA_3_8B, "model_type": "mistral", "sliding_window": 4096,
              "layer_types": ["sliding_attention"] * 32}
    layers = kv_spec(config)
    assert {(x.kind, x.sliding_window) for x in layers} == {("sliding", 4096)}
    assert per_token(layers) == 131072  # a window bounds the tokens kept, not the bytes each


def test_gemma2_alternates_from_layer_0() -> None:
    config = {"model_type": "gemma2", "hidden_size": 3584, "num_attention_heads": 16,
              "num_key_value_heads": 8, "num_hidden_layers": 4, "sliding_window": 4096}
    layers = kv_spec(config)
    # Gemma2Config.layer_types: sliding where (i + 1) % 2, head_dim 256 by default
    assert [x.kind for x in layers] == ["sliding", "full", "sliding", "full"]
    assert per_token(layers) == 4 * 8 * 256 * 2 * 2


def test_gemma3_pattern_of_six() -> None:
    config = {"model_type": "gemma3_text", "hidden_size": 1152, "num_attention_heads": 4,
              "num_key_value_heads": 1, "num_hidden_layers": 12, "sliding_window": 512}
    kinds = [x.kind for x in kv_spec(config)]
    assert [i for i, k in enumerate(kinds) if k == "full"] == [5, 11]


def test_gemma3_multimodal_reads_text_config() -> None:
    config = {"model_type": "gemma3", "torch_dtype": "bfloat16",
              "text_config": {"model_type": "gemma3_text", "hidden_size": 2560,
                              "num_attention_heads": 8, "num_key_value_heads": 4,
                              "num_hidden_layers": 6, "sliding_window": 1024,
                              "max_position_embeddings": 131072},
              "vision_config": {"hidden_size": 1152}}
    layers = kv_spec(config)
    assert per_token(layers) == 6 * 4 * 256 * 2 * 2
    assert model_context_length(config) == 131072


def test_gpt_oss_sinks_and_alternating_windows() -> None:
    config = {"model_type": "gpt_oss", "hidden_size": 2880, "num_attention_heads": 64,
              "num_key_value_heads": 8, "head_dim": 64, "num_hidden_layers": 4,
              "sliding_window": 128,
              "layer_types": ["sliding_attention", "full_attention"] * 2}
    layers = kv_spec(config)
    assert [(x.kind, x.sliding_window) for x in layers] == [
        ("sliding", 128), ("full", None), ("sliding", 128), ("full", None)]
    assert all(x.sinks for x in layers)
    assert per_token(layers) == 4 * 8 * 64 * 2 * 2  # the sinks hold no cache


def test_qwen2_sliding_from_max_window_layers() -> None:
    config = {"model_type": "qwen2", "hidden_size": 896, "num_attention_heads": 14,
              "num_key_value_heads": 2, "num_hidden_layers": 4, "use_sliding_window": True,
              "sliding_window": 4096, "max_window_layers": 2}
    assert [x.kind for x in kv_spec(config)] == ["full", "full", "sliding", "sliding"]


DEEPSEEK_V3 = {"model_type": "deepseek_v3", "hidden_size": 7168, "num_attention_heads": 128,
               "num_key_value_heads": 128, "num_hidden_layers": 61, "kv_lora_rank": 512,
               "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
               "torch_dtype": "bfloat16", "max_position_embeddings": 163840}


def test_mla_latent_one_head_not_split_by_tp() -> None:
    layers = kv_spec(DEEPSEEK_V3)
    # (kv_lora_rank 512 + qk_rope_head_dim 64) x 2 bytes per layer, one "head"
    assert {(x.kind, x.num_kv_heads, x.head_size) for x in layers} == {("mla", 1, 576)}
    assert per_token(layers) == 61 * 576 * 2 == 70272
    assert per_token(kv_spec(DEEPSEEK_V3, tp=8)) == 70272
    assert per_token(kv_spec(DEEPSEEK_V3, kv_cache_dtype="fp8")) == 61 * 576
    # 128 query heads as full K/V would be 128 x (192 + 128) x 2 bytes per layer: 71x more
    assert per_token(layers) * 71 < 61 * 128 * (192 + 128) * 2


def test_jamba_mamba1_state() -> None:
    config = {"model_type": "jamba", "hidden_size": 4096, "num_attention_heads": 32,
              "num_key_value_heads": 8, "num_hidden_layers": 8, "attn_layer_period": 8,
              "attn_layer_offset": 4, "mamba_expand": 2, "mamba_d_state": 16,
              "mamba_d_conv": 4, "torch_dtype": "bfloat16"}
    layers = kv_spec(config)
    assert [x.kind for x in layers] == ["mamba"] * 4 + ["full"] + ["mamba"] * 3
    # d_inner 8192: conv 8192 x 3 + ssm 8192 x 16, 2 bytes
    assert layers[0].state_bytes == (8192 * 3 + 8192 * 16) * 2 == 311296
    assert kv_spec(config, tp=2)[0].state_bytes == 311296 // 2
    assert per_token(layers) == 8 * 128 * 2 * 2  # one attention layer


def test_nemotron_h_mamba2_state_and_mlp_layers() -> None:
    config = {"model_type": "nemotron_h", "hidden_size": 4096, "num_attention_heads": 32,
              "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 4,
              "hybrid_override_pattern": "M-M*", "mamba_num_heads": 128, "mamba_head_dim": 64,
              "n_groups": 8, "ssm_state_size": 128, "conv_kernel": 4,
              "torch_dtype": "bfloat16"}
    layers = kv_spec(config)
    assert [(x.index, x.kind) for x in layers] == [(0, "mamba"), (2, "mamba"), (3, "full")]
    # conv (4 - 1) x (128 x 64 + 2 x 8 x 128) in bf16 + ssm 128 x 64 x 128 in float32
    # (NemotronHForCausalLMConfig's default mamba_ssm_cache_dtype)
    assert layers[0].state_bytes == 3 * 10240 * 2 + 128 * 64 * 128 * 4 == 4255744
    # tp 2: every state dimension split; 8 groups divide
    assert kv_spec(config, tp=2)[0].state_bytes == 4255744 // 2
    bf16 = kv_spec({**config, "mamba_ssm_cache_dtype": "bfloat16"})[0]
    assert bf16.state_bytes == (3 * 10240 + 128 * 64 * 128) * 2


def test_nemotron_h_pads_groups_tp_does_not_divide() -> None:
    config = {"model_type": "nemotron_h", "hidden_size": 1024, "num_attention_heads": 8,
              "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 2,
              "hybrid_override_pattern": "M*", "mamba_num_heads": 16, "mamba_head_dim": 64,
              "n_groups": 1, "ssm_state_size": 128, "conv_kernel": 4,
              "torch_dtype": "bfloat16"}
    # one group replicated to 4 (extra_groups_for_head_shards): conv width 16 x 64 + 2 x 4 x 128
    conv_per_rank = (16 * 64 + 2 * 4 * 128) // 4
    state = kv_spec(config, tp=4)[0]
    assert sorted(map(sorted, state.state_shapes)) == [[3, conv_per_rank], [4, 64, 128]]


def test_qwen3_next_gated_delta_net_state() -> None:
    config = {"model_type": "qwen3_next", "hidden_size": 2048, "num_attention_heads": 16,
              "num_key_value_heads": 2, "head_dim": 256, "num_hidden_layers": 8,
              "full_attention_interval": 4, "linear_num_key_heads": 16,
              "linear_num_value_heads": 32, "linear_key_head_dim": 128,
              "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
              "torch_dtype": "bfloat16"}
    layers = kv_spec(config)
    assert [x.index for x in layers if x.kind == "full"] == [3, 7]
    # conv (2 x 16 x 128 + 32 x 128) x 3, recurrent 32 x 128 x 128, 2 bytes
    assert layers[0].kind == "linear"
    assert layers[0].state_bytes == (8192 * 3 + 32 * 128 * 128) * 2 == 1097728


def test_gemma3n_shared_kv_layers_hold_no_cache() -> None:
    kinds = ["sliding_attention"] * 4 + ["full_attention"]
    config = {"model_type": "gemma3n", "torch_dtype": "bfloat16",
              "text_config": {"model_type": "gemma3n_text", "hidden_size": 2048,
                              "num_attention_heads": 8, "num_key_value_heads": 2,
                              "head_dim": 256, "num_hidden_layers": 10,
                              "layer_types": kinds * 2, "sliding_window": 512,
                              "num_kv_shared_layers": 5}}
    layers = kv_spec(config)
    shared = [(x.index, x.shares_with) for x in layers if x.kind == "shared"]
    # the last sliding layer before layer 5 is 3, the last full one 4
    assert shared == [(5, 3), (6, 3), (7, 3), (8, 3), (9, 4)]
    assert per_token(layers) == 5 * 2 * 256 * 2 * 2  # five layers hold KV, not ten


def test_context_length_and_rope_scaling() -> None:
    assert model_context_length(LLAMA_3_8B) == 8192
    # YaRN and llama3 leave max_position_embeddings already scaled; linear multiplies it
    yarn = {**LLAMA_3_8B, "max_position_embeddings": 32768,
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                             "original_max_position_embeddings": 8192}}
    assert model_context_length(yarn) == 32768
    linear = {**LLAMA_3_8B, "rope_scaling": {"type": "linear", "factor": 4.0}}
    assert model_context_length(linear) == 4 * 8192
    llama3 = {**LLAMA_3_8B, "max_position_embeddings": 131072,
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    assert model_context_length(llama3) == 131072
