"""Trace a parallel layout, one rank per role (``memfit.estimate(..., parallel=...)``): the
ranks grouped by what they hold, each role traced by the engine over its own fake process
group with the hooks of :class:`memfit.parallel.rank.RankRole` (Note: [a rank over a fake
process group] in memfit/parallel/rank.py), the worst rank reported.

Ranks that hold the same shapes hold the same bytes, so one rank is traced per distinct role:
FSDP2 pads every shard to the same size (``_fsdp_param.py: FSDPParam._init_sharded_param``) but
the optimizer states follow the unpadded local shard (``torch.chunk`` on dim 0), so the last
ranks of an uneven split can differ; ZeRO-1 assigns whole parameters to ranks greedily.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from torch import nn

from memfit.errors import MemfitError
from memfit.models.anatomy import model_shape
from memfit.parallel.config import Parallel
from memfit.parallel.rank import RankRole, chunk_rows, local_shapes, zero1_partition
from memfit.trace.engine import estimate as trace_estimate
from memfit.trace.options import check_request

if TYPE_CHECKING:
    from memfit._loss import LossFn
    from memfit.gpus import GpuSpec
    from memfit.runtime.input_pipeline import DataLoaderSpec
    from memfit.trace.estimate import Estimate
    from memfit.trace.optim import OptimizerFactory


def rank_roles(model: nn.Module, parallel: Parallel) -> list[RankRole]:
    """Ranks grouped by what they hold, the first of each group traced for all of it."""
    if parallel.pp > 1:  # one role per pipeline stage (memfit/parallel/pipeline_rank.py)
        from memfit.parallel.pipeline_rank import pipeline_roles

        return pipeline_roles(model, parallel)
    params = [p for p in model.parameters()]
    signatures: list[Any]
    if parallel.tp > 1:
        signatures = _tp_signatures(model, parallel)
    elif parallel.strategy in ("fsdp", "hsdp"):
        signatures = [tuple(chunk_rows(p.shape[0] if p.dim() else 1, parallel.fsdp,
                                        rank % parallel.fsdp) for p in params)
                      for rank in range(parallel.gpus)]
    elif parallel.strategy == "zero1":
        parts = zero1_partition([p.numel() for p in params if p.requires_grad], parallel.dp)
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
    from memfit.trace.replay import redo_without_replay

    estimates = []
    for role in rank_roles(model, parallel):
        def in_world(role: RankRole = role) -> Any:
            with fake_world(parallel.gpus, role.rank):
                return run(role)

        # Note: [replaying a pipeline stage's micro-batches]: a rank whose replayed call was not
        # replayable is traced again, in a new world and without the stages built in the first
        state = getattr(role, "state", None)
        est = redo_without_replay(in_world, before=state.clear if isinstance(state, dict)
                                  else None)
        estimates.append(dataclasses.replace(est, ranks=role.ranks, parallel=parallel))
    worst = max(estimates, key=lambda e: (e.peak_reserved_bytes, e.peak_bytes))
    return dataclasses.replace(worst, per_rank=tuple(estimates))


def estimate(model: nn.Module, inputs: Any, *, optimizer: str | OptimizerFactory | None = "adamw",
             precision: str = "fp32", loss_fn: LossFn | None = None,
             device: str = "cuda", gpu: str | GpuSpec | None = None, steps: int = 2,
             expandable_segments: bool = False, num_gpus: int = 1,
             keep_output: bool = False, parallel: Parallel | None = None,
             dataloader: DataLoaderSpec | Mapping[str, Any] | None = None) -> Estimate:
    """``memfit.estimate``: :func:`memfit.trace.estimate` (see there for every argument), and
    with ``parallel``, a :class:`memfit.Parallel` layout, each distinct rank of it traced running
    PyTorch's own DDP / ZeRO-1 / FSDP2 / HSDP over a fake process group, the result being the
    rank with the highest peak and ``per_rank`` holding one estimate per rank role.

    ``dataloader``: the input pipeline (a :class:`memfit.runtime.input_pipeline.DataLoaderSpec`
    or a dict of its fields: ``num_workers``, ``prefetch_factor``, ``pin_memory``, ``depth``, ...;
    the batch's bytes default to ``inputs``'): ``depth`` batches of
    :class:`memfit.data.DevicePrefetcher` are added to the peak (``ACTIVATIONS``), and the host
    side is in ``input_pipeline`` (memfit.trace.dataloader).

    >>> est = memfit.estimate(model, inputs, device="cpu", parallel=Parallel(gpus=8, fsdp=8))
    >>> est = memfit.estimate(model, inputs, dataloader={"num_workers": 4, "depth": 1})
    """
    est = _estimate(model, inputs, optimizer=optimizer, precision=precision, loss_fn=loss_fn,
                    device=device, gpu=gpu, steps=steps, expandable_segments=expandable_segments,
                    num_gpus=num_gpus, keep_output=keep_output, parallel=parallel)
    if dataloader is None:
        return est
    from memfit.trace.dataloader import with_input_pipeline

    return with_input_pipeline(est, dataloader, inputs)


def _estimate(model: nn.Module, inputs: Any, *, optimizer: str | OptimizerFactory | None,
              precision: str, loss_fn: LossFn | None, device: str, gpu: str | GpuSpec | None,
              steps: int, expandable_segments: bool, num_gpus: int, keep_output: bool,
              parallel: Parallel | None) -> Estimate:
    kwargs: dict[str, Any] = dict(
        optimizer=optimizer, precision=precision, loss_fn=loss_fn, device=device, gpu=gpu,
        steps=steps, expandable_segments=expandable_segments, keep_output=keep_output)
    if parallel is None:
        return trace_estimate(model, inputs, num_gpus=num_gpus, **kwargs)
    check_request(model, optimizer=optimizer, precision=precision, loss_fn=loss_fn,
                  device=device, steps=steps)
    est = estimate_ranks(lambda role: trace_estimate(
        model, inputs, num_gpus=max(num_gpus, getattr(parallel, "gpus", 1)), rank=role,
        **kwargs), model, parallel)
    if (device == "cuda" and parallel.strategy in ("fsdp", "hsdp")
            and precision.endswith("-mixed")):
        est = dataclasses.replace(est, assumptions=(*est.assumptions, FSDP_AUTOCAST_NOTE))
    return est


FSDP_AUTOCAST_NOTE = (
    "FSDP2 under autocast on CUDA: one H100 and one H200 (torch 2.11, NCCL, world size 1) "
    "measured 4-23% above this trace's allocated peak, varying from run to run, not explained "
    "yet (bench/results/parallel-cuda-*-2026-11-27.json); FSDP2's own param_dtype policy "
    "(Parallel(param_dtype='bf16')) matched: leave that much room")
