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

    # -- hooks the trace engine calls (memfit/trace/engine.py: _trace) --------------------------

    @contextlib.contextmanager
    def tracing(self, tracker: Any, fake_mode: Any) -> Iterator[None]:
        """``UntypedStorage.resize_`` becomes a free and an allocation in ``tracker`` while
        ``fake_mode`` tracks (see the module's note); DTensor's metadata propagation, which
        runs each op on global-shape tensors in the active fake mode, is not tracked
        (``torch_internals.dtensor_meta_propagation_within``)."""
        from memfit._compat.torch_internals import dtensor_meta_propagation_within

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
            with dtensor_meta_propagation_within(untracked):
                yield
        finally:
            torch.UntypedStorage.resize_ = original  # type: ignore[method-assign]

    def wrap_model(self, model: nn.Module, tracker: Any, fake_mode: Any) -> nn.Module:
        """The fake model as this rank runs it. DDP's buckets are made by its constructor
        (``Reducer::initialize_buckets``) and live as long as the model: they are tracked as
        gradients from there."""
        if self.parallel.cpu_offload:
            raise MemfitError("Parallel(cpu_offload=True) is not traced yet (FSDP2's "
                              "CPUOffloadPolicy pins host memory, which fake tensors cannot); "
                              "use memfit plan's formulas for offload")
        if self.parallel.strategy not in ("ddp", "zero1"):
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            from memfit.parallel.apply import device_mesh

            with unset_fake_temporarily():  # the mesh's rank map is read with .tolist()
                if self.parallel.tp > 1:
                    from torch.distributed.device_mesh import init_device_mesh

                    mesh = init_device_mesh("cpu", (self.parallel.tp,))
                else:
                    mesh = device_mesh(self.parallel, "cpu") if self.parallel.dp > 1 else None
            return apply_model(model, self.parallel, "cpu", mesh)
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
        return apply_optimizer(optimizer, self.parallel)


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
    if parallel.strategy in ("fsdp", "hsdp"):
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


def _count(model: nn.Module, config_names: tuple[str, ...], attr: str) -> int | None:
    """A head count from the model's config, else from a module's own attribute (memfit's
    builtin Attention: ``num_heads``, ``num_kv_heads``)."""
    config = getattr(model, "config", None)
    for name in config_names:
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return next((getattr(m, attr) for m in model.modules()
                 if isinstance(getattr(m, attr, None), int)), None)


def _model_shape(model: nn.Module) -> tuple[int | None, int | None, int | None]:
    """(attention heads, KV heads, layers) of a model, where its config or structure says them."""
    heads = _count(model, ("num_attention_heads", "n_head", "num_heads"), "num_heads")
    kv_heads = _count(model, ("num_key_value_heads",), "num_kv_heads")
    from memfit.techniques.checkpointing import find_blocks

    try:
        layers: int | None = len(find_blocks(model)) or None
    except MemfitError:
        layers = None
    return heads, kv_heads, layers


def estimate_ranks(run: Callable[[RankRole], Any], model: nn.Module, parallel: Parallel) -> Any:
    """Trace each rank role with ``run(role)`` (an :func:`memfit.trace.estimate` of that rank)
    and return the estimate of the rank with the highest peak, carrying every role's estimate in
    ``per_rank``."""
    if not isinstance(parallel, Parallel):
        raise MemfitError(f"parallel must be a memfit.Parallel, not {type(parallel).__name__}")
    heads, kv_heads, layers = _model_shape(model)
    parallel.check_model(heads=heads, kv_heads=kv_heads, layers=layers)
    estimates = []
    for role in rank_roles(model, parallel):
        with fake_world(parallel.gpus, role.rank):
            est = run(role)
        estimates.append(dataclasses.replace(est, ranks=role.ranks, parallel=parallel))
    worst = max(estimates, key=lambda e: (e.peak_reserved_bytes, e.peak_bytes))
    return dataclasses.replace(worst, per_rank=tuple(estimates))
