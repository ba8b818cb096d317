"""Every memory technique on one small GPT-style model: peak memory and step time vs a baseline.

    python bench/techniques.py [--device cpu|cuda] [--steps 3] [--quick] [--out PATH]

One training step (forward, loss, backward, optimizer step, ``zero_grad(set_to_none=True)``) of
memfit's builtin Llama-style decoder, built fresh for every row, with one technique applied the
way a user applies it (``memfit.techniques``). Each row is measured in the same run as the
baseline (fp32 parameters, AdamW with torch's default implementation for the device, SDPA
attention) and reported relative to it.

- Peak memory. CPU: PyTorch profiler allocator events (``memfit.profiling.cpu.measure_cpu_peak``):
  the bytes the setup (build, technique, optimizer, one warm-up step) left allocated, measured by
  the same events, plus the inputs, plus the peak of one steady-state step above that. Counting
  the setup by its allocator events rather than by walking the model and optimizer catches what a
  walk misses (master-weight copies, host copies of an offloaded optimizer, bitsandbytes'
  quantization states); the walk (``live_bytes``) is recorded next to it as a cross-check.
  CUDA: ``torch.cuda.max_memory_allocated`` over one steady-state step after
  ``reset_peak_memory_stats`` (everything on the device).
- Step time: the median of ``--steps`` timed steps after the warm-up and the measured step
  (``time.perf_counter``; ``torch.cuda.synchronize`` around each step on CUDA). On the CPU each
  timed step follows one step of the (still built) baseline, and "vs base" is the median of the
  pairs' ratios; one intra-op thread by default (``--threads``): with two threads on a loaded
  2-core machine a step of the quick model took 45x longer. Process CPU times are in the JSON.
- Predicted peak: ``memfit.estimate`` (trace engine, ``steps=2``) on the same model with the same
  technique options; "n/a" with the reason when the engine cannot trace it.

Writes ``bench/results/techniques-<device>-<date>.json`` (or ``--out``) with the device, torch
version, command and every row. On a shared machine step times are noisy; peaks are exact.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import gc
import json
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

import memfit
from memfit.errors import MemfitError, suggest
from memfit.models.anatomy import find_blocks
from memfit.models.build import build_model, example_inputs
from memfit.models.spec import TransformerSpec
from memfit.profiling.cpu import live_bytes, measure_cpu_peak
from memfit.techniques import (
    AccumulatedStep,
    Budget,
    MasterWeights,
    MixedPrecision,
    accumulate,
    apply_activation_checkpointing,
    apply_activation_offload,
    apply_chunked_loss,
    apply_lora,
    apply_precision,
    apply_qlora,
    make_optimizer,
    set_attn_implementation,
    split_batch,
)
from memfit.techniques.block_profile import predict_activation_bytes, profile_blocks

DEVICES = ("cpu", "cuda")
# torch's own default AdamW implementation per device: the baseline uses it, explicitly.
DEFAULT_IMPL = {"cpu": "for-loop", "cuda": "foreach"}
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
BUDGET_FRACTION = 0.5  # Budget(bytes) at this fraction of the baseline's activation peak


@dataclass(frozen=True, kw_only=True)
class Sizes:
    """The model and batch of a run."""

    hidden: int
    layers: int
    heads: int
    vocab: int
    batch: int
    seq: int
    chunk: int
    """Chunked cross-entropy: tokens per chunk."""

    def spec(self) -> TransformerSpec:
        # Llama-style: RMSNorm, RoPE, SwiGLU MLP at ~8/3 of the width rounded to 64, untied head.
        return TransformerSpec(
            name="bench-gpt", family="llama", arch="decoder", hidden_size=self.hidden,
            num_layers=self.layers, num_heads=self.heads, num_kv_heads=self.heads,
            head_dim=self.hidden // self.heads,
            intermediate_size=-(-self.hidden * 8 // 3 // 64) * 64, vocab_size=self.vocab,
            max_position_embeddings=self.seq)


SIZES = {
    # 10.5 M parameters, 1024 tokens a step: the whole table in ~2-3 minutes on one CPU thread.
    # Eight layers so that the blocks' activations (which checkpointing can drop) outweigh the
    # head's and the loss's (which it cannot): a 50% budget then leaves some blocks alone.
    "cpu": Sizes(hidden=256, layers=8, heads=4, vocab=8000, batch=4, seq=256, chunk=256),
    # The example model: ~58 M parameters, 2048 tokens a step.
    "cuda": Sizes(hidden=512, layers=8, heads=8, vocab=32000, batch=4, seq=512, chunk=512),
    # --quick (the smoke test): seconds in total.
    "quick": Sizes(hidden=64, layers=2, heads=4, vocab=512, batch=4, seq=128, chunk=128),
}


class NotApplicable(Exception):
    """The technique cannot run here; the message says why (and how to enable it)."""


@dataclass
class Context:
    """What every row shares: the device, the model's shape and one batch of inputs."""

    device: str
    sizes: Sizes
    spec: TransformerSpec
    inputs: dict[str, torch.Tensor]
    budget_bytes: int = 0
    budget_note: str = ""

    def fresh(self, attn_implementation: str | None = None) -> nn.Module:
        torch.manual_seed(0)  # every row starts from the same weights
        return build_model(self.spec, backend="builtin", device=self.device,
                           attn_implementation=attn_implementation)

    def adamw(self, params: Any, impl: str | None = None) -> torch.optim.Optimizer:
        return make_optimizer(params, "adamw", impl=impl or DEFAULT_IMPL[self.device])


