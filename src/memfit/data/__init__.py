"""Data loading under a memory budget: :class:`TokenBudgetBatchSampler` groups variable-length
samples into batches under a token or memory budget, with DistributedSampler's semantics.

(This package also holds memfit's shipped data files, ``gpus.json`` and ``models.json``.)
"""

from memfit.data.sampler import CostFn, PaddingStats, TokenBudgetBatchSampler, traced_cost

__all__ = ["CostFn", "PaddingStats", "TokenBudgetBatchSampler", "traced_cost"]
