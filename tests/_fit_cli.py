"""``memfit fit`` on a test module's ``make()``: the CLI takes a model factory as ``module:fn``, so
a file in ``tmp_path`` re-exports the test module's (tests/fitting/test_fit_tp_plan.py,
test_fit_pp_split.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def fit_cli(test_file: str, batch: int, capsys: Any, tmp_path: Path, monkeypatch: Any,
            *extra: str) -> tuple[int, str, str]:
    """``memfit fit <test module>:make --budget 64MiB --device cpu --global-batch batch --quiet
    *extra``: the exit code, stdout and stderr."""
    from memfit.cli import main

    module = Path(test_file).stem
    factory = f"factory_of_{module}"  # one name per test module: a process imports each once
    (tmp_path / f"{factory}.py").write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(Path(test_file).parent)!r})\n"
        f"from {module} import make\n")
    monkeypatch.chdir(tmp_path)
    code = main(["fit", f"{factory}:make", "--budget", "64MiB", "--device", "cpu",
                 "--global-batch", str(batch), "--quiet", *extra])
    out, err = capsys.readouterr()
    return code, out, err
