"""One traced step: the module attribution hooks, the forward with the outputs it keeps, the
backward, the optimizer's step, and the marking of weights, gradients and optimizer states in
the tracker (:func:`run_steps`; the engine sets up the fake world around it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from memfit._compat import torch_internals
from memfit._loss import LossFn
from memfit._tensors import call_model, shallow_leaves, tensor_leaves
from memfit.categories import MemoryCategory
from memfit.errors import MemfitError
from memfit.trace.autocast import target_autocast
from memfit.trace.options import RankHooks
from memfit.trace.real_values import RealValues
from memfit.trace.tracker import Tracker


def run_steps(fmodel: nn.Module, finputs: Any, tracker: Tracker,
              opt: torch.optim.Optimizer | None, params: list[nn.Parameter], *,
              compute_loss: LossFn, device: str, steps: int, training: bool,
              autocast_dtype: torch.dtype | None, emulate_cuda: bool, keep_output: bool,
              replay: RealValues | None, rank: RankHooks | None) -> None:
    """Run ``steps`` steps of the fake model (forward, loss, backward, ``optimizer.step()``,
    ``zero_grad``), marking the gradients and optimizer states as they appear."""
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

    stack = contextlib.ExitStack()
    stack.enter_context(torch_internals.without_function_modes((_CudaAutocastOnCpu, CudaRouting)))
    stack.enter_context(_HostScalars())
    return stack


class _HostScalars(TorchFunctionMode):
    """``torch.tensor(...)`` without a device, or on the CPU, is host memory on a CUDA target.

    Note: [optimizer step counters on the host] torch's Adam family (and Adagrad, NAdam, RAdam,
    Adamax, ASGD) keep each parameter's ``state["step"]`` as a CPU scalar unless the group is
    ``capturable`` or ``fused`` (``torch/optim/adam.py: _init_group``: ``torch.tensor(0.0,
    dtype=_get_scalar_dtype(), device="cpu")``, else ``device=p.device``). On a CPU-only torch a
    CUDA target's parameters are fake CPU tensors, so the counter looked like one more device
    block per parameter (512 B each). A capturable or fused group names ``p.device`` and stays
    on the device."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.tensor:
            device = kwargs.get("device")
            if device is None or torch.device(device).type == "cpu":
                from memfit.trace.host import host_memory

                with host_memory():
                    return func(*args, **kwargs)
        return func(*args, **kwargs)


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


def _state_tensors(values: Iterable[Any], depth: int = 0) -> Iterator[torch.Tensor]:
    """Tensors among a Parameter subclass's attributes ``values`` (see
    :func:`memfit._tensors.fake_model`), and among their own attributes, two levels down."""
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif depth < 2 and hasattr(v, "__dict__") and not isinstance(v, type | nn.Module):
            yield from _state_tensors(vars(v).values(), depth + 1)


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
