"""vLLM's page, group, block, token and concurrency arithmetic, hand-computed from the rules
memfit.serving.vllm cites (vllm/v1/core/kv_cache_utils.py, vllm/v1/kv_cache_interface.py)."""

from __future__ import annotations

import pytest

from memfit.errors import MemfitError
from memfit.serving import (
    EngineLayerSpec,
    align_hybrid_block_size,
    bytes_per_block,
    fits,
    kv_cache_groups,
    kv_cache_tokens,
    max_concurrency,
    max_memory_usage_bytes,
    max_model_len_that_fits,
    num_gpu_blocks,
    serve_plan,
)

GiB = 2**30
MiB = 2**20
IN_FLIGHT = 2 * 8192  # async scheduling's two batches of vllm serve's 8192 tokens


def attn(kind: str = "full", kv_heads: int = 8, head: int = 128, dtype: int = 2,
         block: int = 16, window: int | None = None) -> EngineLayerSpec:
    return EngineLayerSpec(kind=kind, block_size=block, num_kv_heads=kv_heads, head_size=head,
                           head_size_v=0 if kind == "mla" else head, dtype_bytes=dtype,
                           sliding_window=window)


def test_page_sizes() -> None:
    # 16 tokens x 8 heads x (128 + 128) x 2 bytes
    assert attn().page_size_bytes == 16 * 8 * 256 * 2 == 65536
    # MLA: 16 x 1 x 576 x 2, no separate V
    assert attn("mla", kv_heads=1, head=576).page_size_bytes == 16 * 576 * 2
    assert attn("sliding", window=4096).page_size_bytes == 65536


def test_llama_3_8b_one_group_2_mib_blocks() -> None:
    groups = kv_cache_groups(list(range(32)), [attn()] * 32)
    assert len(groups) == 1 and len(groups[0].layers) == 32
    # one block over all 32 layers: 32 x 64 KiB = 2 MiB
    assert bytes_per_block(groups) == 32 * 65536 == 2 * MiB
    blocks = num_gpu_blocks(groups, 10 * GiB)
    assert blocks == 10 * GiB // (2 * MiB) == 5120
    # one 8192-token request takes cdiv(8192, 16) = 512 blocks
    conc = max_concurrency(groups, blocks, 8192, max_in_flight_tokens=IN_FLIGHT)
    assert conc == 5120 / 512 == 10.0
    assert kv_cache_tokens(conc, 8192) == 81920
    assert max_memory_usage_bytes(groups, 8192, max_in_flight_tokens=IN_FLIGHT) == 512 * 2 * MiB


def test_blocks_round_down() -> None:
    groups = kv_cache_groups(list(range(32)), [attn()] * 32)
    assert num_gpu_blocks(groups, 2 * MiB - 1) == 0
    assert num_gpu_blocks(groups, 2 * MiB * 3 + 5) == 3


def test_null_block_is_held_back_from_the_startup_check() -> None:
    groups = kv_cache_groups(list(range(32)), [attn()] * 32)
    # 512 blocks are 8192 tokens, but one is the null block: 8192 does not fit, 8176 does
    assert not fits(groups, 512 * 2 * MiB, 8192, max_in_flight_tokens=IN_FLIGHT)
    assert fits(groups, 513 * 2 * MiB, 8192, max_in_flight_tokens=IN_FLIGHT)
    fit_len = max_model_len_that_fits(groups, 512 * 2 * MiB, 8192, max_in_flight_tokens=IN_FLIGHT)
    assert fit_len == 511 * 16
    assert max_model_len_that_fits(groups, 2 * 2 * MiB - 1, 8192,
                                   max_in_flight_tokens=IN_FLIGHT) == 0


def test_sliding_and_full_two_groups() -> None:
    # Gemma-2 style: 0, 2 sliding; 1, 3 full; equal pages -> 2 groups of 2 layers
    specs = [attn("sliding", kv_heads=4, head=256, window=4096), attn(kv_heads=4, head=256)] * 2
    groups = kv_cache_groups([0, 1, 2, 3], specs)
    assert [(g.spec.kind, g.layers) for g in groups] == [("sliding", (0, 2)), ("full", (1, 3))]
    page = 16 * 4 * 512 * 2  # 65536
    blocks = num_gpu_blocks(groups, GiB)
    assert blocks == GiB // (2 * page) == 8192
    # per request at 8192 tokens: full cdiv(8192, 16) = 512, sliding
    # cdiv(min(4095 + 16384 in flight, 8192), 16) + 1 = 513 -> 1025 blocks
    conc = max_concurrency(groups, blocks, 8192, max_in_flight_tokens=IN_FLIGHT)
    assert conc == 8192 / 1025
    assert kv_cache_tokens(conc, 8192) == 65472  # int(7.99... x 8192)
    assert max_memory_usage_bytes(groups, 8192, max_in_flight_tokens=IN_FLIGHT) == \
        2 * page * 1025


