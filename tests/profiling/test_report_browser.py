"""Open the HTML report in a real headless Chromium: it renders, without errors, offline.

Needs the Debian package ``chromium`` (``apt-get install -y chromium``); skipped without it.
Set ``MEMFIT_SCREENSHOT=docs/report.png`` to also save the screenshot there (the README's).
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn

from _models import ReluBlock
from memfit.profiling.result import ProfileResult
from memfit.profiling.session import profile
from memfit.units import format_bytes

CHROMIUM = "/usr/bin/chromium"
HOSTILE = "<script>alert(1)</script>"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--enable-logging=stderr", "--v=0"]

pytestmark = pytest.mark.skipif(
    not os.path.exists(CHROMIUM),
    reason="headless browser test needs /usr/bin/chromium (apt-get install -y chromium)")


def _model(d: int = 128) -> nn.Sequential:
    model = nn.Sequential()
    model.add_module(HOSTILE, nn.Linear(d, d))  # a module name that must stay text
    model.add_module("blocks", nn.Sequential(ReluBlock(d), ReluBlock(d), ReluBlock(d)))
    model.add_module("head", nn.Linear(d, 32))
    return model


def _run() -> tuple[ProfileResult, object]:
    import memfit

    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(256, 128)
    with profile(device="cpu", stacks=True, baseline=(model, opt, x)) as prof:
        for step in range(3):
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            prof.mark(f"step {step}: forward done")
            loss.backward()
            opt.step()
    with torch.device("meta"):
        meta = _model()
    est = memfit.estimate(meta, torch.empty(256, 128, device="meta"), optimizer="adamw",
                          device="cpu", loss_fn=lambda m, b: m(b).pow(2).mean(), steps=3)
    assert prof.result is not None
    return prof.result, est


def _chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", *args],
                          capture_output=True, text=True, timeout=120, check=False)


def test_report_renders_in_headless_chromium(tmp_path: Path) -> None:
    result, est = _run()
    page = tmp_path / "report.html"
    from memfit.profiling.report.html import write_html

    write_html(page, result, estimate=est, title="memfit profile: 3-block MLP, AdamW, CPU")  # type: ignore[arg-type]
    url = page.as_uri()

    dom = _chromium(tmp_path, "--dump-dom", url)
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    # The script ran to the end and nothing threw.
    assert re.search(r'<body[^>]*data-rendered="ok"', html), html[:2000]
    assert not re.search(r"<body[^>]*data-error", html)
    console = [line for line in dom.stderr.splitlines() if "CONSOLE" in line]
    assert not [c for c in console if "Uncaught" in c or "Error" in c], console
    # The chart was drawn: one stacked area per category that holds bytes (an MLP has no KV
    # cache: none drawn), the peak line and its value.
    from memfit.profiling.report.html import legend_categories

    areas = re.findall(r'<path [^>]*data-category="([^"]+)"', html)
    assert areas == [c.value for c in legend_categories(result.timeline)]
    assert "kv_cache" not in areas
    # The step's phases are bands on the x-axis: three steps, each forward, backward, optimizer.
    bands = re.findall(r'<rect [^>]*data-phase="([^"]+)"', html)
    assert [b for k, b in enumerate(bands) if k == 0 or bands[k - 1] != b] == [
        "forward", "backward", "optimizer"] * 3
    assert 'id="peak-line"' in html
    label = re.search(r'id="peak-label"[^>]*>([^<]*)<', html)
    assert label is not None and label.group(1) == f"peak {format_bytes(result.peak_bytes)}"
    assert "predicted peak" in html
    # The hostile module name is text, never an element.
    assert HOSTILE not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html

    shot = tmp_path / "report.png"
    run = _chromium(tmp_path, f"--screenshot={shot}", "--window-size=1280,900", url)
    assert run.returncode == 0, run.stderr[-2000:]
    head = shot.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", head[16:24]) == (1280, 900)
    target = os.environ.get("MEMFIT_SCREENSHOT")
    if target:
        shutil.copyfile(shot, target)


def test_cuda_report_draws_allocated_and_reserved(tmp_path: Path) -> None:
    from memfit.profiling.report.html import write_html
    from test_report import cuda_like_result

    page = tmp_path / "cuda.html"
    write_html(page, cuda_like_result())
    dom = _chromium(tmp_path, "--dump-dom", page.as_uri())
    assert re.search(r'<body[^>]*data-rendered="ok"', dom.stdout)
    assert re.search(r'<path [^>]*class="allocated"', dom.stdout)
    assert re.search(r'<path [^>]*class="reserved"', dom.stdout)
