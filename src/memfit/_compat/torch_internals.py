"""torch internals memfit patches, walks or calls, each behind one function, and the register of
every private torch name memfit uses.

The patches of distributed torch have their own modules beside this one:
:mod:`memfit._compat.torch_dtensor` (DTensor's sharding propagation, DeviceMesh),
:mod:`memfit._compat.torch_fsdp` (FSDP2) and :mod:`memfit._compat.torch_pipelining` (the
pipeline schedules). Each was checked against torch 2.13.0 (the CPU test machine; the GPU
machines run 2.11, where ``tests/test_compat.py`` runs too). ``tests/test_compat.py`` checks
every entry against the installed torch and names the internal in its failure message.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = [
    "OPTIONAL_NAMES",
    "PRIVATE_NAMES",
    "DisableTorchFunction",
    "allocator_settings_setter",
    "called_by_autograd_engine",
    "clear_cublas_workspaces",
    "current_graph_task_id",
    "ddp_ignore",
    "engine_run_backward",
    "fake_mode_active",
    "fake_op_errors_unlogged",
    "fake_op_rule",
    "fake_store",
    "flatten_dense_tensors",
    "has_dispatch_kernel",
    "is_norm_layer",
    "queue_engine_callback",
    "reporting_get_rng_state",
    "sdp_priority_order",
    "storage_use_count",
    "unflatten_dense_tensors",
]

# -- the frame walk ------------------------------------------------------------------------------

ENGINE_FRAME = "_engine_run_backward"
"""``torch/autograd/graph.py: _engine_run_backward``: every ``Tensor.backward`` and
``torch.autograd.grad`` enters autograd's C++ engine (``Variable._execution_engine.run_backward``)
from this Python function, so it is the nearest Python frame of an op the engine itself calls
(checked in torch 2.13.0; same name and role since torch 2.4)."""

_TORCH_DISPATCH_FILES = ("fake_tensor.py", "_python_dispatch.py", "eval_frame.py", "_compile.py",
                         os.path.basename(__file__), "torch_dtensor.py", "torch_fsdp.py",
                         "torch_pipelining.py")
"""Python frames between the engine and a dispatch mode: fake-tensor dispatch
(``torch/_subclasses/fake_tensor.py``), ``torch/utils/_python_dispatch.py`` and
``torch._dynamo``'s disable wrapper (``torch/_dynamo/eval_frame.py``, ``_compile.py``), and
memfit's own patches of torch (this module and its siblings in ``memfit/_compat``)."""


def called_by_autograd_engine(skip_files: tuple[str, ...] = ()) -> bool:
    """Whether the op being dispatched was called by autograd's C++ engine itself (e.g. the
    engine's gradient accumulation, ``torch/csrc/autograd/input_buffer.cpp: accumulate``), not by
    Python code (a forward, a Python ``backward``): the nearest Python frame outside torch's
    dispatch code and ``skip_files`` (the caller's own dispatch code, e.g. ``("tracker.py",)``)
    is :data:`ENGINE_FRAME`. Private: CPython's ``sys._getframe`` and torch's frame layout."""
    skip = _TORCH_DISPATCH_FILES + skip_files
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.endswith(skip):
            return frame.f_code.co_name == ENGINE_FRAME
        frame = frame.f_back  # type: ignore[assignment]
    return False


def engine_run_backward(loss: torch.Tensor | tuple[torch.Tensor, ...],
                        grad: torch.Tensor | tuple[torch.Tensor, ...]) -> None:
    """``loss.backward(grad)`` without ``Tensor.backward``'s torch-function dispatch: autograd's
    engine is entered directly through ``torch/autograd/graph.py: _engine_run_backward`` (the
    function ``torch.autograd.backward`` calls, torch >= 2.3; checked in 2.13.0), so the Python
    frame above the engine is :data:`ENGINE_FRAME` as in a real backward. Older torch:
    ``Variable._execution_engine.run_backward`` with the same arguments. ``loss`` and ``grad``
    may be tuples (``torch.autograd.backward(tensors, grad_tensors)``)."""
    run = getattr(torch.autograd.graph, "_engine_run_backward", None)
    if run is None:  # torch < 2.3
        run = torch.autograd.Variable._execution_engine.run_backward  # type: ignore[attr-defined]
    losses = loss if isinstance(loss, tuple) else (loss,)
    grads = grad if isinstance(grad, tuple) else (grad,)
    run(losses, grads, False, False, (), allow_unreachable=True, accumulate_grad=True)



def queue_engine_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the backward pass running now ends, inside autograd's engine
    (``Variable._execution_engine.queue_callback``, as FSDP2 queues its post-backward:
    ``torch/distributed/fsdp/_fully_shard/_fsdp_state.py: _root_pre_forward`` /
    ``_register_root_post_backward_final_callback``; checked in torch 2.13.0). Used by
    ``memfit/trace/replay.py`` to close a recorded backward."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)  # type: ignore[attr-defined]

