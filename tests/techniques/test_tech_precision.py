"""Mixed/low precision: within dtype tolerance of fp32, real savings, predicted by the engine."""

from __future__ import annotations

import copy
import gc
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _models import TinyGPT
from memfit import estimate
from memfit.errors import MemfitError
from memfit.profiling import measure_cpu_peak
from memfit.techniques.precision import MasterWeights, MixedPrecision, apply_precision

VOCAB = 256  # TinyGPT's default (tests/_models.py)

# Unit roundoff (half an ulp at 1.0): bf16 keeps 8 significant bits, fp16 11.
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
# Tolerances in unit roundoffs of the low dtype, relative to fp32. A gradient here passes through
# roughly ten roundings to the low dtype (matmul inputs and outputs, activations of two blocks,
# forward and backward) whose errors add at worst: 16 leaves a margin. The loss (computed from
# logits by cross-entropy, upcast to fp32 by autocast) sees fewer: 2.
GRAD_ROUNDOFFS, LOSS_ROUNDOFFS = 16, 2


def lm_loss(logits: torch.Tensor) -> torch.Tensor:
    targets = torch.arange(logits.shape[0] * logits.shape[1]) % VOCAB
    return F.cross_entropy(logits.flatten(0, 1), targets)


def mse(logits: torch.Tensor) -> torch.Tensor:
    # In the output's dtype (test_estimate_with_upcast_loss covers the .float() variant).
    return logits.pow(2).mean()


