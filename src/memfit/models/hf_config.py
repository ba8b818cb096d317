"""Read a local Hugging Face ``config.json`` into a TransformerSpec, offline.

Only ``json.loads`` touches the file: nothing is downloaded, imported or executed, and
``transformers`` is not needed. Each supported ``model_type`` maps its keys (and the defaults its
``transformers`` config class uses when a key is absent) onto TransformerSpec's fields.

Known limitations: task heads other than the ones below are not counted. Decoders are the
``*ForCausalLM`` model (LM head, tied or not); BERT is ``BertModel`` with its pooler (the MLM/NSP
heads of ``BertForPreTraining`` are not counted); ViT is ``ViTForImageClassification`` (no pooler,
``num_labels`` outputs) unless ``architectures`` says ``ViTModel`` (pooler, no classifier).
Other model types (and variants the formulas cannot express exactly, such as Qwen3-MoE stacks
mixing dense and MoE layers) load through :mod:`memfit.models.hf_auto` for the trace, when
transformers is installed. Multimodal configs (a nested ``text_config``) go that way too.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from memfit.errors import MemfitError, read_json_file
from memfit.models.hf_auto import HFModelSpec
from memfit.models.spec import TransformerSpec

_LLAMA_LIKE = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gemma2",
               "gemma3_text", "olmo2", "phi3")
SUPPORTED_MODEL_TYPES: tuple[str, ...] = (*_LLAMA_LIKE, "gpt2", "gpt_neox", "phi", "falcon", "bert",
                                          "vit")
"""``model_type`` values :func:`load_hf_config` understands."""

# transformers' default for ``tie_word_embeddings`` per config class (used when the key is absent).
_TIE_DEFAULT = {"llama": False, "mistral": False, "mixtral": False, "qwen2": False,
                "qwen3": False, "qwen3_moe": False, "gemma2": True, "gemma3_text": True,
                "olmo2": False, "phi3": False, "gpt2": True}
# Families whose attention bias follows ``attention_bias`` (q, k, v and o together).
_ATTENTION_BIAS_KEY = frozenset({"llama", "gemma2", "gemma3_text", "qwen3", "qwen3_moe", "olmo2"})
# RMSNorm on queries and keys (transformers' modeling code): Qwen3 and Gemma-3 per head
# (``q_norm = RMSNorm(head_dim)``), OLMo-2 over the whole projection
# (``q_norm = RMSNorm(num_attention_heads * head_dim)``).
_QK_NORM = {"qwen3": "head", "qwen3_moe": "head", "gemma3_text": "head", "olmo2": "proj"}
# head_dim defaults of the config classes that set one (Gemma2/3Config 256, Qwen3Config
# 128); the others default to hidden_size / num_attention_heads.
_HEAD_DIM_DEFAULT = {"gemma2": 256, "gemma3_text": 256, "qwen3": 128}


class _Config:
    """Typed access to one parsed config.json, with errors that name the file and the fix."""

    def __init__(self, path: Path, data: dict[str, Any]) -> None:
        self.path = path
        self.data = data

    def fail(self, message: str) -> MemfitError:
        return MemfitError(f"{self.path}: {message}")

    def _lookup(self, keys: tuple[str, ...]) -> tuple[str, Any] | None:
        for key in keys:
            if key in self.data and self.data[key] is not None:
                return key, self.data[key]
        return None

    def int_(self, *keys: str, default: int | None = None, positive: bool = True) -> int:
        """The first of ``keys`` present (non-null); ``default`` if none; required if no
        default."""
        found = self._lookup(keys)
        if found is None:
            if default is None:
                names = " or ".join(repr(k) for k in keys)
                raise self.fail(f"missing required key {names}; add it to the config "
                                f"(copy it from the model's config.json on the Hub)")
            return default
        key, value = found
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(f"{key!r} must be an integer, got {value!r}; fix the value in the "
                            f"config")
        if positive and value <= 0:
            raise self.fail(f"{key!r} must be a positive integer, got {value}; fix the value "
                            f"in the config")
        return value

    def bool_(self, key: str, default: bool) -> bool:
        value = self.data.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.fail(f"{key!r} must be true or false, got {value!r}; fix the value in "
                            f"the config")
        return value

    def prob(self, *keys: str, default: float) -> float:
        found = self._lookup(keys)
        if found is None:
            return default
        key, value = found
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
            raise self.fail(f"{key!r} must be a probability in [0, 1), got {value!r}; fix the "
                            f"value in the config")
        return float(value)

    def hidden_and_heads(self) -> tuple[int, int]:
        """``hidden_size`` and ``num_attention_heads``, for models whose heads split the hidden
        size evenly (no ``head_dim`` key)."""
        hidden = self.int_("hidden_size")
        heads = self.int_("num_attention_heads")
        if hidden % heads:
            raise self.fail(f"hidden_size ({hidden}) is not a multiple of num_attention_heads "
                            f"({heads}); fix one of them in the config")
        return hidden, heads

    def head_dim(self, hidden: int, heads: int) -> int:
        """``head_dim`` if given, else hidden / heads (what transformers' modeling code does)."""
        if self._lookup(("head_dim",)) is not None:
            return self.int_("head_dim")
        if hidden % heads:
            raise self.fail(f"hidden_size ({hidden}) is not a multiple of num_attention_heads "
                            f"({heads}) and there is no 'head_dim'; add 'head_dim' to the config")
        return hidden // heads


def _rope_scaled(data: dict[str, Any]) -> bool:
    """The config stretches RoPE past ``max_position_embeddings``: a ``rope_scaling`` (YaRN,
    linear, dynamic NTK, llama3), or, as transformers 5 writes it, ``rope_parameters`` with a
    ``rope_type`` other than ``"default"``."""
    if data.get("rope_scaling"):
        return True
    params = data.get("rope_parameters")
    return isinstance(params, dict) and params.get("rope_type", "default") != "default"


def _name(path: Path, data: dict[str, Any]) -> str:
    name = data.get("_name_or_path")
    if isinstance(name, str) and name:
        return name
    return path.parent.name if path.name == "config.json" and path.parent.name else path.stem


def _llama_like(cfg: _Config, model_type: str, name: str) -> TransformerSpec | None:
    hidden = cfg.int_("hidden_size")
    heads = cfg.int_("num_attention_heads")
    kv_heads = cfg.int_("num_key_value_heads", default=heads)
    if heads % kv_heads:
        raise cfg.fail(f"num_attention_heads ({heads}) is not a multiple of num_key_value_heads "
                       f"({kv_heads}); fix one of them in the config")
    if model_type == "mixtral":
        experts = cfg.int_("num_local_experts", default=8)  # MixtralConfig's defaults
        per_token = cfg.int_("num_experts_per_tok", default=2)
        if per_token > experts:
            raise cfg.fail(f"num_experts_per_tok ({per_token}) exceeds num_local_experts "
                           f"({experts}); fix one of them in the config")
    elif model_type == "qwen3_moe":
        # Qwen3MoeConfig's defaults. Every layer is MoE only with decoder_sparse_step 1 and no
        # mlp_only_layers; mixed dense/MoE stacks are left to the trace (None).
        mlp_only = cfg.data.get("mlp_only_layers") or []
        if cfg.int_("decoder_sparse_step", default=1) != 1 or mlp_only:
            return None
        experts = cfg.int_("num_experts", default=128)
        per_token = cfg.int_("num_experts_per_tok", default=8)
        if per_token > experts:
            raise cfg.fail(f"num_experts_per_tok ({per_token}) exceeds num_experts "
                           f"({experts}); fix one of them in the config")
    else:
        experts, per_token = 0, 0
    # Qwen2 always has q/k/v biases and no o bias; Llama's, Gemma-2/3's, Qwen3's and OLMo-2's
    # follow attention_bias (q, k, v and o together); Mistral, Mixtral and Phi-3 have none
    # (transformers' modeling code).
    attention_bias = (cfg.bool_("attention_bias", False) if model_type in _ATTENTION_BIAS_KEY
                      else False)
    qkv_bias = model_type == "qwen2" or attention_bias
    mlp_bias = cfg.bool_("mlp_bias", False) if model_type == "llama" else False
    gemma = model_type in ("gemma2", "gemma3_text")
    head_dim = (cfg.int_("head_dim", default=_HEAD_DIM_DEFAULT[model_type])
                if model_type in _HEAD_DIM_DEFAULT else cfg.head_dim(hidden, heads))
    intermediate = (cfg.int_("moe_intermediate_size", default=768) if model_type == "qwen3_moe"
                    else cfg.int_("intermediate_size"))
    hidden_dropout = cfg.prob("resid_pdrop", default=0.0) if model_type == "phi3" else 0.0
    return TransformerSpec(
        name=name, family=model_type, arch="decoder",
        hidden_size=hidden,
        num_layers=cfg.int_("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate,
        vocab_size=cfg.int_("vocab_size"),
        max_position_embeddings=cfg.int_("max_position_embeddings", default=0, positive=False),
        rope_scaling=_rope_scaled(cfg.data),
        mlp="geglu" if gemma else "swiglu",
        norm="rmsnorm",
        norms_per_layer=4 if gemma else 2,
        qk_norm=_QK_NORM.get(model_type, "none"),
        qkv_bias=qkv_bias,
        attn_out_bias=attention_bias,
        mlp_bias=mlp_bias,
        position="rope",
        tie_embeddings=cfg.bool_("tie_word_embeddings", _TIE_DEFAULT[model_type]),
        num_experts=experts,
        experts_per_token=per_token,
        dropout=hidden_dropout,
        attention_dropout=cfg.prob("attention_dropout", default=0.0),
        source=str(cfg.path),
    )


def _gpt2(cfg: _Config, name: str) -> TransformerSpec:
    hidden = cfg.int_("n_embd", "hidden_size")
    heads = cfg.int_("n_head", "num_attention_heads")
    if hidden % heads:
        raise cfg.fail(f"n_embd ({hidden}) is not a multiple of n_head ({heads}); fix one of "
                       f"them in the config")
    return TransformerSpec(
        name=name, family="gpt2", arch="decoder",
        hidden_size=hidden,
        num_layers=cfg.int_("n_layer", "num_hidden_layers"),
        num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
        intermediate_size=cfg.int_("n_inner", "intermediate_size", default=4 * hidden),
        vocab_size=cfg.int_("vocab_size"),
        max_position_embeddings=cfg.int_("n_positions", "max_position_embeddings"),
        mlp="gelu", norm="layernorm", qkv_bias=True, attn_out_bias=True, mlp_bias=True,
        position="learned",
        tie_embeddings=cfg.bool_("tie_word_embeddings", _TIE_DEFAULT["gpt2"]),
        dropout=cfg.prob("resid_pdrop", default=0.1),  # GPT2Config's defaults
        attention_dropout=cfg.prob("attn_pdrop", default=0.1),
        source=str(cfg.path),
    )


def _gpt_neox(cfg: _Config, name: str) -> TransformerSpec:
    """GPTNeoXForCausalLM (Pythia): fused QKV and dense with ``attention_bias`` (default on),
    GeLU MLP with biases, two LayerNorms per block (parallel residual by default: same
    parameters), rotary positions, untied ``embed_out`` by default (GPTNeoXConfig)."""
    hidden, heads = cfg.hidden_and_heads()
    bias = cfg.bool_("attention_bias", True)
    return TransformerSpec(
        name=name, family="gpt_neox", arch="decoder", hidden_size=hidden,
        num_layers=cfg.int_("num_hidden_layers"), num_heads=heads, num_kv_heads=heads,
        head_dim=hidden // heads, intermediate_size=cfg.int_("intermediate_size"),
        vocab_size=cfg.int_("vocab_size"),
        max_position_embeddings=cfg.int_("max_position_embeddings", default=2048),
        mlp="gelu", norm="layernorm", qkv_bias=bias, attn_out_bias=bias, mlp_bias=True,
        position="rope",
        rope_scaling=_rope_scaled(cfg.data), tie_embeddings=cfg.bool_("tie_word_embeddings", False),
        dropout=cfg.prob("hidden_dropout", default=0.0),
        attention_dropout=cfg.prob("attention_dropout", default=0.0), source=str(cfg.path))


def _phi(cfg: _Config, name: str) -> TransformerSpec:
    """PhiForCausalLM (Phi-1, Phi-1.5, Phi-2): q/k/v/dense and fc1/fc2 with biases, one
    LayerNorm per block (attention and MLP in parallel), optional per-head q/k LayerNorms
    (``qk_layernorm``), an LM head with a bias, untied by default (PhiConfig)."""
    hidden = cfg.int_("hidden_size")
    heads = cfg.int_("num_attention_heads")
    kv_heads = cfg.int_("num_key_value_heads", default=heads)
    if heads % kv_heads:
        raise cfg.fail(f"num_attention_heads ({heads}) is not a multiple of num_key_value_heads "
                       f"({kv_heads}); fix one of them in the config")
    return TransformerSpec(
        name=name, family="phi", arch="decoder", hidden_size=hidden,
        num_layers=cfg.int_("num_hidden_layers"), num_heads=heads, num_kv_heads=kv_heads,
        head_dim=cfg.head_dim(hidden, heads), intermediate_size=cfg.int_("intermediate_size"),
        vocab_size=cfg.int_("vocab_size"),
        max_position_embeddings=cfg.int_("max_position_embeddings", default=2048),
        mlp="gelu", norm="layernorm", norms_per_layer=1,
        qk_norm="head" if cfg.bool_("qk_layernorm", False) else "none",
        qkv_bias=True, attn_out_bias=True, mlp_bias=True, head_bias=True, position="rope",
        rope_scaling=_rope_scaled(cfg.data),
        tie_embeddings=cfg.bool_("tie_word_embeddings", False),
        dropout=cfg.prob("resid_pdrop", default=0.0),
        attention_dropout=cfg.prob("attention_dropout", default=0.0), source=str(cfg.path))


def _falcon(cfg: _Config, name: str) -> TransformerSpec | None:
    """FalconForCausalLM (transformers' modeling_falcon.py): fused QKV of
    ``(heads + 2 * kv) * head_dim`` outputs, where kv is ``num_kv_heads`` with
    ``new_decoder_architecture``, 1 with ``multi_query``, else all heads; dense and a GeLU MLP
    of ``ffn_hidden_size`` (default 4h), biases per ``bias``; LayerNorms: two without
    ``parallel_attn`` or with the new architecture's ``num_ln_in_parallel_attn`` (default 2),
    else one; tied head by default. ALiBi models (no rotary) are left to the trace (None)."""
    if cfg.bool_("alibi", False):
        return None
    hidden, heads = cfg.hidden_and_heads()
    new = cfg.bool_("new_decoder_architecture", False)
    parallel = cfg.bool_("parallel_attn", True)
    if new:
        kv_heads = cfg.int_("num_kv_heads", default=heads)
        norms = cfg.int_("num_ln_in_parallel_attn", default=2) if parallel else 2
    else:
        kv_heads = 1 if cfg.bool_("multi_query", True) else heads
        norms = 1 if parallel else 2
    if heads % kv_heads or norms not in (1, 2):
        return None  # a layout TransformerSpec does not describe: traced instead
    bias = cfg.bool_("bias", False)
    return TransformerSpec(
        name=name, family="falcon", arch="decoder", hidden_size=hidden,
        num_layers=cfg.int_("num_hidden_layers"), num_heads=heads, num_kv_heads=kv_heads,
        head_dim=hidden // heads,
        intermediate_size=cfg.int_("ffn_hidden_size", default=4 * hidden),
        vocab_size=cfg.int_("vocab_size"),
        max_position_embeddings=cfg.int_("max_position_embeddings", default=2048),
        mlp="gelu", norm="layernorm", norms_per_layer=norms, qkv_bias=bias, attn_out_bias=bias,
        mlp_bias=bias, position="rope",
        rope_scaling=_rope_scaled(cfg.data), tie_embeddings=cfg.bool_("tie_word_embeddings", True),
        dropout=cfg.prob("hidden_dropout", default=0.0),
        attention_dropout=cfg.prob("attention_dropout", default=0.0), source=str(cfg.path))


def _encoder_common(cfg: _Config) -> dict[str, Any]:
    hidden, heads = cfg.hidden_and_heads()
    return dict(hidden_size=hidden, num_layers=cfg.int_("num_hidden_layers"), num_heads=heads,
                num_kv_heads=heads, head_dim=hidden // heads,
                intermediate_size=cfg.int_("intermediate_size"), mlp="gelu", norm="layernorm",
                qkv_bias=cfg.bool_("qkv_bias", True), attn_out_bias=True, mlp_bias=True,
                position="learned", source=str(cfg.path))


def _bert(cfg: _Config, name: str) -> TransformerSpec:
    return TransformerSpec(
        name=name, family="bert", arch="encoder", **_encoder_common(cfg),
        vocab_size=cfg.int_("vocab_size"),
        max_position_embeddings=cfg.int_("max_position_embeddings", default=512),
        type_vocab_size=cfg.int_("type_vocab_size", default=2, positive=False),
        pooler=True,
        dropout=cfg.prob("hidden_dropout_prob", default=0.1),  # BertConfig's defaults
        attention_dropout=cfg.prob("attention_probs_dropout_prob", default=0.1),
    )


def _vit(cfg: _Config, name: str) -> TransformerSpec:
    architectures = cfg.data.get("architectures") or []
    backbone = isinstance(architectures, list) and "ViTModel" in architectures
    if backbone:
        num_labels = 0
    else:
        # PretrainedConfig: num_labels = len(id2label) when id2label is given, else num_labels
        # (default 2).
        id2label = cfg.data.get("id2label")
        if id2label is not None and not isinstance(id2label, dict):
            raise cfg.fail(f"'id2label' must be an object, got {type(id2label).__name__}; fix "
                           f"the value in the config")
        num_labels = (len(id2label) if id2label
                      else cfg.int_("num_labels", default=2, positive=False))
    image_size = cfg.int_("image_size", default=224)  # ViTConfig's defaults
    patch_size = cfg.int_("patch_size", default=16)
    if image_size % patch_size:
        raise cfg.fail(f"image_size ({image_size}) is not a multiple of patch_size "
                       f"({patch_size}); fix one of them in the config")
    return TransformerSpec(
        name=name, family="vit", arch="vision", **_encoder_common(cfg),
        image_size=image_size, patch_size=patch_size,
        num_channels=cfg.int_("num_channels", default=3),
        num_labels=num_labels, pooler=backbone,
        dropout=cfg.prob("hidden_dropout_prob", default=0.0),
        attention_dropout=cfg.prob("attention_probs_dropout_prob", default=0.0),
    )


def _llama_like_parser(model_type: str) -> Callable[[_Config, str], TransformerSpec | None]:
    def parse(cfg: _Config, name: str) -> TransformerSpec | None:
        return _llama_like(cfg, model_type, name)
    return parse


_PARSERS: dict[str, Callable[[_Config, str], TransformerSpec | None]] = {
    **{t: _llama_like_parser(t) for t in _LLAMA_LIKE},
    "gpt2": _gpt2,
    "gpt_neox": _gpt_neox,
    "phi": _phi,
    "falcon": _falcon,
    "bert": _bert,
    "vit": _vit,
}


def load_hf_config(path: str | Path) -> TransformerSpec | HFModelSpec:
    """Parse a Hugging Face ``config.json`` (a file, or a directory containing one).

    A ``model_type`` in :data:`SUPPORTED_MODEL_TYPES` becomes a :class:`TransformerSpec` (the
    formulas); any other type the installed transformers knows becomes an
    :class:`~memfit.models.hf_auto.HFModelSpec` for the trace.

    >>> spec = load_hf_config("checkpoints/Meta-Llama-3-8B/config.json")  # doctest: +SKIP
    >>> spec.param_count()  # doctest: +SKIP
    8030261248

    Raises MemfitError (one line, naming the file and the fix) when the file is missing, is not
    JSON, has a ``model_type`` neither the formulas nor transformers know (or one only
    transformers knows and it is not installed), or a required key is missing or of the wrong
    type.
    """
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / "config.json"
    data = read_json_file(path, what="config file", fix=(
        "pass a Hugging Face config.json (or the directory holding it) or a preset name "
        "(run `memfit models`)"))
    if not isinstance(data, dict):
        raise MemfitError(f"{path}: expected a JSON object, got {type(data).__name__}; pass a "
                          f"Hugging Face config.json")
    model_type = data.get("model_type")
    supported = ", ".join(SUPPORTED_MODEL_TYPES)
    if model_type is None:
        raise MemfitError(f"{path}: missing 'model_type'; add it (supported: {supported})")
    if not isinstance(model_type, str):
        raise MemfitError(f"{path}: unsupported model_type {model_type!r}; supported: "
                          f"{supported} (or pass --params N to plan model states only)")
    if model_type in _PARSERS:
        spec = _PARSERS[model_type](_Config(path, data), _name(path, data))
        if spec is not None:
            return spec  # else a variant the formulas do not cover: traced below
    from memfit.models.hf_auto import hf_model_spec, known_model_types

    known = known_model_types()
    if known and model_type not in known:
        raise MemfitError(f"{path}: unsupported model_type {model_type!r}: neither memfit's "
                          f"formulas (supported: {supported}) nor the installed transformers "
                          "know it; upgrade transformers, or pass --params N to plan model "
                          "states only")
    return hf_model_spec(data, name=_name(path, data), source=str(path))
