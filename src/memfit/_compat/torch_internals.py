"""torch internals memfit patches, walks or calls, each behind one function.

Each was checked against torch 2.13.0 (the CPU test machine; the GPU machines run 2.11, where
``tests/test_compat.py`` runs too). ``tests/test_compat.py`` checks every entry against the
installed torch and names the internal in its failure message.
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
    "autograd_backward_keeps_function_modes",
    "called_by_autograd_engine",
    "clear_cublas_workspaces",
    "current_graph_task_id",
    "ddp_ignore",
    "device_meshes_made_real",
    "dtensor_foreach_propagation_once_per_shape",
    "dtensor_meta_propagation_within",
    "engine_run_backward",
    "fake_mode_active",
    "fake_op_errors_unlogged",
    "fake_op_rule",
    "fake_store",
    "flatten_dense_tensors",
    "fsdp_chunks_on_demand",
    "has_dispatch_kernel",
    "is_norm_layer",
    "p2p_works_hold_their_tensors",
    "queue_engine_callback",
    "reporting_get_rng_state",
    "sdp_priority_order",
    "storage_resizes_reported",
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
                         os.path.basename(__file__))
"""Python frames between the engine and a dispatch mode: fake-tensor dispatch
(``torch/_subclasses/fake_tensor.py``), ``torch/utils/_python_dispatch.py`` and
``torch._dynamo``'s disable wrapper (``torch/_dynamo/eval_frame.py``, ``_compile.py``)."""


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


