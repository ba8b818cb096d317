"""The multi-GPU layouts :func:`memfit.fit` searches with ``gpus=N``: data-parallel sharding x
tensor x pipeline parallelism, as :class:`memfit.Parallel` values, and the formulas that derive a
layout's per-rank memory from the one-GPU trace before the per-rank trace checks the ones that
can win (Note: [layouts are derived, then traced] in :mod:`memfit.fitting.search_verify`).

Every tp > 1 layout also comes with sequence parallelism (``sp=True``) and with sequence and
loss parallelism (``sp=True, loss_parallel=True``; loss parallelism not under a pipeline) where
:func:`memfit.parallel.apply.tp_plan` splits the model that way (memfit's builtin decoders with
untied embeddings, rotary positions and dense MLPs); a mixture-of-experts model (memfit's builtin
MoE, transformers' experts modules) also gets expert-parallel layouts (``ep`` dividing its
experts and the data-parallel ranks, with DDP when ``ep`` is every data-parallel rank or FSDP2
over all of them; alone or on each pipeline stage; and, without a ``tp_plan``, beside tp:
``ep`` a multiple of ``tp`` dividing the ``dp * tp`` ranks, FSDP2 over the data-parallel ones:
:func:`memfit.parallel.expert.check_experts`).

Known limitations: tensor parallelism is Megatron's split of the attention and MLP projections,
as :func:`memfit.parallel.apply.apply_tp` applies it, so the model's blocks must name their
projections as Llama does (``q_proj`` ... ``down_proj``), unless ``fit(tp_plan=...)`` gives a
plan (then the formulas split the linear layers it names, before the per-rank trace checks).
Pipelines (``pp > 1``) split memfit's builtin decoders (:mod:`memfit.parallel.pipeline`), or
any module at ``fit(pp_split_points=...)`` (1F1B, GPipe, interleaved 1F1B at half the stages),
and run alone,
with tp and with FSDP2 (not beside DDP, ZeRO-1 or HSDP), with the 1F1B schedule and
``accumulation`` micro-batches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from memfit.errors import MemfitError
from memfit.models.anatomy import TP_PROJECTIONS, config_int
from memfit.parallel.config import Parallel

if TYPE_CHECKING:
    from memfit.fitting.config import FitConfig

__all__ = ["PIPELINE_SCHEDULES", "TP_SPLIT", "ModelShape", "activation_factor", "check_gpus",
           "model_shape", "pipeline_in_flight", "pipeline_runs", "root_split",
           "schedule_searched", "traced_step"]

TP_SPLIT = TP_PROJECTIONS
"""The projections memfit/parallel/apply.py: apply_tp splits (memfit.models.anatomy's)."""


@dataclass(frozen=True)
class ModelShape:
    """What the layout formulas need from the model."""

    heads: int | None
    kv_heads: int | None
    layers: int
    hidden: int | None
    seq: int | None
    tp_splittable: bool
    """Whether every block has linear projections :data:`TP_SPLIT` names."""
    block_numels: tuple[tuple[int, int], ...]
    """Per block: (elements tensor parallelism splits, elements it replicates)."""
    first_numel: int
    """Parameters outside the blocks that sit before them (embeddings): the first stage's."""
    last_numel: int
    """The other parameters outside the blocks (final norm, head): the last stage's."""
    pipeline_splittable: bool = True
    """Whether :mod:`memfit.parallel.pipeline` splits the model into stages (memfit's builtin
    decoders with an untied head)."""
    sp_splittable: bool = False
    """Whether :func:`memfit.parallel.apply.tp_plan` runs sequence and loss parallelism on the
    model (``sp_root``: memfit's builtin decoders, untied, rotary, dense MLPs)."""
    vocab: int | None = None
    """The head's output features (the logits' last dimension)."""
    experts: tuple[int, ...] = ()
    """The experts of each MoE layer (:func:`memfit.parallel.expert.moe_layers`)."""
    top_k: int = 0
    """Experts per token of the MoE layers."""
    expert_numel: int = 0
    """Parameters of the MoE layers' experts (what ``ep`` splits), all layers."""
    ep_beside_tp: bool = False
    """Whether expert parallelism runs beside tensor parallelism on the model (MoE layers and
    no ``tp_plan`` of the user's: :func:`memfit.parallel.expert.check_experts`)."""
    stage_blocks: tuple[int, ...] = ()
    """The blocks of each stage of the user's pipeline split (``pp_split_points``); empty:
    memfit's even split."""

    def param_share(self, tp: int, pp: int, root_split: tuple[bool, bool] = (False, False)
                    ) -> float:
        """The share of the model's parameters the most loaded rank holds: its stage's blocks
        (split projections / ``tp``), plus the embeddings on the first stage and the rest on
        the last (1F1B's first stage also holds the most activations). ``root_split``: whether
        tp splits the embeddings (sequence parallelism: ``RowwiseParallel`` on the token
        embedding) and the head (sequence or loss parallelism: ``ColwiseParallel``), as
        ``memfit/parallel/apply.py: tp_plan`` does (:func:`root_split`)."""
        total = sum(s + r for s, r in self.block_numels) + self.first_numel + self.last_numel
        if not total:
            return 1.0
        first = self.first_numel / (tp if root_split[0] else 1)
        last = self.last_numel / (tp if root_split[1] else 1)
        per_stage = -(-len(self.block_numels) // pp)
        starts = [stage * per_stage for stage in range(pp + 1)]
        rank_blocks = [self.block_numels[starts[stage]:starts[stage + 1]] for stage in range(pp)]
        if len(self.stage_blocks) in (pp, 2 * pp):  # the user's split; 2 pp: interleaved, rank
            # r holds stages r and r + pp (memfit/parallel/pipeline.py: stage_modules)
            bounds = [sum(self.stage_blocks[:stage]) for stage in range(len(self.stage_blocks)
                                                                         + 1)]
            rank_blocks = [[b for s in range(r, len(self.stage_blocks), pp)
                            for b in self.block_numels[bounds[s]:bounds[s + 1]]]
                           for r in range(pp)]
        worst = 0.0
        for stage in range(pp):
            blocks = rank_blocks[stage]
            held = sum(s / tp + r for s, r in blocks)
            held += (first if stage == 0 else 0)
            held += (last if stage == pp - 1 else 0)
            worst = max(worst, held)
        return worst / total


    @property
    def numel(self) -> int:
        return sum(s + r for s, r in self.block_numels) + self.first_numel + self.last_numel

    def expert_share(self) -> float:
        """The experts' share of the model's parameters."""
        return self.expert_numel / self.numel if self.numel else 0.0

    def ep_degrees(self, dp: int, tp: int = 1) -> list[int]:
        """The ``ep > 1`` that :func:`memfit.parallel.expert.check_experts` takes over ``dp``
        data-parallel ranks (beside ``tp``: over the ``dp * tp`` ranks, ``ep`` a multiple of
        ``tp``): dividing them and every layer's experts, each rank's experts splitting evenly
        over the ``dp * tp / ep`` ranks that hold the same ones."""
        if not self.experts or (tp > 1 and not self.ep_beside_tp):
            return []
        ranks = dp * tp
        return [ep for ep in range(2, ranks + 1) if ranks % ep == 0 and ep % tp == 0
                and all(e % ep == 0 and (e // ep) % (ranks // ep) == 0 for e in self.experts)]

    def unit_shares(self, tp: int, pp: int, root_split: tuple[bool, bool] = (False, False)
                    ) -> tuple[float, float]:
        """(the largest block, the root's parameters: embeddings, final norm, head) as shares
        of the model's parameters, on one tensor-parallel rank of the most loaded stage: the
        FSDP2 units ``memfit/parallel/apply.py: apply_fsdp`` shards (each block, then the root
        holding what no block holds); ``root_split`` as in :meth:`param_share`."""
        total = self.numel
        if not total:
            return 0.0, 0.0
        block = max((s / tp + r for s, r in self.block_numels), default=0.0)
        first = self.first_numel / (tp if root_split[0] else 1)
        last = self.last_numel / (tp if root_split[1] else 1)
        root = first + last if pp == 1 else max(first, last)
        return block / total, root / total


def model_shape(base: nn.Module, sample_seq: int | None,
                tp_plan: Mapping[str, Any] | None = None,
                pp_split_points: tuple[str, ...] | None = None) -> ModelShape | None:
    """The model's shape for the layout formulas, or None when it has no repeated blocks. With
    ``tp_plan`` (the user's, ``Parallel.tp_plan``) tensor parallelism splits the linear
    layers the plan names, not :data:`TP_SPLIT`'s, and runs no sequence or loss parallelism of
    memfit's (the plan is applied as given). With ``pp_split_points`` (the user's,
    ``Parallel.pp_split_points``; one line for a name that does not split the model) any
    model splits into those stages."""
    from memfit.models.anatomy import find_blocks, model_shape

    try:
        blocks = find_blocks(base)
    except MemfitError:
        return None
    heads, kv_heads, _ = model_shape(base)
    planned = _planned(base, tp_plan)
    seen: set[int] = set()
    block_numels = []
    splittable = True
    for name in blocks:
        split = rest = 0
        block = base.get_submodule(name)
        found = False
        for sub, mod in block.named_modules():
            for pname, p in mod.named_parameters(recurse=False):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                # a row-wise style keeps its bias whole (tp_plans.check_divisible's styles)
                if (planned.get(f"{name}.{sub}") in ("colwise", "rowwise" if pname == "weight"
                                                     else "colwise")
                        if planned is not None else
                        isinstance(mod, nn.Linear) and sub.rsplit(".", 1)[-1] in TP_SPLIT):
                    split += p.numel()
                    found = True
                else:
                    rest += p.numel()
        splittable &= found
        block_numels.append((split, rest))
    first = last = 0
    first_seen = False
    for _name, p in base.named_parameters():
        if id(p) in seen:
            first_seen = True
            continue
        seen.add(id(p))
        if not first_seen:
            first += p.numel()
        else:
            last += p.numel()
    hidden = config_int(base, ("hidden_size", "n_embd", "d_model"))
    from memfit.parallel.expert import moe_shape

    experts, top_k, expert_numel = moe_shape(base)
    return ModelShape(heads=heads, kv_heads=kv_heads, layers=len(blocks), hidden=hidden,
                      seq=sample_seq, tp_splittable=splittable,
                      block_numels=tuple(block_numels), first_numel=first, last_numel=last,
                      pipeline_splittable=(pp_split_points is not None
                                           or _pipeline_splittable(base)),
                      stage_blocks=_stage_blocks(base, blocks, pp_split_points),
                      sp_splittable=planned is None and _sp_splittable(base),
                      vocab=config_int(base, ("vocab_size",)),
                      experts=experts, top_k=top_k,
                      expert_numel=expert_numel,
                      ep_beside_tp=planned is None and bool(experts))


def _stage_blocks(base: nn.Module, blocks: list[str],
                  points: tuple[str, ...] | None) -> tuple[int, ...]:
    """The blocks on each stage of ``base`` split at ``points``
    (:func:`memfit.parallel.pipeline_split.split_points`' one-line errors); empty without
    points, or where the blocks are not the split container's elements."""
    if points is None:
        return ()
    from memfit.parallel.pipeline_split import split_points

    container, starts = split_points(base, points)
    stage_of = []
    for name in blocks:
        parent, _, index = name.rpartition(".")
        if parent != container or not index.isdigit():
            return ()
        stage_of.append(sum(int(index) >= s for s in starts))
    return tuple(stage_of.count(stage) for stage in range(len(points) + 1))


def _planned(base: nn.Module, tp_plan: Mapping[str, Any] | None) -> dict[str, str] | None:
    """The modules ``tp_plan`` splits, each ``"colwise"`` or ``"rowwise"`` (a plan naming a
    module the model does not have is :func:`memfit.parallel.tp_plans.expand_plan`'s one-line
    error); None without a plan."""
    if tp_plan is None:
        return None
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from memfit.parallel.tp_plans import expand_plan, torch_style

    out = {}
    for name, style in expand_plan(base, tp_plan, "fit(tp_plan=...)").items():
        made = torch_style(style) if isinstance(style, str) else style
        if isinstance(made, ColwiseParallel | RowwiseParallel):
            out[name] = "colwise" if isinstance(made, ColwiseParallel) else "rowwise"
    return out


def _sp_splittable(base: nn.Module) -> bool:
    """Whether ``tp_plan`` takes sequence and loss parallelism on ``base`` (its own check,
    ``memfit/parallel/apply.py: sp_root``)."""
    from memfit.parallel.apply import sp_root

    try:
        sp_root(base, Parallel(gpus=2, tp=2, sp=True))
    except MemfitError:
        return False
    return True


def _pipeline_splittable(base: nn.Module) -> bool:
    """memfit's builtin decoder with its head untied from its embedding (the two sit on the
    first and the last stage): what :mod:`memfit.parallel.pipeline` splits."""
    from memfit.models.build import DecoderLM

    return isinstance(base, DecoderLM) and \
        base.lm_head.weight is not base.model.embed_tokens.weight


def root_split(par: Parallel) -> tuple[bool, bool]:
    """Whether ``par``'s tensor parallelism splits the token embedding (sequence parallelism)
    and the head (sequence or loss parallelism): ``memfit/parallel/apply.py: tp_plan``."""
    return par.tp > 1 and par.sp, par.tp > 1 and (par.sp or par.loss_parallel)


def pipeline_runs(par: Parallel) -> bool:
    """Whether ``par`` (``pp > 1``) is a pipeline that the per-rank trace and ``Plan.apply`` run
    (:func:`memfit.fitting.apply.apply_pipeline`): alone, with tp, with FSDP2 over the other
    ranks (torchtitan's ``(pp, dp, tp)`` mesh), with DDP or ZeRO-1 on each stage without tp
    (``memfit/parallel/pipeline_parallelize.py: replicate_stages``) or HSDP on each stage
    without tp (``shard_stages`` over the ``(pp, replicate, shard)`` mesh), and with ep on each
    stage beside DDP (ep = dp) or FSDP2 without tp (``apply_ep_stages``), and beside tp with
    FSDP2 or no data parallelism, ``ep`` a multiple of ``tp`` (``apply_tp_stages``)."""
    if par.ep > 1:
        if par.tp > 1:
            return (par.ep % par.tp == 0 and par.strategy in ("none", "fsdp")
                    and not par.pp_split_points)
        return par.strategy == "fsdp" or (par.strategy == "ddp" and par.ep == par.dp)
    return par.strategy in ("none", "fsdp") or (par.tp == 1
                                                and par.strategy in ("ddp", "zero1", "hsdp"))


PIPELINE_SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b")
"""The schedules fit searches for a pipeline layout (``Parallel.pp_schedule``)."""


def schedule_searched(par: Parallel, accumulation: int) -> bool:
    """Whether fit searches ``par``'s pipeline schedule at ``accumulation`` micro-batches
    (Note: [pipeline schedules]). 1F1B always (it refuses fewer than ``pp`` micro-batches with
    its reason); GPipe only below ``pp`` micro-batches, where 1F1B cannot run: from ``pp`` on it
    has 1F1B's bubble and holds every micro-batch's activations until its backwards, never
    fewer; interleaved 1F1B where ``pp`` divides the micro-batches (``schedules.py:
    ScheduleInterleaved1F1B`` runs them in rounds of ``pp``)."""
    if par.pp == 1 or par.pp_schedule == "1f1b":
        return True
    if par.pp_schedule == "gpipe":
        return accumulation < par.pp
    return accumulation >= par.pp and accumulation % par.pp == 0


def pipeline_in_flight(par: Parallel, accumulation: int) -> float:
    """How many micro-batches' activations of its whole share of the blocks the first stage's
    rank (the one that holds the most) keeps at once under ``par``'s schedule: GPipe every
    micro-batch's, 1F1B ``pp`` at most (its warm-up forwards plus one, ``schedules.py:
    Schedule1F1B``); interleaved 1F1B with ``v`` stages a rank, each ``1/v`` of the rank's
    blocks: ``(v - 1) * pp + 2 * (pp - 1)`` warm-up forwards plus one, of ``v * accumulation``
    at most (``torch/distributed/pipelining/schedules.py: _get_warmup_ops`` of rank 0, rounds
    of ``pp`` micro-batches), divided by ``v``."""
    n = accumulation
    if par.pp_schedule == "gpipe":
        return float(n)
    if par.pp_schedule != "interleaved-1f1b":
        return float(min(par.pp, n))
    v = 2  # memfit/parallel/pipeline.py: stages_per_rank
    warmup = (v - 1) * par.pp + 2 * (par.pp - 1)
    return min(warmup + 1, v * n) / v


def traced_step(cfg: FitConfig) -> tuple[int, Parallel]:
    """The rows and the layout of the step the per-rank trace of ``cfg`` runs (``cfg.parallel``
    set). A pipeline's schedule runs the whole per-rank batch, ``micro_batch * accumulation``
    rows, as ``accumulation`` micro-batches (``Parallel.microbatches``: gradient accumulation
    under a pipeline is the schedule's micro-batches, as ``Plan.apply`` runs it), so its trace
    is the whole step and its peak the plan's; other layouts trace one micro-batch."""
    par = cfg.parallel
    assert par is not None
    if par.pp == 1:
        return cfg.micro_batch, par
    return (cfg.micro_batch * cfg.accumulation,
            dataclasses.replace(par, microbatches=cfg.accumulation))


def activation_factor(tp: int, *, eager: bool, shape: ModelShape | None,
                      sp: bool = False) -> float:
    """The share of a block's saved activations one tensor-parallel rank keeps: Korthikanti et
    al. 2022 (arXiv 2205.05198), per layer, without sequence parallelism Eq. 2,
    ``sbh(10 + 24/t + 5as/(ht))`` of Eq. 1's ``sbh(34 + 5as/h)`` (the ``5as/h`` attention scores
    only where attention is eager: SDPA keeps none); with it (``sp``) Eq. 4,
    ``sbh(34/t + 5as/(ht))``, the norms' and dropouts' ``10 sbh`` split along the sequence
    too, less what PyTorch keeps whole: Megatron stores the attention's and the MLP's inputs
    split and all-gathers them again in the backward (Korthikanti §4.2.2), while DTensor's
    ``ColwiseParallel`` projections save the all-gathered input their matmul ran on
    (``PrepareModuleInput(desired_input_layouts=Replicate())``, then ``mm`` saves its input),
    so those ``2 sbh + 2 sbh`` stay whole: ``sbh(30/t + 4 + 5as/(ht))``."""
    if tp == 1:
        return 1.0
    scores = 0.0
    if eager and shape is not None and shape.heads and shape.seq and shape.hidden:
        scores = 5 * shape.heads * shape.seq / shape.hidden
    if sp:
        return (30 / tp + 4 + scores / tp) / (34 + scores)
    return (10 + 24 / tp + scores / tp) / (34 + scores)


def check_gpus(gpus: Any, gpus_per_node: Any) -> None:
    """One-line errors for ``gpus`` / ``gpus_per_node``."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise MemfitError(f"gpus must be a positive integer, got {gpus!r}")
    if gpus_per_node is not None and (isinstance(gpus_per_node, bool)
                                      or not isinstance(gpus_per_node, int)
                                      or gpus_per_node < 1 or gpus % gpus_per_node):
        raise MemfitError(f"gpus_per_node={gpus_per_node!r} must be a positive integer dividing "
                          f"gpus={gpus}; e.g. gpus_per_node=8 for 8-GPU nodes")
