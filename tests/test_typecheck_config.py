"""The type checker is configured and run: pyproject.toml holds mypy's settings (strict, less
the checks torch's annotations fail), the test extra installs it, and the README's test command
(which .ci/run repeats) runs ``mypy`` before pytest."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_is_configured_strict_over_src() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    mypy = project["tool"]["mypy"]
    assert mypy["files"] == ["src/memfit"]
    assert mypy["strict"] is True
    # what strict keeps: every function annotated, bodies checked
    for relaxed in ("disallow_untyped_defs", "disallow_incomplete_defs", "check_untyped_defs"):
        assert mypy.get(relaxed, True) is True, relaxed
    # no module silences everything: each override names the codes it disables
    for override in mypy.get("overrides", []):
        assert not override.get("ignore_errors", False), override["module"]
        assert set(override) <= {"module", "disable_error_code", "ignore_missing_imports",
                                 "follow_imports"}
        # only optional third-party libraries go unanalysed, never memfit's own modules or torch
        if "follow_imports" in override:
            modules = override["module"]
            assert not any(m.split(".")[0] in ("memfit", "torch") for m in modules), modules
    assert any(d.startswith("mypy") for d in project["project"]["optional-dependencies"]["test"])