@dataclass
class Setup:
    """One row's model, ready to train: ``step()`` runs one training step."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    step: Callable[[], bool]
    """Runs one step; returns whether the parameters were updated (fp16 may skip a step)."""
    predict: Callable[[], int]
    """The trace engine's predicted peak in bytes (raises when it cannot trace the row)."""
    note: str = ""


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, mp: MixedPrecision,
                inputs: dict[str, torch.Tensor]) -> Callable[[], bool]:
    def step() -> bool:
        with mp.autocast():
            loss = model(**inputs)
        mp.backward(loss)
        del loss
        updated = mp.step(opt)
        opt.zero_grad(set_to_none=True)
        return updated
    return step


def _estimate(ctx: Context, model: nn.Module, inputs: Any, optimizer: Any,
              precision: str = "fp32") -> Callable[[], int]:
    def predict() -> int:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the engine's "assumed ..." notes
            est = memfit.estimate(model, inputs, optimizer=optimizer, precision=precision,
                                  device=ctx.device, steps=2)
        return est.peak_bytes
    return predict


def _standard(ctx: Context, model: nn.Module, *, precision: str = "fp32",
              master_weights: bool = False,
              optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
              est_optimizer: Any = None, note: str = "", init_scale: float = 2.0**16) -> Setup:
    """The plain training loop around ``model`` with ``precision`` and ``optimizer``."""
    factory = optimizer or ctx.adamw
    mp = apply_precision(model, precision, master_weights=master_weights,
                         device_type=ctx.device, init_scale=init_scale)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = mp.wrap_optimizer(factory(trainable))
    # The engine takes the mixed precisions by name; a pure-bf16 model is traced as it is.
    est_precision = precision if precision.endswith("-mixed") else "fp32"
    if est_optimizer is None:
        est_optimizer = ((lambda ps: MasterWeights(factory(ps))) if master_weights
                         else factory)
    return Setup(model=model, optimizer=opt, step=_train_step(model, opt, mp, ctx.inputs),
                 predict=_estimate(ctx, model, ctx.inputs, est_optimizer, est_precision),
                 note=note)


# -- the rows: one function per technique, applied in the documented order ---------------------

def baseline(ctx: Context) -> Setup:
    return _standard(ctx, ctx.fresh(), note=f"fp32, AdamW impl={DEFAULT_IMPL[ctx.device]}, SDPA")


def bf16_mixed(ctx: Context) -> Setup:
    return _standard(ctx, ctx.fresh(), precision="bf16-mixed")


def fp16_mixed(ctx: Context) -> Setup:
    # A first loss scale of 2**8: with GradScaler's 2**16 the first steps of a fresh model can
    # overflow and be skipped, and a skipped step creates no optimizer state.
    return _standard(ctx, ctx.fresh(), precision="fp16-mixed", init_scale=2.0**8,
                     note="GradScaler, init_scale 2**8")


