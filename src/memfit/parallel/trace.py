"""Trace one rank of a data-parallel step: PyTorch's own DDP / ZeRO-1 / FSDP2 / HSDP applied to
the fake model over a fake process group, so only that rank's shard is ever made (as fake
tensors) and every collective's buffer is an allocation the tracker sees.

Note: [a rank over a fake process group] ``init_process_group("fake", store=FakeStore())``
(``torch/testing/_internal/distributed/fake_pg.py``: ``FakeProcessGroup``, "a process group which
doesn't actually do any communication ... You can run a single rank with a fake process group
without needing multiple processes (simulates per-rank behavior)") gives the rank its world size
and rank; a ``DeviceMesh`` is built on it as in a real run. The collectives return at once and
write nothing, but their output buffers are made by FSDP / DDP themselves, in Python or through
the dispatcher, so the fake mode sees them: FSDP2's all-gather outputs and copy-in buffers, its
reduce-scatter inputs and outputs (``_fsdp_collectives.py: foreach_all_gather,
foreach_reduce``), DDP's flat gradient buckets (``torch/csrc/distributed/c10d/reducer.cpp:
Reducer::initialize_buckets``). FSDP2 frees and re-allocates the all-gather outputs with
``UntypedStorage.resize_``, which no dispatch mode sees; the trace turns those calls into frees
and allocations, as PyTorch's own ``FSDPMemTracker`` does (``torch/distributed/_tools/
mem_tracker.py: MemTracker._track_resize``).

Ranks that hold the same shapes hold the same bytes, so one rank is traced per distinct role:
FSDP2 pads every shard to the same size (``_fsdp_param.py: FSDPParam._init_sharded_param``) but
the optimizer states follow the unpadded local shard (``torch.chunk`` on dim 0), so the last
ranks of an uneven split can differ; ZeRO-1 assigns whole parameters to ranks greedily.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from memfit.categories import MemoryCategory
from memfit.errors import MemfitError
from memfit.models.anatomy import model_shape
from memfit.parallel.apply import apply_model, apply_optimizer
from memfit.parallel.config import Parallel
from memfit.trace.engine import check_request
from memfit.trace.engine import estimate as trace_estimate

if TYPE_CHECKING:
    from memfit._loss import LossFn
    from memfit.gpus import GpuSpec
    from memfit.trace.estimate import Estimate
    from memfit.trace.optim import OptimizerFactory


@dataclasses.dataclass(frozen=True)
class RankRole:
    """One rank traced for every rank in ``ranks`` (they hold the same shapes)."""

    parallel: Parallel
    rank: int
    ranks: tuple[int, ...]

    # -- hooks the trace engine calls (memfit/trace/engine.py: _trace) --------------------------

    @contextlib.contextmanager
    def tracing(self, tracker: Any, fake_mode: Any) -> Iterator[None]:
        """``UntypedStorage.resize_`` becomes a free and an allocation in ``tracker`` while
        ``fake_mode`` tracks (see the module's note); DTensor's metadata propagation, which
        runs each op on global-shape tensors in the active fake mode, is not tracked
        (``torch_internals.dtensor_meta_propagation_within``)."""
        from memfit._compat.torch_internals import dtensor_meta_propagation_within
        from memfit.parallel.apply import loss_context
        from memfit.parallel.streams import fsdp_streams

        original = torch.UntypedStorage.resize_

        def resize_(st: torch.UntypedStorage, size: int) -> Any:
            out = original(st, size)
            if fake_mode.tracking:
                tracker.resize(st, int(size))
            return out

        @contextlib.contextmanager
        def untracked() -> Iterator[None]:
            before, fake_mode.tracking = fake_mode.tracking, False
            try:
                yield
            finally:
                fake_mode.tracking = before

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign, assignment]
        try:
            with (dtensor_meta_propagation_within(untracked), _meshes_made_real(),
                  _wait_returns_its_input(), loss_context(self.parallel), fsdp_streams(tracker),
                  offload_copies(tracker, self.parallel)):
                yield
        finally:
            torch.UntypedStorage.resize_ = original  # type: ignore[method-assign]

    def wrap_model(self, model: nn.Module, tracker: Any, fake_mode: Any) -> nn.Module:
        """The fake model as this rank runs it. DDP's buckets are made by its constructor
        (``Reducer::initialize_buckets``) and live as long as the model: they are tracked as
        gradients from there."""
        if self.parallel.strategy not in ("ddp", "zero1"):
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            from memfit.parallel.apply import device_mesh

            with unset_fake_temporarily():  # the mesh's rank map is read with .tolist()
                if self.parallel.tp > 1:
                    from memfit.parallel.apply import tp_device_mesh

                    mesh = tp_device_mesh(self.parallel, "cpu")
                else:
                    mesh = device_mesh(self.parallel, "cpu") if self.parallel.dp > 1 else None
            return offloaded(apply_model(model, self.parallel, "cpu", mesh), tracker,
                             self.parallel)
        if self.parallel.ep > 1:  # the experts' shards are weights: made before tracking
            from memfit.parallel.expert import apply_ep

            model = apply_ep(model, self.parallel)
        before = len(tracker.infos)
        fake_mode.tracking = True
        try:
            wrapped = apply_model(model, self.parallel, "cpu", init_sync=False)
        finally:
            fake_mode.tracking = False
        for uid in tracker.live.values():
            if uid >= before:
                tracker.infos[uid].role = MemoryCategory.GRADIENTS
        wrapped.register_comm_hook(None, _fake_allreduce_hook)  # type: ignore[operator]
        wrapped.reducer = _NoRebuild(wrapped.reducer)  # type: ignore[assignment]
        return wrapped

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        check_foreach_kinds(optimizer, self.parallel)
        return host_step(apply_optimizer(optimizer, self.parallel), self.parallel)


def check_foreach_kinds(optimizer: torch.optim.Optimizer, parallel: Parallel) -> None:
    """A one-line error for a foreach optimizer over DTensor and plain parameters together,
    which PyTorch refuses at the first step ("aten._foreach_mul_.Scalar got mixed torch.Tensor
    and DTensor": ``torch/distributed/tensor/_dispatch.py``), on a GPU as in the trace: the
    experts FSDP2 leaves out when ``ep`` is every data-parallel rank stay plain tensors beside
    FSDP2's DTensors (the CUDA target's optimizers are foreach; torchtitan 0.3 keeps the
    experts in FSDP2 on a 1-rank mesh instead, which memfit does not model)."""
    from torch.distributed.tensor import DTensor

    for group in optimizer.param_groups:
        kinds = {isinstance(p, DTensor) for p in group["params"]}
        if group.get("foreach") and len(kinds) == 2:
            raise MemfitError(
                f"Parallel: {parallel.describe()} leaves the experts out of FSDP2 as plain "
                "tensors, and a foreach optimizer (the CUDA target's) refuses DTensor and plain "
                f"parameters together; use more data-parallel ranks than ep={parallel.ep} "
                "(FSDP2 then shards the experts over the ranks that hold the same ones) or DDP "
                "(fsdp=1)")


# Note: [CPU offload in a trace] FSDP2's ``CPUOffloadPolicy`` keeps each sharded parameter on the
# host (``torch/distributed/fsdp/_fully_shard/_fsdp_param.py: FSDPParam._init_sharded_param``:
# ``padded_sharded_param.cpu()``), copies it to the device before each all-gather
# (``FSDPParam.all_gather_inputs``: ``sharded_param_data.to(self.device, non_blocking=True)``),
# copies each reduce-scattered gradient shard back to the host (``_fsdp_collectives.py:
# foreach_reduce``: ``new_sharded_grad.to(torch.device("cpu"), ...)``), and the optimizer steps
# on the host parameters, so its states are host memory too. What the trace reports:
# - a CUDA target: the device's bytes (``peak_bytes``: activations, all-gathered parameters,
#   the reduce-scatter buffers, each shard's device copy while it is gathered, each gradient
#   shard until its copy to the host) and, apart, the host's (``host_peak_bytes``: the sharded
#   parameters, gradients, optimizer states and the optimizer step's temporaries). The trace
#   runs a CUDA target on fake CPU tensors (memfit/trace/host.py: Note: [host memory in a CUDA
#   trace]), where those ``.cpu()`` / ``.to("cpu")`` calls would return their input; here they
#   make a host copy of a device tensor and a device copy of a host one, as on the GPU.
# - a CPU target: one memory, as the gloo ranks that check it: the copies are the identity
#   (``Tensor.to`` returns ``self`` on its own device) and the peak is the total, equal to
#   the same layout without offload (measured: equal on 2 gloo ranks).
# Pinned host memory changes no byte of either (apply.py: pin_memory only with CUDA).


def offloaded(model: nn.Module, tracker: Any, parallel: Parallel) -> nn.Module:
    """With ``parallel.cpu_offload``: the sharded parameters of ``model`` (after ``fully_shard``)
    recorded as host memory in a trace of a CUDA target (Note: [CPU offload in a trace])."""
    if parallel.cpu_offload:
        from torch.distributed.tensor import DTensor

        for p in model.parameters():
            tracker.mark_host(p.to_local() if isinstance(p, DTensor) else p)
    return model


def host_step(optimizer: torch.optim.Optimizer, parallel: Parallel) -> torch.optim.Optimizer:
    """With ``parallel.cpu_offload``: ``optimizer.step`` made inside ``host.host_memory()``, so its
    states and temporaries are host memory in a trace of a CUDA target (FSDP2 with
    ``CPUOffloadPolicy`` steps on the host parameters); else ``optimizer`` as it is."""
    if not parallel.cpu_offload:
        return optimizer
    from memfit.trace.host import host_memory

    step = optimizer.step

    def on_host(*args: Any, **kwargs: Any) -> Any:
        with host_memory():
            return step(*args, **kwargs)

    optimizer.step = on_host  # type: ignore[method-assign]
    return optimizer


@contextlib.contextmanager
def offload_copies(tracker: Any, parallel: Parallel) -> Iterator[None]:
    """In a trace of a CUDA target with ``parallel.cpu_offload``: ``Tensor.cpu()`` and
    ``Tensor.to("cpu")`` make a host copy of a tensor standing for device memory and a device
    copy of a host one (FSDP2's copies; Note: [CPU offload in a trace]); nothing otherwise."""
    if not (parallel.cpu_offload and getattr(tracker, "host_split", False)):
        yield
        return
    from torch.overrides import TorchFunctionMode

    from memfit.trace import host

    def to_cpu(func: Any, args: tuple, kwargs: dict) -> bool:
        if func is torch.Tensor.cpu:
            return True
        target = kwargs.get("device", args[1] if len(args) > 1 else None)
        if isinstance(target, str | torch.device) and len(args) <= 2 and "dtype" not in kwargs:
            return torch.device(target).type == "cpu"
        return False

    class Copies(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                               kwargs: dict | None = None) -> Any:
            kwargs = kwargs or {}
            if (func in (torch.Tensor.to, torch.Tensor.cpu) and args
                    and host.is_fake(args[0]) and tracker.host_depth == 0
                    and to_cpu(func, args, kwargs)):
                t = args[0]
                if host.stands_for_device(t):  # device -> host (a gradient shard)
                    return host.copy_to_host(t)
                if tracker.is_host(t):  # host -> device (a parameter shard to all-gather)
                    return t.clone()
            return func(*args, **kwargs)

    with Copies():
        yield


@contextlib.contextmanager
def _wait_returns_its_input() -> Iterator[None]:
    """A functional collective's ``wait_tensor`` returns its input on fake tensors, as it does
    on real ones.

    Note: [wait_tensor on fake tensors] The kernel of ``_c10d_functional::wait_tensor``
    (``c10d::wait_tensor``, declared in ``torch/csrc/distributed/c10d/ProcessGroup.hpp`` of the
    installed 2.13 and defined in ``ProcessGroup.cpp``) pops the tensor's works, waits for them
    and returns the tensor itself; its meta function (``torch/distributed/
    _functional_collectives.py: _wait_tensor_meta``, torch 2.13) returns
    ``torch.empty_like(self)``, a new block the size of the collective's output that the real
    step never makes. Measured on expert parallelism (an all-to-all, then its wait, in each MoE
    layer): the trace's forward high point stood one all-to-all output (32 KiB) above the real
    ranks' until the wait returned its input; on tp 2 with sequence parallelism, the head's
    all-gathered logits (128 KiB) counted twice at the forward's peak, +4.5% of it."""
    from memfit._compat.torch_internals import fake_op_rule

    wait = getattr(getattr(torch.ops, "_c10d_functional", None), "wait_tensor", None)
    if wait is None:
        yield
        return

    def rule(_fake_mode: Any, _func: Any, tensor: torch.Tensor, *args: Any,
             **kwargs: Any) -> torch.Tensor:
        return tensor

    with fake_op_rule({wait.default}, rule):
        yield


@contextlib.contextmanager
def _meshes_made_real() -> Iterator[None]:
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


class _NoRebuild:
    """DDP's reducer without its bucket rebuild.

    Note: [DDP's bucket rebuild in a trace] Before the second forward DDP re-buckets the
    gradients in the order the first backward produced them (``distributed.py:
    DistributedDataParallel._pre_forward`` -> ``reducer.cpp: Reducer::rebuild_buckets``), after
    agreeing on the order with a broadcast whose indices it reads on the host
    (``sync_bucket_indices``), which a fake tensor cannot answer. The rebuild frees the buckets
    (``initialize_buckets`` clears ``buckets_`` first) and allocates new ones holding the same
    gradients, so the total is unchanged; the trace keeps the first buckets."""

    def __init__(self, reducer: Any) -> None:
        self._reducer = reducer

    def _rebuild_buckets(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reducer, name)


def _fake_allreduce_hook(_state, bucket):  # type: ignore[no-untyped-def]
    # (no annotations: DDP's _check_comm_hook compares them with dist.GradBucket and
    # torch.futures.Future[torch.Tensor], and this module's are strings)
    """DDP's default communication, in place on the bucket, with a future that carries it.

    Note: [DDP over a fake process group] DDP's default hook (``torch/csrc/distributed/c10d/
    default_comm_hooks.cpp: AllReduceCommHook::runHook``) returns the all-reduce's future, whose
    value the reducer takes as the reduced bucket (``reducer.cpp: Reducer::run_comm_hook``); a
    fake process group's work (``FakeWork``) completes with no value, and the reducer's check
    fails. This hook does what the default does to the bucket's memory: divides it in place by
    the world size (``Reducer::mark_variable_ready_dense``'s ``div_factor``) and all-reduces it
    in place, returning the bucket itself."""
    import torch.distributed as dist

    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size())
    dist.all_reduce(buffer)
    future = torch.futures.Future()  # type: ignore[var-annotated]
    future.set_result(buffer)
    return future


def traced_ddp(make: Callable[[], Any], tracker: Any, fake_mode: Any) -> Any:
    """``make()`` (a ``DistributedDataParallel`` constructor call) run with ``fake_mode``
    tracking, so that its buckets (``Reducer::initialize_buckets``, alive as long as the model)
    are tracked as gradients; the wrapper then reduces with :func:`_fake_allreduce_hook` and
    keeps its first buckets (:class:`_NoRebuild`), as :meth:`RankRole.wrap_model` does for the
    whole model (a pipeline stage's DDP: ``memfit.parallel.pipeline.replicate_stages``)."""
    before = len(tracker.infos)
    fake_mode.tracking = True
    try:
        wrapped = make()
    finally:
        fake_mode.tracking = False
    for uid in tracker.live.values():
        if uid >= before:
            tracker.infos[uid].role = MemoryCategory.GRADIENTS
    wrapped.register_comm_hook(None, _fake_allreduce_hook)
    wrapped.reducer = _NoRebuild(wrapped.reducer)
    return wrapped


# -- roles -------------------------------------------------------------------------------------

def _chunk(dim0: int, parts: int, index: int) -> int:
    """Rows of ``torch.chunk(t, parts)[index]`` (empty past the end), as FSDP2 shards dim 0."""
    size = -(-dim0 // parts)
    return max(0, min(size, dim0 - index * size))


def _zero1_partition(numels: list[int], world: int) -> list[tuple[int, ...]]:
    """Numels of the parameters each rank's ZeroRedundancyOptimizer keeps the states of:
    largest first, each to the rank with the fewest elements so far (``torch/distributed/optim/
    zero_redundancy_optimizer.py: ZeroRedundancyOptimizer._partition_parameters``, one group)."""
    sizes = [0] * world
    parts: list[list[int]] = [[] for _ in range(world)]
    for n in sorted(numels, reverse=True):
        rank = sizes.index(min(sizes))
        parts[rank].append(n)
        sizes[rank] += n
    return [tuple(p) for p in parts]


def rank_roles(model: nn.Module, parallel: Parallel) -> list[RankRole]:
    """Ranks grouped by what they hold, the first of each group traced for all of it."""
    if parallel.pp > 1:  # one role per pipeline stage (memfit/parallel/pipeline.py)
        from memfit.parallel.pipeline import pipeline_roles

        return pipeline_roles(model, parallel)
    params = [p for p in model.parameters()]
    signatures: list[Any]
    if parallel.tp > 1:
        signatures = _tp_signatures(model, parallel)
    elif parallel.strategy in ("fsdp", "hsdp"):
        signatures = [tuple(_chunk(p.shape[0] if p.dim() else 1, parallel.fsdp,
                                   rank % parallel.fsdp) for p in params)
                      for rank in range(parallel.gpus)]
    elif parallel.strategy == "zero1":
        parts = _zero1_partition([p.numel() for p in params if p.requires_grad], parallel.dp)
        signatures = [parts[rank] for rank in range(parallel.gpus)]
    else:
        signatures = [()] * parallel.gpus
    groups: dict[Any, list[int]] = {}
    for rank, sig in enumerate(signatures):
        groups.setdefault(sig, []).append(rank)
    return [RankRole(parallel, ranks[0], tuple(ranks)) for ranks in groups.values()]


def _tp_signatures(model: nn.Module, parallel: Parallel) -> list[Any]:
    """Each rank's local shapes under tensor parallelism (and FSDP2 over the dp dim): rank
    ``dp_index * tp + tp_index`` of the ``("dp", "tp")`` mesh holds the ``tp_index`` chunk of
    each split dim (:func:`memfit.parallel.apply.tp_split_dims`), then FSDP2's ``dp_index`` chunk
    of that local tensor's dim 0."""
    from memfit.parallel.apply import tp_split_dims

    split = tp_split_dims(model, parallel)
    params = list(model.parameters())
    signatures = []
    for rank in range(parallel.gpus):
        dp_index, tp_index = divmod(rank, parallel.tp)
        signatures.append(local_shapes(params, split, parallel.tp, tp_index, parallel.fsdp,
                                       dp_index % parallel.fsdp))
    return signatures


def local_shapes(params: list[nn.Parameter], split: dict[int, int], tp: int, tp_index: int,
                 shards: int, shard_index: int) -> tuple[tuple[int, ...], ...]:
    """The shapes rank ``(shard_index, tp_index)`` holds of ``params``: the ``tp_index`` chunk
    of each dim tensor parallelism splits (``split``: ``id(param) -> dim``), then FSDP2's
    ``shard_index`` chunk of that local tensor's dim 0 (``torch.chunk``'s sizes)."""
    sig = []
    for p in params:
        shape = list(p.shape)
        if id(p) in split:
            dim = split[id(p)]
            shape[dim] = _chunk(shape[dim], tp, tp_index)
        if shards > 1 and shape:
            shape[0] = _chunk(shape[0], shards, shard_index)
        sig.append(tuple(shape))
    return tuple(sig)


@contextlib.contextmanager
def fake_world(world: int, rank: int) -> Iterator[None]:
    """torch.distributed initialised as ``rank`` of ``world`` over a fake process group (see
    the module's note), destroyed on exit."""
    import torch.distributed as dist

    from memfit._compat.torch_internals import fake_store

    if not dist.is_available():
        raise MemfitError("parallel= needs torch.distributed, which this torch build lacks")
    if dist.is_initialized():
        raise MemfitError("parallel= traces over its own fake process group, but "
                          "torch.distributed is already initialised in this process; run the "
                          "estimate before init_process_group() or in another process")
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
        _forget_dtensor_shardings()


def _forget_dtensor_shardings() -> None:
    """Clear DTensor's sharding-propagation caches (``torch/distributed/tensor/debug:
    _clear_sharding_prop_cache``, torch 2.13; its Python half alone where that is missing).

    Note: [DTensor's caches outlive a world] The caches are keyed by the ops' specs, whose
    meshes compare equal across process groups (``device_mesh.py: DeviceMesh.__eq__``: rank
    map, layout, device type, names), and a cached output sharding keeps the mesh it was made
    on: the next world (another rank role, another estimate) would redistribute over the
    destroyed world's groups ("Could not resolve the process group registered under the
    name 3", seen with tp 2 x fsdp 2 after a tp 2 trace in one process)."""
    import importlib

    debug = importlib.import_module("torch.distributed.tensor.debug")
    clear = (getattr(debug, "_clear_sharding_prop_cache", None)
             or getattr(debug, "_clear_python_sharding_prop_cache", None))
    if clear is not None:
        clear()


def estimate_ranks(run: Callable[[RankRole], Any], model: nn.Module, parallel: Parallel) -> Any:
    """Trace each rank role with ``run(role)`` (an :func:`memfit.trace.estimate` of that rank)
    and return the estimate of the rank with the highest peak, carrying every role's estimate in
    ``per_rank``."""
    if not isinstance(parallel, Parallel):
        raise MemfitError(f"parallel must be a memfit.Parallel, not {type(parallel).__name__}")
    heads, kv_heads, layers = model_shape(model)
    parallel.check_model(heads=heads, kv_heads=kv_heads, layers=layers)
    if parallel.ep > 1:
        from memfit.parallel.expert import check_experts

        check_experts(model, parallel)
    estimates = []
    from memfit.trace.replay import ReplayMismatch, counts, disabled

    for role in rank_roles(model, parallel):
        try:
            with fake_world(parallel.gpus, role.rank):
                est = run(role)
        except Exception as exc:  # Note: [replaying a pipeline stage's micro-batches]
            cause: BaseException | None = exc  # the schedule wraps a backward's error
            while cause is not None and not isinstance(cause, ReplayMismatch):
                cause = cause.__cause__
            if cause is None:
                raise
            state = getattr(role, "state", None)
            if isinstance(state, dict):  # a pipeline role's stages, built in that world
                state.clear()
            counts["redone"] += 1
            with disabled(), fake_world(parallel.gpus, role.rank):
                est = run(role)
        estimates.append(dataclasses.replace(est, ranks=role.ranks, parallel=parallel))
    worst = max(estimates, key=lambda e: (e.peak_reserved_bytes, e.peak_bytes))
    return dataclasses.replace(worst, per_rank=tuple(estimates))


def estimate(model: nn.Module, inputs: Any, *, optimizer: str | OptimizerFactory | None = "adamw",
             precision: str = "fp32", loss_fn: LossFn | None = None,
             device: str = "cuda", gpu: str | GpuSpec | None = None, steps: int = 2,
             expandable_segments: bool = False, num_gpus: int = 1,
             keep_output: bool = False, parallel: Parallel | None = None) -> Estimate:
    """``memfit.estimate``: :func:`memfit.trace.estimate` (see there for every argument), and
    with ``parallel``, a :class:`memfit.Parallel` layout, each distinct rank of it traced running
    PyTorch's own DDP / ZeRO-1 / FSDP2 / HSDP over a fake process group, the result being the
    rank with the highest peak and ``per_rank`` holding one estimate per rank role.

    >>> est = memfit.estimate(model, inputs, device="cpu", parallel=Parallel(gpus=8, fsdp=8))
    """
    kwargs: dict[str, Any] = dict(
        optimizer=optimizer, precision=precision, loss_fn=loss_fn, device=device, gpu=gpu,
        steps=steps, expandable_segments=expandable_segments, keep_output=keep_output)
    if parallel is None:
        return trace_estimate(model, inputs, num_gpus=num_gpus, **kwargs)
    check_request(model, optimizer=optimizer, precision=precision, loss_fn=loss_fn,
                  device=device, steps=steps)
    return estimate_ranks(lambda role: trace_estimate(
        model, inputs, num_gpus=max(num_gpus, getattr(parallel, "gpus", 1)), rank=role,
        **kwargs), model, parallel)
