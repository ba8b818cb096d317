"""A PNG of the profiled run's stacked timeline, for terminals, slides and papers.

Drawn with matplotlib (``pip install 'memfit[report]'``), imported only here: a figure for a paper
needs labelled axes and a legend, which a hand-written PNG encoder could not draw without
shipping a font.
"""

from __future__ import annotations

import os
from typing import Any

from memfit.errors import MemfitError
from memfit.profiling.report._assets import CATEGORY_COLORS, PHASE_COLORS
from memfit.profiling.report.html import legend_categories, phase_spans
from memfit.profiling.result import TRACKED, ProfileResult, downsample

MAX_POINTS = 4000


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise MemfitError("the PNG export needs matplotlib; install it with "
                          "`pip install 'memfit[report]'` (the HTML report needs nothing)"
                          ) from None
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def write_png(path: str | os.PathLike[str], result: ProfileResult, *, width: float = 10.0,
              height: float = 4.0, dpi: int = 150) -> None:
    """Write the stacked timeline (live bytes by category, the peak marked) to ``path``."""
    plt = _pyplot()
    points = downsample(result.timeline, MAX_POINTS, keep=result.peak_index)
    scale, unit = _unit(max([p.total for p in points] + [result.peak_reserved_bytes or 0, 1]))
    xs = [p.index for p in points]
    seen_phases: set[str] = set()
    shown = set(legend_categories(result.timeline))
    fig, ax = plt.subplots(figsize=(width, height), dpi=dpi)
    try:
        if points:
            series = [[p.bytes[i] / scale for p in points] for i in range(len(TRACKED))]
            # Labels starting with "_" stay out of matplotlib's legend: the empty categories.
            ax.stackplot(xs, *series, labels=[c.value if c in shown else f"_{c.value}"
                                              for c in TRACKED],
                         colors=[CATEGORY_COLORS[c.value] for c in TRACKED], alpha=0.85,
                         step="post")
            if points[0].reserved is not None:
                ax.step(xs, [(p.reserved or 0) / scale for p in points], where="post",
                        color="#34495e", linestyle="--", linewidth=1, label="reserved")
        if result.peak_index >= 0 and points:
            peak_x = peak_marker_x(xs, result.peak_index)
            ax.axvline(peak_x, color="#c0392b", linestyle="--", linewidth=1)
            # The label reads away from the plot's nearer edge, so it stays inside the plot.
            left = peak_x > (xs[0] + xs[-1]) / 2
            ax.annotate(f"peak {result.peak_bytes / scale:.2f} {unit}",
                        xy=(peak_x, result.peak_bytes / scale),
                        xytext=(-4 if left else 4, -12), textcoords="offset points",
                        ha="right" if left else "left", color="#c0392b")
        for phase, start, end in phase_spans(result.timeline):
            # The phases of the step as bands along the x-axis (the legend names them).
            ax.axvspan(start, end, ymin=0, ymax=0.025, color=PHASE_COLORS[phase], linewidth=0,
                       label=phase if phase not in seen_phases else None)
            seen_phases.add(phase)
        ax.set_xlabel(f"op index ({result.num_ops} ops)")
        ax.set_ylabel(f"live memory ({unit})")
        ax.set_title(f"memfit profile ({result.device})")
        # Outside the plot, on its right: inside, it covered whatever was drawn there, the
        # peak's label included (an early peak sits in the upper left).
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=8)
        ax.margins(x=0)
        ax.set_ylim(bottom=0)
        fig.tight_layout()
        fig.savefig(os.fspath(path), format="png")
    finally:
        plt.close(fig)


def peak_marker_x(xs: list[int], peak_index: int) -> float:
    """Where the peak's marker goes: the middle of the step that draws the peak point. The
    areas are drawn ``step="post"``: the point at ``x = xs[k]`` (live bytes after that op) spans
    ``xs[k]`` to ``xs[k + 1]`` (one op, or a downsampled bucket), so a line at ``xs[k]`` itself
    sits on the edge with the op before, whose bytes are drawn to its left. ``xs`` must hold
    ``peak_index`` (:func:`memfit.profiling.result.downsample` keeps it)."""
    k = xs.index(peak_index)
    if k + 1 == len(xs):  # the last point: drawn as the plot's right edge
        return float(xs[k])
    return (xs[k] + xs[k + 1]) / 2


def _unit(n: int) -> tuple[float, str]:
    for scale, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= scale:
            return float(scale), unit
    return 1.0, "B"
