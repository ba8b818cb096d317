"""memfit: predict, measure and reduce the GPU memory of PyTorch training and inference.

>>> import memfit
>>> p = memfit.plan(memfit.resolve_model("gpt2"), memfit.RunConfig(batch=2, seq=512))
>>> p.total_bytes > p.breakdown[memfit.MemoryCategory.WEIGHTS] > 0
True
"""

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

__version__ = "0.1.0"

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
