"""Hybrid Mamba / linear-attention models with vLLM's prefix caching (``mamba_cache_mode``
``align``), hand-computed from the rules memfit.serving.vllm cites:

- the attention block is the smallest multiple of ``lcm(max(16, --block-size), the state
  layers' prefill-checkpoint alignment)`` whose page holds a state, rounded to 16
  (``vllm/platforms/interface.py: Platform._align_hybrid_block_size``); the Mamba block is that
  block (``cache_config.mamba_block_size = block_size``);
- each Mamba group holds ``2 + num_prefill_checkpoint_blocks`` state pages per request
  (``vllm/v1/kv_cache_interface.py: MambaSpec.max_memory_usage_bytes``), one without prefix
  caching;
- Qwen3-Next's gated-delta-net layer checkpoints every 64 tokens with one extra page when the
  FlashInfer GDN prefill kernel runs (SM90; ``gdn/qwen_gdn_linear_attn.py``), Nemotron-H's
  ``MambaMixer2`` keeps one checkpoint page with no alignment, Jamba's ``MambaMixer`` neither.
"""

from __future__ import annotations

import pytest

from memfit.serving import serve_plan
from memfit.serving.vllm import align_hybrid_block_size, mamba_prefill_checkpoints

GiB = 2**30

QWEN3_NEXT = {"model_type": "qwen3_next", "hidden_size": 2048, "num_attention_heads": 16,
              "num_key_value_heads": 2, "head_dim": 256, "num_hidden_layers": 8,
              "full_attention_interval": 4, "linear_num_key_heads": 16,
              "linear_num_value_heads": 32, "linear_key_head_dim": 128,
              "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
              "torch_dtype": "bfloat16", "max_position_embeddings": 32768}
# attention: 2 KV heads x (256 + 256) x 2 B = 2048 B a token; a GDN state: conv
# (2 x 16 x 128 + 32 x 128) x 3 + recurrent 32 x 128 x 128, 2 B each = 1,097,728 B
QWEN3_NEXT_STATE = ((2 * 16 * 128 + 32 * 128) * 3 + 32 * 128 * 128) * 2

JAMBA = {"model_type": "jamba", "hidden_size": 4096, "num_attention_heads": 32,
         "num_key_value_heads": 8, "num_hidden_layers": 8, "attn_layer_period": 8,
         "attn_layer_offset": 4, "mamba_expand": 2, "mamba_d_state": 16, "mamba_d_conv": 4,
         "torch_dtype": "bfloat16", "max_position_embeddings": 8192}

NEMOTRON_H = {"model_type": "nemotron_h", "hidden_size": 4096, "num_attention_heads": 32,
              "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 4,
              "hybrid_override_pattern": "M-M*", "mamba_num_heads": 128,
              "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128, "conv_kernel": 4,
              "torch_dtype": "bfloat16", "max_position_embeddings": 8192}


def test_checkpoint_alignment_and_pages_per_state_layer() -> None:
    align = {"mamba_cache_mode": "align", "linear_key_head_dim": 128}
    # FlashInfer's GDN prefill kernel: SM90, and SM10x / SM12x with 128-wide keys
    for cc in ("9.0", "10.0", "12.0", None):
        assert mamba_prefill_checkpoints("qwen3_next", compute_capability=cc, **align) == (64, 1)
    # Triton elsewhere (A100, L40S, ROCm) and on Blackwell with other key widths
    for cc in ("8.0", "8.9", "gfx942"):
        assert mamba_prefill_checkpoints("qwen3_next", compute_capability=cc, **align) \
            == (None, 0)
    assert mamba_prefill_checkpoints("qwen3_next", mamba_cache_mode="align",
                                     compute_capability="10.0", linear_key_head_dim=64) \
        == (None, 0)
    # without prefix caching the GDN layer exports nothing
    assert mamba_prefill_checkpoints("qwen3_next", mamba_cache_mode="none",
                                     compute_capability="9.0", linear_key_head_dim=128) \
        == (None, 0)
    assert mamba_prefill_checkpoints("nemotron_h", mamba_cache_mode="align",
                                     compute_capability="9.0") == (None, 1)
    assert mamba_prefill_checkpoints("jamba", mamba_cache_mode="align",
                                     compute_capability="9.0") == (None, 0)


def test_the_checkpoint_alignment_sets_the_block_multiple() -> None:
    # lcm(16, 64) = 64: 64 x cdiv(1097728, 64 x 2048) = 64 x 9 = 576 (without it, 16 x 34 = 544)
    assert align_hybrid_block_size(2048, QWEN3_NEXT_STATE, 16, checkpoint_alignment=64) == (
        576, 576 * 2048)
    # a --block-size of 96: lcm(96, 64) = 192, 192 x cdiv(1097728, 192 x 2048) = 192 x 3
    assert align_hybrid_block_size(2048, QWEN3_NEXT_STATE, 96, checkpoint_alignment=64) == (
        576, 576 * 2048)
    # a block of 1024 already holds a state and is a multiple of 64: it stays
    assert align_hybrid_block_size(2048, QWEN3_NEXT_STATE, 1024, checkpoint_alignment=64) == (
        1024, 1024 * 2048)


