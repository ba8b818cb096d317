"""The vision towers :mod:`memfit.serving.multimodal` sizes, one builder per family
(``model_type``): the tower's shapes as the family's vLLM code builds it (:class:`Tower`, for
the encoder's activation peak) and its weights' elements on one rank of a ``tp`` group
(``vision_tower`` and ``projector``), from the ``vision_config``. Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from memfit.errors import MemfitError
from memfit.serving.kv_spec import config_int, text_config

__all__ = ["Tower", "gemma3_tower", "mistral3_tower", "qwen_tower"]


def _int(data: Mapping[str, Any], *keys: str, default: int | None = None) -> int:
    return config_int(data, *keys, default=default,
                      fix="pass the checkpoint's full config.json (its vision_config)")


vision_config_int = _int
"""The first of ``keys`` that ``data`` holds as an integer, else ``default`` (none: the
vision_config is incomplete, a MemfitError)."""


def _div(n: int, tp: int, what: str) -> int:
    if n % tp:
        raise MemfitError(f"--tp {tp} does not divide the vision tower's {what} ({n}); vLLM's "
                          "parallel layers require it (vllm/distributed/utils.py: divide)")
    return n // tp


def _column(n_in: int, n_out: int, tp: int, *, bias: bool, what: str) -> int:
    """Elements of a ``ColumnParallelLinear`` shard: output features (and bias) / tp."""
    out = _div(n_out, tp, what)
    return n_in * out + (out if bias else 0)


def _row(n_in: int, n_out: int, tp: int, *, bias: bool, what: str) -> int:
    """Elements of a ``RowParallelLinear`` shard: input features / tp, the bias whole (added
    after the all-reduce)."""
    return _div(n_in, tp, what) * n_out + (n_out if bias else 0)


@dataclass(frozen=True)
class Tower:
    """A vision transformer's shapes, as the family's vLLM code builds it."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    patch_elements: int
    """Pixel values per patch (channels x temporal patch x patch²)."""
    mlp: str
    """``held`` (gate_up kept while down runs: Qwen2.5-VL), ``gated`` (gate_up freed after
    SiluAndMul: Pixtral), ``plain`` (fc1, act, fc2: Qwen2-VL, SigLIP)."""
    rotary: bool
    """Rotary embedding on q and k (two more ``patches x hidden/tp`` tensors)."""



def qwen_tower(config: Mapping[str, Any], vc: Mapping[str, Any], tp: int,
          ) -> tuple[Tower, dict[str, int], int, int]:
    """Qwen2-VL / Qwen2.5-VL: the tower, its elements per rank, merge size, LM hidden."""
    family = str(config.get("model_type"))
    patch = _int(vc, "patch_size", default=14)
    merge = _int(vc, "spatial_merge_size", default=2)
    temporal = _int(vc, "temporal_patch_size", default=2)
    channels = _int(vc, "in_chans", "in_channels", default=3)
    depth = _int(vc, "depth", "num_hidden_layers")
    heads = _int(vc, "num_heads", "num_attention_heads")
    _div(heads, tp, "attention heads")
    pixels = channels * temporal * patch * patch  # per patch
    if family == "qwen2_5_vl":
        h = _int(vc, "hidden_size")
        inter = _int(vc, "intermediate_size")
        out = _int(vc, "out_hidden_size", default=_int(text_config(config), "hidden_size"))
        norm = h  # RMSNorm (qwen2_5_vl.py: Qwen2_5_VisionTransformer, norm_layer)
        block = (2 * norm
                 + _column(h, 3 * h, tp, bias=True, what="qkv width")  # QKVParallelLinear
                 + _row(h, h, tp, bias=True, what="hidden size")  # attn.proj
                 + _column(h, 2 * inter, tp, bias=True, what="intermediate size")  # gate_up
                 + _row(inter, h, tp, bias=True, what="intermediate size"))  # down_proj
        mlp = "held"
    else:
        h = _int(vc, "embed_dim")
        inter = h * _int(vc, "mlp_ratio", default=4)
        out = _int(vc, "hidden_size", default=_int(text_config(config), "hidden_size"))
        norm = 2 * h  # LayerNorm, weight and bias (qwen2_vl.py: Qwen2VisionBlock)
        block = (2 * norm
                 + _column(h, 3 * h, tp, bias=True, what="qkv width")
                 + _row(h, h, tp, bias=True, what="hidden size")
                 + _column(h, inter, tp, bias=True, what="intermediate size")  # fc1
                 + _row(inter, h, tp, bias=True, what="intermediate size"))  # fc2
        mlp = "plain"
    wide = h * merge * merge
    merger = (norm  # ln_q
              + _column(wide, wide, tp, bias=True, what="merger width")  # mlp.0
              + _row(wide, out, tp, bias=True, what="merger width"))  # mlp.2
    tower = Tower(hidden=h, intermediate=inter, layers=depth, heads=heads,
                  patch_elements=pixels, mlp=mlp, rotary=True)
    patch_embed = pixels * h  # Conv3d, bias=False, replicated
    return tower, {"vision_tower": patch_embed + depth * block, "projector": merger}, merge, out