# -- patches -------------------------------------------------------------------------------------


@contextlib.contextmanager
def reporting_get_rng_state(on_state: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """Within the context ``torch.get_rng_state()`` also passes each state it returns to
    ``on_state``; restored on exit.

    ``torch/utils/checkpoint.py`` saves the CPU generator's state per checkpointed call by
    calling ``torch.get_rng_state()`` through the ``torch`` module (``CheckpointFunction.forward``
    and ``_checkpoint_without_reentrant_generator``: ``fwd_cpu_state = torch.get_rng_state()``,
    torch 2.13.0), so replacing the module attribute sees those calls."""
    original = torch.get_rng_state

    def get_rng_state() -> torch.Tensor:
        state = original()
        on_state(state)
        return state

    torch.get_rng_state = get_rng_state
    try:
        yield
    finally:
        torch.get_rng_state = original


FAKE_TENSOR_LOGGER = "torch._subclasses.fake_tensor"
"""The logger of ``torch/_subclasses/fake_tensor.py``, whose ``FakeTensorMode._dispatch_impl``
logs an op that failed on meta with its traceback (``log.exception("failed while attempting to
run meta for %s", func)``) before raising the error (checked in torch 2.13.0)."""


@contextlib.contextmanager
def fake_op_errors_unlogged() -> Iterator[None]:
    """Within the context, an op that fails on fake tensors raises without its traceback also
    going to stderr through :data:`FAKE_TENSOR_LOGGER` (the error itself still propagates, to
    be reported once by the caller); the logger's level is restored on exit."""
    logger = logging.getLogger(FAKE_TENSOR_LOGGER)
    previous = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(previous)


@contextlib.contextmanager
def fake_op_rule(ops: frozenset[Any] | set[Any],
                 rule: Callable[..., Any]) -> Iterator[None]:
    """Within the context, fake tensors run ``ops`` through ``rule(fake_mode, func, *args,
    **kwargs)`` ahead of torch's own fake/meta implementation; removed on exit.

    Mirrors ``torch/_subclasses/fake_impls.py: register_op_impl``, which appends
    ``(check, impl)`` to the private list ``op_implementations_checks`` that
    ``FakeTensorMode.dispatch`` scans first to last; the entry goes first so it wins."""
    from torch._subclasses import fake_impls

    entry = (ops.__contains__, rule)
    fake_impls.op_implementations_checks.insert(0, entry)
    try:
        yield
    finally:
        fake_impls.op_implementations_checks.remove(entry)


# -- calls ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def without_function_modes(kinds: tuple[type, ...]) -> Iterator[None]:
    """Inside the block, the torch-function modes of ``kinds`` at the top of the mode stack
    are popped (``torch/overrides.py: _pop_mode``), and pushed back on exit."""
    from torch.overrides import _get_current_function_mode_stack, _pop_mode, _push_mode

    popped = []
    try:
        while True:
            stack = _get_current_function_mode_stack()
            if not stack or not isinstance(stack[-1], kinds):
                break
            popped.append(_pop_mode())
        yield
    finally:
        for mode in reversed(popped):
            _push_mode(mode)


def storage_use_count(t: torch.Tensor) -> int:
    """References to ``t``'s storage (``c10::StorageImpl`` use count), as autograd's input buffer
    reads it (``torch/csrc/autograd/input_buffer.cpp: can_accumulate_inplace``:
    ``storage().use_count() == 1``). The ``untyped_storage()`` Python object asked for holds one
    more. ``torch._C._storage_Use_Count(storage._cdata)``, torch 2.13.0."""
    return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))


DisableTorchFunction = torch._C.DisableTorchFunction
"""``torch._C.DisableTorchFunction()``: a context where neither ``__torch_function__`` overrides
nor torch-function modes run (``torch/csrc/utils/disable_torch_function.cpp``); unlike the public
``DisableTorchFunctionSubclass`` it also disables modes."""

flatten_dense_tensors = torch._utils._flatten_dense_tensors
"""``torch/_utils.py: _flatten_dense_tensors``: one flat buffer of the tensors (DDP and
``torch.distributed`` coalesce their collectives with it)."""

unflatten_dense_tensors = torch._utils._unflatten_dense_tensors
"""``torch/_utils.py: _unflatten_dense_tensors``: views of a flat buffer shaped as the tensors."""


def is_norm_layer(module: torch.nn.Module) -> bool:
    """A BatchNorm / InstanceNorm layer (``torch/nn/modules/batchnorm.py: _NormBase``, the base
    class holding ``running_mean``, ``running_var`` and ``num_batches_tracked``)."""
    return isinstance(module, torch.nn.modules.batchnorm._NormBase)


