"""Technique 8, LoRA and QLoRA: exactness at init, adapter-only gradients, measured model bytes
and step peak, predicted peak (memfit.estimate)."""

from __future__ import annotations

import gc
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from memfit.errors import MemfitError
from memfit.profiling import measure_cpu_peak
from memfit.techniques.peft import LoRALinear, apply_lora, apply_qlora, trainable_parameters
from memfit.trace import estimate

HAS_PEFT = importlib.util.find_spec("peft") is not None
HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None
HAS_TORCHAO = importlib.util.find_spec("torchao") is not None

LAYERS, DIM, OUT, RANK = 4, 512, 64, 8
P_TARGET = LAYERS * DIM * DIM  # weights that LoRA adapts / QLoRA quantizes
lora_backends = ["builtin", pytest.param("peft", marks=pytest.mark.skipif(
    not HAS_PEFT, reason="needs peft"))]
quant_backends = [
    pytest.param("bitsandbytes", marks=pytest.mark.skipif(not HAS_BNB, reason="needs bnb")),
    pytest.param("torchao", marks=pytest.mark.skipif(not HAS_TORCHAO, reason="needs torchao"))]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(DIM, DIM), nn.GELU())
                                    for _ in range(LAYERS))
        self.lm_head = nn.Linear(DIM, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(x)


def net() -> Net:
    torch.manual_seed(0)
    return Net()


def x_in() -> torch.Tensor:
    return torch.randn(8, DIM, generator=torch.Generator().manual_seed(1))


def loss_fn(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def adapter_params() -> int:
    return LAYERS * RANK * (DIM + DIM)


# -- exactness --------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", lora_backends)
def test_lora_starts_identical_and_trains_only_adapters(backend: str) -> None:
    ref = net()
    x = x_in()
    expected = ref(x)
    model = apply_lora(net(), rank=RANK, alpha=16, backend=backend)
    # B = 0 at init: base(x) + 0 is bit-identical.
    assert torch.equal(model(x), expected)
    assert trainable_parameters(model) == adapter_params()  # lm_head excluded by "all-linear"
    loss_fn(model(x)).backward()
    for name, p in model.named_parameters():
        if "lora_" in name:
            assert p.requires_grad and p.grad is not None, name
        else:
            assert not p.requires_grad and p.grad is None, name
    assert any(p.grad.abs().sum() > 0 for n, p in model.named_parameters()  # type: ignore[union-attr]
               if "lora_B" in n)


def test_builtin_lora_math() -> None:
    torch.manual_seed(0)
    base = nn.Linear(6, 5)
    layer = LoRALinear(base, 6, 5, rank=2, alpha=4.0)
    with torch.no_grad():
        layer.lora_B.weight.normal_()
    x = torch.randn(3, 6)
    want = base(x) + (x @ layer.lora_A.weight.T @ layer.lora_B.weight.T) * (4.0 / 2)
    torch.testing.assert_close(layer(x), want, rtol=1e-6, atol=1e-6)


def test_targets_by_name() -> None:
    model = apply_lora(net(), rank=RANK, targets=("layers.0.0", "lm_head"), backend="builtin")
    assert isinstance(model.layers[0][0], LoRALinear) and isinstance(model.lm_head, LoRALinear)
    assert isinstance(model.layers[1][0], nn.Linear)
    assert trainable_parameters(model) == RANK * (DIM + DIM) + RANK * (DIM + OUT)


@pytest.mark.parametrize("backend", quant_backends)
def test_qlora_within_nf4_tolerance(backend: str) -> None:
    x = x_in()
    expected = net()(x)
    model = apply_qlora(net(), rank=RANK, quant_backend=backend)
    out = model(x)
    # NF4 has 16 levels per 64-weight block: each weight is off by up to ~half a level spacing
    # of its block's absmax (~10% of |w| at worst, ~3% typical); through 4 layers the output
    # (|y| ~0.3) keeps a relative L2 error of a few percent.
    rel = ((out - expected).norm() / expected.norm()).item()
    assert 1e-4 < rel < 0.05, rel
    loss_fn(out).backward()
    assert trainable_parameters(model) == adapter_params()
    assert all((p.grad is not None) == ("lora_" in n) for n, p in model.named_parameters())


# -- measured effect --------------------------------------------------------------------------

def resident_bytes(build: Callable[[], nn.Module]) -> tuple[int, nn.Module]:
    """Bytes the built model holds, from allocator events (the fp32 weights replaced by 4-bit
    ones are allocated and freed inside the measured region, so both are seen)."""
    gc.collect()  # garbage of earlier tests freed inside the measurement would count
    measured = measure_cpu_peak(build)
    return measured.end_delta_bytes, measured.result


def step_peak(model: nn.Module, resident: int) -> int:
    x = x_in()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])

    def step() -> None:
        for _ in range(2):
            loss_fn(model(x)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    gc.collect()
    return resident + measure_cpu_peak(step, x).peak_bytes


NOT_TARGETED = (DIM * OUT + OUT + LAYERS * DIM) * 4  # lm_head and the targets' biases, fp32
ADAPTERS = adapter_params() * 4

BUILDS: dict[str, Callable[[], nn.Module]] = {
    "plain": net,
    "lora-builtin": lambda: apply_lora(net(), rank=RANK, backend="builtin"),
    "lora-peft": lambda: apply_lora(net(), rank=RANK, backend="peft"),
    "qlora-bitsandbytes": lambda: apply_qlora(net(), rank=RANK, quant_backend="bitsandbytes"),
    "qlora-torchao": lambda: apply_qlora(net(), rank=RANK, quant_backend="torchao"),
}


@dataclass(frozen=True)
class Measured:
    resident: int
    """Bytes the built model holds (:func:`resident_bytes`)."""
    model: nn.Module
    step_peak: int
    """Peak of two AdamW steps on it (:func:`step_peak`)."""


@pytest.fixture(scope="module")
def measured() -> Callable[[str], Measured]:
    """Each model of :data:`BUILDS` built and measured once, when a test first asks for it; the
    tests only read the numbers (the estimate tests trace the model after its measurement, as
    they did when each built its own). Every measurement collects garbage twice, and a full
    collection walks every object the suite has made by then (seconds, late in a run)."""
    done: dict[str, Measured] = {}

    def get(name: str) -> Measured:
        if name not in done:
            resident, model = resident_bytes(BUILDS[name])
            done[name] = Measured(resident, model, step_peak(model, resident))
        return done[name]

    return get


def test_lora_model_bytes_and_step_peak(measured: Callable[[str], Measured]) -> None:
    base, model = measured("plain"), measured("lora-builtin")
    plain, lora = base.resident, model.resident
    assert plain == P_TARGET * 4 + NOT_TARGETED
    assert lora == plain + ADAPTERS
    # Full fine-tuning holds grads + 2 AdamW states for every weight (12 B/param on top of
    # the weights); LoRA for the adapters only.
    full = base.step_peak
    adapted = model.step_peak
    assert full - adapted >= 12 * P_TARGET - 16 * adapter_params()


@pytest.mark.parametrize("backend", quant_backends)
def test_qlora_weights_are_about_an_eighth(backend: str,
                                           measured: Callable[[str], Measured]) -> None:
    lora = measured("lora-builtin").resident
    qlora = measured(f"qlora-{backend}").resident
    # NF4: 4 bits per weight + an 8-bit scale per 64 weights + an fp32 factor per 256 scales
    # (bitsandbytes' double quantization / torchao's quantized scalers): 0.5159 B/weight,
    # plus per-layer lookup tables (~1 KiB). Within 1%.
    expected = NOT_TARGETED + ADAPTERS + P_TARGET * (0.5 + 1 / 64 + 4 / (64 * 256))
    assert abs(qlora - expected) <= 0.01 * expected, (qlora, expected)
    assert lora / qlora > 5


@pytest.mark.skipif(not HAS_BNB, reason="needs bitsandbytes")
def test_qlora_step_peak_below_lora(measured: Callable[[str], Measured]) -> None:
    # The targets' weights shrink by ~3.48 B/param; the step adds dequantization temporaries
    # of about one fp32 weight at a time (<= 2 x 1 MiB here).
    saving = measured("lora-builtin").step_peak - measured("qlora-bitsandbytes").step_peak
    assert saving >= 3.48 * P_TARGET - 2 * DIM * DIM * 4, saving


# -- predicted effect -------------------------------------------------------------------------

@pytest.mark.parametrize("backend", lora_backends)
def test_estimate_predicts_lora(backend: str, measured: Callable[[str], Measured]) -> None:
    built = measured(f"lora-{backend}")
    model, real = built.model, built.step_peak
    est = estimate(model, x_in(), optimizer="adamw", loss_fn=lambda m, b: loss_fn(m(b)),
                   device="cpu", steps=2)
    assert abs(est.peak_bytes - real) <= 0.01 * real, (est.peak_bytes, real)


@pytest.mark.parametrize("backend", quant_backends)
def test_estimate_predicts_qlora(backend: str, measured: Callable[[str], Measured]) -> None:
    built = measured(f"qlora-{backend}")
    model, real = built.model, built.step_peak
    est = estimate(model, x_in(), optimizer="adamw", loss_fn=lambda m, b: loss_fn(m(b)),
                   device="cpu", steps=2)
    assert abs(est.peak_bytes - real) <= 0.01 * real, (est.peak_bytes, real)


# -- errors -----------------------------------------------------------------------------------

def test_errors() -> None:
    with pytest.raises(MemfitError, match="did you mean 'lm_head'"):
        apply_lora(net(), targets=("lm_haed",))
    with pytest.raises(MemfitError, match="rank must be a positive integer"):
        apply_lora(net(), rank=0)
    with pytest.raises(MemfitError, match="valid: auto, peft, builtin"):
        apply_lora(net(), backend="lora")
    with pytest.raises(MemfitError, match="NF4 blocks"):
        apply_qlora(nn.Sequential(nn.Linear(10, 10)), quant_backend="torchao")


def test_missing_backends_say_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    real_import = importlib.import_module

    def fake_import(name: str, package: str | None = None) -> object:
        if name.split(".")[0] in ("peft", "bitsandbytes", "torchao"):
            raise ImportError(name)
        return real_import(name, package)

    monkeypatch.setattr(importlib, "import_module", fake_import)
    with pytest.raises(MemfitError, match=r"pip install 'memfit\[peft\]'"):
        apply_lora(net(), backend="peft")
    with pytest.raises(MemfitError, match=r"pip install 'memfit\[bnb\]'"):
        apply_qlora(net())
    # auto falls back to the builtin LoRA without peft
    assert isinstance(apply_lora(net(), rank=RANK).layers[0][0], LoRALinear)
