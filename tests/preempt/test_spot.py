"""memfit.preempt.spot and `memfit spot-plan`: Young/Daly intervals, lost work, restarts, time
and cost, against numbers worked by hand."""

from __future__ import annotations

import json
import math

import pytest

from memfit.analytic.config import RunConfig
from memfit.cli import main
from memfit.errors import MemfitError
from memfit.models.spec import ParamCountSpec
from memfit.preempt.spot import band_mtbf_s, checkpoint_bytes, daly_interval, spot_plan


def test_the_hand_worked_plan() -> None:
    # C = 100 GB / 1 GB/s = 100 s; M = 20,000 s; Young: sqrt(2 * 100 * 20,000) = 2,000 s.
    # Daly: C/2M = 0.0025, sqrt = 0.05: 2000 * (1 + 0.05/3 + 0.0025/9) - 100 = 1933.888... s.
    # Lost per preemption (2000 + 100)/2 = 1050 s; restart = reading 100 GB at 1 GB/s = 100 s.
    # Wall: 36,000 * (1 + 100/2000) / (1 - 1150/20,000) = 37,800 / 0.9425 = 40,106.10 s.
    p = spot_plan(checkpoint_bytes=100e9, write_bandwidth=1e9, mtbf_s=20_000, work_s=36_000,
                  price_per_hour=10.0, spot_discount=0.6)
    assert p.checkpoint_s == 100
    assert p.interval_s == pytest.approx(2000, rel=1e-12)
    assert p.interval_daly_s == pytest.approx(2000 * (1 + 0.05 / 3 + 0.0025 / 9) - 100)
    assert p.interval_daly_s == pytest.approx(1933.8889, abs=1e-4)
    assert p.lost_per_preemption_s == pytest.approx(1050)
    assert p.restart_s == pytest.approx(100)
    assert p.wall_s == pytest.approx(37_800 / 0.9425)
    assert p.expected_preemptions == pytest.approx(37_800 / 0.9425 / 20_000)
    assert p.on_demand_cost == pytest.approx(100.0)  # 10 h at $10
    assert p.spot_cost == pytest.approx(37_800 / 0.9425 / 3600 * 10 * 0.4)  # $44.56
    assert p.spot_cost == pytest.approx(44.5623, abs=1e-4)


def test_a_checkpoint_on_notice_loses_no_work() -> None:
    # a 6 s step and a 100 s checkpoint fit in AWS's 120 s notice: only the restart is lost
    p = spot_plan(checkpoint_bytes=100e9, write_bandwidth=1e9, mtbf_s=20_000, work_s=36_000,
                  notice_s=120, step_s=6, provision_s=300, read_bandwidth=2e9)
    assert p.saved_on_notice and p.lost_per_preemption_s == 0
    assert p.restart_s == pytest.approx(300 + 50)
    assert p.wall_s == pytest.approx(37_800 / (1 - 350 / 20_000))
    late = spot_plan(checkpoint_bytes=100e9, write_bandwidth=1e9, mtbf_s=20_000,
                     work_s=36_000, notice_s=30, step_s=6)
    assert not late.saved_on_notice and late.lost_per_preemption_s == pytest.approx(1050)


def test_daly_caps_at_the_mtbf() -> None:
    assert daly_interval(300, 100) == 100


def test_bands_convert_the_published_monthly_share() -> None:
    # 5-10%: the upper edge, 10% of instances a month: 730 h / -ln(0.9) = 6928.6 h per instance
    assert band_mtbf_s("aws-5-10") == pytest.approx(730 / -math.log(0.9) * 3600)
    assert band_mtbf_s("aws-5-10") / 3600 == pytest.approx(6928.6, abs=0.1)
    # any one of 8 instances stops a synchronous job: 8 times as often
    assert band_mtbf_s("aws-5-10", 8) == pytest.approx(band_mtbf_s("aws-5-10") / 8)
    assert band_mtbf_s("gcp-preemptible") == 24 * 3600
    with pytest.raises(MemfitError, match="valid: aws-lt5"):
        band_mtbf_s("azure")


def test_checkpoint_bytes_are_weights_and_optimizer_states() -> None:
    model = ParamCountSpec(name="1B", params=10**9)
    # ZeRO paper layout: bf16 weights (2) + fp32 master (4) + Adam's two fp32 moments (8)
    assert checkpoint_bytes(model, RunConfig()) == 14 * 10**9
    # PyTorch (FSDP2/DDP): fp32 parameters are the masters (4) + Adam (8)
    assert checkpoint_bytes(model, RunConfig(engine="fsdp2")) == 12 * 10**9
    # the whole replica, not one GPU's shard
    from memfit.parallel.config import Parallel
    sharded = RunConfig(engine="fsdp2", parallel=Parallel(gpus=8, zero=3))
    assert checkpoint_bytes(model, sharded) == 12 * 10**9


