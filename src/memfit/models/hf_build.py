"""The transformers bridge: the Hugging Face model of a :class:`TransformerSpec`, built from a
config made in code (never downloaded): ``AutoModelForCausalLM`` for decoders, ``BertModel``
(with pooler) for BERT, ``ViTForImageClassification`` for ViT. Needs ``pip install
'memfit[hf]'``; ``build.py``'s :func:`~memfit.models.build.build_model` is the entry point.
"""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

from memfit.errors import MemfitError, suggest
from memfit.models.builtin_layers import _DEFAULT_NORM_EPS, _NORM_EPS, _rope_theta
from memfit.models.spec import TransformerSpec

# family -> (config class, model class); the Auto class used to build it is picked by arch.
_HF_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM"),
    "phi": ("PhiConfig", "PhiForCausalLM"),
    "falcon": ("FalconConfig", "FalconForCausalLM"),
    "bert": ("BertConfig", "BertModel"),
    "vit": ("ViTConfig", "ViTForImageClassification"),
}


def _import_transformers() -> Any:
    try:
        return importlib.import_module("transformers")
    except ImportError:
        raise MemfitError(
            "backend 'transformers' needs the transformers package: pip install 'memfit[hf]' "
            "(or use backend='builtin')") from None


def _hf_config(spec: TransformerSpec, hf: Any) -> Any:
    """The Hugging Face config for ``spec``, built in code (nothing is downloaded)."""
    eps = _NORM_EPS.get(spec.family, _DEFAULT_NORM_EPS)
    config_class = getattr(hf, _HF_CLASSES[spec.family][0])
    if spec.family == "gpt2":
        return config_class(
            vocab_size=spec.vocab_size, n_positions=spec.max_position_embeddings,
            n_embd=spec.hidden_size, n_layer=spec.num_layers, n_head=spec.num_heads,
            n_inner=spec.intermediate_size, activation_function="gelu_new",
            resid_pdrop=spec.dropout, embd_pdrop=spec.dropout, attn_pdrop=spec.attention_dropout,
            layer_norm_epsilon=eps, tie_word_embeddings=spec.tie_embeddings, use_cache=False,
            bos_token_id=None, eos_token_id=None)
    if spec.family == "gpt_neox":
        return config_class(
            vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
            num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
            intermediate_size=spec.intermediate_size, hidden_act="gelu",
            max_position_embeddings=spec.max_position_embeddings or 2048, layer_norm_eps=eps,
            tie_word_embeddings=spec.tie_embeddings, attention_bias=spec.qkv_bias,
            hidden_dropout=spec.dropout, attention_dropout=spec.attention_dropout,
            use_cache=False, bos_token_id=None, eos_token_id=None)
    if spec.family == "falcon":
        # A layout with the spec's parameters: two norms -> the new decoder architecture
        # (kv heads of its own); one norm -> parallel attention, multi-query when kv is 1.
        new = spec.norms_per_layer == 2 or spec.num_kv_heads not in (1, spec.num_heads)
        return config_class(
            vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
            num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
            num_kv_heads=spec.num_kv_heads, new_decoder_architecture=new,
            num_ln_in_parallel_attn=spec.norms_per_layer if new else None,
            multi_query=spec.num_kv_heads == 1, parallel_attn=True, bias=spec.qkv_bias,
            ffn_hidden_size=spec.intermediate_size, alibi=False,
            max_position_embeddings=spec.max_position_embeddings or 2048,
            layer_norm_epsilon=eps, tie_word_embeddings=spec.tie_embeddings,
            hidden_dropout=spec.dropout, attention_dropout=spec.attention_dropout,
            use_cache=False, bos_token_id=None, eos_token_id=None)
    if spec.family == "phi":
        return config_class(
            vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
            intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
            num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
            head_dim=spec.head_dim, resid_pdrop=spec.dropout, embd_pdrop=spec.dropout,
            attention_dropout=spec.attention_dropout, hidden_act="gelu_new",
            max_position_embeddings=spec.max_position_embeddings or 2048, layer_norm_eps=eps,
            tie_word_embeddings=spec.tie_embeddings, qk_layernorm=spec.qk_norm == "head",
            use_cache=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if spec.family in ("bert", "vit"):
        common = dict(
            hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers,
            num_attention_heads=spec.num_heads, intermediate_size=spec.intermediate_size,
            hidden_act="gelu", hidden_dropout_prob=spec.dropout,
            attention_probs_dropout_prob=spec.attention_dropout, layer_norm_eps=eps)
        if spec.family == "bert":
            return config_class(**common, vocab_size=spec.vocab_size,
                                max_position_embeddings=spec.max_position_embeddings,
                                type_vocab_size=spec.type_vocab_size)
        return config_class(**common, image_size=spec.image_size, patch_size=spec.patch_size,
                            num_channels=spec.num_channels, qkv_bias=spec.qkv_bias,
                            num_labels=spec.num_labels)
    # Llama-style decoders. Sliding windows and soft-capping are off: the spec ignores them.
    act = "silu" if spec.mlp == "swiglu" else "gelu_pytorch_tanh"
    kwargs: dict[str, Any] = dict(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim, max_position_embeddings=spec.max_position_embeddings or 2048,
        rms_norm_eps=eps, rope_theta=_rope_theta(spec), tie_word_embeddings=spec.tie_embeddings,
        attention_dropout=spec.attention_dropout, use_cache=False,
        pad_token_id=None, bos_token_id=None, eos_token_id=None)
    if spec.family == "llama":
        kwargs.update(hidden_act=act, attention_bias=spec.qkv_bias, mlp_bias=spec.mlp_bias)
    elif spec.family in ("mistral", "mixtral"):
        kwargs.update(hidden_act=act, sliding_window=None)
        if spec.family == "mixtral":
            kwargs.update(num_local_experts=spec.num_experts,
                          num_experts_per_tok=spec.experts_per_token)
    elif spec.family == "qwen2":
        kwargs.update(hidden_act=act, use_sliding_window=False)
    elif spec.family in ("qwen3", "qwen3_moe"):
        kwargs.update(hidden_act=act, attention_bias=spec.qkv_bias, use_sliding_window=False)
        if spec.family == "qwen3_moe":
            kwargs.update(num_experts=spec.num_experts, num_experts_per_tok=spec.experts_per_token,
                          moe_intermediate_size=spec.intermediate_size, decoder_sparse_step=1,
                          mlp_only_layers=[])
    elif spec.family == "olmo2":
        kwargs.update(hidden_act=act, attention_bias=spec.qkv_bias)
    elif spec.family == "gemma3_text":
        kwargs.update(hidden_activation=act, attention_bias=spec.qkv_bias,
                      query_pre_attn_scalar=spec.head_dim, final_logit_softcapping=None,
                      attn_logit_softcapping=None,
                      layer_types=["full_attention"] * spec.num_layers)
    elif spec.family == "gemma2":
        kwargs.update(hidden_activation=act, attention_bias=spec.qkv_bias,
                      query_pre_attn_scalar=spec.head_dim, final_logit_softcapping=None,
                      attn_logit_softcapping=None,
                      layer_types=["full_attention"] * spec.num_layers)
    elif spec.family == "phi3":
        kwargs.update(hidden_act=act, resid_pdrop=spec.dropout, embd_pdrop=spec.dropout)
    return config_class(**kwargs)


def _build_transformers(spec: TransformerSpec, attn_implementation: str | None) -> nn.Module:
    hf = _import_transformers()
    if spec.family not in _HF_CLASSES:
        raise MemfitError(
            f"model {spec.name!r}: family {spec.family!r} has no transformers mapping; supported: "
            f"{', '.join(_HF_CLASSES)}{suggest(spec.family, _HF_CLASSES)}; or use "
            "backend='builtin'")
    config = _hf_config(spec, hf)
    model_class = getattr(hf, _HF_CLASSES[spec.family][1])
    supports_sdpa = bool(getattr(model_class, "_supports_sdpa", False))
    if attn_implementation is None:
        attn_implementation = "sdpa" if supports_sdpa else "eager"
    elif attn_implementation == "sdpa" and not supports_sdpa:
        raise MemfitError(
            f"transformers {hf.__version__} has no SDPA attention for {model_class.__name__}; "
            "use attn_implementation='eager' (or leave it unset)")
    if spec.arch == "decoder":
        return hf.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    if spec.family == "bert":
        return hf.AutoModel.from_config(config, attn_implementation=attn_implementation,
                                        add_pooling_layer=spec.pooler)
    return hf.AutoModelForImageClassification.from_config(
        config, attn_implementation=attn_implementation)

