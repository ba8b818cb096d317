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
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import torch
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

from memfit import vocab
from memfit._compat import torch_dtensor, torch_fsdp, torch_internals, transformers_internals
from memfit._loss import LossFn, check_loss_fn, model_loss
from memfit._tensors import call_model, fake_inputs, fake_model, shallow_leaves, tensor_leaves
from memfit.categories import MemoryCategory
from memfit.dtypes import torch_dtype
from memfit.errors import MemfitError, suggest
from memfit.gpus import GpuSpec
from memfit.ledger import replay
from memfit.progress import trace_progress
from memfit.trace import foreach, host
from memfit.trace.autocast import cuda_autocast_emulation, target_autocast
from memfit.trace.blocks import replaying_blocks
from memfit.trace.datadep import DataDependentSizes, RealValues, record_real_values
from memfit.trace.estimate import TRACKED, Estimate, ModuleMemory, TimelinePoint
from memfit.trace.heap import with_frozen_heap
from memfit.trace.optim import OptimizerFactory, make_optimizer
from memfit.trace.replay import redo_without_replay
from memfit.trace.sdpa import CudaSdpaRouting
from memfit.trace.tracker import Tracker, TrackingFakeMode


def _dtypes(p: vocab.Precision) -> tuple[torch.dtype | None, torch.dtype | None]:
    """(autocast dtype, dtype the model is cast to) of ``p``; None: no autocast, and the model
    as given for fp32 parameters ("-mixed" is autocast over fp32 parameters)."""
    return (torch_dtype(p.autocast) if p.autocast else None,
            None if p.params == "fp32" else torch_dtype(p.params))


PRECISIONS = {name: _dtypes(vocab.precision(name)) for name in vocab.names("precision", "trace")}
"""Precision name -> (autocast dtype, parameter dtype), from :class:`memfit.vocab.Precision`."""

DEVICES = ("cuda", "cpu")
_CUDA_BLOCK = 512  # the CUDA caching allocator rounds every request up to 512 bytes
_DEFAULT_CC = (8, 0)  # SDPA routing when no GPU is named: an A100-class GPU
# Fake CUDA tensors (exact CUDA autocast lists) on CUDA builds of torch. Off until validated on a
# GPU machine: the CPU stand-in path (see the module note) is the one the test suite covers.
USE_FAKE_CUDA = False


def _compute_capability(gpu: GpuSpec | None) -> tuple[int, int]:
    if gpu is None or not gpu.compute_capability:
        return _DEFAULT_CC
    major, _, minor = gpu.compute_capability.partition(".")
    return int(major), int(minor or 0)


def _resolve_gpu(gpu: str | GpuSpec | None) -> GpuSpec | None:
    if gpu is None or isinstance(gpu, GpuSpec):
        return gpu
    from memfit.gpus import get_gpu

    return get_gpu(gpu)


def _runtime(gpu: GpuSpec | None, num_gpus: int, training: bool
             ) -> tuple[dict[str, int], frozenset[str], str | None]:
    """Runtime parts by name and which of them the caching allocator holds."""
    try:
        from memfit.runtime import ALLOCATOR_PARTS, cuda_runtime_bytes
    except ImportError:
        return {}, frozenset(), ("CUDA runtime constants unavailable (memfit.runtime missing): "
                                 "runtime not added")
    # Matmuls run on the main thread (forward) and on autograd's device thread (backward), each
    # with its own cuBLAS handle and workspaces.
    parts = cuda_runtime_bytes(gpu.name if gpu else None, num_gpus=num_gpus,
                               matmul_threads=2 if training else 1)
    return dict(parts), frozenset(ALLOCATOR_PARTS) & set(parts), None


# -- fake tensors ------------------------------------------------------------------------------

def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return bool(is_fake(t))


def _state_tensors(values: Iterable[Any], depth: int = 0) -> Iterator[torch.Tensor]:
    """Tensors among a Parameter subclass's attributes ``values`` (see
    :func:`memfit._tensors.fake_model`), and among their own attributes, two levels down."""
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif depth < 2 and hasattr(v, "__dict__") and not isinstance(v, type | nn.Module):
            yield from _state_tensors(vars(v).values(), depth + 1)


