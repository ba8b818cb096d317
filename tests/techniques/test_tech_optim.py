"""Technique 4, optimizers: exactness, measured CPU effect, predicted effect (memfit.estimate)."""

from __future__ import annotations

import gc
import importlib.util
from collections.abc import Callable

import pytest
import torch
from torch import nn

from memfit.errors import MemfitError
from memfit.profiling import measure_cpu_peak
from memfit.techniques.optim import CPUOffloadOptimizer, make_optimizer, state_bytes
from memfit.trace import estimate

HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None
HAS_TORCHAO = importlib.util.find_spec("torchao") is not None
HAS_8BIT = HAS_BNB or HAS_TORCHAO

LAYERS, DIM = 8, 256
P = LAYERS * DIM * DIM  # parameters of the wide model (no biases)


def wide() -> nn.Module:
    """Eight 256x256 matrices: 524,288 parameters, 2 MiB of fp32 weights, tiny activations, so
    the optimizer dominates the peak."""
    return nn.Sequential(*[nn.Linear(DIM, DIM, bias=False) for _ in range(LAYERS)])


def small() -> nn.Module:
    return nn.Sequential(nn.Linear(128, 256), nn.Tanh(), nn.Linear(256, 64))


def square() -> nn.Module:
    """Two 128x128 matrices, no biases: torchao's 8-bit AdamW compiles its update once per
    parameter shape (``torch.compile(single_param_adam, dynamic=False)``, torchao/optim/adam.py),
    so one shape is one compile (``small``'s four shapes took 29 s from an empty inductor cache
    on a 2-core Xeon)."""
    return nn.Sequential(nn.Linear(128, 128, bias=False), nn.Tanh(),
                         nn.Linear(128, 128, bias=False))