@contextlib.contextmanager
def dtensor_meta_propagation_within(
        context: Callable[[], contextlib.AbstractContextManager[Any]]) -> Iterator[None]:
    """Within the context, DTensor's output-metadata propagation runs inside ``context()``.

    ``torch/distributed/tensor/_sharding_prop.py:
    ShardingPropagator._propagate_tensor_meta_non_cached`` (torch 2.13.0; since 2.5) derives an
    op's global output shape by running it on global-shape tensors made in the active fake mode
    (``detect_fake_mode() or FakeTensorMode()``, "so that it avoids materializing memory"). In a
    trace that mode is the tracking one, and those metadata-only tensors would count as
    allocations (the full size of every parameter an optimizer touches, at each cache miss).
    Patched on the class, restored on exit."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def propagate(self: Any, op_schema: Any) -> Any:
        with context():
            return original(self, op_schema)

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate  # type: ignore[method-assign]
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original  # type: ignore[method-assign]


@contextlib.contextmanager
def dtensor_foreach_propagation_once_per_shape() -> Iterator[None]:
    """Within the context, DTensor's sharding propagation of a foreach op (an optimizer's
    ``_foreach_*`` over every parameter) works once per distinct element, not once per element;
    its result is the same.

    Note: [DTensor's foreach propagation] ``torch/distributed/tensor/_sharding_prop.py:
    ShardingPropagator.propagate_op_sharding_non_cached`` (torch 2.13.0) costs, at the first
    call of each foreach op (its result is cached by schema after that), time quadratic in the
    list's length: about 11 of the 19-23 CPU-s of a process's first per-rank trace of a 64-way
    FSDP2 Llama-3-70B (its first AdamW step: 723 parameters, 7 foreach ops):

    - ``_expand_single_dim_strategy_to_mesh``'s ``expanded_foreach_strategy`` (``_ops/
      single_dim_strategy.py``) builds each element's schema with a pytree map over every list
      and expands each element's strategy. An element's strategy is a function of its own
      inputs' specs (the ``DTensorSpec`` of each list at that index: mesh, placements, shard
      order, strided flag, shape, stride, dtype), its output's ``TensorMeta`` and the arguments
      that are not lists of tensors, which all elements share. Here the elements are grouped by
      exactly those values, the original expands a schema holding one element of each group, and
      each element gets its group's strategy (the caller only reads it: ``_propagate_use_
      strided_shard_flag`` fixes it up idempotently, ``_select_min_cost_strategy`` selects, the
      specs are copied with each element's own tensor metadata).
    - ``_propagate_use_strided_shard_flag(strategy, op_schema)``, called for each element,
      rebuilds ``op_schema.args_spec`` (every list) and scans every spec's placements each time;
      it reads ``op_schema`` only through ``args_spec`` and returns at once when no spec holds a
      ``_StridedShard``. Here the specs are found once per ``op_schema`` and the function runs
      (on those specs) only when one does.

    - ``ShardingPropagator._propagate_tensor_meta_non_cached`` runs the op on global-shape fake
      tensors made from every element's spec to learn the outputs' ``TensorMeta`` (the meta
      kernel of each element in Python). A foreach op's output at an index is a function of the
      inputs at that index (the lists' specs, a scalar list's value) and of the shared scalars,
      so the op runs on one element of each group of identical indices and each element gets
      its group's ``TensorMeta`` (an immutable tuple). Only ops whose arguments are lists of
      specs or numbers and shared numbers are grouped; anything else runs as torch runs it.

    The first two are patched on ``_sharding_prop`` (the caller looks the names up there), the
    third on the class (on top of :func:`dtensor_meta_propagation_within`'s patch when that is
    entered first), each restored on exit; the first two are skipped where torch lacks them."""
    from torch.distributed.tensor import _sharding_prop
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, TupleStrategy
    from torch.distributed.tensor.placement_types import _StridedShard

    flag = getattr(_sharding_prop, "_propagate_use_strided_shard_flag", None)
    expand = getattr(_sharding_prop, "_expand_single_dim_strategy_to_mesh", None)
    last: list[Any] = [None, None]  # the op_schema seen last, its specs if one is strided

    class _Specs:
        __slots__ = ("args_spec",)

        def __init__(self, specs: tuple[Any, ...]) -> None:
            self.args_spec = specs

    def propagate_flag(op_strategy: Any, op_schema: Any = None, *rest: Any, **kw: Any) -> Any:
        if rest or kw or type(op_schema) is not OpSchema:  # another signature
            return flag(op_strategy, op_schema, *rest, **kw)  # type: ignore[misc]
        if last[0] is not op_schema:
            specs = op_schema.args_spec
            strided = any(isinstance(p, _StridedShard) for s in specs for p in s.placements)
            last[0], last[1] = op_schema, _Specs(specs) if strided else None
        if last[1] is not None:
            flag(op_strategy, last[1])  # type: ignore[misc]
        return None

    def element_key(child: Any) -> Any:
        """The whole state of a list element's input strategy as ``_wrap_with_op_strategy``
        makes it (one ``OpSpec`` of one ``DTensorSpec``), or None for any other shape."""
        if type(child) is not OpStrategy or len(child.strategies) != 1:
            return None
        spec = child.strategies[0]
        out = spec.output_specs
        if (type(spec) is not OpSpec or spec.input_specs is not None
                or spec.redistribute_cost is not None or type(out) is not DTensorSpec):
            return None
        return out, out.use_strided_shard_as_shard_order

    def expand_grouped(*call: Any, **kw: Any) -> Any:
        if len(call) != 4 or kw or type(call[1]) is not OpSchema:  # another signature
            return expand(*call, **kw)  # type: ignore[misc]
        mesh, op_schema, info, out_meta = call
        args = op_schema.args_schema
        lists = [i for i, a in enumerate(args) if type(a) is TupleStrategy]
        if not lists or not op_schema.op.name().startswith(
                ("aten::_foreach_", "aten::_amp_foreach_", "aten::_fused_")):
            return expand(mesh, op_schema, info, out_meta)  # type: ignore[misc]
        length = len(args[lists[0]].children)
        if any(len(args[i].children) != length for i in lists) or (
                out_meta is not None and (not isinstance(out_meta, (list, tuple))
                                          or len(out_meta) != length)):
            return expand(mesh, op_schema, info, out_meta)  # type: ignore[misc]
        group_of: dict[Any, int] = {}
        groups: list[int] = []
        firsts: list[int] = []
        for j in range(length):
            key = tuple(element_key(args[i].children[j]) for i in lists)
            if None in key:
                return expand(mesh, op_schema, info, out_meta)  # type: ignore[misc]
            key += (out_meta[j] if out_meta is not None else None,)
            g = group_of.setdefault(key, len(group_of))
            if g == len(firsts):
                firsts.append(j)
            groups.append(g)
        if len(firsts) == length:
            return expand(mesh, op_schema, info, out_meta)  # type: ignore[misc]
        reduced = OpSchema(op_schema.op, tuple(
            TupleStrategy([a.children[j] for j in firsts]) if i in lists else a
            for i, a in enumerate(args)), op_schema.kwargs_schema,
            schema_info=op_schema.schema_info)
        reduced_meta = None if out_meta is None else [out_meta[j] for j in firsts]
        run = expand(mesh, reduced, info, reduced_meta)  # type: ignore[misc]

        def expanded(op: Any, _args: Any, _kwargs: Any) -> Any:
            children = run(op, reduced.args_meta, reduced.kwargs_meta).children
            return TupleStrategy([children[g] for g in groups])

        return expanded

    propagator = _sharding_prop.ShardingPropagator
    meta = propagator._propagate_tensor_meta_non_cached

    def meta_grouped(self: Any, op_schema: Any) -> Any:
        args = op_schema.args_schema
        if (type(op_schema) is not OpSchema or op_schema.kwargs_schema
                or not op_schema.op.name().startswith(("aten::_foreach_", "aten::_fused_"))):
            return meta(self, op_schema)
        lists = [i for i, a in enumerate(args) if isinstance(a, list | tuple)]
        length = len(args[lists[0]]) if lists else 0
        for i, a in enumerate(args):
            if i in lists:
                if len(a) != length or not all(type(x) is DTensorSpec or type(x) in _NUMBERS
                                               for x in a):
                    return meta(self, op_schema)
            elif not (a is None or type(a) in _NUMBERS):  # a tensor, a spec: shared, keep
                return meta(self, op_schema)
        if not any(type(args[i][0]) is DTensorSpec for i in lists):
            return meta(self, op_schema)
        group_of: dict[Any, int] = {}
        groups: list[int] = []
        firsts: list[int] = []
        for j in range(length):
            key = tuple((args[i][j], args[i][j].use_strided_shard_as_shard_order)
                        if type(args[i][j]) is DTensorSpec else (type(args[i][j]), args[i][j])
                        for i in lists)
            g = group_of.setdefault(key, len(group_of))
            if g == len(firsts):
                firsts.append(j)
            groups.append(g)
        if len(firsts) == length:
            return meta(self, op_schema)
        reduced = OpSchema(op_schema.op, tuple(
            type(a)(a[j] for j in firsts) if i in lists else a for i, a in enumerate(args)),
            {}, schema_info=op_schema.schema_info)
        out = meta(self, reduced)
        if out is None:
            return None
        if not isinstance(out, list | tuple) or len(out) != len(firsts):
            return meta(self, op_schema)
        return type(out)(out[g] for g in groups)

    if flag is not None:
        _sharding_prop._propagate_use_strided_shard_flag = propagate_flag
    if expand is not None:
        _sharding_prop._expand_single_dim_strategy_to_mesh = expand_grouped
    propagator._propagate_tensor_meta_non_cached = meta_grouped  # type: ignore[method-assign]
    try:
        yield
    finally:
        if flag is not None:
            _sharding_prop._propagate_use_strided_shard_flag = flag
        if expand is not None:
            _sharding_prop._expand_single_dim_strategy_to_mesh = expand
        propagator._propagate_tensor_meta_non_cached = meta  # type: ignore[method-assign]
        last.clear()


_NUMBERS = (int, float, bool, complex)


class _ChunksOnDemand:
    """``torch/distributed/fsdp/_fully_shard/_fsdp_common.py: _chunk_with_empty(tensor,
    num_chunks, dim)`` (``torch.chunk``, then ``chunks[0].new_empty(0)`` for each missing chunk)
    as a sequence whose chunks are made when first read: chunk ``i`` is ``tensor.narrow(dim,
    i * size, ...)`` with ``size = ceil(length / num_chunks)``, the view ``torch.chunk`` makes
    (``aten/src/ATen/native/TensorShape.cpp: chunk`` splits by that size)."""

    def __init__(self, tensor: torch.Tensor, num_chunks: int, dim: int) -> None:
        self._tensor, self._n, self._dim = tensor, num_chunks, dim
        self._length = tensor.size(dim)
        self._size = -(-self._length // num_chunks)
        self._count = -(-self._length // self._size)  # chunks torch.chunk returns
        self._made: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._n))]
        i = index + self._n if index < 0 else index
        if not 0 <= i < self._n:
            raise IndexError(index)
        made = self._made.get(i)
        if made is None:
            if i < self._count:
                start = i * self._size
                made = self._tensor.narrow(self._dim, start,
                                           min(self._size, self._length - start))
            else:
                made = self[0].new_empty(0)
            self._made[i] = made
        return made

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (self[i] for i in range(self._n))


@contextlib.contextmanager
def fsdp_chunks_on_demand() -> Iterator[None]:
    """Within the context, FSDP2 makes only the chunks of a parameter it reads.

    ``fully_shard`` splits each parameter into one chunk per rank and reads two of them
    (``torch/distributed/fsdp/_fully_shard/_fsdp_param.py: FSDPParam._init_sharded_param``:
    ``chunks[shard_rank]`` and ``chunks[0].size()``; ``_init_sharded_post_forward_param_
    metadata``: ``chunks[shard_mesh_rank]``), through ``_chunk_with_empty``. On fake tensors
    each of the 64 views of a 64-way split costs a fake tensor (about 1.5 CPU-s of a 70B
    per-rank trace over 64 ranks, torch 2.13.0); :class:`_ChunksOnDemand` makes the same
    views, those read. Patched on ``_fsdp_param`` (which imported the name), restored on exit;
    a no-op where torch lacks it.
    Anything but a positive count and a non-empty dimension goes to the original."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param
    except ImportError:
        yield
        return
    original = getattr(_fsdp_param, "_chunk_with_empty", None)
    if original is None:
        yield
        return

    def chunk_with_empty(tensor: Any, num_chunks: Any, dim: Any) -> Any:
        if (type(num_chunks) is not int or num_chunks < 1 or type(dim) is not int
                or not isinstance(tensor, torch.Tensor) or not 0 <= dim < tensor.dim()
                or tensor.size(dim) < 1):
            return original(tensor, num_chunks, dim)
        return _ChunksOnDemand(tensor, num_chunks, dim)

    _fsdp_param._chunk_with_empty = chunk_with_empty
    try:
        yield
    finally:
        _fsdp_param._chunk_with_empty = original