def bf16_pure(ctx: Context) -> Setup:
    return _standard(ctx, ctx.fresh(), precision="bf16", note="model.to(bf16), bf16 AdamW states")


def bf16_master(ctx: Context) -> Setup:
    return _standard(ctx, ctx.fresh(), precision="bf16", master_weights=True,
                     note="bf16 model, fp32 master weights and states")


def checkpoint_full(ctx: Context) -> Setup:
    model = ctx.fresh()
    plan = apply_activation_checkpointing(model, "full")
    return _standard(ctx, model, note=plan.summary().removeprefix("activation checkpointing: "))


def checkpoint_selective(ctx: Context) -> Setup:
    model = ctx.fresh()
    plan = apply_activation_checkpointing(model, "selective")
    return _standard(ctx, model, note=plan.summary().removeprefix("activation checkpointing: "))


def checkpoint_budget(ctx: Context) -> Setup:
    model = ctx.fresh()
    plan = apply_activation_checkpointing(model, Budget(ctx.budget_bytes), inputs=ctx.inputs)
    full = sum(m == "full" for m in plan.modes)
    sel = sum(m == "selective" for m in plan.modes)
    return _standard(ctx, model, note=f"{ctx.budget_note}: {full} full + {sel} selective of "
                                      f"{len(plan.modes)} blocks")


def activation_offload(ctx: Context) -> Setup:
    if ctx.device != "cuda":
        raise NotApplicable("host is the device (CPU tensors are not moved)")
    model = ctx.fresh()
    apply_activation_offload(model, min_bytes=2**16)
    return _standard(ctx, model, note="saved tensors >= 64 KiB to pinned host memory, streams")


def _eight_bit(params: Any) -> torch.optim.Optimizer:
    try:
        return make_optimizer(params, "adamw-8bit")
    except MemfitError as exc:
        raise NotApplicable(f"pip install 'memfit[bnb]' ({exc})") from None


def _eight_bit_backend() -> str:
    """The 8-bit optimizer's package; raises NotApplicable early, before a model is built."""
    return type(_eight_bit([nn.Parameter(torch.zeros(1))])).__module__.split(".")[0]


def adamw_8bit(ctx: Context) -> Setup:
    backend = _eight_bit_backend()
    return _standard(ctx, ctx.fresh(), optimizer=_eight_bit, est_optimizer="adamw-8bit",
                     note=f"{backend}; predicted with optimizer='adamw-8bit'")


def adafactor(ctx: Context) -> Setup:
    impl = DEFAULT_IMPL[ctx.device]
    return _standard(ctx, ctx.fresh(),
                     optimizer=lambda ps: make_optimizer(ps, "adafactor", impl=impl))


def optimizer_offload(ctx: Context) -> Setup:
    def factory(ps: list[nn.Parameter]) -> torch.optim.Optimizer:
        return make_optimizer(ps, "adamw", impl="for-loop", offload_states=True)
    note = ("AdamW states and step on the host" if ctx.device == "cuda" else
            "host is the device: adds a host copy of params + grads, saves nothing")
    return _standard(ctx, ctx.fresh(), optimizer=factory, note=note)


def adamw_foreach(ctx: Context) -> Setup:
    return _standard(ctx, ctx.fresh(), optimizer=lambda ps: ctx.adamw(ps, "foreach"))


def adamw_fused(ctx: Context) -> Setup:
    return _standard(ctx, ctx.fresh(), optimizer=lambda ps: ctx.adamw(ps, "fused"))


MICRO_BATCH = 1


def _tokens(batch: dict[str, torch.Tensor]) -> int:
    # Labels are shifted inside the model (the first of each row is never predicted) and the
    # bench's labels contain no ignore_index, so the count is known from the shape alone (the
    # trace engine's fake tensors have no values to count).
    b, s = batch["labels"].shape
    return b * (s - 1)


def _mean_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch)  # the model returns the mean over its tokens (_tokens counts them)