def gemma3_tower(config: Mapping[str, Any], vc: Mapping[str, Any], tp: int,
            ) -> tuple[Tower, dict[str, int], int, int, int]:
    """Gemma-3's SigLIP tower (``siglip.py``) and projector (``gemma3_mm.py:
    Gemma3MultiModalProjector``): the tower, its elements per rank, patches and tokens per
    image, LM hidden."""
    h = _int(vc, "hidden_size")
    inter = _int(vc, "intermediate_size")
    layers = _int(vc, "num_hidden_layers")
    heads = _int(vc, "num_attention_heads")
    patch = _int(vc, "patch_size", default=14)
    size = _int(vc, "image_size", default=896)
    channels = _int(vc, "num_channels", default=3)
    text_hidden = _int(text_config(config), "hidden_size")
    _div(heads, tp, "attention heads")
    patches = (size // patch) ** 2
    embeddings = (channels * patch * patch * h + h  # patch_embedding Conv2d with bias
                  + patches * h)  # position_embedding (nn.Embedding, replicated)
    block = (2 * 2 * h  # layer_norm1/2 (LayerNorm)
             + _column(h, 3 * h, tp, bias=True, what="qkv width")  # qkv_proj
             + _row(h, h, tp, bias=True, what="hidden size")  # out_proj
             + _column(h, inter, tp, bias=True, what="intermediate size")  # fc1
             + _row(inter, h, tp, bias=True, what="intermediate size"))  # fc2
    tower = embeddings + layers * block + 2 * h  # post_layernorm
    projector = h * text_hidden + h  # mm_input_projection_weight (nn.Parameter), soft norm
    tokens = _int(config, "mm_tokens_per_image", default=256)
    spec = Tower(hidden=h, intermediate=inter, layers=layers, heads=heads,
                 patch_elements=channels * patch * patch, mlp="plain", rotary=False)
    return spec, {"vision_tower": tower, "projector": projector}, patches, tokens, text_hidden


def mistral3_tower(config: Mapping[str, Any], vc: Mapping[str, Any], tp: int,
              ) -> tuple[Tower, dict[str, int], int, int, int]:
    """Mistral-3's Pixtral tower (``pixtral.py: PixtralHFVisionModel``) and projector
    (``mistral3.py: Mistral3MultiModalProjector``)."""
    h = _int(vc, "hidden_size")
    inter = _int(vc, "intermediate_size")
    layers = _int(vc, "num_hidden_layers")
    heads = _int(vc, "num_attention_heads")
    patch = _int(vc, "patch_size", default=14)
    size = _int(vc, "image_size", default=1024)
    channels = _int(vc, "num_channels", default=3)
    merge = _int(config, "spatial_merge_size", default=1)
    bias = bool(config.get("multimodal_projector_bias", False))
    text_hidden = _int(text_config(config), "hidden_size")
    _div(heads, tp, "attention heads")
    head_dim = _int(vc, "head_dim", default=h // heads)
    qkv_width = heads * head_dim
    block = (2 * h  # attention_norm, ffn_norm (RMSNorm)
             + _column(h, 3 * qkv_width, tp, bias=False, what="qkv width")
             + _row(qkv_width, h, tp, bias=False, what="attention width")  # o_proj
             + _column(h, 2 * inter, tp, bias=False, what="intermediate size")  # gate_up
             + _row(inter, h, tp, bias=False, what="intermediate size"))  # down_proj
    tower = channels * patch * patch * h + h + layers * block  # patch_conv (no bias), ln_pre
    projector = (h  # norm (RMSNorm)
                 + h * merge * merge * h  # patch_merger.merging_layer (nn.Linear, no bias)
                 + _column(h, text_hidden, tp, bias=bias, what="LM hidden size")  # linear_1
                 + _row(text_hidden, text_hidden, tp, bias=bias, what="LM hidden size"))
    side = size // patch  # the dummy image is image_size x image_size
    tokens = (size // (patch * merge)) ** 2  # PixtralHFEncoderInfo.get_num_image_tokens
    spec = Tower(hidden=h, intermediate=inter, layers=layers, heads=heads,
                 patch_elements=channels * patch * patch, mlp="gated", rotary=True)
    return spec, {"vision_tower": tower, "projector": projector}, side * side, tokens, \
        text_hidden
