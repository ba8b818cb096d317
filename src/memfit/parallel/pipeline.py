"""Pipeline parallelism: PyTorch's own ``torch.distributed.pipelining`` stages and schedules, on
the fake model of one rank (the trace) and on the real model of each gloo rank (the truth).

The model is split the way torchtitan splits it by hand (``torchtitan/distributed/
pipeline_parallel.py: generate_llm_fqn_per_model_part, pipeline_module_split``): the embedding
counts as one layer and the final norm + head as one more, those "effective layers" are dealt
out evenly, first stages first; each stage keeps its slice of the transformer blocks, the first
the embedding, the last the final norm, the head and the loss. The ranks form a ``(pp, dp)``
mesh, pipeline outermost (torchtitan's order); a rank runs stage ``pp_rank`` (and, for the
interleaved schedule, ``pp_rank + pp``: torchtitan's "loop" placement, two stages per rank),
FSDP2-sharded over its ``dp`` ranks when ``dp > 1``. Only a rank's own stages are faked and
traced. The step is the schedule's ``step`` (``torch/distributed/pipelining/schedules.py:
PipelineScheduleSingle.step``, ``PipelineScheduleMulti.step``) with ``return_outputs=False``, as
torchtitan's trainer calls it, so the last stage keeps no micro-batch's logits for merging.

What the schedule holds, it holds because it runs: the stage's forward cache keeps each
micro-batch's output and inputs until that micro-batch's backward (``stage.py:
_PipelineStageBase.forward_one_chunk``, ``fwd_cache``), so GPipe keeps every micro-batch's
activations (``schedules.py: ScheduleGPipe._step_microbatches``: all forwards, then all
backwards) and 1F1B at most ``pp - stage`` (``Schedule1F1B._step_microbatches``: ``warmup_chunks
= min(n_microbatches, num_stages - stage_index)``); a non-first stage allocates one receive
buffer per micro-batch for activations and, when it is not last, one for gradients, and keeps
them for its lifetime (``stage.py: PipelineStage._setup_forward_recv_info``,
``_create_grad_recv_info``); the gradient of each received activation stays on its buffer's
``.grad`` until the next step's ``clear_runtime_states``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed.pipelining  # Note: [importing pipelining outside the trace]
import torch.nn.functional as F
from torch import nn

from memfit._compat.torch_pipelining import (
    autograd_backward_keeps_function_modes,
    p2p_works_hold_their_tensors,
    stage_chunks_within,
    warmup_vote_static,
)
from memfit.dtypes import torch_dtype
from memfit.errors import MemfitError
from memfit.parallel.config import PP_SCHEDULES, Parallel
from memfit.parallel.rank import RankRole, host_step, offloaded

# Note: [importing pipelining outside the trace] ``torch/distributed/pipelining/microbatch.py``
# makes a tensor when it is first imported (module level: ``sum_reducer = _LossReducer(
# torch.tensor(0.0), operator.add)``). Imported lazily by the first pipeline trace of a process
# (``build_pipeline`` runs inside the fake mode), that ``torch.tensor`` became a traced CUDA
# allocation (``aten.lift_fresh``, 4 bytes, one 512-byte block) at step 0 of that trace only, and
# left a fake tensor in torch's module for good. A real run imports it before its first step, a
# host tensor. Importing it with this module (outside any trace: the roles are made before the
# fake mode starts) makes the first trace equal to the later ones.

SCHEDULES = PP_SCHEDULES
"""Pipeline schedules: ``torch.distributed.pipelining``'s ``ScheduleGPipe``, ``Schedule1F1B``,
``ScheduleInterleaved1F1B``."""


def stages_per_rank(parallel: Parallel) -> int:
    """Virtual stages a rank holds: 2 for the interleaved schedule (torchtitan's default for
    multi-stage schedules), else 1."""
    return 2 if parallel.pp_schedule == "interleaved-1f1b" else 1


def stage_layers(num_layers: int, num_stages: int) -> list[range]:
    """The transformer blocks of each stage, torchtitan's even split of the effective layers
    (``generate_llm_fqn_per_model_part`` with ``input_weight = output_weight = 1``): the
    embedding and the norm + head count as one layer each; the first ``effective % stages``
    stages take one more.

    >>> stage_layers(4, 2)  # 6 effective layers: embedding + 2 blocks | 2 blocks + head
    [range(0, 2), range(2, 4)]
    """
    effective = num_layers + 2
    if num_stages > num_layers or num_stages < 1:
        raise MemfitError(f"{num_stages} pipeline stages for {num_layers} layers; use at most "
                          f"{num_layers} stages")
    base, extra = divmod(effective, num_stages)
    out, start = [], 0
    for index in range(num_stages):
        size = base + (index < extra) - (index == 0) - (index == num_stages - 1)
        size = max(0, min(size, num_layers - start))
        out.append(range(start, start + size))
        start += size
    return out


def decoder_parts(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(``model.model``, ``model.lm_head``) of memfit's builtin decoder or of a Hugging Face
    decoder ``hf_pipeline.HFStageModule`` splits, else a one-line error."""
    from memfit.models.build import DecoderLM

    if not isinstance(model, DecoderLM):
        from memfit.parallel.hf_pipeline import HF_DECODERS, hf_decoder_parts

        parts = hf_decoder_parts(model)  # Hugging Face's Llama family (hf_pipeline.py)
        if parts is not None:
            return parts
        raise MemfitError(f"Parallel(pp>1) splits memfit's builtin decoders (memfit.models."
                          f"build_model) and Hugging Face's {', '.join(HF_DECODERS)}, not "
                          f"{type(model).__name__}; build the model with build_model(spec, "
                          "backend='builtin') or use memfit plan's formulas")
    return model.model, model.lm_head


