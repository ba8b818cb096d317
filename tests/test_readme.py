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


def test_the_first_commands_output_is_what_the_readme_shows() -> None:
    """"A real output" is the main command's real output (row by row, trailing spaces aside), so
    a change to the planner cannot leave the README's numbers behind."""
    import os
    import subprocess
    import sys

    text = README.read_text()
    command = re.search(r"&& (memfit plan [^\n]+)\n```", text)
    assert command is not None
    section = text[text.index("### A real output"):]
    shown = re.search(r"```\n(.*?)```", section, re.S)
    assert shown is not None
    args = command.group(1).split()[1:]
    run = subprocess.run(
        [sys.executable, "-c", "import sys; from memfit.cli import main; sys.exit(main())", *args],
        capture_output=True, text=True, env={**os.environ, "COLUMNS": "100"}, check=True)
    printed = [line.rstrip() for line in run.stdout.strip().splitlines()]
    assert printed == [line.rstrip() for line in shown.group(1).strip().splitlines()]
