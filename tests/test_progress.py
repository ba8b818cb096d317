"""Progress on long work (issue 12 part 2): quiet rules, honest ETA, partial results, noise."""

from __future__ import annotations

import io
import json
import re

import pytest
import torch
from rich.console import Console

from memfit import progress as progress_mod
from memfit.cli import main
from memfit.progress import Progress, should_show

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _terminal() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, force_terminal=True, width=200, height=40), buf


# -- when progress shows ----------------------------------------------------------------------

def test_should_show_follows_argument_env_and_tty(monkeypatch) -> None:
    """progress= wins; then MEMFIT_PROGRESS; then whether stderr is a terminal."""
    monkeypatch.delenv(progress_mod.ENV, raising=False)
    monkeypatch.setattr("sys.stderr", io.StringIO())  # not a TTY
    assert should_show() is False
    assert should_show(True) is True
    monkeypatch.setenv(progress_mod.ENV, "1")
    assert should_show() is True
    assert should_show(False) is False

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr("sys.stderr", Tty())
    monkeypatch.setenv(progress_mod.ENV, "0")
    assert should_show() is False
    monkeypatch.delenv(progress_mod.ENV)
    assert should_show() is True


def test_forced_terminal_draws_counts_phase_and_eta() -> None:
    """On a terminal the line shows done/total, the running phase, and an ETA once one unit
    finished; a nested Progress shows as the outer line's sub-phase, not a second display."""
    console, buf = _terminal()
    with Progress("validating", total=4, unit="configs", console=console) as bar:
        bar.phase("cfg-a: real run")
        assert bar.eta_seconds() is None  # nothing finished: no ETA to show
        with Progress("tracing", total=None) as inner:
            inner.phase("forward layer 3/32")
            bar._live.refresh()
        bar.advance()
        bar._live.refresh()
        assert bar.eta_seconds() is not None
    text = ANSI.sub("", buf.getvalue())
    assert "0/4 configs" in text and "1/4 configs" in text
    assert "cfg-a: real run" in text
    assert "tracing: forward layer 3/32" in text
    assert "ETA" in text.split("1/4 configs", 1)[1]  # only after the first unit finished
    assert "ETA" not in text.split("1/4 configs", 1)[0]


def test_eta_is_average_time_per_weight_unit_times_what_is_left(monkeypatch) -> None:
    """ETA = (time of the last finish - start) / weight done x weight left, counted down from
    the last finish: 10 s for 2 of 8 units -> 30 s left, 26 s four seconds later."""
    clock = [100.0]
    monkeypatch.setattr(progress_mod.time, "monotonic", lambda: clock[0])
    with Progress("x", total=8, progress=False) as bar:
        clock[0] = 110.0
        bar.advance(2, items=1)
        assert bar.eta_seconds() == pytest.approx(30.0)
        clock[0] = 114.0
        assert bar.eta_seconds() == pytest.approx(26.0)
        clock[0] = 200.0  # overdue: never negative
        assert bar.eta_seconds() == 0.0
        assert "1/8" in bar.status()


def test_quiet_progress_writes_nothing(capfd) -> None:
    """progress=False and a non-TTY stderr (pytest's capture) draw nothing at all."""
    for flag in (False, None):
        with Progress("x", total=2, progress=flag) as bar:
            bar.phase("y")
            bar.advance()
    out, err = capfd.readouterr()
    assert out == "" and err == ""


# -- memfit validate ----------------------------------------------------------------------------

def _fake_result(name: str) -> object:
    from memfit.validate import Result

    return Result(config=name, device="cpu", measured_allocated=1000, measured_reserved=None,
                  predicted_allocated=1010, predicted_reserved=1010, seconds_real=0.0,
                  seconds_trace=0.0)


