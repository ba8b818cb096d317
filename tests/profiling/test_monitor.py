"""memfit monitor, memfit.watch, the Prometheus exporter and the training callbacks."""

from __future__ import annotations

import argparse
import json
import socket
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from torch import nn

from memfit.errors import MemfitError
from memfit.monitor import (
    GpuMemory,
    HostMemory,
    MemoryReading,
    PrometheusExporter,
    Watcher,
    model_memory,
    prometheus_text,
    read_memory,
    watch,
)

F32 = 4


def _meminfo_total() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no MemTotal")


def _reading(gpu_used: int, host_used: int = 10, total: int = 100) -> MemoryReading:
    return MemoryReading(
        gpus=(GpuMemory(index=0, name='A "quoted"\nGPU', used_bytes=gpu_used, total_bytes=total,
                        process_bytes=gpu_used // 2),),
        host=HostMemory(used_bytes=host_used, total_bytes=total,
                        available_bytes=total - host_used),
        gpu_source="nvml")


@pytest.mark.skipif(not Path("/proc/meminfo").exists(), reason="needs Linux /proc/meminfo")
def test_host_memory_matches_proc_meminfo() -> None:
    r = read_memory()
    assert r.host.total_bytes == _meminfo_total()
    assert 0 < r.host.used_bytes < r.host.total_bytes
    assert r.host.used_bytes + r.host.available_bytes == r.host.total_bytes


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_no_gpu_says_host_only() -> None:
    r = read_memory()
    assert r.gpus == () and r.gpu_source == "none"
    assert r.note is not None and "host memory only" in r.note


def test_watch_fires_once_per_crossing_and_rearms() -> None:
    readings = iter([_reading(50), _reading(95), _reading(97), _reading(40), _reading(92)])
    seen = []
    w = Watcher(0.9, seen.append, interval=None, host=None, reader=lambda: next(readings))
    assert w.check() == []                  # 50%
    fired = w.check()                       # 95%: crossed
    assert [a.device for a in fired] == ["cuda:0"] and fired[0].fraction == 0.95
    assert w.check() == []                  # 97%: still over, no repeat
    assert w.check() == []                  # 40%: re-armed
    assert [a.used_bytes for a in w.check()] == [92]
    assert [a.used_bytes for a in seen] == [95, 92]


def test_watch_host_memory_for_real() -> None:
    alerts = []
    over = watch(threshold=1e-6, on_alert=alerts.append, host=True)
    assert [a.device for a in over.check()][-1] == "host"
    assert over.check() == []               # still over: once per crossing
    assert [a.device for a in alerts][-1] == "host"
    never = watch(threshold=1.0, on_alert=alerts.append, host=True)
    n = len(alerts)
    never.check()
    assert len(alerts) == n                 # used < total, always


def test_watch_background_thread() -> None:
    fired = threading.Event()
    with watch(threshold=1e-6, on_alert=lambda a: fired.set(), interval=0.01, host=True) as w:
        assert fired.wait(timeout=30)
    assert w._thread is None                # stopped and joined on exit


@pytest.mark.parametrize("bad", [0, 1.5, -0.1, "0.9"])
def test_watch_rejects_bad_thresholds(bad: object) -> None:
    with pytest.raises(MemfitError, match=r"fraction of memory in \(0, 1\]"):
        watch(threshold=bad)  # type: ignore[arg-type]


def test_watch_without_interval_cannot_start() -> None:
    with pytest.raises(MemfitError, match=r"watcher\.check"):
        watch(0.9).start()


def test_prometheus_text_escapes_labels() -> None:
    text = prometheus_text(_reading(50, host_used=10))
    assert 'memfit_gpu_memory_used_bytes{gpu="0",name="A \\"quoted\\"\\nGPU"} 50' in text
    assert "memfit_gpu_memory_process_bytes{" in text and "} 25\n" in text
    assert "memfit_host_memory_used_bytes 10\n" in text
    assert "# TYPE memfit_host_memory_total_bytes gauge" in text


def test_prometheus_exporter_on_localhost() -> None:
    exporter = PrometheusExporter(0, reader=lambda: _reading(70, host_used=33)).start()
    try:
        assert exporter.server.server_address[0] == "127.0.0.1"
        url = f"http://127.0.0.1:{exporter.port}"
        with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
            assert resp.status == 200
            body = resp.read().decode()
        assert "memfit_host_memory_used_bytes 33" in body
        assert 'memfit_gpu_memory_used_bytes{gpu="0"' in body
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(url + "/secret", timeout=10)
        assert err.value.code == 404
    finally:
        exporter.close()


def test_model_memory_by_category() -> None:
    model = nn.Linear(4, 2)                 # 8 + 2 floats = 40 bytes
    opt = torch.optim.Adam(model.parameters())
    assert model_memory(model, opt) == {"weights": 40, "gradients": 0, "optimizer_states": 0}
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    # Adam: exp_avg + exp_avg_sq per parameter and one float32 `step` per parameter tensor.
    assert model_memory(model, opt) == {"weights": 40, "gradients": 40,
                                        "optimizer_states": 2 * 40 + 2 * F32}


# -- the CLI ----------------------------------------------------------------------------------

def _cli(argv: list[str]) -> int:
    from memfit.cli import monitor as monitor_cli

    parser = argparse.ArgumentParser()
    monitor_cli.register(parser.add_subparsers())
    args = parser.parse_args(["monitor", *argv])
    return int(args.func(args))


def test_cli_once_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli(["--once", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) >= {"gpus", "host", "gpu_source", "note"}
    assert doc["host"]["total_bytes"] > 0
    assert 0.0 < doc["host"]["fraction"] < 1.0


def test_cli_live_view_refreshes(capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli(["--count", "2", "--interval", "0.01", "--threshold", "0.000001"]) == 0
    out = capsys.readouterr().out
    assert "host" in out and "memfit monitor" in out
    assert "host above 0% of its memory" in out     # the alert line (and the bell)


def test_cli_prometheus_serves_and_stops(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert _cli(["--prometheus", str(port), "--count", "1", "--interval", "0.01"]) == 0
    assert f"http://127.0.0.1:{port}/metrics" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "match"), [
    (["--threshold", "2"], "fraction of memory"),
    (["--threshold", "x"], "must be a number"),
    (["--interval", "0"], "positive number of seconds"),
    (["--count", "0"], "positive integer"),
])
def test_cli_bad_input(argv: list[str], match: str) -> None:
    with pytest.raises(MemfitError, match=match):
        _cli(argv)


# -- callbacks --------------------------------------------------------------------------------

def test_integrations_import_lazily() -> None:
    import sys

    import memfit.integrations

    assert "memfit.integrations.huggingface" not in sys.modules or "transformers" in sys.modules
    with pytest.raises(AttributeError):
        memfit.integrations.Nope  # noqa: B018


def test_hf_trainer_callback(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from memfit.integrations import MemfitTrainerCallback

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 4)                  # 32 + 4 = 36 floats

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": nn.functional.mse_loss(self.lin(x), labels)}

    class SeeLogs(TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.logs: list[dict[str, object]] = []

        def on_log(self, args: object, state: object, control: object,
                   logs: dict[str, object] | None = None, **kwargs: object) -> None:
            self.logs.append(dict(logs or {}))

    data = [{"x": torch.randn(8), "labels": torch.randn(4)} for _ in range(16)]
    callback = MemfitTrainerCallback(every_n_steps=2)
    later = SeeLogs()
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2,
                             logging_steps=2, report_to=[], save_strategy="no", use_cpu=True,
                             remove_unused_columns=False, disable_tqdm=True)
    trainer = Trainer(model=Tiny(), args=args, train_dataset=data, callbacks=[callback, later])
    trainer.train()
    assert [e["step"] for e in callback.history] == [2, 4]
    params = 36 * F32
    for entry in callback.history:
        assert entry["weights"] == params
        # AdamW: two moments per parameter plus one float32 step per tensor (2 tensors).
        assert entry["optimizer_states"] == 2 * params + 2 * F32
    # Callbacks that run after it (here SeeLogs, and the console printer) get the keys.
    logged = [e for e in later.logs if "memfit/weights_bytes" in e]
    assert len(logged) == 2 and logged[0]["memfit/weights_bytes"] == params
    with pytest.raises(MemfitError, match="every_n_steps"):
        MemfitTrainerCallback(every_n_steps=0)


def test_lightning_callback() -> None:
    lightning = pytest.importorskip("lightning", reason="lightning is not installed")
    from memfit.integrations import MemfitLightningCallback

    class Module(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 4)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.lin(batch).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    callback = MemfitLightningCallback(every_n_steps=2)
    trainer = lightning.Trainer(max_steps=4, callbacks=[callback], accelerator="cpu",
                                logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False)
    loader = torch.utils.data.DataLoader(torch.randn(16, 8), batch_size=2)
    trainer.fit(Module(), loader)
    assert [e["step"] for e in callback.history] == [2, 4]
    assert callback.history[0]["weights"] == 36 * F32
    assert callback.history[0]["optimizer_states"] == 36 * F32   # one momentum buffer each
