"""The HTML report and the PNG export: escaping, self-containment, predicted vs measured."""

from __future__ import annotations

import json
import re
import struct
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from memfit.categories import MemoryCategory
from memfit.errors import MemfitError
from memfit.profiling.report import embed_json, render_html, write_png
from memfit.profiling.result import ProfileResult
from memfit.profiling.session import profile
from memfit.units import format_bytes

HOSTILE = "<script>alert(1)</script>"


def _profiled() -> ProfileResult:
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("embed", nn.Linear(32, 64))
    model.add_module(HOSTILE, nn.Linear(64, 64))
    model.add_module("head", nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters())
    with profile(device="cpu", stacks=True, baseline=(model, opt)) as prof:
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(16, 32)).pow(2).mean().backward()
            opt.step()
        prof.mark(HOSTILE)
    assert prof.result is not None
    return prof.result


@pytest.fixture(scope="module")
def result() -> ProfileResult:
    return _profiled()


def _estimate() -> object:
    import memfit

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 8))
    return memfit.estimate(model, torch.empty(16, 32, device="meta"), optimizer="adamw",
                           device="cpu", loss_fn=lambda m, b: m(b).pow(2).mean())


def test_user_strings_are_escaped(result: ProfileResult) -> None:
    page = render_html(result, title=HOSTILE)
    assert HOSTILE not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page      # tables and title
    assert "\\u003cscript\\u003ealert(1)" in page                  # the embedded JSON
    # Exactly our own three <script> elements: the data, the error hook, the chart.
    assert len(re.findall(r"<script\b", page)) == 3
    assert page.count("</script>") == 3


def test_embed_json_cannot_close_the_script_element() -> None:
    text = embed_json({"m": "</script><!-- & -->"})
    assert "<" not in text and ">" not in text and "&" not in text
    assert json.loads(text) == {"m": "</script><!-- & -->"}


def test_report_is_self_contained(result: ProfileResult) -> None:
    page = render_html(result)
    urls = set(re.findall(r"https?://[^\s\"'<>)]+", page))
    assert urls <= {"http://www.w3.org/2000/svg"}   # the SVG namespace, never fetched
    assert not re.search(r"<(link|img|iframe)\b", page)
    assert not re.search(r"<script[^>]*\bsrc=", page)


def test_report_sections_and_numbers(result: ProfileResult) -> None:
    page = render_html(result)
    for section in ('id="timeline"', 'id="breakdown"', 'id="modules"', 'id="tensors"'):
        assert section in page
    assert format_bytes(result.peak_bytes) in page
    weights = (32 * 64 + 64 + 64 * 64 + 64 + 64 * 8 + 8) * 4
    assert result.breakdown[MemoryCategory.WEIGHTS] == weights
    assert format_bytes(weights) in page
    data = json.loads(re.search(r'id="memfit-data">(.*?)</script>', page, re.S).group(1))
    assert data["peak_index"] == result.peak_index
    assert len(data["points"]) == len(result.timeline)  # small run: not downsampled
    assert data["predicted_peak"] is None


def test_predicted_vs_measured(result: ProfileResult) -> None:
    est = _estimate()
    page = render_html(result, estimate=est)  # type: ignore[arg-type]
    assert "predicted vs measured" in page
    assert format_bytes(est.peak_bytes) in page  # type: ignore[attr-defined]
    table = re.search(r'<table id="breakdown">(.*?)</table>', page, re.S).group(1)
    weights_row = re.search(r"weights</td>(.*?)</tr>", table, re.S).group(1)
    # Same model, same dtype: predicted weights equal measured, difference 0 B.
    assert weights_row.count(format_bytes(result.breakdown[MemoryCategory.WEIGHTS])) == 2
    assert "0 B (+0.0%)" in weights_row
    doc = result.to_dict(estimate=est)  # type: ignore[arg-type]
    assert doc["predicted"]["peak_bytes"] == est.peak_bytes  # type: ignore[attr-defined]


def test_write_html_via_profiler(tmp_path: Path) -> None:
    lin = nn.Linear(8, 8)
    with profile(device="cpu") as prof:
        lin(torch.randn(2, 8)).sum().backward()
    path = tmp_path / "r.html"
    prof.report(path)
    assert path.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    prof.save_json(tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text())["device"] == "cpu"