def _stub_runner(monkeypatch, interrupt_at: int | None) -> list[str]:
    """Replace the per-config runner: instant fake results, KeyboardInterrupt on call
    ``interrupt_at`` (1-based), as Ctrl-C during that config would raise."""
    calls: list[str] = []

    def run_config(config, **_kw):
        calls.append(config.name)
        if interrupt_at is not None and len(calls) == interrupt_at:
            raise KeyboardInterrupt
        return _fake_result(config.name)

    monkeypatch.setattr("memfit.validate.run_config", run_config)
    return calls


def test_validate_json_keeps_results_after_an_interrupt(monkeypatch, capfd, tmp_path) -> None:
    """Ctrl-C during the 3rd config: exit 130, one line on stderr, and the JSON file holds the
    two configs finished before it, marked incomplete (resnet-bn: 2 precisions x 2 checkpointing
    x 2 optimizer/batch = 8 configs)."""
    calls = _stub_runner(monkeypatch, interrupt_at=3)
    path = tmp_path / "out" / "v.json"
    code = main(["validate", "--device", "cpu", "--families", "resnet-bn", "--json", str(path)])
    out, err = capfd.readouterr()
    assert code == 130
    assert err.strip().splitlines() == [
        f"memfit validate: interrupted after 2 of 8 configs; results so far in {path}"]
    doc = json.loads(path.read_text())
    assert doc["complete"] is False
    assert [r["config"] for r in doc["results"]] == calls[:2]
    assert doc["configs_done"] == 2 and doc["configs_total"] == 8
    assert doc["summary"]["configs"] == 2
    assert calls[0] in out and calls[1] in out  # the partial table is printed
    assert not list(path.parent.glob("*.tmp"))  # no temp file left behind


def test_validate_json_rewritten_after_every_config(monkeypatch, capfd, tmp_path) -> None:
    """The file on disk after config k holds k results (read from inside the k+1-th run)."""
    path = tmp_path / "v.json"
    seen: list[int] = []

    def run_config(config, **_kw):
        if path.exists():
            seen.append(len(json.loads(path.read_text())["results"]))
        return _fake_result(config.name)

    monkeypatch.setattr("memfit.validate.run_config", run_config)
    # the runs are fakes: none is skipped for this CPU (an AVX2-only one refuses a bf16 LSTM)
    monkeypatch.setattr("memfit.validate.why_not_here", lambda config, device: None)
    assert main(["validate", "--device", "cpu", "--families", "lstm", "--json",
                 str(path)]) == 0
    capfd.readouterr()
    assert seen == [0, 1, 2, 3]  # lstm: 4 configs (no checkpointing variants)
    doc = json.loads(path.read_text())
    assert doc["complete"] is True and len(doc["results"]) == 4


def test_validate_quiet_and_non_tty_stderr_is_empty(monkeypatch, capfd) -> None:
    """Under --quiet, and with stderr not a terminal, validate writes nothing to stderr."""
    _stub_runner(monkeypatch, interrupt_at=None)
    for extra in (["--quiet"], []):
        assert main(["validate", "--device", "cpu", "--families", "lstm", "--limit", "2",
                     *extra]) == 0
        out, err = capfd.readouterr()
        assert err == ""
        assert "trace vs real" in out


def test_validate_forced_progress_fills_rows(monkeypatch, capfd) -> None:
    """MEMFIT_PROGRESS=1 draws on stderr even when it is not a terminal; the live view holds
    the rows finished so far."""
    _stub_runner(monkeypatch, interrupt_at=None)
    monkeypatch.setenv(progress_mod.ENV, "1")
    shown: list[str] = []
    real_show = Progress.show

    def show(self, renderable):
        shown.append(ANSI.sub("", _render(renderable)))
        real_show(self, renderable)

    monkeypatch.setattr(Progress, "show", show)
    assert main(["validate", "--device", "cpu", "--families", "lstm", "--limit", "2"]) == 0
    _, err = capfd.readouterr()
    assert "memfit validate" in err
    assert len(shown) == 2
    assert "lstm/fp32/adamw" in shown[0] and "sgd-momentum" not in shown[0]
    assert "sgd-momentum" in shown[1]


