"""`memfit validate`'s matrix and runner, on the CPU (small sizes): the configs it holds, and the
offload configs predicted against real runs."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import memfit
from memfit import validate
from memfit.cli import main
from memfit.validate import Result, matrix, run_config


def test_matrix_holds_every_family_and_the_offload_configs() -> None:
    configs = matrix("small")
    # 7 families x 2 precisions x 2 checkpointing x 2 (optimizer, batch), less full
    # checkpointing for the 2 families without repeated blocks (2 x 2 each), plus 2 decoder
    # families x 2 checkpointing x 2 offload kinds.
    assert len(configs) == 7 * 8 - 2 * 4 + 2 * 2 * 2
    assert len({c.name for c in configs}) == len(configs)
    assert {c.offload for c in configs} == {"none", "activations", "states"}


@pytest.mark.parametrize("offload", ["activations", "states"])
def test_offload_configs_match_real_cpu_runs(offload: str) -> None:
    # On the CPU, activation offload moves nothing (host memory is the device's) and state
    # offload adds the host copies of parameters and gradients: both must be predicted. Tiny:
    # 16.0 and 23.0 MB measured (state offload 7 MB more); bf16 at "small" took 47 + 32 s
    # on an AVX2-only CPU (emulated), for the same check.
    config = next(c for c in matrix("tiny", families=["llama"])
                  if c.offload == offload and c.checkpointing == "full")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = run_config(config, size="tiny", device="cpu", gpu=None)
    assert abs(result.error_allocated) <= 0.01, result


def test_quick_matrix_covers_every_family_and_axis_in_nine_configs() -> None:
    # The CPU default (`memfit validate --device cpu`): one config per family and one per
    # offload kind, every value of every axis run by some family; all of them are in the full
    # matrix.
    full = matrix("tiny")
    quick = matrix("tiny", quick=True)
    assert len(quick) == 7 + 2
    assert set(quick) <= set(full)
    assert {c.family for c in quick} == {c.family for c in full}
    for axis in ("precision", "optimizer", "checkpointing", "batch", "offload"):
        assert {getattr(c, axis) for c in quick} == {getattr(c, axis) for c in full}, axis


def test_tiny_config_matches_its_real_cpu_run() -> None:
    config = next(c for c in matrix("tiny", quick=True) if c.family == "gpt2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = run_config(config, size="tiny", device="cpu", gpu=None)
    assert abs(result.error_allocated) <= 0.01, result


@pytest.mark.parametrize("size", validate.SIZES)
def test_every_family_builds_at_every_size(size: str) -> None:
    # The GPU matrix ("medium") was never run before a GPU was lent: its ViT had no spec, so
    # every vit config would have failed on the first GPU. Build each family on meta.
    for family, with_batch in validate.zoo(size).items():
        model, inputs, _loss = with_batch(2)("meta")
        assert sum(p.numel() for p in model.parameters()) > 0, family
        assert all(t.device.type == "meta" for t in inputs), family


# -- the command (issue 20) ---------------------------------------------------------------------

def _result(name: str, measured: int, predicted: int, reserved: int | None = None) -> Result:
    return Result(config=name, device="cpu" if reserved is None else "cuda",
                  measured_allocated=measured, measured_reserved=reserved,
                  predicted_allocated=predicted,
                  predicted_reserved=predicted if reserved is None else reserved + 2**20,
                  seconds_real=0.0, seconds_trace=0.0)


def _stub(monkeypatch, fail: str | None = None) -> dict[str, tuple[int, int]]:
    """Instant runs: config i measured 17,885,340 + i * 1,000,003 bytes, predicted 12 less;
    the family ``fail`` raises. Returns name -> (measured, predicted)."""
    numbers: dict[str, tuple[int, int]] = {}

    def run_config(config, **_kw):
        if config.family == fail:
            raise RuntimeError("the real run broke")
        measured = 17_885_340 + len(numbers) * 1_000_003
        numbers[config.name] = (measured, measured - 12)
        return _result(config.name, measured, measured - 12)

    monkeypatch.setattr("memfit.validate.run_config", run_config)
    monkeypatch.setattr("memfit.validate.bf16_lstm_refused", lambda: None, raising=False)
    return numbers


def test_validate_without_device_runs_on_cpu_when_there_is_no_cuda(monkeypatch, capfd) -> None:
    """The README's "quick CPU matrix by default": no --device on a CPU machine runs on the CPU
    and says so in one line (it exited 2, "no CUDA device here")."""
    _stub(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["validate", "--limit", "1", "--quiet"]) == 0
    out = capfd.readouterr().out
    assert out.splitlines()[0] == ("memfit validate: on cpu (no --device given; no CUDA "
                                   "device here)")
    assert "trace vs real (cpu, tiny)" in out
    with pytest.raises(SystemExit):
        main(["validate", "--help"])
    help_text = " ".join(capfd.readouterr().out.split())
    assert "--device {cuda,cpu} where the real runs go (default: cuda when" in help_text


def test_validate_reads_at_80_columns_and_prints_no_json(monkeypatch, capfd) -> None:
    """Piped at 80 columns: every line fits, every config name and number is whole on its
    line (the table needed ~150 columns and folded numbers one digit a line), and the summary
    is one line of text, not JSON (JSON goes to --json FILE)."""
    numbers = _stub(monkeypatch)
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["validate", "--device", "cpu", "--quiet"]) == 0
    lines = capfd.readouterr().out.splitlines()
    assert len(numbers) == 9 and max(len(line) for line in lines) <= 80
    for name, (measured, predicted) in numbers.items():
        k = next(i for i, line in enumerate(lines) if name in line.split())
        # the numbers on the name's line (a table) or the next one (the compact layout)
        assert f"{measured:,}" in " ".join(lines[k:k + 2]), name
        assert f"{predicted:,}" in " ".join(lines[k:k + 2]), name
    assert not any(line.lstrip().startswith(("{", "}", '"')) for line in lines)
    assert lines[-1].startswith("9 configs compared; allocated error: median")
    # wide enough, the same rows are one table: a name and its numbers on one line
    monkeypatch.setenv("COLUMNS", "160")
    assert main(["validate", "--device", "cpu", "--quiet", "--limit", "2"]) == 0
    out = capfd.readouterr().out
    name = matrix("tiny", quick=True)[1].name
    row = next(line for line in out.splitlines() if name in line)
    assert f"{numbers[name][0]:,}" in row and f"{numbers[name][1]:,}" in row


def test_validate_compact_layout_holds_reserved_numbers_at_80_columns() -> None:
    """CUDA results carry reserved bytes too (six numbers a config): still 80 columns."""
    from rich.console import Console

    from memfit.cli.validate import ResultsView

    names = [c.name for c in matrix("medium")[:3]]
    items = [_result(n, 80_000_000_000 - i, 79_999_999_000, 81_000_000_000) for i, n in
             enumerate(names)]
    console = Console(width=80, record=True, file=io.StringIO())
    console.print(ResultsView("cuda", "medium", items))
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines) <= 80
    assert sum("80,000,000,000 / 79,999,999,000" in line for line in lines) == 1
    assert sum("81,000,000,000 / 81,001,048,576" in line for line in lines) == 3


def test_validate_exits_1_when_a_config_fails(monkeypatch, capfd) -> None:
    _stub(monkeypatch, fail="unet-gn")
    assert main(["validate", "--device", "cpu", "--quiet"]) == 1
    out = " ".join(capfd.readouterr().out.split())
    assert "failed: RuntimeError: the real run broke" in out
    assert "8 configs compared" in out and "1 failed" in out


def test_validate_skips_bf16_lstm_where_the_cpu_refuses_it() -> None:
    """With oneDNN held to AVX2 (as on an AVX2-only CPU) a bf16 LSTM cannot run: validate shows
    "skipped: <reason>", as the suite skips it, and exits 0 (it showed "failed" with oneDNN's
    message). The bf16 configs reach the real runner unless skipped; the fp32 ones are stubbed."""
    code = textwrap.dedent("""
        import sys
        import memfit.validate as v
        from memfit.cli import main
        real = v.run_config
        def run_config(config, **kw):
            if config.precision == "bf16-mixed":
                return real(config, **kw)
            return v.Result(config=config.name, device="cpu", measured_allocated=1000,
                            measured_reserved=None, predicted_allocated=1000,
                            predicted_reserved=1000, seconds_real=0.0, seconds_trace=0.0)
        v.run_config = run_config
        sys.exit(main(["validate", "--device", "cpu", "--families", "lstm", "--quiet"]))
    """)
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "COLUMNS": "200",
           "PYTHONPATH": os.pathsep.join([str(Path(memfit.__file__).parents[1]),
                                          os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=300, check=False)
    out = " ".join(done.stdout.split())
    assert done.returncode == 0, done.stdout + done.stderr
    for name in ("lstm/bf16-mixed/adamw/ckpt-none/b2", "lstm/bf16-mixed/sgd-momentum/ckpt-none/b4"):
        assert f"{name}: skipped: this CPU (" in out
    assert "cannot run a bf16 LSTM: could not create a primitive descriptor" in out
    assert "failed" not in out and "2 configs compared; " in out and "2 skipped" in out


def test_cpu_offload_config_warns_nothing() -> None:
    """Activation offload on the CPU is validated on purpose; the technique's "saves nothing"
    UserWarning is not shown to the user of validate."""
    config = next(c for c in matrix("tiny", quick=True) if c.offload == "activations")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_config(config, size="tiny", device="cpu", gpu=None)
    assert not [w for w in caught if "offload_activations" in str(w.message)]


@pytest.mark.parametrize(("argv", "needle"), [
    # --limit -1 sliced the matrix to all configs but the last; 0 ran none and exited 0
    (["--limit", "-1"], "--limit must be a positive integer, got -1"),
    (["--limit", "0"], "--limit must be a positive integer, got 0"),
    # --gpu went to a CPU trace that ignores it, and into the JSON as the catalog entry
    (["--gpu", "h100"], "--gpu h100 names the CUDA GPU"),
])
def test_validate_refuses_options_that_would_not_act(capsys, argv: list[str], needle: str) -> None:
    assert main(["validate", "--device", "cpu", "--quiet", *argv]) == 2
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], captured.err