def grad_accumulation(ctx: Context) -> Setup:
    model = ctx.fresh()
    opt = ctx.adamw([p for p in model.parameters() if p.requires_grad])
    parts = split_batch(ctx.inputs, MICRO_BATCH)  # views of the batch: no extra memory

    def step() -> bool:
        accumulate(model, parts, _mean_loss, count_fn=_tokens, optimizer=opt)
        return True

    k = ctx.sizes.batch // MICRO_BATCH
    wrapped = AccumulatedStep(model, k, _mean_loss, count_fn=_tokens)
    return Setup(model=model, optimizer=opt, step=step,
                 predict=_estimate(ctx, wrapped, (ctx.inputs,), ctx.adamw),
                 note=f"{k} micro-batches of {MICRO_BATCH}")


def chunked_loss(ctx: Context) -> Setup:
    model = apply_chunked_loss(ctx.fresh(), chunk_size=ctx.sizes.chunk)
    return _standard(ctx, model, note=f"{ctx.sizes.chunk} tokens per chunk")


def eager_attention(ctx: Context) -> Setup:
    model = set_attn_implementation(ctx.fresh(), "eager")
    return _standard(ctx, model, note="baseline is SDPA: this row shows what SDPA saves")


def lora(ctx: Context) -> Setup:
    model = apply_lora(ctx.fresh(), rank=16, alpha=32, targets=LORA_TARGETS)
    return _standard(ctx, model, note="r=16 on q,k,v,o; base frozen")


def qlora(ctx: Context) -> Setup:
    try:
        model = apply_qlora(ctx.fresh(), rank=16, alpha=32, targets=LORA_TARGETS)
    except MemfitError as exc:
        raise NotApplicable(f"pip install 'memfit[bnb]' ({exc})") from None
    base = next(m.base for m in model.modules() if hasattr(m, "base"))
    return _standard(ctx, model, note=f"r=16 on q,k,v,o; NF4 base ({type(base).__name__})")


def composed(ctx: Context) -> Setup:
    backend = _eight_bit_backend()
    # Note: [composition order] in memfit.techniques: loss, then checkpointing, then the
    # optimizer, then the precision around the loop.
    model = apply_chunked_loss(ctx.fresh(), chunk_size=ctx.sizes.chunk)
    apply_activation_checkpointing(model, "full")
    return _standard(ctx, model, precision="bf16-mixed", optimizer=_eight_bit,
                     est_optimizer="adamw-8bit",
                     note=f"full checkpointing, {ctx.sizes.chunk}-token chunks, {backend}")


@dataclass(frozen=True)
class Row:
    key: str
    label: str
    build: Callable[[Context], Setup]


ROWS = (
    Row("baseline", "baseline (fp32 AdamW)", baseline),
    Row("bf16-mixed", "bf16-mixed (autocast)", bf16_mixed),
    Row("fp16-mixed", "fp16-mixed + GradScaler", fp16_mixed),
    Row("bf16", "pure bf16", bf16_pure),
    Row("bf16-master", "pure bf16 + fp32 master weights", bf16_master),
    Row("ckpt-full", "checkpointing: full", checkpoint_full),
    Row("ckpt-selective", "checkpointing: selective", checkpoint_selective),
    Row("ckpt-budget", "checkpointing: Budget(50% act.)", checkpoint_budget),
    Row("act-offload", "activation offload", activation_offload),
    Row("adamw-8bit", "8-bit AdamW", adamw_8bit),
    Row("adafactor", "Adafactor", adafactor),
    Row("optim-offload", "optimizer-state CPU offload", optimizer_offload),
    Row("adamw-foreach", "AdamW foreach", adamw_foreach),
    Row("adamw-fused", "AdamW fused", adamw_fused),
    Row("grad-accum", "grad accumulation (1 x 4)", grad_accumulation),
    Row("chunked-ce", "chunked cross-entropy", chunked_loss),
    Row("eager-attn", "eager attention (vs SDPA)", eager_attention),
    Row("lora", "LoRA r=16 (q,k,v,o)", lora),
    Row("qlora", "QLoRA r=16 (q,k,v,o)", qlora),
    Row("composed", "bf16-mixed+ckpt+chunked+8bit", composed),
)


# -- measuring ----------------------------------------------------------------------------------

