"""memfit: predict, measure and reduce the GPU memory of PyTorch training and inference."""

from memfit.categories import MemoryCategory
from memfit.errors import MemfitError

__version__ = "0.1.0"

__all__ = ["MemfitError", "MemoryCategory", "__version__"]
