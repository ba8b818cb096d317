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
from torch import nn

from memfit import vocab
from memfit._compat import torch_internals
from memfit.dtypes import torch_dtype
from memfit.models.zoo import SIZES, Factory, zoo
from memfit.recipe import Recipe

__all__ = ["SIZES", "Config", "Result", "Skipped", "bf16_lstm_refused", "matrix", "run_config",
           "run_matrix", "summarize", "why_not_here", "zoo"]


# -- the matrix --------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Config:
    """One point of the matrix: a zoo family run with a :class:`memfit.Recipe` (its precision,
    optimizer, checkpointing, micro-batch and offload; the other fields at their defaults)."""

    family: str
    recipe: Recipe

    @property
    def precision(self) -> str:
        return self.recipe.precision

    @property
    def optimizer(self) -> str:
        return self.recipe.optimizer

    @property
    def checkpointing(self) -> str:
        return self.recipe.checkpointing

    @property
    def batch(self) -> int:
        return self.recipe.micro_batch

    @property
    def offload(self) -> str:
        """``"activations"`` (``apply_activation_offload``, tensors >= 64 KiB), ``"states"``
        (the optimizer's states and step on the host: ``CPUOffloadOptimizer``) or ``"none"``."""
        return ("activations" if self.recipe.offload_activations
                else "states" if self.recipe.offload_states else "none")

    @property
    def name(self) -> str:
        return (f"{self.family}/{self.precision}/{self.optimizer}/ckpt-{self.checkpointing}"
                f"/b{self.batch}" + (f"/offload-{self.offload}" if self.offload != "none"
                                     else ""))


def _config(family: str, precision: str, optimizer: str, checkpointing: str, batch: int,
            offload: str = "none") -> Config:
    return Config(family=family, recipe=Recipe(
        precision=precision, optimizer=optimizer, checkpointing=checkpointing,
        micro_batch=batch, offload_activations=offload == "activations",
        offload_states=offload == "states"))


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
        configs.append(_config(family, precision, opt, ckpt, batch))
    # Offload (predicted with host memory kept out of the device's peak): the decoder families,
    # bf16-mixed AdamW, with and without checkpointing.
    for family, ckpt, offload in itertools.product(("llama", "gpt2"), ("none", "full"),
                                                   ("activations", "states")):
        if family in names:
            configs.append(_config(family, "bf16-mixed", "adamw", ckpt, batches[0], offload))
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


OFFLOAD_MIN_BYTES = 2**16
"""The smallest activation an ``offload="activations"`` config moves, in the real run and the
trace alike."""


def _techniques(model: nn.Module, config: Config) -> Callable[[Any], torch.optim.Optimizer]:
    """Apply the config's recipe to ``model`` for the real run (checkpointing, then activation
    offload of tensors >= :data:`OFFLOAD_MIN_BYTES`:
    :func:`memfit.techniques.recipe.apply_techniques`, as :func:`memfit.trace_recipe` applies
    it to the meta copy) and return its optimizer factory: built as a user builds it (torch
    picks its implementation), its states on the host with ``offload="states"``."""
    from memfit.techniques.recipe import apply_techniques

    apply_techniques(model, config.recipe, offload_min_bytes=OFFLOAD_MIN_BYTES)
    factory = OPTIMIZERS[config.optimizer]
    if config.recipe.offload_states:
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
    from memfit.parallel.recipe import trace_recipe
    from memfit.progress import phase

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
        # The recipe traced as memfit.trace_recipe traces any recipe: its optimizer by name
        # (states on the host when offloaded), which on the traced device is the
        # implementation torch picks for the real run's user-built optimizer (Note: [torch's
        # default optimizer implementation on CUDA] in memfit.trace.optim); lr does not count.
        est = trace_recipe(meta_model, meta_inputs, config.recipe,
                           loss_fn=lambda m, b: meta_loss(m(*b)), device=device, gpu=gpu,
                           steps=steps, offload_min_bytes=OFFLOAD_MIN_BYTES,
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
