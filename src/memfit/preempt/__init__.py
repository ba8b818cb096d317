"""Spot and preemptible instances: price the risk (:mod:`memfit.preempt.spot`, no torch), lose
nothing (:mod:`memfit.preempt.checkpoint`). User guide: docs/spot.md.

>>> with memfit.preemptible("ckpt", model=model, optimizer=opt, every_steps=500) as p:
...     for step in range(p.step, total_steps):
...         train_one_step()
...         p.end_step()      # on SIGTERM: finish the step, save, exit with 143
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Note: [lazy public API] in memfit/__init__.py: `memfit spot-plan` answers without torch.
_SOURCES = {
    "EXIT_PREEMPTED": "memfit.preempt.checkpoint",
    "Preemptible": "memfit.preempt.checkpoint",
    "latest_complete": "memfit.preempt.checkpoint",
    "preemptible": "memfit.preempt.checkpoint",
    "SpotPlan": "memfit.preempt.spot",
    "spot_plan": "memfit.preempt.spot",
    "checkpoint_bytes": "memfit.preempt.spot",
}

__all__ = ["EXIT_PREEMPTED", "Preemptible", "SpotPlan", "checkpoint_bytes", "latest_complete",
           "preemptible", "spot_plan"]


def __getattr__(name: str) -> Any:
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module 'memfit.preempt' has no attribute {name!r}")
    return getattr(importlib.import_module(source), name)


if TYPE_CHECKING:
    from memfit.preempt.checkpoint import (
        EXIT_PREEMPTED,
        Preemptible,
        latest_complete,
        preemptible,
    )
    from memfit.preempt.spot import SpotPlan, checkpoint_bytes, spot_plan
