"""The weights one GPU of a vLLM 0.33.0 TP group holds, as vLLM lays them out.

vLLM's ``model_memory_usage`` (the first term ``determine_available_memory`` subtracts) is
what the loaded model occupies on the rank. Per rank:

- **Column-parallel** layers (q/k/v, gate/up; ``vllm/model_executor/layers/linear.py:
  ColumnParallelLinear``) split their output features by ``tp``; **row-parallel** layers
  (o_proj, down_proj; ``RowParallelLinear``) split their input features. ``QKVParallelLinear``
  keeps one KV head per rank, replicated, when ``tp > num_key_value_heads``
  (``num_kv_head_replicas = tp // kv_heads``).
- The embedding and the LM head (``vocab_parallel_embedding.py: VocabParallelEmbedding``,
  ``ParallelLMHead``) pad the vocabulary to a multiple of 64 (``pad_vocab_size``,
  ``DEFAULT_VOCAB_PADDING_SIZE``), then split the padded rows by ``tp``. A model that ties
  them (``tie_word_embeddings``) holds one tensor.
- Norms and the MoE router are replicated.
- The rotary embedding's ``cos_sin_cache`` buffer, ``[max_position_embeddings, rotary_dim]``
  in the model dtype, one per model (``rotary_embedding/base.py: RotaryEmbedding.__init__``;
  ``get_rope`` caches instances in ``_ROPE_DICT``): 32 MiB for Llama-3.1's 131,072 positions.
  It is allocated while loading, so vLLM counts it with the weights.
- Quantized linear layers hold the tensors each method's ``create_weights`` registers (see
  :data:`QUANT_FORMATS`); embeddings, LM head, norms and the router stay in the model dtype
  (the methods quantize ``LinearBase`` layers only).

Two sources: the config (shapes, per layer) or a folder's safetensors headers (each tensor's
stored bytes, sharded by its name's role). Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit.errors import MemfitError, suggest
from memfit.serving.kv_spec import config_int, text_config

__all__ = ["QUANT_FORMATS", "QuantFormat", "WeightBytes", "check_quant", "linear_bytes",
           "pad_vocab_size", "rope_cache_bytes", "weights_from_checkpoint",
           "weights_from_config"]

VOCAB_PADDING = 64
"""``vocab_parallel_embedding.py: DEFAULT_VOCAB_PADDING_SIZE``."""

_Q = "vllm/model_executor/layers/quantization/"


@dataclass(frozen=True, kw_only=True)
class QuantFormat:
    """One ``--quant`` format: what vLLM 0.33.0's linear method registers per layer."""

    name: str
    vllm_method: str | None
    """vLLM's ``--quantization`` name (None: vLLM 0.33.0 has no method for it)."""
    min_capability: int
    """``QuantizationConfig.get_min_capability()`` (major x 10 + minor); vLLM refuses a GPU
    below it (``vllm/config/vllm.py: VllmConfig._get_quantization_config``)."""
    group_size: int
    """Weights per scale along the input dimension (-1: one per output channel)."""
    layout: str
    source: str


