"""The README runs as written: its Python API example (with a small model for MyModel) and every
`memfit plan` output it and the pages in docs/ quote, checked against the tool in-process."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# the README and the pages in docs/: sentences that quote a `memfit plan` run live in both
QUOTING = [README, *sorted((ROOT / "docs").glob("*.md"))]


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


def memfit(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
           command: str) -> str:
    """``command`` (``memfit plan ...``, as the README writes it) run in-process at 100 columns,
    stdout captured (not a terminal); its stdout."""
    from memfit.cli import main

    argv = shlex.split(command)
    assert argv[:2] == ["memfit", "plan"], command
    # the analytic plan only: several GPUs are traced unless --method analytic says otherwise
    assert "--method" not in argv or "analytic" in argv, command
    monkeypatch.setenv("COLUMNS", "100")
    capsys.readouterr()
    code = main(argv[1:])
    out, err = capsys.readouterr()
    assert code == 0, (command, err)
    return out


def lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.strip().splitlines()]


def words(text: str) -> str:
    """Whitespace collapsed: the README wraps its prose, the tool does not."""
    return " ".join(text.split())


def test_the_first_commands_output_is_what_the_readme_shows(capsys, monkeypatch) -> None:
    """"A real output" is the main command's real output (row by row, trailing spaces aside), so
    a change to the planner cannot leave the README's numbers behind."""
    text = README.read_text()
    command = re.search(r"&& (memfit plan [^\n]+)\n```", text)
    assert command is not None
    section = text[text.index("### A real output"):]
    shown = re.search(r"```\n(.*?)```", section, re.S)
    assert shown is not None
    assert lines(memfit(capsys, monkeypatch, command.group(1))) == lines(shown.group(1))


def test_the_one_change_example_is_what_the_tool_prints(capsys, monkeypatch) -> None:
    """The "what would save memory" example: its command, its total and the block it quotes,
    which is the end of the output (the single changes, then the line on more GPUs)."""
    text = README.read_text()
    found = re.search(r"For example, `(memfit plan [^`]+)` \([^)]*\) gives ([\d.]+ [KMGT]iB) "
                      r"and\s+ends with:\n+```\n(.*?)```", text, re.S)
    assert found is not None
    out = memfit(capsys, monkeypatch, words(found.group(1)))
    assert f"│ total                 │ {found.group(2):>12} │" in out
    shown = lines(found.group(3))
    assert len(shown) > 5 and lines(out)[-len(shown):] == shown


_QUOTES = re.compile(r"`(memfit\s+plan\s[^`]+)` (prints|gives|counts) "
                     r"(?:\"([^\"]+)\"|([\d.]+ [KMGT]iB)(?: of (\w+))?)", re.S)


def quoted_examples() -> list[tuple[str, str, str, str | None]]:
    """Every sentence of the README or docs/ that quotes an analytic ``memfit plan`` run:
    `command` prints "a line", `command` gives <total>, `command` counts <bytes> of <category>."""
    out = []
    for m in _QUOTES.finditer("\n\n".join(page.read_text() for page in QUOTING)):
        command, verb = words(m.group(1)), m.group(2)
        if verb == "prints":
            out.append((command, verb, words(m.group(3)), None))
        elif m.group(4):
            out.append((command, verb, m.group(4), m.group(5)))
    return out


def test_the_readme_quotes_analytic_runs() -> None:
    """The extraction below finds the quotes (a pattern that matches nothing checks nothing):
    the scale-out line, the FSDP2 total against torchtitan and the GPT-2 activations."""
    found = quoted_examples()
    assert {verb for _, verb, _, _ in found} == {"prints", "gives", "counts"}
    assert any(q.startswith("this needs ") for _, verb, q, _ in found if verb == "prints")


@pytest.mark.parametrize(("command", "verb", "quote", "category"), quoted_examples())
def test_each_quoted_run_prints_what_the_readme_says(capsys, monkeypatch, command: str,
                                                     verb: str, quote: str,
                                                     category: str | None) -> None:
    out = memfit(capsys, monkeypatch, command)
    if verb == "prints":
        assert quote in words(out)
    else:
        row = "total" if verb == "gives" else category
        assert re.search(rf"│ (\[bold\])?{row}\b.*?│ +{re.escape(quote)} │", out), (row, quote)


def test_the_serving_example_is_what_serve_plan_prints(capsys, monkeypatch) -> None:
    """The README's serve-plan example: each line it shows is a line of the real output, in
    order ("..." stands for the lines left out)."""
    from memfit.cli import main

    text = README.read_text()
    section = text[text.index("### Serving: before you rent the GPU"):]
    shown = re.search(r"```\n\$ (memfit serve-plan [^\n]+)\n(.*?)```", section, re.S)
    assert shown is not None
    monkeypatch.setenv("COLUMNS", "100")
    capsys.readouterr()
    assert main(shlex.split(shown.group(1))[1:]) == 0
    out = lines(capsys.readouterr().out)
    expected = [line for line in lines(shown.group(2)) if line != "..."]
    assert len(expected) > 8
    at = 0
    for line in expected:
        assert line in out[at:], line
        at = out.index(line, at) + 1
