"""Tensor parallelism's plan for any module: the user's (``Parallel.tp_plan``), the model's own
(transformers' ``tp_plan``), as concrete module names each with its style.

:func:`memfit.parallel.apply.tp_plan` reads these before memfit's own projection names, so the
trace (``memfit.estimate``), the gloo ranks (``memfit.parallel.measure``) and ``Plan.apply``
split a model the same way.

Known limitations: a plan's styles are torch's ``ParallelStyle`` s (the user's, or the names
of :data:`memfit.layout.TP_STYLE_NAMES`) or, for a transformers model's own plan, transformers'
styles as transformers applies them (``transformers/distributed/tensor_parallel.py``:
``apply_tensor_parallelism``); a split dim must be a multiple of ``tp`` (the trace runs one
rank's shapes for all), and a user's plan splits pipeline stages only where the model is split
at ``pp_split_points`` (:func:`stage_plan`).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from memfit.errors import MemfitError, suggest
from memfit.layout import TP_STYLE_ALIASES
from memfit.parallel.config import Parallel

__all__ = ["HfStyle", "expand_plan", "hf_plan", "stage_plan", "torch_style", "user_plan"]


@dataclass(frozen=True)
class HfStyle:
    """One of transformers' own styles, by its name in ``ALL_PARALLEL_STYLES`` (a model's own
    plan, applied as transformers applies it)."""

    name: str


def torch_style(name: str) -> Any:
    """The torch ``ParallelStyle`` of a style name (:data:`memfit.layout.TP_STYLE_NAMES`, or
    one of transformers' aliases); None for ``replicate`` (the module stays whole)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    name = TP_STYLE_ALIASES.get(name, name)
    makers: dict[str, Callable[[], Any]] = {
        "colwise": ColwiseParallel, "rowwise": RowwiseParallel,
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
        "sequence_parallel": SequenceParallel, "replicate": lambda: None}
    return makers[name]()


def _matches(pattern: str, name: str) -> bool:
    """``parallelize_module``'s matching: the dotted parts one by one, ``fnmatch`` each."""
    parts, atoms = name.split("."), pattern.split(".")
    return len(parts) == len(atoms) and all(
        fnmatch.fnmatchcase(p, a) for p, a in zip(parts, atoms, strict=True))


def expand_plan(model: nn.Module, plan: Mapping[str, Any], where: str,
                params: bool = False) -> dict[str, Any]:
    """``plan``'s patterns as the model's module names (and, with ``params``, parameter names),
    in the plan's order, a later pattern's style winning; a pattern that matches nothing is a
    one-line error with the closest names."""
    names = [n for n, _ in model.named_modules() if n]
    if params:
        names += [n for n, _ in model.named_parameters()]
    out: dict[str, Any] = {}
    for pattern, style in plan.items():
        hits = [n for n in names if _matches(pattern, n)]
        if not hits:
            raise MemfitError(
                f"{where}: tp_plan names {pattern!r}, which matches no module of "
                f"{type(model).__name__}{suggest(pattern, names)}; use names from "
                "model.named_modules() (fnmatch patterns per dotted part, e.g. 'blocks.*.q')")
        out.update(dict.fromkeys(hits, style))
    return out


def user_plan(model: nn.Module, parallel: Parallel) -> dict[str, Any]:
    """``parallel.tp_plan`` as module names -> torch styles (names made styles, ``replicate``
    left out), each split dim checked against ``tp`` (:func:`check_divisible`)."""
    assert parallel.tp_plan is not None
    where = f"Parallel(tp={parallel.tp}, tp_plan=...)"
    plan = {}
    for name, style in expand_plan(model, parallel.tp_plan, where).items():
        made = torch_style(style) if isinstance(style, str) else style
        if made is not None:
            plan[name] = made
    check_divisible(model, plan, parallel.tp, where)
    return plan


def stage_plan(stage: nn.Module, parallel: Parallel) -> dict[str, Any]:
    """:func:`user_plan` on one pipeline stage of a model split at ``pp_split_points``
    (``memfit.parallel.pipeline_split.SplitStageModule``: the model's modules under ``inner.``,
    their own names): the plan's entries for the modules this stage holds; a module another
    stage holds is ``nn.Identity`` here, or absent from the split container, and is left to
    that stage (the whole model's plan was checked: ``pipeline.check_pipeline``)."""
    assert parallel.tp_plan is not None
    where = f"Parallel(tp={parallel.tp}, pp={parallel.pp}, tp_plan=...)"
    names = [n for n, m in stage.named_modules() if n.startswith("inner.")
             and not isinstance(m, nn.Identity)]
    plan = {}
    for pattern, style in parallel.tp_plan.items():
        made = torch_style(style) if isinstance(style, str) else style
        if made is None:
            continue
        plan.update(dict.fromkeys((n for n in names if _matches(f"inner.{pattern}", n)), made))
    check_divisible(stage, plan, parallel.tp, where)
    return plan


def check_divisible(model: nn.Module, plan: dict[str, Any], tp: int, where: str) -> None:
    """One-line errors for a plan the layout cannot take: a column- or row-wise style on a
    module that is neither ``nn.Linear`` nor ``nn.Embedding`` (``parallelize_module`` refuses
    it), or a split dim that ``tp`` does not divide (DTensor would split it unevenly, as
    ``torch.chunk``; the trace runs one rank's shapes for all)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    for name, style in plan.items():
        mod = model.get_submodule(name)
        col, row = isinstance(style, ColwiseParallel), isinstance(style, RowwiseParallel)
        if not (col or row):
            continue
        kind = "colwise" if col else "rowwise"
        if isinstance(mod, nn.Linear):
            dim, size = ("output features", mod.out_features) if col else (
                "input features", mod.in_features)
        elif isinstance(mod, nn.Embedding):
            dim, size = ("embedding dims", mod.embedding_dim) if col else (
                "vocabulary rows", mod.num_embeddings)
        else:
            raise MemfitError(f"{where}: {name} is a {type(mod).__name__}, which {kind} styles "
                              "do not split (nn.Linear and nn.Embedding only); name its linear "
                              "layers in tp_plan instead")
        if size % tp:
            raise MemfitError(f"{where}: {name} ({kind}) has {size} {dim}, which tp={tp} does "
                              f"not divide; choose a tp that divides {size}, or leave {name} "
                              "out of tp_plan")


def hf_plan(model: nn.Module, parallel: Parallel) -> dict[str, HfStyle] | None:
    """A transformers model's own plan (``model.tp_plan``: the class's ``_tp_plan``, the
    config's ``base_model_tp_plan`` under the base model's prefix, the input embedding
    vocabulary-split), as module and parameter names -> :class:`HfStyle`; None for a model
    without one. Each column- / row-wise split dim must divide by ``tp``."""
    plan = getattr(model, "tp_plan", None) if hasattr(model, "config") else None
    if not isinstance(plan, Mapping) or not plan:
        return None
    where = f"Parallel(tp={parallel.tp}) with {type(model).__name__}'s own tp_plan"
    expanded: dict[str, HfStyle] = {}
    names = {n for n, _ in model.named_modules()} | {n for n, _ in model.named_parameters()}
    for pattern, style in plan.items():
        # transformers' plans name every variant's modules (a bias, a fused projection) and
        # skip those a config does not build; so does memfit
        hits = [n for n in names if _matches(pattern, n)]
        expanded.update({n: HfStyle(str(style)) for n in sorted(hits)})
    if not expanded:
        return None
    _check_hf_divisible(model, expanded, parallel.tp, where)
    return expanded


_HF_COLWISE = ("colwise", "colwise_gather_output", "colwise_rep", "packed_colwise")
_HF_ROWWISE = ("rowwise", "rowwise_split_input", "rowwise_rep", "packed_rowwise")


def _check_hf_divisible(model: nn.Module, plan: dict[str, HfStyle], tp: int, where: str) -> None:
    """:func:`check_divisible` for the linear layers of transformers' column- and row-wise
    styles."""
    for name, style in plan.items():
        try:
            mod = model.get_submodule(name)
        except AttributeError:  # a parameter
            continue
        if not isinstance(mod, nn.Linear):
            continue
        if style.name in _HF_COLWISE and mod.out_features % tp:
            size, dim = mod.out_features, "output features"
        elif style.name in _HF_ROWWISE and mod.in_features % tp:
            size, dim = mod.in_features, "input features"
        else:
            continue
        raise MemfitError(f"{where}: {name} ({style.name}) has {size} {dim}, which tp={tp} "
                          f"does not divide; choose a tp that divides {size}, or give "
                          "tp_plan= a plan of your own")


def apply_hf_styles(model: nn.Module, mesh: Any, plan: dict[str, HfStyle]) -> None:
    """Apply transformers' styles as transformers does: a parameter's entry shards that
    parameter (``apply_tensor_parallelism``); a module's shards the module's own parameters
    (what transformers' loading does with each weight the plan covers) and installs the
    style's forward."""
    from memfit._compat.transformers_internals import hf_parallel_styles

    styles = hf_parallel_styles()
    modules = dict(model.named_modules())
    for name, entry in plan.items():
        style = styles[entry.name]
        if name in modules:
            module = modules[name]
            if entry.name == "mla_kv_a_proj":  # transformers gives it the config the same way
                module.config = model.config.get_text_config()  # type: ignore[union-attr,operator]
            for param in list(module._parameters):
                style.shard_param(module, param, mesh)
            style.install_forward(module, mesh)
        else:
            module_name, _, param = name.rpartition(".")
            module = modules[module_name]
            style.validate_param(module, param, mesh, parameter_name=name)
            style.shard_param(module, param, mesh)
        module._is_hooked = True
