"""Technique 9, inference quantization (torchao): tolerance against fp32, measured weight bytes
and forward peak, predicted peak, QAT prepare/convert."""

from __future__ import annotations

import gc
import importlib.util

import pytest
import torch
from torch import nn

from memfit.errors import MemfitError
from memfit.profiling import measure_cpu_peak
from memfit.techniques.quant import convert_qat, prepare_qat, quantize_weights, weight_bytes
from memfit.trace import estimate

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                reason="needs torchao (pip install 'memfit[quant]')")

DIM, OUT, LAYERS = 512, 64, 6


def mlp(layers: int = LAYERS) -> nn.Sequential:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers - 1):
        mods += [nn.Linear(DIM, DIM), nn.GELU()]
    return nn.Sequential(*mods, nn.Linear(DIM, OUT)).eval()


def x_in() -> torch.Tensor:
    return torch.randn(8, DIM, generator=torch.Generator().manual_seed(1))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


# -- exactness (stated tolerances) -------------------------------------------------------------

def test_int8_error_within_rounding_bound() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(DIM, DIM)
    x = x_in()
    with torch.no_grad():
        expected = layer(x)
        absmax = layer.weight.abs().amax(dim=1)  # per output row
        quantize_weights(layer, "int8")
        got = layer(x)
    # Symmetric per-row int8: each weight is rounded to a multiple of absmax/127.5, off by at
    # most half a step; so |dy_j| <= sum_i |x_i| * absmax_j / 255 (bound uses 254: looser).
    bound = x.abs().sum(dim=1, keepdim=True) * (absmax / 254)[None, :] + 1e-5
    assert ((got - expected).abs() <= bound).all()
    assert not torch.equal(got, expected)


def test_int8_model_within_half_percent() -> None:
    model, x = mlp(), x_in()
    with torch.no_grad():
        expected = model(x)
        got = quantize_weights(model, "int8")(x)
    # Uniform-initialised weights: absmax = sqrt(3) * rms, rounding error rms = step / sqrt(12)
    # = absmax / (127.5 * sqrt(12)): 0.39% of the weights' rms per layer, ~sqrt(6) x that after
    # 6 layers (~1%) at most, less through the GELUs.
    assert 0 < rel_err(got, expected) < 0.01


def test_qat_convert_reproduces_the_fake_quantized_model() -> None:
    model, x = mlp(3), x_in()
    with torch.no_grad():
        expected = model(x)
    prepare_qat(model, "int8-dynact-int4-weight", group_size=32)
    fake = model(x)
    fake.pow(2).mean().backward()  # trains: gradients reach the float weights
    assert model[0].weight.grad is not None
    convert_qat(model, "int8-dynact-int4-weight", group_size=32)
    with torch.no_grad():
        real = model(x)
    # The converted layers compute from the same integers and scales the fake quantizers used.
    torch.testing.assert_close(real, fake.detach(), rtol=0, atol=1e-5)
    # int4 (16 levels, step absmax/7.5) on uniform weights: 1/15 = 6.7% rms error per layer,
    # ~11.5% after 3 layers; int8 activations add ~0.4% per layer.
    assert 0.05 < rel_err(real, expected) < 0.2


def test_qat_weight_only_scheme() -> None:
    model, x = mlp(2), x_in()
    prepare_qat(model, "int4-weight", group_size=32)
    fake = model(x).detach()
    convert_qat(model, "int4-weight", group_size=32)
    with torch.no_grad():
        torch.testing.assert_close(model(x), fake, rtol=0, atol=1e-5)


# -- measured effect --------------------------------------------------------------------------

N_WEIGHTS = (LAYERS - 1) * DIM * DIM + DIM * OUT
N_ROWS = (LAYERS - 1) * DIM + OUT


def resident(quantize: bool) -> tuple[int, nn.Module]:
    """Bytes the model holds after building (and quantizing) it, from allocator events."""
    gc.collect()  # garbage of earlier tests freed inside the measurement would count
    measured = measure_cpu_peak(lambda: quantize_weights(mlp(), "int8") if quantize else mlp())
    return measured.end_delta_bytes, measured.result


def test_int8_weights_are_a_quarter() -> None:
    fp32, _ = resident(False)
    int8, model = resident(True)
    assert fp32 == (N_WEIGHTS + N_ROWS) * 4  # weights + biases
    # int8 values + per row an fp32 scale and an int8 zero point; biases stay fp32.
    assert int8 == N_WEIGHTS + N_ROWS * (4 + 1) + N_ROWS * 4
    assert weight_bytes(model) == int8
    assert (N_WEIGHTS * 4) / (int8 - N_ROWS * 4) > 3.9


