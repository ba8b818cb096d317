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

from memfit.dtypes import torch_dtype
from memfit.errors import MemfitError
from memfit.parallel.config import Parallel
from memfit.parallel.tp_replicate import is_norm as _is_norm
from memfit.parallel.tp_replicate import replicate_the_rest


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
    ``memfit.models.anatomy.find_blocks`` finds), then on the root (in place), with
    the layout's ``reshard_after_forward``, ``MixedPrecisionPolicy`` and ``CPUOffloadPolicy``."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    from memfit.models.anatomy import find_blocks

    kwargs: dict[str, Any] = {"mesh": mesh,
                              "reshard_after_forward": bool(parallel.reshard_after_forward)}
    if parallel.param_dtype or parallel.reduce_dtype:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch_dtype(parallel.param_dtype) if parallel.param_dtype else None,
            reduce_dtype=torch_dtype(parallel.reduce_dtype) if parallel.reduce_dtype else None)
    if parallel.cpu_offload:
        # Pinned host memory (torchtitan's CPUOffloadPolicy() default) needs an accelerator:
        # on a CPU-only torch (the trace's fake ranks, the gloo ranks) the shards stay pageable,
        # which changes no byte (Note: [CPU offload in a trace] in memfit/parallel/rank.py).
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
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


def apply_ddp(model: nn.Module, parallel: Parallel, init_sync: bool = True,
              process_group: Any = None) -> nn.Module:
    """``DistributedDataParallel`` over every rank (CPU: no ``device_ids``), with the layout's
    ``bucket_cap_mb``. ``init_sync=False`` skips the constructor's check of the parameters'
    shapes across ranks and its broadcast of rank 0's values, which read real data (a trace has
    none); neither allocates anything that outlives the constructor. ``process_group``: the
    ranks that replicate the module (default: every rank; a pipeline stage's data-parallel
    ranks: ``memfit.parallel.pipeline_parallelize.replicate_stages``)."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, bucket_cap_mb=parallel.bucket_cap_mb,
                                   init_sync=init_sync, process_group=process_group)


def tp_plan(model: nn.Module, parallel: Parallel, blocks: list[str] | None = None,
            root: tuple[str | None, str | None, str | None] | None = None) -> dict[str, Any]:
    """The ``parallelize_module`` plan (module name -> ``ParallelStyle``) of :func:`apply_tp`.

    Megatron's layout, as torchtitan's llama ``apply_tp`` writes it
    (``torchtitan/models/llama3/infra/parallelize.py``): in each block the attention's q/k/v and
    the MLP's gate/up projections are split by output features (``ColwiseParallel``), the
    attention output and MLP down projections by input features (``RowwiseParallel``); each
    attention module then runs ``heads / tp`` heads. Without sequence parallelism the row-wise
    outputs are all-reduced and the embeddings, norms and head stay replicated.

    Note: [sequence parallelism] With ``parallel.sp`` the residual stream between the
    projections is split along the sequence (dim 1), as torchtitan's plan does it
    (``torch/distributed/tensor/parallel/style.py``): the norms run on the local sequence shard
    (``SequenceParallel``: it "replicates a compatible ``nn.Module`` parameters and runs the
    sharded computation with input sharded on the sequence dimension"; its output stays a
    ``Shard(1)`` DTensor); the attention and the MLP
    all-gather it first (``PrepareModuleInput(input_layouts=Shard(1),
    desired_input_layouts=Replicate())``); ``o_proj`` and ``down_proj`` reduce-scatter their
    output back to the shard (``RowwiseParallel(output_layouts=Shard(1))``); the token embedding
    is split by vocabulary rows and reduce-scatters its output (``RowwiseParallel(
    input_layouts=Replicate(), output_layouts=Shard(1))``); the final norm is sequence-parallel
    and the head all-gathers its input and its logits (``ColwiseParallel(input_layouts=Shard(1),
    output_layouts=Replicate())``, as torchtitan with ``disable_loss_parallel``), unless
    ``parallel.loss_parallel`` keeps the logits split (Note: [loss parallelism]).

    ``blocks``: the blocks' names (default: ``find_blocks(model)``), e.g. a pipeline stage's
    ``layers.<i>`` (``memfit.parallel.pipeline_parallelize.apply_tp_stages``); ``root``: the
    names of the token embedding, final norm and head that sequence / loss parallelism split
    (default: ``sp_root(model)``; None for a part a pipeline stage does not hold).

    Note: [whose plan] ``parallel.tp_plan`` (the user's) comes first, then the model's own
    (transformers' ``tp_plan``, without sequence or loss parallelism, which it does not
    write), then the names above (``memfit.parallel.tp_plans``); a model none applies to is a
    one-line error naming ``tp_plan=``."""
    from memfit.parallel.tp_plans import hf_plan, user_plan

    if parallel.tp_plan is not None:
        if blocks is not None or root is not None:
            from memfit.parallel.pipeline_split import SplitStageModule
            from memfit.parallel.tp_plans import stage_plan

            if not isinstance(model, SplitStageModule):
                raise MemfitError(
                    f"Parallel(tp={parallel.tp}, pp={parallel.pp}, tp_plan=...): a plan of "
                    "your own splits the stages of a model split at pp_split_points (its names "
                    "are the model's); name the split points too, or drop tp_plan (memfit's "
                    "projection names split each stage of its own split)")
            return stage_plan(model, parallel)
        return user_plan(model, parallel)
    if blocks is None and root is None and not (parallel.sp or parallel.loss_parallel):
        own = hf_plan(model, parallel)
        if own is not None:
            return own
    return _names_plan(model, parallel, blocks, root)


def _names_plan(model: nn.Module, parallel: Parallel, blocks: list[str] | None,
                root: tuple[str | None, str | None, str | None] | None) -> dict[str, Any]:
    """memfit's plan by projection names (:func:`tp_plan`'s docstring)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    from memfit.models.anatomy import COLWISE_PROJECTIONS, ROWWISE_PROJECTIONS, find_blocks
    from memfit.parallel.hf_pipeline import attention_input, is_hf_attention

    sp = parallel.sp
    row_out = {"output_layouts": Shard(1)} if sp else {}
    plan_names = ({n: ColwiseParallel for n in COLWISE_PROJECTIONS}
                  | {n: RowwiseParallel for n in ROWWISE_PROJECTIONS})
    plan: dict[str, Any] = {}
    for name in find_blocks(model) if blocks is None else blocks:
        block = model.get_submodule(name)
        found = {sub: plan_names[sub.rsplit(".", 1)[-1]] for sub, mod in block.named_modules()
                 if sub.rsplit(".", 1)[-1] in plan_names and isinstance(mod, nn.Linear)}
        if not found:
            raise MemfitError(f"Parallel(tp={parallel.tp}): block {name} has none of the "
                              f"projections memfit's plan splits ({', '.join(plan_names)}) and "
                              f"{type(model).__name__} has no tp_plan of its own; pass "
                              "tp_plan={'<module pattern>': 'colwise' | 'rowwise', ...}")
        for sub, style in found.items():
            plan[f"{name}.{sub}"] = (style(**row_out) if style is RowwiseParallel else style())
        if sp:
            for sub, mod in block.named_children():
                if _is_norm(mod):
                    plan[f"{name}.{sub}"] = SequenceParallel()
                elif is_hf_attention(mod):  # Hugging Face's: (hidden_states=x, ...)
                    plan[f"{name}.{sub}"] = attention_input(Shard(1), Replicate())
                elif hasattr(mod, "q_proj"):  # the attention: (x, rope)
                    plan[f"{name}.{sub}"] = PrepareModuleInput(
                        input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None))
                elif hasattr(mod, "down_proj"):  # the MLP: (x,)
                    plan[f"{name}.{sub}"] = PrepareModuleInput(
                        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    if sp or parallel.loss_parallel:
        embed, norm, head = sp_root(model, parallel) if root is None else root
        # Note: [loss parallelism] the logits stay a vocabulary-split DTensor and the loss
        # runs inside torch's loss_parallel() (torch/distributed/tensor/parallel/loss.py: "the
        # input is sharded on the class dimension"), as torchtitan's apply_tp writes the head
        # (output_layouts=Shard(-1), use_local_output=False) when loss parallelism is on.
        logits: dict[str, Any] = ({"output_layouts": Shard(-1), "use_local_output": False}
                                  if parallel.loss_parallel else
                                  {"output_layouts": Replicate()})
        if sp:
            if embed is not None:
                plan[embed] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
            if norm is not None:
                plan[norm] = SequenceParallel()
            logits["input_layouts"] = Shard(1)
        if head is not None:
            plan[head] = ColwiseParallel(**logits)
    return plan


def sp_root(model: nn.Module, parallel: Parallel) -> tuple[str, str, str]:
    """Names of the token embedding, final norm and head that sequence parallelism splits, for
    memfit's builtin decoders (``memfit.models.build.DecoderLM``) and Hugging Face's Llama,
    Mistral, Qwen2 and Qwen3 (``hf_pipeline.hf_sp_root``; their position ids are given whole:
    ``hf_pipeline.full_positions``): a one-line error for other models, whose forward may read
    the sequence length off the (now split) hidden states, as Hugging Face's position ids do."""
    from memfit.models.build import DecoderLM
    from memfit.models.builtin_layers import Mlp

    where = f"Parallel(tp={parallel.tp}, {'sp' if parallel.sp else 'loss_parallel'}=True)"
    from memfit.parallel.hf_pipeline import hf_sp_root

    hf_root = hf_sp_root(model)  # Hugging Face's Llama family (hf_pipeline.py)
    if hf_root is not None:
        if model.lm_head.weight is model.model.embed_tokens.weight:
            raise MemfitError(f"{where}: tied embeddings are split two ways (embedding by rows, "
                              "head by columns of the same weight); use sp=False and "
                              "loss_parallel=False")
        return hf_root
    if not isinstance(model, DecoderLM):
        raise MemfitError(f"{where} is traced for memfit's builtin decoders so far (build the "
                          f"model with backend='builtin'), not {type(model).__name__}")
    if parallel.sp and any(layer.sandwich or layer.post_norm or not isinstance(layer.mlp, Mlp)
                           for layer in model.model.layers):
        raise MemfitError(f"{where}: sequence parallelism is traced for blocks with a norm "
                          "before the attention and one before a dense MLP (Llama's), not "
                          "sandwich / post-sub-layer norms or MoE; use sp=False")
    if parallel.sp and model.model.embed_positions is not None:
        raise MemfitError(f"{where}: learned position embeddings are added to the full "
                          "sequence, which sequence parallelism splits; use sp=False")
    if model.lm_head.weight is model.model.embed_tokens.weight:
        raise MemfitError(f"{where}: tied embeddings are split two ways (embedding by rows, "
                          "head by columns of the same weight); use sp=False and "
                          "loss_parallel=False")
    return "model.embed_tokens", "model.norm", "lm_head"


def loss_context(parallel: Parallel) -> Any:
    """The context the loss and its backward run in: torch's ``loss_parallel()`` with
    ``parallel.loss_parallel`` ("The corresponding backward() call, if any, also needs to happen
    under this context manager"), else a null one."""
    import contextlib

    if not parallel.loss_parallel:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def tp_split_dims(model: nn.Module, parallel: Parallel, blocks: list[str] | None = None,
                  root: tuple[str | None, str | None, str | None] | None = None
                  ) -> dict[int, int]:
    """``id(parameter) -> dim`` of each parameter :func:`apply_tp` shards, as the styles place
    them (``style.py``: ``ColwiseParallel`` shards a Linear's weight and bias on dim 0,
    ``RowwiseParallel`` a Linear's weight on dim 1 (bias replicated) and an Embedding's weight
    on dim 0); DTensor splits a dim as ``torch.chunk`` does."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    dims: dict[int, int] = {}
    for name, style in tp_plan(model, parallel, blocks, root).items():
        if not isinstance(style, ColwiseParallel | RowwiseParallel):
            continue  # transformers' own styles: split evenly (tp_plans.hf_plan checks)
        mod = model.get_submodule(name)
        if isinstance(style, ColwiseParallel) and isinstance(mod, nn.Linear):
            dims.update({id(p): 0 for p in mod.parameters(recurse=False)})
        elif isinstance(style, RowwiseParallel) and isinstance(mod, nn.Linear):
            dims[id(mod.weight)] = 1
        elif isinstance(style, RowwiseParallel) and isinstance(mod, nn.Embedding):
            dims[id(mod.weight)] = 0
    return dims


def apply_tp(model: nn.Module, parallel: Parallel, mesh: Any, blocks: list[str] | None = None,
             root: tuple[str | None, str | None, str | None] | None = None,
             leave: tuple[str, ...] = ()) -> nn.Module:
    """Tensor (and, with ``parallel.sp``, sequence) parallelism with ``parallelize_module`` over
    the 1-D tensor-parallel ``mesh``, the plan of :func:`tp_plan` (``blocks``, ``root``: as
    there); ``leave``: modules whose parameters stay plain tensors, not replicated over ``mesh``
    (expert parallelism's experts: :func:`apply_ep_tp`)."""
    from torch.distributed.tensor.parallel import parallelize_module

    from memfit.parallel.tp_plans import HfStyle, apply_hf_styles

    plan = tp_plan(model, parallel, blocks, root)
    if leave:  # a model's own plan may split them (transformers' moe_tp_experts)
        plan = {name: style for name, style in plan.items()
                if not any(name == lv or name.startswith(f"{lv}.") for lv in leave)}
    own = {name: style for name, style in plan.items() if isinstance(style, HfStyle)}
    if len(own) < len(plan):
        parallelize_module(model, mesh, {n: s for n, s in plan.items() if n not in own})
    if own:  # a transformers model's own plan, applied as transformers applies it
        apply_hf_styles(model, mesh, own)
    replicate_the_rest(model, mesh, {**plan, **dict.fromkeys(leave)})
    if parallel.sp:
        model.register_forward_pre_hook(_even_sequence(parallel.tp), with_kwargs=True)
        from memfit.parallel.hf_pipeline import full_positions, is_hf_decoder

        if is_hf_decoder(model):  # its forward would read seq / tp positions (hf_pipeline.py)
            full_positions(model)
    for mod in model.modules():  # the attention's view() takes the local head counts
        if hasattr(mod, "q_proj"):
            for attr in ("num_heads", "num_kv_heads"):
                if isinstance(getattr(mod, attr, None), int):
                    setattr(mod, attr, getattr(mod, attr) // parallel.tp)
    return model


def _even_sequence(tp: int) -> Any:
    """A forward pre-hook refusing a sequence that ``tp`` does not divide: sequence parallelism
    would give the last ranks fewer tokens (DTensor's ``Shard`` splits as ``torch.chunk``), and
    a rank role is traced once for ranks that hold the same parameters."""

    def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[1] % tp:
            raise MemfitError(f"Parallel(tp={tp}, sp=True): the sequence of {ids.shape[1]} "
                              f"tokens does not split evenly over {tp} ranks; use a sequence "
                              f"length divisible by {tp}")

    return hook


def tp_device_mesh(parallel: Parallel, device_type: str) -> Any:
    """The mesh of a layout with tensor parallelism: 1-D ``("tp",)`` alone, 2-D ``("dp", "tp")``
    with data parallelism (torchtitan's ``ParallelDims.build_mesh`` order: the tensor-parallel
    ranks are the adjacent ones, ``rank = dp_index * tp + tp_index``)."""
    from torch.distributed.device_mesh import init_device_mesh

    if parallel.dp == 1:
        return init_device_mesh(device_type, (parallel.tp,), mesh_dim_names=("tp",))
    if parallel.strategy == "hsdp":  # 3-D: torchtitan's ("dp_replicate", "dp_shard", "tp")
        return init_device_mesh(device_type, (parallel.replicate, parallel.fsdp, parallel.tp),
                                mesh_dim_names=("replicate", "shard", "tp"))
    return init_device_mesh(device_type, (parallel.dp, parallel.tp), mesh_dim_names=("dp", "tp"))


def _check_tp_dp(parallel: Parallel) -> None:
    """Tensor parallelism combines with FSDP2 only. DDP (and ZeRO-1, DDP with a sharded
    optimizer) over a mesh dim beside TP is refused as torchtitan refuses it
    (``parallelize_llama``: "DDP has not supported > 1D parallelism"); HSDP with TP needs a
    3-D ``("replicate", "shard", "tp")`` mesh."""
    if parallel.dp > 1 and parallel.strategy not in ("fsdp", "hsdp"):
        raise MemfitError(
            f"Parallel(tp={parallel.tp}) with {parallel.strategy} over {parallel.dp} "
            "data-parallel ranks is not traced yet: only the data-parallel family (fsdp, hsdp, "
            "ddp, zero=1), tp alone and tp x fsdp / hsdp are (DDP beside TP is refused by "
            f"torchtitan too); use fsdp={parallel.dp}")


def apply_tp_dp(model: nn.Module, parallel: Parallel, mesh: Any) -> nn.Module:
    """Tensor parallelism on ``mesh["tp"]``, then FSDP2 on ``mesh["dp"]`` (torchtitan's order in
    ``parallelize_llama``: TP first, then ``fully_shard`` with the data-parallel sub-mesh; FSDP2
    then shards each DTensor parameter's local tensor on dim 0 over the dp ranks)."""
    _check_tp_dp(parallel)
    tp_mesh = mesh["tp"] if mesh.ndim > 1 else mesh
    apply_tp(model, parallel, tp_mesh)
    if parallel.dp > 1:
        apply_fsdp(model, parallel, mesh["replicate", "shard"] if parallel.strategy == "hsdp"
                   else mesh["dp"])
    return model


def apply_model(model: nn.Module, parallel: Parallel, device_type: str,
                mesh: Any = None, init_sync: bool = True) -> nn.Module:
    """The model as this rank runs it: FSDP2/HSDP-sharded (on ``mesh``, default
    :func:`device_mesh`), DDP-wrapped, or itself."""
    if parallel.tp > 1 and parallel.pp == 1:
        _check_tp_dp(parallel)  # before a mesh is made
        mesh = tp_device_mesh(parallel, device_type) if mesh is None else mesh
        if parallel.ep > 1:
            return apply_ep_tp(model, parallel, device_type, mesh)
        return apply_tp_dp(model, parallel, mesh)
    if parallel.ep > 1:
        return apply_ep_dp(model, parallel, device_type, mesh, init_sync)
    if parallel.tp > 1 or parallel.pp > 1 or parallel.ep > 1:
        raise MemfitError(f"Parallel(tp={parallel.tp}, pp={parallel.pp}, ep={parallel.ep}): only "
                          "the data-parallel family (fsdp, hsdp, ddp, zero=1), tp alone and tp x "
                          "fsdp / hsdp are traced so far; use memfit plan's formulas for the "
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


def apply_ep_tp(model: nn.Module, parallel: Parallel, device_type: str, mesh: Any) -> nn.Module:
    """Expert parallelism beside tensor parallelism (torchtitan's order in
    ``parallelize_llama``: the dense tensor parallelism, then ``apply_moe_ep_tp``, then FSDP2):
    :func:`apply_tp_beside_ep`, then :func:`apply_fsdp_beside_ep`."""
    apply_tp_beside_ep(model, parallel, device_type, mesh)
    return apply_fsdp_beside_ep(model, parallel, mesh)


def apply_tp_beside_ep(model: nn.Module, parallel: Parallel, device_type: str,
                       mesh: Any) -> nn.Module:
    """``apply_ep`` on the ``(efsdp, ep)`` mesh over the ``dp * tp`` ranks (each tp rank routing
    its chunk of the tokens: Note: [expert parallelism beside tensor parallelism] in
    memfit/parallel/expert.py), then tensor parallelism on ``mesh["tp"]`` for the rest (the
    experts left plain tensors, out of the plan: transformers' own plans split them,
    ``moe_tp_experts``), in place."""
    from memfit.parallel.expert import apply_ep, ep_mesh, moe_layers

    tp_mesh = mesh["tp"] if mesh.ndim > 1 else mesh
    apply_ep(model, parallel, ep_mesh(parallel, device_type), tp_mesh)
    return apply_tp(model, parallel, tp_mesh,
                    leave=tuple(f"{name}.experts" for name, _ in moe_layers(model)))


def apply_fsdp_beside_ep(model: nn.Module, parallel: Parallel, mesh: Any) -> nn.Module:
    """Over ``dp > 1`` data-parallel ranks (the ``mesh["dp"]`` of :func:`tp_device_mesh`): FSDP2
    on each MoE layer's experts over the ranks that hold the same ones ("efsdp" of the mesh
    ``apply_ep`` got; left out of FSDP2 when ``ep`` is every rank), then on each block and the
    root (:func:`apply_fsdp`)."""
    from memfit.parallel.expert import expert_parameter_names, moe_layers

    if parallel.dp == 1:
        return model
    layers = moe_layers(model)
    experts_mesh = getattr(layers[0][1].experts, "ep_mesh", None) if layers else None
    if experts_mesh is None:
        return apply_fsdp(model, parallel, mesh["dp"], ignored_params={
            model.get_parameter(n) for n in expert_parameter_names(model)})
    for _, moe in layers:
        apply_fsdp(moe.experts, parallel, experts_mesh["efsdp"], blocks=[])
    return apply_fsdp(model, parallel, mesh["dp"])


def apply_optimizer(optimizer: torch.optim.Optimizer, parallel: Parallel,
                    process_group: Any = None) -> torch.optim.Optimizer:
    """ZeRO-1: the same optimizer class and settings as a ``ZeroRedundancyOptimizer`` (each rank
    keeps the states of its partition of the parameters among the ranks of ``process_group``,
    default every rank; a pipeline stage's data-parallel ranks with ``pp``); otherwise
    ``optimizer`` itself."""
    if parallel.strategy != "zero1":
        return optimizer
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from memfit.techniques.optim import constructor_settings

    params = [p for group in optimizer.param_groups for p in group["params"]]
    return ZeroRedundancyOptimizer(  # type: ignore[return-value]
        params, optimizer_class=type(optimizer), process_group=process_group,
        **constructor_settings(optimizer))
