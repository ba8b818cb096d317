"""Find the fastest training configuration that fits a memory budget, and apply it.

>>> plan = memfit.fitting.fit(model, batch, global_batch=256, gpu="a100-40gb")
>>> print(plan)
>>> model, optimizer, step = plan.apply(model)
"""

from memfit.fitting.apply import apply_recipe
from memfit.fitting.config import FitConfig
from memfit.fitting.cost import Rates, StepCost
from memfit.fitting.plan import Candidate, Plan, Rejected
from memfit.fitting.search import SearchOptions, fit

__all__ = ["Candidate", "FitConfig", "Plan", "Rates", "Rejected", "SearchOptions", "StepCost",
           "apply_recipe", "fit"]
