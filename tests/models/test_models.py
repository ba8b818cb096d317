"""Model presets and Hugging Face config.json parsing.

Expected parameter counts are published numbers (sources next to each), and, when transformers is
installed, an independent count of the real Hugging Face modules built on the meta device.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import memfit.models
from memfit.errors import MemfitError
from memfit.models import (
    SUPPORTED_MODEL_TYPES,
    TransformerSpec,
    get_preset,
    is_preset,
    list_presets,
    load_hf_config,
    preset_aliases,
    published_params,
    resolve_model,
)

# Published parameter counts, tied weights counted once. "HF index" = the checkpoint's
# model.safetensors.index.json "total_size" / 2 bytes (bf16/fp16), as shown by the Hub's
# "safetensors: total" metadata.
PUBLISHED: dict[str, int] = {
    # GPT2LMHeadModel (head tied to wte), sum(p.numel() for p in model.parameters());
    # shared/facts.md (124,439,808) and the Hugging Face GPT-2 checkpoints.
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
    # shared/facts.md; HF index meta-llama/Llama-2-7b-hf total_size 13,476,831,232.
    "llama-2-7b": 6_738_415_616,
    # HF index meta-llama/Llama-2-13b-hf total_size 26,031,728,640.
    "llama-2-13b": 13_015_864_320,
    # shared/facts.md; HF index meta-llama/Llama-2-70b-hf.
    "llama-2-70b": 68_976_648_192,
    # shared/facts.md; HF index meta-llama/Meta-Llama-3-8B total_size 16,060,522,496.
    "llama-3-8b": 8_030_261_248,
    # HF safetensors total of meta-llama/Meta-Llama-3-70B ("70.6B" on the card).
    "llama-3-70b": 70_553_706_496,
    # Llama 3.1 has the 3.0 shapes (longer RoPE context only): HF safetensors totals of
    # meta-llama/Llama-3.1-8B, -70B, -405B.
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496,
    "llama-3.1-405b": 405_853_388_800,
    # shared/facts.md; HF index mistralai/Mistral-7B-v0.1.
    "mistral-7b": 7_241_732_096,
    # shared/facts.md; HF index mistralai/Mixtral-8x7B-v0.1 total_size 93,405,585,408.
    "mixtral-8x7b": 46_702_792_704,
    # HF index Qwen/Qwen2.5-7B(-Instruct) total_size 15,231,233,024 (card: "7.61B").
    "qwen2.5-7b": 7_615_616_512,
    # HF safetensors total of Qwen/Qwen2.5-72B(-Instruct) (card: "72.7B").
    "qwen2.5-72b": 72_706_203_648,
    # HF index google/gemma-2-9b; KerasHub preset gemma2_9b_en "params": 9241705984.
    "gemma-2-9b": 9_241_705_984,
    # HF safetensors total of microsoft/Phi-3-mini-4k-instruct (card: "3.8B");
    # KerasHub preset phi3_mini_4k_instruct_en "params": 3821079552.
    "phi-3-mini": 3_821_079_552,
    # BertModel with pooler: google-bert/bert-base-uncased / bert-large-uncased
    # (KerasHub bert_large_en_uncased "params": 335141888).
    "bert-base": 109_482_240,
    "bert-large": 335_141_888,
    # torchvision vit_b_16 / vit_l_16 docs (ImageNet-1k head, no pooler); HF
    # ViTForImageClassification with num_labels=1000 has the same modules.
    "vit-b-16": 86_567_656,
    "vit-l-16": 304_326_632,
    # Llama 3.2 (tied embeddings): HF safetensors totals of meta-llama/Llama-3.2-1B ("1.24B")
    # and -3B ("3.21B").
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    # Qwen3 model cards give "Number of Parameters" and "(Non-Embedding)", rounded: checked in
    # test_new_presets_match_their_cards. The exact counts are those of the transformers
    # modules built on meta from the Hub configs (test_transformers_meta_model_matches_published).
    "qwen3-0.6b": 596_049_920,
    "qwen3-1.7b": 1_720_574_976,
    "qwen3-4b": 4_022_468_096,
    "qwen3-8b": 8_190_735_360,
    "qwen3-14b": 14_768_307_200,
    "qwen3-32b": 32_762_123_264,
    "qwen3-30b-a3b": 30_532_122_624,
    # Gemma 3 text decoders (Gemma3ForCausalLM; the 4B/12B/27B checkpoints add a 417M SigLIP
    # vision tower, not counted). Gemma 3 technical report (arXiv 2503.19786) Table 1 gives the
    # non-embedding counts 698M / 3,209M / 10,759M / 25,600M (checked below).
    "gemma-3-1b": 999_885_952,
    "gemma-3-4b": 3_880_263_168,
    "gemma-3-12b": 11_766_034_176,
    "gemma-3-27b": 27_009_346_304,
    # OLMo 2 (allenai/OLMo-2-1124-7B, -13B; cards "7B" / "13B", HF safetensors "7.3B" / "13.7B").
    "olmo-2-7b": 7_298_617_344,
    "olmo-2-13b": 13_716_198_400,
    # microsoft/phi-4 (Phi3ForCausalLM): HF safetensors total "14.7B" (14.66B).
    "phi-4": 14_659_507_200,
}


# --------------------------------------------------------------------- HF config.json contents
# The keys the real Hub config.json files have for each preset (plus a few irrelevant ones the
# parser must ignore). Written from the Hub configs, independently of memfit/data/models.json.
def _gpt2(n_embd: int, n_layer: int, n_head: int, **extra: Any) -> dict[str, Any]:
    return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": n_embd,
            "n_layer": n_layer, "n_head": n_head, "n_ctx": 1024, "n_positions": 1024,
            "vocab_size": 50257, "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1,
            "layer_norm_epsilon": 1e-5, "activation_function": "gelu_new", **extra}


def _llama(hidden: int, layers: int, heads: int, kv: int, inter: int, vocab: int, maxpos: int,
           model_type: str = "llama", **extra: Any) -> dict[str, Any]:
    return {"model_type": model_type, "hidden_size": hidden, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv, "intermediate_size": inter,
            "vocab_size": vocab, "max_position_embeddings": maxpos, "rms_norm_eps": 1e-5,
            "hidden_act": "silu", "tie_word_embeddings": False, "attention_dropout": 0.0,
            **extra}


def _bert(hidden: int, layers: int, heads: int) -> dict[str, Any]:
    return {"model_type": "bert", "architectures": ["BertForMaskedLM"], "hidden_size": hidden,
            "num_hidden_layers": layers, "num_attention_heads": heads,
            "intermediate_size": 4 * hidden, "vocab_size": 30522, "max_position_embeddings": 512,
            "type_vocab_size": 2, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
            "attention_probs_dropout_prob": 0.1, "layer_norm_eps": 1e-12}


def _vit(hidden: int, layers: int, heads: int) -> dict[str, Any]:
    return {"model_type": "vit", "architectures": ["ViTForImageClassification"],
            "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
            "intermediate_size": 4 * hidden, "image_size": 224, "patch_size": 16,
            "num_channels": 3, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
            "qkv_bias": True, "id2label": {str(i): f"class_{i}" for i in range(1000)}}


def _qwen3(hidden: int, layers: int, heads: int, inter: int, tie: bool,
           **extra: Any) -> dict[str, Any]:
    return _llama(hidden, layers, heads, 8, inter, 151936, 40960, "qwen3", head_dim=128,
                  tie_word_embeddings=tie, rms_norm_eps=1e-6, rope_theta=1000000,
                  attention_bias=False, **extra)


def _gemma3(hidden: int, layers: int, heads: int, kv: int, inter: int, vocab: int = 262208,
            **extra: Any) -> dict[str, Any]:
    return _llama(hidden, layers, heads, kv, inter, vocab, 131072, "gemma3_text",
                  **{"head_dim": 256, "tie_word_embeddings": True, "rms_norm_eps": 1e-6,
                     "hidden_activation": "gelu_pytorch_tanh", "sliding_window": 1024,
                     "query_pre_attn_scalar": 256, **extra})


HF_CONFIGS: dict[str, dict[str, Any]] = {
    "gpt2": _gpt2(768, 12, 12, n_inner=None),
    "gpt2-medium": _gpt2(1024, 24, 16),
    "gpt2-large": _gpt2(1280, 36, 20),
    "gpt2-xl": _gpt2(1600, 48, 25),
    "llama-2-7b": _llama(4096, 32, 32, 32, 11008, 32000, 4096),
    "llama-2-13b": _llama(5120, 40, 40, 40, 13824, 32000, 4096),
    "llama-2-70b": _llama(8192, 80, 64, 8, 28672, 32000, 4096),
    "llama-3-8b": _llama(4096, 32, 32, 8, 14336, 128256, 8192, rope_theta=500000.0),
    "llama-3-70b": _llama(8192, 80, 64, 8, 28672, 128256, 8192, rope_theta=500000.0),
    "llama-3.1-8b": _llama(4096, 32, 32, 8, 14336, 128256, 131072, head_dim=128),
    "llama-3.1-70b": _llama(8192, 80, 64, 8, 28672, 128256, 131072, mlp_bias=False),
    "llama-3.1-405b": _llama(16384, 126, 128, 8, 53248, 128256, 131072, attention_bias=False),
    "mistral-7b": _llama(4096, 32, 32, 8, 14336, 32000, 32768, "mistral", sliding_window=4096),
    "mixtral-8x7b": _llama(4096, 32, 32, 8, 14336, 32000, 32768, "mixtral",
                           num_local_experts=8, num_experts_per_tok=2),
    "qwen2.5-7b": _llama(3584, 28, 28, 4, 18944, 152064, 131072, "qwen2", rope_theta=1e6),
    "qwen2.5-72b": _llama(8192, 80, 64, 8, 29568, 152064, 131072, "qwen2"),
    "gemma-2-9b": _llama(3584, 42, 16, 8, 14336, 256000, 8192, "gemma2", head_dim=256,
                         tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
                         final_logit_softcapping=30.0, attn_logit_softcapping=50.0),
    "phi-3-mini": _llama(3072, 32, 32, 32, 8192, 32064, 4096, "phi3", resid_pdrop=0.0,
                         embd_pdrop=0.0, pad_token_id=32000),
    "llama-3.2-1b": _llama(2048, 16, 32, 8, 8192, 128256, 131072, head_dim=64,
                           tie_word_embeddings=True, rope_theta=500000.0),
    "llama-3.2-3b": _llama(3072, 28, 24, 8, 8192, 128256, 131072, head_dim=128,
                           tie_word_embeddings=True, rope_theta=500000.0),
    "qwen3-0.6b": _qwen3(1024, 28, 16, 3072, True),
    "qwen3-1.7b": _qwen3(2048, 28, 16, 6144, True),
    "qwen3-4b": _qwen3(2560, 36, 32, 9728, True),
    "qwen3-8b": _qwen3(4096, 36, 32, 12288, False),
    "qwen3-14b": _qwen3(5120, 40, 40, 17408, False),
    "qwen3-32b": _qwen3(5120, 64, 64, 25600, False),
    "qwen3-30b-a3b": dict(_qwen3(2048, 48, 32, 6144, False), model_type="qwen3_moe",
                          num_key_value_heads=4, num_experts=128, num_experts_per_tok=8,
                          moe_intermediate_size=768, decoder_sparse_step=1, mlp_only_layers=[],
                          norm_topk_prob=True),
    # google/gemma-3-1b-pt is a gemma3_text config; the larger ones' text_config.
    "gemma-3-1b": _gemma3(1152, 26, 4, 1, 6912, 262144, max_position_embeddings=32768,
                          sliding_window=512),
    "gemma-3-4b": _gemma3(2560, 34, 8, 4, 10240),
    "gemma-3-12b": _gemma3(3840, 48, 16, 8, 15360),
    "gemma-3-27b": _gemma3(5376, 62, 32, 16, 21504, head_dim=128, query_pre_attn_scalar=168),
    "olmo-2-7b": _llama(4096, 32, 32, 32, 11008, 100352, 4096, "olmo2", rms_norm_eps=1e-6,
                        rope_theta=500000, attention_bias=False, pad_token_id=100277),
    "olmo-2-13b": _llama(5120, 40, 40, 40, 13824, 100352, 4096, "olmo2", rms_norm_eps=1e-6,
                         rope_theta=500000, attention_bias=False, pad_token_id=100277),
    "phi-4": _llama(5120, 40, 40, 10, 17920, 100352, 16384, "phi3", resid_pdrop=0.0,
                    embd_pdrop=0.0, pad_token_id=100349, rope_theta=250000),
    "bert-base": _bert(768, 12, 12),
    "bert-large": _bert(1024, 24, 16),
    "vit-b-16": _vit(768, 12, 12),
    "vit-l-16": _vit(1024, 24, 16),
}


def _write(tmp_path: Path, data: Any, name: str = "config.json") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data), encoding="utf-8")
    return path


# ----------------------------------------------------------------------------------- presets
def test_presets_cover_the_issue_list() -> None:
    names = [spec.name for spec in list_presets()]
    assert len(names) == len(set(names)) >= 15
    assert set(PUBLISHED) <= set(names)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_param_count_equals_published(name: str) -> None:
    assert get_preset(name).param_count() == PUBLISHED[name]
    assert published_params(name) == PUBLISHED[name]


def test_every_preset_reproduces_its_published_count() -> None:
    for spec in list_presets():
        assert spec.param_count() == published_params(spec.name), spec.name


def test_lookup_is_case_insensitive_and_knows_aliases() -> None:
    assert get_preset("LLAMA-3-8B").name == "llama-3-8b"
    assert get_preset("meta-llama/Meta-Llama-3-8B").name == "llama-3-8b"
    assert get_preset("llama3-8b").name == "llama-3-8b"
    assert get_preset("llama_3_8b").name == "llama-3-8b"
    assert get_preset("  bert-base-uncased ").name == "bert-base"
    assert get_preset("vit_b_16").name == "vit-b-16"
    assert is_preset("Qwen/Qwen2.5-7B-Instruct") and not is_preset("qwen2.5-14b")
    for spec in list_presets():
        for alias in preset_aliases(spec.name):
            assert get_preset(alias) is spec, alias


def test_unknown_preset_suggests_close_names() -> None:
    with pytest.raises(MemfitError) as err:
        get_preset("llama-3-7b")
    message = str(err.value)
    assert "'llama-3-7b'" in message and "'llama-3-8b'" in message
    assert "memfit models" in message and "\n" not in message
    with pytest.raises(MemfitError, match="memfit models"):
        published_params("no-such-model")


@pytest.mark.parametrize("name, total, non_embedding", [
    # Qwen3 model cards (huggingface.co/Qwen/Qwen3-*): "Number of Parameters" and
    # "Number of Parameters (Non-Embedding)", in billions as printed.
    ("qwen3-0.6b", "0.6", "0.44"), ("qwen3-1.7b", "1.7", "1.4"), ("qwen3-4b", "4.0", "3.6"),
    ("qwen3-8b", "8.2", "6.95"), ("qwen3-14b", "14.8", "13.2"), ("qwen3-32b", "32.8", "31.2"),
    ("qwen3-30b-a3b", "30.5", "29.9"),
])
def test_new_presets_match_their_cards(name: str, total: str, non_embedding: str) -> None:
    spec = get_preset(name)
    embeddings = spec.vocab_size * spec.hidden_size * (1 if spec.tie_embeddings else 2)
    digits = len(total.split(".")[1])
    assert f"{spec.param_count() / 1e9:.{digits}f}" == total
    digits = len(non_embedding.split(".")[1])
    assert f"{(spec.param_count() - embeddings) / 1e9:.{digits}f}" == non_embedding


def test_qwen3_moe_active_and_gemma3_non_embedding_counts() -> None:
    # Qwen3-30B-A3B card: "3.3B activated" (8 of 128 experts). Counting the embeddings, the
    # untied head and 8 experts per layer gives 3.353B: the card's figure is within 0.06B.
    assert abs(get_preset("qwen3-30b-a3b").active_param_count() / 1e9 - 3.3) < 0.06
    # Gemma 3 report Table 1, non-embedding parameters in millions (tied embeddings, text only).
    for name, millions in (("gemma-3-1b", 698), ("gemma-3-4b", 3209), ("gemma-3-12b", 10759),
                           ("gemma-3-27b", 25600)):
        spec = get_preset(name)
        non_embedding = spec.param_count() - spec.vocab_size * spec.hidden_size
        assert round(non_embedding / 1e6) == millions, name


def test_deepseek_v3_is_a_trace_only_preset() -> None:
    """DeepSeek-V3's multi-head latent attention has low-rank q and kv projections that
    TransformerSpec cannot express: the preset is the Hub config, planned by the trace.

    Its count, from the config's shapes (DeepseekV3ForCausalLM; the multi-token-prediction
    module is not part of it): embeddings and untied head 2 * 129280 * 7168; per layer MLA
    q_a 7168x1536 + q_a norm 1536 + q_b 1536x(128 heads * 192) + kv_a 7168x(512 + 64) + kv_a
    norm 512 + kv_b 512x(128 * 256) + o (128 * 128)x7168, two norms of 7168; 3 dense layers
    with a 3 x 7168 x 18432 MLP; 58 MoE layers with 256 routed + 1 shared expert of
    3 x 7168 x 2048 and a 256 x 7168 router; the final norm.
    """
    from memfit.models import HFModelSpec

    h, v = 7168, 129280
    attention = (h * 1536 + 1536 + 1536 * 128 * 192 + h * 576 + 512 + 512 * 128 * 256
                 + 128 * 128 * h)
    dense = attention + 2 * h + 3 * h * 18432
    moe = attention + 2 * h + 257 * 3 * h * 2048 + 256 * h
    expected = 2 * v * h + 3 * dense + 58 * moe + h
    spec = get_preset("deepseek-v3")
    assert isinstance(spec, HFModelSpec) and spec.model_type == "deepseek_v3"
    assert spec.param_count() == published_params("deepseek-v3") == expected
    assert round(expected / 1e9) == 671  # DeepSeek-V3 report: "671B total parameters"
    assert get_preset("deepseek-ai/DeepSeek-V3") is spec
    assert spec not in list_presets()
    assert spec in list_presets(include_trace_only=True)
    if _has_transformers():
        assert sum(p.numel() for p in spec.build().parameters()) == expected


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


PYTHIA_160M: dict[str, Any] = {
    "model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"], "hidden_size": 768,
    "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072,
    "vocab_size": 50304, "max_position_embeddings": 2048, "rotary_pct": 0.25,
    "use_parallel_residual": True, "tie_word_embeddings": False, "layer_norm_eps": 1e-5}
PHI_2: dict[str, Any] = {
    "model_type": "phi", "architectures": ["PhiForCausalLM"], "hidden_size": 2560,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
    "intermediate_size": 10240, "vocab_size": 51200, "max_position_embeddings": 2048,
    "partial_rotary_factor": 0.4, "qk_layernorm": False, "tie_word_embeddings": False,
    "resid_pdrop": 0.1, "embd_pdrop": 0.0, "attention_dropout": 0.0, "hidden_act": "gelu_new"}


def test_gpt_neox_and_phi_counts_from_first_principles(tmp_path: Path) -> None:
    """EleutherAI/pythia-160m: embed_in and untied embed_out 2 x 50304 x 768; per layer fused
    QKV 768 x 2304 + 2304, dense 768 x 768 + 768, MLP 768 x 3072 + 3072 + 3072 x 768 + 768, two
    LayerNorms 2 x 1536; the final LayerNorm 1536: 162,322,944 (the Pythia suite's table).
    microsoft/phi-2: embeddings + untied head 2 x 51200 x 2560 + the head's bias 51200; per
    layer q, k, v, dense 4 x (2560^2 + 2560), fc1 + fc2 2 x 2560 x 10240 + 10240 + 2560, one
    LayerNorm 5120; the final LayerNorm: 2,779,683,840 ("2.7B")."""
    pythia = load_hf_config(_write(tmp_path, PYTHIA_160M, "pythia.json"))
    per_layer = (768 * 2304 + 2304) + (768 * 768 + 768) + (2 * 768 * 3072 + 3072 + 768) + 3072
    assert pythia.param_count() == 2 * 50304 * 768 + 12 * per_layer + 1536 == 162_322_944
    phi2 = load_hf_config(_write(tmp_path, PHI_2, "phi2.json"))
    per_layer = 4 * (2560 * 2560 + 2560) + (2 * 2560 * 10240 + 10240 + 2560) + 5120
    expected = 2 * 51200 * 2560 + 51200 + 32 * per_layer + 5120
    assert phi2.param_count() == expected == 2_779_683_840
    assert (phi2.family, phi2.norms_per_layer, phi2.head_bias, phi2.dropout) == (
        "phi", 1, True, 0.1)
    # qk_layernorm adds a LayerNorm (weight and bias) of head_dim on q and on k per layer.
    qk = load_hf_config(_write(tmp_path, dict(PHI_2, qk_layernorm=True), "qk.json"))
    assert qk.param_count() == expected + 32 * 2 * 2 * 80
    if _has_transformers():
        for config in (PYTHIA_160M, PHI_2, dict(PHI_2, qk_layernorm=True)):
            spec = load_hf_config(_write(tmp_path, config, "c.json"))
            assert spec.param_count() == _hf_param_count(config), config["model_type"]


def test_falcon_layouts_count_exactly(tmp_path: Path) -> None:
    """tiiuae/falcon-7b by hand: tied embeddings 65024 x 4544; per layer multi-query QKV
    4544 x (4544 + 2 x 64), dense 4544^2, MLP 2 x 4544 x 18176, one LayerNorm 2 x 4544 (no
    biases); the final LayerNorm: 6,921,720,704 ("7B"). The other layouts (no multi-query, no
    parallel attention, the new decoder architecture with one or two norms) are checked
    against transformers' FalconForCausalLM on meta."""
    falcon_7b = {"model_type": "falcon", "hidden_size": 4544, "num_hidden_layers": 32,
                 "num_attention_heads": 71, "vocab_size": 65024, "multi_query": True,
                 "parallel_attn": True, "bias": False, "alibi": False}
    per_layer = 4544 * (4544 + 128) + 4544 * 4544 + 2 * 4544 * 18176 + 2 * 4544
    expected = 65024 * 4544 + 32 * per_layer + 2 * 4544
    assert load_hf_config(_write(tmp_path, falcon_7b)).param_count() == expected
    assert expected == 6_921_720_704
    tiny = {"model_type": "falcon", "hidden_size": 256, "num_hidden_layers": 2,
            "num_attention_heads": 8, "vocab_size": 1000}
    layouts = [tiny, dict(tiny, multi_query=False), dict(tiny, parallel_attn=False),
               dict(tiny, multi_query=False, parallel_attn=False, bias=True),
               dict(tiny, new_decoder_architecture=True, num_kv_heads=2),
               dict(tiny, new_decoder_architecture=True, num_kv_heads=2,
                    num_ln_in_parallel_attn=1),
               dict(tiny, new_decoder_architecture=True, num_kv_heads=4, parallel_attn=False,
                    ffn_hidden_size=300, tie_word_embeddings=False)]
    if _has_transformers():
        for i, config in enumerate(layouts):
            spec = load_hf_config(_write(tmp_path, config, f"f{i}.json"))
            assert spec.param_count() == _hf_param_count(config), config
        # ALiBi Falcons (falcon-rw) have no rotary positions: traced, not a formula.
        from memfit.models import HFModelSpec

        alibi = load_hf_config(_write(tmp_path, dict(tiny, alibi=True), "alibi.json"))
        assert isinstance(alibi, HFModelSpec) and alibi.param_count() == _hf_param_count(
            dict(tiny, alibi=True))


def test_presets_keep_the_configs_dropout_and_shapes() -> None:
    # GPT2Config resid/attn_pdrop 0.1, BertConfig hidden/attention dropout 0.1, ViT 0.0, Llama
    # attention_dropout 0.0 (the Hub config.json files).
    assert (get_preset("gpt2").dropout, get_preset("gpt2").attention_dropout) == (0.1, 0.1)
    assert (get_preset("bert-large").dropout, get_preset("bert-large").attention_dropout) == (
        0.1, 0.1)
    assert (get_preset("vit-l-16").dropout, get_preset("vit-l-16").attention_dropout) == (0, 0)
    assert get_preset("llama-3-8b").dropout == get_preset("llama-3-8b").attention_dropout == 0
    # Llama-3-8B: 32 layers, 8 KV heads of 128 -> 128 KiB of bf16 KV cache per token (facts.md).
    llama = get_preset("llama-3-8b")
    assert 2 * llama.num_layers * llama.num_kv_heads * llama.head_dim * 2 == 128 * 1024
    mixtral = get_preset("mixtral-8x7b")
    assert (mixtral.num_experts, mixtral.experts_per_token) == (8, 2)
    # Mixtral activates 2 of 8 experts: published "12.9B active parameters" (Mistral AI).
    assert round(mixtral.active_param_count() / 1e9, 1) == 12.9


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_presets_match_their_hub_configs(tmp_path: Path, name: str) -> None:
    """The preset and the parsed Hub config.json describe the same architecture."""
    parsed = load_hf_config(_write(tmp_path, HF_CONFIGS[name]))
    preset = get_preset(name)
    ignore = {"name", "source"}
    for field in TransformerSpec.__dataclass_fields__:
        if field not in ignore:
            assert getattr(parsed, field) == getattr(preset, field), (name, field)


# ----------------------------------------------------------------------- config.json parsing
@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_hf_config_param_count_equals_published(tmp_path: Path, name: str) -> None:
    spec = load_hf_config(_write(tmp_path, HF_CONFIGS[name]))
    assert spec.param_count() == PUBLISHED[name]
    assert spec.family == HF_CONFIGS[name]["model_type"]


def test_hf_config_reads_a_directory_and_names_the_model(tmp_path: Path) -> None:
    model_dir = tmp_path / "my-llama"
    model_dir.mkdir()
    _write(model_dir, HF_CONFIGS["llama-3-8b"])
    spec = load_hf_config(model_dir)
    assert spec.name == "my-llama" and spec.source == str(model_dir / "config.json")
    named = dict(HF_CONFIGS["llama-3-8b"], _name_or_path="meta-llama/Meta-Llama-3-8B")
    assert load_hf_config(_write(tmp_path, named, "x.json")).name == "meta-llama/Meta-Llama-3-8B"


def test_hf_config_family_defaults(tmp_path: Path) -> None:
    """Keys left out take the transformers config class's default."""
    # LlamaConfig: num_key_value_heads defaults to num_attention_heads; no tie.
    llama = dict(HF_CONFIGS["llama-2-7b"])
    del llama["num_key_value_heads"], llama["tie_word_embeddings"]
    assert load_hf_config(_write(tmp_path, llama)).param_count() == PUBLISHED["llama-2-7b"]
    # Gemma2Config: head_dim 256 and tied embeddings by default.
    gemma = dict(HF_CONFIGS["gemma-2-9b"])
    del gemma["head_dim"], gemma["tie_word_embeddings"]
    assert load_hf_config(_write(tmp_path, gemma)).param_count() == PUBLISHED["gemma-2-9b"]
    # GPT2Config: n_inner None -> 4 * n_embd; tied head; dropout 0.1.
    gpt2 = {k: v for k, v in HF_CONFIGS["gpt2"].items() if not k.endswith("pdrop")}
    spec = load_hf_config(_write(tmp_path, gpt2))
    assert spec.param_count() == PUBLISHED["gpt2"] and spec.dropout == 0.1
    # ... and hidden_size/num_hidden_layers are GPT-2's attribute aliases.
    aliased = {"model_type": "gpt2", "hidden_size": 768, "num_hidden_layers": 12,
               "num_attention_heads": 12, "vocab_size": 50257, "n_positions": 1024}
    assert load_hf_config(_write(tmp_path, aliased)).param_count() == PUBLISHED["gpt2"]
    # Untying GPT-2's head adds one vocab x hidden matrix.
    untied = dict(HF_CONFIGS["gpt2"], tie_word_embeddings=False)
    assert load_hf_config(_write(tmp_path, untied)).param_count() == (
        PUBLISHED["gpt2"] + 50257 * 768)


def test_hf_config_biases(tmp_path: Path) -> None:
    """attention_bias adds q, k, v and o biases; mlp_bias gate, up and down biases (Llama)."""
    h, layers, kv_dim, f = 4096, 32, 8 * 128, 14336
    biased = dict(HF_CONFIGS["llama-3-8b"], attention_bias=True, mlp_bias=True)
    expected = PUBLISHED["llama-3-8b"] + layers * ((h + 2 * kv_dim + h) + (2 * f + h))
    assert load_hf_config(_write(tmp_path, biased)).param_count() == expected
    # Qwen2 hard-codes q/k/v biases: Qwen2.5-7B without them would be 28 * (3584 + 2 * 512)
    # parameters smaller, so matching the published count above already proves they are counted.
    qwen = load_hf_config(_write(tmp_path, HF_CONFIGS["qwen2.5-7b"]))
    assert qwen.qkv_bias and not qwen.attn_out_bias


def test_hf_config_vit_heads(tmp_path: Path) -> None:
    b16 = PUBLISHED["vit-b-16"]
    head_1000, pooler = 768 * 1000 + 1000, 768 * 768 + 768
    # ViTModel: pooler (dense + tanh), no classifier. google/vit-base-patch16-224-in21k's
    # ViTModel has 86,389,248 parameters.
    backbone = dict(HF_CONFIGS["vit-b-16"], architectures=["ViTModel"])
    assert load_hf_config(_write(tmp_path, backbone)).param_count() == b16 - head_1000 + pooler
    assert b16 - head_1000 + pooler == 86_389_248
    # No id2label: num_labels, else PretrainedConfig's default of 2 labels.
    no_labels = {k: v for k, v in HF_CONFIGS["vit-b-16"].items() if k != "id2label"}
    assert load_hf_config(_write(tmp_path, no_labels)).num_labels == 2
    ten = dict(no_labels, num_labels=10)
    assert load_hf_config(_write(tmp_path, ten)).param_count() == b16 - head_1000 + 7690


# --------------------------------------------------------------------------------- bad input
def _error(path: Path | str) -> str:
    with pytest.raises(MemfitError) as err:
        load_hf_config(path)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_hf_config_missing_file_or_directory(tmp_path: Path) -> None:
    message = _error(tmp_path / "nope.json")
    assert "nope.json" in message and "no such file" in message and "memfit models" in message
    assert "config.json" in _error(tmp_path)  # a directory without one


@pytest.mark.parametrize("text, expected", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"hidden_size": 8}', "missing 'model_type'"),
    ('{"model_type": 7}', "unsupported model_type 7"),
])
def test_hf_config_malformed(tmp_path: Path, text: str, expected: str) -> None:
    path = _write(tmp_path, text)
    message = _error(path)
    assert expected in message and str(path) in message