def _render(renderable: object) -> str:
    console, buf = _terminal()
    console.print(renderable)
    return buf.getvalue()


# -- third-party noise --------------------------------------------------------------------------

def test_profiler_start_stop_lines_are_silenced(capfd) -> None:
    """Kineto writes 'USDT: ... profiler_start' / 'profiler_stop' to fd 2 when a
    torch.profiler.profile starts and stops (libkineto/src/SyncActivityProfilerHandler.cpp:
    startTrace / stopTrace, USDT_EMIT_START_TRACE in libkineto/src/Logger.h, severity USDT above
    the ERROR level set by suppressLibkinetoLogMessages in init.cpp). memfit's own profiler runs
    (measure_cpu_peak, the trace's CPU kernel measurements) redirect fd 2 around start/stop only.
    The check that raw profiling prints them keeps this test able to fail on a torch that
    prints them."""
    from torch.profiler import ProfilerActivity, profile

    from memfit.profiling.cpu import measure_cpu_peak

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
        torch.ones(8).sum()
    _, raw = capfd.readouterr()
    peak = measure_cpu_peak(lambda: torch.ones(1000).sum())
    assert peak.peak_delta_bytes == 4004  # 1000 fp32 + the fp32 sum
    _, err = capfd.readouterr()
    assert "profiler_st" not in err
    if "profiler_start" not in raw:
        pytest.skip("this torch build prints no kineto start/stop lines")


def test_quiet_fd2_restores_stderr(capfd) -> None:
    """What C code writes to fd 2 inside quiet_fd2 is dropped; after it, fd 2 works again."""
    import os

    from memfit._noise import quiet_fd2

    with quiet_fd2():
        os.write(2, b"hidden\n")
    os.write(2, b"shown\n")
    _, err = capfd.readouterr()
    assert err == "shown\n"


def test_quiet_import_restores_logger_levels() -> None:
    """quiet_imports raises the optional dependencies' loggers to ERROR and restores them."""
    import logging

    from memfit._noise import quiet_imports

    lg = logging.getLogger("torchao")
    before = lg.level
    with quiet_imports():
        assert lg.getEffectiveLevel() >= logging.ERROR
    assert lg.level == before


def test_trace_on_cpu_target_prints_nothing(capfd) -> None:
    """A trace for a CPU target measures CPU kernels under the profiler: no kineto lines."""
    from memfit.trace import estimate

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU())
    estimate(model, torch.empty(2, 3, 16, 16, device="meta"), device="cpu", steps=1)
    _, err = capfd.readouterr()
    assert "profiler_st" not in err



# -- find_batch_size and fit -------------------------------------------------------------------

def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def test_find_batch_size_reports_each_trial_and_the_bracket(monkeypatch) -> None:
    """Each trial names its batch as the phase, and the note holds the bracket and the most
    trials bisection can still need: ceil(log2(hi - lo)) for a fit at lo and a miss at hi."""
    from memfit.batch_size import find_batch_size

    notes: list[str] = []
    phases: list[str] = []
    monkeypatch.setattr(Progress, "set_note", lambda self, text: notes.append(text))
    real_phase = Progress.phase
    monkeypatch.setattr(Progress, "phase",
                        lambda self, text: (phases.append(text), real_phase(self, text)))
    # A budget no batch above 40 rows meets, by the trial's own verdict (no measurement needed).
    monkeypatch.setattr("memfit.batch_size._Trials._measure",
                        lambda self, rows: 1000 * rows)
    found = find_batch_size(_mlp(), lambda b: torch.randn(b, 32), budget_bytes=40_500,
                            device="cpu", start=33, progress=True, log=False)
    assert found == 40
    trials = [p for p in phases if p.startswith("trial: batch ")]
    assert trials[:2] == ["trial: batch 33, real training steps",
                          "trial: batch 34, real training steps"]
    # 33 and 34 fit (33,000 and 34,000 B); the line through them meets the budget at 40.5
    # rows: 40 fits, 41 (41,000 B) does not: bracket (40, 41) -> ceil(log2(1)) = 0 left.
    assert notes == ["1 trials, 33 fits", "2 trials, 34 fits", "3 trials, 40 fits",
                     "4 trials, 40 fits, 41 does not, ≤ 0 left"]
    assert notes[-1].endswith("≤ 0 left")  # 41 does not fit: nothing left between 40 and 41


