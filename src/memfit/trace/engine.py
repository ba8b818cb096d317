"""Run the user's step on fake tensors that model the target device, and account every byte.

The model is never changed: a structural copy whose parameters, buffers and tensor attributes are
fake tensors on the target device (same shapes, strides and dtypes, no data) runs the real forward,
loss, backward, ``optimizer.step()`` and ``zero_grad(set_to_none=True)``, ``steps`` times. A
:class:`~memfit.trace.tracker.TrackingFakeMode` records each storage created and freed; see
``tracker.py`` for how categories are assigned and ``estimate.py`` for the result.

Note: [CUDA target on a CPU-only torch] Fake CUDA tensors cannot run autograd on a CPU-only build
(it has no CUDA device guard, and autograd aborts the process asking for one). So the CUDA step
runs on fake CPU tensors with CUDA's behaviour layered on: its autocast lists (``autocast.py``),
its attention kernels (``sdpa.py``), foreach optimizers (``optim.py``) and its caching allocator
(``allocator.py``). ``USE_FAKE_CUDA`` switches CUDA builds to fake CUDA tensors (untested yet).

Here: :func:`estimate` and the fake world a trace sets up. What a trace may be asked for and the
checks made first are in ``options.py``; the rules that make fake tensors behave as the real
step in ``fake_rules.py``; the steps themselves in ``step.py``; the result in ``result.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
import warnings
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

from memfit._compat import torch_dtensor, torch_fsdp, torch_internals
from memfit._loss import LossFn, model_loss
from memfit._tensors import call_model, fake_inputs, fake_model, tensor_leaves
from memfit.errors import MemfitError
from memfit.gpus import GpuSpec
from memfit.progress import trace_progress
from memfit.trace import foreach, host, pruning, sparse
from memfit.trace.autocast import cuda_autocast_emulation
from memfit.trace.blocks import replaying_blocks
from memfit.trace.datadep import DataDependentSizes
from memfit.trace.estimate import Estimate
from memfit.trace.fake_rules import _count_cpu_rng_states, _eager_library_paths, grouped_mm_rule
from memfit.trace.heap import with_frozen_heap
from memfit.trace.optim import OptimizerFactory, make_optimizer
from memfit.trace.options import (
    PRECISIONS,
    RankHooks,
    _compute_capability,
    _resolve_gpu,
    _runtime,
    check_request,
    check_target,
)
from memfit.trace.real_values import RealValues, record_real_values
from memfit.trace.replay import redo_without_replay
from memfit.trace.result import _result
from memfit.trace.sdpa import CudaSdpaRouting
from memfit.trace.step import _module_hooks, _register_baseline, run_steps
from memfit.trace.tracker import Tracker, TrackingFakeMode

_CUDA_BLOCK = 512  # the CUDA caching allocator rounds every request up to 512 bytes
MPS_NOTE = ("MPS target: sizes as requested (Metal's heap size and alignment per buffer, "
            "MPSAllocator's 8/32 MiB and 1 GiB heaps and MPSGraph's own buffers are not "
            "modelled); no CUDA context or BLAS workspace")
# Fake CUDA tensors (exact CUDA autocast lists) on CUDA builds of torch. Off until validated on a
# GPU machine: the CPU stand-in path (see the module note) is the one the test suite covers.
USE_FAKE_CUDA = False


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return bool(is_fake(t))


def estimate(model: nn.Module, inputs: Any, *, optimizer: str | OptimizerFactory | None = "adamw",
             precision: str = "fp32", loss_fn: LossFn | None = None,
             device: str = "cuda", gpu: str | GpuSpec | None = None, steps: int = 2,
             expandable_segments: bool = False, num_gpus: int = 1,
             keep_output: bool = False, rank: RankHooks | None = None) -> Estimate:
    """Trace ``steps`` training steps (or forward passes if ``optimizer=None``) of ``model`` on
    ``inputs`` and predict their peak memory on ``device``.

    ``loss_fn(model, batch) -> scalar`` runs the model and returns the loss (``batch`` is
    ``inputs``, as fake tensors of the same structure): e.g. ``lambda m, b: F.cross_entropy(
    m(b[0]), b[1])``. The default is the model's own loss (``model(*inputs)``, ``model(**inputs)``
    or ``model(inputs)``, then :func:`default_loss`). The old one-argument ``loss_fn(output)`` is
    refused with the rewrite.

    ``keep_output``: whether the model's output stays referenced through the backward, as in a
    loop that writes ``out = model(x); loss = crit(out, y); loss.backward()``. The default
    (False) models ``loss_fn(model, batch).backward()`` (Hugging Face Trainer, Lightning): during
    the backward only what the loss's autograd graph saved is alive, e.g. not the logits that a
    cross-entropy (which saves its log-softmax) was computed from.

    ``rank``: the hooks of one rank of a parallel layout (:class:`RankHooks`); ``memfit.parallel``
    passes them to trace each rank (``memfit.estimate(..., parallel=...)``); the engine itself
    knows nothing of parallelism.

    >>> with torch.device("meta"):
    ...     model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    >>> est = estimate(model, torch.empty(32, 1024, device="meta"), device="cpu")
    >>> est.peak_bytes > 4 * 4 * 1024 * 1024  # weights + grads + two Adam states
    True
    """
    compute_loss = check_request(model, optimizer=optimizer, precision=precision,
                                 loss_fn=loss_fn, device=device, steps=steps)
    check_target(device, gpu, precision=precision, expandable_segments=expandable_segments,
                 num_gpus=num_gpus)
    trace = functools.partial(_trace_or_redo, model, inputs, optimizer=optimizer,
                              precision=precision, compute_loss=compute_loss, device=device,
                              gpu=gpu, steps=steps, expandable_segments=expandable_segments,
                              num_gpus=num_gpus, keep_output=keep_output, rank=rank)
    if not _real_step(model, inputs):
        return trace(None)[0]
    # Note: [real values of a real step] in real_values.py: trace once; if its forward needed an
    # assumption, read the values from a real forward and trace again.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, datadep = trace(None)
    if "forward" not in datadep.assumed_in:
        for w in caught:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
        return first
    training = optimizer is not None
    autocast_dtype = PRECISIONS[precision][0]

    def run() -> None:
        with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16,
                            enabled=autocast_dtype is not None):
            if training and compute_loss is not model_loss:  # the user's loss, e.g. with labels
                compute_loss(model, inputs)
            else:  # the default loss reads the output (it needs grad, which no_grad has not)
                call_model(model, inputs)

    try:
        records = record_real_values(model, run)
    except Exception as exc:  # the assumptions stand; say why
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        for w in caught:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
        note = f"data-dependent values not read from a real forward ({first_line})"
        return dataclasses.replace(first, assumptions=(*first.assumptions, note))
    real = RealValues(records)
    est, _ = trace(real)
    if real.diverged is not None:
        note = (f"data-dependent values read from a real forward of the inputs until the trace "
                f"diverged ({real.diverged}); the assumptions above from there on")
    else:
        note = (f"data-dependent values ({len(real.records)} per forward) read from a real "
                f"forward of the given inputs (no_grad, CPU)")
    return dataclasses.replace(est, assumptions=(*est.assumptions, note),
                               trace_seconds=first.trace_seconds + est.trace_seconds)


def _real_step(model: nn.Module, inputs: Any) -> bool:
    """Whether the model's parameters and buffers and the inputs are all real CPU tensors, so
    that a real forward can answer what the fake one cannot."""
    tensors = [*model.parameters(), *model.buffers()]
    leaves = list(tensor_leaves(inputs, objects=True))
    return bool(leaves) and all(t.device.type == "cpu" and not _is_fake(t)
                                for t in (*tensors, *leaves))


def _trace_or_redo(*args: Any, **kwargs: Any) -> tuple[Estimate, DataDependentSizes]:
    """:func:`_trace`, redone without replay where a replayed block's template turned out not
    to be replayable (Note: [replaying identical blocks] in blocks.py)."""
    if kwargs.get("rank") is not None:  # a parallel rank: memfit.parallel.trace redoes it
        return _trace(*args, **kwargs)  # (in a fresh fake world, the rank's state dropped)
    return redo_without_replay(lambda: _trace(*args, **kwargs))


@with_frozen_heap  # Note: [frozen heap] in heap.py
def _trace(model: nn.Module, inputs: Any, replay: RealValues | None, *,
           optimizer: str | OptimizerFactory | None, precision: str,
           compute_loss: LossFn, device: str, gpu: str | GpuSpec | None, steps: int,
           expandable_segments: bool, num_gpus: int, keep_output: bool,
           rank: RankHooks | None = None
           ) -> tuple[Estimate, DataDependentSizes]:
    """One trace of ``steps`` steps (see :func:`estimate`); ``replay``: the data-dependent answers
    of a real forward, replayed in each forward."""
    autocast_dtype, param_dtype = PRECISIONS[precision]
    spec = _resolve_gpu(gpu) if device != "cpu" else None
    cuda_target = device == "cuda"  # NVIDIA or ROCm (HIP's allocator is hipified from CUDA's)
    # Note: [the MPS target] device="mps" traces the ops on fake CPU tensors under MPS's
    # autocast lists (CUDA's, less five ops), without CUDA's SDPA routing, with no CUDA context,
    # no BLAS workspace and no caching-allocator model: MPSAllocator sizes a buffer by Metal's
    # heapBufferSizeAndAlignWithLength, a runtime answer not in PyTorch's source, so sizes are
    # counted as requested (MPS_NOTE).
    mps_target = device == "mps"
    fake_device = ("cuda" if cuda_target and USE_FAKE_CUDA and torch.backends.cuda.is_built()
                   else "cpu")
    # MPS's autocast (AutocastMPS) registers the ops CUDA's does, but for the RNN cells,
    # rms_norm and vdot (the dispatcher, torch 2.13): CUDA's lists are applied to it.
    emulate_cuda = (cuda_target and fake_device == "cpu") or device == "mps"

    allocator = None
    if cuda_target:
        from memfit.trace.allocator import CachingAllocatorSim

        allocator = CachingAllocatorSim.for_gpu(spec, num_gpus=num_gpus,
                                                expandable_segments=expandable_segments)
    tracker = Tracker(fake_device, round_to=_CUDA_BLOCK if cuda_target else 1,
                      allocator=allocator, host_split=cuda_target)
    notes: list[str] = []

    def warn(note: str) -> None:
        if note not in notes:
            notes.append(note)
            warnings.warn(f"memfit: assumed {note}", stacklevel=3)

    datadep = DataDependentSizes(replay)
    started = time.perf_counter()
    fake_mode = TrackingFakeMode(tracker, datadep, warn,
                                 measure_cpu_kernels=not (cuda_target or mps_target))
    if mps_target:
        notes.append(MPS_NOTE)
    with contextlib.ExitStack() as stack:
        stack.enter_context(fake_mode)
        stack.enter_context(torch_internals.fake_op_errors_unlogged())  # raised, not logged
        stack.enter_context(host.tracing(tracker))
        stack.enter_context(grouped_mm_rule())
        stack.enter_context(foreach.grouped())  # Note: [foreach ops on fake tensors]
        fmodel, finputs = _fake_model_and_inputs(stack, model, inputs, rank, tracker, fake_mode,
                                                 datadep, fake_device, param_dtype)
        if pruned := pruning.note(fmodel, training=optimizer is not None):
            notes.append(pruned)
        params = [p for p in fmodel.parameters() if p.requires_grad]
        training = optimizer is not None
        # Built outside the fake mode: an optimizer's constructor may compute constants from
        # real values (bitsandbytes' quantization maps call .tolist()); states made from the fake
        # parameters are still fake (fake tensors dispatch to their own mode).
        with unset_fake_temporarily():
            opt = (make_optimizer(optimizer, params, cuda_target=cuda_target)
                   if training and params else None)
            if opt is not None:
                sparse.check_optimizer(opt, fmodel)
            if rank is not None and opt is not None:
                opt = rank.wrap_optimizer(opt)
        if training and not params:
            raise MemfitError("the model has no parameter that requires grad; pass "
                              "optimizer=None to estimate inference")
        runtime: dict[str, int] = {}
        in_allocator: frozenset[str] = frozenset()
        if cuda_target:
            runtime, in_allocator = _matmul_workspaces(fake_mode, spec, num_gpus, training, notes)
        fake_mode.tracking = True
        stack.callback(tracker.close)  # runs last: frees after the trace are not recorded
        stack.callback(setattr, fake_mode, "tracking", False)
        _enter_step_contexts(stack, fmodel, tracker, fake_mode, rank=rank, replay=replay,
                             training=training, steps=steps, spec=spec, cuda_target=cuda_target,
                             emulate_cuda=emulate_cuda, autocast_dtype=autocast_dtype)
        run_steps(fmodel, finputs, tracker, opt, params, compute_loss=compute_loss,
                  device="cpu" if mps_target else device,  # Note: [the MPS target]
                  steps=steps, training=training, autocast_dtype=autocast_dtype,
                  emulate_cuda=emulate_cuda, keep_output=keep_output, replay=replay, rank=rank)
    elapsed = time.perf_counter() - started
    return _result(tracker, allocator, runtime, in_allocator, device=device, precision=precision,
                   optimizer=optimizer, steps=steps, notes=notes, elapsed=elapsed), datadep


def _fake_model_and_inputs(stack: contextlib.ExitStack, model: nn.Module, inputs: Any,
                           rank: RankHooks | None, tracker: Tracker, fake_mode: TrackingFakeMode,
                           datadep: DataDependentSizes, fake_device: str,
                           param_dtype: torch.dtype | None) -> tuple[nn.Module, Any]:
    """The fake model (as this rank runs it) and the fake inputs, registered as the baseline;
    the real values of real CPU inputs are known to ``datadep``."""
    # A pipeline rank fakes only its own stages (memfit/parallel/pipeline_rank.py: local_model).
    local = getattr(rank, "local_model", None)
    fmodel = fake_model(model if local is None else local(model), fake_device, param_dtype)
    if rank is not None:  # one rank of a memfit.Parallel layout (memfit/parallel/rank.py)
        stack.enter_context(rank.tracing(tracker, fake_mode))
        stack.enter_context(torch_dtensor.dtensor_foreach_propagation_once_per_shape())
        stack.enter_context(torch_fsdp.fsdp_chunks_on_demand())
        fmodel = rank.wrap_model(fmodel, tracker, fake_mode)
    memo: dict[int, torch.Tensor] = {}
    finputs = fake_inputs(inputs, fake_device, memo, param_dtype)
    for real in tensor_leaves(inputs, objects=True):
        if id(real) in memo and real.device.type == "cpu" and not _is_fake(real):
            datadep.know(memo[id(real)], real)  # e.g. an attention mask's padding
    _register_baseline(tracker, fmodel, finputs)
    return fmodel, finputs


def _matmul_workspaces(fake_mode: TrackingFakeMode, spec: GpuSpec | None, num_gpus: int,
                       training: bool, notes: list[str]
                       ) -> tuple[dict[str, int], frozenset[str]]:
    """The CUDA runtime parts and those of them the caching allocator holds; the latter, the
    cuBLAS workspaces, are handed to the fake mode per thread that runs matmuls."""
    runtime, in_allocator, note = _runtime(spec, num_gpus, training)
    if note:
        notes.append(note)
    threads = ["forward", "backward"] if training else ["forward"]
    for phase in threads:
        fake_mode.matmul_workspaces[phase] = [
            runtime[name] // len(threads) for name in sorted(in_allocator)
            if runtime[name]]
    return runtime, in_allocator


def _enter_step_contexts(stack: contextlib.ExitStack, fmodel: nn.Module, tracker: Tracker,
                         fake_mode: TrackingFakeMode, *, rank: RankHooks | None,
                         replay: RealValues | None, training: bool, steps: int,
                         spec: GpuSpec | None, cuda_target: bool, emulate_cuda: bool,
                         autocast_dtype: torch.dtype | None) -> None:
    """Enter the contexts the steps run in: block replay, module attribution, progress, the
    libraries' eager paths, and CUDA's SDPA routing and autocast (or CPU's RNG states)."""
    if rank is None and cuda_target and replay is None:
        # before the trace's own module hooks: see Note: [replaying identical blocks]
        stack.enter_context(replaying_blocks(fmodel, tracker, fake_mode,
                                             training=training))
    stack.enter_context(_module_hooks(fmodel, tracker))
    stack.enter_context(pruning.mark_recomputed(fmodel, tracker))
    stack.enter_context(trace_progress(fmodel, steps=steps, training=training))
    stack.enter_context(_eager_library_paths())
    if cuda_target:
        stack.enter_context(CudaSdpaRouting(_compute_capability(spec),
                                            cuda_on_cpu=emulate_cuda))
        stack.enter_context(host.traced_save_on_cpu())
        if emulate_cuda and autocast_dtype is not None:
            # For the whole step, so that checkpoint's recompute in backward sees it too;
            # see Note: [autocast in the recompute] in autocast.py.
            stack.enter_context(cuda_autocast_emulation())
    else:
        if emulate_cuda and autocast_dtype is not None:  # the MPS target: its autocast lists
            stack.enter_context(cuda_autocast_emulation())
        stack.enter_context(_count_cpu_rng_states(tracker))
