"""The :class:`Parallel` layout, re-exported from :mod:`memfit.layout` (where it lives, below
every layer that reads it: a :class:`memfit.Recipe` holds one)."""

from memfit.layout import PP_SCHEDULES, Parallel, check_degrees

__all__ = ["PP_SCHEDULES", "Parallel", "check_degrees"]
