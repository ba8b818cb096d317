"""PyTorch's pipeline schedules (``torch.distributed.pipelining``), patched for a per-rank trace.

A schedule over a fake process group runs as over a real one once its P2P works keep their
tensors, its warm-up vote is answered without a peer, and a stage's backward keeps the trace's
torch-function modes; the trace also marks each stage's forward and backward chunks. Each patch
is a context manager that restores what it replaced on exit, and names the torch source it
mirrors and the version it was checked against. The private names are registered in
:data:`memfit._compat.torch_internals.PRIVATE_NAMES` and ``OPTIONAL_NAMES``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from memfit._compat.torch_internals import engine_run_backward

__all__ = [
    "autograd_backward_keeps_function_modes",
    "p2p_works_hold_their_tensors",
    "stage_chunks_within",
    "warmup_vote_static",
]


class _HeldWork:
    """A point-to-point work that keeps the tensors it was given, as a real backend's does."""

    def __init__(self, work: Any, tensors: list[torch.Tensor]) -> None:
        self._work, self._tensors = work, tensors

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


@contextlib.contextmanager
def p2p_works_hold_their_tensors() -> Iterator[None]:
    """Inside the block, the schedule's P2P works keep their tensors alive as long as the
    schedule keeps the works; the schedules module's own ``_batch_p2p`` again on exit.

    Note: [a P2P work keeps its tensor] A backend's send or receive work holds the tensor it
    was given for as long as the work object lives: gloo's ``SendWork`` / ``RecvWork`` keep it
    as a member (``torch/csrc/distributed/c10d/ProcessGroupGloo.hpp``: ``at::Tensor
    tensor_``), NCCL's work keeps it as its outputs (``ProcessGroupNCCL.cpp:
    ProcessGroupNCCL::pointToPoint``: "we still create these outputs [for send] for use cases
    such as profiling", ``work->outputs_``). A schedule keeps its last send works in a local
    variable until it waits on the next ones, or to the end of the step: 1F1B's first stage
    keeps the send of its first micro-batch's activations through the whole steady state
    (``schedules.py: Schedule1F1B._step_microbatches``: ``send_work`` is only reassigned from
    the backward sends, and the first stage has none), one micro-batch's output past its
    backward (measured on gloo: +32,768 bytes, one 2x64x64 fp32 activation, on stage 0 of 2
    with 4 micro-batches). A fake process group's ``FakeWork`` keeps nothing, so each work the
    schedule gets here carries its tensors."""
    from torch.distributed.pipelining import schedules

    batch_p2p = schedules._batch_p2p

    def held(p2p_ops: list[Any], desc: str | None = None) -> list[Any]:
        works = batch_p2p(p2p_ops, desc=desc)
        if len(works) == len(p2p_ops):
            return [_HeldWork(w, [op.tensor]) for w, op in zip(works, p2p_ops, strict=True)]
        return [_HeldWork(w, [op.tensor for op in p2p_ops]) for w in works]  # coalesced

    schedules._batch_p2p = held  # type: ignore[assignment]
    try:
        yield
    finally:
        schedules._batch_p2p = batch_p2p  # type: ignore[assignment]


