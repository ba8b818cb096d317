"""memfit's trace engine: run a real PyTorch step on fake tensors and predict its peak memory.

>>> import torch, memfit.trace
>>> with torch.device("meta"):
...     model = torch.nn.Linear(1024, 1024)
>>> est = memfit.trace.estimate(model, torch.empty(8, 1024, device="meta"), device="cpu")
>>> est.peak_bytes >= 4 * 1024 * 1024 * 4
True
"""

from memfit._loss import default_loss
from memfit.trace.engine import estimate
from memfit.trace.estimate import Estimate, ModuleMemory, TimelinePoint
from memfit.trace.optim import OPTIMIZERS
from memfit.trace.options import PRECISIONS

__all__ = ["OPTIMIZERS", "PRECISIONS", "Estimate", "ModuleMemory", "TimelinePoint",
           "default_loss", "estimate"]