def test_gemma3_five_to_one_six_groups() -> None:
    # 12 layers, full at 5 and 11: group size 2 (10 sliding is not < 1.5 x 2 full)
    specs = [attn("full" if (i + 1) % 6 == 0 else "sliding", kv_heads=1, head=256,
                  window=None if (i + 1) % 6 == 0 else 512) for i in range(12)]
    groups = kv_cache_groups(list(range(12)), specs)
    # sliding layers split into 5 groups of 2, layers[i::5]; then the full pair
    assert [g.layers for g in groups] == [(0, 6), (1, 7), (2, 8), (3, 9), (4, 10), (5, 11)]
    page = 16 * 1 * 512 * 2  # 16384
    blocks = num_gpu_blocks(groups, GiB)
    assert blocks == GiB // (2 * page) == 32768
    # at 32768 tokens: full 2048 blocks, each sliding group
    # cdiv(min(511 + 16384, 32768), 16) + 1 = 1056 + 1
    conc = max_concurrency(groups, blocks, 32768, max_in_flight_tokens=IN_FLIGHT)
    assert conc == 32768 / (2048 + 5 * 1057)
    assert f"{conc:.2f}" == "4.47"
    # one request at full context is 7333 blocks: the pool holds 4.47 of them
    assert kv_cache_tokens(conc, 32768) == int(32768 / 7333 * 32768)


def test_async_scheduling_doubles_the_in_flight_window() -> None:
    specs = [attn("sliding", window=1024)] * 2 + [attn()]
    groups = kv_cache_groups([0, 1, 2], specs)
    sliding = next(g for g in groups if g.spec.kind == "sliding")
    # cdiv(min(1023 + 2048, 32768), 16) + 1 vs cdiv(1023 + 4096, 16) + 1
    assert sliding.blocks_per_request(32768, 2048) == 192 + 1
    assert sliding.blocks_per_request(32768, 4096) == 320 + 1


def test_group_size_uses_the_most_when_close() -> None:
    # 12 sliding + 13 full (gpt-oss-20b + a drafter): 13 < 1.5 x 12 -> group size 13
    specs = [attn("sliding", window=128)] * 12 + [attn()] * 13
    groups = kv_cache_groups(list(range(25)), specs)
    assert [len(g.layers) for g in groups] == [12, 13]
    # the 13-layer group sets the block: the sliding group pads one layer
    assert num_gpu_blocks(groups, GiB) == GiB // (13 * 65536) == 1260


def test_uniform_type_sums_pages() -> None:
    # all full attention, two head counts: one group, page = the sum of the layers' pages
    specs = [attn(kv_heads=8), attn(kv_heads=4)]
    groups = kv_cache_groups([0, 1], specs)
    assert len(groups) == 1 and groups[0].uniform_type
    assert groups[0].page_size_bytes == bytes_per_block(groups) == 65536 + 32768
    blocks = num_gpu_blocks(groups, GiB)
    assert blocks == GiB // 98304 == 10922
    assert max_concurrency(groups, blocks, 8192, max_in_flight_tokens=IN_FLIGHT) == 10922 / 512


def test_unify_pages_by_growing_block_size() -> None:
    # sliding pages half the full ones: their block size doubles to 32
    specs = [attn("sliding", kv_heads=4, window=1024), attn(kv_heads=8)]
    groups = kv_cache_groups([0, 1], specs)
    assert sorted(g.block_size for g in groups) == [16, 32]
    assert {g.page_size_bytes for g in groups} == {65536}
    # sliding: cdiv(min(1023 + 16384, 8192), 32) + 1 = 257; full 512
    assert max_concurrency(groups, 100, 8192, max_in_flight_tokens=IN_FLIGHT) == 100 / 769


def test_pages_that_do_not_divide_are_padded_or_refused() -> None:
    # a 24576 B sliding page does not divide 65536: padded (non-MLA attention)
    specs = [attn("sliding", kv_heads=3, window=1024), attn(kv_heads=8)]
    groups = kv_cache_groups([0, 1], specs)
    assert [(g.block_size, g.page_size_bytes) for g in groups] == [(16, 65536), (16, 65536)]
    # an MLA page (18432 B) cannot be padded: vLLM raises
    with pytest.raises(MemfitError, match="unify_kv_cache_spec_page_size"):
        kv_cache_groups([0, 1], [attn("mla", kv_heads=1, head=576), attn()])


