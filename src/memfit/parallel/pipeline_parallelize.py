"""Each pipeline stage's own parallelism: data parallelism (FSDP2, HSDP, DDP, ZeRO-1), expert
parallelism and tensor parallelism on the stages of :mod:`memfit.parallel.pipeline`, over the
layout's ``(pp, dp[, tp])`` DeviceMesh.

As torchtitan does it, the model is split into stages first and each stage (a model part) is
then parallelized as a whole model would be (``torchtitan/distributed/pipeline_parallel.py:
pipeline_llm`` calls ``parallelize_llama`` / ``parallelize_deepseekv3`` on each part:
``apply_tp``, then ``apply_fsdp``), with the per-model functions of :mod:`memfit.parallel.apply`
and :mod:`memfit.parallel.expert`.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from memfit.parallel.config import Parallel
from memfit.parallel.pipeline import StageModule

__all__ = [
    "apply_dp_stages",
    "apply_ep_stages",
    "apply_tp_stages",
    "ep_pipeline_mesh",
    "pipeline_mesh",
    "replicate_stages",
    "shard_stages",
    "stage_blocks",
    "stage_root",
    "tp_pipeline_mesh",
]


def pipeline_mesh(parallel: Parallel, device_type: str = "cpu") -> Any:
    """The ``(pp, dp)`` DeviceMesh of a pipeline layout with data parallelism (torch.distributed
    initialised with ``parallel.gpus`` ranks); ``(pp, replicate, shard)`` for HSDP
    (torchtitan's ``ParallelDims`` order: pp, dp_replicate, dp_shard)."""
    from torch.distributed.device_mesh import init_device_mesh

    if parallel.tp > 1:
        return tp_pipeline_mesh(parallel, device_type)
    if parallel.strategy == "hsdp":
        return init_device_mesh(device_type, (parallel.pp, parallel.replicate, parallel.fsdp),
                                mesh_dim_names=("pp", "replicate", "shard"))
    return init_device_mesh(device_type, (parallel.pp, parallel.dp), mesh_dim_names=("pp", "dp"))


def shard_stages(modules: list[StageModule], parallel: Parallel, mesh: Any) -> None:
    """FSDP2 on each stage over the mesh's ``dp`` dimension: each of its blocks, then the
    stage (``memfit.parallel.apply.apply_fsdp``), as torchtitan shards each model part."""
    from memfit.parallel.apply import apply_fsdp

    dp_mesh = mesh["replicate", "shard"] if parallel.strategy == "hsdp" else mesh["dp"]
    for module in modules:
        apply_fsdp(module, parallel, dp_mesh, blocks=stage_blocks(module))


# -- data parallelism beside the pipeline ------------------------------------------------------

def replicate_stages(modules: list[StageModule], parallel: Parallel, mesh: Any,
                     init_sync: bool = True, wrap: Any = None) -> list[nn.Module]:
    """DDP on each stage over the mesh's ``dp`` group (``memfit.parallel.apply.apply_ddp``): the
    modules the ``PipelineStage``s run (``build_pipeline(submods=...)``). PyTorch's pipelining
    runs every micro-batch's forward and backward but the last under ``no_sync`` and prepares
    the reducer for the last backward (``stage.py: forward_maybe_with_nosync``,
    ``backward_maybe_with_nosync``: ``reducer.prepare_for_backward``), so the buckets are
    all-reduced once per step. ``wrap``: a function the constructor call is handed to (the
    trace's :func:`memfit.parallel.rank.traced_ddp`)."""
    from memfit.parallel.apply import apply_ddp

    group = mesh["dp"].get_group()
    out = []
    for module in modules:
        def make(module: nn.Module = module) -> nn.Module:
            return apply_ddp(module, parallel, init_sync, process_group=group)

        out.append(make() if wrap is None else wrap(make))
    return out


def apply_dp_stages(modules: list[StageModule], parallel: Parallel, mesh: Any,
                    init_sync: bool = True, wrap: Any = None) -> list[nn.Module] | None:
    """The layout's data parallelism on each stage (no tensor parallelism): FSDP2 / HSDP in
    place (:func:`shard_stages`; returns None), or DDP wrappers (:func:`replicate_stages`;
    returns them, for ``build_pipeline(submods=...)``); with ``ep``, expert parallelism first
    (:func:`apply_ep_stages`)."""
    if parallel.ep > 1:
        return apply_ep_stages(modules, parallel, mesh, init_sync, wrap)
    if parallel.strategy in ("ddp", "zero1"):
        return replicate_stages(modules, parallel, mesh, init_sync, wrap)
    shard_stages(modules, parallel, mesh)
    return None


def ep_pipeline_mesh(parallel: Parallel, device_type: str = "cpu") -> Any:
    """The expert mesh of a pipeline layout with ``ep``: ``(pp, efsdp, ep)`` = ``(pp, dp // ep,
    ep)``, torchtitan's sparse mesh (``torchtitan/distributed/parallel_dims.py``, v0.2.2:
    ``("pp", "dp_replicate", "efsdp", "ep", "etp")``, here without replicas or expert tensor
    parallelism): the ``ep`` ranks of a stage that exchange tokens are adjacent, and rank ``r``
    holds the same experts as ``r + ep``, ... of its stage, which shard them over ``efsdp``."""
    from torch.distributed.device_mesh import init_device_mesh

    ranks = parallel.dp * parallel.tp  # beside tp: ep borrows the tp ranks too (whole groups)
    return init_device_mesh(device_type, (parallel.pp, ranks // parallel.ep, parallel.ep),
                            mesh_dim_names=("pp", "efsdp", "ep"))


def apply_ep_stages(modules: list[StageModule], parallel: Parallel, mesh: Any,
                    init_sync: bool = True, wrap: Any = None) -> list[nn.Module] | None:
    """Expert parallelism on each stage's builtin MoE layers over the stage's ``ep`` ranks
    (``memfit.parallel.expert.apply_ep`` with :func:`ep_pipeline_mesh`), then the data
    parallelism of ``memfit.parallel.apply.apply_ep_dp`` on each stage over the ``(pp, dp)``
    ``mesh``'s ``dp`` dim: with ``ep`` equal to the stage's data-parallel ranks the experts are
    left out (DDP's ignored parameters, FSDP2's ``ignored_params``); with fewer, FSDP2 shards
    them over ``efsdp`` first, then each block and the stage over ``dp``. torchtitan splits the
    model into stages, then applies EP and FSDP to each model part (``torchtitan/models/
    deepseek_v3/infra/parallelize.py: parallelize_deepseekv3``, v0.2.2). Returns the DDP
    wrappers (``build_pipeline(submods=...)``), or None under FSDP2."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from memfit._compat.torch_internals import ddp_ignore
    from memfit.parallel.apply import apply_ddp, apply_fsdp
    from memfit.parallel.expert import apply_ep, expert_parameter_names, moe_layers

    with unset_fake_temporarily():  # the mesh's rank map is read with .tolist()
        experts_mesh = ep_pipeline_mesh(parallel, mesh.device_type)
    for module in modules:
        if moe_layers(module):  # a stage of only the final norm and head has none
            apply_ep(module, parallel, experts_mesh)
    if parallel.strategy == "fsdp":
        for module in modules:
            blocks = stage_blocks(module)
            names = expert_parameter_names(module)
            if parallel.ep == parallel.dp:
                apply_fsdp(module, parallel, mesh["dp"], blocks=blocks,
                           ignored_params={module.get_parameter(n) for n in names})
                continue
            for _, moe in moe_layers(module):
                apply_fsdp(moe.experts, parallel, experts_mesh["efsdp"], blocks=[])
            apply_fsdp(module, parallel, mesh["dp"], blocks=blocks)
        return None
    group = mesh["dp"].get_group()
    out = []
    for module in modules:
        ddp_ignore(module, expert_parameter_names(module))

        def make(module: nn.Module = module) -> nn.Module:
            return apply_ddp(module, parallel, init_sync, process_group=group)

        out.append(make() if wrap is None else wrap(make))
    return out


# -- tensor parallelism inside each stage ------------------------------------------------------

def tp_pipeline_mesh(parallel: Parallel, device_type: str = "cpu") -> Any:
    """The DeviceMesh of a pipeline layout with tensor parallelism: ``(pp, tp)``, or
    ``(pp, dp, tp)`` with FSDP2 over the data-parallel ranks (torchtitan's ``ParallelDims``
    order: pipeline outermost, the tensor-parallel ranks the adjacent ones)."""
    from torch.distributed.device_mesh import init_device_mesh

    if parallel.dp == 1:
        return init_device_mesh(device_type, (parallel.pp, parallel.tp),
                                mesh_dim_names=("pp", "tp"))
    if parallel.strategy == "hsdp":  # torchtitan: pp, dp_replicate, dp_shard, tp
        return init_device_mesh(device_type,
                                (parallel.pp, parallel.replicate, parallel.fsdp, parallel.tp),
                                mesh_dim_names=("pp", "replicate", "shard", "tp"))
    return init_device_mesh(device_type, (parallel.pp, parallel.dp, parallel.tp),
                            mesh_dim_names=("pp", "dp", "tp"))


def stage_root(module: StageModule) -> tuple[str | None, str | None, str | None]:
    """The token embedding, final norm and head a stage holds (None where it does not), which
    sequence parallelism splits: the first stage's embedding reduce-scatters its output along
    the sequence, so the stages exchange ``1/tp`` of it (``seq / tp`` rows each); the last
    stage's head all-gathers its input (``memfit.parallel.apply.tp_plan``)."""
    return ("embed_tokens" if module.first else None, "norm" if module.last else None,
            "lm_head" if module.last else None)


def stage_blocks(module: StageModule) -> list[str]:
    """The names of a stage's transformer blocks inside it (``layers.<i>``; a model split at
    named points: its elements of the split container,
    ``pipeline_split.SplitStageModule.block_names``)."""
    names = getattr(module, "block_names", None)
    return names() if names is not None else [f"layers.{k}" for k in module.layers]


def apply_tp_stages(modules: list[StageModule], parallel: Parallel, mesh: Any) -> None:
    """Tensor parallelism on each stage over the mesh's ``tp`` dimension (the plan of
    ``memfit.parallel.apply.tp_plan`` on the stage's own blocks; the embedding, final norm and
    head replicated), then, with data parallelism, FSDP2 over ``dp``: torchtitan's order
    (``torchtitan/distributed/pipeline_parallel.py: pipeline_llm`` splits the model into
    stages first, then calls ``parallelize_llama`` on each model part: ``apply_tp``, then
    ``apply_fsdp``)."""
    from memfit.parallel.apply import apply_tp

    if parallel.ep > 1:
        return _apply_ep_tp_stages(modules, parallel, mesh)
    for module in modules:
        apply_tp(module, parallel, mesh["tp"], blocks=stage_blocks(module),
                 root=stage_root(module))
        if parallel.sp:
            module.seq_shards = parallel.tp
    if parallel.dp > 1:
        shard_stages(modules, parallel, mesh)
    return None


def _apply_ep_tp_stages(modules: list[StageModule], parallel: Parallel, mesh: Any) -> None:
    """Expert parallelism beside tensor parallelism on each stage (as without a pipeline:
    ``memfit.parallel.apply.apply_ep_tp``, over each stage's ``dp * tp`` ranks): ``apply_ep``
    on :func:`ep_pipeline_mesh`, tensor parallelism for the rest (the experts left out), then
    over ``dp > 1`` FSDP2 on the experts over "efsdp" (left out where ``ep`` is every rank of
    the stage) and on each block and the stage over "dp"."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from memfit.parallel.apply import apply_fsdp, apply_tp
    from memfit.parallel.expert import apply_ep, expert_parameter_names, moe_layers

    with unset_fake_temporarily():  # the mesh's rank map is read with .tolist()
        experts_mesh = ep_pipeline_mesh(parallel, mesh.device_type)
    for module in modules:
        layers = moe_layers(module)
        if layers:
            apply_ep(module, parallel, experts_mesh, mesh["tp"])
        apply_tp(module, parallel, mesh["tp"], blocks=stage_blocks(module),
                 root=stage_root(module), leave=tuple(f"{name}.experts" for name, _ in layers))
        if parallel.dp == 1:
            continue
        every = parallel.ep == parallel.dp * parallel.tp
        if not every:
            for _, moe in layers:
                apply_fsdp(moe.experts, parallel, experts_mesh["efsdp"], blocks=[])
        apply_fsdp(module, parallel, mesh["dp"], blocks=stage_blocks(module),
                   ignored_params={module.get_parameter(n) for n in expert_parameter_names(module)}
                   if every else None)
