"""The import layers are written down and checked: pyproject.toml holds the import-linter
contract, the test extra installs it, and the README's test command (which .ci/run repeats)
runs ``lint-imports``."""

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_layers_contract_is_in_pyproject() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    linter = project["tool"]["importlinter"]
    assert linter["root_package"] == "memfit"
    layers = next(c for c in linter["contracts"] if c["type"] == "layers")
    assert layers["containers"] == ["memfit"]
    order = [name.strip() for layer in layers["layers"] for name in layer.split("|")]
    # the house's order: the CLI on top, the engine below the features, errors at the bottom
    assert order.index("cli") < order.index("fitting") < order.index("parallel")
    assert order.index("parallel") < order.index("trace") < order.index("models")
    assert order[-1] == "errors" or "errors" in layers["layers"][-1]
    assert any(d.startswith("import-linter") for d in
               project["project"]["optional-dependencies"]["test"])


def test_the_readme_test_command_and_ci_run_every_check() -> None:
    """The README's test command runs the import layers, the type check (tests/
    test_typecheck_config.py), the docs build and pytest, and .ci/run runs the same checks."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    command = next(line for line in readme.splitlines()
                   if line.startswith("python3 -m venv") and "pytest" in line)
    assert "&& lint-imports &&" in command
    assert "&& lint-imports && mypy && mkdocs build --strict && pytest" in command
    checks = command[command.index("ruff check"):]  # .ci/run's pip is quiet (-q); the checks match
    assert checks in ci


def test_the_contracts_ignore_no_import() -> None:
    """Every import obeys the layers as they are: no import is excused from a contract (the
    exceptions the first contract carried were fitting.plan -> export and profiling.session ->
    report, a cycle each)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    for contract in project["tool"]["importlinter"]["contracts"]:
        assert not contract.get("ignore_imports"), contract["name"]


SRC = ROOT / "src" / "memfit"


def _module(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package(module: str) -> str:
    """The top-level part of memfit a module belongs to: ``trace`` for memfit.trace.engine,
    ``errors`` for memfit.errors."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _is_module(module: str, src: Path) -> bool:
    path = src.parent.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_names_across_packages(src: Path = SRC) -> list[str]:
    """``from memfit.X import _name`` and ``X._name`` (X a memfit module imported by name) in a
    module of another package than X's."""
    found = []
    for path in sorted(src.rglob("*.py")):
        me = _module(path, src)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        modules: dict[str, str] = {}  # local name -> memfit module it binds
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("memfit"):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    if _is_module(full, src):
                        modules[alias.asname or alias.name] = full
                    elif _private(alias.name) and _package(node.module) != _package(me):
                        found.append(f"{path.relative_to(src.parent)}:{node.lineno}: from "
                                     f"{node.module} import {alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("memfit"):
                        modules[alias.asname or alias.name] = alias.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in modules and _private(node.attr)
                    and _package(modules[node.value.id]) != _package(me)):
                found.append(f"{path.relative_to(src.parent)}:{node.lineno}: "
                             f"{modules[node.value.id]}.{node.attr}")
    return found


def test_no_private_name_is_imported_across_packages() -> None:
    """A name one part of memfit uses from another is public there (documented, in its
    ``__all__`` where it has one); a private name stays inside its package."""
    assert private_names_across_packages() == []


def test_the_private_name_scan_finds_both_forms(tmp_path: Path) -> None:
    """The scan above sees ``from ... import _x`` and ``module._x`` across packages, and lets a
    package use its own private names."""
    pkg = tmp_path / "memfit"
    for rel, text in {
        "__init__.py": "",
        "a/__init__.py": "",
        "a/low.py": "_hidden = 1\n",
        "a/same.py": "from memfit.a.low import _hidden\n",
        "b/__init__.py": "",
        "b/up.py": "from memfit.a.low import _hidden\nfrom memfit.a import low\nlow._hidden\n",
    }.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    assert private_names_across_packages(pkg) == [
        "memfit/b/up.py:1: from memfit.a.low import _hidden",
        "memfit/b/up.py:3: memfit.a.low._hidden"]


def test_the_cli_contract_covers_every_other_module() -> None:
    """"Only the CLI imports the CLI" names every top-level part of memfit but the CLI, so a new
    module is covered the day it is added."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    contract = next(c for c in project["tool"]["importlinter"]["contracts"]
                    if c.get("forbidden_modules") == ["memfit.cli"])
    parts = {f"memfit.{p.stem if p.is_file() else p.name}" for p in SRC.iterdir()
             if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()}
    assert set(contract["source_modules"]) == parts - {"memfit.cli"}


def test_the_replay_retry_exists_once() -> None:
    """A trace whose replayed call was not replayable is redone by one function
    (memfit.trace.replay.redo_without_replay); nothing else looks for a ReplayMismatch."""
    catchers = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "isinstance" and "ReplayMismatch" in ast.unparse(node)):
                catchers.append(str(path.relative_to(SRC)))
    assert catchers == ["trace/replay.py"]
