"""Validate the trace engine against real runs: a model zoo, a config matrix, and a runner.

Each config builds a real model with random weights on the target device, runs ``steps``
training steps the way :func:`memfit.estimate` simulates them (forward + loss under autocast,
backward, ``optimizer.step()``, ``zero_grad(set_to_none=True)``), and measures the peak:

- CUDA: ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``, with the cache emptied,
  cuBLAS workspaces cleared and the peak stats reset before each config;
- CPU: the profiler's allocator events plus the bytes alive before the run
  (:func:`memfit.profiling.cpu.measure_cpu_peak`).

The same model, copied to the meta device, is then traced by :func:`memfit.estimate`, and the
two are compared. ``memfit validate`` and ``bench/validate_gpu.py`` drive it.

Why the zoo is in the library, not in ``bench/``: ``memfit validate`` is a user command. A
user who doubts a prediction runs it on their own GPU and torch version, where the published
numbers may not hold; ``bench/`` is not installed with the package, so a zoo kept there would
leave the command with nothing to run. The zoo is small (seven families, scaled by ``size``),
imports nothing beyond torch and memfit's own builders, and costs nothing until called.
``bench/validate_gpu.py`` only wraps the command to write a dated JSON under ``bench/results``.

Speed: on the CPU the real run is measured under the profiler (every allocation an event), so
a config costs seconds to minutes. The CPU default is therefore the ``tiny`` sizes and the
``quick`` matrix (one config per family, the families together covering every precision,
checkpointing, optimizer and offload kind: :func:`matrix`), a few minutes on two cores;
``memfit validate --full`` runs the whole matrix. A config the machine cannot run at all (a
bf16 LSTM where oneDNN refuses it: an AVX2-only CPU) is skipped with the reason
(:func:`why_not_here`, the probe the test suite skips with), not counted as a failure.

Known limitations: configs run one after another in one process, so CUDA's caching allocator
starts each config with an empty cache but the CUDA context and library handles already exist
(they are outside the allocator's statistics either way).
"""

from __future__ import annotations

import functools
import gc
import itertools
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memfit import vocab
from memfit._compat import torch_internals
from memfit.dtypes import torch_dtype
from memfit.errors import MemfitError

Factory = Callable[[str], tuple[nn.Module, tuple[Any, ...], Callable[[Any], torch.Tensor]]]


# -- the zoo: small, scalable versions of each model family ---------------------------------------

class ResNetBN(nn.Module):
    """A CNN with batch norm and residual blocks (ResNet-style)."""

    def __init__(self, width: int, blocks: int, classes: int = 100) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(width, width, 3, padding=1, bias=False),
                          nn.BatchNorm2d(width), nn.ReLU(),
                          nn.Conv2d(width, width, 3, padding=1, bias=False),
                          nn.BatchNorm2d(width)) for _ in range(blocks))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = F.relu(x + block(x))
        return self.head(x.mean((2, 3)))


