"""Training-framework callbacks that log memory by category every N steps.

Importing this package imports neither transformers nor lightning; each callback class is loaded
from its module on first access:

>>> from memfit.integrations import MemfitTrainerCallback      # needs transformers
>>> from memfit.integrations import MemfitLightningCallback    # needs lightning
"""

from __future__ import annotations

from typing import Any

__all__ = ["MemfitLightningCallback", "MemfitTrainerCallback"]


def __getattr__(name: str) -> Any:
    if name == "MemfitTrainerCallback":
        from memfit.integrations.huggingface import MemfitTrainerCallback

        return MemfitTrainerCallback
    if name == "MemfitLightningCallback":
        from memfit.integrations.lightning import MemfitLightningCallback

        return MemfitLightningCallback
    raise AttributeError(f"module 'memfit.integrations' has no attribute {name!r}")