def test_mamba_page_is_padded_to_the_attention_page() -> None:
    mamba = EngineLayerSpec(kind="mamba", block_size=8192, state_bytes=40000)
    groups = kv_cache_groups([0, 1], [mamba, attn()])
    assert [g.page_size_bytes for g in groups] == [65536, 65536]
    # one state page per request (mamba_cache_mode none), cdiv(8192, 16) attention blocks
    assert max_concurrency(groups, 1000, 8192, max_in_flight_tokens=IN_FLIGHT) == 1000 / 513


def test_serve_plan_llama_preset() -> None:
    p = serve_plan("llama-3-8b", kv_cache_memory=GiB)
    assert (p.num_gpu_blocks, p.kv_cache_tokens) == (512, 8192)
    assert p.max_model_len == 8192 and p.max_concurrency == 1.0
    assert p.log_line == ("GPU KV cache size: 8,192 tokens, Maximum concurrency for 8,192 "
                          "tokens per request: 1.00x")
    # the null block leaves 511: vLLM refuses 8192 tokens and says 8176 fit
    assert not p.fits and p.max_model_len_that_fits == 8176
    tp2 = serve_plan("llama-3-8b", kv_cache_memory=GiB, tp=2, kv_cache_dtype="fp8")
    assert tp2.num_gpu_blocks == GiB // (32 * 16 * 4 * 256 * 1) == 2048


def test_serve_plan_mistral_preset_windows_every_layer() -> None:
    p = serve_plan("mistral-7b", kv_cache_memory=4 * GiB)
    assert {g.spec.kind for g in p.groups} == {"sliding"} and len(p.groups) == 1
    # 32768 tokens: a sliding layer holds cdiv(min(4095 + 16384, 32768), 16) + 1 = 1281 blocks
    blocks = 4 * GiB // (32 * 65536)
    assert p.max_concurrency == blocks / 1281


def test_serve_plan_mla() -> None:
    config = {"model_type": "deepseek_v3", "hidden_size": 7168, "num_attention_heads": 128,
              "num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
              "torch_dtype": "bfloat16", "max_position_embeddings": 163840}
    p = serve_plan(config, kv_cache_memory=GiB, tp=8)
    # page 16 x 576 x 2 = 18432 per layer; 61 layers per block
    assert p.bytes_per_block == 61 * 18432
    assert p.num_gpu_blocks == GiB // (61 * 18432) == 954
    # a 163840-token request takes 10240 blocks
    assert p.max_concurrency == 954 / 10240
    assert p.kv_cache_tokens == int(954 / 10240 * 163840)
    assert not p.fits
    assert p.max_model_len_that_fits == 953 * 16  # the null block held back


def test_serve_plan_gemma3n_counts_only_cache_layers() -> None:
    kinds = ["sliding_attention"] * 4 + ["full_attention"]
    config = {"model_type": "gemma3n", "torch_dtype": "bfloat16",
              "text_config": {"model_type": "gemma3n_text", "hidden_size": 2048,
                              "num_attention_heads": 8, "num_key_value_heads": 2,
                              "head_dim": 256, "num_hidden_layers": 10,
                              "layer_types": kinds * 2, "sliding_window": 512,
                              "num_kv_shared_layers": 5, "max_position_embeddings": 32768}}
    p = serve_plan(config, kv_cache_memory=GiB)
    # 4 sliding + 1 full, group size 1: five one-layer groups of 16 x 2 x 512 x 2 B pages
    assert [g.layers for g in p.groups] == [(0,), (1,), (2,), (3,), (4,)]
    assert p.num_gpu_blocks == GiB // 32768
    # per request: 4 x (cdiv(511 + 16384, 16) + 1) + cdiv(32768, 16)
    assert p.max_concurrency == (GiB // 32768) / (4 * 1057 + 2048)


def test_serve_plan_json_keys() -> None:
    data = serve_plan("llama-3-8b", kv_cache_memory=GiB).to_json()
    for key in ("engine", "engine_version", "weights_bytes", "activation_peak_bytes",
                "non_torch_bytes", "cuda_graph_bytes", "kv_cache_bytes", "kv_cache_tokens",
                "num_gpu_blocks", "max_concurrency", "max_model_len_that_fits",
                "kv_cache_groups"):
        assert key in data
    assert data["weights_bytes"] is None and data["engine_version"] == "0.33.0"
    assert data["kv_cache_groups"][0]["page_size_bytes"] == 65536


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"max_model_len": 8193}, "above llama-3-8b's context of 8192"),
    ({"kv_cache_memory": -1}, "must be a number of bytes >= 0"),
    ({"tp": 3}, "does not divide num_attention_heads"),
    ({"kv_cache_dtype": "int8"}, "unknown --kv-cache-dtype"),
])
def test_serve_plan_bad_input(kwargs: dict, words: str) -> None:
    args = {"kv_cache_memory": GiB, **kwargs}
    with pytest.raises(MemfitError, match=words):
        serve_plan("llama-3-8b", **args)


