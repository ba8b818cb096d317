"""Expert parallelism for memfit's builtin MoE layers (and, through
:mod:`memfit.parallel.hf_expert`, transformers' experts modules): each rank keeps
``num_experts / ep`` of the experts and exchanges tokens with the other ranks by all-to-all.

The layout follows torchtitan's ``ExpertParallel`` (``torchtitan/distributed/expert_parallel.py``
before 0.3; ``torchtitan/models/common/token_dispatcher.py: AllToAllTokenDispatcher`` since): the
stacked expert weights ``[experts, ...]`` are split on dim 0 (torchtitan: ``Shard(0)`` over the
"ep" mesh dimension), tokens go to the rank that holds their expert with
``torch.distributed._functional_collectives.all_to_all_single`` (autograd-aware: the backward is
the reverse all-to-all) and come back with a second one. The non-expert parameters (attention,
norms, embeddings, the router) are replicated over the same ranks, which see different tokens:
data parallel, with DDP or FSDP2 reducing their gradients. When ``ep`` is every data-parallel
rank, each expert lives on one rank and is left out
(``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``; ``fully_shard``'s
``ignored_params``); with fewer, the ``dp / ep`` ranks that hold the same experts shard them with
FSDP2 on their own mesh dimension (:func:`ep_mesh`: "efsdp" x "ep"), as torchtitan did before
0.3 (``torchtitan/models/llama4/infra/parallelize.py: apply_fsdp``:
``fully_shard(transformer_block.moe.experts, mesh=dp_mod_ep_mesh)``, then the block on the
data-parallel mesh; its gradient divide factor changes no byte). torchtitan 0.3 keeps
the experts in FSDP2 even when that dimension (``fsdp * tp // ep`` ranks,
``torchtitan/distributed/parallel_dims.py``) is 1, through a per-parameter mesh
(``torchtitan/distributed/fsdp.py``: ``shard_placement_fn`` returning ``ShardPlacementResult``);
memfit leaves them out of FSDP2 then, which computes the same step, and does not model that
1-rank FSDP2 group's buffers.

Note: [expert parallelism without data-dependent sizes] torchtitan dispatches a variable number of
tokens per expert, so its all-to-all's split sizes come from a token-count exchange read on the
host (``AllToAllTokenDispatcher._sync_token_count_exchange``: ``.tolist()``). memfit's builtin
``MoE`` (``models/builtin_layers.py``) gives every expert a fixed buffer of ``capacity`` token slots
(GShard / Switch Transformer's capacity formulation; tokens past it are dropped), so the exchange
has equal splits: rank ``j`` gets ``[num_experts / ep, capacity, hidden]`` from every rank, and
every size is known before the step. A rank's bytes do not depend on the routing: its expert
buffers are the same size whether the router balances the tokens or not (the default
``capacity_factor=1.0`` is the balanced load, ``ceil(tokens * k / num_experts)`` slots per
expert, the balanced-routing assumption memfit's trace makes elsewhere,
``memfit/trace/datadep.py``). An imbalanced router drops more tokens; it does not take more
memory.

Note: [the all-to-all's buffers] ``_c10d_functional::all_to_all_single``
(``torch/csrc/distributed/c10d/Functional.cpp: all_to_all_single``, read at pytorch commit
00295ae; the same in the installed 2.13) allocates its output on the caller with
``input.new_empty`` (dim 0: the sum of the output splits) and hands it to the backend's
``alltoall_base`` (NCCL: ``ProcessGroupNCCL::alltoall_base``, into that output; gloo on CPU:
measured, no block of its own); the backward (``AllToAllSingle::backward`` in that file at that
commit; in 2.13 ``torch/distributed/_functional_collectives.py: all_to_all_single_backward``)
makes the incoming gradient contiguous and runs the reverse exchange the same way. The trace sees
each allocation through the op's fake kernel, as the real step makes it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from memfit.errors import MemfitError
from memfit.models.anatomy import EXPERT_PARAMS
from memfit.models.builtin_layers import MoE
from memfit.parallel.config import Parallel
from memfit.parallel.hf_expert import (
    apply_hf_ep,
    expert_count,
    hf_expert_numel,
    hf_moe_blocks,
    hf_top_k,
)


def moe_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The MoE layers of ``model`` by name: memfit's builtin ones
    (``memfit.models.builtin_layers.MoE``) and transformers' blocks whose ``experts`` child holds
    the experts as fused 3-D parameters (:func:`memfit.parallel.hf_expert.hf_moe_blocks`). Either
    kind's experts are ``layer.experts`` once :func:`apply_ep` has run."""
    builtin = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, MoE)]
    return builtin or hf_moe_blocks(model)


