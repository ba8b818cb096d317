"""The plan's budget by target: moved to :mod:`memfit.budget` (below the trace, so that the
trace, serving, packing and fitting judge against the same bytes); re-exported here."""

from memfit.budget import (
    DeviceBudget,
    budget_bytes,
    device_budget,
    device_runtime_bytes,
    planned_on,
)

__all__ = ["DeviceBudget", "budget_bytes", "device_budget", "device_runtime_bytes", "planned_on"]
