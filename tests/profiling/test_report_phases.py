"""The report's timeline (issue 12): the step's phases marked on the x-axis, no empty category
in the legend, the PNG's peak marker on the step it names."""

from __future__ import annotations

import json
import re

import pytest

from memfit.profiling.report.html import legend_categories, phase_spans, render_html
from memfit.profiling.report.png import peak_marker_x, write_png
from memfit.profiling.result import TRACKED, MeasuredPoint, ProfileResult
from test_report import HOSTILE, _profiled


@pytest.fixture(scope="module")
def result() -> ProfileResult:
    return _profiled()


def _point(i: int, phase: str, weights: int = 0, acts: int = 0) -> MeasuredPoint:
    bytes_ = [0] * len(TRACKED)
    bytes_[0], bytes_[3] = weights, acts
    return MeasuredPoint(i, "aten.x", phase, "", tuple(bytes_))


def test_phase_spans_tile_the_runs_of_each_phase() -> None:
    phases = ["other", "forward", "forward", "other", "backward", "backward", "optimizer",
              "optimizer", "forward", "other"]
    points = [_point(i, ph) for i, ph in enumerate(phases)]
    # By hand: forward 1-2 ends where "other" starts (3); backward 4-5 ends where the
    # optimizer starts (6); the optimizer ends at the next forward (8), which ends at 9.
    assert phase_spans(points) == [("forward", 1, 3), ("backward", 4, 6), ("optimizer", 6, 8),
                                   ("forward", 8, 9)]


def test_legend_categories_are_those_that_hold_bytes() -> None:
    points = [_point(0, "forward", weights=10), _point(1, "forward", weights=10, acts=5),
              _point(2, "backward", weights=10)]
    assert [c.value for c in legend_categories(points)] == ["weights", "activations"]


def _data(page: str) -> dict:
    m = re.search(r'<script type="application/json" id="memfit-data">(.*?)</script>', page, re.S)
    assert m is not None
    return json.loads(m.group(1))


def test_report_marks_forward_backward_and_optimizer(result: ProfileResult) -> None:
    """The profiled run is two training steps: forward, backward, optimizer, twice."""
    data = _data(render_html(result))
    order = [s["phase"] for s in data["phases"]]
    collapsed = [ph for k, ph in enumerate(order) if k == 0 or order[k - 1] != ph]
    assert collapsed == ["forward", "backward", "optimizer"] * 2
    by_index = {p.index: p.phase for p in result.timeline}
    for s in data["phases"]:
        assert s["start"] < s["end"]
        inside = {by_index[i] for i in range(s["start"], s["end"])}
        assert inside <= {s["phase"], "other"} and s["phase"] in inside
    assert set(data["phase_colors"]) == {"forward", "backward", "optimizer"}


def test_legend_hides_empty_categories(result: ProfileResult) -> None:
    """An MLP trained with AdamW holds weights, gradients, optimizer states, activations and
    temporaries, but never a KV cache: kv_cache is not in the legend."""
    page = render_html(result, title=HOSTILE)
    legend = re.search(r'<div id="legend">(.*?)</div>', page, re.S)
    assert legend is not None
    listed = re.findall(r'data-category="([^"]+)"', legend.group(1))
    assert "kv_cache" not in listed
    assert {"weights", "gradients", "optimizer_states", "activations"} <= set(listed)
    expected = [c.value for i, c in enumerate(TRACKED)
                if any(p.bytes[i] for p in result.timeline)]
    assert listed == expected == _data(page)["shown"]
    phases = re.findall(r'data-phase="([^"]+)"', legend.group(1))
    assert phases == ["forward", "backward", "optimizer"]
    assert HOSTILE not in page


@pytest.mark.parametrize(("xs", "peak", "x"), [
    ([0, 1, 2, 3], 1, 1.5),         # one op per step: the middle of [1, 2)
    ([0, 4, 8, 12], 4, 6.0),        # downsampled: the step runs to the next kept point
    ([0, 1, 2], 2, 2.0),            # the last point is the plot's right edge
])
def test_peak_marker_x_is_the_middle_of_the_peak_step(xs, peak, x) -> None:
    assert peak_marker_x(xs, peak) == x


def test_png_marker_and_legend(result: ProfileResult, tmp_path, monkeypatch) -> None:
    """The drawn figure: the peak line at the middle of the peak point's step (the run has
    under 4000 points, so none are dropped and the step is [peak, peak + 1)), and the legend
    lists no empty category."""
    pytest.importorskip("matplotlib", reason="the PNG export needs memfit[report]")
    from matplotlib.figure import Figure

    seen: dict[str, object] = {}
    original = Figure.savefig

    def spy(self: Figure, *args: object, **kwargs: object) -> None:
        ax = self.axes[0]
        seen["legend"] = [t.get_text() for t in ax.get_legend().get_texts()]
        seen["peak_x"] = [line.get_xdata()[0] for line in ax.get_lines()
                          if line.get_color() == "#c0392b"]
        original(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", spy)
    write_png(tmp_path / "t.png", result)
    assert seen["peak_x"] == [result.peak_index + 0.5]
    assert "kv_cache" not in seen["legend"]  # type: ignore[operator]
    assert {"weights", "optimizer_states", "forward", "backward", "optimizer"} <= set(
        seen["legend"])  # type: ignore[arg-type]


@pytest.mark.parametrize("peak_at", [2, 37])
def test_png_legend_leaves_the_peak_label_readable(peak_at: int, tmp_path, monkeypatch) -> None:
    """The legend sat in the plot's upper left, over the "peak" label when the peak came early;
    it is outside the plot now, and the label stays inside the figure, on either side: their
    drawn boxes (matplotlib's window extents) do not meet."""
    pytest.importorskip("matplotlib", reason="the PNG export needs memfit[report]")
    from matplotlib.figure import Figure

    phases = ["forward"] * 15 + ["backward"] * 15 + ["optimizer"] * 10
    mib = 2**20
    points = [_point(i, phase, weights=64 * mib, acts=(96 if i == peak_at else 32) * mib)
              for i, phase in enumerate(phases)]
    result = ProfileResult(
        device="cpu", peak_bytes=160 * mib, peak_reserved_bytes=None, breakdown={},
        tracked_peak_bytes=160 * mib, baseline_bytes=64 * mib, peak_index=peak_at,
        peak_op="aten.x", peak_phase=phases[peak_at], peak_module="", num_ops=len(points),
        timeline=points, modules=[], top_tensors=[])
    boxes: dict[str, object] = {}
    original = Figure.savefig

    def spy(self: Figure, *args: object, **kwargs: object) -> None:
        renderer = self.canvas.get_renderer()
        ax = self.axes[0]
        label, = (t for t in ax.texts if t.get_text().startswith("peak "))
        boxes.update(legend=ax.get_legend().get_window_extent(renderer),
                     label=label.get_window_extent(renderer), figure=self.bbox)
        original(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", spy)
    write_png(tmp_path / "t.png", result)
    legend, label, figure = boxes["legend"], boxes["label"], boxes["figure"]
    assert not legend.overlaps(label), (legend, label)  # type: ignore[attr-defined]
    assert figure.x0 <= label.x0 and label.x1 <= figure.x1, (label, figure)  # type: ignore