def _experts(layer: nn.Module) -> int:
    """How many experts an MoE layer routes to, every rank's together."""
    return int(layer.num_experts) if isinstance(layer, MoE) else expert_count(layer)


def moe_shape(model: nn.Module) -> tuple[tuple[int, ...], int, int]:
    """What the layout search needs of ``model``'s MoE layers (:func:`moe_layers`): each layer's
    experts, the experts per token (the largest), and the parameters ``ep`` splits (every
    layer's stacked expert weights and biases)."""
    layers = [layer for _, layer in moe_layers(model)]
    numel = sum(sum(p.numel() for n, p in layer.named_parameters()
                    if n.split(".")[-1] in EXPERT_PARAMS) if isinstance(layer, MoE)
                else hf_expert_numel(layer) for layer in layers)
    top_k = max((int(layer.top_k) if isinstance(layer, MoE) else hf_top_k(layer)
                 for layer in layers), default=0)
    return tuple(_experts(layer) for layer in layers), top_k, numel


def check_experts(model: nn.Module, parallel: Parallel) -> None:
    """One-line errors for an ``ep`` the model or the layout cannot take: the model has
    MoE layers, ``ep`` divides their experts, and the layout is the one traced (DDP or FSDP2
    for the rest; beside tp: :func:`_check_tp_experts`)."""
    if parallel.ep == 1:
        return
    layers = moe_layers(model)
    if not layers:
        raise MemfitError(f"Parallel(ep={parallel.ep}) needs a mixture-of-experts model: "
                          "memfit's builtin MoE layers (memfit.models.build_model with "
                          "num_experts > 0) or transformers' experts modules of fused 3-D "
                          "parameters (Mixtral, Qwen3-MoE, DeepSeek-V3, gpt-oss, ...); this "
                          "model has neither: use ep=1")
    for name, moe in layers:
        experts = _experts(moe)
        if experts % parallel.ep:
            raise MemfitError(f"Parallel(ep={parallel.ep}) does not divide the {experts} experts "
                              f"of {name}; choose an ep that divides {experts}")
    if parallel.tp > 1:
        _check_tp_experts(parallel)
    elif parallel.strategy not in ("ddp", "fsdp") or (
            parallel.strategy == "ddp" and parallel.ep != parallel.dp):
        raise MemfitError(f"Parallel(ep={parallel.ep}) on {parallel.describe()}: expert "
                          "parallelism is traced with FSDP2 over every data-parallel rank "
                          "(fsdp = gpus / (tp*pp)), or DDP when ep is all of them (no hsdp, "
                          f"zero=1); use Parallel(gpus={parallel.gpus}, fsdp={parallel.dp}, "
                          f"ep={parallel.ep}) or ep={parallel.dp}")
    for name, moe in layers:
        local, shards = _experts(moe) // parallel.ep, _sparse(parallel) // parallel.ep
        if local % shards:
            where = "dp * tp / ep" if parallel.tp > 1 else "dp / ep"
            raise MemfitError(f"Parallel(ep={parallel.ep}): the {local} experts each rank of "
                              f"{name} keeps do not split evenly over the {shards} ranks that "
                              f"shard them ({where}); choose an ep with {_experts(moe)} "
                              f"/ ep divisible by {_sparse(parallel)} / ep")
    if parallel.param_dtype or parallel.reduce_dtype or parallel.cpu_offload:
        raise MemfitError(f"Parallel(ep={parallel.ep}) with FSDP2's param_dtype, reduce_dtype or "
                          "cpu_offload is not traced yet (the experts, outside FSDP, would keep "
                          "their own dtype); use precision= for mixed precision instead")


