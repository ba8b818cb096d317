"""What both callbacks record: memory by category at one step."""

from __future__ import annotations

import logging
from typing import Any

from memfit.errors import MemfitError
from memfit.monitor import model_memory

log = logging.getLogger("memfit")


def check_every(every_n_steps: int) -> int:
    if not isinstance(every_n_steps, int) or every_n_steps <= 0:
        raise MemfitError(f"every_n_steps must be a positive integer, got {every_n_steps!r}")
    return every_n_steps


def record(step: int, model: Any, optimizer: Any) -> dict[str, int]:
    """``{"step": step, "weights": ..., "gradients": ..., "optimizer_states": ...}`` (plus
    ``allocated``, ``reserved`` and ``other`` on CUDA), logged on the ``memfit`` logger."""
    entry = {"step": step, **model_memory(model, optimizer)}
    log.info("memfit step %d: %s", step,
             ", ".join(f"{k}={v}" for k, v in entry.items() if k != "step"))
    return entry
