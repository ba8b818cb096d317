"""Build a real ``torch.nn.Module`` from a :class:`TransformerSpec`.

Two backends:

- ``"transformers"``: the Hugging Face model itself, built from a config made in code (never
  downloaded): ``AutoModelForCausalLM`` for decoders, ``BertModel`` (with pooler) for BERT,
  ``ViTForImageClassification`` for ViT (``hf_build.py``). Needs ``pip install 'memfit[hf]'``.
- ``"builtin"``: memfit's own compact reference implementations in plain PyTorch (the models
  below, made of the blocks in ``builtin_layers.py``), in the spirit of nanoGPT / torchtitan:
  one pre-norm decoder block (RMSNorm or LayerNorm, RoPE or learned positions, GQA through SDPA,
  SwiGLU / GeGLU / GeLU MLP, optional biases, optional top-k MoE), a post-norm BERT encoder and
  a pre-norm ViT. Parameter counts equal ``spec.param_count()`` exactly (tied embeddings are
  tied for real), and decoders use Hugging Face Llama's parameter names
  (``model.layers.0.self_attn.q_proj.weight``, ...), so Llama-family state dicts load as they are.

``"auto"`` picks transformers when it is installed, else builtin.

Forward contracts (both backends; the HF models return their ``ModelOutput`` instead of a tensor):

- decoders: ``model(input_ids, labels=None)`` -> logits ``[b, s, vocab]``, or with labels the mean
  cross-entropy of next-token prediction (labels shifted left by one inside, ``-100`` ignored,
  logits upcast to fp32), as Hugging Face's ``ForCausalLMLoss`` computes it;
- BERT: ``model(input_ids, token_type_ids=None)`` -> the last hidden state ``[b, s, h]`` (the
  pooler's output is not part of it: ``model.pool(hidden)`` gives it);
- ViT: ``model(pixel_values, labels=None)`` -> logits ``[b, num_labels]`` or the cross-entropy.

Use :func:`example_inputs` for keyword inputs of the right shapes. Hugging Face decoders are
built with ``use_cache=False`` (a training step keeps no KV cache); set
``model.config.use_cache = True`` to trace generation.

Known limitations of the builtin models: numerics-only details are not reproduced (Gemma-2's
``1 + w`` RMSNorm scaling, embedding scaling and soft-capping, sliding windows, RoPE scaling; the
RoPE base is one published value per family); attention has no padding mask; MoE layers use a
fixed expert capacity (see :class:`~memfit.models.builtin_layers.MoE`).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from memfit.errors import MemfitError, suggest
from memfit.models.builtin_layers import (
    MoE,
    PostNormBlock,
    PreNormBlock,
    RotaryEmbedding,
    _dropout,
    _norm,
    _rope_theta,
)
from memfit.models.hf_build import _build_transformers
from memfit.models.spec import TransformerSpec

__all__ = ["BACKENDS", "build_model", "example_inputs", "transformers_available"]

BACKENDS = ("auto", "transformers", "builtin")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")

_INIT_STD = 0.02  # GPT-2 / BERT / Llama initializer_range


# ---------------------------------------------------------------------------------- the models
class DecoderModel(nn.Module):
    """Token (+ learned position) embeddings, pre-norm blocks, final norm."""

    def __init__(self, spec: TransformerSpec, *, attn_implementation: str,
                 moe_capacity_factor: float | None) -> None:
        super().__init__()
        h = spec.hidden_size
        self.embed_tokens = _embedding(spec.vocab_size, h)
        self.embed_positions = (_embedding(spec.max_position_embeddings, h)
                                if spec.position == "learned" else None)
        self.rotary_emb = (RotaryEmbedding(spec.head_dim, _rope_theta(spec))
                           if spec.position == "rope" else None)
        self.dropout = _dropout(spec.dropout)
        self.layers = nn.ModuleList(
            PreNormBlock(spec, causal=True, attn_implementation=attn_implementation,
                         moe_capacity_factor=moe_capacity_factor)
            for _ in range(spec.num_layers))
        self.norm = _norm(spec)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        seq = input_ids.shape[1]
        x = self.embed_tokens(input_ids)
        if self.embed_positions is not None:
            x = x + self.embed_positions(torch.arange(seq, device=input_ids.device))
        x = self.dropout(x)
        rope = self.rotary_emb(x, seq) if self.rotary_emb is not None else None
        for layer in self.layers:
            x = layer(x, rope)
        return self.norm(x)


class DecoderLM(nn.Module):
    """A causal language model: :class:`DecoderModel` + LM head (tied to the embedding if the
    spec ties them)."""

    def __init__(self, spec: TransformerSpec, *, attn_implementation: str = "sdpa",
                 moe_capacity_factor: float | None = 1.0) -> None:
        super().__init__()
        self.spec = spec
        self.model = DecoderModel(spec, attn_implementation=attn_implementation,
                                  moe_capacity_factor=moe_capacity_factor)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        _init_model(self)
        if spec.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.lm_head(self.model(input_ids))
        if labels is None:
            return logits
        # Hugging Face's ForCausalLMLoss: fp32 logits, labels shifted left by padding with -100.
        shift_labels = F.pad(labels, (0, 1), value=-100)[:, 1:]
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                               shift_labels.reshape(-1), ignore_index=-100)


class BertEncoder(nn.Module):
    """BERT: word + position + token-type embeddings with LayerNorm, post-norm blocks, pooler.

    ``forward`` returns the last hidden state; ``pool(hidden)`` applies the pooler
    (``tanh(dense(hidden[:, 0]))``).
    """

    def __init__(self, spec: TransformerSpec, *, attn_implementation: str = "sdpa") -> None:
        super().__init__()
        h = spec.hidden_size
        self.spec = spec
        self.word_embeddings = _embedding(spec.vocab_size, h)
        self.position_embeddings = (_embedding(spec.max_position_embeddings, h)
                                    if spec.position == "learned" else None)
        self.rotary_emb = (RotaryEmbedding(spec.head_dim, _rope_theta(spec))
                           if spec.position == "rope" else None)
        self.token_type_embeddings = (_embedding(spec.type_vocab_size, h)
                                      if spec.type_vocab_size else None)
        self.embed_norm = _norm(spec)
        self.dropout = _dropout(spec.dropout)
        self.layers = nn.ModuleList(PostNormBlock(spec, attn_implementation=attn_implementation)
                                    for _ in range(spec.num_layers))
        self.pooler = nn.Linear(h, h) if spec.pooler else None
        _init_model(self)

    def forward(self, input_ids: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        seq = input_ids.shape[1]
        x = self.word_embeddings(input_ids)
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(torch.arange(seq, device=input_ids.device))
        if self.token_type_embeddings is not None:
            if token_type_ids is None:
                token_type_ids = torch.zeros_like(input_ids)
            x = x + self.token_type_embeddings(token_type_ids)
        x = self.dropout(self.embed_norm(x))
        rope = self.rotary_emb(x, seq) if self.rotary_emb is not None else None
        for layer in self.layers:
            x = layer(x, rope)
        return x

    def pool(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.pooler is None:
            raise MemfitError(f"model {self.spec.name!r} has no pooler (spec.pooler is False)")
        return torch.tanh(self.pooler(hidden[:, 0]))


class VisionTransformer(nn.Module):
    """ViT (Dosovitskiy et al. 2021): patch conv, class token, learned positions, pre-norm
    blocks, final norm, linear classifier on the class token."""

    def __init__(self, spec: TransformerSpec, *, attn_implementation: str = "sdpa") -> None:
        super().__init__()
        h = spec.hidden_size
        self.spec = spec
        self.patch_embed = nn.Conv2d(spec.num_channels, h, kernel_size=spec.patch_size,
                                     stride=spec.patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, h))
        self.position_embeddings = nn.Parameter(torch.zeros(1, spec.num_patches + 1, h))
        self.dropout = _dropout(spec.dropout)
        self.layers = nn.ModuleList(
            PreNormBlock(spec, causal=False, attn_implementation=attn_implementation,
                         moe_capacity_factor=1.0)
            for _ in range(spec.num_layers))
        self.norm = _norm(spec)
        self.classifier = nn.Linear(h, spec.num_labels) if spec.num_labels else None
        if _init_model(self):
            nn.init.trunc_normal_(self.cls_token, std=_INIT_STD)
            nn.init.trunc_normal_(self.position_embeddings, std=_INIT_STD)

    def forward(self, pixel_values: torch.Tensor,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        # Images arrive in fp32 whatever the weights are; cast them as Hugging Face's ViT does.
        pixel_values = pixel_values.to(self.patch_embed.weight.dtype)
        x = self.patch_embed(pixel_values).flatten(2).transpose(1, 2)  # [b, patches, h]
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        x = self.dropout(x + self.position_embeddings)
        for layer in self.layers:
            x = layer(x)
        cls = self.norm(x)[:, 0]
        if self.classifier is None:
            if labels is not None:
                raise MemfitError(f"model {self.spec.name!r} has no classifier (num_labels=0); "
                                  "give no labels or set num_labels")
            return cls
        logits = self.classifier(cls)
        return logits if labels is None else F.cross_entropy(logits, labels)


def _embedding(num_embeddings: int, dim: int) -> nn.Embedding:
    # Note: [no init on meta] nn.Embedding's own reset_parameters runs normal_, whose meta
    # implementation is a Python decomposition that imports torch._dynamo on first use (~1.5 s);
    # passing the storage skips it, and _init_model initialises real tensors instead.
    return nn.Embedding(num_embeddings, dim, _weight=torch.empty(num_embeddings, dim))


def _init_model(model: nn.Module) -> bool:
    """Initialise real weights (see [no init on meta]); returns False on meta, where there is
    nothing to initialise."""
    if any(p.is_meta for p in model.parameters()):
        return False
    model.apply(_init_weights)
    return True


def _init_weights(module: nn.Module) -> None:
    """GPT-2 / BERT initialisation: N(0, 0.02) weights, zero biases, unit norms."""
    if isinstance(module, nn.Linear | nn.Conv2d | nn.Embedding):
        nn.init.normal_(module.weight, std=_INIT_STD)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, MoE):
        for weight in (module.gate_proj, module.up_proj, module.down_proj):
            if weight is not None:
                nn.init.normal_(weight, std=_INIT_STD)


# GPT-NeoX (use_parallel_residual), Phi-1/2 and Falcon (parallel_attn) run attention and the
# MLP side by side.
_PARALLEL_BLOCK_FAMILIES = frozenset({"gpt_neox", "phi", "falcon"})


def _build_builtin(spec: TransformerSpec, attn_implementation: str | None,
                   moe_capacity_factor: float | None) -> nn.Module:
    if spec.family in _PARALLEL_BLOCK_FAMILIES or spec.head_bias:
        raise MemfitError(
            f"model {spec.name!r}: the builtin backend has no parallel attention + MLP block "
            f"or LM-head bias ({spec.family}); use backend='transformers' "
            "(pip install 'memfit[hf]')")
    attn = attn_implementation or "sdpa"
    if spec.arch == "decoder":
        return DecoderLM(spec, attn_implementation=attn, moe_capacity_factor=moe_capacity_factor)
    if spec.arch == "encoder":
        return BertEncoder(spec, attn_implementation=attn)
    return VisionTransformer(spec, attn_implementation=attn)


# ---------------------------------------------------------------------------------- public API
@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Create floating parameters in ``dtype`` directly (no fp32 copy first); restore on exit."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def transformers_available() -> bool:
    """Whether Hugging Face ``transformers`` imports here (``backend="auto"`` then builds
    with it)."""
    try:
        importlib.import_module("transformers")
    except ImportError:
        return False
    return True


def build_model(
    spec: TransformerSpec,
    *,
    backend: str = "auto",
    device: str | torch.device = "meta",
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
    moe_capacity_factor: float | None = 1.0,
) -> nn.Module:
    """Build ``spec`` as a real module, on ``device`` (meta by default: no memory) in ``dtype``.

    ``attn_implementation``: ``"sdpa"`` or ``"eager"``; unset means SDPA (eager for Hugging
    Face models that have no SDPA path, e.g. Gemma-2 in transformers 5).
    ``moe_capacity_factor`` only affects builtin MoE layers (see
    :class:`~memfit.models.builtin_layers.MoE`).

    >>> model = build_model(spec, backend="builtin")          # meta, fp32
    >>> loss = model(**example_inputs(spec, batch=2, seq=128))
    """
    if not isinstance(spec, TransformerSpec):
        raise MemfitError(
            f"model {getattr(spec, 'name', spec)!r} has no architecture (only a parameter count) "
            "and cannot be built or traced; give a preset name or a config.json")
    if backend not in BACKENDS:
        raise MemfitError(f"unknown backend {backend!r}{suggest(backend, BACKENDS)}; "
                          f"valid: {', '.join(BACKENDS)}")
    if attn_implementation is not None and attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise MemfitError(
            f"unknown attn_implementation {attn_implementation!r}"
            f"{suggest(attn_implementation, ATTN_IMPLEMENTATIONS)}; valid: "
            f"{', '.join(ATTN_IMPLEMENTATIONS)}")
    if moe_capacity_factor is not None and not moe_capacity_factor > 0:
        raise MemfitError(f"moe_capacity_factor must be positive or None, got "
                          f"{moe_capacity_factor}")
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise MemfitError(f"dtype must be a floating torch.dtype (e.g. torch.bfloat16), got "
                          f"{dtype!r}")
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise MemfitError(f"bad device {device!r}: {exc}; use e.g. 'meta', 'cpu' or 'cuda'"
                          ) from None
    if backend == "auto":
        backend = "transformers" if transformers_available() else "builtin"

    with target, _default_dtype(dtype):
        if backend == "transformers":
            model = _build_transformers(spec, attn_implementation)
        else:
            model = _build_builtin(spec, attn_implementation, moe_capacity_factor)

    built = sum(p.numel() for p in model.parameters())
    if built != spec.param_count():
        raise MemfitError(
            f"model {spec.name!r}: the {backend} {spec.family} model has {built:,} parameters but "
            f"the spec counts {spec.param_count():,}; the spec sets something this backend "
            "cannot express (biases, head_dim, norms); try the other backend")
    return model


def example_inputs(
    spec: TransformerSpec,
    batch: int,
    seq: int | None = None,
    device: str | torch.device = "meta",
    *,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Keyword inputs for ``build_model(spec)``: ``input_ids`` and ``labels`` (a separate tensor,
    as a data collator gives) for decoders, ``input_ids`` for BERT, ``pixel_values`` (in
    ``dtype``) and ``labels`` for ViT (labels only with a classifier). ``seq`` defaults to
    ``spec.default_seq_len``; for ViT it is fixed by the image size.

    >>> model(**example_inputs(spec, batch=4, seq=2048))
    """
    if isinstance(batch, bool) or not isinstance(batch, int) or batch <= 0:
        raise MemfitError(f"batch must be a positive integer, got {batch!r}")
    if seq is not None and (isinstance(seq, bool) or not isinstance(seq, int) or seq <= 0):
        raise MemfitError(f"seq must be a positive integer, got {seq!r}")
    if spec.arch == "vision":
        if seq is not None and seq != spec.default_seq_len:
            raise MemfitError(
                f"model {spec.name!r} sees {spec.default_seq_len} tokens per image "
                f"({spec.num_patches} patches + class token); leave seq unset or change "
                "image_size")
        size = (batch, spec.num_channels, spec.image_size, spec.image_size)
        inputs = {"pixel_values": torch.randn(size, device=device, dtype=dtype)}
        if spec.num_labels:
            inputs["labels"] = torch.randint(0, spec.num_labels, (batch,), device=device)
        return inputs
    seq = seq or spec.default_seq_len
    if spec.position == "learned" and seq > spec.max_position_embeddings:
        raise MemfitError(
            f"model {spec.name!r} has {spec.max_position_embeddings} learned positions, "
            f"seq {seq} is longer; use seq <= {spec.max_position_embeddings}")
    input_ids = torch.randint(0, spec.vocab_size, (batch, seq), device=device)
    if spec.arch == "encoder":
        return {"input_ids": input_ids}
    return {"input_ids": input_ids, "labels": input_ids.clone()}