# -- distributed: a rank traced over a fake process group (memfit/parallel) ---------------------


@contextlib.contextmanager
def storage_resizes_reported(on_resize: Callable[[torch.UntypedStorage, int], None]
                             ) -> Iterator[None]:
    """Inside the block, ``torch.UntypedStorage.resize_`` also calls ``on_resize(storage,
    size)`` after it resized; torch's own method again on exit.

    FSDP2 frees and re-allocates its all-gather outputs with ``UntypedStorage.resize_``
    (``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``: ``free_storage``,
    ``alloc_storage``), which no dispatch mode sees; PyTorch's own ``FSDPMemTracker`` patches
    the same method for the same reason (``torch/distributed/_tools/mem_tracker.py:
    MemTracker._track_resize``, torch 2.13.0)."""
    original = torch.UntypedStorage.resize_

    def resize_(st: torch.UntypedStorage, size: int) -> Any:
        out = original(st, size)
        on_resize(st, int(size))
        return out

    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original  # type: ignore[method-assign]


@contextlib.contextmanager
def device_meshes_made_real() -> Iterator[None]:
    """Inside the block, a ``DeviceMesh`` is constructed outside the fake mode; restored after.

    Note: [FSDP2 over tensor parallelism in a trace] ``fully_shard`` over DTensor parameters
    builds each parameter's 2-D ``(dp, tp)`` mesh while it shards (``torch/distributed/fsdp/
    _fully_shard/_fsdp_param.py: FSDPParam._init_sharding_spec_tp`` -> ``DeviceMesh.
    _concatenate``), and a mesh finds its own coordinates with ``(mesh == rank).nonzero()``
    on its rank map (``device_mesh.py: DeviceMesh._compute_coordinates_from_mesh``), a real
    CPU tensor that a fake mode would turn into a fake one of unknown size. A mesh holds no
    device memory."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        with unset_fake_temporarily():
            original(self, *args, **kwargs)

    DeviceMesh.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        DeviceMesh.__init__ = original  # type: ignore[method-assign]


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
    the single-device step does (``memfit/trace/engine.py: _backward``), the engine is entered
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
    "torch.distributed._functional_collectives": ("wait_tensor", "all_to_all_single_autograd"),
    # memfit/parallel/pipeline.py: the schedule's P2P works (Note: [a P2P work keeps its tensor])
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
    # memfit/parallel/pipeline.py: _static_metadata, the schedule's warm-up vote
    "torch.distributed.pipelining._utils.InferenceMode": "2.13 (absent: no vote to answer)",
    # dtensor_foreach_propagation_once_per_shape: each patched only where present
    "torch.distributed.tensor._sharding_prop._propagate_use_strided_shard_flag": "2.13",
    "torch.distributed.tensor._sharding_prop._expand_single_dim_strategy_to_mesh": "2.13",
    "torch.distributed.fsdp._fully_shard._fsdp_param._chunk_with_empty": "2.11, 2.13",
}
"""Private names looked up with ``getattr`` (absent from some torch versions or builds): when
each is present."""
