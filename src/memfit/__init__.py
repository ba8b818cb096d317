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
# work as before. tests/test_cli_no_torch.py checks that those paths never import torch.

import importlib as _importlib
import sys as _sys
import types as _types
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

__version__ = "0.1.0"

# public name -> the module that defines it
_SOURCES: dict[str, str] = {
    "Estimate": "memfit.trace",
    "GpuSpec": "memfit.gpus",
    "GuardedStep": "memfit.guard",
    "MemfitError": "memfit.errors",
    "MemoryCategory": "memfit.categories",
    "MemoryPlan": "memfit.estimate.planner",
    "ParamCountSpec": "memfit.models",
    "Plan": "memfit.fit",
    "RunConfig": "memfit.estimate.config",
    "TransformerSpec": "memfit.models",
    "build_model": "memfit.models.build",
    "estimate": "memfit.trace",
    "example_inputs": "memfit.models.build",
    "find_batch_size": "memfit.batch_size",
    "fit": "memfit.fit",
    "get_gpu": "memfit.gpus",
    "guard": "memfit.guard",
    "list_gpus": "memfit.gpus",
    "list_presets": "memfit.models",
    "plan": "memfit.estimate.planner",
    "profile": "memfit.profile.session",
    "resolve_model": "memfit.models",
    "watch": "memfit.monitor",
}

# (tests/test_cli_no_torch.py checks that __all__ and _SOURCES name the same things)
__all__ = [
    "Estimate",
    "GpuSpec",
    "GuardedStep",
    "MemfitError",
    "MemoryCategory",
    "MemoryPlan",
    "ParamCountSpec",
    "Plan",
    "RunConfig",
    "TransformerSpec",
    "__version__",
    "build_model",
    "estimate",
    "example_inputs",
    "find_batch_size",
    "fit",
    "get_gpu",
    "guard",
    "list_gpus",
    "list_presets",
    "plan",
    "profile",
    "resolve_model",
    "watch",
]

# Functions that share their name with a subpackage or module of memfit.
_SHADOWED = frozenset({"estimate", "fit", "guard", "profile"})


def __getattr__(name: str) -> _Any:
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module 'memfit' has no attribute {name!r}")
    value = getattr(_importlib.import_module(source), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_SOURCES))


class _Memfit(_types.ModuleType):
    """The memfit module: `memfit.estimate` stays the function when its subpackage loads.

    Importing a submodule binds it on its parent (importlib._bootstrap._find_and_load_unlocked:
    ``setattr(parent_module, child, module)``). Once the public names are lazy, a later
    ``import memfit.estimate.planner`` would rebind ``memfit.estimate`` to the package; this
    keeps the function (the package stays reachable through sys.modules and ``import``).
    """

    def __setattr__(self, name: str, value: _Any) -> None:
        if name in _SHADOWED and isinstance(value, _types.ModuleType):
            return
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Memfit

if _TYPE_CHECKING:  # what type checkers and IDEs see: the eager imports of before
    from memfit.batch_size import find_batch_size
    from memfit.categories import MemoryCategory
    from memfit.errors import MemfitError
    from memfit.estimate.config import RunConfig
    from memfit.estimate.planner import MemoryPlan, plan
    from memfit.fit import Plan, fit
    from memfit.gpus import GpuSpec, get_gpu, list_gpus
    from memfit.guard import GuardedStep, guard
    from memfit.models import ParamCountSpec, TransformerSpec, list_presets, resolve_model
    from memfit.models.build import build_model, example_inputs
    from memfit.monitor import watch
    from memfit.profile.session import profile
    from memfit.trace import Estimate, estimate
