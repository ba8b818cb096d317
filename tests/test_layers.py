"""The import layers are written down and checked: pyproject.toml holds the import-linter
contract, the test extra installs it, and the README's test command (which .ci/run repeats)
runs ``lint-imports``."""

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


def test_the_readme_test_command_and_ci_run_lint_imports() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    command = next(line for line in readme.splitlines()
                   if line.startswith("python3 -m venv") and "pytest" in line)
    assert "&& lint-imports &&" in command
    checks = command[command.index("ruff check"):]  # .ci/run's pip is quiet (-q); the checks match
    assert checks in ci
