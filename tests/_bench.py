"""The bench scripts under ``bench/`` loaded as modules, for their smoke tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench(script: str) -> ModuleType:
    """``bench/<script>.py`` imported as the module ``bench_<script>`` (registered in
    ``sys.modules``: a dataclass looks its module up by name)."""
    spec = importlib.util.spec_from_file_location(f"bench_{script}", BENCH / f"{script}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
