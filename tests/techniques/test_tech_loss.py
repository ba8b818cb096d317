"""Chunked cross-entropy: same loss and gradients as the dense loss, much less memory, predicted."""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memfit import estimate
from memfit.errors import MemfitError
from memfit.models.build import build_model, example_inputs
from memfit.models.spec import TransformerSpec
from memfit.profiling import measure_cpu_peak
from memfit.techniques.loss import apply_chunked_loss, chunked_cross_entropy

# fp32 tolerance. Chunking sums the per-token losses per chunk and then over chunks, computes the
# log-sum-exp as max + log(sum(exp(x - max))) in place, and accumulates W's gradient chunk by
# chunk: the same math in another order. Each such sum of n fp32 terms can move by about
# log2(n) * eps(fp32) = 13 * 1.2e-7 relative; 4e-6 leaves a small margin over that.
RTOL = 4e-6

SPEC = TransformerSpec(name="tiny-llama", family="llama", arch="decoder", hidden_size=64,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                       intermediate_size=128, vocab_size=8192, norm="rmsnorm", position="rope",
                       mlp="swiglu")


def dense(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, reduction: str = "mean"
          ) -> torch.Tensor:
    return F.cross_entropy((h @ w.t()).float().flatten(0, -2), y.flatten(), ignore_index=-100,
                           reduction=reduction)


def close(a: torch.Tensor, b: torch.Tensor, rtol: float = RTOL) -> bool:
    """Equal up to ``rtol`` of the larger tensor's largest magnitude."""
    scale = max(a.abs().max().item(), b.abs().max().item(), 1e-30)
    return (a - b).abs().max().item() <= rtol * scale


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 10_000])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_matches_dense_cross_entropy(chunk_size: int, reduction: str) -> None:
    torch.manual_seed(0)
    h = torch.randn(3, 21, 16, requires_grad=True)
    w = torch.randn(50, 16, requires_grad=True)
    y = torch.randint(0, 50, (3, 21))
    y[0, :5] = -100
    ref = dense(h, w, y, reduction)
    gh_ref, gw_ref = torch.autograd.grad(ref, (h, w))
    out = chunked_cross_entropy(h, w, y, chunk_size=chunk_size, reduction=reduction)
    gh, gw = torch.autograd.grad(out, (h, w))
    assert close(out, ref) and close(gh, gh_ref) and close(gw, gw_ref)


def test_low_precision_inputs_within_bf16_tolerance() -> None:
    # bf16 hidden states and weight: logits are computed in bf16 (as the dense head does) and the
    # loss in fp32; gradients are returned in bf16, whose 8-bit mantissa rounds at 2**-8 relative.
    torch.manual_seed(0)
    h = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(100, 32, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, 100, (64,))
    ref = dense(h, w, y)
    out = chunked_cross_entropy(h, w, y, chunk_size=16)
    assert out.dtype == torch.float32
    assert close(out, ref, 1e-5)
    gh_ref, gw_ref = torch.autograd.grad(ref, (h, w))
    gh, gw = torch.autograd.grad(out, (h, w))
    assert gh.dtype == gw.dtype == torch.bfloat16
    assert close(gh.float(), gh_ref.float(), 2**-7) and close(gw.float(), gw_ref.float(), 2**-7)


def test_bad_input_raises_memfit_errors() -> None:
    h, w, y = torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long)
    with pytest.raises(MemfitError, match="chunk_size"):
        chunked_cross_entropy(h, w, y, chunk_size=0)
    with pytest.raises(MemfitError, match="labels shape"):
        chunked_cross_entropy(h, w, y[:3])
    with pytest.raises(MemfitError, match="reduction"):
        chunked_cross_entropy(h, w, y, reduction="none")
    with pytest.raises(MemfitError, match="needs CUDA"):
        chunked_cross_entropy(h, w, y, use_liger=True)
    with pytest.raises(MemfitError, match="no lm_head"):
        apply_chunked_loss(nn.Linear(2, 2))


# -- on models -----------------------------------------------------------------------------------

