"""Speculative decoding's KV in vLLM 0.33, hand-computed from the rules
memfit.serving.speculative cites:

- a draft's attention layers get specs like the target's (``is_draft`` is left out of equality),
  so an EAGLE layer of Llama-3-8B's shape widens every block from 32 to 33 pages of
  16 x 8 KV heads x (128 + 128) x 2 B = 64 KiB;
- the lookahead is reserved at run time and capped at ``max_model_len``: a full-attention
  model's blocks, tokens, concurrency and startup check do not move with ``K``;
- a Mamba layer keeps ``K`` more state pages per request (``MambaSpec.num_speculative_blocks``),
  ngram included; multi-module MTP keeps ``K - 1`` more sliding-window tokens.
"""

from __future__ import annotations

import pytest

from memfit.cli import main
from memfit.errors import MemfitError
from memfit.serving import serve_plan
from memfit.serving.speculative import speculative_decoding
from memfit.serving.vllm import EngineLayerSpec

GiB = 2**30
PAGE = 16 * 8 * (128 + 128) * 2  # one Llama-3-8B layer's block: 65,536 B

JAMBA = {"model_type": "jamba", "hidden_size": 4096, "num_attention_heads": 32,
         "num_key_value_heads": 8, "num_hidden_layers": 8, "attn_layer_period": 8,
         "attn_layer_offset": 4, "mamba_expand": 2, "mamba_d_state": 16, "mamba_d_conv": 4,
         "torch_dtype": "bfloat16", "max_position_embeddings": 8192}

# DeepSeek-V3's attention in 3 layers: an MLA latent of 512 + 64 per token, one MTP layer
DEEPSEEK = {"model_type": "deepseek_v3", "hidden_size": 7168, "num_attention_heads": 128,
            "num_hidden_layers": 3, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 128, "v_head_dim": 128, "num_nextn_predict_layers": 1,
            "torch_dtype": "bfloat16", "max_position_embeddings": 163840}


def test_eagle_layer_widens_the_block_by_one_page() -> None:
    base = serve_plan("llama-3-8b", kv_cache_memory=GiB, block_size=16)
    p = serve_plan("llama-3-8b", kv_cache_memory=GiB, block_size=16,
                   speculative_method="eagle", num_speculative_tokens=3)
    assert base.bytes_per_block == 32 * PAGE and base.num_gpu_blocks == 512
    assert p.bytes_per_block == 33 * PAGE == 2_162_688
    assert p.num_gpu_blocks == GiB // (33 * PAGE) == 496
    assert p.kv_cache_tokens == int(496 / 512 * 8192) == 7936  # 8192 / 16 blocks a request
    assert [g.layers for g in p.groups] == [tuple(range(33))]  # one group, draft included
    assert p.layers[-1].draft and p.layers[-1].index == 32
    assert p.to_json()["speculative"] == {"method": "eagle", "num_speculative_tokens": 3,
                                          "lookahead_tokens": 3, "extra_retained_tokens": 0,
                                          "draft_layers": 1}
    two = serve_plan("llama-3-8b", kv_cache_memory=GiB, block_size=16,
                     speculative_method="eagle3", num_speculative_tokens=3, draft_layers=2)
    assert two.num_gpu_blocks == GiB // (34 * PAGE) == 481


def test_lookahead_leaves_full_attention_and_startup_check_alone() -> None:
    plans = [serve_plan("llama-3-8b", kv_cache_memory=GiB, block_size=16,
                        speculative_method="eagle", num_speculative_tokens=k) for k in (1, 7)]
    for p in plans:
        assert p.request_bytes == 512 * 33 * PAGE  # cdiv(8192, 16) blocks, not + K
        assert (p.num_gpu_blocks, p.kv_cache_tokens) == (496, 7936)
        assert not p.fits and p.max_model_len_that_fits == (496 - 1) * 16  # null block
    ngram = serve_plan("llama-3-8b", kv_cache_memory=GiB, block_size=16,
                       speculative_method="ngram", num_speculative_tokens=4)
    assert (ngram.num_gpu_blocks, ngram.kv_cache_tokens) == (512, 8192)
    assert ngram.speculative is not None and ngram.speculative.lookahead_tokens == 0


def test_mtp_adds_num_nextn_predict_layers_of_the_models_mla() -> None:
    latent_page = 64 * (512 + 64) * 2  # block 64 x one latent x bf16 = 73,728 B
    p = serve_plan(DEEPSEEK, kv_cache_memory=10 * 4 * latent_page + 5, block_size=64,
                   max_model_len=4096, speculative_method="mtp")
    assert p.speculative is not None and p.speculative.num_speculative_tokens == 1  # default
    assert p.bytes_per_block == 4 * latent_page and p.num_gpu_blocks == 10
    assert [(x.index, x.kind, x.draft) for x in p.layers][-1] == (3, "mla", True)
    # K above the layers must be a multiple of them; min(layers, K) > 1 retains K - 1 tokens
    assert speculative_decoding("mtp", 3, DEEPSEEK, 8192).extra_retained_tokens == 0
    two = {**DEEPSEEK, "num_nextn_predict_layers": 2}
    assert speculative_decoding("mtp", 4, two, 8192).extra_retained_tokens == 3
    with pytest.raises(MemfitError, match="multiple"):
        speculative_decoding("mtp", 3, two, 8192)
    with pytest.raises(MemfitError, match="num_nextn_predict_layers"):
        serve_plan("llama-3-8b", kv_cache_memory=GiB, speculative_method="mtp")