def loss_fn(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def train(make: Callable[[], nn.Module], name: str, steps: int = 5, **kw: object) -> torch.Tensor:
    torch.manual_seed(0)
    model = make()
    x = torch.randn(16, next(model.parameters()).shape[1])
    opt = make_optimizer(model.parameters(), name, **kw)  # type: ignore[arg-type]
    for _ in range(steps):
        loss_fn(model(x)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def initial(make: Callable[[], nn.Module]) -> torch.Tensor:
    torch.manual_seed(0)
    return torch.cat([p.detach().flatten() for p in make().parameters()])


def real_peak(name: str, **kw: object) -> tuple[int, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model, x = wide(), torch.randn(4, DIM)
    opt = make_optimizer(model.parameters(), name, **kw)  # type: ignore[arg-type]

    def step() -> None:
        for _ in range(2):
            loss_fn(model(x)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    host = opt.host_params if isinstance(opt, CPUOffloadOptimizer) else []
    gc.collect()  # garbage of earlier tests freed inside the measurement would count
    return measure_cpu_peak(step, model, x, host).peak_bytes, opt


def predicted_peak(name: str | Callable[..., torch.optim.Optimizer]) -> int:
    torch.manual_seed(0)
    model, x = wide(), torch.randn(4, DIM)
    return estimate(model, x, optimizer=name, loss_fn=lambda m, b: loss_fn(m(b)), device="cpu",
                    steps=2).peak_bytes


# -- exactness --------------------------------------------------------------------------------

def test_foreach_and_offload_are_bit_exact_fused_within_ulps() -> None:
    ref = train(small, "adamw", impl="for-loop")
    # Same arithmetic per element, only batched differently: bit-identical.
    assert torch.equal(train(small, "adamw", impl="foreach"), ref)
    # Offload runs the same for-loop update on host copies (here the same device): identical.
    assert torch.equal(train(small, "adamw", impl="for-loop", offload_states=True), ref)
    # The fused kernel fuses the update into one expression (different rounding of
    # intermediates): within a few fp32 ulps of weights of size ~0.1 after 5 steps.
    torch.testing.assert_close(train(small, "adamw", impl="fused"), ref, rtol=0, atol=1e-7)


def test_adafactor_implementations_agree() -> None:
    a = train(small, "adafactor", impl="for-loop")
    b = train(small, "adafactor", impl="foreach")
    torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
    assert not torch.equal(a, initial(small))  # it trained


@pytest.mark.skipif(not HAS_8BIT, reason="needs bitsandbytes or torchao")
@pytest.mark.parametrize("backend", ["bitsandbytes", "torchao"])
def test_8bit_update_within_tolerance(backend: str) -> None:
    if importlib.util.find_spec(backend) is None:
        pytest.skip(f"{backend} not installed")
    init = initial(square)
    u32 = train(square, "adamw", impl="for-loop") - init
    u8 = train(square, "adamw-8bit", backend_8bit=backend) - init
    # 8-bit blockwise dynamic quantization keeps states to ~1% relative error (256 levels per
    # block, scaled by the block's absmax); the summed update of 5 steps stays within 5% (L2).
    rel = ((u8 - u32).norm() / u32.norm()).item()
    assert rel < 0.05, rel
    assert not torch.equal(u8, u32)  # really a different optimizer


def test_offload_works_with_schedulers_and_state_dicts() -> None:
    torch.manual_seed(0)
    model = small()
    opt = make_optimizer(model.parameters(), "adamw", offload_states=True, lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        loss_fn(model(torch.randn(2, 128))).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025)  # 0.1 * 0.5^2, seen by the inner
    again = make_optimizer(model.parameters(), "adamw", offload_states=True)
    again.load_state_dict(opt.state_dict())
    assert int(again.state_dict()["state"][0]["step"]) == 2


# -- measured effect --------------------------------------------------------------------------

def test_foreach_costs_temporaries_fused_saves_them() -> None:
    loop, _ = real_peak("adamw", impl="for-loop")
    foreach, _ = real_peak("adamw", impl="foreach")
    fused, _ = real_peak("adamw", impl="fused")
    # foreach holds AdamW's denominator sqrt(v)/bc + eps for all parameters at once (4 B/param)
    # where the for-loop holds its temporaries for one 256x256 matrix at a time (at most ~4
    # matrix-sized fp32 tensors, 256 KiB each): foreach is higher by at least the difference.
    matrix = DIM * DIM * 4
    assert foreach - loop >= 4 * P - 4 * matrix
    # fused keeps intermediates in registers: below the for-loop by at least one matrix's
    # temporaries (256*256*4 B).
    assert loop - fused >= DIM * DIM * 4


def test_adafactor_saves_almost_all_state() -> None:
    adamw, adamw_opt = real_peak("adamw", impl="for-loop")
    ada, ada_opt = real_peak("adafactor", impl="for-loop")
    assert state_bytes(adamw_opt) >= 8 * P  # exp_avg + exp_avg_sq in fp32
    # Adafactor: one row and one column vector per matrix, (256 + 256) * 4 B each, + steps.
    assert state_bytes(ada_opt) < LAYERS * (2 * DIM * 4 + 64)
    assert adamw - ada >= 7 * P  # at least 7 of AdamW's 8 B/param of state gone from the peak


@pytest.mark.skipif(not HAS_BNB, reason="needs bitsandbytes")
def test_8bit_states_are_a_quarter() -> None:
    adamw, adamw_opt = real_peak("adamw", impl="for-loop")
    eight, eight_opt = real_peak("adamw-8bit", backend_8bit="bitsandbytes")
    # Two uint8 states (2 B/param) + one fp32 absmax per 256 values per state + 256-entry
    # quantization maps: ~2.03 B/param against AdamW's 8.
    assert state_bytes(eight_opt) <= 2.1 * P
    assert state_bytes(adamw_opt) / state_bytes(eight_opt) > 3.8
    # At the peak the saving is the 6 B/param of state minus the 8-bit step's fp32 temporaries
    # for one parameter (several 256x256x4 B copies): at least half of the 6 B/param.
    assert adamw - eight >= 3 * P


def test_offload_moves_all_state_off_the_device() -> None:
    _, opt = real_peak("adamw", offload_states=True)
    assert isinstance(opt, CPUOffloadOptimizer)
    # On this CPU-only machine host and device are both "cpu"; what is checked is that every
    # state tensor belongs to the host copies (none is shaped on the device params) and that
    # the states are the full 8 B/param.
    assert state_bytes(opt) >= 8 * P
    host_ids = {id(p) for p in opt.host_params}
    assert set(map(id, opt.state)) == host_ids


# -- predicted effect -------------------------------------------------------------------------

@pytest.mark.parametrize("impl", ["for-loop", "foreach", "fused"])
def test_estimate_predicts_impl(impl: str) -> None:
    real, _ = real_peak("adamw", impl=impl)
    pred = predicted_peak(lambda ps: make_optimizer(ps, "adamw", impl=impl))
    assert abs(pred - real) <= 0.01 * real, (pred, real)


def test_estimate_predicts_adafactor() -> None:
    real, _ = real_peak("adafactor", impl="for-loop")
    pred = predicted_peak(lambda ps: make_optimizer(ps, "adafactor", impl="for-loop"))
    assert abs(pred - real) <= 0.01 * real, (pred, real)


def test_estimate_predicts_offload_on_cpu() -> None:
    real, _ = real_peak("adamw", impl="for-loop", offload_states=True)
    pred = predicted_peak(
        lambda ps: make_optimizer(ps, "adamw", impl="for-loop", offload_states=True))
    assert abs(pred - real) <= 0.01 * real, (pred, real)


def test_estimate_predicts_offload_device_saving_and_host_memory() -> None:
    model, x = wide(), torch.randn(4, DIM)
    plain = estimate(model, x, optimizer="adamw", loss_fn=lambda m, b: loss_fn(m(b)), device="cuda")
    off = estimate(model, x, loss_fn=lambda m, b: loss_fn(m(b)), device="cuda",
                   optimizer=lambda ps: make_optimizer(ps, "adamw", offload_states=True))
    workspaces = sum(off.runtime[k] for k in off.runtime_in_allocator)
    # The device keeps weights + grads (8 B/param) and the tiny (4, 256) activations; AdamW's
    # 8 B/param of state and its step's temporaries leave it.
    assert 8 * P <= off.peak_bytes - workspaces <= 8 * P + 0.05 * P
    assert plain.peak_bytes - off.peak_bytes >= 8 * P
    # The host holds a copy of the parameters and gradients (8 B/param), the states (8 B/param)
    # and the for-loop step's temporaries, at most a few copies of one 256x256 matrix.
    one = DIM * DIM * 4
    assert 16 * P <= off.host_peak_bytes <= 16 * P + 4 * one
    # without offload the host holds only AdamW's 4-byte step counters, one per parameter
    # tensor, and foreach's 1.0 increment (Note: [optimizer step counters on the host])
    assert plain.host_peak_bytes == 4 * len(list(model.parameters())) + 4


@pytest.mark.skipif(not HAS_BNB, reason="needs bitsandbytes")
def test_estimate_predicts_8bit() -> None:
    real, _ = real_peak("adamw-8bit", backend_8bit="bitsandbytes")
    pred = predicted_peak("adamw-8bit")
    assert abs(pred - real) <= 0.01 * real, (pred, real)


# -- errors -----------------------------------------------------------------------------------

def test_bad_names_raise_memfit_errors() -> None:
    params = list(small().parameters())
    with pytest.raises(MemfitError, match="did you mean 'adamw'"):
        make_optimizer(params, "adamww")
    with pytest.raises(MemfitError, match="valid: foreach, fused, for-loop"):
        make_optimizer(params, "adamw", impl="fast")
    with pytest.raises(MemfitError, match="no fused implementation"):
        make_optimizer(params, "adafactor", impl="fused")
    with pytest.raises(MemfitError, match="no parameters"):
        make_optimizer([], "adamw")


def test_missing_8bit_backend_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    real_import = importlib.import_module

    def fake_import(name: str, package: str | None = None) -> object:
        if name.split(".")[0] in ("bitsandbytes", "torchao"):
            raise ImportError(name)
        return real_import(name, package)

    monkeypatch.setattr(importlib, "import_module", fake_import)
    with pytest.raises(MemfitError, match=r"pip install 'memfit\[bnb\]'"):
        make_optimizer(small().parameters(), "adamw-8bit")
    with pytest.raises(MemfitError, match=r"pip install 'memfit\[quant\]'"):
        make_optimizer(small().parameters(), "adamw-8bit", backend_8bit="torchao")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offload_saves_device_memory_on_cuda() -> None:
    torch.manual_seed(0)
    model, x = wide().cuda(), torch.randn(4, DIM, device="cuda")
    peaks = {}
    for offload in (False, True):
        opt = make_optimizer(model.parameters(), "adamw", offload_states=offload)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(2):
            loss_fn(model(x)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        peaks[offload] = torch.cuda.max_memory_allocated()
        del opt
    assert peaks[False] - peaks[True] >= 7 * P  # AdamW's 8 B/param left the GPU
