"""Read a local Hugging Face ``config.json`` into a TransformerSpec, offline.

Only ``json.loads`` touches the file: nothing is downloaded, imported or executed, and
``transformers`` is not needed. Each supported ``model_type`` maps its keys (and the defaults its
``transformers`` config class uses when a key is absent) onto TransformerSpec's fields.

Known limitations: task heads other than the ones below are not counted. Decoders are the
``*ForCausalLM`` model (LM head, tied or not); BERT is ``BertModel`` with its pooler (the MLM/NSP
heads of ``BertForPreTraining`` are not counted); ViT is ``ViTForImageClassification`` (no pooler,
``num_labels`` outputs) unless ``architectures`` says ``ViTModel`` (pooler, no classifier).
Multimodal configs (a nested ``text_config``) are not supported.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from memfit.errors import MemfitError, read_json_file
from memfit.models.spec import TransformerSpec

_LLAMA_LIKE = ("llama", "mistral", "mixtral", "qwen2", "gemma2", "phi3")
SUPPORTED_MODEL_TYPES: tuple[str, ...] = (*_LLAMA_LIKE, "gpt2", "bert", "vit")
"""``model_type`` values :func:`load_hf_config` understands."""

# transformers' default for ``tie_word_embeddings`` per config class (used when the key is absent).
_TIE_DEFAULT = {"llama": False, "mistral": False, "mixtral": False, "qwen2": False,
                "gemma2": True, "phi3": False, "gpt2": True}


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

    def head_dim(self, hidden: int, heads: int) -> int:
        """``head_dim`` if given, else hidden / heads (what transformers' modeling code does)."""
        if self._lookup(("head_dim",)) is not None:
            return self.int_("head_dim")
        if hidden % heads:
            raise self.fail(f"hidden_size ({hidden}) is not a multiple of num_attention_heads "
                            f"({heads}) and there is no 'head_dim'; add 'head_dim' to the config")
        return hidden // heads


def _name(path: Path, data: dict[str, Any]) -> str:
    name = data.get("_name_or_path")
    if isinstance(name, str) and name:
        return name
    return path.parent.name if path.name == "config.json" and path.parent.name else path.stem


def _llama_like(cfg: _Config, model_type: str, name: str) -> TransformerSpec:
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
    else:
        experts, per_token = 0, 0
    # Qwen2 always has q/k/v biases and no o bias; Llama's and Gemma-2's follow attention_bias
    # (q, k, v and o together); Mistral, Mixtral and Phi-3 have none (transformers' modeling code).
    attention_bias = (cfg.bool_("attention_bias", False) if model_type in ("llama", "gemma2")
                      else False)
    qkv_bias = model_type == "qwen2" or attention_bias
    mlp_bias = cfg.bool_("mlp_bias", False) if model_type == "llama" else False
    gemma = model_type == "gemma2"
    hidden_dropout = cfg.prob("resid_pdrop", default=0.0) if model_type == "phi3" else 0.0
    return TransformerSpec(
        name=name, family=model_type, arch="decoder",
        hidden_size=hidden,
        num_layers=cfg.int_("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=cfg.int_("head_dim", default=256) if gemma else cfg.head_dim(hidden, heads),
        intermediate_size=cfg.int_("intermediate_size"),
        vocab_size=cfg.int_("vocab_size"),
        max_position_embeddings=cfg.int_("max_position_embeddings", default=0, positive=False),
        rope_scaling=bool(cfg.data.get("rope_scaling")),
        mlp="geglu" if gemma else "swiglu",
        norm="rmsnorm",
        norms_per_layer=4 if gemma else 2,
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


def _encoder_common(cfg: _Config) -> dict[str, Any]:
    hidden = cfg.int_("hidden_size")
    heads = cfg.int_("num_attention_heads")
    if hidden % heads:
        raise cfg.fail(f"hidden_size ({hidden}) is not a multiple of num_attention_heads "
                       f"({heads}); fix one of them in the config")
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


def _llama_like_parser(model_type: str) -> Callable[[_Config, str], TransformerSpec]:
    def parse(cfg: _Config, name: str) -> TransformerSpec:
        return _llama_like(cfg, model_type, name)
    return parse


_PARSERS: dict[str, Callable[[_Config, str], TransformerSpec]] = {
    **{t: _llama_like_parser(t) for t in _LLAMA_LIKE},
    "gpt2": _gpt2,
    "bert": _bert,
    "vit": _vit,
}


def load_hf_config(path: str | Path) -> TransformerSpec:
    """Parse a Hugging Face ``config.json`` (a file, or a directory containing one).

    >>> spec = load_hf_config("checkpoints/Meta-Llama-3-8B/config.json")  # doctest: +SKIP
    >>> spec.param_count()  # doctest: +SKIP
    8030261248

    Raises MemfitError (one line, naming the file and the fix) when the file is missing, is not
    JSON, has an unsupported ``model_type``, or a required key is missing or of the wrong type.
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
    if not isinstance(model_type, str) or model_type not in _PARSERS:
        raise MemfitError(f"{path}: unsupported model_type {model_type!r}; supported: "
                          f"{supported} (or pass --params N to plan model states only)")
    return _PARSERS[model_type](_Config(path, data), _name(path, data))
