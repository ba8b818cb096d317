"""Trace a :class:`memfit.Recipe`'s step: its techniques applied to the model
(:func:`memfit.techniques.recipe.apply_techniques`), then :func:`memfit.estimate` run with its
precision, optimizer (its states on the host when offloaded) and layout."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memfit.errors import MemfitError
from memfit.gpus import GpuSpec
from memfit.recipe import Recipe

if TYPE_CHECKING:  # torch is imported on first use: the analytic CLI imports this module
    from torch import nn

    from memfit._loss import LossFn
    from memfit.trace.estimate import Estimate

__all__ = ["trace_precision", "trace_recipe", "untraced"]


def trace_precision(run: Any, parallel: Any) -> str:
    """The trace's precision: the run's, except under FSDP2's ``MixedPrecisionPolicy``, which
    handles mixed precision itself: fp32 parameters, gradients and optimizer states, 16-bit
    all-gathers and compute, no autocast (torchtitan, ``torchtitan/distributed/utils.py:
    maybe_enable_amp``: "FSDP handles mixed precision internally", a ``nullcontext``)."""
    return "fp32" if parallel is not None and parallel.param_dtype else run.precision


def untraced(recipe: Recipe) -> str | None:
    """What in ``recipe`` the trace does not model, or None."""
    par = recipe.parallel
    if recipe.offload_params and not (par is not None and par.cpu_offload):
        return "offload_params without a layout that offloads (Parallel(cpu_offload=True))"
    if recipe.offload_gradients:
        return "offload_gradients"
    if recipe.offload_to != "cpu":
        return f"offload_to={recipe.offload_to!r}"
    if recipe.weight_quant != "none" or recipe.kv_cache_dtype is not None:
        return "weight_quant / kv_cache_dtype (an inference deployment)"
    return None


def trace_recipe(model: nn.Module, batch: Any, recipe: Recipe, *, loss_fn: LossFn | None = None,
                 device: str = "cuda", gpu: str | GpuSpec | None = None, steps: int = 2,
                 num_gpus: int = 1, keep_output: bool = False, train: bool = True,
                 expandable_segments: bool = False,
                 offload_min_bytes: int = 1024) -> Estimate:
    """Trace ``steps`` steps of ``recipe`` on ``model`` (meta or fake; changed in place: the
    recipe's techniques are applied to it) with ``batch`` as one micro-batch: what
    :func:`memfit.estimate` predicts for the recipe, its layout (``recipe.parallel``) traced per
    rank. ``train=False``: a forward in eval mode, no optimizer (inference).
    ``offload_min_bytes``: the smallest activation an ``offload_activations`` recipe moves
    (:func:`memfit.techniques.recipe.apply_techniques`).

    A ``budget`` checkpointing without resolved modes is resolved on ``batch``; the modes
    applied are in the estimate's ``checkpoint_modes``-free model (read them from
    :func:`memfit.techniques.recipe.apply_techniques` when needed).

    >>> est = trace_recipe(meta_model, batch, Recipe(precision="bf16-mixed",
    ...                    checkpointing="full"), device="cpu")  # doctest: +SKIP
    """
    from memfit.parallel.trace import estimate
    from memfit.techniques.optim import offloaded
    from memfit.techniques.recipe import apply_techniques

    if not isinstance(recipe, Recipe):
        raise MemfitError(f"trace_recipe takes a memfit.Recipe, not {type(recipe).__name__}")
    why = untraced(recipe)
    if why:
        raise MemfitError(f"trace_recipe does not model {why} yet; use memfit plan's analytic "
                          "method for it")
    apply_techniques(model, recipe, inputs=batch, offload_min_bytes=offload_min_bytes)
    optimizer: Any = None
    if train:
        optimizer = offloaded(recipe.optimizer) if recipe.offload_states else recipe.optimizer
    else:
        model.eval()
    return estimate(model, batch, optimizer=optimizer,
                    precision=trace_precision(recipe, recipe.parallel), loss_fn=loss_fn,
                    device=device, gpu=gpu if device == "cuda" else None, steps=steps,
                    num_gpus=num_gpus, keep_output=keep_output,
                    expandable_segments=expandable_segments, parallel=recipe.parallel)
