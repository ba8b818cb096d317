"""Every install hint in memfit's source names a real extra or dependency (issue 12: ``fit``
told users to ``pip install 'memfit[8bit]'``, an extra that does not exist)."""

from __future__ import annotations

import ast
import io
import re
import tokenize
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "memfit"

_EXTRA = re.compile(r"memfit\[([^\]]*)\]")
_PIP = re.compile(r"pip install((?:\s+-{1,2}[\w-]+)*)\s+([^\s,;)]+)")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*")


def _extras() -> dict[str, set[str]]:
    """Extra name -> the normalized distribution names it installs (pyproject.toml)."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    return {extra: {_dist(req) for req in reqs}
            for extra, reqs in data["project"]["optional-dependencies"].items()}


def _dist(requirement: str) -> str:
    match = _NAME.match(requirement.strip())
    assert match, requirement
    return match.group(0).lower().replace("_", "-").replace(".", "-")


def _texts(source: str) -> list[str]:
    """Every string literal (implicitly concatenated pieces joined; f-string fields as ``{}``),
    and every comment, of a module's source."""
    out: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.append(node.value)
        elif isinstance(node, ast.JoinedStr):
            out.append("".join(v.value if isinstance(v, ast.Constant) else "{}"
                               for v in node.values))
    out += [tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline)
            if tok.type == tokenize.COMMENT]
    return out


def _require_calls(source: str, function: str = "require") -> list[tuple[str, str]]:
    """``(module, extra)`` of each ``require("module", "extra", ...)`` call (or of another
    ``function`` with the same two first arguments)."""
    return [(node.args[0].value, node.args[1].value) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == function
            and len(node.args) >= 2 and all(isinstance(a, ast.Constant) for a in node.args[:2])]


# Import names whose distribution is named otherwise.
_MODULE_DIST = {"yaml": "pyyaml", "recipes": "torchtune"}  # torchtune ships its recipes


def _installs(extras: dict[str, set[str]], extra: str, module: str) -> bool:
    top = module.split(".")[0]
    return _dist(_MODULE_DIST.get(top, top)) in extras.get(extra, set())


def problems(source: str, extras: dict[str, set[str]]) -> tuple[list[str], int]:
    """The wrong hints in ``source`` and how many hints were checked."""
    bad: list[str] = []
    checked = 0
    every_dist = set().union(*extras.values())
    for text in _texts(source):
        for match in _EXTRA.finditer(text):
            if "{" in match.group(1):
                continue  # a template (_noise.require): its callers are checked below
            for extra in match.group(1).split(","):
                checked += 1
                if extra.strip() not in extras:
                    bad.append(f"memfit[{extra.strip()}] is not an extra")
        for match in _PIP.finditer(text):
            target = match.group(2).strip("'\"`.")
            if target.startswith("memfit[") or target in ("-e", "."):
                continue  # checked above
            name = _NAME.match(target)
            checked += 1
            if name is None or _dist(name.group(0)) not in every_dist:
                bad.append(f"pip install {target}: not a dependency of any extra")
    for module, extra in _require_calls(source):
        checked += 1
        if extra not in extras:
            bad.append(f"require({module!r}, {extra!r}): {extra!r} is not an extra")
        elif not _installs(extras, extra, module):
            bad.append(f"require({module!r}, {extra!r}): the extra does not install {module}")
    return bad, checked


def test_every_install_hint_names_a_real_extra_or_dependency() -> None:
    extras = _extras()
    bad: list[str] = []
    checked = 0
    for path in sorted(SRC.rglob("*.py")):
        found, n = problems(path.read_text(encoding="utf-8"), extras)
        bad += [f"{path.relative_to(ROOT)}: {b}" for b in found]
        checked += n
    assert not bad, "\n".join(bad)
    # The hints this test exists for are found (bnb, quant, report, monitor, hf, fp8, liger...):
    # a scan that found nothing would pass vacuously.
    assert checked >= 20, checked


def test_checker_catches_a_missing_extra_split_over_lines() -> None:
    """The original bug: the hint spans two implicitly concatenated literals."""
    source = ('x = ("needs bitsandbytes or torchao: pip "\n'
              '     "install \'memfit[8bit]\'")\n'
              'y = "pip install nosuchpkg"\n'
              'require("bitsandbytes", "quant", "8-bit")\n')
    bad, checked = problems(source, _extras())
    assert checked == 3
    assert bad == ["memfit[8bit] is not an extra", "pip install nosuchpkg: not a dependency of "
                   "any extra", "require('bitsandbytes', 'quant'): the extra does not install "
                   "bitsandbytes"]


def test_test_skip_hints_name_the_extra_that_installs_the_module() -> None:
    """The tests' skips say which extra to install (issue 20: the tyro and omegaconf skips
    said ``memfit[export]``; they are in ``export-torchtitan`` and ``export-torchtune``)."""
    extras = _extras()
    bad, checked = [], 0
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        for module, extra in _require_calls(path.read_text(encoding="utf-8"), "needs"):
            checked += 1
            if not _installs(extras, extra, module):
                bad.append(f"{path.name}: needs({module!r}, {extra!r}): the extra does not "
                           f"install {module}")
    assert not bad, "\n".join(bad)
    assert checked >= 20, checked  # test_export_tools.py's skips are found
