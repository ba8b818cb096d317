"""memfit plan --dataloader / --host-memory: the input pipeline per GPU and per node, the node's
RAM warning with settings that fit, and bad settings refused in one line (exit 2)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from memfit.cli import main

GiB = 1 << 30
MiB = 1 << 20


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


PLAN = ("plan", "--params", "7e9", "--gpus", "8", "--zero", "3", "--method", "analytic",
        "--batch", "4")


def test_json_per_gpu_and_per_node(capsys) -> None:
    code, out, _ = cli(capsys, *PLAN, "--json", "--dataloader",
                       "workers=4,prefetch=2,sample-bytes=1MiB,worker-rss=0,depth=2")
    assert code == 0
    data = json.loads(out)
    pipe = data["input_pipeline"]
    # batch = 4 samples x 1 MiB; 4 workers x 2 = 8 batches in flight + 1 in use, in shared
    # memory; each worker 2 batches (WORKER_BATCHES; worker-rss=0)
    assert pipe["host_bytes_per_gpu"] == 9 * 4 * MiB + 4 * 2 * 4 * MiB
    assert pipe["host_bytes_per_node"] == 8 * pipe["host_bytes_per_gpu"]
    assert pipe["device_bytes_per_gpu"] == 2 * 4 * MiB
    assert pipe["fits_host"] is None and pipe["suggestion"] is None
    without = json.loads(cli(capsys, *PLAN, "--json")[1])
    assert data["per_gpu"]["total_bytes"] - without["per_gpu"]["total_bytes"] == 2 * 4 * MiB


def test_host_memory_warning_with_offload_and_a_setting_that_fits(capsys) -> None:
    argv = (*PLAN, "--offload-optimizer", "--dataloader",
            "workers=8,prefetch=4,pin=1,batch-bytes=1GiB,worker-rss=0", "--host-memory", "256GiB")
    data = json.loads(cli(capsys, *argv, "--json")[1])["input_pipeline"]
    # per GPU: 33 pinned 1 GiB batches + 1 being pinned + 8 workers x 2 batches = 50 GiB; x 8
    assert data["host_bytes_per_node"] == 8 * 50 * GiB
    offload = data["offload_bytes_per_node"]
    assert offload > 0 and data["host_bytes_per_node_total"] == 8 * 50 * GiB + offload
    assert data["fits_host"] is False
    s = data["suggestion"]
    # the suggestion fits: 8 x ((w p + 1) + 1 + 2 w) GiB + offload <= 256 GiB
    w, p = s["num_workers"], s["prefetch_factor"]
    assert 8 * (w * p + 2 + 2 * w) * GiB + offload <= 256 * GiB
    code, out, _ = cli(capsys, *argv)
    assert code == 0
    assert "warning: host memory: input pipeline 400.00 GiB + offloaded states" in out
    assert f"fits with workers={w},prefetch={p}" in out


@pytest.mark.parametrize(("setting", "message"), [
    ("prefetch=2,sample-bytes=1KiB", "prefetch_factor needs worker processes"),
    ("workers=-2,sample-bytes=1KiB", "must be an integer >= 0"),
    ("workers=2,depth=-1,sample-bytes=1KiB", "depth='-1'"),
    ("workers=2,bogus=1", "unknown key 'bogus'"),
])
def test_bad_settings_exit_2_in_one_line(capsys, setting: str, message: str) -> None:
    code, out, err = cli(capsys, *PLAN, "--dataloader", setting)
    assert code == 2 and out == ""
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_host_memory_needs_dataloader_and_trace_is_refused(capsys) -> None:
    code, _, err = cli(capsys, *PLAN, "--host-memory", "1TiB")
    assert code == 2 and "give --dataloader too" in err
    code, _, err = cli(capsys, "plan", "gpt2", "--method", "trace", "--dataloader", "workers=2")
    assert code == 2 and "add --method analytic" in err


def test_a_language_models_default_sample_and_no_torch() -> None:
    code = ("import json, sys\n"
            "from memfit.cli import main\n"
            "main(['plan', 'gpt2', '--method', 'analytic', '--batch', '8', '--seq', '1024', "
            "'--json', '--dataloader', 'workers=2,worker-rss=0'])\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    pipe = json.loads(out.stdout)["input_pipeline"]
    assert pipe["spec"]["batch_bytes"] == 8 * 1024 * 2 * 8  # int64 ids + labels per token
