"""Technique 7, SDPA attention: eager-equal outputs/grads, measured and predicted CPU saving."""

from __future__ import annotations

import gc
import importlib.util
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memfit.errors import MemfitError
from memfit.models.build import build_model, example_inputs
from memfit.models.spec import TransformerSpec
from memfit.profiling import measure_cpu_peak
from memfit.techniques.attention import sdpa_backends, set_attn_implementation, use_sdpa
from memfit.trace import estimate

HAS_HF = importlib.util.find_spec("transformers") is not None
BATCH, SEQ = 2, 256
SPEC = TransformerSpec(
    name="tiny-llama", family="llama", arch="decoder", hidden_size=64, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16, intermediate_size=128, vocab_size=128,
    max_position_embeddings=512)
backends = ["builtin", pytest.param("transformers", marks=pytest.mark.skipif(
    not HAS_HF, reason="needs transformers"))]


def loss_of(out: Any) -> torch.Tensor:
    return out.loss if hasattr(out, "loss") else out


def model_and_inputs(backend: str, impl: str = "eager") -> tuple[nn.Module,
                                                                   dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = build_model(SPEC, backend=backend, device="cpu", attn_implementation=impl)
    return model, example_inputs(SPEC, batch=BATCH, seq=SEQ, device="cpu")


def loss_and_grads(model: nn.Module, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor,
                                                                              list[torch.Tensor]]:
    loss = loss_of(model(**inputs))
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def real_peak(model: nn.Module, inputs: dict[str, torch.Tensor]) -> int:
    opt = torch.optim.AdamW(model.parameters())

    def step() -> None:
        for _ in range(2):
            loss_of(model(**inputs)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    gc.collect()  # garbage of earlier tests freed inside the measurement would count
    return measure_cpu_peak(step, model, inputs).peak_bytes


# -- exactness --------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", backends)
def test_sdpa_matches_eager(backend: str) -> None:
    model, inputs = model_and_inputs(backend, "eager")
    eager_loss, eager_grads = loss_and_grads(model, inputs)
    assert use_sdpa(model) is model
    if backend == "transformers":
        assert model.config._attn_implementation == "sdpa"
    with sdpa_backends("flash", "efficient"):  # CPU: the flash-attention CPU kernel
        sdpa_loss, sdpa_grads = loss_and_grads(model, inputs)
    # Same softmax(QK^T/sqrt(d))V in fp32, with a blockwise (online) softmax: the loss agrees
    # to fp32 rounding of a ~4.9 value; gradients (|g| <= ~0.03) to 1e-7 absolute.
    torch.testing.assert_close(sdpa_loss, eager_loss, rtol=1e-6, atol=0)
    for got, want in zip(sdpa_grads, eager_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    set_attn_implementation(model, "eager")
    back_loss, _ = loss_and_grads(model, inputs)
    assert torch.equal(back_loss, eager_loss)


def test_pinned_backends_refuse_what_they_exclude() -> None:
    q = k = v = torch.randn(1, 2, 8, 4)
    ref = F.scaled_dot_product_attention(q, k, v)
    with sdpa_backends("math"):
        torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v), ref)
    # The CPU build has no memory-efficient kernel: pinning it alone must fail loudly rather
    # than fall back to the math path.
    with sdpa_backends("efficient"), pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v), ref)  # restored


# -- measured effect --------------------------------------------------------------------------

def test_sdpa_saves_the_attention_matrices() -> None:
    model, inputs = model_and_inputs("builtin", "eager")
    eager = real_peak(model, inputs)
    use_sdpa(model)
    sdpa = real_peak(model, inputs)
    # Eager keeps each layer's softmax probabilities [b, heads, s, s] in fp32 for backward
    # (2 x 4 x 256 x 256 x 4 B = 2 MiB per layer); the flash kernel keeps the output and a
    # [b, heads, s] log-sum-exp instead. At least the probabilities of every layer go.
    probs = BATCH * SPEC.num_heads * SEQ * SEQ * 4
    assert eager - sdpa >= SPEC.num_layers * probs


# -- predicted effect -------------------------------------------------------------------------

@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_estimate_predicts_builtin(impl: str) -> None:
    model, inputs = model_and_inputs("builtin", impl)
    est = estimate(model, inputs, optimizer="adamw", loss_fn=lambda m, b: loss_of(m(**b)),
                   device="cpu", steps=2)
    real = real_peak(model, inputs)
    assert abs(est.peak_bytes - real) <= 0.01 * real, (est.peak_bytes, real)


@pytest.mark.skipif(not HAS_HF, reason="needs transformers")
def test_estimate_predicts_hf_sdpa() -> None:
    model, inputs = model_and_inputs("transformers", "sdpa")
    est = estimate(model, inputs, optimizer="adamw", loss_fn=lambda m, b: loss_of(m(**b)),
                   device="cpu", steps=2)
    real = real_peak(model, inputs)
    assert abs(est.peak_bytes - real) <= 0.01 * real, (est.peak_bytes, real)


# -- errors -----------------------------------------------------------------------------------

def test_errors() -> None:
    with pytest.raises(MemfitError, match="found no attention"):
        use_sdpa(nn.Linear(2, 2))
    with pytest.raises(MemfitError, match="did you mean 'sdpa'"):
        set_attn_implementation(nn.Linear(2, 2), "spda")
    with pytest.raises(MemfitError, match="did you mean 'flash'"), sdpa_backends("flesh"):
        pass
