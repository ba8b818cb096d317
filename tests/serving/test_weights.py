"""Per-rank weights as vLLM 0.33.0 lays them out: bytes computed by hand from the shapes."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from memfit.errors import MemfitError
from memfit.serving.weights import (
    QUANT_FORMATS,
    check_quant,
    linear_bytes,
    pad_vocab_size,
    rope_cache_bytes,
    weights_from_checkpoint,
    weights_from_config,
)

LLAMA3_8B = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
             "intermediate_size": 14336, "vocab_size": 128256, "torch_dtype": "bfloat16"}


def test_llama3_8b_bf16_one_gpu_is_its_parameter_count_times_two() -> None:
    # 8,030,261,248 parameters (facts.md, reference counts) in bf16
    assert weights_from_config(LLAMA3_8B).total == 8_030_261_248 * 2


def test_llama3_8b_bf16_per_rank_at_tp2_by_hand() -> None:
    w = weights_from_config(LLAMA3_8B, tp=2)
    # 128256 is a multiple of 64: 64128 rows per rank, embedding and head each
    embedding = 64128 * 4096 * 2
    # per layer: q 4096x(16x128), k and v 4096x(4x128), o (16x128)x4096,
    # gate+up 4096x(2x7168), down 7168x4096; two norms replicated
    layer = (4096 * 2048 + 2 * 4096 * 512 + 2048 * 4096 + 4096 * 14336 + 7168 * 4096) * 2
    norms = (32 * 2 + 1) * 4096 * 2
    assert w.parts["embedding"] == w.parts["lm_head"] == embedding
    # 1,050,673,152 + 32 x 218,103,808 + 532,480
    assert w.total == 2 * embedding + 32 * layer + norms == 8_030_527_488


def test_rope_cache_is_counted_once_per_rank() -> None:
    llama31 = {**LLAMA3_8B, "max_position_embeddings": 131072}
    # [131072, 128] in bf16: 32 MiB, one per model (get_rope caches it), replicated under TP
    assert rope_cache_bytes(llama31, 2) == 32 * 2**20
    assert weights_from_config(llama31, tp=4).parts["rope_cache"] == 32 * 2**20
    assert weights_from_config(llama31).total == 8_030_261_248 * 2 + 32 * 2**20
    # a partial rotary factor shortens the rows (Phi-2: 0.4 of 80 = 32)
    assert rope_cache_bytes({"hidden_size": 2560, "num_attention_heads": 32,
                             "partial_rotary_factor": 0.4,
                             "max_position_embeddings": 2048}, 2) == 2048 * 32 * 2
    assert rope_cache_bytes({"model_type": "gpt2", "max_position_embeddings": 1024}, 2) == 0


def test_vocab_padded_to_64_before_the_split() -> None:
    assert pad_vocab_size(32001) == 32064
    cfg = {**LLAMA3_8B, "vocab_size": 32001}
    # 32064 / 4 = 8016 rows of 4096 bf16 on each of 4 ranks
    assert weights_from_config(cfg, tp=4).parts["embedding"] == 8016 * 4096 * 2


def test_kv_heads_replicated_when_tp_exceeds_them() -> None:
    cfg = {**LLAMA3_8B, "num_key_value_heads": 2}
    at4, at8 = weights_from_config(cfg, tp=4), weights_from_config(cfg, tp=8)
    # tp 8 > 2 KV heads: each rank keeps one head (k and v: 4096 x 128), not a quarter
    q8, o8 = 4096 * 4 * 128, 4 * 128 * 4096
    assert at8.parts["attention"] == 32 * (q8 + 2 * 4096 * 128 + o8) * 2
    q4, o4 = 4096 * 8 * 128, 8 * 128 * 4096
    assert at4.parts["attention"] == 32 * (q4 + 2 * 4096 * 128 + o4) * 2


def test_tied_embeddings_counted_once() -> None:
    tied = weights_from_config({**LLAMA3_8B, "tie_word_embeddings": True})
    untied = weights_from_config(LLAMA3_8B)
    assert tied.parts["lm_head"] == 0
    assert untied.total - tied.total == 128256 * 4096 * 2


def test_awq_int4_layer_packed_bytes_by_hand() -> None:
    # 4096 -> 4096, groups of 128: qweight int32 [4096, 512] (8 nibbles per int32),
    # qzeros int32 [32, 512], scales fp16 [32, 4096]
    expected = 4096 * 512 * 4 + 32 * 512 * 4 + 32 * 4096 * 2
    assert expected == 8_716_288
    assert linear_bytes(4096, 4096, dtype_bytes=2, quant=QUANT_FORMATS["awq"]) == expected
    # a quarter of the bf16 layer's 32 MiB, plus 320 KiB of zeros and scales
    assert expected - 4096 * 4096 * 2 // 4 == 320 * 1024


def test_gptq_fp8_nvfp4_layer_bytes_by_hand() -> None:
    gptq = linear_bytes(4096, 11008, dtype_bytes=2, quant=QUANT_FORMATS["gptq"])
    assert gptq == 512 * 11008 * 4 + 32 * 1376 * 4 + 32 * 11008 * 2
    # channelwise GPTQ (group -1): one scale and zero row
    channel = linear_bytes(4096, 4096, dtype_bytes=2, quant=QUANT_FORMATS["gptq"], group_size=-1)
    assert channel == 512 * 4096 * 4 + 512 * 4 + 4096 * 2
    # fp8: one byte per weight, one float32 scale per fused shard (q, k, v)
    assert linear_bytes(4096, 6144, dtype_bytes=2, quant=QUANT_FORMATS["fp8"], shards=3) == \
        4096 * 6144 + 3 * 4
    # nvfp4: two weights per byte, one e4m3 scale per 16, two float32 per shard
    assert linear_bytes(4096, 4096, dtype_bytes=2, quant=QUANT_FORMATS["nvfp4"]) == \
        4096 * 2048 + 4096 * 256 + 8


def test_awq_llama3_8b_by_hand() -> None:
    awq = weights_from_config(LLAMA3_8B, quant=QUANT_FORMATS["awq"])
    # groups of 128; qweight int32 [in, out/8], qzeros int32 [in/128, out/8], scales [in/128, out]
    qkv = 4096 * 768 * 4 + 32 * 768 * 4 + 32 * 6144 * 2  # 13,074,432
    o = 4096 * 512 * 4 + 32 * 512 * 4 + 32 * 4096 * 2  # 8,716,288
    gate_up = 4096 * 3584 * 4 + 32 * 3584 * 4 + 32 * 28672 * 2  # 61,014,016
    down = 14336 * 512 * 4 + 112 * 512 * 4 + 112 * 4096 * 2  # 30,507,008
    assert awq.parts["attention"] == 32 * (qkv + o)
    assert awq.parts["mlp"] == 32 * (gate_up + down)
    # embedding, head and norms stay bf16 (AWQ quantizes LinearBase layers only)
    assert awq.parts["embedding"] == awq.parts["lm_head"] == 128256 * 4096 * 2
    # 5.73 GB: the size of the published AWQ checkpoints of Llama-3-8B
    assert awq.total == 5_727_854_592


def test_quant_refusals() -> None:
    with pytest.raises(MemfitError, match=r"compute capability 7\.5"):
        check_quant("fp8", "7.0")  # V100
    with pytest.raises(MemfitError, match="bitsandbytes"):
        check_quant("bnb-4bit", "9.0")
    with pytest.raises(MemfitError, match="did you mean 'awq'"):
        check_quant("awk", "9.0")
    fmt = check_quant("gptq", "7.0")
    assert fmt is not None and fmt.min_capability == 60
    assert check_quant("nvfp4", "7.5") is not None


def _write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], int]]) -> None:
    """A real safetensors file of zeros: name -> (dtype, shape, bytes per element)."""
    header, offset = {}, 0
    for name, (dtype, shape, size) in tensors.items():
        n = size
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * offset)


def test_checkpoint_headers_sharded_by_role(tmp_path: Path) -> None:
    cfg = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
           "vocab_size": 100, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    _write_safetensors(tmp_path / "model.safetensors", {
        "model.embed_tokens.weight": ("F32", [100, 64], 4),  # float32: served in bf16
        "lm_head.weight": ("BF16", [100, 64], 2),
        "model.layers.0.self_attn.q_proj.weight": ("BF16", [64, 64], 2),
        "model.layers.0.self_attn.k_proj.weight": ("BF16", [32, 64], 2),
        "model.layers.0.self_attn.o_proj.qweight": ("I32", [64, 8], 4),
        "model.layers.0.mlp.down_proj.weight": ("BF16", [64, 128], 2),
        "model.layers.0.input_layernorm.weight": ("BF16", [64], 2),
    })
    w4 = weights_from_checkpoint(tmp_path, cfg, tp=4, dtype_bytes=2)
    # vocab 100 pads to 128: 32 rows of 64 bf16 per rank, embedding and head
    assert w4.parts["embedding"] == w4.parts["lm_head"] == 32 * 64 * 2
    # q / 4; k: tp 4 > 2 KV heads, one head's share (half); o (packed) / 4; norm whole
    assert w4.parts["attention"] == 64 * 64 * 2 // 4 + 32 * 64 * 2 // 2 + 64 * 8 * 4 // 4
    assert w4.parts["mlp"] == 64 * 128 * 2 // 4
    assert w4.parts["norms"] == 64 * 2


def test_checkpoint_tied_head_stored_twice_counted_once(tmp_path: Path) -> None:
    cfg = {"hidden_size": 64, "num_attention_heads": 4, "vocab_size": 128,
           "tie_word_embeddings": True}
    _write_safetensors(tmp_path / "model.safetensors", {
        "model.embed_tokens.weight": ("BF16", [128, 64], 2),
        "lm_head.weight": ("BF16", [128, 64], 2),
    })
    w = weights_from_checkpoint(tmp_path, cfg, tp=1, dtype_bytes=2)
    assert w.total == 128 * 64 * 2


def test_checkpoint_expert_blocks_split_row_bias_whole(tmp_path: Path) -> None:
    # gpt-oss names its MXFP4 experts gate_up_proj_blocks / _scales / _bias, down_proj_*
    cfg = {"hidden_size": 64, "num_attention_heads": 4, "vocab_size": 128}
    _write_safetensors(tmp_path / "model.safetensors", {
        "model.layers.0.mlp.experts.gate_up_proj_blocks": ("U8", [4, 256, 2, 16], 1),
        "model.layers.0.mlp.experts.gate_up_proj_bias": ("BF16", [4, 256], 2),
        "model.layers.0.mlp.experts.down_proj_blocks": ("U8", [4, 64, 4, 16], 1),
        "model.layers.0.mlp.experts.down_proj_bias": ("BF16", [4, 64], 2),
        "model.layers.0.mlp.router.weight": ("BF16", [4, 64], 2),
    })
    w = weights_from_checkpoint(tmp_path, cfg, tp=2, dtype_bytes=2)
    sharded = (4 * 256 * 2 * 16 + 4 * 256 * 2 + 4 * 64 * 4 * 16) // 2
    whole = 4 * 64 * 2 + 4 * 64 * 2  # the row-parallel bias and the router
    assert w.parts["mlp"] == sharded + whole


def test_an_untold_tie_follows_the_config_class() -> None:
    """A config.json without ``tie_word_embeddings`` gets the config class's default: Gemma's
    ties (one tensor), Llama's does not."""
    from memfit.serving.weights import weights_from_config

    gemma = {"model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
             "head_dim": 16, "vocab_size": 1024, "torch_dtype": "bfloat16"}
    assert weights_from_config(gemma).parts["lm_head"] == 0
    # 1024 rows (a multiple of 64) x 64 x 2 bytes
    assert weights_from_config({**gemma, "model_type": "llama"}).parts["lm_head"] == 1024 * 64 * 2
    assert weights_from_config({**gemma, "tie_word_embeddings": False}).parts["lm_head"] == \
        1024 * 64 * 2


def test_qwen25_vl_without_use_sliding_window_is_full_attention() -> None:
    """Qwen2.5-VL's config sets ``sliding_window`` but ``use_sliding_window: false``: the text
    config class then gives every layer full attention, as Qwen2's does."""
    from memfit.serving import kv_spec

    cfg = {"model_type": "qwen2_5_vl", "hidden_size": 3584, "num_hidden_layers": 28,
           "num_attention_heads": 28, "num_key_value_heads": 4, "sliding_window": 32768,
           "use_sliding_window": False, "max_window_layers": 28, "torch_dtype": "bfloat16"}
    assert {layer.kind for layer in kv_spec(cfg)} == {"full"}
