"""``memfit plan``'s text as a user and a script read it: the order of its advice, the scale-out
line's wording, ``--check``'s exit code, ``--help`` in plain text, whole lines when piped, and an
honest time in the trace's header (issue 20, section 4)."""

from __future__ import annotations

import json
import re
import shlex
import time
from pathlib import Path

import pytest

from memfit.cli import build_parser, main
from memfit.units import format_bytes


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's own exits (--help)
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(autouse=True)
def _width(monkeypatch: pytest.MonkeyPatch) -> None:
    """rich's width when stdout is not a terminal and COLUMNS is unset: 80 (set, so that a
    terminal on stdin or stderr does not decide it)."""
    monkeypatch.setenv("COLUMNS", "80")


def one_line(out: str, start: str) -> str:
    """The line of ``out`` that starts with ``start``; exactly one."""
    found = [line for line in out.splitlines() if line.startswith(start)]
    assert len(found) == 1, (start, out)
    return found[0]


# -- the scale-out line -----------------------------------------------------------------------

def test_more_gpus_come_after_the_single_changes(capsys) -> None:
    """Qwen3-8B LoRA, batch 2 x 4096 on an H100: one change (full checkpointing, or half the
    micro-batch) fits one GPU, so the plan lists those first and offers more GPUs after them,
    as the alternative with none of them."""
    code, out, err = run(capsys, "plan", "qwen3-8b", "--gpu", "h100-80gb", "--mode", "lora",
                         "--batch", "2", "--seq", "4096", "--json")
    assert code == 0, err
    data = json.loads(out)
    fitting = [s["change"] for s in data["suggestions"] if s["fits"]]
    assert data["fits"] is False and "--checkpointing full" in fitting
    n = data["scale_out"]["gpus"]
    code, out, err = run(capsys, "plan", "qwen3-8b", "--gpu", "h100-80gb", "--mode", "lora",
                         "--batch", "2", "--seq", "4096")
    assert code == 0, err
    line = one_line(out, "or, with none of these changes: this needs ")
    assert f"this needs {n} GPUs" in line
    assert out.index("What would save memory") < out.index(line)
    assert out.index("--checkpointing full") < out.index(line)


