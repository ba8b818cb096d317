"""The offline HTML report of a profiled run: one self-contained file, no network.

Tables are rendered here with every user string (module names, ops, file paths) passed through
``html.escape``; the chart is drawn by a small inline script from JSON embedded with ``<``, ``>``
and ``&`` written as ``\\u003c``/``\\u003e``/``\\u0026``, so no string in it can close the
``<script>`` element (stricter than escaping ``</`` as ``<\\/``).

>>> import memfit.profiling.report.html as h
>>> h.embed_json({"name": "</script><script>alert(1)</script>"})
'{"name": "\\\\u003c/script\\\\u003e\\\\u003cscript\\\\u003ealert(1)\\\\u003c/script\\\\u003e"}'
"""

from __future__ import annotations

import datetime as dt
import html
import json
import os
from typing import TYPE_CHECKING, Any

from memfit.categories import MemoryCategory
from memfit.ledger import CATEGORIES, TimelinePoint
from memfit.profiling.report._assets import CATEGORY_COLORS, CSS, JS, PHASE_COLORS
from memfit.profiling.result import TRACKED, ProfileResult, downsample
from memfit.units import format_bytes

if TYPE_CHECKING:
    from memfit.trace.estimate import Estimate

MAX_POINTS = 2000
"""Timeline points embedded in the report (the run is downsampled, keeping every local peak)."""


def embed_json(obj: Any) -> str:
    """JSON safe to place inside ``<script type="application/json">``."""
    text = json.dumps(obj, separators=(", ", ": "))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def phase_spans(points: list[TimelinePoint]) -> list[tuple[str, int, int]]:
    """``(phase, start, end)`` of each run of consecutive points in one phase of the training
    step (forward, backward, optimizer), over point indices: the run covers ``start <= i <
    end``, ``end`` being where the next run (or an ``other`` point: outside the step, no span
    of its own) starts; the last run ends at the last point."""
    spans: list[tuple[str, int, int]] = []
    current: tuple[str, int] | None = None  # the open run: (phase, start)
    for p in points:
        phase = p.phase if p.phase in PHASE_COLORS else None
        if current is not None and phase == current[0]:
            continue
        if current is not None:
            spans.append((current[0], current[1], p.index))
        current = (phase, p.index) if phase is not None else None
    if current is not None:
        spans.append((current[0], current[1], points[-1].index))
    return spans


def legend_categories(points: list[TimelinePoint]) -> list[MemoryCategory]:
    """The categories that hold bytes at some point of the run (the legend lists these only: an
    empty category is noise), predicted or measured (a measured run has no runtime column)."""
    return [c for i, c in enumerate(CATEGORIES)
            if any(i < len(p.bytes) and p.bytes[i] for p in points)]


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _module(name: str) -> str:
    return _e(name) if name else "<i>(model / no module)</i>"


def render_html(result: ProfileResult, *, estimate: Estimate | None = None,
                title: str = "memfit profile") -> str:
    """The report as a string (see :func:`write_html`)."""
    points = downsample(result.timeline, MAX_POINTS, keep=result.peak_index)
    shown = legend_categories(result.timeline)
    data = {
        "categories": [c.value for c in TRACKED],
        "shown": [c.value for c in shown],
        "phases": [{"phase": ph, "start": a, "end": b} for ph, a, b in
                   phase_spans(result.timeline)],
        "phase_colors": PHASE_COLORS,
        "colors": {c.value: CATEGORY_COLORS[c.value] for c in TRACKED},
        "points": [
            {"i": p.index, "op": p.op, "phase": p.phase, "module": p.module,
             "bytes": list(p.bytes),
             **({"allocated": p.allocated, "reserved": p.reserved}
                if p.allocated is not None else {})}
            for p in points],
        "num_ops": result.num_ops,
        "downsampled": len(points) < len(result.timeline),
        "peak_index": result.peak_index,
        "peak_label": format_bytes(result.peak_bytes),
        "predicted_peak": estimate.peak_bytes if estimate is not None else None,
        "marks": [{"index": i, "label": label} for i, label in result.marks],
    }
    parts = [
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">",
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">",
        f"<title>{_e(title)}</title><style>{CSS}</style></head><body>",
        f"<h1>{_e(title)}</h1>",
        f"<div class=\"sub\">device {_e(result.device)} · torch {_e(result.torch_version)} · "
        f"{result.num_ops} ops · {result.seconds:.2f} s · generated "
        f"{dt.datetime.now(dt.UTC).strftime('%Y-%m-%d %H:%M UTC')}</div>",
        _cards(result, estimate),
        "<h2>Timeline: live memory by category</h2>",
        "<div id=\"chart\"><svg id=\"timeline\" role=\"img\" aria-label=\"memory timeline\" "
        "xmlns=\"http://www.w3.org/2000/svg\"></svg><div id=\"tip\"></div></div>",
        _legend(result, shown),
        _breakdown(result, estimate),
        _modules(result),
        _tensors(result),
        _cuda(result),
        f"<script type=\"application/json\" id=\"memfit-data\">{embed_json(data)}</script>",
        "<script>window.addEventListener('error', function (e) { document.body.setAttribute("
        "'data-error', String(e.message)); });</script>",
        f"<script>{JS}</script>",
        "</body></html>\n",
    ]
    return "\n".join(parts)