class StageModule(nn.Module):
    """One pipeline stage of a builtin decoder, holding the model's own submodules (no copy):
    blocks ``layers`` (named by their index in the whole model, as torchtitan keeps them), the
    embedding on the first stage, the final norm and head on the last. Its forward takes the
    token ids (first stage) or the hidden states and returns the hidden states, or the logits
    on the last stage."""

    def __init__(self, model: nn.Module, layers: range, *, index: int, first: bool,
                 last: bool) -> None:
        super().__init__()
        decoder, head = decoder_parts(model)
        self.index, self.first, self.last = index, first, last
        self.hidden_size = int(decoder.embed_tokens.weight.shape[1])
        self.embed_tokens = decoder.embed_tokens if first else None
        self.embed_positions = decoder.embed_positions if first else None
        self.dropout = decoder.dropout
        self.rotary_emb = decoder.rotary_emb
        self.layers = nn.ModuleDict({str(i): decoder.layers[i] for i in layers})
        self.norm = decoder.norm if last else None
        self.lm_head = head if last else None
        self.seq_shards = 1  # sequence parallelism: a later stage gets 1/tp of the sequence

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = x.shape[1] * (1 if self.first else self.seq_shards)
        if self.first:  # as DecoderModel.forward
            ids = x
            x = self.embed_tokens(ids)  # type: ignore[misc]
            if self.embed_positions is not None:
                x = x + self.embed_positions(torch.arange(seq, device=ids.device))
            x = self.dropout(x)
        rope = self.rotary_emb(x, seq) if self.rotary_emb is not None else None
        for layer in self.layers.values():
            x = layer(x, rope)
        if self.last:
            x = self.lm_head(self.norm(x))  # type: ignore[misc]
        return x


def stage_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The last stage's loss: the builtin decoder's own (``DecoderLM.forward``: fp32 logits,
    labels shifted left)."""
    shift_labels = F.pad(labels, (0, 1), value=-100)[:, 1:]
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                           shift_labels.reshape(-1), ignore_index=-100)


def num_microbatches(parallel: Parallel) -> int:
    return parallel.microbatches or parallel.pp


def check_pipeline(model: nn.Module, parallel: Parallel, batch: int | None) -> None:
    """One-line errors for a pipeline layout the model or batch cannot take."""
    decoder, _ = decoder_parts(model)
    check_pipeline_dp(parallel)
    if parallel.tp > 1 and (parallel.sp or parallel.loss_parallel):
        from memfit.parallel.apply import sp_root

        sp_root(model, parallel)  # the model checks of sequence parallelism
    stages = parallel.pp * stages_per_rank(parallel)
    layers = len(decoder.layers)
    if stages > layers:
        raise MemfitError(f"Parallel(pp={parallel.pp}, pp_schedule={parallel.pp_schedule!r}) "
                          f"needs {stages} stages, more than the model's {layers} layers; use "
                          "a smaller pp")
    n = num_microbatches(parallel)
    if batch is not None and batch % n:
        raise MemfitError(f"Parallel(microbatches={n}) does not divide the batch of {batch}; "
                          "choose a number of micro-batches that divides it")
    if parallel.pp_schedule != "gpipe" and n < parallel.pp:
        raise MemfitError(f"Parallel(pp_schedule={parallel.pp_schedule!r}) needs at least pp="
                          f"{parallel.pp} micro-batches, got microbatches={n}")
    if parallel.pp_schedule == "interleaved-1f1b" and n % parallel.pp:
        raise MemfitError(f"Parallel(pp_schedule='interleaved-1f1b') needs microbatches ({n}) "
                          f"divisible by pp={parallel.pp}")


@dataclasses.dataclass
class Pipeline:
    """This rank's stages of a model and the schedule that runs them."""

    modules: list[StageModule]
    schedule: Any

    @property
    def first(self) -> bool:
        return any(m.first for m in self.modules)

    @property
    def last(self) -> bool:
        return any(m.last for m in self.modules)

    def step(self, inputs: dict[str, torch.Tensor], losses: list[Any] | None = None) -> None:
        """One schedule step over the whole batch, as torchtitan's trainer calls it: the token
        ids on the rank with the first stage, the labels on the rank with the last; the last
        stage appends each micro-batch's loss to ``losses`` when given."""
        target = inputs["labels"] if self.last else None
        if self.first:
            self.schedule.step(inputs["input_ids"], target=target, losses=losses,
                               return_outputs=False)
        else:
            self.schedule.step(target=target, losses=losses, return_outputs=False)