def test_draft_model_pages_join_one_uniform_type_group() -> None:
    draft = {"model_type": "llama", "hidden_size": 2048, "num_attention_heads": 32,
             "num_key_value_heads": 8, "head_dim": 64, "num_hidden_layers": 16,
             "torch_dtype": "float32"}  # runs in the target's bf16
    p = serve_plan("llama-3-8b", kv_cache_memory=GiB, block_size=16,
                   speculative_method="draft_model", num_speculative_tokens=5,
                   draft_model=draft)
    small = 16 * 8 * (64 + 64) * 2
    assert p.bytes_per_block == 32 * PAGE + 16 * small == 2_621_440
    assert p.num_gpu_blocks == 409 and len(p.groups) == 1 and p.groups[0].uniform_type
    assert p.kv_cache_tokens == int(409 / 512 * 8192)


def test_mamba_layers_keep_k_more_state_pages() -> None:
    spec = EngineLayerSpec(kind="mamba", block_size=16, state_bytes=1000, speculative_blocks=2)
    assert spec.max_memory_usage_bytes(8192, 16384, "none") == (1 + 2) * 1000
    spec = EngineLayerSpec(kind="mamba", block_size=16, state_bytes=1000, speculative_blocks=2,
                           checkpoint_blocks=1)
    assert spec.max_memory_usage_bytes(8192, 16384, "align") == (2 + 2 + 1) * 1000
    # Jamba: 1 attention + 7 Mamba groups of one layer; ngram adds no layer, 2 pages per Mamba
    kw = {"kv_cache_memory": 4 * GiB, "prefix_caching": False}
    base = serve_plan(JAMBA, **kw)
    ngram = serve_plan(JAMBA, speculative_method="ngram", num_speculative_tokens=2, **kw)
    assert len(base.groups) == 8 and ngram.bytes_per_block == base.bytes_per_block
    assert ngram.num_gpu_blocks == base.num_gpu_blocks
    assert ngram.request_bytes - base.request_bytes == 7 * 2 * base.bytes_per_block


def test_multi_module_mtp_retains_k_minus_one_sliding_tokens() -> None:
    kw = {"kind": "sliding", "block_size": 16, "num_kv_heads": 1, "head_size": 1,
          "head_size_v": 1, "dtype_bytes": 1, "sliding_window": 4096}
    # min(4095 + 2 + 16384, 131072) = 20481 tokens -> 1281 blocks + 1 (window unaligned)
    assert EngineLayerSpec(extra_retained_tokens=2, **kw).max_memory_usage_bytes(
        131072, 16384) == 1282 * 16 * 2
    assert EngineLayerSpec(**kw).max_memory_usage_bytes(131072, 16384) == 1281 * 16 * 2


@pytest.mark.parametrize(("argv", "needle"), [
    (["--speculative-method", "eagle"], "--num-speculative-tokens"),
    (["--speculative-method", "eagle", "--num-speculative-tokens", "4",
      "--max-num-batched-tokens", "4", "--max-num-seqs", "4"], "must exceed"),
    (["--num-speculative-tokens", "2"], "need --speculative-method"),
    (["--speculative-method", "ngram", "--num-speculative-tokens", "2", "--draft-layers", "2"],
     "--draft-layers is for"),
    (["--speculative-method", "draft_model", "--num-speculative-tokens", "2"], "--draft-model"),
])
def test_cli_bad_speculative_input_is_one_line_exit_2(argv: list[str], needle: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve-plan", "llama-3-8b", "--kv-cache-memory", "1GiB", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_cli_eagle_json(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    assert main(["serve-plan", "llama-3-8b", "--kv-cache-memory", "1GiB", "--block-size", "16",
                 "--speculative-method", "eagle", "--num-speculative-tokens", "2",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["num_gpu_blocks"], out["kv_cache_tokens"]) == (496, 7936)
    assert out["speculative"]["draft_layers"] == 1


def test_vllms_own_code_agrees_on_the_eagle_cases() -> None:
    """bench/serving_vllm_parity.py's EAGLE cases, run through vLLM 0.33.0's planner with the
    draft layer's spec marked is_draft: no mismatch, and Llama-3-8B at 1 GiB is 496 blocks."""
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "results" / \
        "serving-vllm-parity-eagle-cpu-2026-11-27.json"
    data = json.loads(path.read_text())
    cols, res = data["case_columns"], data["result_columns"]
    rows = [dict(zip(cols, r["case"], strict=True)) | {"vllm": dict(zip(res, r["vllm"],
                                                                         strict=True)),
                                                        "mismatch": r["mismatch"]}
            for r in data["rows"]]
    eagle = [r for r in rows if r["speculative"] == "eagle"]
    assert len(eagle) == 16 and not any(r["mismatch"] for r in eagle)
    llama = next(r for r in eagle if (r["model"], r["tp"], r["memory_gib"], r["max_model_len"])
                 == ("llama-3-8b", 1, 1, None))
    assert (llama["vllm"]["bytes_per_block"], llama["vllm"]["num_gpu_blocks"],
            llama["vllm"]["kv_cache_tokens"]) == (33 * PAGE, 496, 7936)


def test_gpu_budget_is_the_targets_and_says_the_draft_is_left_out() -> None:
    kw = {"gpu": "h100-80gb", "activation_peak_bytes": GiB, "cuda_graph_bytes": 0}
    base = serve_plan("llama-3-8b", **kw)
    p = serve_plan("llama-3-8b", speculative_method="eagle", num_speculative_tokens=2, **kw)
    assert p.kv_cache_bytes == base.kv_cache_bytes
    assert p.num_gpu_blocks == p.kv_cache_bytes // (33 * PAGE)
    assert "not in the startup budget" in p.to_json()["speculative"]["note"]
