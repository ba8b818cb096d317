"""The README's Python API example runs as written (with a small model for MyModel)."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

README = Path(__file__).resolve().parents[1] / "README.md"


class MyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3, stride=4), nn.BatchNorm2d(8), nn.ReLU(),
                                 nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def test_python_api_example_runs() -> None:
    text = README.read_text()
    section = text[text.index("## Python API"):]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None
    namespace: dict[str, object] = {"MyModel": MyModel}
    exec(compile(code.group(1), "README.md", "exec"), namespace)  # our own README, not user input
    est = namespace["est"]
    p = namespace["p"]
    assert est.peak_bytes > 0 and est.peak_reserved_bytes >= est.peak_bytes  # type: ignore[attr-defined]
    assert p.total_bytes > 0  # type: ignore[attr-defined]
