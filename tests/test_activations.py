"""Eager attention's saved score bytes per precision: first principles and the trace engine.

Byte rules per element of the a×s×s score matrix (Note: [eager scores under autocast] in
memfit.estimate.activations), from torch's source:

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
from memfit.categories import MemoryCategory
from memfit.estimate.activations import layer_terms, score_bytes_per_element, training_activations
from memfit.estimate.config import RunConfig
from memfit.models.spec import TransformerSpec

B, S, H = 2, 64, 128  # every tensor a multiple of 512 bytes: no CUDA rounding in the trace


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
    # the residual stream (fp32 under autocast) differs too; the scores add 2 B per element
    residual = spec.norms_per_layer * 2 * S * B * H
    gap = (training_activations(spec, mixed, S).per_layer
           - training_activations(spec, pure, S).per_layer)
    assert gap == residual + 2 * 4 * S * S * B
    # selective recompute (Korthikanti) drops every layer's whole score term, fp32 softmax
    # output included, and holds one layer's during its backward
    deep = dataclasses.replace(spec, num_layers=3)
    scores = 7 * 4 * S * S * B
    sel = training_activations(deep, dataclasses.replace(mixed, checkpointing="selective"), S)
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
                              steps=1, loss_fn=lambda out: out)
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
