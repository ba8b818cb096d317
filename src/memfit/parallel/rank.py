"""One rank of a parallel layout as the trace engine runs it (:class:`RankRole`, the engine's
rank hooks): PyTorch's own DDP / ZeRO-1 / FSDP2 / HSDP applied to the fake model over a fake
process group, so only that rank's shard is ever made (as fake tensors) and every collective's
buffer is an allocation the tracker sees; and the shapes a rank holds, by which ranks are
grouped into roles (:mod:`memfit.parallel.trace` drives the roles).

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
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from memfit.categories import MemoryCategory
from memfit.errors import MemfitError
from memfit.parallel.apply import apply_model, apply_optimizer
from memfit.parallel.config import Parallel


@dataclasses.dataclass(frozen=True)
class RankRole:
    """One rank traced for every rank in ``ranks`` (they hold the same shapes)."""

    parallel: Parallel
    rank: int
    ranks: tuple[int, ...]

    # -- hooks the trace engine calls (memfit/trace/engine.py: _trace; step.py: run_steps) -------

    @contextlib.contextmanager
    def tracing(self, tracker: Any, fake_mode: Any) -> Iterator[None]:
        """``UntypedStorage.resize_`` becomes a free and an allocation in ``tracker`` while
        ``fake_mode`` tracks (see the module's note); DTensor's metadata propagation, which
        runs each op on global-shape tensors in the active fake mode, is not tracked
        (``torch_dtensor.dtensor_meta_propagation_within``)."""
        from memfit._compat.torch_dtensor import (
            device_meshes_made_real,
            dtensor_meta_propagation_within,
        )
        from memfit._compat.torch_fsdp import storage_resizes_reported
        from memfit.parallel.apply import loss_context
        from memfit.parallel.streams import fsdp_streams

        def resized(st: torch.UntypedStorage, size: int) -> None:
            if fake_mode.tracking:
                tracker.resize(st, size)

        @contextlib.contextmanager
        def untracked() -> Iterator[None]:
            before, fake_mode.tracking = fake_mode.tracking, False
            try:
                yield
            finally:
                fake_mode.tracking = before

        with (storage_resizes_reported(resized), dtensor_meta_propagation_within(untracked),
              device_meshes_made_real(), _wait_returns_its_input(), loss_context(self.parallel),
              fsdp_streams(tracker), offload_copies(tracker, self.parallel)):
            yield

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
                    mesh = (device_mesh(self.parallel, "cpu") if self.parallel.strategy != "none"
                            else None)
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
        wrapped.reducer = _NoRebuild(  # type: ignore[assignment]
            wrapped.reducer, model, tracker, int(self.parallel.bucket_cap_mb * 2**20))
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
        if group.get("foreach") and len(kinds) == 2 and parallel.tp > 1:
            raise MemfitError(
                f"Parallel: {parallel.describe()} keeps every rank's own experts as plain "
                "tensors beside tensor parallelism's DTensors, and a foreach optimizer (the "
                "CUDA target's) refuses DTensor and plain parameters together; use an ep "
                f"below dp * tp = {parallel.dp * parallel.tp} with FSDP2 over dp > 1 (which "
                "shards the experts over the ranks that hold the same ones), or tp=1")
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


class _NoRebuild:
    """DDP's reducer without its bucket rebuild.

    Note: [DDP's bucket rebuild in a trace] Before the second forward DDP re-buckets the
    gradients in the order the first backward produced them (``distributed.py:
    DistributedDataParallel._pre_forward`` -> ``reducer.cpp: Reducer::rebuild_buckets``), after
    agreeing on the order with a broadcast whose indices it reads on the host
    (``sync_bucket_indices``), which a fake tensor cannot answer. The rebuild frees the buckets
    (``initialize_buckets`` clears ``buckets_`` first) and allocates new ones holding the same
    gradients, so the total is unchanged; the trace keeps the first buckets.

    Note: [DDP's first buckets on NCCL] On a CUDA target the first buckets are not freed by the
    rebuild: the first backward's all-reduce works hold them (ProcessGroupNCCL stashes a
    collective's tensors, ``stashed_for_allocator_safety_``, until ``work.wait()`` or the
    watchdog's clean-up of the finished work; DDP waits on the work's future, not the work), so
    they are alive beside the rebuilt buckets in the second step. Measured at world size 1 on
    an H100 and an H200 (torch 2.11.0+cu130, ``bench/parallel_cuda.py --anatomy``): at the second
    step's peak the constructor's bucket block and the 13 rebuilt ones were both allocated, DDP
    and ZeRO-1 10.3% over the trace without this; with a 1 s pause after each step DDP's were
    freed in time (+0.19%), ZeRO-1's were not (−10.1%). The trace of a CUDA target holds a
    second set of buckets from the rebuild to the end: the case a training loop without pauses
    meets (bench/results/parallel-cuda-h100-2026-11-27.json)."""

    def __init__(self, reducer: Any, module: nn.Module | None = None,
                 tracker: Any = None, cap_bytes: int = 25 << 20) -> None:
        self._reducer = reducer
        self._module = module
        self._tracker = tracker
        self._cap_bytes = cap_bytes
        self._held: list[torch.Tensor] | None = None

    def _rebuild_buckets(self) -> bool:
        if (self._held is None and self._module is not None and self._tracker is not None
                and self._tracker.host_split):  # a CUDA target: Note: [DDP's first buckets on NCCL]
            self._held = _rebuilt_buckets(self._module, self._tracker, self._cap_bytes)
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reducer, name)


def _rebuilt_buckets(module: nn.Module, tracker: Any, cap_bytes: int) -> list[torch.Tensor]:
    """The rebuilt buckets as the reducer fills them (the parameters in the first backward's
    order, taken as the reverse of their order, each dtype apart, a bucket closed once it
    reaches ``cap_bytes``), tracked as gradients."""
    params = [p for p in module.parameters() if p.requires_grad][::-1]
    buckets: list[torch.Tensor] = []
    open_: dict[torch.dtype, tuple[torch.Tensor, int]] = {}

    def close(dtype: torch.dtype) -> None:
        like, numel = open_.pop(dtype)
        bucket = like.new_empty((numel,), dtype=dtype)
        tracker.track(bucket, MemoryCategory.GRADIENTS)
        buckets.append(bucket)

    for p in params:
        like, numel = open_.get(p.dtype, (p, 0))
        open_[p.dtype] = (like, numel + p.numel())
        if (numel + p.numel()) * p.element_size() >= cap_bytes:
            close(p.dtype)
    for dtype in list(open_):
        close(dtype)
    return buckets


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
    whole model (a pipeline stage's DDP:
    ``memfit.parallel.pipeline_parallelize.replicate_stages``)."""
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


# -- what a rank holds -----------------------------------------------------------------------------

def chunk_rows(dim0: int, parts: int, index: int) -> int:
    """Rows of ``torch.chunk(t, parts)[index]`` (empty past the end), as FSDP2 shards dim 0."""
    size = -(-dim0 // parts)
    return max(0, min(size, dim0 - index * size))


def zero1_partition(numels: list[int], world: int) -> list[tuple[int, ...]]:
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
            shape[dim] = chunk_rows(shape[dim], tp, tp_index)
        if shards > 1 and shape:
            shape[0] = chunk_rows(shape[0], shards, shard_index)
        sig.append(tuple(shape))
    return tuple(sig)