@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. offload's "nothing to gain on the CPU"
        yield


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _release(device: str) -> None:
    gc.collect()
    if device == "cpu":
        # Note: [frozen heap]: what survived is alive, and later collections skip it. Not on
        # CUDA: a frozen row's reference cycles (hooks, closures) would never be collected, and
        # their device blocks would count in every later row's max_memory_allocated (the H100
        # run of 2026-11-27 had ~0.55 GiB of earlier rows alive from the offload row on).
        gc.freeze()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


@dataclass
class Measured:
    peak_bytes: int
    step_seconds: float
    step_cpu_seconds: float
    """Process CPU time of the same steps (steadier than wall time on a shared machine)."""
    alive_bytes: int
    """Bytes alive before the measured step (setup's allocator events + inputs on CPU)."""
    alive_walk_bytes: int
    """The same, counted by walking model, inputs and optimizer (a cross-check)."""
    updated: list[bool] = field(default_factory=list)
    time_rel: float | None = None
    """Median of (step / the baseline step just before it), when paired with the baseline."""
    cpu_time_rel: float | None = None
    leftover_bytes: int = 0
    """CUDA: bytes allocated before the row was built (the inputs, unless an earlier row
    leaked)."""


def _timed(step: Callable[[], bool], device: str) -> tuple[float, float, bool]:
    """Wall and process CPU seconds of one step, and whether it updated the parameters."""
    _sync(device)
    start, cpu_start = time.perf_counter(), time.process_time()
    updated = step()
    _sync(device)
    return time.perf_counter() - start, time.process_time() - cpu_start, updated


def measure(ctx: Context, build: Callable[[Context], Setup], steps: int,
            reference: Setup | None = None) -> tuple[Setup, Measured]:
    """Build, warm up once, measure one step's peak, then time ``steps`` steps.

    With ``reference`` (the baseline, on the CPU) each timed step follows one baseline step and
    the time relative to the baseline is the median of the pairs' ratios: on a shared machine
    the load changes from row to row, much less from one step to the next."""
    input_bytes = live_bytes(ctx.inputs) if ctx.device == "cpu" else 0
    _release(ctx.device)
    if ctx.device == "cpu":
        def setup_and_warm_up() -> tuple[Setup, bool]:
            setup = build(ctx)
            updated = setup.step()
            gc.collect()  # garbage cycles freed inside the window, not during the step
            return setup, updated
        made = measure_cpu_peak(setup_and_warm_up)
        setup, warm = made.result
        alive = input_bytes + made.end_delta_bytes
        del made
        gc.collect()
        run = measure_cpu_peak(setup.step)
        peak, updated = alive + run.peak_delta_bytes, [warm, run.result]
    else:
        leftover = torch.cuda.memory_allocated()  # the inputs alone, unless earlier rows leak
        setup = build(ctx)
        updated = [setup.step()]
        _release(ctx.device)
        alive = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        updated.append(setup.step())
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    walk = live_bytes(setup.model, ctx.inputs, setup.optimizer)
    times, cpu_times, ratios, cpu_ratios = [], [], [], []
    for _ in range(steps):
        ref = _timed(reference.step, ctx.device) if reference is not None else None
        wall, cpu, ok = _timed(setup.step, ctx.device)
        times.append(wall)
        cpu_times.append(cpu)
        updated.append(ok)
        if ref is not None:
            ratios.append(wall / ref[0])
            cpu_ratios.append(cpu / max(ref[1], 1e-9))
    return setup, Measured(
        peak_bytes=peak, step_seconds=statistics.median(times),
        step_cpu_seconds=statistics.median(cpu_times), alive_bytes=alive, alive_walk_bytes=walk,
        updated=updated, time_rel=statistics.median(ratios) if ratios else None,
        cpu_time_rel=statistics.median(cpu_ratios) if cpu_ratios else None,
        leftover_bytes=leftover if ctx.device == "cuda" else 0)


