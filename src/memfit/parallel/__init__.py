"""Multi-GPU layouts: :class:`Parallel` and the per-rank trace of the real parallel step.

>>> from memfit.parallel import Parallel
>>> Parallel(gpus=16, gpus_per_node=8, fsdp=8).strategy
'hsdp'
"""

from memfit.parallel.config import Parallel

__all__ = ["Parallel"]
