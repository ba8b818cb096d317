"""The layouts of ``gpus`` that :func:`memfit.fit` searches (:func:`layouts`): each tp and pp
the model takes, each data-parallel sharding beside them, each pipeline schedule, the sequence /
loss parallel variants and the expert-parallel layouts of a builtin MoE model, as
:class:`memfit.Parallel` values; what is left out is recorded with why. The model's side of it
(:class:`~memfit.fitting.layouts.ModelShape`) and the formulas that derive a layout's per-rank
memory are :mod:`memfit.fitting.layouts`'.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from memfit.errors import MemfitError
from memfit.fitting.config import LAYOUT_SHARDING
from memfit.fitting.layouts import PIPELINE_SCHEDULES, TP_SPLIT, ModelShape
from memfit.fitting.plan import Rejected
from memfit.parallel.config import Parallel

__all__ = ["layouts"]


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
            rejected: list[Rejected], tp_plan: Mapping[str, Any] | None = None,
            pp_split_points: tuple[str, ...] | None = None) -> list[Parallel]:
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
    - for MoE models (memfit's builtin ones, transformers' experts modules), without tp, alone
      and beside each pp the model takes: each ``ep`` of :meth:`ModelShape.ep_degrees` over the
      ``dp`` ranks (of each stage) with FSDP2 (zero2 / zero3), and with DDP where ``ep = dp``;
      and beside each tp > 1 (without ``tp_plan``), alone and beside each pp: each ``ep`` (a
      multiple of ``tp``) over the ``dp * tp`` ranks (of each stage), with FSDP2 over
      ``dp > 1``;
    - with ``tp_plan`` (the user's, ``shape`` measured with it: :func:`model_shape`) every
      tp > 1 layout splits the model with that plan (``Parallel.tp_plan``), not under a
      pipeline (fit's pipelines are memfit's own split of its builtin decoders, whose stages
      the plan does not name) unless the pipeline is the user's split;
    - with ``pp_split_points`` (the user's, ``Parallel.pp_split_points``) the pipeline layouts
      are those of the ``len(pp_split_points) + 1`` stages split there, on any module: one a
      rank with the 1F1B and GPipe schedules (``pp`` = the stages), two a rank with
      interleaved 1F1B (``pp`` = half the stages), beside data parallelism and ep, with
      ``tp_plan`` inside each stage where given (tp x pp).
    """
    node = gpus_per_node or gpus
    for name in ("tp", "pp"):
        if name in space:
            _check_space(name, space[name], gpus, node)
    if pp_split_points is not None:
        space = _split_space(space, len(pp_split_points) + 1, gpus)
    tps, pps = _degrees(gpus, node, shape, space, rejected)
    shardings = [s for s in space.get("sharding", LAYOUT_SHARDING)]
    out: list[Parallel] = []
    for tp in tps:
        if not _tp_takes(tp, shape, space, rejected):
            continue
        for pp in pps:
            out += _layouts_of(tp, pp, gpus=gpus, gpus_per_node=gpus_per_node,
                               global_batch=global_batch, shape=shape, space=space,
                               shardings=shardings, rejected=rejected)
    if pp_split_points is not None:
        out = _with_split(out, pp_split_points, rejected)
    if tp_plan is not None:
        out = _with_plan(out, tp_plan, space, rejected)
    if not out:
        # the layouts left out say why (a tp that splits no head count, a pp beyond the
        # blocks); the global batch is the fix only where none of them was
        why = "; ".join(dict.fromkeys(f"{r.what}: {r.reason}" for r in rejected))
        raise MemfitError(f"no layout of {gpus} GPUs fits the search's limits (global batch "
                          f"{global_batch}, space {space}); "
                          + (why if why else "pick a global batch that divides over the "
                             "data-parallel ranks"))
    return out


