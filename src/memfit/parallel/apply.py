"""Apply a :class:`~memfit.parallel.Parallel` layout with PyTorch's own APIs, one function each.

The same functions run on the traced (fake) model over a fake process group and on a real model
in each rank of a real run (``memfit.parallel.measure``), so the prediction and the measurement
run the same PyTorch code. Order (torchtitan's ``apply_fsdp``): each transformer block is sharded
first, then the root, which takes the parameters no block holds (embeddings, final norm, head).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from memfit.errors import MemfitError
from memfit.parallel.config import Parallel

_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def device_mesh(parallel: Parallel, device_type: str) -> Any:
    """The data-parallel DeviceMesh: 1-D ``(fsdp,)`` or, for HSDP, 2-D ``(replicate, shard)``
    (``torch.distributed.fsdp.fully_shard``: "a 2D mesh ... replicates across the 0th dim and
    shards across the 1st dim"). Needs torch.distributed initialised with ``parallel.gpus``
    ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    if parallel.strategy == "hsdp":
        return init_device_mesh(device_type, (parallel.replicate, parallel.fsdp),
                                mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device_type, (parallel.dp,), mesh_dim_names=("dp",))


def apply_fsdp(model: nn.Module, parallel: Parallel, mesh: Any,
               blocks: list[str] | None = None,
               ignored_params: set[nn.Parameter] | None = None) -> nn.Module:
    """FSDP2 ``fully_shard`` on each block (``blocks``; default: the repeated blocks that
    ``memfit.techniques.checkpointing.find_blocks`` finds), then on the root (in place), with
    the layout's ``reshard_after_forward``, ``MixedPrecisionPolicy`` and ``CPUOffloadPolicy``."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    from memfit.techniques.checkpointing import find_blocks

    kwargs: dict[str, Any] = {"mesh": mesh,
                              "reshard_after_forward": bool(parallel.reshard_after_forward)}
    if parallel.param_dtype or parallel.reduce_dtype:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=_DTYPE.get(parallel.param_dtype or ""),
            reduce_dtype=_DTYPE.get(parallel.reduce_dtype or ""))
    if parallel.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    if ignored_params:  # neither sharded nor reduced (expert parallelism's own experts)
        kwargs["ignored_params"] = ignored_params
    if blocks is None:
        try:
            blocks = find_blocks(model)
        except MemfitError:  # no repeated blocks: the root holds every parameter
            blocks = []
    for name in blocks:
        fully_shard(model.get_submodule(name), **kwargs)
    fully_shard(model, **kwargs)
    return model


def apply_ddp(model: nn.Module, parallel: Parallel, init_sync: bool = True) -> nn.Module:
    """``DistributedDataParallel`` over every rank (CPU: no ``device_ids``), with the layout's
    ``bucket_cap_mb``. ``init_sync=False`` skips the constructor's check of the parameters'
    shapes across ranks and its broadcast of rank 0's values, which read real data (a trace has
    none); neither allocates anything that outlives the constructor."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, bucket_cap_mb=parallel.bucket_cap_mb,
                                   init_sync=init_sync)