def test_hf_config_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_bytes(b"\xff\xfe\x00garbage")
    assert "UTF-8" in _error(path)


def test_hf_config_unsupported_type_names_the_supported_ones(tmp_path: Path) -> None:
    message = _error(_write(tmp_path, {"model_type": "no-such-type", "d_model": 512}))
    assert "'no-such-type'" in message
    for model_type in ("llama", "mistral", "mixtral", "qwen2", "gemma2", "gpt2", "bert", "phi3",
                       "vit"):
        assert model_type in message
        assert model_type in SUPPORTED_MODEL_TYPES


@pytest.mark.parametrize("name, change, expected", [
    ("llama-3-8b", {"hidden_size": None}, "missing required key 'hidden_size'"),
    ("llama-3-8b", {"vocab_size": None}, "missing required key 'vocab_size'"),
    ("gpt2", {"n_embd": None}, "missing required key 'n_embd' or 'hidden_size'"),
    ("bert-base", {"intermediate_size": None}, "missing required key 'intermediate_size'"),
    ("llama-3-8b", {"hidden_size": "4096"}, "'hidden_size' must be an integer, got '4096'"),
    ("llama-3-8b", {"num_hidden_layers": 32.0}, "'num_hidden_layers' must be an integer"),
    ("llama-3-8b", {"num_hidden_layers": True}, "'num_hidden_layers' must be an integer"),
    ("llama-3-8b", {"intermediate_size": 0}, "'intermediate_size' must be a positive integer"),
    ("llama-3-8b", {"num_key_value_heads": 5}, "not a multiple of num_key_value_heads (5)"),
    ("llama-3-8b", {"tie_word_embeddings": "yes"}, "'tie_word_embeddings' must be true or false"),
    ("llama-3-8b", {"attention_dropout": 1.5}, "'attention_dropout' must be a probability"),
    ("llama-3-8b", {"num_attention_heads": 24, "num_key_value_heads": 8},
     "not a multiple of num_attention_heads (24)"),
    ("mixtral-8x7b", {"num_experts_per_tok": 9}, "exceeds num_local_experts (8)"),
    ("gpt2", {"n_head": 7}, "not a multiple of n_head (7)"),
    ("bert-base", {"hidden_dropout_prob": "0.1"}, "'hidden_dropout_prob' must be a probability"),
    ("vit-b-16", {"patch_size": 15}, "not a multiple of patch_size (15)"),
    ("vit-b-16", {"id2label": ["cat", "dog"]}, "'id2label' must be an object"),
])
def test_hf_config_bad_values(tmp_path: Path, name: str, change: dict[str, Any],
                              expected: str) -> None:
    data = {k: v for k, v in HF_CONFIGS[name].items() if change.get(k, 0) is not None}
    data.update({k: v for k, v in change.items() if v is not None})
    path = _write(tmp_path, data)
    message = _error(path)
    assert expected in message, message
    assert str(path) in message and "config" in message


