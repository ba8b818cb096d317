"""Each decoder layer's KV cache, per tensor-parallel rank, from a transformers ``config.json``.

The layout follows the architecture layer by layer (the mistakes other tools made are in issue
22: sliding-window layers left out, Qwen3's explicit ``head_dim`` ignored, MLA's latent counted as
full heads, Gemma 3n's shared-KV layers counted twice):

- full attention, GQA/MQA: ``2 (K, V) x kv_heads x head_dim x dtype`` bytes per token, with
  ``head_dim`` from the config when it has one (Qwen3, Gemma), else ``hidden / heads``;
- sliding-window layers, from ``layer_types`` or the pattern the transformers config class
  derives (Gemma-2 alternate, Gemma-3 ``sliding_window_pattern``, Qwen2
  ``use_sliding_window`` + ``max_window_layers``); gpt-oss's attention sinks add no cache;
- MLA (DeepSeek-V2/V3, Kimi-K2): one latent of ``kv_lora_rank + qk_rope_head_dim`` per token,
  shared by all heads and not split by TP;
- Mamba / linear-attention layers (Jamba, Nemotron-H, Qwen3-Next): a fixed state per request;
- shared-KV layers (Gemma 3n ``num_kv_shared_layers``): no cache of their own;
- KV dtype: ``auto`` is the model's dtype (``fp8`` 1 byte);
- TP: ``max(1, kv_heads // tp)`` KV heads per rank, replicated when ``tp > kv_heads``.

The engine-specific paging of these layers is :mod:`memfit.serving.vllm`. Only ``json`` reads the
config; nothing is imported from transformers or vLLM.

Known limitations: chunked-local attention (Llama-4) and encoder-decoder cross attention are
refused; a vision tower's encoder cache is not counted (it is no KV cache).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from memfit.errors import MemfitError

__all__ = ["KV_DTYPES", "LayerKV", "kv_spec", "model_context_length", "model_dtype_bytes",
           "text_config"]

LayerKind = Literal["full", "sliding", "mla", "mamba", "linear", "shared"]

KV_DTYPES: dict[str, int | None] = {"auto": None, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1,
                                    "bfloat16": 2, "float16": 2}
"""``--kv-cache-dtype`` values and their bytes per element (``auto``: the model's dtype).
vLLM's ``CacheDType`` (``vllm/config/cache.py``); the per-token-head and nvfp4 variants are not
modelled."""

# The checkpoint dtype -> bytes of the dtype vLLM runs it in with ``--dtype auto``: float32
# checkpoints run in 16 bits (vllm/config/model.py: _resolve_auto_dtype downcasts float32).
_MODEL_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 2, "half": 2, "float": 2}

# head_dim defaults of the transformers config classes that set one (Gemma2/3Config 256,
# Qwen3Config 128, GptOssConfig 64); the others use hidden_size // num_attention_heads.
_HEAD_DIM_DEFAULT = {"gemma2": 256, "gemma3_text": 256, "gemma3n_text": 256, "qwen3": 128,
                     "qwen3_moe": 128, "gpt_oss": 64, "qwen3_next": 256}

# The keys vLLM reads for the model's context, smallest wins, and the RoPE types whose
# max_position_embeddings is already the scaled context (vllm/config/model.py).
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                 "model_max_length", "max_target_positions", "max_sequence_length",
                 "max_seq_length", "seq_len")
_ROPE_PRESCALED = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")

# Qwen2Config's rule (``use_sliding_window``, ``max_window_layers``), which the Qwen2-VL and
# Qwen2.5-VL text configs share (Qwen2VLTextConfig, Qwen2_5_VLTextConfig)
_QWEN_WINDOWED = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "qwen2_vl", "qwen2_vl_text",
                  "qwen2_5_vl", "qwen2_5_vl_text")

_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding",
                "linear_attention": "linear", "mamba": "mamba", "attention": "full"}


@dataclass(frozen=True, kw_only=True)
class LayerKV:
    """One decoder layer's cache on one TP rank.

    ``kind``: ``full`` / ``sliding`` (K and V per KV head per token), ``mla`` (one latent per
    token), ``mamba`` / ``linear`` (a fixed state per request, ``state_shapes``), ``shared``
    (reads layer ``shares_with``'s cache, holds none).
    """

    index: int
    kind: LayerKind
    num_kv_heads: int = 0
    """KV heads on this rank (1 for MLA's latent)."""
    head_size: int = 0
    """K head size (MLA: ``kv_lora_rank + qk_rope_head_dim``)."""
    head_size_v: int = 0
    """V head size (0 for MLA: the latent holds both)."""
    dtype_bytes: int = 0
    sliding_window: int | None = None
    sinks: bool = False
    """gpt-oss's learned attention sinks: a per-head logit, no cache."""
    state_shapes: tuple[tuple[int, ...], ...] = ()
    state_dtype_bytes: tuple[int, ...] = ()
    shares_with: int | None = None
    draft: bool = False
    """A speculative draft's layer (vLLM's ``KVCacheSpec.is_draft``): same pool, grouped like
    the target's layers (:mod:`memfit.serving.speculative`)."""

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes each token adds to this layer: ``kv_heads x (head_size + head_size_v) x
        dtype`` (for MLA ``head_size x dtype``); 0 for state and shared layers."""
        if self.kind in ("full", "sliding", "mla"):
            return self.num_kv_heads * (self.head_size + self.head_size_v) * self.dtype_bytes
        return 0

    @property
    def state_bytes(self) -> int:
        """A Mamba / linear-attention layer's state per request: the sum of each state tensor's
        elements times its dtype's bytes."""
        return sum(math.prod(s) * b for s, b in zip(self.state_shapes, self.state_dtype_bytes,
                                                   strict=True))


class _Cfg:
    """The text model's config with typed reads; errors name the key and the fix."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        self.data = data
        self.model_type = str(data.get("model_type", ""))

    def get(self, key: str, default: Any = None) -> Any:
        value = self.data.get(key)
        return default if value is None else value

    def int_(self, key: str, default: int | None = None) -> int:
        value = self.data.get(key)
        if value is None:
            if default is None:
                raise MemfitError(f"config has no {key!r} (model_type {self.model_type!r}); add "
                                  "it from the model's config.json on the Hub")
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise MemfitError(f"config {key!r} must be a positive integer, got {value!r}; fix "
                              "the config")
        return value


def config_int(data: Mapping[str, Any], *keys: str, default: int | None = None,
               fix: str = "pass a full config.json") -> int:
    """The first of ``keys`` that ``data`` (a config dict) holds as an integer, else
    ``default``; with no default, one line naming the first key and ``fix``."""
    for key in keys:
        value = data.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    if default is None:
        raise MemfitError(f"the config has no {keys[0]}; {fix}")
    return default


def text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The language model's config: ``text_config`` of a multimodal config (Gemma-3, Gemma 3n),
    else the config itself; the top level's dtype fills a missing one."""
    inner = config.get("text_config")
    if not isinstance(inner, Mapping):
        return dict(config)
    merged = dict(inner)
    for key in ("torch_dtype", "dtype"):
        if merged.get(key) is None and config.get(key) is not None:
            merged[key] = config[key]
    return merged


def model_dtype_bytes(config: Mapping[str, Any]) -> int:
    """Bytes per element of the dtype vLLM runs the model in with ``--dtype auto``: the
    config's ``dtype`` / ``torch_dtype``, float32 run in 16 bits; 2 when the config names
    none."""
    data = text_config(config)
    name = data.get("dtype") or data.get("torch_dtype") or "bfloat16"
    name = str(name).removeprefix("torch.")
    if name not in _MODEL_DTYPE_BYTES:
        raise MemfitError(f"config dtype {name!r} is not one vLLM serves; valid: "
                          f"{', '.join(_MODEL_DTYPE_BYTES)}")
    return _MODEL_DTYPE_BYTES[name]


def model_context_length(config: Mapping[str, Any]) -> int | None:
    """The context vLLM derives for the model (``vllm/config/model.py:
    _get_and_verify_max_len``): the smallest of the ``possible_keys``
    (``vllm/transformers_utils/model_arch_config_convertor.py:
    derive_max_model_len_and_key``), times the RoPE ``factor`` unless the RoPE type already
    scales ``max_position_embeddings`` (``su``, ``longrope``, ``llama3``, ``yarn``,
    ``deepseek_yarn``, ``deepseek_llama_scaling``) or the model is a Gemma-3; None when the
    config has none of the keys (vLLM then assumes 2048)."""
    data = text_config(config)
    values = [v for k in _CONTEXT_KEYS
              if isinstance(v := data.get(k), int) and not isinstance(v, bool) and v > 0]
    if not values:
        return None
    length = min(values)
    scaling = data.get("rope_scaling") or data.get("rope_parameters")
    if isinstance(scaling, Mapping) and "gemma3" not in str(data.get("model_type", "")):
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        factor = scaling.get("factor")
        if kind not in _ROPE_PRESCALED and isinstance(factor, int | float) and factor > 0:
            length = int(length * factor)
    return length


def _kv_dtype_bytes(kv_cache_dtype: str, model_bytes: int) -> int:
    if kv_cache_dtype not in KV_DTYPES:
        raise MemfitError(f"unknown --kv-cache-dtype {kv_cache_dtype!r}; valid: "
                          f"{', '.join(KV_DTYPES)}")
    found = KV_DTYPES[kv_cache_dtype]
    return model_bytes if found is None else found


def _layer_kinds(cfg: _Cfg, num_layers: int) -> list[str]:
    """Each layer's kind before sharing: ``full``, ``sliding``, ``mamba``, ``linear`` or
    ``none`` (an MLP-only layer), as the transformers config class lays them out."""
    mt = cfg.model_type
    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, list) and layer_types:
        if len(layer_types) < num_layers:
            raise MemfitError(f"config 'layer_types' lists {len(layer_types)} layers but "
                              f"num_hidden_layers is {num_layers}; fix the config")
        kinds = []
        for t in layer_types[:num_layers]:
            if t not in _LAYER_TYPES:
                raise MemfitError(f"layer type {t!r} is not supported yet (supported: "
                                  f"{', '.join(_LAYER_TYPES)}); chunked-local attention "
                                  "(Llama-4) is not modelled")
            kinds.append(_LAYER_TYPES[t])
        return kinds
    if mt == "jamba":  # JambaConfig.layers_block_type
        period, offset = cfg.int_("attn_layer_period", 8), cfg.get("attn_layer_offset", 4)
        return ["full" if i % period == offset else "mamba" for i in range(num_layers)]
    if mt == "nemotron_h":  # NemotronHConfig.hybrid_override_pattern: M mamba2, * attention
        pattern = str(cfg.get("hybrid_override_pattern", ""))
        if len(pattern) != num_layers:
            raise MemfitError(f"config 'hybrid_override_pattern' has {len(pattern)} layers but "
                              f"num_hidden_layers is {num_layers}; fix the config")
        return [{"M": "mamba", "*": "full"}.get(c, "none") for c in pattern]
    if mt == "qwen3_next":  # Qwen3NextConfig: full attention every full_attention_interval
        interval = cfg.int_("full_attention_interval", 4)
        return ["linear" if (i + 1) % interval else "full" for i in range(num_layers)]
    window = cfg.get("sliding_window")
    if mt == "gemma2":  # Gemma2Config.layer_types: even layers sliding
        return ["sliding" if (i + 1) % 2 else "full" for i in range(num_layers)]
    if mt in ("gemma3_text", "gemma3"):  # Gemma3TextConfig: sliding_window_pattern (6)
        every = cfg.int_("sliding_window_pattern", 6)
        return ["sliding" if (i + 1) % every else "full" for i in range(num_layers)]
    if mt in _QWEN_WINDOWED:
        # Qwen2Config.layer_types: sliding_window only with use_sliding_window, from
        # max_window_layers on
        if not (cfg.get("use_sliding_window") and window):
            return ["full"] * num_layers
        first = cfg.get("max_window_layers", num_layers)
        return ["sliding" if i >= first else "full" for i in range(num_layers)]
    if window:
        # No layer_types (Mistral, Phi-3): vLLM gives every layer the config's window
        # (vllm/engine/arg_utils.py: EngineArgs.create_engine_config sets
        # CacheConfig.sliding_window when there are no layer_types;
        # vllm/model_executor/layers/attention/attention.py: Attention.__init__ uses it).
        return ["sliding"] * num_layers
    return ["full"] * num_layers


def _divide(total: int, tp: int, what: str) -> int:
    """``vllm/distributed/utils.py: divide`` (asserts ``total % tp == 0``)."""
    if total % tp:
        raise MemfitError(f"--tp {tp} does not divide {what} ({total}); vLLM refuses it "
                          "(vllm/distributed/utils.py: divide); pick a --tp that divides it")
    return total // tp


def _check_tp_heads(heads: int, kv_heads: int, tp: int) -> int:
    """KV heads per rank, with vLLM's refusals:
    ``vllm/config/model.py: ModelConfig.verify_with_parallel_config`` raises unless ``tp``
    divides ``num_attention_heads``; ``vllm/model_executor/layers/linear.py:
    QKVParallelLinear.__init__`` then takes ``divide(kv_heads, tp)`` when ``tp < kv_heads``,
    else one head per rank replicated ``divide(tp, kv_heads)`` times."""
    if heads % tp:
        raise MemfitError(f"--tp {tp} does not divide num_attention_heads ({heads}); vLLM "
                          "refuses it (vllm/config/model.py: verify_with_parallel_config); "
                          "pick a --tp that divides it")
    if tp >= kv_heads:
        if tp % kv_heads:
            raise MemfitError(f"--tp {tp} is not a multiple of the {kv_heads} KV heads; vLLM "
                              "refuses it (linear.py: QKVParallelLinear, divide(tp, kv_heads))"
                              "; pick a --tp that divides or is a multiple of them")
        return 1
    return _divide(kv_heads, tp, "the KV heads")


def _mamba_state(cfg: _Cfg, tp: int, dtype_bytes: int) -> tuple[tuple[tuple[int, ...], ...],
                                                                tuple[int, ...]]:
    """A Mamba / GDN layer's state shapes on one rank and their dtypes' bytes
    (``vllm/model_executor/layers/mamba/mamba_utils.py: MambaStateShapeCalculator``; the conv
    state's two dimensions are stored in either order, ``_orient_conv_shape``):

    - Mamba-1 (Jamba, ``mamba1_state_shape``): conv ``(d_inner / tp, d_conv - 1)``, SSM
      ``(d_inner / tp, d_state)``;
    - Mamba-2 (Nemotron-H, ``mamba2_state_shape``): conv ``(d_conv - 1, (d_inner + 2 x groups
      x d_state) / tp)``, SSM ``(heads / tp, head_dim, d_state)``, the groups grown by
      ``tp - groups`` when tp does not divide them (``extra_groups_for_head_shards``);
    - gated delta net (Qwen3-Next, ``gated_delta_net_state_shape``): conv ``((2 x k_heads x
      k_dim + v_heads x v_dim) / tp, conv_kernel - 1)``, recurrent ``(v_heads / tp, v_dim,
      k_dim)``.

    Dtypes (``MambaStateDtypeCalculator._mamba_state_dtype``): the conv state in the model's
    dtype, the SSM state too (``mamba_ssm_cache_dtype`` ``auto``) except Nemotron-H, whose
    ``mamba_ssm_cache_dtype`` comes from its config, float32 by default
    (``vllm/model_executor/models/config.py: NemotronHForCausalLMConfig``)."""
    mt = cfg.model_type
    ssm_bytes = dtype_bytes
    if mt == "jamba":
        d_inner = cfg.int_("mamba_expand", 2) * cfg.int_("hidden_size")
        d_state, d_conv = cfg.int_("mamba_d_state", 16), cfg.int_("mamba_d_conv", 4)
        per_rank = _divide(d_inner, tp, "the Mamba inner size")
        shapes: tuple[tuple[int, ...], ...] = ((per_rank, d_conv - 1), (per_rank, d_state))
    elif mt == "nemotron_h":
        heads, head_dim = cfg.int_("mamba_num_heads"), cfg.int_("mamba_head_dim")
        groups, d_state = cfg.int_("n_groups", 8), cfg.int_("ssm_state_size", 128)
        d_conv = cfg.int_("conv_kernel", 4)
        if groups % tp:
            groups += tp - groups
        conv_dim = heads * head_dim + 2 * groups * d_state
        shapes = ((d_conv - 1, _divide(conv_dim, tp, "the Mamba conv width")),
                  (_divide(heads, tp, "the Mamba heads"), head_dim, d_state))
        ssm_name = str(cfg.get("mamba_ssm_cache_dtype", "float32"))
        ssm_bytes = {"float32": 4, "float16": 2, "bfloat16": 2}.get(ssm_name, dtype_bytes)
    elif mt == "qwen3_next":
        k_heads, v_heads = cfg.int_("linear_num_key_heads"), cfg.int_("linear_num_value_heads")
        k_dim, v_dim = cfg.int_("linear_key_head_dim"), cfg.int_("linear_value_head_dim")
        d_conv = cfg.int_("linear_conv_kernel_dim", 4)
        conv_dim = 2 * k_heads * k_dim + v_heads * v_dim
        shapes = ((_divide(conv_dim, tp, "the linear-attention conv width"), d_conv - 1),
                  (_divide(v_heads, tp, "the linear-attention value heads"), v_dim, k_dim))
    else:
        raise MemfitError(f"state layers of model_type {mt!r} are not modelled yet (supported: "
                          "jamba, nemotron_h, qwen3_next)")
    return shapes, (dtype_bytes, ssm_bytes)


def _shared_targets(cfg: _Cfg, kinds: list[str]) -> dict[int, int]:
    """Gemma 3n's last ``num_kv_shared_layers`` layers read the cache of the last earlier layer
    of their own type (``vllm/model_executor/models/gemma3n.py: Gemma3nAttention``: the last
    full layer is 1 before the first shared layer, the last sliding one 2 before)."""
    shared = cfg.get("num_kv_shared_layers", 0)
    if not shared:
        return {}
    first = len(kinds) - int(shared)
    if first <= 0:
        raise MemfitError(f"num_kv_shared_layers ({shared}) must be below num_hidden_layers "
                          f"({len(kinds)}); fix the config")
    targets = {}
    for i in range(first, len(kinds)):
        earlier = [j for j in range(first) if kinds[j] == kinds[i]]
        if not earlier:
            raise MemfitError(f"layer {i} shares KV but no earlier layer is {kinds[i]!r}")
        targets[i] = earlier[-1]
    return targets


def kv_spec(config: Mapping[str, Any], *, tp: int = 1,
            kv_cache_dtype: str = "auto") -> list[LayerKV]:
    """Every decoder layer's cache on one of ``tp`` ranks, from a transformers config dict.

    >>> llama = {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32,
    ...          "num_key_value_heads": 8, "num_hidden_layers": 32, "torch_dtype": "bfloat16"}
    >>> sum(layer.bytes_per_token for layer in kv_spec(llama))  # 32 x 8 x 128 x 2 x 2
    131072

    Bad input (a ``tp`` vLLM refuses, an unknown KV dtype, a missing key) raises MemfitError.
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise MemfitError(f"--tp must be a positive integer, got {tp!r}")
    data = text_config(config)
    cfg = _Cfg(data)
    num_layers = cfg.int_("num_hidden_layers")
    model_bytes = model_dtype_bytes(config)
    kv_bytes = _kv_dtype_bytes(kv_cache_dtype, model_bytes)
    kinds = _layer_kinds(cfg, num_layers)
    targets = _shared_targets(cfg, kinds)
    window = cfg.get("sliding_window")
    if "sliding" in kinds and not (isinstance(window, int) and window > 0):
        raise MemfitError("config has sliding-window layers but no positive 'sliding_window'; "
                          "fix the config")
    mla = cfg.get("kv_lora_rank") is not None
    layers: list[LayerKV] = []
    if any(k in ("full", "sliding") for k in kinds) and not mla:
        heads = cfg.int_("num_attention_heads")
        kv_heads = cfg.int_("num_key_value_heads", heads)
        head_dim = cfg.int_("head_dim", _HEAD_DIM_DEFAULT.get(cfg.model_type)
                            or cfg.int_("hidden_size") // heads)
        kv_per_rank = _check_tp_heads(heads, kv_heads, tp)
    elif mla:
        # MLA: MLAAttentionSpec(num_kv_heads=1, head_size=kv_lora_rank + qk_rope_head_dim)
        # (vllm/model_executor/layers/attention/mla_attention.py: get_kv_cache_spec); the latent
        # is replicated on every rank, only the query heads are split.
        heads = cfg.int_("num_attention_heads")
        _divide(heads, tp, "num_attention_heads")
        latent = cfg.int_("kv_lora_rank") + cfg.int_("qk_rope_head_dim")
    for i, kind in enumerate(kinds):
        if i in targets:
            layers.append(LayerKV(index=i, kind="shared", shares_with=targets[i]))
        elif kind in ("full", "sliding") and mla:
            layers.append(LayerKV(index=i, kind="mla", num_kv_heads=1, head_size=latent,
                                  dtype_bytes=kv_bytes))
        elif kind in ("full", "sliding"):
            layers.append(LayerKV(
                index=i, kind="sliding" if kind == "sliding" else "full",
                num_kv_heads=kv_per_rank, head_size=head_dim, head_size_v=head_dim,
                dtype_bytes=kv_bytes, sliding_window=window if kind == "sliding" else None,
                sinks=cfg.model_type == "gpt_oss"))
        elif kind in ("mamba", "linear"):
            shapes, dtypes = _mamba_state(cfg, tp, model_bytes)
            layers.append(LayerKV(index=i, kind="mamba" if kind == "mamba" else "linear",
                                  state_shapes=shapes, state_dtype_bytes=dtypes))
    return layers