def cuda_like_result() -> ProfileResult:
    """A hand-made CUDA-shaped result (this machine may have no GPU) to render its parts."""
    from memfit.profiling.result import TRACKED, MeasuredPoint

    points = [MeasuredPoint(i, "aten.mm.default", "forward", "layer", (512 * i, 0, 0, 0, 0, 512),
                            512 * i + 512, 2 * 2**20) for i in range(5)]
    breakdown = {c: 0 for c in MemoryCategory}
    breakdown[TRACKED[0]], breakdown[MemoryCategory.TEMPORARIES] = 2048, 512
    return ProfileResult(device="cuda", peak_bytes=4096, peak_reserved_bytes=2 * 2**20,
                         breakdown=breakdown, tracked_peak_bytes=2560, baseline_bytes=0,
                         peak_index=4, peak_op="aten.mm.default", peak_phase="forward",
                         peak_module="layer", num_ops=5, timeline=points, modules=[],
                         top_tensors=[],
                         cuda={"device_name": "Fake GPU", "total_bytes": 80 * 2**30,
                               "allocated_bytes": 0, "reserved_bytes": 2 * 2**20,
                               "inactive_split_bytes": 2**20, "fragmentation": 0.5,
                               "num_alloc_retries": 0, "num_ooms": 0})


def test_cuda_parts_render() -> None:
    page = render_html(cuda_like_result())
    assert 'id="cuda"' in page and "Fake GPU" in page
    assert "50.0% of reserved" in page                         # 1 MiB inactive of 2 MiB
    assert format_bytes(2 * 2**20) in page                     # peak reserved card and row
    data = json.loads(re.search(r'id="memfit-data">(.*?)</script>', page, re.S).group(1))
    assert data["points"][4]["reserved"] == 2 * 2**20


def test_png_export(result: ProfileResult, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the PNG export needs memfit[report]")
    path = tmp_path / "timeline.png"
    write_png(path, result, width=8, height=3, dpi=100)
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", head[16:24])
    assert (width, height) == (800, 300)


def test_png_without_matplotlib_says_how_to_install(result: ProfileResult, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    with pytest.raises(MemfitError, match=r"pip install 'memfit\[report\]'"):
        write_png(tmp_path / "x.png", result)


def test_inside_kernels_row_and_prediction_against_the_allocator_peak() -> None:
    """A hand-made CPU result whose allocator peak (10 KiB) is the ledger's 8 KiB plus 2 KiB of
    kernel scratch: the report shows the 2 KiB as its own row, the rows add up to the peak, and
    a prediction is compared with the allocator's peak, not the ledger's."""
    from types import SimpleNamespace

    from memfit.profiling.result import TRACKED, MeasuredPoint

    breakdown = {c: 0 for c in MemoryCategory}
    breakdown[MemoryCategory.WEIGHTS], breakdown[MemoryCategory.ACTIVATIONS] = 4096, 4096
    points = [MeasuredPoint(0, "aten.convolution.default", "forward", "conv",
                            (4096, 0, 0, 4096, 0, 0))]
    assert len(points[0].bytes) == len(TRACKED)
    r = ProfileResult(device="cpu", peak_bytes=10240, peak_reserved_bytes=None,
                      breakdown=breakdown, tracked_peak_bytes=8192, baseline_bytes=4096,
                      peak_index=0, peak_op="aten.convolution.default", peak_phase="forward",
                      peak_module="conv", num_ops=1, timeline=points, modules=[],
                      top_tensors=[], allocator_peak_bytes=10240, inside_kernels_bytes=2048)
    est = SimpleNamespace(peak_bytes=11264, peak_reserved_bytes=None, device="cpu",
                          breakdown={MemoryCategory.WEIGHTS: 4096,
                                     MemoryCategory.ACTIVATIONS: 4096,
                                     MemoryCategory.TEMPORARIES: 3072})
    page = render_html(r, estimate=est)  # type: ignore[arg-type]
    inside = re.search(r'<tr id="inside-kernels">(.*?)</tr>', page, re.S)
    assert inside is not None
    assert format_bytes(2048) in inside.group(1) and "20.0%" in inside.group(1)  # 2 of 10 KiB
    peak = re.search(r'<tr id="peak-row">(.*?)</tr>', page, re.S)
    assert peak is not None
    # predicted 11 KiB against the allocator's 10 KiB: +1 KiB, +10.0% (against the ledger's
    # 8 KiB it would read +37.5%).
    assert format_bytes(10240) in peak.group(1) and "+10.0%" in peak.group(1)
    assert 'id="card-inside-kernels">2.00 KiB<' in page
    doc = r.to_dict()
    assert doc["inside_kernels_bytes"] == 2048
    assert sum(doc["breakdown"].values()) + doc["inside_kernels_bytes"] == doc["peak_bytes"]