def test_find_batch_size_is_silent_off_a_terminal(capfd) -> None:
    """progress=None with stderr not a terminal (pytest captures it): nothing on stderr."""
    from memfit.batch_size import find_batch_size

    find_batch_size(_mlp(), lambda b: torch.randn(b, 32), budget_bytes=2**22, device="cpu",
                    start=4, max_batch=6, log=False)
    _, err = capfd.readouterr()
    assert err == ""


def test_fit_counts_a_combination_when_it_is_finished(monkeypatch) -> None:
    """fit's progress advances after a combination's traces (never before it starts: the old
    bar showed 1/16 while the first combination was still tracing) and ends at the total."""
    from memfit.fitting import fit

    events: list[tuple[str, float]] = []
    real_advance, real_phase = Progress.advance, Progress.phase

    def advance(self, weight=1.0, *, items=1):
        events.append(("advance", self.completed + weight))
        real_advance(self, weight, items=items)

    def phase(self, text):
        if text.startswith("tracing "):
            events.append(("trace", self.completed))
        real_phase(self, text)

    monkeypatch.setattr(Progress, "advance", advance)
    monkeypatch.setattr(Progress, "phase", phase)
    fit(_mlp(), torch.randn(4, 32), global_batch=4, budget_bytes=2**30, device="cpu",
        space={"precision": ["fp32", "bf16-mixed"], "micro_batch": [4]}, progress=True)
    traces = [done for kind, done in events if kind == "trace"]
    assert traces and traces[0] == 0  # the first trace runs with nothing counted yet
    assert [done for kind, done in events if kind == "advance"][-1] == 2  # fp32, bf16-mixed


def test_plan_trace_progress_and_the_quiet_rule(monkeypatch, capfd) -> None:
    """plan --method trace names its phases (forward layer i/N from the block hooks); --json
    and --quiet win over MEMFIT_PROGRESS=1 (the quiet rule), with nothing at all on stderr.
    The trace runs once; the quiet runs reuse its result (what is checked is what the CLI asks
    of the display: drawing or not)."""
    import memfit.cli.trace_plan as trace_plan

    monkeypatch.setenv(progress_mod.ENV, "1")
    texts: list[str] = []
    real_phase = Progress.phase
    monkeypatch.setattr(Progress, "phase",
                        lambda self, text: (texts.append(text), real_phase(self, text)))
    real = trace_plan.traced_estimate
    cached: list[object] = []
    drawing: list[bool] = []

    def traced_estimate(spec, run, gpu):
        drawing.append(progress_mod.current().drawing)
        if not cached:
            cached.append(real(spec, run, gpu))
        return cached[0]

    monkeypatch.setattr(trace_plan, "traced_estimate", traced_estimate)
    argv = ["plan", "gpt2", "--method", "trace", "--gpu", "h100-80gb", "--seq", "32"]
    assert main(argv) == 0
    _, err = capfd.readouterr()
    assert "memfit plan: tracing gpt2" in ANSI.sub("", err)
    assert "building the model on meta" in texts
    assert "step 1/2 forward: layer 12/12" in texts  # gpt2: 12 blocks, two traced steps
    assert "step 2/2 backward: layer 1/12" in texts
    assert "step 2/2 optimizer step" in texts
    for extra in (["--json"], ["--quiet"]):
        assert main([*argv, *extra]) == 0
        _, err = capfd.readouterr()
        assert err == ""
    assert drawing == [True, False, False]


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_phase_hooks_do_not_change_the_trace(monkeypatch, checkpointing) -> None:
    """The trace with progress hooks (forward pre-hooks on blocks, gradient hooks on their
    outputs, an optimizer step pre-hook) is op for op and byte for byte the trace without them,
    with and without a checkpoint's recompute."""
    from memfit.models.build import build_model, example_inputs
    from memfit.models.zoo import small_llama as _small_llama
    from memfit.trace import estimate

    spec = _small_llama(2, 128)

    def traced(show: bool) -> tuple[object, ...]:
        model = build_model(spec, backend="builtin", device="meta")
        if checkpointing != "none":
            from memfit.techniques.checkpointing import apply_activation_checkpointing

            apply_activation_checkpointing(model, policy=checkpointing)
        inputs = example_inputs(spec, batch=2, seq=64, device="meta")
        phases: list[str] = []
        real_phase = Progress.phase
        monkeypatch.setattr(Progress, "phase",
                            lambda self, text: (phases.append(text), real_phase(self, text)))
        with Progress("test", progress=show, console=_terminal()[0] if show else None):
            est = estimate(model, inputs, precision="bf16-mixed", device="cuda",
                           gpu="a100-80gb")
        assert any("backward: layer 1/2" in p for p in phases) == show
        return (est.peak_bytes, est.peak_reserved_bytes, est.num_ops,
                [(p.op, p.bytes) for p in est.timeline])

    assert traced(True) == traced(False)


