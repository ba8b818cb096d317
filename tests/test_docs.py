"""The pages in docs/ stay true and whole: their Python examples run, every page is in the
mkdocs.yml navigation, and every relative link (README's and the pages') reaches a file.

A ```python block runs unless the line above it is ``<!-- no-test: REASON -->``, and a block
may be skipped only when it needs a GPU or a file of the user's (the reason says which). The
runnable blocks of a page run in order in one namespace, as a reader would paste them, inside
an empty working directory (examples may write files such as ``report.html``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))

_FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_NO_TEST = re.compile(r"<!--\s*no-test:\s*(.*?)\s*-->\s*$")


def python_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """(line, code, reason to skip or None) for every ```python block of a page."""
    blocks = []
    for m in _FENCE.finditer(text):
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = _NO_TEST.match(before.strip())
        line = text.count("\n", 0, m.start()) + 1
        blocks.append((line, m.group(1), marker.group(1) if marker else None))
    return blocks


def test_the_block_extraction_finds_blocks_and_markers() -> None:
    """A pattern that matches nothing checks nothing: the docs have runnable examples, skipped
    ones say why, and the parser tells a marked block from an unmarked one."""
    sample = ("x\n\n```python\na = 1\n```\n\n"
              "<!-- no-test: needs a GPU -->\n```python\nb = 2\n```\n")
    assert python_blocks(sample) == [(3, "a = 1\n", None), (8, "b = 2\n", "needs a GPU")]
    found = [(page.name, *block) for page in PAGES for block in python_blocks(page.read_text())]
    runnable = [b for b in found if b[3] is None]
    assert len(runnable) >= 4, found
    for name, line, _, reason in found:
        if reason is not None:
            assert re.search(r"\bGPU\b|your (model|data|file)", reason), (name, line, reason)


def test_no_stray_markers() -> None:
    """A ``no-test`` marker always sits right above a ```python block (a marker that skips
    nothing would read as if it did)."""
    for page in PAGES:
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.lstrip().startswith("<!--") and "no-test" in line:
                assert _NO_TEST.match(line.strip()), (page.name, i + 1,
                                                      "write <!-- no-test: why -->")
                assert i + 1 < len(lines) and lines[i + 1] == "```python", (page.name, i + 1)


@pytest.mark.parametrize("page", [p for p in PAGES
                                  if any(r is None for _, _, r in python_blocks(p.read_text()))],
                         ids=lambda p: p.name)
def test_the_examples_of_each_page_run(page: Path, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.setenv("MEMFIT_PROGRESS", "0")
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem}"}
    for line, code, reason in python_blocks(page.read_text()):
        if reason is None:
            # our own docs, not user input; the line number makes a traceback point at the page
            exec(compile("\n" * (line) + code, str(page), "exec"), namespace)


def _nav_files(node: object) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [f for item in node for f in _nav_files(item)]
    if isinstance(node, dict):
        return [f for value in node.values() for f in _nav_files(value)]
    return []


def test_every_page_is_in_the_navigation() -> None:
    yaml = pytest.importorskip("yaml", reason="pip install -e '.[docs]'")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert config["docs_dir"] == "docs"
    nav = _nav_files(config["nav"])
    assert len(nav) == len(set(nav)), nav
    assert sorted(nav) == sorted(p.name for p in PAGES)


_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def relative_links(text: str) -> list[str]:
    """The targets of the Markdown links of ``text`` that are relative paths, code spans and
    fenced blocks left out (a link there is not a link)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    text = re.sub(r"`[^`\n]*`", "", text)
    out = []
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        out.append(target.split("#", 1)[0])
    return out


@pytest.mark.parametrize("page", [ROOT / "README.md", *PAGES], ids=lambda p: p.name)
def test_every_relative_link_resolves(page: Path) -> None:
    links = relative_links(page.read_text())
    if page.name in ("README.md", "index.md"):
        assert len(links) >= 10  # the front door and the home page link to every page
    for target in links:
        path = (page.parent / target).resolve()
        assert path.exists(), (page.name, target)
        if page.parent == DOCS:  # MkDocs builds docs/ alone: a page cannot leave it
            assert DOCS in path.parents or path == DOCS, (page.name, target)


def test_relative_links_sees_links_and_skips_code() -> None:
    text = "[a](docs/x.md#y) `[b](no.md)` [c](https://e.org) [d](#here)\n```\n[e](no.md)\n```\n"
    assert relative_links(text) == ["docs/x.md"]


def test_the_install_page_has_the_readme_commands() -> None:
    """docs/install.md repeats the README's two commands; they must not drift apart."""
    readme = (ROOT / "README.md").read_text()
    install = (DOCS / "install.md").read_text()
    commands = [line for line in readme.splitlines() if line.startswith("python3 -m venv")]
    assert len(commands) == 2
    for command in commands:
        assert command in install.splitlines()