def mse_fp32(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().pow(2).mean()


def loss_and_grads(precision: str, x: torch.Tensor, **kw: Any
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = TinyGPT()
    mp = apply_precision(model, precision, device_type="cpu", **kw)
    with mp.autocast():
        loss = lm_loss(model(x))
    mp.backward(loss)
    mp.unscale_(torch.optim.SGD(model.parameters(), lr=0.0))
    return loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}


# -- exactness within dtype tolerance ------------------------------------------------------------

@pytest.mark.parametrize(("precision", "dtype"), [("bf16-mixed", torch.bfloat16),
                                                  ("fp16-mixed", torch.float16),
                                                  ("bf16", torch.bfloat16)])
def test_within_dtype_tolerance_of_fp32(precision: str, dtype: torch.dtype) -> None:
    x = torch.randint(0, VOCAB, (4, 64))
    loss0, grads0 = loss_and_grads("fp32", x)
    # fp16-mixed: a 2**10 loss scale, unscaled before comparing (GradScaler's unscale_).
    kw = {"init_scale": 2.0**10} if precision == "fp16-mixed" else {}
    loss1, grads1 = loss_and_grads(precision, x, **kw)
    u = UNIT_ROUNDOFF[dtype]
    assert abs(loss1 - loss0).item() <= LOSS_ROUNDOFFS * u * loss0.abs().item()
    for name, g0 in grads0.items():
        error = ((grads1[name] - g0).norm() / g0.norm()).item()
        assert error <= GRAD_ROUNDOFFS * u, (name, error)
    # And it is not trivially fp32: something was rounded.
    assert any(not torch.equal(grads1[n], grads0[n]) for n in grads0)


def test_fp16_dynamic_loss_scaling_skips_overflow_and_halves_the_scale() -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    mp = apply_precision(model, "fp16-mixed", device_type="cpu", init_scale=2.0**40)
    assert isinstance(mp, MixedPrecision) and mp.scaler is not None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = copy.deepcopy(model.state_dict())
    x = torch.randint(0, VOCAB, (2, 16))
    with mp.autocast():
        loss = lm_loss(model(x))
    assert model(x).dtype == torch.float32  # outside autocast
    mp.backward(loss)  # 2**40 times the gradients overflows fp16 (max 65504)
    assert mp.step(opt) is False
    assert mp.scaler.get_scale() == 2.0**39  # backoff factor 0.5
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # A small scale: no overflow, the step happens, the scale stays.
    mp2 = apply_precision(model, "fp16-mixed", device_type="cpu", init_scale=2.0**4)
    opt.zero_grad(set_to_none=True)
    with mp2.autocast():
        loss = lm_loss(model(x))
    mp2.backward(loss)
    assert mp2.step(opt) is True
    assert mp2.scaler is not None and mp2.scaler.get_scale() == 2.0**4
    assert not torch.equal(before["head.weight"], model.state_dict()["head.weight"])


def test_master_weights_keep_updates_that_bf16_rounds_away() -> None:
    # bf16 weights near 1 are spaced 2**-7 apart: an SGD update of 1e-6 rounds back to the same
    # weight. fp32 master weights (spaced 2**-23 apart) keep it, and the bf16 weights written back
    # are exactly the fp32 update rounded to bf16.
    torch.manual_seed(0)
    pure, master = nn.Linear(8, 8), nn.Linear(8, 8)
    with torch.no_grad():
        pure.weight.fill_(1.0)
        master.load_state_dict(pure.state_dict())
    mp_pure = apply_precision(pure, "bf16", device_type="cpu")
    mp_master = apply_precision(master, "bf16", master_weights=True, device_type="cpu")
    opt_pure = mp_pure.wrap_optimizer(torch.optim.SGD(pure.parameters(), lr=1e-6))
    opt_master = mp_master.wrap_optimizer(torch.optim.SGD(master.parameters(), lr=1e-6))
    assert isinstance(opt_master, MasterWeights) and not isinstance(opt_pure, MasterWeights)
    x = torch.ones(4, 8, dtype=torch.bfloat16)
    reference = master.weight.detach().float().clone()
    for _ in range(3):
        for model, opt in ((pure, opt_pure), (master, opt_master)):
            model(x).float().pow(2).sum().backward()
            grad = model.weight.grad.float() if model is master else None
            opt.step()
            opt.zero_grad(set_to_none=True)
            if grad is not None:
                reference -= 1e-6 * grad  # SGD in fp32 on the upcast bf16 gradient
    assert torch.equal(pure.weight, torch.ones_like(pure.weight))  # every update lost
    assert opt_master.masters is not None
    assert torch.equal(opt_master.masters[0], reference)
    assert torch.equal(master.weight, reference.to(torch.bfloat16))
    assert master.weight.dtype == torch.bfloat16


def test_bad_input_raises_memfit_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(MemfitError, match="did you mean 'bf16-mixed'"):
        apply_precision(nn.Linear(2, 2), "bf16-mixd")
    with pytest.raises(MemfitError, match="only applies to precision='bf16'"):
        apply_precision(nn.Linear(2, 2), "fp16-mixed", master_weights=True)
    with pytest.raises(MemfitError, match=r"compute capability >= 8\.9"):
        apply_precision(nn.Linear(16, 16), "fp8", device_type="cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA to get past the CPU check")
def test_fp8_without_torchao_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9")
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(MemfitError, match=r"pip install 'memfit\[fp8\]'"):
        apply_precision(nn.Linear(16, 16).cuda(), "fp8")


# -- measured and predicted effect ---------------------------------------------------------------

def train(model: nn.Module, mp: MixedPrecision, x: torch.Tensor, opt: torch.optim.Optimizer
          ) -> Callable[[], list[bool]]:
    gc.collect()

    def run() -> list[bool]:
        stepped = []
        for _ in range(2):
            with mp.autocast():
                loss = mse(model(x))
            mp.backward(loss)
            del loss
            stepped.append(mp.step(opt))
            opt.zero_grad(set_to_none=True)
        return stepped
    return run


CASES = {
    # (precision, master weights) -> (most of fp32's peak it may use, first-principles reason)
    ("bf16-mixed", False): 0.75,  # saved activations ~halve (LN in/out stay fp32); +2 B/param
    ("fp16-mixed", False): 0.75,  # the same on CPU (fp16 and bf16 autocast lists agree here)
    ("bf16", False): 0.52,        # every tensor is half as large: 0.5 (+ 2 fp32 loss scalars)
    ("bf16", True): 0.62,         # activations halve; +4 B/param masters, fp32 states, grads
}


@pytest.fixture(scope="module")
def fp32_peak() -> int:
    x = torch.randint(0, VOCAB, (8, 128), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    base = TinyGPT()
    opt = torch.optim.AdamW(base.parameters(), lr=1e-3)
    return measure_cpu_peak(train(base, apply_precision(base, "fp32"), x, opt),
                            base, x, opt).peak_bytes


@pytest.mark.parametrize(("precision", "master"), list(CASES))
def test_real_saving_and_estimate(precision: str, master: bool, fp32_peak: int) -> None:
    x = torch.randint(0, VOCAB, (8, 128), generator=torch.Generator().manual_seed(0))
    real0 = fp32_peak
    torch.manual_seed(0)
    model = TinyGPT()
    # fp16: a loss scale that does not overflow, so both steps really happen (with the default
    # 2**16 this model's first steps overflow and are skipped: no AdamW state, a lower peak).
    mp = apply_precision(model, precision, master_weights=master, device_type="cpu",
                         init_scale=2.0**4)
    opt = mp.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    peak = measure_cpu_peak(train(model, mp, x, opt), model, x, opt)
    assert peak.result == [True, True]
    assert peak.peak_bytes <= CASES[precision, master] * real0, (peak.peak_bytes, real0)
    # The engine on the same model: mixed precisions by name on the fp32 model; pure bf16 on the
    # cast model (as fp32), master weights through the optimizer factory.
    torch.manual_seed(0)
    fresh = TinyGPT()
    if master:
        est = estimate(fresh.to(torch.bfloat16), (x,), loss_fn=lambda m, b: mse(m(*b)),
                       device="cpu",
                       optimizer=lambda ps: MasterWeights(torch.optim.AdamW(ps, lr=1e-3)))
    else:
        est = estimate(fresh, (x,), precision=precision, loss_fn=lambda m, b: mse(m(*b)),
                       device="cpu")
    assert abs(est.peak_bytes - peak.peak_bytes) <= 0.01 * peak.peak_bytes, (
        est.peak_bytes, peak.peak_bytes)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_trains_on_a_capable_gpu() -> None:
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9")
    pytest.importorskip("torchao.float8")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)).cuda()
    reference = copy.deepcopy(model)
    mp = apply_precision(model, "fp8")
    assert type(model[0]).__name__ == "Float8Linear"
    x = torch.randn(64, 256, device="cuda")
    with mp.autocast():
        out = model(x)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref = reference(x)
    # fp8 e4m3 keeps 4 significant bits: unit roundoff 2**-4; outputs agree to a few of them.
    error = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert error <= 4 * 2.0**-4, error
    mp.backward(out.float().pow(2).mean())
    assert all(p.grad is not None for p in model.parameters())


def test_estimate_with_upcast_loss() -> None:
    x = torch.randint(0, VOCAB, (8, 128))
    torch.manual_seed(0)
    model = TinyGPT()
    mp = apply_precision(model, "bf16-mixed", device_type="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def run() -> None:
        for _ in range(2):
            with mp.autocast():
                loss = mse_fp32(model(x))
            mp.backward(loss)
            del loss
            mp.step(opt)
            opt.zero_grad(set_to_none=True)

    gc.collect()
    real = measure_cpu_peak(run, model, x, opt).peak_bytes
    torch.manual_seed(0)
    est = estimate(TinyGPT(), (x,), precision="bf16-mixed", loss_fn=lambda m, b: mse_fp32(m(*b)),
                   device="cpu")
    assert abs(est.peak_bytes - real) <= 0.01 * real, (est.peak_bytes, real)