def test_host_memory_per_gpu_and_per_node_are_of_the_gpus_they_name(capsys) -> None:
    """Llama-3-70B with the optimizer offloaded (DeepSpeed ZeRO-Offload: 16 bytes per
    parameter on the host, fp32 masters + AdamW states + an fp32 gradient copy, sharded over
    the data-parallel ranks under ZeRO-3). The plan's own line is its one GPU's 16Ψ; the
    scale-out line's are its n GPUs': 16Ψ/n per GPU and, all n on one node, 16Ψ per node."""
    psi = 70_553_706_496
    code, out, err = run(capsys, "plan", "llama-3-70b", "--gpu", "h100-80gb", "--checkpointing",
                         "full", "--offload-optimizer", "--json")
    assert code == 0, err
    n = json.loads(out)["scale_out"]["gpus"]
    assert 1 < n <= 8
    per_gpu = -(-12 * psi // n) + -(-4 * psi // n)
    code, out, err = run(capsys, "plan", "llama-3-70b", "--gpu", "h100-80gb", "--checkpointing",
                         "full", "--offload-optimizer")
    assert code == 0, err
    own = one_line(out, "host memory for offloaded states: ")
    assert own == f"host memory for offloaded states: {format_bytes(16 * psi)} per GPU"
    line = one_line(out, "or, with none of these changes: this needs ")
    assert line.endswith(f"; host memory for offloaded states on {n} GPUs: "
                         f"{format_bytes(per_gpu)} per GPU, {format_bytes(per_gpu * n)} per "
                         f"node of {n} GPUs")
    assert out.index(own) < out.index(line)


def test_sharded_states_past_4096_gpus_are_not_called_unshrinkable(capsys) -> None:
    """--params 1e15 (Ψ = 1e15, bf16-mixed AdamW, the ZeRO paper's layout): at 4096 GPUs
    with ZeRO-3 each holds 2Ψ/N weights + 2Ψ/N gradients + 12Ψ/N optimizer states + the
    foreach step's fp32 temporary 4Ψ/N = 20Ψ/N bytes, plus the runtime; every part of the 20Ψ/N
    shrinks with more GPUs, and the activations are unknown."""
    from memfit.runtime import cuda_runtime_bytes

    psi, n = 10**15, 4096
    runtime = sum(cuda_runtime_bytes("h100-sxm-80gb", num_gpus=n).values())
    code, out, err = run(capsys, "plan", "--params", "1e15", "--gpu", "h100-80gb")
    assert code == 0, err
    line = one_line(out, "no number of GPUs up to 4096")
    assert "do not shrink" not in line
    assert (f"each of 4096 GPUs still needs {format_bytes(20 * psi // n + runtime)}, all but "
            f"{format_bytes(runtime)} of it sharded states, which more GPUs shrink") in line
    assert "activations not counted" in line


def test_what_does_not_shrink_is_named_with_its_parts(capsys) -> None:
    """Llama-3-70B without checkpointing: one micro-batch's activations stay on every GPU
    whatever ZeRO-3 shards; the line adds up the parts more GPUs leave (each shown rounded)."""
    code, out, err = run(capsys, "plan", "llama-3-70b", "--gpu", "h100-80gb")
    assert code == 0, err
    line = one_line(out, "no number of GPUs up to 4096")
    found = re.search(r"what more GPUs do not shrink is ([\d.]+) GiB per GPU \((.*?)\), over "
                      r"the ([\d.]+) GiB the fit margin leaves", line)
    assert found is not None, line
    parts = dict(re.findall(r"(\w+) ([\d.]+ [KMG]iB)", found.group(2)))
    assert "activations" in parts
    scale = {"KiB": 2**-20, "MiB": 2**-10, "GiB": 1}
    total = sum(float(v.split()[0]) * scale[v.split()[1]] for v in parts.values())
    assert total == pytest.approx(float(found.group(1)), abs=0.01 * len(parts))
    usable = 85_017_493_504  # the H100 SXM's total_memory, measured (bench/results/cuda-facts-*)
    assert found.group(3) == f"{(usable - int(0.19 * usable)) / 2**30:.2f}"


# -- --check ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("argv", "code"), [
    # GPT-2 (124M parameters) trains on an 80 GB H100 with room to spare
    (["plan", "gpt2", "--gpu", "h100-80gb"], 0),
    # Llama-3-70B needs 16 bytes per parameter of model states alone: 1.1 TB, not 24 GB
    (["plan", "llama-3-70b", "--gpu", "rtx-4090"], 1),
    (["plan", "llama-3-70b", "--gpu", "rtx-4090", "--json"], 1),
])
def test_check_exits_1_when_the_step_does_not_fit(capsys, argv: list[str], code: int) -> None:
    got, out, err = run(capsys, *argv, "--check")
    assert got == code, err
    if "--json" in argv:  # the answer is still printed
        assert json.loads(out)["fits"] is (code == 0)
    got, _, err = run(capsys, *argv)  # without --check: answered, exit 0 (as before)
    assert got == 0, err


def test_check_needs_a_gpu(capsys) -> None:
    code, _, err = run(capsys, "plan", "gpt2", "--check")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--gpu" in err


def test_check_with_the_trace(capsys, tmp_path: Path) -> None:
    """The traced plan gates the same way: GPT-2 on a 4090 cut to 1 GiB does not hold 124M
    parameters trained with AdamW (16 bytes each: 1.85 GiB)."""
    small = tmp_path / "gpus.json"
    small.write_text(json.dumps({"gpus": [{"name": "rtx-4090", "memory_bytes": 2**30}]}))
    code, _, err = run(capsys, "plan", "gpt2", "--method", "trace", "--seq", "128", "--gpu",
                       "rtx-4090", "--gpu-file", str(small), "--check", "--json", "--quiet")
    assert code == 1, err


# -- names, help, width, time -----------------------------------------------------------------

