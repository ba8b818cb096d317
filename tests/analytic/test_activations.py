"""Eager attention's saved score bytes per precision: first principles and the trace engine.

Byte rules per element of the a×s×s score matrix (Note: [eager scores under autocast] in
memfit.analytic.block_activations), from torch's source:

- CUDA autocast puts ``softmax`` on its fp32 list (``aten/src/ATen/autocast_mode.h``,
  ``AT_FORALL_FP32_SET_OPT_DTYPE``; registered for CUDA in ``autocast_mode.cpp``): it runs as
  ``softmax(x, dim, dtype=float)`` and its backward keeps its fp32 output: 4 bytes.
- ``dropout`` on a CUDA tensor with 0 < p < 1 is ``native_dropout``
  (``aten/src/ATen/native/Dropout.cpp``: ``is_fused_kernel_acceptable``), whose backward keeps
  only its bool mask (``derivatives.yaml``): 1 byte. Its fp32 output is not kept.
- The matmul with V is on autocast's lower-precision list: it casts the fp32 probabilities to
  16-bit and keeps that copy for V's gradient: 2 bytes.

So fp16-/bf16-mixed keeps 4 + 1 + 2 = 7 bytes per score element with attention dropout and
4 + 2 = 6 without; pure 16-bit keeps Korthikanti's 2 + 1 + 2 = 5 (2 without: the matmul keeps the
softmax output itself), fp32 4 + 1 + 4 = 9 (4).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import warnings

import pytest
import torch
from torch import nn

import memfit
from memfit.analytic.activations import training_activations
from memfit.analytic.block_activations import layer_terms, score_bytes_per_element
from memfit.analytic.config import RunConfig
from memfit.categories import MemoryCategory
from memfit.models.spec import TransformerSpec

B, S, H = 2, 64, 128  # every tensor a multiple of 512 bytes: no CUDA rounding in the trace


def llama_like(family: str = "llama") -> TransformerSpec:
    return TransformerSpec(
        name=f"{family}-tiny", family=family, arch="decoder", hidden_size=H, num_layers=1,
        num_heads=4, num_kv_heads=2, head_dim=H // 4, intermediate_size=3 * H, vocab_size=1000)


def bert_like(heads: int, dropout: float) -> TransformerSpec:
    return TransformerSpec(
        name="bert-tiny", family="bert", arch="encoder", hidden_size=H, num_layers=1,
        num_heads=heads, num_kv_heads=heads, head_dim=H // heads, intermediate_size=4 * H,
        vocab_size=1000, max_position_embeddings=512, mlp="gelu", norm="layernorm",
        qkv_bias=True, attn_out_bias=True, mlp_bias=True, position="learned",
        dropout=dropout, attention_dropout=dropout)


@pytest.mark.parametrize(("precision", "dropout", "per_element"), [
    ("bf16-mixed", 0.1, 4 + 1 + 2),  # fp32 softmax out, bool mask, the matmul's bf16 copy
    ("fp16-mixed", 0.1, 4 + 1 + 2),
    ("bf16-mixed", 0.0, 4 + 2),  # fp32 softmax out, the matmul's bf16 copy
    ("bf16", 0.1, 2 + 1 + 2),  # Korthikanti's 5as²b
    ("bf16", 0.0, 2),  # the matmul keeps the softmax output itself
    ("fp32", 0.1, 4 + 1 + 4),
    ("fp32", 0.0, 4),
])
def test_eager_score_bytes_by_hand(precision: str, dropout: float, per_element: int) -> None:
    heads = 4
    run = RunConfig(precision=precision, attention="eager", batch=B, seq=S)
    e = 4 if precision == "fp32" else 2
    assert score_bytes_per_element(act_bytes=e, dropout=dropout > 0,
                                   autocast=run.mixed) == per_element
    terms = layer_terms(bert_like(heads, dropout), seq=S, batch=B, act_bytes=e,
                        attention="eager", autocast=run.mixed)
    # bf16-mixed with dropout: 7 B x 4 heads x 64 x 64 x 2 = 229,376 bytes
    assert terms.attention_scores == per_element * heads * S * S * B
    if (precision, dropout) == ("bf16-mixed", 0.1):
        assert terms.attention_scores == 229_376


def test_autocast_scores_reach_training_activations() -> None:
    spec = bert_like(4, 0.1)
    mixed = RunConfig(precision="bf16-mixed", attention="eager", batch=B, seq=S)
    pure = RunConfig(precision="bf16", attention="eager", batch=B, seq=S)
    # the residual stream (fp32 under autocast) differs too, and BERT's separate query, key and
    # value keep a bf16 input each (pure bf16: one shared); the scores add 2 B per element
    residual = spec.norms_per_layer * 2 * S * B * H
    projection_inputs = 2 * 2 * S * B * H
    gap = (training_activations(spec, mixed, S).per_layer
           - training_activations(spec, pure, S).per_layer)
    assert gap == residual + projection_inputs + 2 * 4 * S * S * B
    # selective-attn (Korthikanti's selective recompute) drops every layer's whole score term,
    # fp32 softmax output included, and holds one layer's during its backward
    deep = dataclasses.replace(spec, num_layers=3)
    scores = 7 * 4 * S * S * B
    korthikanti = dataclasses.replace(mixed, checkpointing="selective-attn")
    sel = training_activations(deep, korthikanti, S)
    none = training_activations(deep, mixed, S)
    assert none.activations - sel.activations == (3 - 1) * scores


class EagerAttention(nn.Module):
    """A fused QKV projection and Hugging Face's ``eager_attention_forward`` (BERT, GPT-2)."""

    def __init__(self, heads: int, p: float) -> None:
        super().__init__()
        self.heads, self.head_dim, self.p = heads, H // heads, p
        self.qkv = nn.Linear(H, 3 * H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        w = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        w = nn.functional.dropout(nn.functional.softmax(w, dim=-1), p=self.p, training=True)
        return torch.matmul(w, v).float().sum()


def traced_saved_bytes(model: nn.Module, x: torch.Tensor, precision: str) -> int:
    """Activation bytes alive at the end of the traced forward pass on the CUDA target."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = memfit.estimate(model, x, precision=precision, device="cuda", optimizer="sgd",
                              steps=1, loss_fn=lambda m, b: m(b))
    forward = [p for p in est.timeline if p.phase == "forward"]
    return forward[-1].by_category()[MemoryCategory.ACTIVATIONS]


def traced_score_bytes(make: type[nn.Module] | object, precision: str, p: float) -> int:
    """Saved bytes per score element in the trace: 4 heads vs 8 heads of the same width differ
    only in the a×s×s tensors (Q, K, V and the projections are s×b×h either way)."""
    x = torch.empty(B, S, H, device="meta", requires_grad=True)
    saved = []
    for heads in (4, 8):
        with torch.device("meta"):
            model = make(heads, p)  # type: ignore[operator]
        saved.append(traced_saved_bytes(model, x, precision))
    return saved[1] - saved[0]


# pure precisions without dropout are left out: the trace's dropout stand-in copies the input at
# p=0 (torch's decomposition) where CUDA's dropout returns it, so it keeps one extra copy.
@pytest.mark.parametrize(("precision", "p"), [
    ("bf16-mixed", 0.1), ("fp16-mixed", 0.1), ("bf16-mixed", 0.0), ("fp16-mixed", 0.0),
    ("bf16", 0.1), ("fp16", 0.1), ("fp32", 0.1),
])
def test_eager_scores_match_the_trace(precision: str, p: float) -> None:
    run = RunConfig(precision=precision, attention="eager", batch=B, seq=S)
    e = 4 if precision == "fp32" else 2

    def analytic(heads: int) -> int:
        return layer_terms(bert_like(heads, p), seq=S, batch=B, act_bytes=e,
                           attention="eager", autocast=run.mixed).attention_scores

    expected = analytic(8) - analytic(4)
    traced = traced_score_bytes(EagerAttention, precision, p)
    assert traced == pytest.approx(expected, rel=0.02)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers not installed")
@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
def test_eager_scores_match_the_trace_of_hf_bert_layer(precision: str) -> None:
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertLayer

    class Layer(nn.Module):
        def __init__(self, heads: int, p: float) -> None:
            super().__init__()
            config = BertConfig(hidden_size=H, num_attention_heads=heads,
                                intermediate_size=4 * H, hidden_dropout_prob=p,
                                attention_probs_dropout_prob=p)
            config._attn_implementation = "eager"
            self.layer = BertLayer(config)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.layer(x)
            return (out[0] if isinstance(out, tuple) else out).float().sum()

    def analytic(heads: int) -> int:
        return layer_terms(bert_like(heads, 0.1), seq=S, batch=B, act_bytes=2,
                           attention="eager", autocast=True).attention_scores

    traced = traced_score_bytes(Layer, precision, 0.1)
    assert traced == pytest.approx(analytic(8) - analytic(4), rel=0.02)


SBH = S * B * H


@pytest.mark.parametrize(("spec", "precision", "targets", "per_sbh"), [
    # 2 RMSNorms x (fp32 input 4 + normalised 4) + q, k, v casts 3 x 2 + gate, up casts 2 x 2
    (llama_like(), "bf16-mixed", None, 2 * (4 + 4) + 3 * 2 + 2 * 2),
    # pure bf16: fp32 upcast 4 + bf16 normalised 2 per norm; one shared input per block
    (llama_like(), "bf16", None, 2 * (4 + 2) + 2 + 2),
    (llama_like(), "fp32", None, 2 * (4 + 4) + 4 + 4),
    # Phi-3's fused qkv_proj and gate_up_proj cast once each
    (llama_like("phi3"), "bf16-mixed", None, 2 * (4 + 4) + 2 + 2),
    # LoRA on q and v: frozen norms keep only the fp32 input; one cast per adapter
    (llama_like(), "bf16-mixed", ("q", "v"), 2 * 4 + 2 * 2),
    (llama_like(), "bf16", ("q", "v"), 2 * 4 + 2),
    # BERT: LayerNorm inputs (fp32 residual), separate query/key/value, one GeLU MLP input,
    # two 1-byte residual dropout masks
    (bert_like(4, 0.1), "bf16-mixed", None, 2 * 4 + 3 * 2 + 2 + 2 * 1),
    (bert_like(4, 0.1), "bf16", None, 2 * 2 + 2 + 2 + 2 * 1),
])
def test_replicated_bytes_by_hand(spec: TransformerSpec, precision: str,
                                  targets: tuple[str, ...] | None, per_sbh: int) -> None:
    run = RunConfig(precision=precision, batch=B, seq=S)
    e = 4 if precision == "fp32" else 2
    terms = layer_terms(spec, seq=S, batch=B, act_bytes=e, attention="sdpa",
                        trainable=None if targets is None else frozenset(targets),
                        residual_bytes=4 if run.mixed else e, autocast=run.mixed)
    assert terms.replicated == per_sbh * SBH
    if (spec.family, precision, targets) == ("llama", "bf16-mixed", None):
        assert terms.replicated == 425_984  # 26 x 64 x 2 x 128


def test_gpt2_fused_qkv_keeps_one_cast() -> None:
    gpt2 = dataclasses.replace(bert_like(4, 0.1), family="gpt2", arch="decoder")
    mixed = layer_terms(gpt2, seq=S, batch=B, act_bytes=2, attention="sdpa", residual_bytes=4,
                        autocast=True)
    bert = layer_terms(bert_like(4, 0.1), seq=S, batch=B, act_bytes=2, attention="sdpa",
                       residual_bytes=4, autocast=True)
    assert bert.replicated - mixed.replicated == 2 * 2 * SBH  # key's and value's casts


def traced_layer_bytes(make: type[nn.Module], precision: str, batch: int) -> int:
    """Activation bytes at the end of the traced forward, less the fp32 input tensor itself."""
    x = torch.empty(batch, S, H, device="meta", requires_grad=True)
    with torch.device("meta"):
        model = make()
    return traced_saved_bytes(model, x, precision) - x.numel() * 4


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers not installed")
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["bert", "llama"])
def test_layer_terms_match_the_trace_of_hf_layers(family: str, attention: str) -> None:
    """A whole HF block under bf16-mixed: batch 4 minus batch 2 (the cached weight casts cancel).
    The block's input is made a non-leaf (``x * 1.0``) as it is in a real stack: autocast would
    cache the casts of a leaf that requires grad and keep one."""
    from transformers import BertConfig, LlamaConfig
    from transformers.models.bert.modeling_bert import BertLayer
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    class Bert(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            config = BertConfig(hidden_size=H, num_attention_heads=4, intermediate_size=4 * H,
                                hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
            config._attn_implementation = attention
            self.layer = BertLayer(config)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.layer(x * 1.0)
            return (out[0] if isinstance(out, tuple) else out).float().sum()

    class Llama(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            config = LlamaConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2,
                                 intermediate_size=3 * H, vocab_size=1000)
            config._attn_implementation = attention
            self.layer = LlamaDecoderLayer(config, 0)
            self.rope = LlamaRotaryEmbedding(config)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # position ids of batch 1, as LlamaModel makes them: cos/sin do not grow with batch
            positions = torch.arange(x.shape[1], device=x.device)[None]
            out = self.layer(x * 1.0, position_embeddings=self.rope(x, positions))
            return (out[0] if isinstance(out, tuple) else out).float().sum()

    spec, make = (bert_like(4, 0.1), Bert) if family == "bert" else (llama_like(), Llama)

    def analytic(batch: int) -> int:
        terms = layer_terms(spec, seq=S, batch=batch, act_bytes=2, attention=attention,
                            residual_bytes=4, autocast=True)
        return terms.replicated + terms.split

    traced = traced_layer_bytes(make, "bf16-mixed", 4) - traced_layer_bytes(make, "bf16-mixed", 2)
    assert traced == pytest.approx(analytic(4) - analytic(2), rel=0.02)