# -- module attribution ------------------------------------------------------------------------

@contextlib.contextmanager
def _module_hooks(model: nn.Module, tracker: Tracker) -> Iterator[None]:
    handles = []
    modules = tracker.modules

    def pre(name: str) -> Callable[..., None]:
        def hook(_mod: nn.Module, _args: Any) -> None:
            modules.enter(name)
        return hook

    def post(_mod: nn.Module, _args: Any, out: Any) -> None:
        modules.leave(tensor_leaves(out, objects=True) if torch.is_grad_enabled() else ())

    for name, mod in model.named_modules():
        handles.append(mod.register_forward_pre_hook(pre(name)))
        handles.append(mod.register_forward_hook(post))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _count_cpu_rng_states(tracker: Tracker) -> Iterator[None]:
    """torch.utils.checkpoint saves the CPU RNG state (a real 5 KB tensor) per checkpointed call;
    count it on CPU targets, where it lives in the same memory."""
    with torch_internals.reporting_get_rng_state(tracker.track):
        yield


@contextlib.contextmanager
def _eager_library_paths() -> Iterator[None]:
    """Make libraries that branch on "is this a FakeTensor?" take their eager path.

    Note: [libraries that detect fake tensors] Hugging Face transformers treats a FakeTensor as
    "being traced by torch.compile/export" (``transformers.utils.import_utils.is_fake_tensor``,
    used by ``is_tracing``) and then skips its data-dependent shortcuts: it materialises a causal
    mask for SDPA instead of passing ``is_causal=True`` when the attention mask is all ones, and
    assumes packed sequences. The real eager step takes the shortcut, so the trace must too: the
    check answers False for the duration of the trace, and the data-dependent ``.all()`` it then
    evaluates is answered by ``datadep.py``: from the real values when the attention mask was
    given as a real tensor (a padded batch takes the masked path, as for real), else ``True``
    (no padding, no packing; an assumption the engine states).
    """
    with transformers_internals.fake_tensors_look_eager():
        yield