def pp_rank(parallel: Parallel, rank: int) -> int:
    """The pipeline rank of a global rank: the mesh is ``(pp, dp, tp)``, pipeline outermost and
    tensor parallelism innermost, as torchtitan orders it (``ParallelDims``: pp, dp_replicate,
    dp_shard, cp, tp)."""
    return rank // (parallel.dp * parallel.tp)


def stage_modules(model: nn.Module, parallel: Parallel, rank: int) -> list[StageModule]:
    """This rank's stages of ``model`` (its own submodules): stage ``pp_rank``, and for the
    interleaved schedule also ``pp_rank + pp`` (torchtitan's "loop" placement)."""
    decoder, _ = decoder_parts(model)
    num_stages = parallel.pp * stages_per_rank(parallel)
    layers = stage_layers(len(decoder.layers), num_stages)
    first_index = pp_rank(parallel, rank)
    cls = _stage_class(model)
    return [cls(model, layers[index], index=index, first=index == 0,
                last=index == num_stages - 1)
            for index in (first_index + s * parallel.pp for s in range(stages_per_rank(parallel)))]


def _stage_class(model: nn.Module) -> Any:
    """:class:`StageModule` for memfit's builtin decoders, ``hf_pipeline.HFStageModule`` for
    Hugging Face's (its forward runs their layers as ``LlamaModel.forward`` does)."""
    from memfit.models.build import DecoderLM

    if isinstance(model, DecoderLM):
        return StageModule
    from memfit.parallel.hf_pipeline import HFStageModule

    return HFStageModule


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
        apply_fsdp(module, parallel, dp_mesh, blocks=[f"layers.{k}" for k in module.layers])


# -- data parallelism beside the pipeline ------------------------------------------------------

