"""A pipeline rank in the per-rank trace: its stages of the fake model (:mod:`memfit.parallel.
pipeline`), parallelized as the layout says (:mod:`memfit.parallel.pipeline_parallelize`) and
run by the layout's schedule as the step, and the ranks grouped by what they hold.

The engine calls the role's hooks (:class:`memfit.parallel.rank.RankRole`): ``local_model``
(only a rank's own stages are faked), ``wrap_model``, ``run_step`` in place of forward +
backward (each micro-batch's forward traced as phase ``forward``, its backward as
``backward``) and ``wrap_optimizer``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from memfit._compat.torch_pipelining import (
    autograd_backward_keeps_function_modes,
    p2p_works_hold_their_tensors,
    stage_chunks_within,
    warmup_vote_static,
)
from memfit.errors import MemfitError
from memfit.parallel.config import Parallel
from memfit.parallel.pipeline import (
    Pipeline,
    build_pipeline,
    check_pipeline,
    pp_rank,
    stage_modules,
)
from memfit.parallel.pipeline_parallelize import (
    apply_dp_stages,
    apply_tp_stages,
    pipeline_mesh,
    stage_blocks,
    stage_root,
    tp_pipeline_mesh,
)
from memfit.parallel.rank import RankRole, host_step, offloaded

__all__ = ["PipelineRole", "pipeline_roles"]


@dataclasses.dataclass(frozen=True)
class PipelineRole(RankRole):
    """A pipeline rank: its stages of the fake model, run by the layout's schedule as the
    step (the engine calls :meth:`run_step` in place of forward + backward)."""

    state: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    runs_step = True

    def local_model(self, model: nn.Module) -> nn.Module:
        """This rank's stages of the real model (the engine fakes only these): a
        :class:`~memfit.parallel.pipeline.StageModule`, or a ``ModuleList`` of two (interleaved)."""
        modules = stage_modules(model, self.parallel, self.rank)
        return modules[0] if len(modules) == 1 else nn.ModuleList(modules)

    def wrap_model(self, model: nn.Module, tracker: Any, fake_mode: Any) -> nn.Module:
        """The fake stages, FSDP2-sharded over the data-parallel ranks when there are some (the
        schedule is built at the first step)."""
        modules = list(model) if isinstance(model, nn.ModuleList) else [model]
        self.state["modules"] = modules
        if self.parallel.dp > 1 and self.parallel.tp == 1:
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            from memfit.parallel.rank import traced_ddp

            with unset_fake_temporarily():  # the mesh's rank map is read with .tolist()
                mesh = pipeline_mesh(self.parallel)
            self.state["submods"] = apply_dp_stages(
                modules, self.parallel, mesh, init_sync=False,
                wrap=lambda make: traced_ddp(make, tracker, fake_mode))
            self.state["group"] = mesh["pp"].get_group()
            if "dp" in (mesh.mesh_dim_names or ()):
                self.state["dp_group"] = mesh["dp"].get_group()
            offloaded(model, tracker, self.parallel)
        elif self.parallel.tp > 1:
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            with unset_fake_temporarily():
                mesh = tp_pipeline_mesh(self.parallel)
            apply_tp_stages(modules, self.parallel, mesh)
            self.state["group"] = mesh["pp"].get_group()
        return model

    def run_step(self, model: nn.Module, inputs: Any, tracker: Any, loss_fn: Any) -> None:
        """One schedule step; each micro-batch's forward is traced as phase ``forward`` and its
        backward as ``backward``. The stages and schedule are built at the first step, from the
        batch's shape. ``loss_fn``: the trace's loss (None: no optimizer, an inference trace)."""
        from memfit._loss import model_loss

        if loss_fn is None:
            raise MemfitError("Parallel(pp>1) traces training steps (the schedule runs each "
                              "micro-batch's forward and backward); pass an optimizer")
        if loss_fn is not model_loss:
            raise MemfitError("Parallel(pp>1) computes the model's own loss on the last stage "
                              "(cross-entropy on the batch's labels); drop loss_fn")
        if "pipeline" not in self.state:
            batch, seq = _batch_shape(inputs)
            self.state["pipeline"] = build_pipeline(self.state["modules"], self.parallel,
                                                    batch, seq, group=self.state.get("group"),
                                                    submods=self.state.get("submods"))
        pipeline: Pipeline = self.state["pipeline"]
        from memfit.trace.replay import replaying

        # Micro-batches 2.. of each stage module replay micro-batch 1's recorded events
        # (Note: [replaying a pipeline stage's micro-batches] in memfit/trace/replay.py); not
        # beside data parallelism, whose wrappers (DDP's reducer, FSDP2) keep state across calls
        alone = self.parallel.dp == 1 and not self.state.get("submods")
        with _phases(pipeline.schedule, tracker), warmup_vote_static(pipeline.schedule), \
                p2p_works_hold_their_tensors(), \
                replaying(pipeline.modules if alone else [], tracker):
            pipeline.step(inputs)

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """ZeRO-1: a ``ZeroRedundancyOptimizer`` over the stage's data-parallel ranks (the
        mesh's ``dp`` group), each keeping the states of its partition of the stage's
        parameters; otherwise ``optimizer`` itself."""
        from memfit.parallel.apply import apply_optimizer
        from memfit.parallel.rank import check_foreach_kinds

        check_foreach_kinds(optimizer, self.parallel)
        return host_step(apply_optimizer(optimizer, self.parallel,
                                         process_group=self.state.get("dp_group")), self.parallel)


def _batch_shape(inputs: Any) -> tuple[int, int]:
    ids = inputs.get("input_ids") if isinstance(inputs, dict) else None
    if ids is None or ids.dim() != 2 or "labels" not in inputs:
        raise MemfitError("Parallel(pp>1) needs the batch as a dict with input_ids (batch, seq) "
                          "and labels (memfit.models.build.example_inputs)")
    return int(ids.shape[0]), int(ids.shape[1])


@contextlib.contextmanager
def _phases(schedule: Any, tracker: Any) -> Iterator[None]:
    """Each stage's ``forward_one_chunk`` traced as ``forward`` (its storages still alive at the
    end marked as saved activations) and ``backward_one_chunk`` as ``backward``; the stages'
    own methods again on exit (``torch_pipelining.stage_chunks_within``)."""

    @contextlib.contextmanager
    def forward() -> Iterator[None]:
        tracker.phase = "forward"
        try:
            yield
        finally:
            tracker.end_forward()

    @contextlib.contextmanager
    def backward() -> Iterator[None]:
        tracker.phase = "backward"
        tracker.modules.backward = ""
        try:
            with autograd_backward_keeps_function_modes():
                yield
        finally:
            tracker.phase = "forward"

    with stage_chunks_within(schedule, forward, backward):
        yield


def pipeline_roles(model: nn.Module, parallel: Parallel) -> list[RankRole]:
    """Ranks grouped by stage and by what they hold of it (:func:`_dp_signature`: with FSDP2 /
    HSDP the unpadded ``torch.chunk`` of each parameter's dim 0, with ZeRO-1 the partition of
    the optimizer states, as in ``trace.rank_roles``)."""
    check_pipeline(model, parallel, None)
    if parallel.tp > 1:
        return _tp_pipeline_roles(model, parallel)
    groups: dict[Any, list[int]] = {}
    for rank in range(parallel.gpus):
        params = [p for m in stage_modules(model, parallel, rank) for p in m.parameters()]
        sig = (pp_rank(parallel, rank), _dp_signature(params, parallel, rank % parallel.dp))
        groups.setdefault(sig, []).append(rank)
    return [PipelineRole(parallel, ranks[0], tuple(ranks)) for ranks in groups.values()]


def _dp_signature(params: list[nn.Parameter], parallel: Parallel, dp_index: int) -> Any:
    """What data-parallel rank ``dp_index`` of a stage holds of its ``params``: FSDP2's
    ``torch.chunk`` rows of each dim 0 (HSDP: over the ``fsdp`` ranks of its replica, the
    mesh's innermost dim), ZeRO-1's partition of the optimizer states, nothing of its own
    under DDP."""
    from memfit.parallel.rank import chunk_rows, zero1_partition

    if parallel.strategy in ("fsdp", "hsdp"):
        return tuple(chunk_rows(p.shape[0] if p.dim() else 1, parallel.fsdp,
                                 dp_index % parallel.fsdp) for p in params)
    if parallel.strategy == "zero1":
        return zero1_partition([p.numel() for p in params if p.requires_grad],
                                parallel.dp)[dp_index]
    return ()


def _tp_pipeline_roles(model: nn.Module, parallel: Parallel) -> list[RankRole]:
    """Ranks of a ``(pp, [dp,] tp)`` layout grouped by stage and the local shapes they hold:
    rank ``(pp_index * dp + dp_index) * tp + tp_index`` holds the ``tp_index`` chunk of each
    dim tensor parallelism splits (``memfit.parallel.apply.tp_split_dims`` on the stage's
    blocks), then FSDP2's ``dp_index`` chunk of that local tensor's dim 0."""
    from memfit.parallel.apply import tp_split_dims
    from memfit.parallel.rank import local_shapes

    stages: dict[int, tuple[list[nn.Parameter], dict[int, int]]] = {}
    groups: dict[Any, list[int]] = {}
    for rank in range(parallel.gpus):
        index = pp_rank(parallel, rank)
        if index not in stages:
            modules = stage_modules(model, parallel, rank)
            split: dict[int, int] = {}
            for m in modules:
                split.update(tp_split_dims(m, parallel, stage_blocks(m), stage_root(m)))
            stages[index] = ([p for m in modules for p in m.parameters()], split)
        params, split = stages[index]
        dp_index, tp_index = divmod(rank % (parallel.dp * parallel.tp), parallel.tp)
        sig = local_shapes(params, split, parallel.tp, tp_index, parallel.fsdp,
                           dp_index % parallel.fsdp)
        groups.setdefault((index, tuple(sig)), []).append(rank)
    return [PipelineRole(parallel, ranks[0], tuple(ranks)) for ranks in groups.values()]
