"""The multi-GPU layouts :func:`memfit.fit` searches with ``gpus=N``: data-parallel sharding x
tensor x pipeline parallelism, as :class:`memfit.Parallel` values, and the formulas that derive a
layout's per-rank memory from the one-GPU trace before the per-rank trace checks the ones that
can win (Note: [layouts are derived, then traced] in :mod:`memfit.fitting.search_verify`).

Every tp > 1 layout also comes with sequence parallelism (``sp=True``) and with sequence and
loss parallelism (``sp=True, loss_parallel=True``; loss parallelism not under a pipeline) where
:func:`memfit.parallel.apply.tp_plan` splits the model that way (memfit's builtin decoders with
untied embeddings, rotary positions and dense MLPs); a mixture-of-experts model built by memfit
also gets expert-parallel layouts (``ep`` dividing its experts and the data-parallel ranks, with
DDP when ``ep`` is every data-parallel rank or FSDP2 over all of them, no tp or pp:
:func:`memfit.parallel.expert.check_experts`).

Known limitations: tensor parallelism is Megatron's split of the attention and MLP projections,
as :func:`memfit.parallel.apply.apply_tp` applies it, so the model's blocks must name their
projections as Llama does (``q_proj`` ... ``down_proj``). Pipelines (``pp > 1``) split memfit's
builtin decoders only (:mod:`memfit.parallel.pipeline`) and run alone, with tp and with FSDP2
(not beside DDP, ZeRO-1 or HSDP), with the 1F1B schedule and ``accumulation`` micro-batches.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from memfit.errors import MemfitError
from memfit.fitting.config import LAYOUT_SHARDING
from memfit.fitting.plan import Rejected
from memfit.parallel.config import Parallel

if TYPE_CHECKING:
    from memfit.fitting.config import FitConfig

__all__ = ["PIPELINE_SCHEDULES", "ModelShape", "activation_factor", "check_gpus", "layouts",
           "model_shape", "pipeline_in_flight", "pipeline_runs", "root_split",
           "schedule_searched", "traced_step"]

# The projections memfit/parallel/apply.py: apply_tp splits (Colwise / Rowwise by name).
TP_SPLIT = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


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
    """The experts of each builtin MoE layer (:func:`memfit.parallel.expert.moe_layers`)."""
    top_k: int = 0
    """Experts per token of the MoE layers."""
    expert_numel: int = 0
    """Parameters of the MoE layers' experts (what ``ep`` splits), all layers."""

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
        worst = 0.0
        for stage in range(pp):
            blocks = self.block_numels[stage * per_stage:(stage + 1) * per_stage]
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

    def ep_degrees(self, dp: int) -> list[int]:
        """The ``ep > 1`` that :func:`memfit.parallel.expert.check_experts` takes over ``dp``
        data-parallel ranks: dividing ``dp`` and every layer's experts, each rank's experts
        splitting evenly over the ``dp / ep`` ranks that hold the same ones."""
        if not self.experts:
            return []
        return [ep for ep in range(2, dp + 1) if dp % ep == 0
                and all(e % ep == 0 and (e // ep) % (dp // ep) == 0 for e in self.experts)]

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


def _count(model: nn.Module, names: tuple[str, ...]) -> int | None:
    config = getattr(model, "config", None) or getattr(model, "spec", None)
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def model_shape(base: nn.Module, sample_seq: int | None) -> ModelShape | None:
    """The model's shape for the layout formulas, or None when it has no repeated blocks."""
    from memfit.models.anatomy import find_blocks, model_shape

    try:
        blocks = find_blocks(base)
    except MemfitError:
        return None
    heads, kv_heads, _ = model_shape(base)
    seen: set[int] = set()
    block_numels = []
    splittable = True
    for name in blocks:
        split = rest = 0
        block = base.get_submodule(name)
        found = False
        for sub, mod in block.named_modules():
            for p in mod.parameters(recurse=False):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                if isinstance(mod, nn.Linear) and sub.rsplit(".", 1)[-1] in TP_SPLIT:
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
    hidden = _count(base, ("hidden_size", "n_embd", "d_model"))
    from memfit.parallel.expert import moe_layers

    moes = moe_layers(base)
    expert_numel = sum(p.numel() for _, moe in moes for n, p in moe.named_parameters()
                       if n.split(".")[-1] in _EXPERT_PARAMS)
    return ModelShape(heads=heads, kv_heads=kv_heads, layers=len(blocks), hidden=hidden,
                      seq=sample_seq, tp_splittable=splittable,
                      block_numels=tuple(block_numels), first_numel=first, last_numel=last,
                      pipeline_splittable=_pipeline_splittable(base),
                      sp_splittable=_sp_splittable(base),
                      vocab=_count(base, ("vocab_size",)),
                      experts=tuple(int(moe.num_experts) for _, moe in moes),
                      top_k=max((int(moe.top_k) for _, moe in moes), default=0),
                      expert_numel=expert_numel)


# memfit/parallel/expert.py: _EXPERT_PARAMS (the stacked expert weights ep splits on dim 0).
_EXPERT_PARAMS = ("gate_proj", "up_proj", "down_proj", "gate_bias", "up_bias", "down_bias")


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
    (``memfit/parallel/pipeline.py: replicate_stages``); not with HSDP or ep."""
    return par.ep == 1 and (par.strategy in ("none", "fsdp")
                            or (par.tp == 1 and par.strategy in ("ddp", "zero1")))


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


def _check_space(name: str, values: list[Any], gpus: int, node: int) -> None:
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise MemfitError(f"space {name} {v!r} must be a positive integer")
        if gpus % v:
            raise MemfitError(f"{name}={v} does not divide gpus={gpus}; choose a {name} "
                              f"that divides {gpus}")
    if name == "tp":
        beyond = [v for v in values if v > node]
        if beyond:
            raise MemfitError(f"tp={beyond[0]} is beyond a node of {node} GPUs: tensor "
                              f"parallelism stays inside a node; choose tp <= {node}")


def layouts(*, gpus: int, gpus_per_node: int | None, global_batch: int,
            shape: ModelShape | None, space: dict[str, list[Any]],
            rejected: list[Rejected]) -> list[Parallel]:
    """Every layout of ``gpus`` the search considers (one-line errors for what ``space`` asks
    that cannot be; layouts left out are recorded in ``rejected`` with why):

    - tp: the divisors of the attention and KV heads (``apply_tp`` splits both) up to a node;
    - pp: the divisors of ``gpus / tp`` up to the number of blocks, each with the 1F1B, GPipe
      and (where the blocks fill ``2 pp`` stages) interleaved 1F1B schedules
      (:func:`schedule_searched`);
    - the data-parallel ``dp = gpus / (tp pp)`` ranks: DDP, ZeRO-1, ZeRO-2, ZeRO-3/FSDP and,
      across nodes, HSDP sharding inside a node (``fsdp = gpus_per_node / (tp pp)``), replicas
      across (with tp > 1: FSDP / HSDP only, as apply_model runs them); ``dp`` must divide the
      global batch;
    - each tp > 1 layout again with sequence parallelism, and with sequence and loss
      parallelism (not under a pipeline), where ``tp_plan`` splits the model so (Note:
      [sequence and loss parallelism are tp variants]);
    - for memfit's builtin MoE models, without tp or pp: each ``ep`` of
      :meth:`ModelShape.ep_degrees` with FSDP2 (zero2 / zero3), and with DDP where ``ep = dp``.
    """
    node = gpus_per_node or gpus
    for name in ("tp", "pp"):
        if name in space:
            _check_space(name, space[name], gpus, node)
    tps = space.get("tp") or [t for t in range(1, node + 1) if gpus % t == 0]
    pps = space.get("pp") or [p for p in range(1, gpus + 1) if gpus % p == 0]
    shardings = [s for s in space.get("sharding", LAYOUT_SHARDING)]
    if shape is None or not shape.tp_splittable:
        if any(t > 1 for t in tps):
            rejected.append(Rejected(what="tensor parallelism", reason=(
                "the model's blocks have no projections apply_tp splits "
                f"({', '.join(TP_SPLIT)})" if shape is not None else
                "the model has no repeated blocks to split")))
        tps = [1]
    if shape is None:
        pps = [1]
    elif not shape.pipeline_splittable and any(p > 1 for p in pps):
        if "pp" in space and any(p > 1 for p in space["pp"]):
            raise MemfitError("space pp > 1 splits memfit's builtin decoders (memfit.models."
                              "build_model) with an untied head; use pp=1 for this model")
        rejected.append(Rejected(what="pipeline parallelism", reason=(
            "memfit.parallel.pipeline splits memfit's builtin decoders with an untied head")))
        pps = [1]
    out: list[Parallel] = []
    for tp in tps:
        if shape is not None and tp > 1:
            try:
                Parallel(gpus=tp, tp=tp).check_model(heads=shape.heads, kv_heads=shape.kv_heads,
                                                     layers=shape.layers)
            except MemfitError as exc:
                if "tp" in space:
                    raise
                rejected.append(Rejected(what=f"tp {tp}", reason=str(exc)))
                continue
        for pp in pps:
            if gpus % (tp * pp):
                if "tp" in space and "pp" in space:
                    raise MemfitError(f"tp*pp = {tp}*{pp} = {tp * pp} does not divide gpus="
                                      f"{gpus}; choose degrees whose product divides it")
                continue
            if shape is not None and pp > shape.layers:
                if "pp" in space:
                    raise MemfitError(f"space pp={pp} is more stages than the model's "
                                      f"{shape.layers} blocks; use pp <= {shape.layers}")
                continue
            dp = gpus // (tp * pp)
            if global_batch % dp:
                rejected.append(Rejected(what=f"tp {tp} x pp {pp} (dp {dp})", reason=(
                    f"the global batch {global_batch} does not split over {dp} data-parallel "
                    "ranks")))
                continue
            if tp > 1 and dp > 1 and any(z in shardings for z in ("none", "zero1")):
                # memfit/parallel/apply.py: _check_tp_dp (torchtitan's parallelize_llama: "DDP
                # has not supported > 1D parallelism").
                rejected.append(Rejected(what=f"tp {tp} x pp {pp} with ddp / zero1 over {dp}",
                                         reason="DDP beside tensor parallelism is refused by "
                                         "torchtitan and apply_model; FSDP / HSDP are searched"))
            if pp > 1 and dp > 1 and "hsdp" in shardings:
                # fitting/apply.py: _pipeline_parallel (Plan.apply runs pp beside DDP, ZeRO-1
                # and FSDP2: tests/fitting/test_fit_pipeline.py; HSDP under a pipeline is traced but
                # not applied yet)
                rejected.append(Rejected(what=f"tp {tp} x pp {pp} with hsdp over {dp}",
                                         reason="Plan.apply runs a pipeline beside DDP, ZeRO-1 "
                                         "and FSDP2, not HSDP yet; FSDP is searched"))
            refused = (("none", "zero1") if tp > 1 else ()) + (("hsdp",) if pp > 1 else ())
            found = _shardings(gpus, gpus_per_node, tp, pp, dp,
                               [z for z in shardings if z not in refused])
            if pp > 1:
                # Note: [pipeline schedules] Each pipeline layout with each schedule of
                # PIPELINE_SCHEDULES, the interleaved one where the blocks fill two stages a
                # rank; which accumulation each is searched at: schedule_searched. Costed by
                # their bubble (memfit/fitting/cost.py: step_cost).
                found += [dataclasses.replace(par, pp_schedule=sched) for par in found
                          for sched in PIPELINE_SCHEDULES[1:]
                          if sched != "interleaved-1f1b" or shape is None
                          or 2 * pp <= shape.layers]
            out += found
            if tp > 1 and shape is not None and shape.sp_splittable:
                # Note: [sequence and loss parallelism are tp variants] Every tp layout also
                # runs with sequence parallelism, and with sequence and loss parallelism
                # (torchtitan's default: its apply_tp keeps the logits split unless
                # disable_loss_parallel); loss parallelism not under a pipeline
                # (fitting/apply.py: _pipeline_parallel refuses it on the last stage).
                for par in found:
                    out.append(dataclasses.replace(par, sp=True))
                    if pp == 1:
                        out.append(dataclasses.replace(par, sp=True, loss_parallel=True))
            if tp == 1 and pp == 1 and shape is not None and shape.experts:
                out += _expert_layouts(gpus, gpus_per_node, dp, shape, shardings, rejected)
    if not out:
        raise MemfitError(f"no layout of {gpus} GPUs fits the search's limits (global batch "
                          f"{global_batch}, space {space}); pick a global batch that "
                          "divides over the data-parallel ranks")
    return out


def _expert_layouts(gpus: int, gpus_per_node: int | None, dp: int, shape: ModelShape,
                    shardings: list[str], rejected: list[Rejected]) -> list[Parallel]:
    """The expert-parallel layouts of ``dp`` data-parallel ranks (no tp, no pp) that
    :func:`memfit.parallel.expert.check_experts` takes: each ``ep`` of
    :meth:`ModelShape.ep_degrees` with FSDP2 over every data-parallel rank (zero2 / zero3; the
    ``dp / ep`` ranks holding the same experts shard them), and DDP when ``ep`` is every
    data-parallel rank."""
    degrees = shape.ep_degrees(dp)
    if not degrees:
        if dp > 1:
            rejected.append(Rejected(what="expert parallelism", reason=(
                f"no ep > 1 divides both the {dp} data-parallel ranks and the experts "
                f"({', '.join(map(str, sorted(set(shape.experts))))}) with each rank's experts "
                "split evenly over the ranks that hold the same ones")))
        return []
    if any(z in shardings for z in ("zero1", "hsdp")):
        rejected.append(Rejected(what="ep with zero1 / hsdp, or beside tp / pp", reason=(
            "memfit.parallel.expert runs expert parallelism with DDP (ep = dp) or FSDP2 over "
            "every data-parallel rank, without tp or pp")))
    out = []
    for ep in degrees:
        if ep == dp and "none" in shardings:
            out.append(Parallel(gpus=gpus, gpus_per_node=gpus_per_node, ep=ep))
        out += [Parallel(gpus=gpus, gpus_per_node=gpus_per_node, ep=ep, zero=z)
                for z in (2, 3) if f"zero{z}" in shardings]
    return out


def _shardings(gpus: int, gpus_per_node: int | None, tp: int, pp: int, dp: int,
               shardings: list[str]) -> list[Parallel]:
    if dp == 1:
        return [Parallel(gpus=gpus, gpus_per_node=gpus_per_node, tp=tp, pp=pp)]
    zero = {"none": None, "zero1": 1, "zero2": 2, "zero3": 3}
    out = [Parallel(gpus=gpus, gpus_per_node=gpus_per_node, tp=tp, pp=pp, zero=zero[s])
           for s in shardings if s in zero]
    if "hsdp" in shardings and gpus_per_node and gpus_per_node % (tp * pp) == 0:
        shard = gpus_per_node // (tp * pp)
        if 1 < shard < dp and dp % shard == 0:
            out.append(Parallel(gpus=gpus, gpus_per_node=gpus_per_node, tp=tp, pp=pp,
                                fsdp=shard))
    return out
