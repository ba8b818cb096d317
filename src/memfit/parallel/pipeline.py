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

import dataclasses
from typing import Any

import torch
import torch.distributed.pipelining  # Note: [importing pipelining outside the trace]
import torch.nn.functional as F
from torch import nn

from memfit.dtypes import torch_dtype
from memfit.errors import MemfitError
from memfit.parallel.config import PP_SCHEDULES, Parallel

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
                          f"{type(model).__name__}, which has no base_model_pp_plan; name where "
                          "to split it: Parallel(pp_split_points=['blocks.2', ...])")
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


def split_of(model: nn.Module, parallel: Parallel) -> tuple[str, ...] | None:
    """Where ``model`` is split (``memfit.parallel.pipeline_split``): the layout's
    ``pp_split_points``, else transformers' ``config.base_model_pp_plan`` for a model that is not
    a decoder :func:`decoder_parts` splits; None for those (torchtitan's even split)."""
    if parallel.pp_split_points:
        return parallel.pp_split_points
    from memfit.models.build import DecoderLM
    from memfit.parallel.hf_pipeline import hf_decoder_parts

    if isinstance(model, DecoderLM) or hf_decoder_parts(model) is not None:
        return None
    from memfit.parallel.pipeline_split import pp_plan_points

    return pp_plan_points(model, parallel.pp * stages_per_rank(parallel))


def check_pipeline(model: nn.Module, parallel: Parallel, batch: int | None) -> None:
    """One-line errors for a pipeline layout the model or batch cannot take."""
    points = split_of(model, parallel)
    check_pipeline_dp(parallel)
    if points is not None:
        from memfit.parallel.pipeline_split import split_points

        split_points(model, points)
        if parallel.tp > 1 and (parallel.tp_plan is None or parallel.sp
                                or parallel.loss_parallel):
            raise MemfitError(f"Parallel(pp={parallel.pp}, tp={parallel.tp}) on a model split "
                              "at pp_split_points: the split runs with data parallelism (FSDP2, "
                              "HSDP, DDP, ZeRO-1), ep, and tp from a tp_plan of your own (no sp "
                              "or loss_parallel); use tp=1 or tp_plan=")
        if parallel.tp > 1:  # the whole model's plan: each stage takes its part (stage_plan)
            from memfit.parallel.tp_plans import user_plan

            user_plan(model, parallel)
        layers = parallel.pp * stages_per_rank(parallel)
    else:
        decoder, _ = decoder_parts(model)
        layers = len(decoder.layers)
    if parallel.tp > 1 and (parallel.sp or parallel.loss_parallel):
        from memfit.parallel.apply import sp_root

        sp_root(model, parallel)  # the model checks of sequence parallelism
    stages = parallel.pp * stages_per_rank(parallel)
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
    interleaved schedule also ``pp_rank + pp`` (torchtitan's "loop" placement). A model split
    at named points (:func:`split_of`) gets ``pipeline_split.SplitStageModule`` stages."""
    num_stages = parallel.pp * stages_per_rank(parallel)
    first_index = pp_rank(parallel, rank)
    points = split_of(model, parallel)
    if points is not None:
        from memfit.parallel.pipeline_split import split_stage_modules

        return split_stage_modules(  # type: ignore[return-value]
            model, points, num_stages,
            [first_index + s * parallel.pp for s in range(stages_per_rank(parallel))])
    decoder, _ = decoder_parts(model)
    layers = stage_layers(len(decoder.layers), num_stages)
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
    each stage runs in place of its module (its DDP wrapper:
    :func:`memfit.parallel.pipeline_parallelize.replicate_stages`)."""
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
        if hasattr(module, "io_metas"):  # a model split at named points: its own shapes
            inputs, outputs = module.io_metas(
                micro, seq, torch_dtype(parallel.param_dtype) if parallel.param_dtype else None)
            stages.append(PipelineStage(module if submods is None else submods[position], index,
                                        num_stages, torch.device(device), input_args=inputs,
                                        output_args=outputs, group=group))
            continue
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
