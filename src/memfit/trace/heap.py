"""The garbage collector during a trace: the objects that were there before it are not scanned.

Note: [frozen heap] A trace allocates hundreds of thousands of Python objects (fake tensors,
autograd nodes, cache keys), so CPython's collector runs during it, and a full (generation 2)
collection walks every object of the process: in a process that imported transformers, or ran
MemTracker before, one full collection costs a quarter of a second, 15% of a 7B trace.
:func:`frozen_heap` calls ``gc.freeze()`` before the trace (the objects that exist then move to
the permanent generation, which collections skip: ``Modules/gcmodule.c: gc_freeze_impl``) and
``gc.unfreeze()`` after (they go back to the oldest generation, collected as before). Only the
objects made before the trace are left out of its collections; the trace's own objects are
collected as before, so a tensor freed by the collector during a trace is still freed. Nested
and concurrent traces share one freeze (a count under a lock); a process that has frozen
objects itself is left as it is. Finding that out costs a walk of the frozen objects
(``gc.get_freeze_count()`` counts a linked list: 30 ms with a million objects frozen, CPython
3.11), so a process that freezes for good (a forking server, a test session) says so once with
:func:`mark_process_frozen` and the traces skip the walk.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

_lock = threading.Lock()
_depth = 0
_ours = False  # whether the outermost frozen_heap froze (False: the process had frozen already)
_declared = False  # the process said it froze its objects itself (mark_process_frozen)
F = TypeVar("F", bound=Callable[..., Any])


def mark_process_frozen(frozen: bool = True) -> None:
    """Say that this process called ``gc.freeze()`` itself and keeps its objects frozen
    (``frozen=False`` takes it back, e.g. before ``gc.unfreeze()``). Traces then leave the
    permanent generation as it is without counting it (module docstring)."""
    global _declared
    with _lock:
        _declared = frozen


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Leave the objects that exist now out of the collections made inside (module docstring)."""
    global _depth, _ours
    with _lock:
        if _depth == 0:
            # A process that froze objects itself (a forking server's gc.freeze()) keeps its
            # permanent generation: unfreezing after the trace would undo the user's freeze.
            _ours = not _declared and gc.get_freeze_count() == 0
            if _ours:
                gc.freeze()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _ours:
                gc.unfreeze()


def with_frozen_heap(fn: F) -> F:
    """``fn`` run inside :func:`frozen_heap`."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with frozen_heap():
            return fn(*args, **kwargs)
    return run  # type: ignore[return-value]