def test_qwen3_next_like_with_prefix_caching_on_an_h100() -> None:
    p = serve_plan(QWEN3_NEXT, kv_cache_memory=GiB, gpu="h100-sxm-80gb",
                   max_num_batched_tokens=8192)
    assert p.mamba_cache_mode == "align" and p.to_json()["mamba_cache_mode"] == "align"
    page = 576 * 2048  # the state padded to a 576-token attention page: 1,179,648 B
    assert p.block_size == 576
    # 6 GDN layers + 2 full: groups of 2, the GDN layers in three groups (layers[i::3]); every
    # group's block is 576 tokens, the GDN ones included (mamba_block_size = block_size)
    assert [(g.spec.kind, g.layers, g.block_size, g.page_size_bytes) for g in p.groups] == [
        ("mamba", (0, 4), 576, page), ("mamba", (1, 5), 576, page),
        ("mamba", (2, 6), 576, page), ("full", (3, 7), 576, page)]
    assert p.bytes_per_block == 2 * page == 2359296
    assert p.num_gpu_blocks == GiB // 2359296 == 455
    # one request of 32768 tokens: cdiv(32768, 576) = 57 attention blocks + 3 GDN groups x
    # (2 + 1 checkpoint) pages = 66 blocks
    assert p.request_bytes == 66 * 2359296
    assert p.max_concurrency == 455 / 66
    assert p.kv_cache_tokens == int(455 / 66 * 32768) == 225900
    assert p.fits


def test_qwen3_next_like_with_prefix_caching_on_an_a100_and_without() -> None:
    # SM80 runs the Triton GDN kernel: no checkpoint alignment or page, the block stays 544
    a100 = serve_plan(QWEN3_NEXT, kv_cache_memory=GiB, gpu="a100-80gb",
                      max_num_batched_tokens=8192)
    assert a100.block_size == 544 and a100.num_gpu_blocks == GiB // (2 * 544 * 2048) == 481
    # cdiv(32768, 544) = 61 attention blocks + 3 GDN groups x 2 pages
    assert a100.max_concurrency == 481 / (61 + 6)
    # prefix caching off: one page per GDN group, and the GDN block is max_model_len
    off = serve_plan(QWEN3_NEXT, kv_cache_memory=GiB, gpu="a100-80gb", prefix_caching=False,
                     max_num_batched_tokens=8192)
    assert off.mamba_cache_mode == "none"
    assert off.max_concurrency == 481 / (61 + 3)
    assert [g.block_size for g in off.groups] == [32768, 32768, 32768, 544]


def test_jamba_like_with_prefix_caching() -> None:
    # attention 8 x (128 + 128) x 2 = 4096 B a token; a Mamba-1 state (8192 x 3 + 8192 x 16)
    # x 2 = 311,296 B: 16 x cdiv(311296, 65536) = 80 tokens, no checkpoint alignment
    p = serve_plan(JAMBA, kv_cache_memory=GiB)
    page = 80 * 4096
    assert p.block_size == 80
    # 7 Mamba layers and 1 attention: groups of 1 layer each (7 >= 1.5 x 1)
    assert [g.layers for g in p.groups] == [(0,), (1,), (2,), (3,), (5,), (6,), (7,), (4,)]
    assert {(g.block_size, g.page_size_bytes) for g in p.groups} == {(80, page)}
    assert p.num_gpu_blocks == GiB // page == 3276
    # cdiv(8192, 80) = 103 attention blocks + 7 Mamba groups x 2 pages = 117 (110 without)
    assert p.max_concurrency == 3276 / 117 == 28.0
    assert p.kv_cache_tokens == 28 * 8192
    off = serve_plan(JAMBA, kv_cache_memory=GiB, prefix_caching=False)
    assert off.max_concurrency == 3276 / 110
    # the largest context that fits in 1 GiB less the null block: 3275 blocks - 14 state
    # pages = 3261 attention blocks of 80 tokens, above the 8192 context
    assert p.max_model_len_that_fits == 8192


def test_nemotron_h_like_keeps_a_checkpoint_page() -> None:
    # attention 4096 B a token; a state of 4,255,744 B: 16 x cdiv(4255744, 65536) = 1040
    p = serve_plan(NEMOTRON_H, kv_cache_memory=GiB)
    assert p.block_size == 1040
    assert p.num_gpu_blocks == GiB // (1040 * 4096) == 252
    # cdiv(8192, 1040) = 8 attention blocks + 2 Mamba groups x (2 + 1) pages = 14
    assert p.max_concurrency == 252 / 14 == 18.0
    assert serve_plan(NEMOTRON_H, kv_cache_memory=GiB,
                      prefix_caching=False).max_concurrency == 252 / 10


@pytest.mark.parametrize("config", [QWEN3_NEXT, JAMBA])
def test_startup_check_counts_the_state_pages(config: dict) -> None:
    # exactly one request plus the null block: fits; one byte less does not
    p = serve_plan(config, kv_cache_memory=GiB)
    need = p.request_bytes + p.bytes_per_block
    assert serve_plan(config, kv_cache_memory=need).fits
    assert not serve_plan(config, kv_cache_memory=need - 1).fits