def test_the_gpu_name_plan_prints_is_a_valid_gpu(capsys) -> None:
    code, out, err = run(capsys, "plan", "llama-3-8b", "--gpu", "rtx-4090")
    assert code == 0, err
    label = re.search(r"\) on (.+)$", out.splitlines()[0]).group(1)  # type: ignore[union-attr]
    assert label == "NVIDIA GeForce RTX 4090"
    code, again, err = run(capsys, "plan", "llama-3-8b", "--gpu", label.lower())
    assert code == 0, err
    assert again == out


@pytest.mark.parametrize("command", [None, "plan", "fit", "gpus", "models", "profile",
                                     "monitor", "validate", "export"])
def test_help_is_plain_text(capsys, command: str | None) -> None:
    code, out, _ = run(capsys, *([command] if command else []), "--help")
    assert code == 0
    assert "``" not in out and not re.search(r":(func|class|meth|mod|data):`", out)


def test_plan_help_examples_are_whole_commands(capsys) -> None:
    """Each example under "examples:" is one command, continued with a backslash onto an
    indented line where it is long: no line holds a run of spaces inside a command (a
    continuation lost in the source), and each parses."""
    code, out, _ = run(capsys, "plan", "--help")
    assert code == 0
    examples = out[out.index("examples:"):].split("\n\n")[0].splitlines()[1:]
    commands: list[str] = []
    for line in examples:
        body = line.split("#")[0].rstrip()
        assert not re.search(r"\S {2,}-", body), line
        if line.startswith("      ") and commands:
            commands[-1] = commands[-1].rstrip("\\").rstrip() + " " + line.strip()
        else:
            commands.append(body.strip())
    assert len(commands) >= 10
    parser = build_parser()
    for command in commands:
        argv = shlex.split(command.split("&&")[0])
        assert argv[:2] == ["memfit", "plan"], command
        parser.parse_args(argv[1:])


def test_piped_output_never_splits_a_line(capsys) -> None:
    """Captured stdout is not a terminal (rich then assumes 80 columns): the run's description,
    84 characters here, and the longer lines under the table stay whole."""
    from memfit.analytic.config import RunConfig
    from memfit.analytic.planner import plan
    from memfit.gpus import get_gpu
    from memfit.models import get_preset

    described = plan(get_preset("llama-3-8b"), RunConfig(mode="qlora", checkpointing="full",
                                                         seq=2048), get_gpu("rtx-4090")).describe()
    assert len(described) > 80
    code, out, err = run(capsys, "plan", "llama-3-8b", "--gpu", "rtx-4090", "--mode", "qlora",
                         "--checkpointing", "full", "--batch", "1", "--seq", "2048")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[1] == described
    assert any(len(line) > 80 and line.startswith("[1] not modelled here") for line in lines)
    assert max(len(line) for line in lines if line.startswith(("┃", "│", "┏", "└"))) <= 80


def test_the_trace_header_says_the_whole_time(capsys, monkeypatch) -> None:
    """The header once gave the trace of the step alone (2.4 s of an 18 s command). Building the
    model is made 1.5 s slower here: the header's time is the command's wall time, measured
    around it, and the step's share is named."""
    import memfit.models.build as build

    real = build.build_model

    def slow(*args, **kwargs):
        time.sleep(1.5)
        return real(*args, **kwargs)

    monkeypatch.setattr(build, "build_model", slow)
    started = time.perf_counter()
    code, out, err = run(capsys, "plan", "gpt2", "--method", "trace", "--seq", "128", "--gpu",
                         "rtx-4090", "--quiet")
    wall = time.perf_counter() - started
    assert code == 0, err
    found = re.search(r"traced on meta tensors for .+ in ([\d.]+) s \(([\d.]+) s of it tracing "
                      r"the step\)", out.splitlines()[0])
    assert found is not None, out.splitlines()[0]
    said, step = float(found.group(1)), float(found.group(2))
    # the slowed build is inside the time said, which is inside the test's own stopwatch (no
    # lower wall-clock tolerance: imports before the command's timer vary with the machine)
    assert 1.5 <= said <= wall + 0.05
    assert step <= said - 1.4