def test_int8_forward_peak_is_lower() -> None:
    x = x_in()
    peaks = {}
    for quantize in (False, True):
        held, model = resident(quantize)
        gc.collect()
        with torch.no_grad():
            peaks[quantize] = held + measure_cpu_peak(lambda m=model: m(x), x).peak_bytes
    # 3 B saved per weight; torchao's CPU int8 weight-only matmul dequantizes one layer's
    # weight to fp32 at a time (1 MiB for 512x512) and the fp32 run has no such temporary.
    assert peaks[False] - peaks[True] >= 3 * N_WEIGHTS - DIM * DIM * 4 - 64 * 1024


# -- predicted effect -------------------------------------------------------------------------

def test_estimate_predicts_int8_inference() -> None:
    held, model = resident(True)
    x = x_in()
    gc.collect()
    with torch.no_grad():
        real = held + measure_cpu_peak(lambda: model(x), x).peak_bytes
    est = estimate(model, x, optimizer=None, device="cpu")
    assert abs(est.peak_bytes - real) <= 0.01 * real, (est.peak_bytes, real)


@pytest.mark.parametrize("scheme", ["int8-dynact-int4-weight", "int4-weight"])
def test_qat_training_step_costs_memory_and_estimate_predicts_it(scheme: str) -> None:
    # QAT trains through fake-quantized weights (and activations): each linear's forward makes a
    # quantize-dequantize copy of its weight that autograd keeps, so a step peaks higher than
    # plain fp32 training. The trace engine must see those temporaries.
    def step_peak(qat: bool) -> tuple[int, int]:
        torch.manual_seed(0)
        model = mlp(3).train()
        if qat:
            prepare_qat(model, scheme, group_size=32)
        x = torch.randn(64, DIM)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step() -> None:
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        step()
        gc.collect()
        real = measure_cpu_peak(step, model, x).peak_bytes
        est = estimate(model, x, optimizer="sgd", loss_fn=lambda m, b: m(b).pow(2).mean(),
                       device="cpu", steps=2)
        return real, est.peak_bytes

    plain, _ = step_peak(False)
    real, pred = step_peak(True)
    # the fake-quantized fp32 copy of each 512x512 weight is saved for backward (F.linear keeps
    # the weight it multiplied by to compute the input gradient)
    assert real - plain >= 2 * DIM * DIM * 4
    # the trace engine's 1% target; the prediction is 0.10% above the measurement for both
    # schemes. (This test allowed 2% while the measurement drifted with the process's history:
    # Python's cycle collector freeing torchao's garbage mid-step, and stale allocator frees.
    # measure_cpu_peak now pauses the collector and drops those frees.)
    assert abs(pred - real) <= 0.01 * real, (pred, real)


# -- errors and GPU ---------------------------------------------------------------------------

def test_errors() -> None:
    with pytest.raises(MemfitError, match="needs the model on a CUDA GPU"):
        quantize_weights(mlp(2), "int4")
    with pytest.raises(MemfitError, match="did you mean 'int8'"):
        quantize_weights(mlp(2), "int9")
    with pytest.raises(MemfitError, match="power of two"):
        prepare_qat(mlp(2), group_size=48)
    with pytest.raises(MemfitError, match="valid: int8-dynact-int4-weight, int4-weight"):
        prepare_qat(mlp(2), "int2")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_int4_on_cuda() -> None:
    model = mlp().to("cuda", torch.bfloat16)
    x = x_in().to("cuda", torch.bfloat16)
    with torch.no_grad():
        expected = model(x).float()
        before = weight_bytes(model)
        quantize_weights(model, "int4", group_size=128)
        got = model(x).float()
    assert before == 2 * ((LAYERS - 1) * (DIM * DIM + DIM) + DIM * OUT + OUT)  # bf16
    # torchao's tinygemm layout (int4_tile_packed_to_4d_tensor.py, from_hp) pads in_features to
    # a multiple of 1024 (out_features to 8) before packing two 4-bit values per byte, and keeps
    # a bf16 scale and zero point per 128 weights of the padded row; biases stay bf16. With
    # in_features 512 the padding doubles the packed bytes (measured on an H100, torch 2.11,
    # torchao 0.17: 1,432,704 B, this count exactly).
    k = -(-DIM // 1024) * 1024

    def int4(out: int) -> int:
        return out * k // 2 + (k // 128) * out * 2 * 2 + 2 * out
    assert weight_bytes(model) == (LAYERS - 1) * int4(DIM) + int4(OUT)
    assert rel_err(got, expected) < 0.2


def test_missing_torchao_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    real_import = importlib.import_module

    def fake_import(name: str, package: str | None = None) -> object:
        if name.startswith("torchao"):
            raise ImportError(name)
        return real_import(name, package)

    monkeypatch.setattr(importlib, "import_module", fake_import)
    with pytest.raises(MemfitError, match=r"pip install 'memfit\[quant\]'"):
        quantize_weights(mlp(2), "int8")