class UNetGN(nn.Module):
    """A two-level UNet with group norm and a skip connection."""

    def __init__(self, width: int) -> None:
        super().__init__()

        def conv(cin: int, cout: int) -> nn.Module:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(8, cout),
                                 nn.SiLU())

        self.down1, self.down2 = conv(3, width), conv(width, 2 * width)
        self.pool = nn.MaxPool2d(2)
        self.up = nn.ConvTranspose2d(2 * width, width, 2, stride=2)
        self.out = nn.Sequential(conv(2 * width, width), nn.Conv2d(width, 3, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.down1(x)
        b = self.down2(self.pool(a))
        return self.out(torch.cat([a, self.up(b)], dim=1))


class LSTMNet(nn.Module):
    def __init__(self, hidden: int, layers: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(hidden, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0])


def _mse(out: Any) -> torch.Tensor:
    return out.float().pow(2).mean()


def _ce(out: Any) -> torch.Tensor:
    logits = out.float()
    return F.cross_entropy(logits, torch.zeros(logits.shape[0], dtype=torch.long,
                                               device=logits.device))


def _transformer(name: str, batch: int, seq: int | None) -> Factory:
    from memfit.models.build import build_model, example_inputs
    from memfit.models.presets import get_preset

    def make(device: str) -> tuple[nn.Module, tuple[Any, ...], Callable[[Any], torch.Tensor]]:
        spec = _SCALED[name]() if name in _SCALED else get_preset(name)
        model = build_model(spec, backend="builtin", device=device)
        inputs = example_inputs(spec, batch=batch, seq=seq, device=device)
        if "input_ids" in inputs:
            inputs["input_ids"].random_(0, spec.vocab_size)
            if "labels" in inputs:
                inputs["labels"].copy_(inputs["input_ids"])
        else:
            inputs["pixel_values"].normal_()
            inputs["labels"].zero_()
        keys = list(inputs)
        return (_KwargsModel(model, keys), tuple(inputs[k] for k in keys),
                lambda out: out if out.dim() == 0 else _mse(out))

    return make


class _KwargsModel(nn.Module):
    """Positional inputs -> keyword inputs, so every zoo model takes a tuple."""

    def __init__(self, model: nn.Module, keys: list[str]) -> None:
        super().__init__()
        self.model, self.keys = model, keys

    def forward(self, *args: torch.Tensor) -> Any:
        return self.model(**dict(zip(self.keys, args, strict=True)))


def _small_llama(layers: int, hidden: int, experts: int = 0, vocab: int = 32000) -> Any:
    from memfit.models.spec import TransformerSpec

    heads = hidden // 64
    return TransformerSpec(
        name=f"llama-{layers}x{hidden}" + (f"-moe{experts}" if experts else ""),
        family="mixtral" if experts else "llama", arch="decoder", hidden_size=hidden,
        num_layers=layers, num_heads=heads, num_kv_heads=max(heads // 4, 1), head_dim=64,
        intermediate_size=int(hidden * 8 / 3) // 64 * 64, vocab_size=vocab,
        max_position_embeddings=4096, num_experts=experts, experts_per_token=2 if experts else 0)


def _small_gpt2(layers: int, hidden: int, vocab: int = 50257) -> Any:
    from memfit.models.spec import TransformerSpec

    return TransformerSpec(
        name=f"gpt2-{layers}x{hidden}", family="gpt2", arch="decoder", hidden_size=hidden,
        num_layers=layers, num_heads=hidden // 64, num_kv_heads=hidden // 64, head_dim=64,
        intermediate_size=4 * hidden, vocab_size=vocab, max_position_embeddings=2048,
        mlp="gelu", norm="layernorm", qkv_bias=True, attn_out_bias=True, mlp_bias=True,
        position="learned", tie_embeddings=True)


def _small_vit(layers: int = 2, hidden: int = 128, image: int = 32, patch: int = 8,
               labels: int = 10) -> Any:
    from memfit.models.spec import TransformerSpec

    heads = hidden // 64
    return TransformerSpec(
        name=f"vit-{layers}x{hidden}", family="vit", arch="vision", hidden_size=hidden,
        num_layers=layers, num_heads=heads, num_kv_heads=heads, head_dim=64,
        intermediate_size=4 * hidden, mlp="gelu", norm="layernorm", qkv_bias=True,
        attn_out_bias=True, mlp_bias=True, position="learned", image_size=image,
        patch_size=patch, num_labels=labels)


_SCALED: dict[str, Callable[[], Any]] = {
    # tiny: two blocks and a 2,048-token vocabulary (the logits of a 50,257-token vocabulary
    # dominated a small CPU config's time)
    "vit-tiny": _small_vit,
    "gpt2-tiny": lambda: _small_gpt2(2, 128, vocab=2048),
    "llama-tiny": lambda: _small_llama(2, 128, vocab=2048),
    "moe-tiny": lambda: _small_llama(2, 128, experts=4, vocab=2048),
    "vit-small": _small_vit,
    "gpt2-small": lambda: _small_gpt2(4, 256),
    "gpt2-medium": lambda: _small_gpt2(12, 768),
    "vit-medium": lambda: _small_vit(12, 768, image=224, patch=16, labels=1000),  # ViT-B/16
    "llama-small": lambda: _small_llama(4, 256),
    "llama-medium": lambda: _small_llama(16, 2048),
    "moe-small": lambda: _small_llama(2, 256, experts=4),
    "moe-medium": lambda: _small_llama(8, 1024, experts=8),
}


SIZES = ("tiny", "small", "medium")


def zoo(size: str) -> dict[str, Callable[[int], Factory]]:
    """Model families by name -> ``batch -> factory``; ``size`` is "tiny" (the CPU default:
    seconds a config), "small" (CPU, tens of seconds) or "medium" (GPU: hundreds of MB to GBs,
    so the runtime constants are a small share)."""
    if size not in SIZES:
        raise MemfitError(f"unknown zoo size {size!r}; valid: {', '.join(SIZES)}")
    small = size != "medium"
    tiny = size == "tiny"
    seq = 64 if tiny else 128 if small else 1024
    img = 16 if tiny else 32 if small else 128
    width = 8 if tiny else 16 if small else 128

    def vision(make: Callable[[], nn.Module], shape: tuple[int, ...],
               loss: Callable[[Any], torch.Tensor]) -> Callable[[int], Factory]:
        def with_batch(batch: int) -> Factory:
            def factory(device: str) -> tuple[nn.Module, tuple[Any, ...],
                                              Callable[[Any], torch.Tensor]]:
                with torch.device(device):
                    return make(), (torch.randn(batch, *shape),), loss
            return factory
        return with_batch

    hidden = 32 if tiny else 64 if small else 1024
    return {
        "gpt2": lambda b: _transformer(f"gpt2-{size}", b, seq),
        "llama": lambda b: _transformer(f"llama-{size}", b, seq),
        "moe": lambda b: _transformer(f"moe-{size}", b, seq),
        "vit": lambda b: _transformer(f"vit-{size}", b, None),
        "resnet-bn": vision(lambda: ResNetBN(width, 2 if small else 6), (3, img, img), _ce),
        "unet-gn": vision(lambda: UNetGN(width), (3, img, img), _mse),
        "lstm": vision(lambda: LSTMNet(hidden, 2), (seq // 2, hidden), _mse),
    }


# -- the matrix --------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Config:
    family: str
    precision: str
    optimizer: str
    checkpointing: str
    batch: int
    offload: str = "none"
    """``"activations"`` (``apply_activation_offload``, tensors >= 64 KiB) or ``"states"``
    (the optimizer's states and step on the host: ``CPUOffloadOptimizer``)."""

    @property
    def name(self) -> str:
        return (f"{self.family}/{self.precision}/{self.optimizer}/ckpt-{self.checkpointing}"
                f"/b{self.batch}" + (f"/offload-{self.offload}" if self.offload != "none"
                                     else ""))


def matrix(size: str, *, families: list[str] | None = None, quick: bool = False
           ) -> list[Config]:
    """The validation matrix: families x precision x checkpointing x (optimizer, batch).

    Optimizer and batch vary together (adamw with the small batch, sgd-momentum with the large
    one) to keep the matrix at 2 x 2 x 2 = 8 configs per family.

    ``quick``: one config per family, the i-th family taking the i-th point of precision x
    checkpointing x (optimizer, batch), stepping by three (families without blocks to
    checkpoint step through their uncheckpointed points), and one config per offload kind:
    every value of every axis is still run, by some family, in 9 of the 56 configs.
    """
    names = families or list(zoo(size))
    if quick:
        full = matrix(size, families=names)
        picked: list[Config] = []
        for i, family in enumerate(names):
            own = [c for c in full if c.family == family and c.offload == "none"]
            plain = [c for c in own if c.checkpointing == "none"]
            points = own if len(own) == 8 else plain + plain  # no ckpt: the none half, twice
            picked.append(points[(3 * i) % len(points)] if points else own[0])
        offload = [c for c in full if c.offload != "none"]
        for kind, ckpt in (("activations", "full"), ("states", "none")):
            picked += [c for c in offload if c.offload == kind and c.checkpointing == ckpt][:1]
        return picked
    batches = (2, 4) if size != "medium" else (4, 8)
    configs = []
    for family, precision, ckpt, (opt, batch) in itertools.product(
            names, ("fp32", "bf16-mixed"), ("none", "full"),
            (("adamw", batches[0]), ("sgd-momentum", batches[1]))):
        if ckpt == "full" and family in ("lstm", "unet-gn"):
            continue  # no repeated blocks to checkpoint
        configs.append(Config(family=family, precision=precision, optimizer=opt,
                              checkpointing=ckpt, batch=batch))
    # Offload (predicted with host memory kept out of the device's peak): the decoder families,
    # bf16-mixed AdamW, with and without checkpointing.
    for family, ckpt, offload in itertools.product(("llama", "gpt2"), ("none", "full"),
                                                   ("activations", "states")):
        if family in names:
            configs.append(Config(family=family, precision="bf16-mixed", optimizer="adamw",
                                  checkpointing=ckpt, batch=batches[0], offload=offload))
    return configs


# -- the runner -----------------------------------------------------------------------------------

_CPU_OFFLOAD_NOTE = "memfit: offload_activations on CPU tensors"
"""The start of ``memfit.techniques.offload``'s warning on CPU tensors (a regex prefix)."""

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-4),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-4, momentum=0.9),
}


@dataclass(frozen=True, kw_only=True)
class Result:
    config: str
    device: str
    measured_allocated: int
    measured_reserved: int | None
    predicted_allocated: int
    predicted_reserved: int
    seconds_real: float
    seconds_trace: float

    @property
    def error_allocated(self) -> float:
        return (self.predicted_allocated - self.measured_allocated) / self.measured_allocated

    @property
    def error_reserved(self) -> float | None:
        if self.measured_reserved is None:
            return None
        return (self.predicted_reserved - self.measured_reserved) / self.measured_reserved

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["error_allocated"] = self.error_allocated
        out["error_reserved"] = self.error_reserved
        return out


def _techniques(model: nn.Module, config: Config) -> Callable[[Any], torch.optim.Optimizer]:
    """Apply the config's checkpointing and activation offload to ``model`` (in that order, as
    documented) and return its optimizer factory."""
    if config.checkpointing != "none":
        from memfit.techniques.checkpointing import apply_activation_checkpointing

        apply_activation_checkpointing(model, policy=config.checkpointing)
    if config.offload == "activations":
        from memfit.techniques.offload import apply_activation_offload

        apply_activation_offload(model, min_bytes=2**16)
    factory = OPTIMIZERS[config.optimizer]
    if config.offload == "states":
        from memfit.techniques.optim import CPUOffloadOptimizer

        return lambda ps: CPUOffloadOptimizer(ps, factory)
    return factory


def _steps(model: nn.Module, inputs: tuple[Any, ...], loss_fn: Callable[[Any], torch.Tensor],
           opt: torch.optim.Optimizer, precision: str, device: str, steps: int) -> None:
    fmt = vocab.precision(precision).autocast
    dtype = torch_dtype(fmt) if fmt else None
    for _ in range(steps):
        with torch.autocast(device, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            out = model(*inputs)
            loss = loss_fn(out)
        loss.backward()
        del loss, out
        opt.step()
        opt.zero_grad(set_to_none=True)


def _reset_cuda() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch_internals.clear_cublas_workspaces()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def _measure(config: Config, factory: Factory, device: str,
             steps: int) -> tuple[int, int | None, float]:
    """Run the config for real; the model and its state die with this frame."""
    torch.manual_seed(0)
    if device == "cuda":
        _reset_cuda()
    model, inputs, loss_fn = factory(device)
    make_optimizer = _techniques(model, config)
    start = time.perf_counter()
    if device == "cuda":
        opt = make_optimizer(list(model.parameters()))
        _steps(model, inputs, loss_fn, opt, config.precision, device, steps)
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved(),
                time.perf_counter() - start)
    from memfit.profiling.cpu import measure_cpu_peak

    def run() -> None:
        # The optimizer is built inside the measurement: what it allocates up front (the host
        # copies of an offloaded optimizer) is part of the run, as in the trace.
        opt = make_optimizer(list(model.parameters()))
        _steps(model, inputs, loss_fn, opt, config.precision, device, steps)

    peak = measure_cpu_peak(run, model, inputs)
    return peak.peak_bytes, None, time.perf_counter() - start


def run_config(config: Config, *, size: str, device: str, gpu: str | None,
               steps: int = 2) -> Result:
    """Measure one config on ``device`` for real, then trace it on a meta copy."""
    from memfit.progress import phase
    from memfit.trace import estimate

    factory = zoo(size)[config.family](config.batch)
    with warnings.catch_warnings():
        # Activation offload on the CPU is run (and traced) on purpose: its prediction is that
        # nothing moves. The technique's warning that it saves nothing there is for users who
        # apply it, not for this check.
        warnings.filterwarnings("ignore", message=_CPU_OFFLOAD_NOTE)
        phase(f"{config.name}: real run on {device}")
        measured_alloc, measured_res, real_seconds = _measure(config, factory, device, steps)
        phase(f"{config.name}: trace")
        torch.manual_seed(0)
        meta_model, meta_inputs, meta_loss = factory("meta")
        est = estimate(meta_model, meta_inputs, optimizer=_techniques(meta_model, config),
                       precision=config.precision, loss_fn=lambda m, b: meta_loss(m(*b)),
                       device=device,
                       gpu=gpu if device == "cuda" else None, steps=steps,
                       keep_output=True)  # _steps keeps ``out`` alive through backward
    return Result(config=config.name, device=device, measured_allocated=measured_alloc,
                  measured_reserved=measured_res, predicted_allocated=est.peak_bytes,
                  predicted_reserved=est.peak_reserved_bytes, seconds_real=real_seconds,
                  seconds_trace=est.trace_seconds)


@dataclass(frozen=True, kw_only=True)
class Skipped:
    """A config this machine cannot run at all, and why (found by probing: :func:`why_not_here`)."""

    config: Config
    reason: str


@functools.cache
def bf16_lstm_refused() -> str | None:
    """Why this CPU cannot train an LSTM under bf16 autocast, or None if it can.

    Probed by running one: torch routes a bf16 LSTM to oneDNN, which creates its primitive only
    where the CPU has the instructions for it (on an AVX2-only CPU, or AVX-512 limited with
    ``ONEDNN_MAX_CPU_ISA=AVX2``: "could not create a primitive descriptor"). A step that cannot
    run has no peak to compare with."""
    lstm, x = nn.LSTM(4, 4, batch_first=True), torch.randn(1, 2, 4)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = lstm(x)[0]
        out.float().sum().backward()
    except RuntimeError as exc:
        return str(exc).strip().splitlines()[0]
    return None


def why_not_here(config: Config, device: str) -> str | None:
    """Why ``config`` cannot run on this machine's ``device`` at all, or None (it can).

    The test suite skips the same cases with the same reason."""
    if (device == "cpu" and config.precision == "bf16-mixed" and config.family == "lstm"
            and (why := bf16_lstm_refused())):
        return (f"this CPU ({torch.backends.cpu.get_cpu_capability()}) cannot run a bf16 LSTM: "
                f"{why}")
    return None


def run_matrix(configs: list[Config], *, size: str, device: str, gpu: str | None,
               steps: int = 2) -> Iterator[Result | Skipped | tuple[Config, str]]:
    """Run each config; yields a Result, a :class:`Skipped` when this machine cannot run the
    config at all (:func:`why_not_here`), or (config, error message) when a config fails.

    Shows no progress itself: ``memfit validate`` wraps it in a :class:`memfit.progress.Progress`
    (each config names its phase in the active progress, if any). ``KeyboardInterrupt`` is not
    caught: results yielded before it stand."""
    for config in configs:
        if (reason := why_not_here(config, device)) is not None:
            yield Skipped(config=config, reason=reason)
            continue
        try:
            yield run_config(config, size=size, device=device, gpu=gpu, steps=steps)
        except torch.OutOfMemoryError:
            yield config, "out of memory on the real run"
        except Exception as exc:  # a failing config is reported, not fatal to the matrix
            yield config, f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        finally:
            if device == "cuda":
                _reset_cuda()


def summarize(results: list[Result]) -> dict[str, Any]:
    """Median and max absolute error, and the worst under-prediction (negative error)."""
    def stats(errors: list[float]) -> dict[str, float | None]:
        if not errors:
            return {"median_abs": None, "max_abs": None, "worst_under": None}
        ordered = sorted(abs(e) for e in errors)
        mid = len(ordered) // 2
        median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
        return {"median_abs": median, "max_abs": ordered[-1], "worst_under": min(errors)}

    return {
        "configs": len(results),
        "allocated": stats([r.error_allocated for r in results]),
        "reserved": stats([e for r in results if (e := r.error_reserved) is not None]),
    }
