"""What is being run: a transformer's architecture, or just a parameter count.

Parameter counts are computed from the shapes, module by module, the way PyTorch counts
``sum(p.numel() for p in model.parameters())`` with tied weights counted once; the tests check
them against the published counts exactly.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

from memfit.errors import MemfitError

Arch = Literal["decoder", "encoder", "vision"]
Mlp = Literal["gelu", "swiglu", "geglu"]
Norm = Literal["layernorm", "rmsnorm"]
Position = Literal["learned", "rope"]
QkNorm = Literal["none", "head", "proj"]

# Linear layers a LoRA adapter may target, by role (peft's names differ per model; these are ours).
ATTENTION_TARGETS = ("q", "k", "v", "o")
MLP_TARGETS = ("gate", "up", "down")


@dataclass(frozen=True, kw_only=True)
class LinearShape:
    """One linear layer of a transformer block."""

    role: str
    """One of ATTENTION_TARGETS or MLP_TARGETS."""
    in_features: int
    out_features: int
    count: int = 1
    """How many per layer (MoE experts: one per expert)."""


@dataclass(frozen=True, kw_only=True)
class TransformerSpec:
    """A transformer's shapes: decoder LLMs, BERT-style encoders, ViTs.

    Known limitations: sliding-window attention, soft-capping and rope scaling change speed or
    numerics, not the bytes counted here, and are ignored. Vision models are ViTs with a class
    token and a linear classification head.
    """

    name: str
    family: str
    """HF ``model_type``: gpt2, gpt_neox, falcon, llama, mistral, mixtral, qwen2, qwen3,
    qwen3_moe, gemma2, gemma3_text, olmo2, phi, phi3, bert, vit."""
    arch: Arch
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    """FFN width (per expert for MoE)."""
    vocab_size: int = 0
    max_position_embeddings: int = 0
    rope_scaling: bool = False
    """config.json has a ``rope_scaling``: the RoPE context may be stretched past
    ``max_position_embeddings`` (YaRN, linear, dynamic NTK), so a longer ``--seq`` is allowed."""
    mlp: Mlp = "swiglu"
    norm: Norm = "rmsnorm"
    norms_per_layer: int = 2
    """Gemma-2/3 have four (pre/post attention, pre/post feed-forward). OLMo-2's two come after
    attention and after the MLP (post-norm), the others' before."""
    qk_norm: QkNorm = "none"
    """Norms (of type ``norm``) on queries and keys: ``"head"`` over each head (Qwen3, Gemma-3,
    Phi-2's ``qk_layernorm``), ``"proj"`` over the whole q and k projections (OLMo-2)."""
    head_bias: bool = False
    """A bias on the LM head (Phi-1/2: vocab_size more parameters)."""
    qkv_bias: bool = False
    attn_out_bias: bool = False
    mlp_bias: bool = False
    position: Position = "rope"
    tie_embeddings: bool = False
    num_experts: int = 0
    """0 for dense models."""
    experts_per_token: int = 0
    type_vocab_size: int = 0
    """BERT token-type embeddings."""
    pooler: bool = False
    """BERT pooler (dense h x h + tanh)."""
    image_size: int = 0
    patch_size: int = 0
    num_channels: int = 3
    num_labels: int = 0
    """Classification head outputs (ViT); 0 for none."""
    dropout: float = 0.0
    """Hidden/residual dropout probability (dropout masks cost activation memory)."""
    attention_dropout: float = 0.0
    source: str | None = None
    """Where the config comes from (model card / config.json)."""

    def __post_init__(self) -> None:
        for field_name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                           "intermediate_size"):
            if getattr(self, field_name) <= 0:
                raise MemfitError(f"model {self.name!r}: {field_name} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise MemfitError(
                f"model {self.name!r}: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})")
        if self.arch == "vision" and (self.image_size <= 0 or self.patch_size <= 0):
            raise MemfitError(
                f"model {self.name!r}: a vision model needs image_size and patch_size")
        if self.arch != "vision" and self.vocab_size <= 0:
            raise MemfitError(f"model {self.name!r}: vocab_size must be positive")
        if self.qk_norm not in ("none", "head", "proj"):
            raise MemfitError(f"model {self.name!r}: qk_norm must be 'none', 'head' or 'proj', "
                              f"got {self.qk_norm!r}")
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise MemfitError(
                f"model {self.name!r}: experts_per_token must be in 1..{self.num_experts}")

    # ----------------------------------------------------------------- shapes
    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2 if self.arch == "vision" else 0

    @property
    def default_seq_len(self) -> int:
        """Tokens per sample when the user gives none: the image's patches + class token for
        ViTs, else the context length (capped at 2048 to stay a plausible default)."""
        if self.arch == "vision":
            return self.num_patches + 1
        return min(self.max_position_embeddings or 2048, 2048)

    def linear_shapes(self) -> list[LinearShape]:
        """The linear layers of one block, by role (fused projections listed per role)."""
        return list(_linear_shapes(self))

    # ----------------------------------------------------------- param counts
    def _norm_params(self) -> int:
        return self.hidden_size * (2 if self.norm == "layernorm" else 1)

    def layer_params(self) -> int:
        """Parameters of one transformer block."""
        h = self.hidden_size
        total = sum(s.in_features * s.out_features * s.count for s in self.linear_shapes())
        if self.qkv_bias:
            total += self.q_dim + 2 * self.kv_dim
        if self.attn_out_bias:
            total += h
        if self.mlp_bias:
            experts = max(self.num_experts, 1)
            total += experts * (self.intermediate_size * (2 if self.mlp != "gelu" else 1) + h)
        if self.is_moe:
            total += h * self.num_experts  # router, no bias
        total += self.norms_per_layer * self._norm_params()
        per_weight = 2 if self.norm == "layernorm" else 1  # LayerNorm has a bias too
        if self.qk_norm == "head":
            total += 2 * self.head_dim * per_weight
        elif self.qk_norm == "proj":
            total += (self.q_dim + self.kv_dim) * per_weight
        return total

    def embedding_params(self) -> int:
        """Token/patch/position embeddings (and the embedding LayerNorm of BERT)."""
        h = self.hidden_size
        if self.arch == "vision":
            patch = self.num_channels * self.patch_size**2 * h + h  # conv with bias
            return patch + h + (self.num_patches + 1) * h  # + class token + positions
        total = self.vocab_size * h
        if self.position == "learned":
            total += self.max_position_embeddings * h
        total += self.type_vocab_size * h
        if self.arch == "encoder":
            total += self._norm_params()  # BERT normalises the embeddings
        return total

    def head_params(self) -> int:
        """Everything after the last block: final norm, LM head / pooler / classifier."""
        h = self.hidden_size
        total = 0
        if self.arch != "encoder":  # BERT's last LayerNorm is inside its last block
            total += self._norm_params()
        if self.arch == "decoder" and not self.tie_embeddings:
            total += self.vocab_size * h
        if self.arch == "decoder" and self.head_bias:
            total += self.vocab_size
        if self.pooler:
            total += h * h + h
        if self.num_labels:
            total += h * self.num_labels + self.num_labels
        return total

    def param_count(self) -> int:
        """All parameters, tied weights counted once."""
        return self.embedding_params() + self.num_layers * self.layer_params() + self.head_params()

    def active_param_count(self) -> int:
        """Parameters used per token (MoE: only ``experts_per_token`` experts)."""
        if not self.is_moe:
            return self.param_count()
        h, f = self.hidden_size, self.intermediate_size
        per_expert = h * f * (3 if self.mlp != "gelu" else 2)
        idle = (self.num_experts - self.experts_per_token) * per_expert
        return self.param_count() - self.num_layers * idle