def _budget(ctx: Context) -> tuple[int, str]:
    """``BUDGET_FRACTION`` of the baseline's activation peak in Budget's own accounting (see
    Note: [budget accounting] in memfit.techniques.checkpointing), raised to halfway between the
    floor and the baseline if full checkpointing cannot reach it (the head and loss stay)."""
    model = ctx.fresh()
    profiles = profile_blocks(model, find_blocks(model), ctx.inputs)
    none = predict_activation_bytes(profiles, [None] * len(profiles))
    floor = predict_activation_bytes(profiles, ["full"] * len(profiles))
    target = int(BUDGET_FRACTION * none)
    if target >= floor:
        return target, f"budget {target / 2**20:.1f} MiB = 50% of {none / 2**20:.1f} MiB"
    target = (floor + none) // 2
    return target, (f"budget {target / 2**20:.1f} MiB (50% of {none / 2**20:.1f} MiB is below "
                    f"the full-checkpointing floor {floor / 2**20:.1f} MiB)")


def _mib(n: int | None) -> str:
    return "" if n is None else f"{n / 2**20:.1f} MiB"


def run_rows(ctx: Context, rows: Sequence[Row], steps: int, log: Callable[[str], None]
             ) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    base: Measured | None = None
    # On the CPU the baseline stays built and its steps are interleaved with each row's (see
    # measure); that costs no measured memory there (peaks are allocator deltas). On CUDA the
    # peak is absolute, so the baseline is freed and step times are compared as they are.
    reference: Setup | None = None
    for row in rows:
        entry: dict[str, Any] = {"key": row.key, "technique": row.label}
        started = time.perf_counter()
        try:
            with _quiet():
                setup, m = measure(ctx, row.build, steps, reference)
        except NotApplicable as exc:
            entry.update(status="n/a", na_reason=str(exc))
            results.append(entry)
            log(f"  {row.key}: n/a ({exc})")
            continue
        except Exception as exc:  # a technique that breaks on this machine: say so, go on
            entry.update(status="n/a", na_reason=f"failed: {type(exc).__name__}: {exc}"[:300])
            results.append(entry)
            log(f"  {row.key}: failed ({type(exc).__name__}: {exc})")
            _release(ctx.device)
            continue
        if base is None:
            base = m  # the first row is the baseline
            m.time_rel = m.cpu_time_rel = 1.0
            if ctx.device == "cpu":
                reference = setup
        try:
            predicted: int | None = setup.predict()
            predicted_na = None
        except Exception as exc:  # the engine cannot trace this one: report why
            predicted, predicted_na = None, f"{type(exc).__name__}: {exc}".split("\n")[0][:200]
        skipped = m.updated.count(False)
        note = setup.note + (f"; {skipped} of {len(m.updated)} steps skipped (inf/nan)"
                             if skipped else "")
        entry.update(
            status="ok", peak_bytes=m.peak_bytes, peak_rel=m.peak_bytes / base.peak_bytes,
            step_seconds=m.step_seconds,
            time_rel=m.time_rel or m.step_seconds / base.step_seconds,
            step_cpu_seconds=m.step_cpu_seconds,
            cpu_time_rel=m.cpu_time_rel or m.step_cpu_seconds / base.step_cpu_seconds,
            predicted_bytes=predicted,
            pred_over_measured=None if predicted is None else predicted / m.peak_bytes,
            predicted_na_reason=predicted_na, alive_bytes=m.alive_bytes,
            leftover_bytes=m.leftover_bytes, alive_walk_bytes=m.alive_walk_bytes, note=note)
        results.append(entry)
        log(f"  {row.key}: {_mib(m.peak_bytes)}, {m.step_seconds * 1e3:.0f} ms/step "
            f"({time.perf_counter() - started:.1f} s)"
            + (f", {_mib(m.leftover_bytes)} allocated before the build" if m.leftover_bytes
               else ""))
        del setup  # freed before the next row's measurement (which collects garbage first)
    return results


# -- offload on a CUDA target, predicted (the CPU cannot show it: its host is its device) --------