def test_serve_plan_refuses_what_vllm_refuses() -> None:
    qwen = {"model_type": "qwen2", "hidden_size": 896, "num_attention_heads": 14,
            "num_key_value_heads": 2, "num_hidden_layers": 4, "use_sliding_window": True,
            "sliding_window": 4096, "max_window_layers": 2, "max_position_embeddings": 32768}
    with pytest.raises(MemfitError, match="max_window_layers == num_hidden_layers"):
        serve_plan(qwen, kv_cache_memory=GiB)


QWEN3_NEXT = {"model_type": "qwen3_next", "hidden_size": 2048, "num_attention_heads": 16,
              "num_key_value_heads": 2, "head_dim": 256, "num_hidden_layers": 8,
              "full_attention_interval": 4, "linear_num_key_heads": 16,
              "linear_num_value_heads": 32, "linear_key_head_dim": 128,
              "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
              "torch_dtype": "bfloat16", "max_position_embeddings": 32768}


def test_hybrid_attention_block_grows_to_hold_a_state() -> None:
    # attention: 2 heads x (256 + 256) x 2 B = 2048 B per token; a GDN state is 1097728 B:
    # 16 x cdiv(1097728, 16 x 2048) = 16 x 34 = 544 tokens per block
    assert align_hybrid_block_size(2048, 1097728, 16) == (544, 544 * 2048)
    # a block already large enough stays; an exact fit pads nothing
    assert align_hybrid_block_size(2048, 1097728, 1024) == (1024, 1024 * 2048)
    assert align_hybrid_block_size(2048, 16 * 2048, 16) == (16, None)


def test_serve_plan_hybrid_gdn_without_prefix_caching() -> None:
    p = serve_plan(QWEN3_NEXT, kv_cache_memory=GiB, prefix_caching=False)
    assert p.block_size == 544
    # 6 state layers + 2 full: group size 2, three state groups, layers[i::3]
    assert [(g.spec.kind, g.layers) for g in p.groups] == [
        ("mamba", (0, 4)), ("mamba", (1, 5)), ("mamba", (2, 6)), ("full", (3, 7))]
    page = 544 * 2048  # the state padded to the attention page
    assert {g.page_size_bytes for g in p.groups} == {page}
    assert p.num_gpu_blocks == GiB // (2 * page) == 481
    # one request: cdiv(32768, 544) = 61 attention blocks + one state block per state group
    assert p.max_concurrency == 481 / (61 + 3)
    assert p.kv_cache_tokens == int(481 / 64 * 32768)


def test_serve_plan_hybrid_with_prefix_caching_is_planned() -> None:
    # vLLM's default (mamba_cache_mode align) is planned, no longer refused; its arithmetic is
    # tests/serving/test_hybrid_prefix_caching.py's
    p = serve_plan(QWEN3_NEXT, kv_cache_memory=GiB)
    assert p.mamba_cache_mode == "align" and p.block_size == 576


def test_the_default_block_is_the_backends_preferred_size() -> None:
    """vLLM 0.33 sizes the block from the attention backend it selects when --block-size is not
    given: FlashInfer-MLA on Blackwell takes [32, 64] only, so DeepSeek-V3's MLA gets 32-token
    blocks on a B200 and 16 on an H100; a GQA model stays at 16."""
    import memfit

    v3 = {"model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61,
          "num_attention_heads": 128, "num_key_value_heads": 128, "kv_lora_rank": 512,
          "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
          "max_position_embeddings": 163840, "torch_dtype": "bfloat16"}
    # MLA: one latent of 512 + 64 values a token, 2 bytes: 1,152 B a token and layer
    b200 = memfit.serve_plan(v3, kv_cache_memory=2**30, gpu="b200", max_model_len=4096)
    assert b200.block_size == 32
    assert b200.groups[0].page_size_bytes == 32 * 1152
    h100 = memfit.serve_plan(v3, kv_cache_memory=2**30, gpu="h100-sxm-80gb",
                             max_model_len=4096)
    assert h100.block_size == 16
    assert memfit.serve_plan(v3, kv_cache_memory=2**30, max_model_len=4096).block_size == 16
    given = memfit.serve_plan(v3, kv_cache_memory=2**30, gpu="b200", block_size=64,
                              max_model_len=4096)
    assert given.block_size == 64
    llama = memfit.serve_plan("llama-3-8b", kv_cache_memory=2**30, gpu="b200")
    assert llama.block_size == 16
