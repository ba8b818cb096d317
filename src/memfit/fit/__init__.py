"""Find the fastest training configuration that fits a memory budget, and apply it.

>>> plan = memfit.fit.fit(model, batch, global_batch=256, gpu="a100-40gb")
>>> print(plan)
>>> model, optimizer, step = plan.apply(model)
"""

from memfit.fit.config import FitConfig
from memfit.fit.cost import Rates, StepCost
from memfit.fit.plan import Candidate, Plan, Rejected
from memfit.fit.search import fit

__all__ = ["Candidate", "FitConfig", "Plan", "Rates", "Rejected", "StepCost", "fit"]
