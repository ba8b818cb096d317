"""Hugging Face transformers internals memfit patches, each behind one function.

Checked against transformers 5.23.0. ``tests/test_compat.py`` checks each against the
installed transformers.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["IMPORT_UTILS", "fake_tensors_look_eager", "hf_parallel_styles"]

IMPORT_UTILS = "transformers.utils.import_utils"
"""The module defining ``is_fake_tensor(x)`` and ``is_tracing(tensor)``; ``is_tracing`` (used by
``masking_utils`` and the attention code) looks ``is_fake_tensor`` up in this module's globals
at each call, so replacing the module attribute reaches every caller."""


@contextlib.contextmanager
def fake_tensors_look_eager(answer: bool = False) -> Iterator[None]:
    """Within the context ``transformers.utils.import_utils.is_fake_tensor`` answers False, so
    that ``is_tracing(fake_tensor)`` is False and transformers takes its eager code paths (see
    Note: [libraries that detect fake tensors] in ``memfit/trace/fake_rules.py``); restored on exit.
    Nothing is patched when transformers is not imported or has no ``is_fake_tensor``.
    ``answer=True``: every tensor looks traced, so a forward on meta tensors skips the
    data-dependent shortcuts (``.all()`` of a mask) that a meta tensor cannot answer."""
    module = sys.modules.get(IMPORT_UTILS)
    original = getattr(module, "is_fake_tensor", None)
    if module is None or original is None:
        yield
        return

    def is_fake_tensor(_x: Any) -> bool:
        return answer

    module.is_fake_tensor = is_fake_tensor  # type: ignore[attr-defined]
    try:
        yield
    finally:
        module.is_fake_tensor = original  # type: ignore[attr-defined]


def hf_parallel_styles() -> Any:
    """transformers' registry of tensor-parallel styles by the names its ``tp_plan`` s use
    (``ALL_PARALLEL_STYLES``: ``transformers/distributed/tensor_parallel.py`` since 5.x;
    ``transformers/integrations/tensor_parallel.py`` before)."""
    try:
        from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES
    except ImportError:
        from transformers.integrations.tensor_parallel import ALL_PARALLEL_STYLES
    return ALL_PARALLEL_STYLES
