"""Data loading under a memory budget: :class:`TokenBudgetBatchSampler` groups variable-length
samples into batches under a token or memory budget, with DistributedSampler's semantics;
:class:`DevicePrefetcher` copies the next batches to the GPU on a side stream while a step runs.
The input pipeline's host and device memory is predicted by
:func:`memfit.runtime.input_pipeline.input_pipeline_memory` (torch-free, for the planner).

(This package also holds memfit's shipped data files, ``gpus.json`` and ``models.json``.)
"""

from memfit.data.prefetch import DevicePrefetcher, batch_nbytes
from memfit.data.sampler import CostFn, PaddingStats, TokenBudgetBatchSampler, traced_cost

__all__ = ["CostFn", "DevicePrefetcher", "PaddingStats", "TokenBudgetBatchSampler",
           "batch_nbytes", "traced_cost"]
