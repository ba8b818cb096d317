"""memfit: predict, measure and reduce the GPU memory of PyTorch training and inference.

>>> import memfit
>>> p = memfit.plan(memfit.resolve_model("gpt2"), memfit.RunConfig(batch=2, seq=512))
>>> p.total_bytes > p.breakdown[memfit.MemoryCategory.WEIGHTS] > 0
True
"""

# Note: [lazy public API]
# `import memfit` imports nothing of memfit or torch: each public name below is imported on first
# use (PEP 562 module __getattr__), so the analytic CLI (`memfit plan --params 7e9`, `memfit gpus`)
# answers without importing torch (2-3 s on its own). `from memfit import plan` and `memfit.plan`
# work as before. tests/cli/test_cli_no_torch.py checks that those paths never import torch.

import importlib as _importlib
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

from memfit._version import __version__

# public name -> the module that defines it
_SOURCES: dict[str, str] = {
    "Estimate": "memfit.trace",
    "GpuSpec": "memfit.gpus",
    "GuardedStep": "memfit.oom_guard",
    "MemfitError": "memfit.errors",
    "MemoryCategory": "memfit.categories",
    "MemoryPlan": "memfit.analytic.planner",
    "Parallel": "memfit.parallel",
    "ParamCountSpec": "memfit.models",
    "Plan": "memfit.fitting",
    "Preemptible": "memfit.preempt",
    "Recipe": "memfit.recipe",
    "RunConfig": "memfit.analytic.config",
    "TokenBudgetBatchSampler": "memfit.data",
    "TransformerSpec": "memfit.models",
    "apply_recipe": "memfit.fitting.apply",
    "build_model": "memfit.models.build",
    "estimate": "memfit.parallel.trace",  # the engine, or each rank of a layout
    "example_inputs": "memfit.models.build",
    "find_batch_size": "memfit.batch_size",
    "fit": "memfit.fitting",
    "get_gpu": "memfit.gpus",
    "guard": "memfit.oom_guard",
    "list_gpus": "memfit.gpus",
    "list_presets": "memfit.models",
    "pack": "memfit.serving.pack",
    "plan": "memfit.analytic.planner",
    "preemptible": "memfit.preempt",
    "profile": "memfit.profiling.session",
    "resolve_model": "memfit.models",
    "rightsize_serving": "memfit.serving.rightsize",
    "rightsize_training": "memfit.fitting.rightsize",
    "serve_plan": "memfit.serving",
    "spot_plan": "memfit.preempt",
    "trace_recipe": "memfit.parallel.recipe",  # the recipe's techniques, then memfit.estimate
    "watch": "memfit.monitor",
}

# (tests/cli/test_cli_no_torch.py checks that __all__ and _SOURCES name the same things)
__all__ = [
    "Estimate",
    "GpuSpec",
    "GuardedStep",
    "MemfitError",
    "MemoryCategory",
    "MemoryPlan",
    "Parallel",
    "ParamCountSpec",
    "Plan",
    "Preemptible",
    "Recipe",
    "RunConfig",
    "TokenBudgetBatchSampler",
    "TransformerSpec",
    "__version__",
    "apply_recipe",
    "build_model",
    "estimate",
    "example_inputs",
    "find_batch_size",
    "fit",
    "get_gpu",
    "guard",
    "list_gpus",
    "list_presets",
    "pack",
    "plan",
    "preemptible",
    "profile",
    "resolve_model",
    "rightsize_serving",
    "rightsize_training",
    "serve_plan",
    "spot_plan",
    "trace_recipe",
    "watch",
]


def __getattr__(name: str) -> _Any:
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module 'memfit' has no attribute {name!r}")
    value = getattr(_importlib.import_module(source), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_SOURCES))


if _TYPE_CHECKING:  # what type checkers and IDEs see: the eager imports of before
    from memfit.analytic.config import RunConfig
    from memfit.analytic.planner import MemoryPlan, plan
    from memfit.batch_size import find_batch_size
    from memfit.categories import MemoryCategory
    from memfit.data import TokenBudgetBatchSampler
    from memfit.errors import MemfitError
    from memfit.fitting import Plan, fit
    from memfit.fitting.apply import apply_recipe
    from memfit.fitting.rightsize import rightsize_training
    from memfit.gpus import GpuSpec, get_gpu, list_gpus
    from memfit.models import ParamCountSpec, TransformerSpec, list_presets, resolve_model
    from memfit.models.build import build_model, example_inputs
    from memfit.monitor import watch
    from memfit.oom_guard import GuardedStep, guard
    from memfit.parallel import Parallel
    from memfit.parallel.recipe import trace_recipe
    from memfit.parallel.trace import estimate
    from memfit.preempt import Preemptible, preemptible, spot_plan
    from memfit.profiling.session import profile
    from memfit.recipe import Recipe
    from memfit.serving import serve_plan
    from memfit.serving.pack import pack
    from memfit.serving.rightsize import rightsize_serving
    from memfit.trace import Estimate