def _sparse(parallel: Parallel) -> int:
    """The ranks one pipeline stage's experts spread over (torchtitan's sparse region,
    ``dp_shard * cp * tp``: ``parallel_dims.py``): ``ep`` of them exchange tokens, the others
    (``dp * tp / ep``, "efsdp") hold the same experts."""
    return parallel.dp * parallel.tp


def _check_tp_experts(parallel: Parallel) -> None:
    """One line for a tp x ep layout other than the one traced (Note: [expert parallelism beside
    tensor parallelism] in :class:`ExpertParallelMoE`): no sequence parallelism, no tp_plan or
    pp_split_points of the user's, FSDP2 (or nothing) over the data-parallel ranks (of each
    pipeline stage), ``tp`` dividing ``ep``."""
    run = (f"use Parallel(gpus={parallel.gpus}, tp={parallel.tp}, "
           + (f"pp={parallel.pp}, " if parallel.pp > 1 else "")
           + (f"fsdp={parallel.dp}, " if parallel.dp > 1 else "")
           + f"ep={parallel.tp * parallel.dp if parallel.ep % parallel.tp else parallel.ep})")
    why = None
    if parallel.sp or parallel.tp_plan is not None or parallel.pp_split_points:
        why = "runs without sequence parallelism, a tp_plan of your own and pp_split_points"
        run = "use sp=False and memfit's plan and split with tp and ep, or tp=1"
    elif parallel.ep % parallel.tp or parallel.strategy not in ("fsdp", "none"):
        why = ("runs with ep a multiple of tp (each expert group whole tensor-parallel groups) "
               "and FSDP2 over every data-parallel rank")
    elif parallel.param_dtype or parallel.reduce_dtype or parallel.cpu_offload:
        why = "runs without FSDP2's param_dtype, reduce_dtype or cpu_offload"
        run = "use precision= for mixed precision instead"
    if why is not None:
        raise MemfitError(f"Parallel(tp={parallel.tp}, ep={parallel.ep}) on "
                          f"{parallel.describe()}: expert parallelism beside tensor parallelism "
                          f"{why}; {run}")


def expert_parameter_names(model: nn.Module) -> list[str]:
    """Qualified names of the expert parameters of an expert-parallel ``model`` (after
    :func:`apply_ep`: sharded by ``ep``, left out of the dense parameters' DDP / FSDP2)."""
    return [f"{name}.experts.{attr}" for name, moe in moe_layers(model)
            for attr, _ in moe.experts.named_parameters()]