# ------------------------------------------------------------------------------ resolve_model
def test_resolve_model_preset_file_and_directory(tmp_path: Path) -> None:
    assert resolve_model("Mistral-7B").name == "mistral-7b"
    path = _write(tmp_path, HF_CONFIGS["phi-3-mini"])
    assert resolve_model(str(path)).param_count() == PUBLISHED["phi-3-mini"]
    assert resolve_model(str(tmp_path)).param_count() == PUBLISHED["phi-3-mini"]


def test_resolve_model_prefers_an_existing_local_snapshot(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # A local directory named like the alias "meta-llama/Meta-Llama-3-8B" holding a tiny config.
    snapshot = tmp_path / "meta-llama" / "Meta-Llama-3-8B"
    snapshot.mkdir(parents=True)
    tiny = _llama(64, 2, 4, 2, 128, 1000, 256)
    _write(snapshot, tiny)
    monkeypatch.chdir(tmp_path)
    spec = resolve_model("meta-llama/Meta-Llama-3-8B")
    # embeddings + head 2*1000*64, per layer q,o 64*64 each, k,v 64*32 each, mlp 3*64*128,
    # two RMSNorms, plus the final norm.
    per_layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64
    assert spec.param_count() == 2 * 1000 * 64 + 2 * per_layer + 64
    # A bare name that is a preset stays the preset even if the directory exists without a
    # config.json.
    (tmp_path / "gpt2").mkdir()
    assert resolve_model("gpt2").param_count() == PUBLISHED["gpt2"]


@pytest.mark.parametrize("text, expected", [
    ("./missing/config.json", "no such file or directory"),
    ("models/llama.json", "no such file or directory"),
    ("~/definitely-not-here-memfit", "no such file or directory"),
    ("lama-3-8b", "did you mean"),
    ("", "empty model name"),
])
def test_resolve_model_bad_input(text: str, expected: str) -> None:
    with pytest.raises(MemfitError) as err:
        resolve_model(text)
    message = str(err.value)
    assert expected in message and "memfit models" in message and "\n" not in message


def test_exports() -> None:
    assert set(memfit.models.__all__) == {
        "HFModelSpec", "LinearShape", "ModelSpec", "ParamCountSpec", "TransformerSpec",
        "SUPPORTED_MODEL_TYPES",
        "get_preset", "is_preset", "list_presets", "load_hf_config", "preset_aliases",
        "published_params", "resolve_model"}


# ------------------------------------------------- independent count: the real HF modules
def _hf_param_count(config: dict[str, Any]) -> int:
    """Build the transformers model on the meta device and count its parameters (tied once)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    values = {k: v for k, v in config.items() if k not in ("model_type", "architectures")}
    hf_config = transformers.AutoConfig.for_model(config["model_type"], **values)
    with torch.device("meta"):
        if config["model_type"] == "bert":
            model = transformers.BertModel(hf_config)  # with pooler, as the preset counts
        elif config["model_type"] == "vit":
            if config.get("architectures") == ["ViTModel"]:
                model = transformers.ViTModel(hf_config)
            else:
                model = transformers.ViTForImageClassification(hf_config)
        else:
            model = transformers.AutoModelForCausalLM.from_config(hf_config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_transformers_meta_model_matches_published(name: str) -> None:
    pytest.importorskip("transformers")
    assert _hf_param_count(HF_CONFIGS[name]) == PUBLISHED[name]


def test_transformers_meta_model_matches_variants(tmp_path: Path) -> None:
    """Configs off the presets' path: biases, untied GPT-2, ViTModel, a tiny GQA Llama."""
    pytest.importorskip("transformers")
    variants = [
        dict(_llama(256, 2, 8, 2, 512, 1000, 128), attention_bias=True, mlp_bias=True),
        dict(_llama(256, 2, 8, 4, 512, 1000, 128, "qwen2"), tie_word_embeddings=True),
        dict(_llama(256, 2, 4, 2, 512, 1000, 128, "gemma2"), head_dim=32, attention_bias=True),
        dict(_llama(256, 2, 8, 4, 512, 1000, 128, "mixtral"), num_local_experts=4,
             num_experts_per_tok=1),
        dict(_llama(256, 2, 8, 4, 512, 1000, 128, "mistral"), head_dim=48),
        dict(_llama(256, 2, 8, 4, 512, 1000, 128, "phi3"), pad_token_id=0),
        dict(HF_CONFIGS["gpt2"], n_layer=2, tie_word_embeddings=False, n_inner=1000),
        dict(HF_CONFIGS["vit-b-16"], architectures=["ViTModel"], num_hidden_layers=2),
        dict(_bert(128, 2, 4), type_vocab_size=3, max_position_embeddings=64),
        dict(_qwen3(256, 2, 8, 512, True), head_dim=48, attention_bias=True),
        dict(_llama(256, 2, 8, 4, 512, 1000, 128, "qwen3_moe"), num_experts=4,
             num_experts_per_tok=2, moe_intermediate_size=96),
        dict(_llama(256, 2, 8, 4, 512, 1000, 128, "olmo2"), attention_bias=True, head_dim=48,
             pad_token_id=0),
        _gemma3(256, 2, 4, 2, 512, 1000, head_dim=32, tie_word_embeddings=False,
                attention_bias=True),
        dict(PYTHIA_160M, num_hidden_layers=2, attention_bias=False, tie_word_embeddings=True),
        dict(PHI_2, num_hidden_layers=2, num_key_value_heads=8, tie_word_embeddings=True),
    ]
    for i, config in enumerate(variants):
        spec = load_hf_config(_write(tmp_path, config, f"c{i}.json"))
        assert spec.param_count() == _hf_param_count(config), config["model_type"]


@pytest.mark.parametrize(("params", "needle"), [
    (0, "must be positive"), (-5, "must be positive"), (10**15 + 1, "above 1e15")])
def test_param_count_spec_bounds_name_both_spellings(params: int, needle: str) -> None:
    from memfit.models.spec import ParamCountSpec

    with pytest.raises(MemfitError, match=needle) as info:
        ParamCountSpec(name="x", params=params)
    assert "params=" in str(info.value) and "--params" in str(info.value)
    assert ParamCountSpec(name="x", params=10**15).param_count() == 10**15