QUANT_FORMATS: dict[str, QuantFormat] = {
    "awq": QuantFormat(
        name="awq", vllm_method="awq", min_capability=75, group_size=128,
        layout="qweight int32 [in, out/8], qzeros int32 [in/g, out/8], scales dtype [in/g, out]",
        source=_Q + "auto_awq.py: AutoAWQMarlinLinearMethod.create_weights; "
        "AutoAWQConfig.get_min_capability = 75"),
    "gptq": QuantFormat(
        name="gptq", vllm_method="gptq", min_capability=60, group_size=128,
        layout="qweight int32 [in/8, out], qzeros int32 [in/g, out/8], scales dtype [in/g, out]",
        source=_Q + "auto_gptq.py: create_weights; AutoGPTQConfig.get_min_capability = 60"),
    "fp8": QuantFormat(
        name="fp8", vllm_method="fp8", min_capability=75, group_size=-1,
        layout="weight float8_e4m3fn [out, in], weight_scale float32 per logical shard",
        source=_Q + "fp8.py: Fp8LinearMethod.create_weights (utils/fp8_utils.py: "
        "create_fp8_weight_parameter, create_fp8_scale_parameter, per-tensor); "
        "Fp8Config.get_min_capability = 75 (Marlin weight-only below sm 89)"),
    "nvfp4": QuantFormat(
        name="nvfp4", vllm_method="modelopt_fp4", min_capability=75, group_size=16,
        layout="weight uint8 [out, in/2], weight_scale float8_e4m3fn [out, in/16], "
        "weight_scale_2 and input_scale float32 per logical shard",
        source=_Q + "modelopt.py: KNvfp4Static.create_weights (group_size 16); "
        "ModelOptNvFp4Config.get_min_capability = 75 (Marlin W4A16 below sm 100)"),
    "bnb-4bit": QuantFormat(
        name="bnb-4bit", vllm_method=None, min_capability=0, group_size=64,
        layout="not served by vLLM 0.33.0",
        source=_Q + "__init__.py: get_quantization_config (method_to_config has no "
        "bitsandbytes entry in 0.33.0)"),
}
"""The ``--quant`` formats and the vLLM 0.33.0 source of each layout."""


def check_quant(quant: str | None, compute_capability: str | None = None) -> QuantFormat | None:
    """The format for ``--quant``, or MemfitError (one line) for an unknown name, one vLLM
    0.33.0 does not serve, or a GPU below its minimum capability.

    >>> check_quant("fp8", "7.0")
    Traceback (most recent call last):
    memfit.errors.MemfitError: --quant fp8 needs compute capability 7.5 ...
    """
    if quant is None or quant == "none":
        return None
    fmt = QUANT_FORMATS.get(quant)
    if fmt is None:
        raise MemfitError(f"unknown --quant {quant!r}{suggest(quant, list(QUANT_FORMATS))}; "
                          f"valid: {', '.join(QUANT_FORMATS)}")
    if fmt.vllm_method is None:
        raise MemfitError(f"--quant {quant}: vLLM 0.33.0 has no bitsandbytes method "
                          f"({fmt.source}); serve an awq, gptq, fp8 or nvfp4 checkpoint")
    if compute_capability and compute_capability[0].isdigit():
        major, _, minor = compute_capability.partition(".")
        capability = int(major) * 10 + int(minor or 0)
        if capability < fmt.min_capability:
            need = f"{fmt.min_capability // 10}.{fmt.min_capability % 10}"
            raise MemfitError(
                f"--quant {quant} needs compute capability {need} in vLLM 0.33.0 "
                f"({fmt.source.split('; ')[-1]}); the GPU has {compute_capability}: "
                "pick a newer GPU or another --quant (gptq runs from 6.0)")
    return fmt


