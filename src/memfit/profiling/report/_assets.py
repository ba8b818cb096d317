# ruff: noqa: E501  (inline JavaScript, not Python)
"""The report's inline stylesheet and script (no CDN: the file must open offline).

The script reads the JSON in ``<script id="memfit-data" type="application/json">`` and draws the
stacked timeline as SVG. Every string from the data is inserted with ``textContent`` (never
``innerHTML``), so module names and file paths cannot inject markup.
"""

CATEGORY_COLORS = {
    "weights": "#4e79a7",
    "gradients": "#f28e2b",
    "optimizer_states": "#e15759",
    "activations": "#76b7b2",
    "kv_cache": "#59a14f",
    "temporaries": "#edc948",
    "runtime": "#b07aa1",
}

PHASE_COLORS = {
    "forward": "#a9b4c2",
    "backward": "#6b778a",
    "optimizer": "#2f3a4a",
}
"""The bands that mark the phases of the step on the timeline's x-axis (greys: the hues are
the categories')."""

CSS = """
:root { --fg: #1d2430; --muted: #5b6576; --line: #d9dee7; --bg: #ffffff; --card: #f5f7fa; }
* { box-sizing: border-box; }
body { margin: 0; padding: 24px 32px; font: 14px/1.45 system-ui, -apple-system, "Segoe UI",
       Roboto, sans-serif; color: var(--fg); background: var(--bg); }
h1 { font-size: 20px; margin: 0 0 4px; }
h2 { font-size: 16px; margin: 28px 0 8px; }
.sub { color: var(--muted); margin-bottom: 16px; }
.cards { display: flex; flex-wrap: wrap; gap: 12px; }
.card { background: var(--card); border: 1px solid var(--line); border-radius: 8px;
        padding: 10px 14px; min-width: 150px; }
.card .k { color: var(--muted); font-size: 12px; }
.card .v { font-size: 18px; font-weight: 600; }
table { border-collapse: collapse; min-width: 480px; }
th, td { border-bottom: 1px solid var(--line); padding: 4px 10px; text-align: left; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
.swatch { display: inline-block; width: 10px; height: 10px; border-radius: 2px;
          margin-right: 6px; vertical-align: baseline; }
#chart { position: relative; max-width: 1200px; }
#timeline { width: 100%; height: 352px; display: block; }
#timeline .axis { stroke: #8a93a3; stroke-width: 1; }
#timeline .grid { stroke: #eceff4; stroke-width: 1; }
#timeline text { font-size: 11px; fill: var(--muted); }
#timeline .peak-line { stroke: #c0392b; stroke-width: 1.5; stroke-dasharray: 4 3; }
#timeline .peak-label { fill: #c0392b; font-weight: 600; font-size: 12px; }
#timeline .reserved { fill: none; stroke: #34495e; stroke-width: 1.5; stroke-dasharray: 6 3; }
#timeline .allocated { fill: none; stroke: #111; stroke-width: 1; }
#timeline .predicted { stroke: #8e44ad; stroke-width: 1.5; stroke-dasharray: 2 3; }
#timeline .mark { stroke: #7f8c8d; stroke-width: 1; stroke-dasharray: 1 3; }
#timeline .phase-band { stroke: #fff; stroke-width: 0.5; }
#timeline .phase-label { font-size: 10px; fill: #2f3a4a; }
#legend { margin: 6px 0 0; color: var(--muted); }
#legend span.item { margin-right: 14px; white-space: nowrap; }
#tip { position: absolute; pointer-events: none; background: rgba(29,36,48,.92); color: #fff;
       padding: 6px 8px; border-radius: 6px; font-size: 12px; display: none; white-space: pre; }
details pre { margin: 4px 0 0; font-size: 12px; color: var(--muted); white-space: pre-wrap; }
.note { color: var(--muted); font-size: 12px; }
.over { color: #c0392b; } .under { color: #27ae60; }
"""

