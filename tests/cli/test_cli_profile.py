"""``memfit profile`` CLI errors: one line, exit code 2, worded in flags (issue 12)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from memfit.cli import main
from memfit.errors import MemfitError
from memfit.profiling import Profiler


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["profile", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(("target", "missing"), [
    ("nosuchmod_memfit", "no module named nosuchmod_memfit"),
    ("nosuchpkg_memfit.train", "no module named 'nosuchpkg_memfit'"),  # the parent is missing
])
def test_missing_module_is_one_line_exit_2(capsys, tmp_path, monkeypatch, target,
                                           missing) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, err = _run(capsys, "--", "python", "-m", target)
    assert code == 2
    assert err.startswith("memfit: error: ") and err.count("\n") == 1, err
    assert missing in err and "Traceback" not in err + out


def test_missing_submodule_of_a_real_package(capsys, tmp_path, monkeypatch) -> None:
    (tmp_path / "realpkg_memfit").mkdir()
    (tmp_path / "realpkg_memfit" / "__init__.py").write_text("")
    monkeypatch.chdir(tmp_path)
    code, _, err = _run(capsys, "--", "python", "-m", "realpkg_memfit.nosub")
    sys.modules.pop("realpkg_memfit", None)
    assert code == 2 and err.count("\n") == 1 and "realpkg_memfit.nosub" in err


def test_missing_script_is_one_line_exit_2(capsys, tmp_path) -> None:
    code, _, err = _run(capsys, "--", "python", str(tmp_path / "nosuch.py"))
    assert code == 2 and err.count("\n") == 1 and "not found" in err


def test_a_script_whose_own_import_fails_keeps_its_traceback(capsys, tmp_path,
                                                             monkeypatch) -> None:
    """An ImportError raised by the user's code is the script's failure (exit 1, traceback,
    report still printed), not memfit's "no module" error."""
    (tmp_path / "usermod_memfit.py").write_text("import nosuchdep_memfit\n")
    monkeypatch.chdir(tmp_path)
    code, _, err = _run(capsys, "--", "python", "-m", "usermod_memfit")
    sys.modules.pop("usermod_memfit", None)
    assert code == 1 and "Traceback" in err and "nosuchdep_memfit" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine "
                    "without CUDA")
def test_device_error_speaks_in_flags_in_the_cli_and_in_arguments_in_the_api(
        capsys, tmp_path) -> None:
    script = tmp_path / "t.py"
    script.write_text("x = 1\n")
    code, _, err = _run(capsys, "--device", "cuda", "--", "python", str(script))
    assert code == 2 and "--device cpu" in err and "device=" not in err
    with pytest.raises(MemfitError, match=r"device='cpu'"):
        Profiler(device="cuda")


def test_unknown_device_is_an_argparse_error(capsys, tmp_path) -> None:
    script = Path(tmp_path / "t.py")
    script.write_text("x = 1\n")
    with pytest.raises(SystemExit) as exc:
        main(["profile", "--device", "gpu", "--", "python", str(script)])
    assert exc.value.code == 2 and "--device" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_snapshot_on_cpu_is_refused_up_front_in_flags(capsys, tmp_path) -> None:
    """Refused before the script runs (it would otherwise run to the end first), in flags."""
    script = tmp_path / "t.py"
    marker = str(tmp_path / "ran.txt")
    script.write_text(f"open({marker!r}, 'w').write('ran')\n")
    code, _, err = _run(capsys, "--snapshot", str(tmp_path / "s.pickle"), "--", "python",
                        str(script))
    assert code == 2 and "--snapshot" in err and "record_history" not in err
    assert not (tmp_path / "ran.txt").exists()