def _split_space(space: dict[str, list[Any]], stages: int, gpus: int) -> dict[str, list[Any]]:
    """``space`` with the pipeline degrees the user's split points allow: 1, ``stages`` (one
    stage a rank) and ``stages / 2`` (interleaved 1F1B, two a rank, where that is 2 or more);
    one line where ``space`` or ``gpus`` asks for another."""
    interleaved = [stages // 2] if stages % 2 == 0 and stages >= 4 else []
    fits = [pp for pp in (stages, *interleaved) if gpus % pp == 0]
    if not fits:
        raise MemfitError(f"pp_split_points make {stages} pipeline stages, which do not divide "
                          f"gpus={gpus}{' (nor half of them, interleaved)' if interleaved else ''}"
                          f"; name split points for a number of stages that divides it")
    asked = space.get("pp")
    for pp in asked or ():
        if pp != 1 and stages % pp:
            raise MemfitError(f"space pp {pp}: pp_split_points make {stages} stages, not a "
                              f"multiple of pp={pp}; name pp - 1 split points (1F1B, GPipe) or "
                              "2 pp - 1 (interleaved 1F1B)")
        if pp != 1 and stages // pp > 2:
            raise MemfitError(f"space pp {pp}: pp_split_points make {stages} stages, "
                              f"{stages // pp} a rank; memfit's interleaved 1F1B runs 2 a rank: "
                              f"name {2 * pp - 1} split points, or ask for pp {stages}")
    return {**space, "pp": asked or [1, *fits]}


def _with_split(found: list[Parallel], points: tuple[str, ...],
                rejected: list[Rejected]) -> list[Parallel]:
    """``found`` with the user's split points on every pipeline layout whose stages they name:
    1F1B and GPipe at ``pp`` = the points' stages, interleaved 1F1B at half of them (two a
    rank); the other schedules are left out, the interleaved one recorded where the stages do
    not halve."""
    stages = len(points) + 1

    def named(p: Parallel) -> bool:
        return p.pp * (2 if p.pp_schedule == "interleaved-1f1b" else 1) == stages

    interleaved = [named(p) for p in found if p.pp_schedule == "interleaved-1f1b"]
    if interleaved and not any(interleaved):
        rejected.append(Rejected(what="interleaved 1F1B with pp_split_points", reason=(
            f"the {len(points)} split point(s) make {stages} stages; interleaved 1F1B runs "
            "two a rank over pp ranks (2 pp - 1 split points, pp >= 2, dividing the GPUs), "
            "so it is not searched here")))
    return [dataclasses.replace(p, pp_split_points=points) if p.pp > 1 else p
            for p in found if p.pp == 1 or named(p)]


def _with_plan(found: list[Parallel], tp_plan: Mapping[str, Any], space: dict[str, list[Any]],
               rejected: list[Rejected]) -> list[Parallel]:
    """``found`` with the user's ``tp_plan`` on every tp > 1 layout, those under a pipeline
    of memfit's own split left out (recorded; an error where ``space`` asks for nothing else);
    a pipeline split at the user's points takes the plan in each stage (``stage_plan``)."""
    found = [dataclasses.replace(p, tp_plan=tp_plan) if p.tp > 1 and p.pp_split_points else p
             for p in found]
    staged = [p for p in found if p.tp > 1 and p.pp > 1 and not p.pp_split_points]
    if staged:
        rejected.append(Rejected(what="tp_plan under a pipeline", reason=(
            "fit's pipelines split memfit's builtin decoders by its own rule, whose stages a "
            "user tp_plan does not name (a model split at pp_split_points takes one: "
            "memfit/parallel/tp_plans.py: stage_plan), so tp x pp is not searched")))
    out = [dataclasses.replace(p, tp_plan=tp_plan) if p.tp > 1 else p
           for p in found if not (p.tp > 1 and p.pp > 1 and not p.pp_split_points)]
    if not any(p.tp > 1 for p in out) and "tp" in space:
        raise MemfitError(f"tp_plan splits the tensor-parallel ranks, but space tp "
                          f"{space['tp']} (with pp {space.get('pp', 'searched')}) leaves no "
                          "tp > 1 layout without a pipeline; ask for a tp > 1 with pp 1, or "
                          "drop tp_plan")
    return out


def _degrees(gpus: int, node: int, shape: ModelShape | None, space: dict[str, list[Any]],
             rejected: list[Rejected]) -> tuple[list[int], list[int]]:
    """The tp and pp degrees searched: ``space``'s, else every divisor of ``gpus`` (tp up to a
    node); only 1 where the model cannot be split so (recorded in ``rejected``)."""
    tps = space.get("tp") or [t for t in range(1, node + 1) if gpus % t == 0]
    pps = space.get("pp") or [p for p in range(1, gpus + 1) if gpus % p == 0]
    if shape is None or not shape.tp_splittable:
        if "tp" in space and any(t > 1 for t in space["tp"]):
            # as for pp below: a tp the user fixed is not swapped for tp 1 without a word
            raise MemfitError(
                f"space tp {max(space['tp'])}: "
                + (f"the model's blocks have no projections apply_tp splits "
                   f"({', '.join(TP_SPLIT)})" if shape is not None else
                   "the model has no repeated blocks to split")
                + "; use tp=1 for this model (or a tp_plan naming its own layers)")
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
    return tps, pps


def _tp_takes(tp: int, shape: ModelShape | None, space: dict[str, list[Any]],
              rejected: list[Rejected]) -> bool:
    """Whether the model's heads and layers take ``tp`` (``Parallel.check_model``); a tp the
    space asks for that they do not take raises, another is recorded in ``rejected``."""
    if shape is not None and tp > 1:
        try:
            Parallel(gpus=tp, tp=tp).check_model(heads=shape.heads, kv_heads=shape.kv_heads,
                                                 layers=shape.layers)
        except MemfitError as exc:
            if "tp" in space:
                raise
            rejected.append(Rejected(what=f"tp {tp}", reason=str(exc)))
            return False
    return True


def _layouts_of(tp: int, pp: int, *, gpus: int, gpus_per_node: int | None, global_batch: int,
                shape: ModelShape | None, space: dict[str, list[Any]], shardings: list[str],
                rejected: list[Rejected]) -> list[Parallel]:
    """The layouts of ``tp`` x ``pp`` and the ``gpus / (tp pp)`` data-parallel ranks beside
    them: each sharding, each pipeline schedule, the sequence / loss parallel variants and,
    without tp or pp, the expert-parallel ones (see :func:`layouts`)."""
    out: list[Parallel] = []
    if gpus % (tp * pp):
        if "tp" in space and "pp" in space:
            raise MemfitError(f"tp*pp = {tp}*{pp} = {tp * pp} does not divide gpus="
                              f"{gpus}; choose degrees whose product divides it")
        return []
    if shape is not None and pp > shape.layers:
        if "pp" in space:
            raise MemfitError(f"space pp={pp} is more stages than the model's "
                              f"{shape.layers} blocks; use pp <= {shape.layers}")
        return []
    dp = gpus // (tp * pp)
    if global_batch % dp:
        rejected.append(Rejected(what=f"tp {tp} x pp {pp} (dp {dp})", reason=(
            f"the global batch {global_batch} does not split over {dp} data-parallel "
            "ranks")))
        return []
    if tp > 1 and dp > 1 and any(z in shardings for z in ("none", "zero1")):
        # memfit/parallel/apply.py: _check_tp_dp (torchtitan's parallelize_llama: "DDP
        # has not supported > 1D parallelism").
        rejected.append(Rejected(what=f"tp {tp} x pp {pp} with ddp / zero1 over {dp}",
                                 reason="DDP beside tensor parallelism is refused by "
                                 "torchtitan and apply_model; FSDP / HSDP are searched"))
    if pp > 1 and tp > 1 and dp > 1 and "hsdp" in shardings:
        # fitting/apply.py: _pipeline_parallel (Plan.apply runs pp beside HSDP without tp:
        # tests/fitting/test_fit_pipeline_split.py; pp x HSDP x tp is traced, not applied yet)
        rejected.append(Rejected(what=f"tp {tp} x pp {pp} with hsdp over {dp}",
                                 reason="Plan.apply runs a pipeline beside HSDP without tp, "
                                 "not beside tp yet; FSDP is searched"))
    refused = (("none", "zero1") if tp > 1 else ()) + (("hsdp",) if pp > 1 and tp > 1 else ())
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
    if shape is not None and shape.experts:
        experts = (_expert_tp_layouts(gpus, gpus_per_node, tp, pp, dp, shape, shardings,
                                      rejected) if tp > 1 else
                   _expert_layouts(gpus, gpus_per_node, dp, shape, shardings, rejected, pp))
        if pp > 1:  # each schedule, as the pipeline layouts above (Note: [pipeline schedules])
            experts += [dataclasses.replace(par, pp_schedule=sched) for par in experts
                        for sched in PIPELINE_SCHEDULES[1:]
                        if sched != "interleaved-1f1b" or 2 * pp <= shape.layers]
        out += experts
    return out


def _expert_layouts(gpus: int, gpus_per_node: int | None, dp: int, shape: ModelShape,
                    shardings: list[str], rejected: list[Rejected], pp: int = 1
                    ) -> list[Parallel]:
    """The expert-parallel layouts of ``dp`` data-parallel ranks (no tp; each of ``pp`` stages
    over its own ``dp`` ranks, ``memfit/parallel/pipeline_parallelize.py: apply_ep_stages``)
    that :func:`memfit.parallel.expert.check_experts` takes: each ``ep`` of
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
        rejected.append(Rejected(what="ep with zero1 / hsdp", reason=(
            "memfit.parallel.expert runs expert parallelism with DDP (ep = dp) or FSDP2 over "
            "every data-parallel rank (of each pipeline stage)")))
    out = []
    for ep in degrees:
        if ep == dp and "none" in shardings:
            out.append(Parallel(gpus=gpus, gpus_per_node=gpus_per_node, pp=pp, ep=ep))
        out += [Parallel(gpus=gpus, gpus_per_node=gpus_per_node, pp=pp, ep=ep, zero=z)
                for z in (2, 3) if f"zero{z}" in shardings]
    return out


def _expert_tp_layouts(gpus: int, gpus_per_node: int | None, tp: int, pp: int, dp: int,
                       shape: ModelShape, shardings: list[str], rejected: list[Rejected]
                       ) -> list[Parallel]:
    """The layouts of expert parallelism beside ``tp`` (and ``pp``: on each stage) that
    :func:`memfit.parallel.expert.check_experts` takes: each ``ep`` of
    :meth:`ModelShape.ep_degrees` over the ``dp * tp`` ranks (of a stage), with FSDP2 over the
    ``dp > 1`` data-parallel ranks (zero2 / zero3), or nothing more where ``dp`` is 1."""
    if not shape.ep_beside_tp:
        rejected.append(Rejected(what=f"ep beside tp {tp}", reason=(
            "expert parallelism beside tensor parallelism runs with memfit's tp plan or the "
            "model's own, not a tp_plan of yours (memfit/parallel/expert.py: check_experts)")))
        return []
    out = []
    for ep in shape.ep_degrees(dp, tp):
        if dp == 1:
            out.append(Parallel(gpus=gpus, gpus_per_node=gpus_per_node, tp=tp, pp=pp, ep=ep))
        out += [Parallel(gpus=gpus, gpus_per_node=gpus_per_node, tp=tp, pp=pp, ep=ep, zero=z)
                for z in (2, 3) if dp > 1 and f"zero{z}" in shardings]
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
