"""Progress of long work on stderr: what is done, what is left, an honest ETA.

>>> with Progress("validating", total=len(configs), unit="configs") as bar:
...     for config in configs:
...         bar.phase(f"{config.name}: real run")
...         run(config)
...         bar.advance()

Rules (issue 12, "Long work must show progress"):

- Output goes to **stderr**, only when stderr is a terminal; never under ``--json`` or
  ``--quiet`` (the CLI passes ``progress=False``). ``MEMFIT_PROGRESS=0`` silences it from the
  environment (or ``os.environ`` in Python), ``MEMFIT_PROGRESS=1`` forces it on. A ``progress=``
  argument, where a function takes one, wins over both: ``True`` shows, ``False`` hides, ``None``
  (the default) decides by the rules above (:func:`should_show`).
- The **ETA** is shown only once a unit of work has finished, and is the average time per
  finished unit (weighted, when the caller knows that units differ in cost) times what is left,
  counted down from the last finished unit. Until then, and when the total is unknown, the line
  shows a spinner, the time elapsed, and the name of the sub-phase running now with its own
  elapsed time, so a long single unit never looks stuck at "6% -:--:--".
- A ``Progress`` entered while another is showing does not open a second display: its phases
  and counts appear as the outer one's sub-phase (e.g. ``fit`` tracing a candidate shows the
  trace's layer). So library calls can report progress without knowing who called them.
- The display is transient: it is erased when the work ends; results are printed by the caller.

Known limitations: the display redraws four times a second from a background thread; a
C/C++ library writing to fd 2 while it draws can garble one frame (memfit silences the
profiler's lines around its own runs, see :mod:`memfit._noise`).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["ENV", "Progress", "current", "paused", "phase", "quiet", "should_show",
           "trace_progress"]

ENV = "MEMFIT_PROGRESS"
"""Environment variable: ``0``/``false``/``off`` hides progress, ``1``/``true``/``on`` shows it."""

_OFF = frozenset({"0", "false", "no", "off", "quiet"})
_ON = frozenset({"1", "true", "yes", "on", "force"})

_stack: list[Progress] = []
_stack_lock = threading.RLock()
_draw_lock = threading.RLock()
"""Held while a display starts and while :func:`paused` holds the displays still."""


def should_show(progress: bool | None = None) -> bool:
    """Whether long work shows progress: ``progress`` when given, else ``$MEMFIT_PROGRESS``,
    else whether stderr is a terminal."""
    if progress is not None:
        return bool(progress)
    env = os.environ.get(ENV, "").strip().lower()
    if env in _OFF:
        return False
    if env in _ON:
        return True
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


def current() -> Progress | None:
    """The innermost active progress display, if any."""
    with _stack_lock:
        return _stack[-1] if _stack else None


def _clock(seconds: float) -> str:
    seconds = max(0, int(seconds + 0.5))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class Progress:
    """A progress line (and optionally a view above it) for one piece of long work.

    ``total``: the work in weight units (default one unit per item; ``None`` when unknown);
    ``items``: how many items make up the work when the weights are not one per item (shown as
    ``done/items unit``); ``unit``: what an item is ("configs", "candidates"); ``progress``:
    see :func:`should_show`; ``console``: a :class:`rich.console.Console` to draw on (default:
    stderr; tests pass ``Console(file=..., force_terminal=True)``); ``delay``: seconds before
    the display appears (work that ends sooner draws nothing); ``eta_is_bound``: the ETA is
    shown as an upper bound ("ETA ≤ 1:20"), for work whose later items may be skipped (``fit``'s
    branch and bound prunes combinations without tracing them).

    Known limitations: weights are the caller's estimate of relative cost; an ETA is only as
    good as they are.
    """

    def __init__(self, description: str, *, total: float | None = None,
                 items: int | None = None, unit: str = "", progress: bool | None = None,
                 console: Any = None, delay: float = 0.0, eta_is_bound: bool = False
                 ) -> None:
        self.description = description
        self.total = None if total is None else float(total)
        self.items = items if items is not None else (int(total) if total is not None else None)
        self.unit = unit
        self.completed = 0.0
        self.items_done = 0
        self.note = ""
        self._phase = ""
        self._phase_started = 0.0
        self._started = 0.0
        self._last_done = 0.0
        self._view: Any = None
        self._enabled = should_show(progress) if console is None else progress is not False
        self._console = console
        self._live: Any = None
        self._parent: Progress | None = None
        self._lock = threading.RLock()
        self._delay = delay
        self.eta_is_bound = eta_is_bound
        self._timer: threading.Timer | None = None
        self._closed = False

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> Progress:
        self._started = self._last_done = self._phase_started = time.monotonic()
        with _stack_lock:
            self._parent = _stack[-1] if _stack else None
            _stack.append(self)
        if self._parent is None and self._enabled:
            if self._delay > 0:
                # Work that ends within the delay draws nothing (no flash of a bar).
                self._timer = threading.Timer(self._delay, self._start)
                self._timer.daemon = True
                self._timer.start()
            else:
                self._start()
        self._report()
        return self

    def _start(self) -> None:
        from rich.console import Console
        from rich.live import Live

        with _draw_lock, self._lock:
            if self._closed:
                return
            # Asked for explicitly (progress=True, MEMFIT_PROGRESS=1) on a stream that is not a
            # terminal: draw as on one, or rich would print nothing for a transient display.
            console = self._console or Console(stderr=True, force_terminal=True)
            live = Live(console=console, transient=True, refresh_per_second=4,
                        get_renderable=self._render)
            live.start()
            self._live = live

    def __exit__(self, *exc: object) -> None:
        with _stack_lock:
            if self in _stack:
                _stack.remove(self)
        if self._timer is not None:
            self._timer.cancel()
        with self._lock:
            self._closed = True
            live, self._live = self._live, None
        if live is not None:
            live.stop()
        if self._parent is not None:
            self._parent._child_done()

    @property
    def drawing(self) -> bool:
        """Whether the outermost progress draws (or will, once its delay is over)."""
        root = self
        while root._parent is not None:
            root = root._parent
        return root._enabled and not root._closed

    @property
    def shown(self) -> bool:
        """Whether this progress is drawn (itself, or as an outer display's sub-phase)."""
        return self._live is not None or (self._parent is not None and self._parent.shown)

    def console_height(self) -> int:
        """Lines of the terminal drawn on (24 when not drawn): to size a view."""
        live = self._live
        return int(live.console.size.height) if live is not None else 24

    # -- updates ---------------------------------------------------------------------------

    def advance(self, weight: float = 1.0, *, items: int = 1) -> None:
        """Record finished work: ``weight`` units (one item by default)."""
        with self._lock:
            self.completed += weight
            self.items_done += items
            self._last_done = time.monotonic()
        self._report()

    def track(self, iterable: Iterable[T]) -> Iterator[T]:
        """Yield each item; the item counts as done when the loop body has run (a ``continue``
        included), not when it starts."""
        for item in iterable:
            yield item
            self.advance()

    def set_total(self, total: float | None, *, items: int | None = None) -> None:
        """Change the total when it becomes known (or changes)."""
        with self._lock:
            self.total = None if total is None else float(total)
            self.items = items if items is not None else (
                int(total) if total is not None else None)
        self._report()

    def phase(self, text: str) -> None:
        """Name what runs now (shown with its own elapsed time)."""
        with self._lock:
            if text != self._phase:
                self._phase = text
                self._phase_started = time.monotonic()
        self._report()

    def set_note(self, text: str) -> None:
        """A short status shown after the counts (e.g. "5 fit, 3 over budget")."""
        self.note = text
        self._report()

    def show(self, renderable: Any) -> None:
        """Show ``renderable`` (e.g. the rows of a table finished so far) above the line."""
        self._view = renderable
        self._report()

    # -- state -----------------------------------------------------------------------------

    def eta_seconds(self, now: float | None = None) -> float | None:
        """Seconds left: the average time per finished weight unit times the weight left,
        counted down from the last finished unit; None before the first unit finishes or
        without a total."""
        if self.total is None or self.completed <= 0:
            return None
        per_unit = (self._last_done - self._started) / self.completed
        left = per_unit * max(0.0, self.total - self.completed)
        now = time.monotonic() if now is None else now
        return max(0.0, left - (now - self._last_done))

    def status(self, now: float | None = None, *, with_phase: bool = True) -> str:
        """The progress line as plain text (what the display shows, without the spinner)."""
        now = time.monotonic() if now is None else now
        parts = [self.description]
        if self.items is not None:
            parts.append(f"{self.items_done}/{self.items}{' ' + self.unit if self.unit else ''}")
        elif self.items_done:
            parts.append(f"{self.items_done}{' ' + self.unit if self.unit else ''} done")
        eta = self.eta_seconds(now)
        if eta is not None and self.completed < (self.total or 0):
            parts.append(f"ETA {'≤ ' if self.eta_is_bound else ''}{_clock(eta)}")
        parts.append(f"elapsed {_clock(now - self._started)}")
        if self.note:
            parts.append(self.note)
        line = " · ".join(parts)
        if self._phase and with_phase:
            line += f" · {self.phase_text(now)}"
        return line

    def phase_text(self, now: float | None = None) -> str:
        """The sub-phase running now, with its elapsed time (empty when none)."""
        if not self._phase:
            return ""
        now = time.monotonic() if now is None else now
        return f"{self._phase} ({_clock(now - self._phase_started)})"

    def _fraction(self) -> float | None:
        if self.total is None or self.total <= 0:
            return None
        return min(1.0, self.completed / self.total)

    # -- drawing ---------------------------------------------------------------------------

    def _report(self) -> None:
        """Pass this progress up as the parent's sub-phase (nested), or redraw soon."""
        if self._parent is not None:
            counts = (f" {self.items_done}/{self.items}" if self.items is not None else "")
            head = f"{self.description}{counts}"
            self._parent._child_phase(": ".join(t for t in (head, self._phase) if t))

    def _child_phase(self, text: str) -> None:
        with self._lock:
            self._child = text
        self._report()

    def _child_done(self) -> None:
        with self._lock:
            self._child = ""
        self._report()

    _child = ""

    def _render(self) -> Any:
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.spinner import Spinner
        from rich.table import Table
        from rich.text import Text

        now = time.monotonic()
        with self._lock:
            phase = self.phase_text(now)
            line = self.status(now, with_phase=False)  # the phase goes on the line below
            below = " › ".join(t for t in (phase, self._child) if t)
            fraction = self._fraction()
        grid = Table.grid(padding=(0, 1))
        grid.add_column(no_wrap=True)
        if fraction is not None:
            grid.add_column(width=24, no_wrap=True)
        grid.add_column(overflow="ellipsis", no_wrap=True)
        cells: list[Any] = [_SPINNER.setdefault("s", Spinner("dots"))]
        if fraction is not None:
            cells.append(ProgressBar(total=1.0, completed=fraction, width=24))
        cells.append(Text(line))
        grid.add_row(*cells)
        rows: list[Any] = [] if self._view is None else [self._view]
        rows.append(grid)
        if below:
            rows.append(Text(f"  {below}", overflow="ellipsis", no_wrap=True, style="dim"))
        return Group(*rows)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Hold the display still (no redraw) inside the block: around code that writes to the
        terminal's file descriptor directly."""
        live = self._live
        if live is None:
            yield
            return
        with live._lock:
            yield


_SPINNER: dict[str, Any] = {}


@contextmanager
def paused() -> Iterator[None]:
    """Hold the active display (if any) still inside the block (see :meth:`Progress.paused`)."""
    with _draw_lock:  # no display starts meanwhile (a delayed one, from its timer thread)
        with _stack_lock:
            root = _stack[0] if _stack else None
        if root is None:
            yield
            return
        with root.paused():
            yield


def phase(text: str) -> None:
    """Name the sub-phase of the innermost active progress, if any (a no-op otherwise): code
    deep in a call reports what it runs without being handed the progress object."""
    active = current()
    if active is not None:
        active.phase(text)


@contextmanager
def quiet() -> Iterator[None]:
    """No progress display inside the block, whatever the terminal or the arguments below say
    (``--quiet`` and ``--json`` run the command inside it).

    >>> with memfit.progress.quiet():
    ...     est = memfit.estimate(model, batch)
    """
    with Progress("", progress=False):
        yield


@contextmanager
def trace_progress(model: Any, *, steps: int, training: bool,
                   description: str = "memfit.estimate: tracing") -> Iterator[None]:
    """Phases of a traced step on the active progress (or on a display of its own after a
    second, when the trace runs alone in a terminal): ``step s/S forward: layer i/N`` from a
    forward pre-hook on each repeated block, ``backward: layer i/N`` from a hook on each block's
    output gradient, ``optimizer step`` from a global optimizer step pre-hook (removed on exit).

    The hooks only name phases: they return nothing and allocate nothing, so the trace is
    unchanged (the engine's module attribution uses the same kind of hooks)."""
    outer = current()
    if not should_show() if outer is None else not outer.drawing:
        yield  # nothing would be drawn: no hooks at all
        return
    import torch

    from memfit.errors import MemfitError
    from memfit.models.anatomy import find_blocks

    try:
        names = find_blocks(model)
    except MemfitError:
        names = []
    modules = dict(model.named_modules())
    blocks = [modules[n] for n in names if n in modules]
    state = {"step": 0, "backward": False}
    prefix = (lambda: f"step {state['step']}/{steps} ") if steps > 1 else (lambda: "")
    handles: list[Any] = []
    with Progress("" if outer is not None else description, total=None, delay=1.0) as bar:
        def root_pre(_mod: Any, _args: Any) -> None:
            state["step"] += 1
            state["backward"] = False
            bar.phase(f"{prefix()}forward")

        def block_pre(i: int) -> Any:
            def hook(_mod: Any, _args: Any) -> None:
                if not state["backward"]:  # not a checkpoint's recompute
                    bar.phase(f"{prefix()}forward: layer {i + 1}/{len(blocks)}")
            return hook

        def block_post(i: int) -> Any:
            def on_grad(_grad: Any) -> None:
                state["backward"] = True
                bar.phase(f"{prefix()}backward: layer {i + 1}/{len(blocks)}")

            def hook(_mod: Any, _args: Any, out: Any) -> None:
                if state["backward"] or not torch.is_grad_enabled():
                    return
                first = out[0] if isinstance(out, tuple | list) and out else out
                if isinstance(first, torch.Tensor) and first.requires_grad:
                    first.register_hook(on_grad)
            return hook

        def optimizer_pre(*_args: Any) -> None:
            bar.phase(f"{prefix()}optimizer step")

        handles.append(model.register_forward_pre_hook(root_pre))
        for i, block in enumerate(blocks):
            handles.append(block.register_forward_pre_hook(block_pre(i)))
            handles.append(block.register_forward_hook(block_post(i)))
        if training:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            handles.append(register_optimizer_step_pre_hook(optimizer_pre))
        try:
            yield
        finally:
            for h in handles:
                h.remove()