@contextlib.contextmanager
def autograd_backward_keeps_function_modes() -> Iterator[None]:
    """Inside the block, ``torch.autograd.backward`` enters autograd's engine directly, while the
    trace's torch-function modes (the CUDA SDPA routing, the CUDA autocast emulation) stay
    active; torch's own function again on exit.

    Note: [the stage's backward under the trace's modes] A stage's backward is
    ``torch.autograd.backward(stage_output_tensors, grad_tensors=output_grad_tensors)``
    (``torch/distributed/pipelining/_backward.py: stage_backward``, called by ``stage.py:
    backward_maybe_with_nosync`` for ``backward_one_chunk(full_backward=True)``, which every
    schedule here uses). ``torch.autograd.backward`` is a torch function
    (``torch/autograd/__init__.py: backward``: ``handle_torch_function``), so a torch-function
    mode handles it with the mode popped (``torch/overrides.py: handle_torch_function``), and a
    block that activation checkpointing recomputes inside it would run without the trace's CUDA
    routing: CPU attention kernels and no autocast where the forward had CUDA's, so
    ``torch/utils/checkpoint.py: _checkpoint_hook`` / ``_CachingTorchDispatchMode`` reject the
    recompute ("A different number of tensors was saved", or an op "not found in storage"
    under selective checkpointing). A trace artifact: on a real GPU there is no such mode. As
    the single-device step does (``memfit/trace/step.py: _backward``), the engine is entered
    without the torch-function dispatch; the implicit gradient of a scalar output is
    ``torch.ones_like(out, memory_format=torch.preserve_format)`` as in ``torch/autograd/
    __init__.py: _make_grads``. Calls with other arguments go to torch's own function."""
    original = torch.autograd.backward

    def backward(tensors: Any, grad_tensors: Any = None, retain_graph: Any = None,
                 create_graph: bool = False, grad_variables: Any = None,
                 inputs: Any = None) -> None:
        outs = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
        grads = ((grad_tensors,) if isinstance(grad_tensors, torch.Tensor) or grad_tensors is None
                 else tuple(grad_tensors))
        if (retain_graph or create_graph or grad_variables is not None or inputs is not None
                or len(grads) != len(outs)
                or any(g is None and (o.numel() != 1 or not o.is_floating_point())
                       for o, g in zip(outs, grads, strict=True))):
            return original(tensors, grad_tensors, retain_graph, create_graph, grad_variables,
                            inputs)
        grads = tuple(torch.ones_like(o, memory_format=torch.preserve_format) if g is None
                      else g for o, g in zip(outs, grads, strict=True))
        engine_run_backward(outs, grads)

    torch.autograd.backward = backward  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.autograd.backward = original


@contextlib.contextmanager
def warmup_vote_static(schedule: Any) -> Iterator[None]:
    """Inside the block, the schedule's warm-up vote is answered without a peer: every stage
    static; the schedule's own ``_warmup_p2p`` again on exit.

    Note: [the pipeline's vote over a fake process group] Before its first step a schedule runs
    a vote along the stages (``schedules.py: _PipelineSchedule._warmup_p2p`` ->
    ``stage.py: PipelineStage._warmup_forward_vote``, ``_warmup_backward_result``): each stage
    multiplies a one-element int32 tensor by 1 if it was given its input and output shapes
    (``InferenceMode.needs_dynamic``) and sends it on, and every stage reads the result with
    ``.item()``. A fake process group delivers nothing (the received tensor has no value) and a
    fake tensor has no ``.item()``; every stage here is given its shapes, so every real stage
    votes static and the result is 1. The schedule instance's ``_warmup_p2p`` is replaced by
    one that sets that result (the 4-byte vote tensors are not traced)."""
    try:
        from torch.distributed.pipelining._utils import InferenceMode
    except ImportError:  # a torch without the vote: the shapes given are used as they are
        yield
        return

    def warmup(stages_: Any, has_backward: bool, p2p_done: bool) -> None:
        for stage in stages_:
            stage._inference_mode = InferenceMode.STATIC

    schedule._warmup_p2p = warmup
    try:
        yield
    finally:
        del schedule._warmup_p2p


@contextlib.contextmanager
def stage_chunks_within(schedule: Any,
                        forward: Callable[[], contextlib.AbstractContextManager[Any]],
                        backward: Callable[[], contextlib.AbstractContextManager[Any]]
                        ) -> Iterator[None]:
    """Inside the block, each stage's ``forward_one_chunk`` runs inside ``forward()`` and its
    ``backward_one_chunk`` inside ``backward()``; the stages' own methods again on exit. The
    stages are the schedule's ``_stages`` (a multi-stage schedule) or its ``_stage``
    (``torch/distributed/pipelining/schedules.py``, torch 2.13.0)."""
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    for stage in stages:
        forward_chunk, backward_chunk = stage.forward_one_chunk, stage.backward_one_chunk

        def fwd(*args: Any, _run: Any = forward_chunk, **kwargs: Any) -> Any:
            with forward():
                return _run(*args, **kwargs)

        def bwd(*args: Any, _run: Any = backward_chunk, **kwargs: Any) -> Any:
            with backward():
                return _run(*args, **kwargs)

        stage.forward_one_chunk, stage.backward_one_chunk = fwd, bwd
    try:
        yield
    finally:
        for stage in stages:
            del stage.forward_one_chunk, stage.backward_one_chunk