def current_graph_task_id() -> Callable[[], int] | None:
    """``torch._C._current_graph_task_id``: -1 outside a backward, the running graph task's id
    inside one (``torch/csrc/autograd/python_engine.cpp``); None where torch lacks it."""
    return getattr(torch._C, "_current_graph_task_id", None)


def fake_mode_active() -> Callable[[], bool]:
    """A function saying whether a ``FakeTensorMode`` is active on this thread (memfit's trace):
    ``torch._C._get_dispatch_mode(_TorchDispatchModeKey.FAKE)``.
    ``FakeTensorMode`` is an infra mode (``torch/_subclasses/fake_tensor.py: _mode_key``): it
    sits in its own slot below the mode stack (``torch/utils/_python_dispatch.py:
    _push_mode``), so a ``TorchDispatchMode`` entered before it still sees every op of its fake
    tensors first, outputs included. Checked in torch 2.13.0 (the same since torch 2.2)."""
    get, key = torch._C._get_dispatch_mode, torch._C._TorchDispatchModeKey.FAKE
    return lambda: get(key) is not None


def sdp_priority_order() -> list[int] | None:
    """The SDPA backend order set with ``sdpa_kernel(..., set_priority=True)`` as
    ``torch.nn.attention.SDPBackend`` values (``torch._C._get_sdp_priority_order``,
    ``THPModule_getSDPPriorityOrder``, torch >= 2.6); None where torch lacks it."""
    getter = getattr(torch._C, "_get_sdp_priority_order", None)
    return list(getter()) if getter is not None else None


def has_dispatch_kernel(op: str, key: str) -> bool:
    """Whether the installed torch registers a kernel for ``op`` (``"aten::rms_norm"``) under
    dispatch key ``key`` (``"AutocastCUDA"``): ``torch._C._dispatch_has_kernel_for_dispatch_key``
    (``torch/csrc/utils/python_dispatch.cpp``). False for an op this torch does not have."""
    try:
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key(op, key))
    except RuntimeError:  # no such operator in this torch
        return False


def clear_cublas_workspaces() -> None:
    """Free cuBLAS's per-handle workspaces (``torch._C._cuda_clearCublasWorkspaces``,
    ``torch/csrc/cuda/Module.cpp``), which ``torch.cuda.empty_cache`` keeps; no-op where torch
    lacks it."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def allocator_settings_setter() -> Callable[[str], None] | None:
    """The setter behind ``torch.cuda.memory._set_allocator_settings``:
    ``torch._C._accelerator_setAllocatorSettings`` (torch >= 2.9) or
    ``torch._C._cuda_cudaCachingAllocator_set_allocator_settings`` (older); None if neither."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        setter = getattr(torch._C, "_cuda_cudaCachingAllocator_set_allocator_settings", None)
    return setter


def ddp_ignore(module: torch.nn.Module, names: list[str]) -> None:
    """DDP leaves the parameters and buffers named ``names`` (qualified) of ``module`` out of its
    buckets and all-reduce: ``torch/nn/parallel/distributed.py:
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model`` (a static method that
    sets ``module._ddp_params_and_buffers_to_ignore``, read by the constructor, and marks each
    tensor ``_ddp_ignored``; checked in torch 2.13.0, the same since torch 1.8). Call it before
    wrapping ``module``."""
    from torch.nn.parallel import DistributedDataParallel

    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)