@pytest.mark.parametrize("bad", [{"write_bandwidth": 0}, {"write_bandwidth": -1e9},
                                 {"mtbf_s": 0}, {"mtbf_s": -5}, {"spot_discount": 1.0},
                                 {"work_s": 0}])
def test_bad_input_is_refused(bad: dict[str, float]) -> None:
    kwargs = {"checkpoint_bytes": 1e9, "write_bandwidth": 1e9, "mtbf_s": 1e4, "work_s": 1e4,
              **bad}
    with pytest.raises(MemfitError):
        spot_plan(**kwargs)  # type: ignore[arg-type]


def test_a_job_preempted_faster_than_it_progresses_is_refused() -> None:
    # C = 1000 s, M = 600 s: each preemption costs more than the time between them
    with pytest.raises(MemfitError, match="never finishes"):
        spot_plan(checkpoint_bytes=1e12, write_bandwidth=1e9, mtbf_s=600, work_s=3600)


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["spot-plan", "--checkpoint-bytes", "100GB", "--work-hours", "10",
                 "--write-bandwidth", "1GB/s", "--mtbf-hours", "5.5555555555555555",
                 "--price-per-hour", "10", "--discount", "0.6", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["interval_s"] == pytest.approx(2000)
    assert out["spot_cost"] == pytest.approx(44.5623, abs=1e-3)


def test_cli_text_and_default_band(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["spot-plan", "--params", "1e9", "--work-hours", "10",
                 "--write-bandwidth", "1GB/s"]) == 0
    out = capsys.readouterr().out
    # 14 GB at 1 GB/s = 14 s; M = 24 h: sqrt(2 * 14 * 86400) = 1555.4 s = 25 min 55 s
    assert "14.00 GB" in out and "25 min 55 s" in out and "24 h" in out


@pytest.mark.parametrize("argv", [
    ["--write-bandwidth", "0"], ["--write-bandwidth=-1GB/s"],
    ["--write-bandwidth", "1GB/s", "--mtbf-hours", "0"],
    ["--write-bandwidth", "1GB/s", "--mtbf-hours=-2"],
    ["--write-bandwidth", "1GB/s", "--discount", "1.5"],
    # gigabits, not gigabytes: read as bytes it was 8x too fast a write
    ["--write-bandwidth", "8Gb/s"],
    # --gpus multiplies --gpu's price; alone it did nothing
    ["--write-bandwidth", "1GB/s", "--gpus", "8"],
    ["--write-bandwidth", "1GB/s", "--gpus", "8", "--price-per-hour", "10"],
])
def test_cli_bad_input_is_one_line_exit_2(argv: list[str],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["spot-plan", "--params", "1e9", "--work-hours", "10", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("memfit: error:")


@pytest.mark.parametrize("command", [["spot-plan", "--work-hours", "10", "--write-bandwidth",
                                      "1GB/s"], ["plan"]])
@pytest.mark.parametrize("params", ["0.5", "0.6"])
def test_cli_params_below_one_names_what_was_typed(command: list[str], params: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    # 0.5 was rounded to 0 before the check, which then said "got 0"; 0.6 became 1 parameter
    assert main([*command, "--params", params]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"got '{params}'" in err and "0.5B" in err, err


def test_cli_params_with_a_suffix_as_plan_reads_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["spot-plan", "--params", "0.5b", "--work-hours", "10",
                 "--write-bandwidth", "1GB/s"]) == 0
    # 5e8 parameters x 14 bytes (bf16-mixed AdamW) = 7 GB
    assert "7.00 GB" in capsys.readouterr().out


@pytest.mark.parametrize("flag", [["--mode", "lora"], ["--optimizer", "sgd"],
                                  ["--precision", "fp32"], ["--engine", "fsdp2"]])
def test_cli_sizing_flags_with_checkpoint_bytes_are_refused(
        flag: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    # they size a model's checkpoint; with the size given they did nothing
    assert main(["spot-plan", "--checkpoint-bytes", "10GB", "--work-hours", "10",
                 "--write-bandwidth", "1GB/s", *flag]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{flag[0]}: only a model or --params" in err


def test_spot_plan_imports_no_torch() -> None:
    """Like `memfit plan --params`, the planner answers from the formulas alone."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import memfit

    code = ("import sys; from memfit.cli import main; "
            "rc = main(['spot-plan', '--params', '7e9', '--work-hours', '10', "
            "'--write-bandwidth', '1GB/s', '--gpu', 'h100-80gb', '--json']); "
            "assert rc == 0 and 'torch' not in sys.modules, sorted(sys.modules)")
    src = str(Path(memfit.__file__).resolve().parents[1])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": src}, timeout=60)
    assert done.returncode == 0, done.stderr