def pad_vocab_size(vocab_size: int, pad_to: int = VOCAB_PADDING) -> int:
    """``vocab_parallel_embedding.py: pad_vocab_size``: round up to a multiple of 64.

    >>> pad_vocab_size(128256), pad_vocab_size(32001)
    (128256, 32064)
    """
    return -(-vocab_size // pad_to) * pad_to


def linear_bytes(in_features: int, out_features: int, *, dtype_bytes: int,
                 quant: QuantFormat | None = None, shards: int = 1,
                 group_size: int | None = None) -> int:
    """Bytes of one linear layer's partition of ``in_features x out_features`` (already divided
    by TP), with ``shards`` logical shards fused in it (q/k/v: 3; gate/up: 2), no bias.

    >>> linear_bytes(4096, 4096, dtype_bytes=2)
    33554432
    >>> awq = QUANT_FORMATS["awq"]  # 4-bit, groups of 128
    >>> linear_bytes(4096, 4096, dtype_bytes=2, quant=awq) == (
    ...     4096 * 512 * 4 + 32 * 512 * 4 + 32 * 4096 * 2)
    True
    """
    if quant is None:
        return in_features * out_features * dtype_bytes
    g = group_size if group_size is not None else quant.group_size
    groups = 1 if g == -1 else in_features // g
    if quant.name == "awq":  # packed along the output dimension
        return (in_features * (out_features // 8) * 4 + groups * (out_features // 8) * 4
                + groups * out_features * dtype_bytes)
    if quant.name == "gptq":  # qweight packed along the input dimension
        return ((in_features // 8) * out_features * 4 + groups * (out_features // 8) * 4
                + groups * out_features * dtype_bytes)
    if quant.name == "fp8":
        return in_features * out_features + 4 * shards
    if quant.name == "nvfp4":
        return out_features * (in_features // 2) + out_features * (in_features // 16) \
            + 2 * 4 * shards
    raise MemfitError(f"--quant {quant.name}: no layout")


@dataclass(frozen=True, kw_only=True)
class WeightBytes:
    """The weights on one rank of the TP group, by part (bytes)."""

    parts: dict[str, int]
    """``embedding``, ``lm_head`` (0 when tied), ``attention``, ``mlp``, ``norms``,
    ``rope_cache``, ``other``."""
    source: str
    """``config`` or the safetensors folder read."""
    quant: str | None

    @property
    def total(self) -> int:
        return sum(self.parts.values())


def _int(data: Mapping[str, Any], *keys: str, default: int | None = None) -> int:
    return config_int(data, *keys, default=default,
                      fix="pass a full config.json or the checkpoint folder")


def _kv_per_rank(kv_heads: int, tp: int) -> int:
    # linear.py: QKVParallelLinear: one replicated KV head per rank when tp >= kv_heads
    return 1 if tp >= kv_heads else kv_heads // tp


_QK_NORM_TYPES = ("qwen3", "qwen3_moe", "gemma3", "gemma3_text")
_NO_ROPE_TYPES = ("gpt2", "gpt_bigcode", "opt", "bloom", "mpt", "bert", "roberta", "t5")


def rope_cache_bytes(config: Mapping[str, Any], dtype_bytes: int) -> int:
    """The ``cos_sin_cache`` buffer: ``max_position_embeddings x rotary_dim x dtype`` with
    ``rotary_dim = head_dim x partial_rotary_factor`` (``rotary_embedding/__init__.py:
    get_rope``); 0 for a model without RoPE or a config without ``max_position_embeddings``.
    Scaled RoPE variants that extend the cache (YaRN's ``max_position x factor``) and models
    with two RoPEs (Gemma-3's local and global) are counted as one plain cache.

    >>> rope_cache_bytes({"hidden_size": 4096, "num_attention_heads": 32,
    ...                   "max_position_embeddings": 131072}, 2) == 32 * 2**20
    True
    """
    data = text_config(config)
    positions = data.get("max_position_embeddings")
    if str(data.get("model_type")) in _NO_ROPE_TYPES or not isinstance(positions, int):
        return 0
    heads = _int(data, "num_attention_heads", "n_head")
    head_dim = _int(data, "head_dim", default=_int(data, "hidden_size") // heads)
    params = data.get("rope_parameters") or data.get("rope_scaling") or {}
    factor = data.get("partial_rotary_factor") or (
        params.get("partial_rotary_factor") if isinstance(params, Mapping) else None) or 1.0
    return positions * int(head_dim * float(factor)) * dtype_bytes


# The text model types whose transformers config class ties the embeddings when the config.json
# does not say (``tie_word_embeddings=True`` in the class's ``__init__``; read from the classes
# of transformers 5.24: GemmaConfig ... Gemma3nTextConfig, GPT2Config, FalconConfig,
# Starcoder2Config, CohereConfig, SmolLM3Config, BloomConfig, OPTConfig). Llama, Mistral,
# Qwen2/3, Phi-3, DeepSeek, gpt-oss and the hybrids default to untied.
_TIED_BY_DEFAULT = frozenset({"gemma", "gemma2", "gemma3", "gemma3_text", "gemma3n",
                              "gemma3n_text", "gpt2", "falcon", "starcoder2", "cohere",
                              "smollm3", "bloom", "opt"})


def tied_embeddings(config: Mapping[str, Any]) -> bool:
    """Whether the LM head is the embedding (one tensor in vLLM): the text config's
    ``tie_word_embeddings``, else the top level's (a multimodal config may set it there), else
    the config class's default for the model type (:data:`_TIED_BY_DEFAULT`)."""
    data = text_config(config)
    for source in (data, config):
        value = source.get("tie_word_embeddings")
        if value is not None:
            return bool(value)
    return str(data.get("model_type")) in _TIED_BY_DEFAULT


def weights_from_config(config: Mapping[str, Any], *, tp: int = 1, dtype_bytes: int = 2,
                        quant: QuantFormat | None = None) -> WeightBytes:
    """Per-rank weights of a decoder (dense, or MoE with ``num_local_experts`` /
    ``num_experts``) from its config's shapes.

    Llama-3-8B in bf16 on one GPU: 8,030,261,248 parameters x 2 bytes.

    >>> cfg = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
    ...        "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256}
    >>> weights_from_config(cfg).total == 8030261248 * 2
    True
    """
    data = text_config(config)
    if data.get("kv_lora_rank"):
        raise MemfitError("MLA models (kv_lora_rank) are not sized from the config yet; pass "
                          "the checkpoint folder (its safetensors headers are read)")
    hidden = _int(data, "hidden_size", "d_model")
    layers = _int(data, "num_hidden_layers", "n_layer")
    heads = _int(data, "num_attention_heads", "n_head")
    kv_heads = _int(data, "num_key_value_heads", default=heads)
    head_dim = _int(data, "head_dim", default=hidden // heads)
    vocab = _int(data, "vocab_size")
    experts = _int(data, "num_local_experts", "num_experts", default=0)
    inter = _int(data, "moe_intermediate_size", "intermediate_size") if experts else \
        _int(data, "intermediate_size", "ffn_dim")
    if experts and (data.get("shared_expert_intermediate_size") or
                    data.get("n_shared_experts") or data.get("first_k_dense_replace")):
        raise MemfitError("MoE models with shared experts or dense first layers are not sized "
                          "from the config yet; pass the checkpoint folder")
    if heads % tp:
        raise MemfitError(f"--tp {tp} does not divide the {heads} attention heads; vLLM "
                          "refuses it (vllm/config/model.py: verify_with_parallel_config)")
    if inter % tp:
        raise MemfitError(f"--tp {tp} does not divide the MLP's {inter} features")
    b = dtype_bytes
    q_out = heads // tp * head_dim
    kv_out = _kv_per_rank(kv_heads, tp) * head_dim
    qkv = linear_bytes(hidden, q_out + 2 * kv_out, dtype_bytes=b, quant=quant, shards=3)
    o = linear_bytes(heads // tp * head_dim, hidden, dtype_bytes=b, quant=quant)
    attn_bias = (q_out + 2 * kv_out) * b if data.get("attention_bias") or \
        data.get("model_type") in ("qwen2", "qwen2_moe") else 0
    qk_norm = 2 * head_dim * b if data.get("model_type") in _QK_NORM_TYPES else 0
    gate_up = linear_bytes(hidden, 2 * (inter // tp), dtype_bytes=b, quant=quant, shards=2)
    down = linear_bytes(inter // tp, hidden, dtype_bytes=b, quant=quant)
    mlp = (gate_up + down) * max(experts, 1) + (hidden * experts * b if experts else 0)
    mlp_bias = (2 * (inter // tp) + hidden) * b if data.get("mlp_bias") else 0
    norms_per_layer = 4 if str(data.get("model_type", "")).startswith("gemma") and \
        str(data.get("model_type")) != "gemma" else 2
    padded = pad_vocab_size(vocab)
    embedding = padded // tp * hidden * b
    tied = tied_embeddings(config)
    return WeightBytes(parts={
        "embedding": embedding,
        "lm_head": 0 if tied else embedding,
        "attention": layers * (qkv + o + attn_bias + qk_norm),
        "mlp": layers * (mlp + mlp_bias),
        "norms": (layers * norms_per_layer + 1) * hidden * b,
        "rope_cache": rope_cache_bytes(data, b),
    }, source="config", quant=quant.name if quant else None)


_COLUMN = ("q_proj", "k_proj", "v_proj", "qkv_proj", "gate_proj", "up_proj", "gate_up_proj",
           "w1", "w3", "c_attn", "fc1", "query_key_value", "dense_h_to_4h")
_ROW = ("o_proj", "down_proj", "w2", "c_proj", "fc2", "dense_4h_to_h", "out_proj")
_VOCAB = ("embed_tokens", "lm_head", "wte", "word_embeddings")
_FLOATS = ("F32", "F16", "BF16", "F64")


def _named(part: str, names: tuple[str, ...]) -> bool:
    # gpt-oss stores experts as gate_up_proj_blocks / _scales / _bias
    return any(part == n or part.startswith(n + "_") for n in names)


def _role(name: str) -> str:
    parts = name.split(".")
    if any(p in _VOCAB for p in parts):
        return "vocab"
    if any(_named(p, ("k_proj", "v_proj")) for p in parts):
        return "kv"
    row = any(_named(p, _ROW) for p in parts)
    if row and parts[-1].endswith("bias"):
        return "replicated"  # a row-parallel bias is added after the all-reduce, whole
    if row or any(_named(p, _COLUMN) for p in parts):
        return "sharded"
    return "replicated"


def weights_from_checkpoint(folder: str | Path, config: Mapping[str, Any], *, tp: int = 1,
                            dtype_bytes: int = 2) -> WeightBytes:
    """Per-rank weights from a folder's safetensors headers (quantization scales and zeros
    included as stored). A floating-point tensor counts at the serving dtype (``--dtype
    auto`` runs a float32 checkpoint in 16 bits); packed integers, fp8 and fp4 tensors as
    stored. Sharded roles by name: embedding and LM head by padded vocabulary rows / tp;
    k/v projections / tp, or one KV head's share when ``tp > kv_heads``; the other q/k/v,
    gate/up/down and o projections (and experts' w1/w2/w3) / tp; everything else replicated."""
    from memfit.models.checkpoint import tensor_entries

    data = text_config(config)
    vocab = _int(data, "vocab_size")
    heads = _int(data, "num_attention_heads", default=1)
    kv_heads = _int(data, "num_key_value_heads", default=heads)
    tied = tied_embeddings(config)
    entries = tensor_entries(folder)
    if entries is None:
        raise MemfitError(f"{folder}: no model.safetensors or index; pass the config instead")
    parts = {"embedding": 0, "lm_head": 0, "attention": 0, "mlp": 0, "norms": 0,
             "rope_cache": rope_cache_bytes(data, dtype_bytes), "other": 0}
    for name, (dtype, numel, nbytes) in entries.items():
        if dtype in _FLOATS:
            nbytes = numel * dtype_bytes
        role = _role(name)
        if role == "vocab":
            if tied and "lm_head" in name.split("."):
                continue  # transformers may store a tied head; vLLM holds one tensor
            # rows are vocab entries: pad, then split (VocabParallelEmbedding)
            share = nbytes * pad_vocab_size(vocab) // vocab // tp
            parts["lm_head" if "lm_head" in name else "embedding"] += share
            continue
        if role == "kv":
            share = nbytes // kv_heads if tp >= kv_heads else nbytes // tp
        elif role == "sharded":
            share = nbytes // tp
        else:
            share = nbytes
        key = "norms" if "norm" in name else "attention" if any(
            p in name for p in ("attn", "attention")) else "mlp" if any(
            p in name for p in ("mlp", "expert", "moe", "ffn")) else "other"
        parts[key] += share
    return WeightBytes(parts=parts, source=str(folder), quant=None)