def fake_store() -> Any:
    """A ``torch.testing._internal.distributed.fake_pg.FakeStore``: the store for
    ``init_process_group("fake", ...)``. Importing that module registers the ``"fake"`` backend
    (``dist.Backend.register_backend(dist.Backend.FAKE, _create_fake_pg, ...)``, a
    ``torch._C._distributed_c10d.FakeProcessGroup`` that communicates nothing); checked in torch
    2.13.0 (the same module and names since torch 2.1)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


# -- private names other modules import directly ------------------------------------------------

PRIVATE_NAMES: dict[str, tuple[str, ...]] = {
    "torch._subclasses.fake_tensor": (
        "DataDependentOutputException", "DynamicOutputShapeException", "FakeTensor",
        "FakeTensorConfig", "FakeTensorMode", "TensorMetadata", "in_kernel_invocation_manager",
        "is_fake",
        "unset_fake_temporarily"),
    "torch._subclasses.fake_impls": ("foreach_run_and_map_input_device",
                                     "op_implementations_checks"),
    "torch.utils._python_dispatch": (
        "TorchDispatchMode", "_disable_current_modes", "is_traceable_wrapper_subclass"),
    "torch.utils._pytree": ("tree_flatten", "tree_map"),
    "torch._C._profiler": ("_EventType", "_RecordFunctionFast"),
    "torch._ops": ("OpOverload",),
    "torch._C": ("DisableTorchFunction", "_DisableTorchDispatch", "_current_graph_task_id",
                 "_TorchDispatchModeKey", "_dispatch_has_kernel_for_dispatch_key",
                 "_get_dispatch_mode", "_get_sdp_priority_order",
                 "_set_conj", "_set_neg", "_set_throw_on_mutable_data_ptr",
                 "_set_warn_deprecated_on_mutable_data_ptr", "_storage_Use_Count"),
    "torch.utils._mode_utils": ("no_dispatch",),
    "torch.overrides": ("_get_current_function_mode_stack", "_pop_mode", "_push_mode"),
    "torch._utils": ("_flatten_dense_tensors", "_unflatten_dense_tensors"),
    "torch.autograd.graph": ("_engine_run_backward",),
    "torch.autograd.profiler": ("_is_profiler_enabled",),
    "torch.cuda.memory": ("_record_memory_history", "_snapshot"),
    "torch.nn.modules.batchnorm": ("_NormBase",),
    "torch.testing._internal.distributed.fake_pg": ("FakeStore",),
    "torch.distributed.tensor._sharding_prop": ("ShardingPropagator",),
    # parallel/measure.py: all_to_all_single, autograd-aware with a Python backward in 2.11-2.13
    # (Note: [the all-to-all's C++ wait])
    "torch.distributed._functional_collectives": ("wait_tensor", "all_to_all_single_autograd",
                                                  "all_to_all_single"),
    # torch_pipelining.py: the schedule's P2P works (Note: [a P2P work keeps its tensor])
    "torch.distributed.pipelining.schedules": ("_batch_p2p",),
    "torch.distributed.tensor._op_schema": ("OpSchema", "OpSpec", "OpStrategy", "TupleStrategy"),
    "torch.distributed.tensor._dtensor_spec": ("DTensorSpec",),
    "torch.distributed.tensor.placement_types": ("_StridedShard",),
    # trace/tracker.py: Note: [dynamo's disable wrapper] (checked in torch 2.13.0)
    "torch._C._dynamo.eval_frame": ("get_eval_frame_callback",),
    "torch._dynamo": ("eval_frame",),
    "torch._dynamo.eval_frame": ("_stance",),
    "torch": ("_disable_dynamo",),
}
"""Every private torch name memfit uses, by module (those looked up with ``getattr`` are in
:data:`OPTIONAL_NAMES`). ``tests/test_compat.py`` checks that each still exists and that
``src/memfit`` uses no private torch name missing here."""

OPTIONAL_NAMES: dict[str, str] = {
    "torch._C._accelerator_setAllocatorSettings": "torch >= 2.9",
    "torch._C._cuda_cudaCachingAllocator_set_allocator_settings": "CUDA builds of older torch",
    "torch._C._cuda_clearCublasWorkspaces": "builds with CUDA",
    # trace/fastkey.py (the fake cache key): each checked before use, the fast key off without it;
    # present in torch 2.11 and 2.13 (the versions the suite ran on)
    "torch.Tensor._has_symbolic_sizes_strides": "2.11, 2.13 (fastkey.supported)",
    "torch._subclasses.fake_tensor.FakeTensorMode._prep_args_for_hash": "2.11, 2.13",
    "torch._subclasses.fake_tensor._DISPATCH_META_HANDLERS": "2.11, 2.13",
    "torch._subclasses.fake_impls.op_implementations_dict": "2.11, 2.13",
    # trace/tracker.py: TrackingFakeMode overrides it (Note: [dynamo's disable wrapper]); 2.13
    "torch.utils._python_dispatch.TorchDispatchMode._should_skip_dynamo": "2.13",
    "torch.Tensor._make_subclass": "2.11, 2.13 (fastkey: cached outputs, lifted constants)",
    # parallel/trace.py: _forget_dtensor_shardings (between fake worlds)
    "torch.distributed.tensor.debug._clear_sharding_prop_cache": "2.13",
    "torch.distributed.tensor.debug._clear_python_sharding_prop_cache": "2.13 (its Python half)",
    # torch_pipelining.py: warmup_vote_static, the schedule's warm-up vote
    "torch.distributed.pipelining._utils.InferenceMode": "2.13 (absent: no vote to answer)",
    # torch_dtensor.py: dtensor_foreach_propagation_once_per_shape, each patched only where present
    "torch.distributed.tensor._sharding_prop._propagate_use_strided_shard_flag": "2.13",
    "torch.distributed.tensor._sharding_prop._expand_single_dim_strategy_to_mesh": "2.13",
    "torch.distributed.fsdp._fully_shard._fsdp_param._chunk_with_empty": "2.11, 2.13",
}
"""Private names looked up with ``getattr`` (absent from some torch versions or builds): when
each is present."""