@functools.lru_cache(maxsize=256)
def _linear_shapes(spec: TransformerSpec) -> tuple[LinearShape, ...]:
    """:meth:`TransformerSpec.linear_shapes`, cached by the (frozen) spec: the formulas ask
    for them several times in every plan, and a search makes tens of thousands of plans."""
    h, f = spec.hidden_size, spec.intermediate_size
    experts = max(spec.num_experts, 1)
    shapes = [
        LinearShape(role="q", in_features=h, out_features=spec.q_dim),
        LinearShape(role="k", in_features=h, out_features=spec.kv_dim),
        LinearShape(role="v", in_features=h, out_features=spec.kv_dim),
        LinearShape(role="o", in_features=spec.q_dim, out_features=h),
    ]
    if spec.mlp in ("swiglu", "geglu"):
        shapes.append(LinearShape(role="gate", in_features=h, out_features=f, count=experts))
    shapes.append(LinearShape(role="up", in_features=h, out_features=f, count=experts))
    shapes.append(LinearShape(role="down", in_features=f, out_features=h, count=experts))
    return tuple(shapes)


# A bound on a bare parameter count: 1e15 (1000T) is over 5x the largest model ever reported
# (BaGuaLu, 174T, on the Sunway supercomputer, 2022) and ~500x today's largest open models
# (~1-2T); its bf16 weights alone are 2 PB. A count above it is a typo (an exponent or a
# suffix), not a plan: the reports would print numbers no one can use.
MAX_PARAMS = 10**15


@dataclass(frozen=True, kw_only=True)
class ParamCountSpec:
    """A model known only by its parameter count: model states can be planned, activations
    cannot (the planner says so)."""

    name: str
    params: int

    def __post_init__(self) -> None:
        # The caller may be the CLI (--params) or Python (params=): the message names both.
        if self.params <= 0:
            raise MemfitError(f"a parameter count (--params / params=) must be positive, "
                              f"got {self.params:,}")
        if self.params > MAX_PARAMS:
            raise MemfitError(
                f"a parameter count (--params / params=) of {self.params:.10g} is above "
                "1e15 (1000T), over 5x the largest model ever reported (BaGuaLu, 174T) and "
                "2 PB of bf16 weights alone; check the exponent or the suffix "
                "(7.5e9 = 7.5B)")

    def param_count(self) -> int:
        return self.params


ModelSpec = TransformerSpec | ParamCountSpec