def check_pipeline_dp(parallel: Parallel) -> None:
    """One-line errors for the data parallelism beside the pipeline that is not traced.

    Traced: FSDP2 and HSDP on each stage (torchtitan's layouts: ``parallelize_llama``'s
    ``apply_fsdp`` with the ``("dp_replicate", "fsdp")`` mesh on each model part), DDP on each
    stage and ZeRO-1 (DDP + ``ZeroRedundancyOptimizer`` over the stage's data-parallel group),
    which PyTorch's pipelining drives (``torch/distributed/pipelining/stage.py:
    _PipelineStageBase.backward_maybe_with_nosync``: "If submod is wrapped by DDP", ``no_sync``
    for every micro-batch but the last). DDP / ZeRO-1 beside tensor parallelism is refused as
    torchtitan refuses it (``torchtitan/models/llama3/infra/parallelize.py: parallelize_llama``,
    v0.2.2: "DDP has not supported > 1D parallelism")."""
    if parallel.tp > 1 and parallel.strategy in ("ddp", "zero1"):
        raise MemfitError(f"Parallel(pp={parallel.pp}, tp={parallel.tp}) with "
                          f"{parallel.strategy} over {parallel.dp} data-parallel ranks: DDP "
                          "beside tensor parallelism is refused (torchtitan: \"DDP has not "
                          f"supported > 1D parallelism\"); use fsdp={parallel.dp}")


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

    return init_device_mesh(device_type, (parallel.pp, parallel.dp // parallel.ep, parallel.ep),
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
        experts_mesh = ep_pipeline_mesh(parallel)
    for module in modules:
        if moe_layers(module):  # a stage of only the final norm and head has none
            apply_ep(module, parallel, experts_mesh)
    if parallel.strategy == "fsdp":
        for module in modules:
            blocks = [f"layers.{k}" for k in module.layers]
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
    """The names of a stage's transformer blocks inside it (``layers.<i>``)."""
    return [f"layers.{k}" for k in module.layers]


def apply_tp_stages(modules: list[StageModule], parallel: Parallel, mesh: Any) -> None:
    """Tensor parallelism on each stage over the mesh's ``tp`` dimension (the plan of
    ``memfit.parallel.apply.tp_plan`` on the stage's own blocks; the embedding, final norm and
    head replicated), then, with data parallelism, FSDP2 over ``dp``: torchtitan's order
    (``torchtitan/distributed/pipeline_parallel.py: pipeline_llm`` splits the model into
    stages first, then calls ``parallelize_llama`` on each model part: ``apply_tp``, then
    ``apply_fsdp``)."""
    from memfit.parallel.apply import apply_tp

    for module in modules:
        apply_tp(module, parallel, mesh["tp"], blocks=stage_blocks(module),
                 root=stage_root(module))
        if parallel.sp:
            module.seq_shards = parallel.tp
    if parallel.dp > 1:
        shard_stages(modules, parallel, mesh)


def _autocast_dtype() -> torch.dtype | None:
    """The dtype autocast gives the last stage's ``lm_head`` (a linear: on its lower-precision
    list) when the pipeline is built inside autocast, as the trace builds it; torch 2.11's
    ``PipelineStage`` checks each stage's outputs against the declared ones
    (``stage.py: _validate_fwd_outputs``)."""
    for device in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device):
            return torch.get_autocast_dtype(device)
    return None


def build_pipeline(modules: list[StageModule], parallel: Parallel, batch: int, seq: int,
                   device: str = "cpu", group: Any = None, *, loss_fn: Any = stage_loss,
                   scale_grads: bool = True, submods: list[nn.Module] | None = None) -> Pipeline:
    """``modules`` (:func:`stage_modules` of ``rank``) as ``PipelineStage``s and the layout's
    schedule over them; torch.distributed must be initialised with ``parallel.gpus`` ranks.
    Every stage is given its input and output shapes (``input_args``, ``output_args``), so no
    stage infers them at run time (static metadata: ``stage.py: PipelineStage``).
    ``loss_fn(logits, labels)`` and ``scale_grads`` go to the schedule (``schedules.py:
    _PipelineSchedule.__init__``: True divides the gradients by the micro-batches after the
    step); ``memfit.fitting.apply`` weighs each micro-batch's loss itself. ``submods``: what
    each stage runs in place of its module (its DDP wrapper: :func:`replicate_stages`)."""
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    per_rank = stages_per_rank(parallel)
    num_stages = parallel.pp * per_rank
    n = num_microbatches(parallel)
    if batch % n:
        raise MemfitError(f"Parallel(microbatches={n}) does not divide the batch of {batch}; "
                          "choose a number of micro-batches that divides it")
    micro = batch // n
    stages = []
    for position, module in enumerate(modules):
        index = module.index
        # the hidden states' dtype: FSDP2's compute dtype, else the parameters' (an fp32 model
        # under autocast keeps an fp32 residual stream: embedding + residual adds)
        width = module.hidden_size
        dtype = (torch_dtype(parallel.param_dtype) if parallel.param_dtype else
                 next(p.dtype for p in module.parameters() if p.is_floating_point()))
        with torch.device("meta"):
            ids = torch.zeros(micro, seq, dtype=torch.long)
            # requires_grad: the metadata of the gradients sent back (stage.py:
            # _derive_grad_metas gives none for an output that needs no gradient)
            # (sequence parallelism: the stages exchange seq / tp rows of the hidden states)
            states = torch.zeros(micro, seq // parallel.tp if parallel.sp else seq, width,
                                 dtype=dtype, requires_grad=True)
            logits = torch.zeros(micro, seq, module.lm_head.out_features if module.last else 1,
                                 dtype=_autocast_dtype() or dtype,
                                 requires_grad=True)  # type: ignore[union-attr]
        stages.append(PipelineStage(module if submods is None else submods[position], index,
                                    num_stages, torch.device(device),
                                    input_args=ids if module.first else states,
                                    output_args=logits if module.last else states, group=group))
    if parallel.pp_schedule == "interleaved-1f1b":
        schedule = ScheduleInterleaved1F1B(stages, n, loss_fn=loss_fn, scale_grads=scale_grads)
    else:
        cls = ScheduleGPipe if parallel.pp_schedule == "gpipe" else Schedule1F1B
        schedule = cls(stages[0], n, loss_fn=loss_fn, scale_grads=scale_grads)
    return Pipeline(modules, schedule)


# -- the trace's rank role ---------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class PipelineRole(RankRole):
    """A pipeline rank: its stages of the fake model, run by the layout's schedule as the
    step (the engine calls :meth:`run_step` in place of forward + backward)."""

    state: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    runs_step = True

    def local_model(self, model: nn.Module) -> nn.Module:
        """This rank's stages of the real model (the engine fakes only these): a
        :class:`StageModule`, or a ``ModuleList`` of two (interleaved)."""
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