def _offload_variants(ctx: Context) -> list[tuple[str, nn.Module, Any]]:
    def offloaded_states(ps: list[nn.Parameter]) -> torch.optim.Optimizer:
        return make_optimizer(ps, "adamw", impl="for-loop", offload_states=True)

    act = ctx.fresh()
    apply_activation_offload(act, min_bytes=2**16)
    act_sync = ctx.fresh()
    apply_activation_offload(act_sync, min_bytes=2**16, prefetch=False)
    ckpt_act = ctx.fresh()
    apply_activation_checkpointing(ckpt_act, "full")
    apply_activation_offload(ckpt_act, min_bytes=2**16)
    both = ctx.fresh()
    apply_activation_offload(both, min_bytes=2**16)
    return [("baseline (fp32 AdamW)", ctx.fresh(), "adamw"),
            ("activation offload", act, "adamw"),
            ("activation offload, no prefetch", act_sync, "adamw"),
            ("optimizer-state CPU offload", ctx.fresh(), offloaded_states),
            ("full ckpt + activation offload", ckpt_act, "adamw"),
            ("activation + state offload", both, offloaded_states)]


def cuda_predictions(ctx: Context) -> list[dict[str, Any]]:
    """The trace engine's device and host peaks for the offload techniques on a CUDA target
    (``memfit.estimate(..., device="cuda")``): predictions, not measurements."""
    rows: list[dict[str, Any]] = []
    for label, model, optimizer in _offload_variants(ctx):
        with _quiet():
            est = memfit.estimate(model, ctx.inputs, optimizer=optimizer, device="cuda",
                                  steps=2)
        rows.append({"technique": label, "device_peak_bytes": est.peak_bytes,
                     "device_reserved_bytes": est.peak_reserved_bytes,
                     "host_peak_bytes": est.host_peak_bytes, "peak_phase": est.peak_phase})
    base = rows[0]["device_peak_bytes"]
    for r in rows:
        r["device_peak_rel"] = r["device_peak_bytes"] / base
    return rows


def format_predictions(rows: Sequence[dict[str, Any]]) -> str:
    head = (f"{'technique (CUDA target, predicted)':36} {'device peak':>12} {'vs base':>7} "
            f"{'reserved':>10} {'host peak':>10}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['technique']:36} {_mib(r['device_peak_bytes']):>12} "
                     f"{r['device_peak_rel']:7.3f} {_mib(r['device_reserved_bytes']):>10} "
                     f"{_mib(r['host_peak_bytes']):>10}")
    return "\n".join(lines)


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    head = (f"{'technique':32} {'peak':>10} {'vs base':>7} {'step ms':>8} {'vs base':>7} "
            f"{'predicted':>10} {'pred/meas':>9}  note")
    lines = [head, "-" * len(head)]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"{r['technique']:32} n/a: {r['na_reason']}")
            continue
        pred = (f"{_mib(r['predicted_bytes']):>10} {r['pred_over_measured']:9.3f}"
                if r["predicted_bytes"] is not None else f"{'n/a':>10} {'':9}")
        note = r["note"]
        if r["predicted_na_reason"]:
            note += ("; " if note else "") + f"predict: {r['predicted_na_reason'][:80]}"
        lines.append(f"{r['technique']:32} {_mib(r['peak_bytes']):>10} {r['peak_rel']:7.3f} "
                     f"{r['step_seconds'] * 1e3:8.1f} {r['time_rel']:7.3f} {pred}  {note}")
    return "\n".join(lines)


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({torch.get_num_threads()} threads)"
    return f"{platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"