def test_a_delayed_display_draws_nothing_for_quick_work(capfd) -> None:
    """Work that ends before the delay draws nothing, even when progress is asked for."""
    with Progress("quick", total=1, progress=True, delay=600) as bar:
        bar.advance()
    _, err = capfd.readouterr()
    assert err == ""


def test_transformers_default_loss_notice_is_dropped_inside_memfit_runs(caplog) -> None:
    """transformers' "`loss_type=None` ... Using the default loss" record (every model built
    from a config logs it) is dropped inside memfit's runs; the logger's other records pass, and
    outside the block the notice passes again."""
    import logging

    from memfit._noise import quiet_loggers

    hf = logging.getLogger("transformers.modeling_utils")
    notice = ("`loss_type=None` was set in the config but it is unrecognized. Using the default "
              "loss: `ForCausalLMLoss`.")
    with caplog.at_level(logging.WARNING, logger="transformers.modeling_utils"):
        with quiet_loggers():
            hf.warning(notice)
            hf.warning("something else")
        hf.warning(notice)
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["something else", notice]


def test_plan_trace_prints_its_assumptions_once(capfd) -> None:
    """A traced step that does not fit is traced on an unlimited GPU, an assumption the table
    prints as an "assumed:" line; the engine's UserWarning of it is not repeated on stderr."""
    import warnings

    argv = ["plan", "gpt2", "--method", "trace", "--gpu", "t4", "--batch", "32", "--seq", "1024"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(argv) == 0
    out, err = capfd.readouterr()
    assert "assumed: an unlimited GPU" in out
    assert "memfit: assumed" not in err
    assert [str(w.message) for w in caught if "memfit: assumed" in str(w.message)] == []


def test_find_batch_size_reports_the_bisection_left_in_a_wide_bracket(monkeypatch) -> None:
    """Where the measured peaks give no line to follow (flat below the answer), the finder
    gallops: 33, 34, 36, 40 fit (steps 1, 2, 4), 48 does not: bracket (40, 48), and the note
    says at most ceil(log2(48 - 40)) = 3 trials are left."""
    from memfit.batch_size import find_batch_size

    notes: list[str] = []
    monkeypatch.setattr(Progress, "set_note", lambda self, text: notes.append(text))
    monkeypatch.setattr("memfit.batch_size._Trials._measure",
                        lambda self, rows: 40_000 if rows <= 40 else 41_000)
    found = find_batch_size(_mlp(), lambda b: torch.randn(b, 32), budget_bytes=40_500,
                            device="cpu", start=33, progress=True, log=False)
    assert found == 40
    assert "5 trials, 40 fits, 48 does not, ≤ 3 left" in notes