def write_html(path: str | os.PathLike[str], result: ProfileResult, *,
               estimate: Estimate | None = None, title: str = "memfit profile") -> None:
    """Write the self-contained offline report of ``result`` to ``path``."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_html(result, estimate=estimate, title=title))


def _legend(result: ProfileResult, shown: list[MemoryCategory]) -> str:
    """The chart's key, in HTML (readable without the script): the categories that hold bytes,
    the phases marked on the x-axis, and what the lines are."""
    items = [f"<span class=\"item\" data-category=\"{_e(c.value)}\"><span class=\"swatch\" "
             f"style=\"background:{CATEGORY_COLORS[c.value]}\"></span>{_e(c.value)}</span>"
             for c in shown]
    phases = {p.phase for p in result.timeline}
    items += [f"<span class=\"item\" data-phase=\"{_e(ph)}\"><span class=\"swatch phase\" "
              f"style=\"background:{color}\"></span>{_e(ph)} (x-axis)</span>"
              for ph, color in PHASE_COLORS.items() if ph in phases]
    cuda = any(p.reserved is not None for p in result.timeline[:1])
    note = ("solid line: allocated, dashed: reserved (CUDA caching allocator)" if cuda
            else "(CPU: no caching allocator, reserved = allocated)")
    items.append(f"<span class=\"item\">{_e(note)}</span>")
    return f"<div id=\"legend\">{''.join(items)}</div>"


def _cards(result: ProfileResult, estimate: Estimate | None) -> str:
    where = f"{result.peak_op} ({result.peak_phase}"
    where += f", {result.peak_module})" if result.peak_module else ")"
    cards = [("peak allocated", format_bytes(result.peak_bytes)),
             ("peak reserved", format_bytes(result.peak_reserved_bytes)
              if result.peak_reserved_bytes is not None else "n/a on CPU"),
             ("alive at start", format_bytes(result.baseline_bytes)),
             ("peak at", where)]
    if result.inside_kernels_bytes is not None:
        cards.append(("inside kernels", format_bytes(result.inside_kernels_bytes)))
    if estimate is not None:
        cards.append(("predicted peak", format_bytes(estimate.peak_bytes)))
    body = "".join(f"<div class=\"card\"><div class=\"k\">{_e(k)}</div>"
                   f"<div class=\"v\" id=\"card-{_e(k.replace(' ', '-'))}\">{_e(v)}</div></div>"
                   for k, v in cards)
    return f"<div class=\"cards\">{body}</div>"


def _breakdown(result: ProfileResult, estimate: Estimate | None) -> str:
    head = "<tr><th>category</th><th class=\"num\">measured</th><th class=\"num\">share</th>"
    if estimate is not None:
        head += "<th class=\"num\">predicted</th><th class=\"num\">predicted − measured</th>"
    rows = [head + "</tr>"]
    inside = result.inside_kernels_bytes
    total = max(1, sum(result.breakdown.values()) + (inside or 0))
    for cat in MemoryCategory:
        measured = result.breakdown.get(cat, 0)
        predicted = estimate.breakdown.get(cat, 0) if estimate is not None else 0
        if not measured and not predicted:
            continue
        color = CATEGORY_COLORS[cat.value]
        row = (f"<tr><td><span class=\"swatch\" style=\"background:{color}\"></span>"
               f"{_e(cat.value)}</td><td class=\"num\">{_e(format_bytes(measured))}</td>"
               f"<td class=\"num\">{100 * measured / total:.1f}%</td>")
        if estimate is not None:
            row += _predicted_cells(predicted, measured)
        rows.append(row + "</tr>")
    if inside is not None:
        # Note: [inside kernels] in memfit.profiling.recorder: allocator bytes no tensor owned.
        row = (f"<tr id=\"inside-kernels\"><td><span class=\"swatch\"></span>inside kernels"
               f"</td><td class=\"num\">{_e(format_bytes(inside))}</td>"
               f"<td class=\"num\">{100 * inside / total:.1f}%</td>")
        if estimate is not None:
            row += "<td></td><td></td>"
        rows.append(row + "</tr>")
    # The prediction is compared with the allocator's peak (with allocator events, the CPU
    # default, or on CUDA), not with the tensors the ledger saw.
    label = "peak allocated" if inside is not None else "tracked peak"
    row = (f"<tr id=\"peak-row\"><th>{label}</th><th class=\"num\">"
           f"{_e(format_bytes(result.peak_bytes))}</th><th></th>")
    if estimate is not None:
        row += _predicted_cells(estimate.peak_bytes, result.peak_bytes, tag="th")
    rows.append(row + "</tr>")
    if result.peak_reserved_bytes is not None:
        row = (f"<tr><th>peak reserved</th><th class=\"num\">"
               f"{_e(format_bytes(result.peak_reserved_bytes))}</th><th></th>")
        if estimate is not None:
            row += _predicted_cells(estimate.peak_reserved_bytes, result.peak_reserved_bytes,
                                    tag="th")
        rows.append(row + "</tr>")
    note = ("<p class=\"note\">Bytes of tensor storages alive at the allocator's peak, by "
            "what they turned out to be; <i>inside kernels</i> is what the allocator held "
            "beyond them (scratch a kernel allocates and frees, e.g. oneDNN's, or on CUDA "
            "library workspaces).</p>")
    title = "At the peak: predicted vs measured" if estimate is not None else "At the peak"
    return f"<h2>{title}</h2><table id=\"breakdown\">{''.join(rows)}</table>{note}"


def _predicted_cells(predicted: int, measured: int, *, tag: str = "td") -> str:
    diff = predicted - measured
    pct = f" ({100 * diff / measured:+.1f}%)" if measured else ""
    cls = "over" if diff > 0 else "under" if diff < 0 else ""
    return (f"<{tag} class=\"num\">{_e(format_bytes(predicted))}</{tag}>"
            f"<{tag} class=\"num {cls}\">{_e(format_bytes(diff))}{pct}</{tag}>")


def _modules(result: ProfileResult) -> str:
    if not result.modules:
        return ""
    cats = [c for c in TRACKED if any(m.at_peak.get(c) for m in result.modules)]
    head = "<tr><th>module</th><th class=\"num\">at peak</th>" + "".join(
        f"<th class=\"num\">{_e(c.value)}</th>" for c in cats) + "</tr>"
    rows = [head]
    for m in result.modules[:30]:
        rows.append(f"<tr><td>{_module(m.name)}</td><td class=\"num\">"
                    f"{_e(format_bytes(m.total))}</td>" + "".join(
                        f"<td class=\"num\">{_e(format_bytes(m.at_peak.get(c, 0)))}</td>"
                        for c in cats) + "</tr>")
    more = (f"<p class=\"note\">{len(result.modules) - 30} more modules not shown.</p>"
            if len(result.modules) > 30 else "")
    return (f"<h2>Modules at the peak</h2><table id=\"modules\">{''.join(rows)}</table>{more}"
            "<p class=\"note\">What each module created that is alive at the peak, plus the "
            "weights, gradients and optimizer states of its own parameters.</p>")


def _tensors(result: ProfileResult) -> str:
    if not result.top_tensors:
        return ""
    rows = ["<tr><th class=\"num\">bytes</th><th>category</th><th>shape</th><th>dtype</th>"
            "<th>module</th><th>created by</th></tr>"]
    for t in result.top_tensors:
        created = f"{_e(t.op)} ({_e(t.phase)})"
        if t.stack:
            frames = "\n".join(f"{f}:{line} in {fn}" for f, line, fn in t.stack)
            created += f"<details><summary>stack</summary><pre>{_e(frames)}</pre></details>"
        rows.append(f"<tr><td class=\"num\">{_e(format_bytes(t.nbytes))}</td>"
                    f"<td>{_e(t.category.value)}</td><td>{_e(list(t.shape))}</td>"
                    f"<td>{_e(t.dtype)}</td><td>{_module(t.module)}</td><td>{created}</td></tr>")
    note = "" if result.stacks else ("<p class=\"note\">Profile with <code>stacks=True</code> "
                                     "(<code>--stacks</code>) to see where each was allocated."
                                     "</p>")
    return (f"<h2>Largest tensors at the peak</h2><table id=\"tensors\">{''.join(rows)}"
            f"</table>{note}")


def _cuda(result: ProfileResult) -> str:
    if not result.cuda:
        return ""
    c = result.cuda
    rows = [("GPU", c.get("device_name", "")),
            ("total memory", format_bytes(c.get("total_bytes"))),
            ("allocated at end", format_bytes(c.get("allocated_bytes"))),
            ("reserved at end", format_bytes(c.get("reserved_bytes"))),
            ("inactive split blocks (fragmentation)",
             f"{format_bytes(c.get('inactive_split_bytes'))} "
             f"({100 * float(c.get('fragmentation', 0.0)):.1f}% of reserved)"),
            ("allocator retries (cudaFree + retry)", c.get("num_alloc_retries", 0)),
            ("out-of-memory errors", c.get("num_ooms", 0))]
    body = "".join(f"<tr><td>{_e(k)}</td><td class=\"num\">{_e(v)}</td></tr>" for k, v in rows)
    return f"<h2>CUDA caching allocator</h2><table id=\"cuda\">{body}</table>"