JS = r"""
(function () {
  "use strict";
  var NS = "http://www.w3.org/2000/svg";
  function el(name, attrs, parent) {
    var e = document.createElementNS(NS, name);
    for (var k in attrs) { e.setAttribute(k, String(attrs[k])); }
    if (parent) { parent.appendChild(e); }
    return e;
  }
  function fmt(n) {
    var units = ["B", "KiB", "MiB", "GiB", "TiB"], v = Math.abs(n), i = 0;
    while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
    return (n < 0 ? "-" : "") + (i === 0 ? v.toFixed(0) : v.toFixed(2)) + " " + units[i];
  }
  var data = JSON.parse(document.getElementById("memfit-data").textContent);
  var svg = document.getElementById("timeline");
  var W = 1160, H = 352, L = 78, R = 16, T = 22, B = 46;
  svg.setAttribute("viewBox", "0 0 " + W + " " + H);
  var pts = data.points, cats = data.categories, colors = data.colors;
  var n = pts.length;
  var maxY = 1;
  pts.forEach(function (p) {
    var s = 0; p.bytes.forEach(function (b) { s += b; });
    maxY = Math.max(maxY, s, p.reserved || 0, p.allocated || 0);
  });
  if (data.predicted_peak) { maxY = Math.max(maxY, data.predicted_peak); }
  maxY *= 1.08;
  var lastI = n ? pts[n - 1].i : 1, firstI = n ? pts[0].i : 0;
  function x(i) { return L + (W - L - R) * (lastI === firstI ? 0.5 : (i - firstI) / (lastI - firstI)); }
  function y(b) { return H - B - (H - T - B) * (b / maxY); }
  var grid = el("g", {}, svg);
  for (var k = 0; k <= 4; k++) {
    var v = maxY * k / 4, yy = y(v);
    el("line", {x1: L, x2: W - R, y1: yy, y2: yy, "class": "grid"}, grid);
    var t = el("text", {x: L - 6, y: yy + 4, "text-anchor": "end"}, grid);
    t.textContent = fmt(v);
  }
  el("line", {x1: L, x2: L, y1: T, y2: H - B, "class": "axis"}, svg);
  el("line", {x1: L, x2: W - R, y1: H - B, y2: H - B, "class": "axis"}, svg);
  var xl = el("text", {x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle"}, svg);
  xl.textContent = "op index (" + data.num_ops + " ops" + (data.downsampled ? ", downsampled" : "") + ")";
  [firstI, lastI].forEach(function (i, j) {
    var tx = el("text", {x: x(i), y: H - B + 30, "text-anchor": j ? "end" : "start"}, svg);
    tx.textContent = String(i);
  });
  // The phases of the step (forward, backward, optimizer) as bands under the x-axis, named
  // where a band is wide enough for its name.
  var phases = el("g", {id: "phases"}, svg);
  data.phases.forEach(function (s) {
    var x0 = x(s.start), x1 = x(s.end);
    var band = el("rect", {x: x0, y: H - B + 2, width: Math.max(x1 - x0, 0.5), height: 6,
                           fill: data.phase_colors[s.phase], "class": "phase-band",
                           "data-phase": s.phase}, phases);
    var bt = el("title", {}, band); bt.textContent = s.phase + ": ops " + s.start + "-" + s.end;
    var name = x1 - x0 >= 7 * s.phase.length ? s.phase : x1 - x0 >= 24 ? s.phase.slice(0, 3) : "";
    if (name) {
      var pl = el("text", {x: (x0 + x1) / 2, y: H - B + 19, "text-anchor": "middle",
                           "class": "phase-label"}, phases);
      pl.textContent = name;
    }
  });
  var areas = el("g", {id: "areas"}, svg);
  if (n) {
    var lower = pts.map(function () { return 0; });
    cats.forEach(function (c, ci) {
      if (data.shown.indexOf(c) < 0) { return; }  // holds no bytes in the run: not drawn
      var upper = pts.map(function (p, j) { return lower[j] + p.bytes[ci]; });
      var d = "M" + x(pts[0].i) + "," + y(lower[0]);
      for (var j = 0; j < n; j++) { d += "L" + x(pts[j].i).toFixed(2) + "," + y(upper[j]).toFixed(2); }
      for (var j2 = n - 1; j2 >= 0; j2--) { d += "L" + x(pts[j2].i).toFixed(2) + "," + y(lower[j2]).toFixed(2); }
      d += "Z";
      var path = el("path", {d: d, fill: colors[c], "fill-opacity": 0.85, "class": "area",
                             "data-category": c}, areas);
      var title = el("title", {}, path); title.textContent = c;
      lower = upper;
    });
    ["allocated", "reserved"].forEach(function (key) {
      if (pts[0][key] === undefined) { return; }
      var d = "";
      pts.forEach(function (p, j) { d += (j ? "L" : "M") + x(p.i).toFixed(2) + "," + y(p[key]).toFixed(2); });
      el("path", {d: d, "class": key}, svg);
    });
  }
  if (data.predicted_peak) {
    var py = y(data.predicted_peak);
    el("line", {x1: L, x2: W - R, y1: py, y2: py, "class": "predicted"}, svg);
    var pt = el("text", {x: W - R - 4, y: py - 4, "text-anchor": "end", fill: "#8e44ad"}, svg);
    pt.textContent = "predicted peak " + fmt(data.predicted_peak);
  }
  data.marks.forEach(function (m) {
    var mx = x(m.index);
    el("line", {x1: mx, x2: mx, y1: T, y2: H - B, "class": "mark"}, svg);
    var mt = el("text", {x: mx + 3, y: H - B - 4}, svg); mt.textContent = m.label;
  });
  var peakX = data.peak_index >= 0 ? x(data.peak_index) : L;
  el("line", {x1: peakX, x2: peakX, y1: T - 6, y2: H - B, "class": "peak-line", id: "peak-line"}, svg);
  var right = peakX > (L + W - R) / 2;
  var lab = el("text", {x: peakX + (right ? -6 : 6), y: T + 6, "text-anchor": right ? "end" : "start",
                        "class": "peak-label", id: "peak-label"}, svg);
  lab.textContent = "peak " + data.peak_label;
  var tip = document.getElementById("tip"), chart = document.getElementById("chart");
  svg.addEventListener("mousemove", function (ev) {
    if (!n) { return; }
    var r = svg.getBoundingClientRect();
    var sx = (ev.clientX - r.left) * W / r.width;
    var lo = 0, hi = n - 1;
    while (lo < hi) { var mid = (lo + hi) >> 1; if (x(pts[mid].i) < sx) { lo = mid + 1; } else { hi = mid; } }
    var p = pts[lo], s = 0, lines = [];
    p.bytes.forEach(function (b, ci) { s += b; if (b) { lines.push(cats[ci] + ": " + fmt(b)); } });
    tip.textContent = "#" + p.i + " " + p.op + "\n" + p.phase + (p.module ? " in " + p.module : "") +
      "\ntotal " + fmt(s) + "\n" + lines.join("\n");
    tip.style.display = "block";
    tip.style.left = Math.min(ev.clientX - chart.getBoundingClientRect().left + 12, r.width - 220) + "px";
    tip.style.top = (ev.clientY - chart.getBoundingClientRect().top + 12) + "px";
  });
  svg.addEventListener("mouseleave", function () { tip.style.display = "none"; });
  document.body.setAttribute("data-rendered", "ok");
})();
"""
