"""memfit's version, a leaf module: what a submodule reads without importing the package's
public API (memfit/__init__.py)."""

__version__ = "0.2.0"