def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--device", default="cpu", choices=DEVICES)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per row (median)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (the smoke test)")
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON path (default bench/results/techniques-<device>-<date>.json)")
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU intra-op threads (default 1: steady timings on a shared machine)")
    ap.add_argument("--rows", default=None,
                    help="comma-separated row keys (default: all; the baseline always runs)")
    args = ap.parse_args(argv)
    if args.threads < 1:
        raise MemfitError(f"--threads must be at least 1, got {args.threads}; e.g. --threads 1")
    if args.steps < 1:
        raise MemfitError(f"--steps must be at least 1, got {args.steps}; e.g. --steps 3")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise MemfitError("--device cuda: no CUDA device is available to this torch "
                          f"({torch.__version__}); run with --device cpu")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the bench (``argv`` as on the command line) and return the report it wrote."""
    args = parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    # Note: [frozen heap] Each row collects garbage five times (before the build, the warm-up
    # and the step are measured, so that the peaks do not depend on when the collector runs),
    # and a full collection walks every object alive: with torch, transformers and
    # bitsandbytes imported, 0.47 s each, 46 s of a 98 s --quick run (cProfile, 2-core EPYC).
    # What is alive after a collection is moved to the collector's permanent generation
    # (gc.freeze), so the next collections walk only what the rows made since; they free the
    # same garbage. unfreeze on the way out gives the caller's objects back to the collector,
    # unless the caller had frozen them itself (a test session: its freeze is left as it was).
    gc.collect()
    ours = gc.get_freeze_count() == 0
    gc.freeze()
    try:
        return _run(args, argv)
    finally:
        if ours:
            gc.unfreeze()
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace, argv: Sequence[str] | None) -> dict[str, Any]:
    rows = list(ROWS)
    if args.rows:
        keys = {r.key for r in ROWS}
        wanted = [k.strip() for k in args.rows.split(",") if k.strip()]
        unknown = [k for k in wanted if k not in keys]
        if unknown:
            raise MemfitError(f"unknown row {unknown[0]!r}{suggest(unknown[0], keys)}"
                              f"; valid: {', '.join(sorted(keys))}")
        rows = [r for r in ROWS if r.key == "baseline" or r.key in wanted]
    sizes = SIZES["quick" if args.quick else args.device]
    spec = sizes.spec()
    torch.manual_seed(0)
    inputs = example_inputs(spec, batch=sizes.batch, seq=sizes.seq, device=args.device)
    ctx = Context(device=args.device, sizes=sizes, spec=spec, inputs=inputs)
    ctx.budget_bytes, ctx.budget_note = _budget(ctx)
    params = spec.param_count()
    print(f"memfit techniques bench: {_device_name(args.device)}, torch {torch.__version__}; "
          f"Llama-style decoder {params / 1e6:.1f} M params (hidden {sizes.hidden}, "
          f"{sizes.layers} layers, {sizes.heads} heads, vocab {sizes.vocab}), batch {sizes.batch}"
          f" x seq {sizes.seq}; {args.steps} timed steps per row", flush=True)
    started = time.perf_counter()
    results = run_rows(ctx, rows, args.steps, lambda s: print(s, file=sys.stderr, flush=True))
    table = format_table(results)
    legend = ("peak: " + ("allocator events of setup + step, plus the inputs" if args.device ==
                          "cpu" else "torch.cuda.max_memory_allocated")
              + "; step ms: the row's median wall time; time vs base: "
              + ("median ratio to a baseline step run just before each timed step"
                 if args.device == "cpu" else "ratio of the medians")
              + "; predicted: memfit.estimate (trace engine, 2 steps)")
    print(table)
    print(legend)
    predictions: list[dict[str, Any]] = []
    if args.device == "cpu":
        predictions = cuda_predictions(ctx)
        print()
        print(format_predictions(predictions))
        print("predicted by memfit.estimate(..., device='cuda'): peak allocated and reserved on "
              "the device (cuBLAS workspaces included), and the host memory offload holds")
    seconds = time.perf_counter() - started
    print(f"({seconds:.0f} s in total)")
    report = {
        "what": "peak memory and step time of every memfit technique vs a baseline, same run",
        "device": args.device, "device_name": _device_name(args.device),
        "torch": torch.__version__, "python": platform.python_version(),
        "command": " ".join(["python", *sys.argv]) if argv is None
        else " ".join(["python", "bench/techniques.py", *argv]),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "model": {**dataclasses.asdict(sizes), "params": params,
                  "intermediate": spec.intermediate_size},
        "steps": args.steps, "threads": args.threads, "seconds": seconds,
        "peak_method": ("profiler allocator events (setup + step) + inputs" if args.device == "cpu"
                        else "torch.cuda.max_memory_allocated"),
        "rows": results, "table": table, "legend": legend,
        "cuda_predictions": predictions,
    }
    out = args.out or Path("bench/results") / (
        f"techniques-{args.device}{'-quick' if args.quick else ''}-{dt.date.today().isoformat()}"
        ".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    try:
        main()
    except MemfitError as exc:
        sys.exit(f"error: {exc}")