def apply_tp(model: nn.Module, parallel: Parallel, mesh: Any) -> nn.Module:
    """Tensor parallelism with ``parallelize_module`` (Megatron's layout, as torchtitan's
    ``apply_tp`` writes it): in each block the attention's q/k/v and the MLP's gate/up
    projections are split by output features (``ColwiseParallel``), the attention output and
    MLP down projections by input features (``RowwiseParallel``, an all-reduce of the output);
    each attention module then runs ``heads / tp`` heads. Embeddings, norms and the head stay
    replicated (no sequence parallelism yet)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from memfit.techniques.checkpointing import find_blocks

    plan_names = {"q_proj": ColwiseParallel, "k_proj": ColwiseParallel,
                  "v_proj": ColwiseParallel, "o_proj": RowwiseParallel,
                  "gate_proj": ColwiseParallel, "up_proj": ColwiseParallel,
                  "down_proj": RowwiseParallel}
    for name in find_blocks(model):
        block = model.get_submodule(name)
        plan = {sub: plan_names[sub.rsplit(".", 1)[-1]]() for sub, mod in block.named_modules()
                if sub.rsplit(".", 1)[-1] in plan_names and isinstance(mod, nn.Linear)}
        if not plan:
            raise MemfitError(f"Parallel(tp={parallel.tp}): block {name} has none of the "
                              f"projections tensor parallelism splits ({', '.join(plan_names)})")
        parallelize_module(block, mesh, plan)
        for mod in block.modules():  # the attention's view() takes the local head counts
            if hasattr(mod, "q_proj"):
                for attr in ("num_heads", "num_kv_heads"):
                    if isinstance(getattr(mod, attr, None), int):
                        setattr(mod, attr, getattr(mod, attr) // parallel.tp)
    return model


def apply_model(model: nn.Module, parallel: Parallel, device_type: str,
                mesh: Any = None, init_sync: bool = True) -> nn.Module:
    """The model as this rank runs it: FSDP2/HSDP-sharded (on ``mesh``, default
    :func:`device_mesh`), DDP-wrapped, or itself."""
    if parallel.tp > 1 and parallel.tp == parallel.gpus:
        from torch.distributed.device_mesh import init_device_mesh

        return apply_tp(model, parallel, init_device_mesh(device_type, (parallel.tp,))
                        if mesh is None else mesh)
    if parallel.ep > 1:
        return apply_ep_dp(model, parallel, device_type, mesh, init_sync)
    if parallel.tp > 1 or parallel.pp > 1 or parallel.ep > 1:
        raise MemfitError(f"Parallel(tp={parallel.tp}, pp={parallel.pp}, ep={parallel.ep}): only "
                          "the data-parallel family (fsdp, hsdp, ddp, zero=1) and tp alone "
                          "(tp == gpus) are traced so far; use memfit plan's formulas for the "
                          "rest")
    if parallel.strategy in ("fsdp", "hsdp"):
        return apply_fsdp(model, parallel,
                          device_mesh(parallel, device_type) if mesh is None else mesh)
    if parallel.strategy in ("ddp", "zero1"):
        return apply_ddp(model, parallel, init_sync)
    return model


def apply_ep_dp(model: nn.Module, parallel: Parallel, device_type: str, mesh: Any = None,
                init_sync: bool = True) -> nn.Module:
    """Expert parallelism (``memfit.parallel.expert.apply_ep``: each rank keeps ``1/ep`` of the
    experts, tokens exchanged by all-to-all), then data parallelism over the other parameters,
    which every rank holds whole. With ``ep`` equal to the data-parallel ranks each expert is on
    one rank and is left out: DDP skips it
    (``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``), FSDP2 neither
    shards nor reduces it (``fully_shard(..., ignored_params=...)``). With fewer, the ``dp / ep``
    ranks holding the same experts shard them with FSDP2 on the "efsdp" mesh dimension first
    (``fully_shard(moe.experts, mesh=efsdp)``, as torchtitan's ``apply_fsdp`` did before 0.3),
    then each block and the root on the data-parallel mesh."""
    from memfit._compat.torch_internals import ddp_ignore
    from memfit.parallel.expert import apply_ep, ep_mesh, expert_parameter_names, moe_layers

    experts_mesh = ep_mesh(parallel, device_type)
    model = apply_ep(model, parallel, experts_mesh)
    names = expert_parameter_names(model)
    if parallel.strategy == "fsdp":
        dp_mesh = device_mesh(parallel, device_type) if mesh is None else mesh
        if experts_mesh is None:
            return apply_fsdp(model, parallel, dp_mesh,
                              ignored_params={model.get_parameter(n) for n in names})
        for _, moe in moe_layers(model):
            apply_fsdp(moe.experts, parallel, experts_mesh["efsdp"], blocks=[])
        return apply_fsdp(model, parallel, dp_mesh)
    ddp_ignore(model, names)
    return apply_ddp(model, parallel, init_sync)


def apply_optimizer(optimizer: torch.optim.Optimizer, parallel: Parallel) -> torch.optim.Optimizer:
    """ZeRO-1: the same optimizer class and settings as a ``ZeroRedundancyOptimizer`` (each rank
    keeps the states of its partition of the parameters); otherwise ``optimizer`` itself."""
    if parallel.strategy != "zero1":
        return optimizer
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from memfit.techniques.optim import constructor_settings

    params = [p for group in optimizer.param_groups for p in group["params"]]
    return ZeroRedundancyOptimizer(  # type: ignore[return-value]
        params, optimizer_class=type(optimizer), **constructor_settings(optimizer))