@contextlib.contextmanager
def _grouped_mm_rule() -> Iterator[None]:
    """Fake tensors take ``aten._grouped_mm`` (the mixture-of-experts matmul) with the dtypes the
    real kernels take.

    Note: [grouped_mm on fake tensors] torch's meta function (``torch/_meta_registrations.py:
    _meta_grouped_mm_common``) still requires bf16 inputs, while the kernels it describes accept
    fp32, bf16 and fp16 (``aten/src/ATen/native/GroupedMMUtils.h: _grouped_mm_validate_inputs``;
    ``aten/src/ATen/native/cuda/GroupedBlas.cpp: _grouped_mm_cuda`` runs bf16 on sm90/sm100 with
    CUTLASS and everything else through ``_grouped_mm_fallback``, one ``mm_out`` per group into
    the same output; the CPU kernel runs that fallback too). transformers' MoE layers call it
    with fp32 weights under fp32 and under autocast (``integrations/moe.py: _grouped_mm`` casts
    the input to the weight dtype), so every MoE model failed to trace. The rule here makes the
    output as ``create_grouped_gemm_output_tensor`` (GroupedMMUtils.h) does on CUDA and CPU (not
    ROCm): dtype ``out_dtype`` or the input's, last dimension's stride padded to 16 bytes.
    """
    from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager

    if not hasattr(torch.ops.aten, "_grouped_mm"):  # torch < 2.8 has no such op: nothing to fix
        yield
        return
    ops = {torch.ops.aten._grouped_mm.default}
    allowed = (torch.float32, torch.bfloat16, torch.float16)

    def rule(fake_mode: Any, func: Any, mat_a: torch.Tensor, mat_b: torch.Tensor,
             offs: torch.Tensor | None = None, bias: torch.Tensor | None = None,
             out_dtype: torch.dtype | None = None) -> Any:
        for name, m in (("mat_a", mat_a), ("mat_b", mat_b)):
            if m.dtype not in allowed:
                raise RuntimeError(f"Expected {name} to be Float32, BFloat16 or Float16 matrix, "
                                   f"got {m.dtype}")
        if mat_a.dim() not in (2, 3) or mat_b.dim() not in (2, 3):
            raise RuntimeError("mat_a and mat_b have to be 2 or 3d")
        a2, b2 = mat_a.dim() == 2, mat_b.dim() == 2
        if not (a2 and b2) and mat_a.shape[-1] != mat_b.shape[-2]:
            raise RuntimeError("contraction dimension of mat_a and mat_b must match")
        if a2 and b2:
            size = [offs.shape[0] if offs is not None else 1, mat_a.shape[0], mat_b.shape[1]]
        elif a2:
            size = [mat_a.shape[0], mat_b.shape[-1]]
        elif b2:
            size = [mat_a.shape[1], mat_b.shape[1]]
        else:
            size = [mat_a.shape[0], mat_a.shape[1], mat_b.shape[-1]]
        dtype = out_dtype or mat_a.dtype
        align = 16 // dtype.itemsize
        padded = -(-size[-1] // align) * align
        stride = [padded, 1] if a2 != b2 else [size[1] * padded, padded, 1]
        with in_kernel_invocation_manager(fake_mode):
            out = torch.empty_strided(size, stride, dtype=dtype, device="meta")
        return FakeTensor(fake_mode, out, mat_a.device)

    with torch_internals.fake_op_rule(ops, rule):
        yield


# -- the run -----------------------------------------------------------------------------------

def _validate(optimizer: Any, precision: str, device: str, steps: int) -> None:
    vocab.check("precision", precision, "trace")
    if device not in DEVICES:
        raise MemfitError(f"unknown device {device!r}{suggest(device, DEVICES)}; valid: "
                          f"{', '.join(DEVICES)} (the device to model, not where to run)")
    if not isinstance(steps, int) or steps < 1:
        raise MemfitError(f"steps must be a positive integer, got {steps!r}; use steps=2 to "
                          f"cover optimizer-state creation and the steady state")


def check_request(model: Any, *, optimizer: str | OptimizerFactory | None, precision: str,
                  loss_fn: LossFn | None, device: str, steps: int) -> LossFn:
    """The checks :func:`estimate` makes before tracing (one MemfitError line each), and the
    loss it will compute; ``memfit.parallel`` makes them once before tracing each rank."""
    _validate(optimizer, precision, device, steps)
    compute_loss = check_loss_fn(loss_fn) or model_loss
    if not isinstance(model, nn.Module):
        raise MemfitError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    return compute_loss


class RankHooks(Protocol):
    """What one rank of a parallel layout changes in a trace (``memfit.parallel`` implements it,
    as PyTorch's ``FSDPMemTracker`` extends ``MemTracker``: the engine is extended, never calls
    up). Optional members, read with ``getattr``: ``local_model(model)`` (the part of the model
    this rank holds, e.g. a pipeline stage), ``runs_step`` and ``run_step(model, inputs,
    tracker, ...)`` (a rank whose schedule runs the forward and backward itself)."""

    def tracing(self, tracker: Any, fake_mode: Any) -> contextlib.AbstractContextManager[Any]:
        """Entered around the whole trace (the rank's fake process group, its streams)."""
        ...

    def wrap_model(self, model: nn.Module, tracker: Any, fake_mode: Any) -> nn.Module:
        """The fake model as this rank runs it (DDP, FSDP2, tensor-parallel shards)."""
        ...

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer as this rank steps it (ZeRO-1's partition, an offloaded step)."""
        ...


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
    trace = functools.partial(_trace_or_redo, model, inputs, optimizer=optimizer,
                              precision=precision, compute_loss=compute_loss, device=device,
                              gpu=gpu, steps=steps, expandable_segments=expandable_segments,
                              num_gpus=num_gpus, keep_output=keep_output, rank=rank)
    if not _real_step(model, inputs):
        return trace(None)[0]
    # Note: [real values of a real step] in datadep.py: trace once; if its forward needed an
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
    spec = _resolve_gpu(gpu) if device == "cuda" else None
    cuda_target = device == "cuda"
    fake_device = ("cuda" if cuda_target and USE_FAKE_CUDA and torch.backends.cuda.is_built()
                   else "cpu")
    emulate_cuda = cuda_target and fake_device == "cpu"

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
    fake_mode = TrackingFakeMode(tracker, datadep, warn, measure_cpu_kernels=not cuda_target)
    with contextlib.ExitStack() as stack:
        stack.enter_context(fake_mode)
        stack.enter_context(torch_internals.fake_op_errors_unlogged())  # raised, not logged
        stack.enter_context(host.tracing(tracker))
        stack.enter_context(_grouped_mm_rule())
        stack.enter_context(foreach.grouped())  # Note: [foreach ops on fake tensors]
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
        params = [p for p in fmodel.parameters() if p.requires_grad]
        training = optimizer is not None
        # Built outside the fake mode: an optimizer's constructor may compute constants from
        # real values (bitsandbytes' quantization maps call .tolist()); states made from the fake
        # parameters are still fake (fake tensors dispatch to their own mode).
        with unset_fake_temporarily():
            opt = (make_optimizer(optimizer, params, cuda_target=cuda_target)
                   if training and params else None)
            if rank is not None and opt is not None:
                opt = rank.wrap_optimizer(opt)
        if training and not params:
            raise MemfitError("the model has no parameter that requires grad; pass "
                              "optimizer=None to estimate inference")
        runtime: dict[str, int] = {}
        in_allocator: frozenset[str] = frozenset()
        if cuda_target:
            runtime, in_allocator, note = _runtime(spec, num_gpus, training)
            if note:
                notes.append(note)
            threads = ["forward", "backward"] if training else ["forward"]
            for phase in threads:
                fake_mode.matmul_workspaces[phase] = [
                    runtime[name] // len(threads) for name in sorted(in_allocator)
                    if runtime[name]]
        fake_mode.tracking = True
        stack.callback(tracker.close)  # runs last: frees after the trace are not recorded
        stack.callback(setattr, fake_mode, "tracking", False)
        if rank is None and cuda_target and replay is None:
            # before the trace's own module hooks: see Note: [replaying identical blocks]
            stack.enter_context(replaying_blocks(fmodel, tracker, fake_mode,
                                                 training=training))
        stack.enter_context(_module_hooks(fmodel, tracker))
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
            stack.enter_context(_count_cpu_rng_states(tracker))
        owners = _owners(fmodel)
        for step in range(steps):
            tracker.step = step
            tracker.phase = "forward"
            if replay is not None:
                replay.start()
            grad_mode = torch.enable_grad() if training else torch.no_grad()
            # A pipeline rank's schedule runs forward and backward of every micro-batch as its
            # step (memfit/parallel/pipeline_rank.py: PipelineRole.run_step); the optimizer follows.
            pipeline = getattr(rank, "runs_step", False)
            with grad_mode, target_autocast(device, autocast_dtype, emulate_cuda=emulate_cuda), \
                    _outputs(fmodel, keep_output) as out:
                if pipeline:
                    loss = rank.run_step(fmodel, finputs, tracker,  # type: ignore[union-attr]
                                         compute_loss if training else None)
                elif training:
                    loss = compute_loss(fmodel, finputs)
                else:
                    loss = None
                    out.append(call_model(fmodel, finputs))
            if not keep_output and training:
                out = None
            tracker.end_forward()
            if replay is not None:
                replay.stop()
            if (loss is not None or pipeline) and opt is not None:
                tracker.phase = "backward"
                tracker.modules.backward = ""
                if not pipeline:
                    _backward(loss)
                del loss, out
                _mark_grads(tracker, params, owners)
                tracker.phase = "optimizer"
                with _optimizer_modes(opt):
                    opt.step()
                _mark_states(tracker, opt, owners)
                tracker.phase = "zero_grad"
                opt.zero_grad(set_to_none=True)
            else:
                del loss, out
    elapsed = time.perf_counter() - started
    return _result(tracker, allocator, runtime, in_allocator, device=device, precision=precision,
                   optimizer=optimizer, steps=steps, notes=notes, elapsed=elapsed), datadep


def _optimizer_modes(opt: torch.optim.Optimizer) -> Any:
    """The trace's own torch-function modes (CUDA's autocast lists, SDPA and device routing)
    left out of a ``torch.optim`` optimizer's step, where none of them acts: autocast is off,
    and torch's optimizers make their tensors on their parameters' device and call no SDPA or
    norm. Each op of the step then passes two Python modes fewer (AdamW's first step makes
    three state tensors per parameter). Other optimizers keep them."""
    if not type(opt).__module__.startswith("torch.optim."):
        return contextlib.nullcontext()
    from memfit.trace.autocast import _CudaAutocastOnCpu
    from memfit.trace.sdpa import CudaRouting

    return torch_internals.without_function_modes((_CudaAutocastOnCpu, CudaRouting))


@contextlib.contextmanager
def _outputs(model: nn.Module, keep: bool) -> Iterator[list[Any]]:
    """A list that holds the model's outputs while the step runs: with ``keep`` (keep_output),
    every output of ``model``'s own forward, seen by a forward hook, since ``loss_fn`` calls the
    model itself and returns only the loss."""
    kept: list[Any] = []
    if not keep:
        yield kept
        return

    def hook(_mod: nn.Module, _args: Any, output: Any) -> None:
        kept.append(output)

    handle = model.register_forward_hook(hook)
    try:
        yield kept
    finally:
        handle.remove()


def _backward(loss: torch.Tensor) -> None:
    """``loss.backward()``, run by autograd's engine while the trace's torch-function modes (the
    CUDA SDPA routing, the CUDA autocast emulation) stay active.

    ``Tensor.backward`` is itself a torch function: the mode's handler would run it with the mode
    popped, so a forward that activation checkpointing recomputes in backward would take CPU
    kernels where the original forward took CUDA's, and checkpoint's recompute check fails."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        what = type(loss).__name__ if not isinstance(loss, torch.Tensor) else (
            f"a tensor of shape {tuple(loss.shape)}")
        raise MemfitError(f"the loss must be a scalar tensor, got {what}; return e.g. "
                          f"loss.mean() from loss_fn")
    if not loss.requires_grad:
        raise MemfitError("the loss does not require grad (nothing to backpropagate); check "
                          "that the model has trainable parameters, or pass optimizer=None")
    grad = torch.ones_like(loss, memory_format=torch.preserve_format)
    torch_internals.engine_run_backward(loss, grad)


def _owners(model: nn.Module) -> dict[int, str]:
    owners: dict[int, str] = {}
    for name, mod in model.named_modules():
        for p in mod._parameters.values():
            if p is not None:
                owners.setdefault(id(p), name)
    return owners


def _register_baseline(tracker: Tracker, model: nn.Module, inputs: Any) -> None:
    for name, mod in model.named_modules():
        for p in mod._parameters.values():
            if p is not None:
                tracker.track(p, MemoryCategory.WEIGHTS, name)
                state = [getattr(p, key) for key in getattr(p, "_memfit_state", ())]
                for t in _state_tensors(state):  # a subclass's state: fake_model
                    tracker.track(t, MemoryCategory.WEIGHTS, name)
        for b in mod._buffers.values():
            if b is not None:
                tracker.track(b, MemoryCategory.WEIGHTS, name)
        for v in shallow_leaves(vars(mod).values()):
            tracker.track(v, MemoryCategory.WEIGHTS, name)
    for t in tensor_leaves(inputs, objects=True):
        tracker.track(t, MemoryCategory.ACTIVATIONS, "")


def _mark_grads(tracker: Tracker, params: list[nn.Parameter], owners: dict[int, str]) -> None:
    for p in params:
        if p.grad is not None:
            tracker.track(p.grad, MemoryCategory.GRADIENTS, owners.get(id(p), ""))


def _mark_states(tracker: Tracker, opt: torch.optim.Optimizer, owners: dict[int, str]) -> None:
    inner = getattr(opt, "optim", None)  # ZeroRedundancyOptimizer: its local optimizer's states
    if isinstance(inner, torch.optim.Optimizer) and not opt.state:
        opt = inner
    for p, state in opt.state.items():
        for v in tensor_leaves(state, objects=True):
            tracker.track(v, MemoryCategory.OPTIMIZER_STATES, owners.get(id(p), ""))


_CONVOLUTIONS = frozenset({torch.ops.aten.convolution.default,
                           torch.ops.aten.convolution_backward.default})
CONV_NOTE = (
    "convolutions on CUDA: cuDNN's workspaces (and, for some fp32 nets, more) are not modelled; "
    "memfit validate on an H100 (torch 2.11) measured convolutional nets 4-16% above this "
    "trace's allocated peak and up to 33% above its reserved peak "
    "(bench/results/validate-h100-2026-11-27.json): leave that much room")


def _result(tracker: Tracker, allocator: Any, runtime: dict[str, int],
            in_allocator: frozenset[str], *, device: str,
            precision: str, optimizer: Any, steps: int, notes: list[str],
            elapsed: float) -> Estimate:
    activation: dict[str, int] = {}
    for info in tracker.infos:
        if info.saved and info.step == 0 and info.role is None:
            activation[info.module] = activation.get(info.module, 0) + info.nbytes
    ops = tracker.ops
    run = replay(tracker, [op[4] for op in ops], tracker.peak_events, TRACKED)
    names: dict[Any, str] = {}  # str(OpOverload) is Python code: once per op kind
    timeline = [TimelinePoint(index=i, op=names.get(op[0]) or names.setdefault(op[0], str(op[0])),
                              phase=op[1], step=op[2], module=op[3], bytes=after)
                for i, (op, after) in enumerate(zip(ops, run.after, strict=True))]
    breakdown = run.peak.by_category(TRACKED)
    if run.peak_op < len(ops):  # else the peak is the baseline (nothing allocated by any op)
        breakdown[MemoryCategory.TEMPORARIES] += tracker.peak_extra
    at_peak = tracker.by_module(run.peak.live)
    breakdown[MemoryCategory.RUNTIME] += sum(v for k, v in runtime.items()
                                             if k not in in_allocator)
    peak_bytes = tracker.peak
    peak_reserved = peak_bytes
    if allocator is not None:
        peak_reserved = max(allocator.peak_reserved_bytes, peak_bytes)
    if 0 <= tracker.peak_op < len(tracker.ops):
        func, phase, step, module, _ = tracker.ops[tracker.peak_op]
        peak_op, peak_phase, peak_step, peak_module = str(func), phase, step, module
    else:
        peak_op, peak_phase, peak_step, peak_module = "(before the first op)", "setup", 0, ""
    names = set(at_peak) | set(activation)
    modules = {name: ModuleMemory(name=name, at_peak=at_peak.get(name, {}),
                                  activation_bytes=activation.get(name, 0)) for name in names}
    opt_name = optimizer if isinstance(optimizer, str) or optimizer is None else getattr(
        optimizer, "__name__", "custom")
    if device == "cuda" and any(op[0] in _CONVOLUTIONS for op in ops):
        notes = [*notes, CONV_NOTE]
    return Estimate(peak_bytes=peak_bytes, peak_reserved_bytes=peak_reserved, breakdown=breakdown,
                    runtime=runtime, device=device, precision=precision, optimizer=opt_name,
                    steps=steps, peak_op=peak_op, peak_phase=peak_phase, peak_step=peak_step,
                    peak_module=peak_module, timeline=timeline, modules=modules,
                    num_ops=len(tracker.ops), trace_seconds=elapsed, assumptions=tuple(notes),
                    runtime_in_allocator=in_allocator, host_peak_bytes=tracker.host_peak,
                    phase_peaks=dict(tracker.phase_peaks),
                    op_peaks=dict(tracker.op_peaks))