def ep_mesh(parallel: Parallel, device_type: str) -> Any:
    """None when ``ep`` is every data-parallel rank (the expert group is the world); otherwise
    the 2-D DeviceMesh ``(efsdp, ep)`` = ``(dp // ep, ep)`` (torchtitan's sparse mesh, "ep"
    innermost: ranks ``0..ep-1`` exchange tokens, and rank ``r`` holds the same experts as
    ``r + ep``, ``r + 2 ep``..., which shard them with FSDP2 over "efsdp")."""
    if parallel.ep == _sparse(parallel):
        return None
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import init_device_mesh

    with unset_fake_temporarily():  # the mesh's rank map is read with .tolist()
        return init_device_mesh(device_type, (_sparse(parallel) // parallel.ep, parallel.ep),
                                mesh_dim_names=("efsdp", "ep"))


class Experts(nn.Module):
    """One MoE layer's local experts, a module of their own (torchtitan: ``GroupedExperts``) so
    that FSDP2 can shard them on another mesh than the layer's other parameters; its forward is
    :meth:`memfit.models.builtin_layers.MoE.run_experts` on its own parameters."""

    ep_mesh: Any = None
    """The ``(efsdp, ep)`` mesh of :func:`ep_mesh` (None: the expert group is every rank)."""

    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.act = act
        for attr in EXPERT_PARAMS:
            setattr(self, attr, None)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return MoE.run_experts(self, tokens)  # type: ignore[arg-type]


def apply_ep(model: nn.Module, parallel: Parallel, mesh: Any = None,
             tp_mesh: Any = None) -> nn.Module:
    """Expert parallelism on every MoE layer of ``model`` (in place; transformers' experts
    modules: :func:`memfit.parallel.hf_expert.apply_hf_ep`): in the expert group
    (``mesh["ep"]``, or every rank when ``mesh`` is None), the rank of index ``i`` keeps experts
    ``[i * E / ep, (i + 1) * E / ep)`` of each layer's stacked weights, moved to an
    :class:`Experts` child, and runs them on the tokens the group sends it
    (:class:`ExpertParallelMoE`). ``tp_mesh``: the tensor-parallel mesh beside it, whose ranks
    each route their own share of the tokens (Note: [expert parallelism beside tensor
    parallelism]). Applying it twice changes nothing."""
    import torch.distributed as dist

    check_experts(model, parallel)
    group = dist.group.WORLD if mesh is None else mesh["ep"].get_group()
    index, ep = dist.get_rank(group), parallel.ep
    for _, moe in moe_layers(model):
        if not isinstance(moe, MoE):  # transformers' experts module (hf_expert.py)
            apply_hf_ep(moe, group, index, ep, tp_mesh=tp_mesh)
            moe.experts.ep_mesh = mesh
            continue
        if isinstance(moe, ExpertParallelMoE):
            continue
        local = moe.num_experts // ep
        experts = Experts(moe.act)
        for attr in EXPERT_PARAMS:
            param = getattr(moe, attr, None)
            delattr(moe, attr)
            if param is not None:  # this rank's experts, a tensor of their own
                shard = param.detach()[index * local:(index + 1) * local].clone()
                setattr(experts, attr, nn.Parameter(shard, requires_grad=param.requires_grad))
        moe.__class__ = ExpertParallelMoE
        moe.experts = experts
        moe.ep_group, moe.ep_size = group, ep  # type: ignore[assignment]
        moe.tp_mesh = tp_mesh  # type: ignore[assignment]
        experts.ep_mesh = mesh  # the (efsdp, ep) mesh FSDP2 shards the experts over
    return model


class ExpertParallelMoE(MoE):
    """A builtin MoE layer holding ``num_experts / ep_size`` experts (its :class:`Experts`
    child): the routing and the capacity buffers are :class:`~memfit.models.builtin_layers.MoE`'s;
    the experts step exchanges the buffers (see the module's note)."""

    experts: Experts
    ep_group: Any
    ep_size: int
    tp_mesh: Any = None
    """The tensor-parallel mesh beside expert parallelism, or None."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """:class:`~memfit.models.builtin_layers.MoE`'s forward; beside tensor parallelism
        (``tp_mesh``), on this tensor-parallel rank's share of the tokens.

        Note: [expert parallelism beside tensor parallelism] torchtitan's layout with the
        experts not tensor-parallel (etp = 1; read at torchtitan commit a2b5ee66ccb7, the parent
        of c4b409af2 "#3167 deprecate expert tensor parallel": ``torchtitan/models/llama4/
        parallelize.py: apply_moe_ep_tp``, its ``ExpertParallel`` branch, and
        ``torchtitan/models/common/token_dispatcher.py``; the mesh as in
        ``torchtitan/distributed/parallel_dims.py`` at b5bcd76c: ep borrows from the sparse
        region ``dp_shard * cp * tp``, ``efsdp = fsdp * tp // ep``, "ep" innermost). The MoE
        layer's input is replicated over the tp ranks (``PrepareModuleInputOutput(
        desired_input_layouts=Replicate())``) and the router runs on every token on each of
        them (``NoParallel``);
        then each tp rank keeps its ``tp_index``-th chunk of the tokens and their routing
        (``AllToAllTokenDispatcher._split_along_sp``, ``sp_size = tp``), which the expert group
        exchanges as without tp. The chunk is taken as DTensor's ``Replicate -> Shard(0)`` (a
        local slice; its backward all-gathers the gradients, so that the router's weight gets
        every token's: torchtitan #2416 "Force all reduce in bwd for router at MoE boundary")
        and the output comes back as ``Shard(0) -> Replicate`` (an all-gather, its backward a
        local slice), where torchtitan scatters its chunk into zeros and all-reduces the
        ``Partial`` sum: the same values, one ``[tokens, hidden]`` output either way. Each
        rank's expert buffers hold ``capacity(tokens / tp)`` slots."""
        if self.tp_mesh is None:
            return super().forward(x)
        mesh, tp = self.tp_mesh, self.tp_mesh.size()
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if x.shape[0] % tp:
            raise MemfitError(f"Parallel(tp={tp}, ep={self.ep_size}): the {x.shape[0]} tokens "
                              f"of a step do not split evenly over the {tp} tensor-parallel "
                              f"ranks that route them; use batch * sequence divisible by {tp}")
        weights, expert = self.route(x)
        local = expert.chunk(tp)[mesh.get_local_rank()]
        out = self.dispatch_combine(tp_chunk(x, mesh), tp_chunk(weights, mesh), local)
        return tp_gather(out, mesh).view(shape)

    def run_experts(self, expert_in: torch.Tensor) -> torch.Tensor:
        from torch.distributed import _functional_collectives as funcol

        experts, capacity, hidden = expert_in.shape
        ep, local = self.ep_size, experts // self.ep_size
        # Dispatch: chunk j of the buffers (rank j's experts) goes to rank j; what arrives is
        # rank-major [ep, local, capacity, hidden], made expert-major for the batched matmuls
        # (torchtitan: AllToAllTokenDispatcher._permute).
        received = funcol.all_to_all_single_autograd(
            expert_in.reshape(experts * capacity, hidden), None, None, self.ep_group)
        tokens = received.view(ep, local, capacity, hidden).transpose(0, 1).reshape(
            local, ep * capacity, hidden)
        out = self.experts(tokens)
        # Combine: back to rank-major, each rank's slots sent home (the reverse exchange).
        back = out.view(local, ep, capacity, hidden).transpose(0, 1).reshape(
            experts * capacity, hidden)
        returned = funcol.all_to_all_single_autograd(back, None, None, self.ep_group)
        return returned.view(experts, capacity, hidden)


def tp_chunk(t: torch.Tensor, mesh: Any) -> torch.Tensor:
    """This tensor-parallel rank's chunk (dim 0) of ``t``, which every rank of ``mesh`` holds
    whole: DTensor's ``Replicate -> Shard(0)``, whose backward all-gathers the gradient."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    return DTensor.from_local(t, mesh, [Replicate()], run_check=False).redistribute(
        mesh, [Shard(0)]).to_local()


def tp_gather(t: torch.Tensor, mesh: Any) -> torch.Tensor:
    """The ranks' chunks ``t`` of ``mesh`` all-gathered on dim 0: DTensor's ``Shard(0) ->
    Replicate``, whose backward keeps this rank's chunk of the (replicated) gradient."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    return DTensor.from_local(t, mesh, [Shard(0)], run_check=False).redistribute(
        mesh, [Replicate()]).to_local()