def loss_of(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.loss


def loss_and_grads(model: nn.Module, inputs: dict[str, torch.Tensor]
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = loss_of(model(**inputs))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def batch() -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    inputs = example_inputs(SPEC, batch=4, seq=256, device="cpu")
    inputs["labels"][:, :10] = -100  # a prompt that does not count
    return inputs


def backends() -> list[str]:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return ["builtin"]
    return ["builtin", "transformers"]


@pytest.mark.parametrize("backend", backends())
def test_model_loss_and_gradients_match(backend: str) -> None:
    torch.manual_seed(0)
    base = build_model(SPEC, backend=backend, device="cpu")
    model = apply_chunked_loss(copy.deepcopy(base), chunk_size=256)
    inputs = batch()
    loss0, grads0 = loss_and_grads(base, inputs)
    loss1, grads1 = loss_and_grads(model, inputs)
    assert close(loss1, loss0)
    assert grads0.keys() == grads1.keys()
    for name in grads0:
        assert close(grads1[name], grads0[name]), name
    # Without labels the model is unchanged: it returns its logits.
    ids = inputs["input_ids"]
    out0, out1 = base(input_ids=ids), model(input_ids=ids)
    logits0 = out0 if isinstance(out0, torch.Tensor) else out0.logits
    logits1 = out1 if isinstance(out1, torch.Tensor) else out1.logits
    assert torch.equal(logits0, logits1)


def backward_step(model: nn.Module, inputs: dict[str, torch.Tensor]) -> Callable[[], None]:
    gc.collect()

    def run() -> None:
        loss_of(model(**inputs)).backward()
    return run


@pytest.mark.parametrize("backend", backends())
def test_saves_real_memory(backend: str) -> None:
    # First principles: 4 x 256 = 1024 tokens x vocab 8192 fp32 logits are 32 MiB. The dense
    # loss holds the logits, log_softmax's saved output (32 MiB) and, in backward, the gradient
    # of each (32 MiB apiece): >= 96 MiB on top of ~0.6 M params (weights + grads ~5 MiB). The
    # chunked loss holds at most one 256-token chunk's logits and gradient (8 MiB each): <= ~25
    # MiB in all. So at least 60% is saved.
    torch.manual_seed(0)
    base = build_model(SPEC, backend=backend, device="cpu")
    model = apply_chunked_loss(copy.deepcopy(base), chunk_size=256)
    inputs = batch()
    real0 = measure_cpu_peak(backward_step(base, inputs), base, inputs).peak_bytes
    real1 = measure_cpu_peak(backward_step(model, inputs), model, inputs).peak_bytes
    assert real1 <= 0.4 * real0, (real0, real1)


def test_estimate_predicts_the_chunked_peak() -> None:
    torch.manual_seed(0)
    model = apply_chunked_loss(build_model(SPEC, backend="builtin", device="cpu"), chunk_size=256)
    inputs = batch()
    real = measure_cpu_peak(backward_step(model, inputs), model, inputs).peak_bytes
    est = estimate(model, inputs, optimizer="sgd", loss_fn=lambda m, b: loss_of(m(**b)),
                   device="cpu", steps=1)
    assert abs(est.peak_bytes - real) <= 0.01 * real, (est.peak_bytes, real)


def test_estimate_predicts_the_chunked_peak_hf() -> None:
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = apply_chunked_loss(build_model(SPEC, backend="transformers", device="cpu"),
                               chunk_size=256)
    inputs = batch()
    real = measure_cpu_peak(backward_step(model, inputs), model, inputs).peak_bytes
    est = estimate(model, inputs, optimizer="sgd", loss_fn=lambda m, b: loss_of(m(**b)),
                   device="cpu", steps=1)
    assert abs(est.peak_bytes - real) <= 0.01 * real, (est.peak_bytes, real)


def test_hf_chunked_loss_logs_no_cache_deprecation() -> None:
    """`memfit fit gpt2` began with transformers' "`past_key_values`/`cache_params` are
    deprecated. Use `cache` instead.": the chunked forward read and passed the outputs' old
    field name (transformers/utils/generic.py: ModelOutput.past_key_values logs it once). It
    now uses the name the installed transformers has, and nothing is logged."""
    import logging

    transformers = pytest.importorskip("transformers")
    from transformers.utils import logging as hf_logging

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64,
                                     n_positions=32)
    base = transformers.GPT2LMHeadModel(config).eval()  # no dropout: the losses compare
    model = apply_chunked_loss(copy.deepcopy(base), chunk_size=16)
    ids = torch.randint(0, 64, (2, 32))
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    root = logging.getLogger("transformers")
    hf_logging.warning_once.cache_clear()  # a line logged once already would not show again
    root.addHandler(handler)
    try:
        out = model(input_ids=ids, labels=ids)
    finally:
        root.removeHandler(handler)
    assert [r.getMessage() for r in records if "deprecated" in r.getMessage()] == []
    assert close(out.loss, base(input_ids=ids, labels=ids).loss)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_dense_and_uses_liger_when_installed() -> None:
    torch.manual_seed(0)
    h = torch.randn(512, 64, device="cuda", requires_grad=True)
    w = torch.randn(4096, 64, device="cuda", requires_grad=True)
    y = torch.randint(0, 4096, (512,), device="cuda")
    ref = dense(h, w, y)
    out = chunked_cross_entropy(h, w, y, chunk_size=128)
    assert close(out, ref, 1e-4)
    for use_liger in (False, None):
        gh, gw = torch.autograd.grad(chunked_cross_entropy(h, w, y, chunk_size=128,
                                                           use_liger=use_liger), (h, w))
        gh_ref, gw_ref = torch.autograd.grad(dense(h, w, y), (h, w))
        assert close(gh, gh_ref, 1e-3) and close(gw, gw_ref, 1e-3)
