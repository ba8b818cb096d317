"""Watch memory while a job runs: GPUs through NVML, the host through psutil or /proc/meminfo.

- :func:`read_memory` takes one reading (what ``memfit monitor --once --json`` prints).
- :func:`watch` raises an alert when a device passes a fraction of its memory, from a training
  loop (``watcher.check()`` once per step: deterministic, no thread) or a background thread
  (``interval=`` seconds).
- :class:`PrometheusExporter` serves the readings at ``/metrics`` (bound to 127.0.0.1).
- :func:`model_memory` counts a model's weights, gradients and optimizer states by storage, for
  the Hugging Face and Lightning callbacks.

NVML comes from ``nvidia-ml-py`` (``pip install 'memfit[monitor]'``). Without it, CUDA devices are
read through ``torch.cuda.mem_get_info``; with no GPU at all, only host memory is shown, and
torch (seconds to import) is not imported unless the host has a GPU driver's device files
(:func:`gpu_device_files`).
"""

from __future__ import annotations

import glob
import importlib.util
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from memfit.errors import MemfitError

log = logging.getLogger("memfit")


@dataclass(frozen=True, kw_only=True)
class GpuMemory:
    """One GPU's memory."""

    index: int
    name: str
    used_bytes: int
    """In use by every process on the device (NVML, or total minus free from CUDA)."""
    total_bytes: int
    process_bytes: int | None
    """Held by this process: NVML's per-process figure, or ``torch.cuda.memory_reserved``."""

    @property
    def fraction(self) -> float:
        return self.used_bytes / self.total_bytes if self.total_bytes else 0.0


@dataclass(frozen=True, kw_only=True)
class HostMemory:
    used_bytes: int
    """Total minus available (what new allocations cannot have)."""
    total_bytes: int
    available_bytes: int

    @property
    def fraction(self) -> float:
        return self.used_bytes / self.total_bytes if self.total_bytes else 0.0


@dataclass(frozen=True, kw_only=True)
class MemoryReading:
    gpus: tuple[GpuMemory, ...]
    host: HostMemory
    gpu_source: str
    """``nvml``, ``torch`` or ``none``."""
    note: str | None = None
    """Why GPUs are missing or read another way, for the user."""
    time: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        for g, d in zip(self.gpus, doc["gpus"], strict=True):
            d["fraction"] = round(g.fraction, 6)
        doc["host"]["fraction"] = round(self.host.fraction, 6)
        return doc


# -- reading ----------------------------------------------------------------------------------

def read_host() -> HostMemory:
    """Host memory from psutil if installed, else ``/proc/meminfo`` (Linux)."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        vm = psutil.virtual_memory()
        return HostMemory(used_bytes=int(vm.total - vm.available), total_bytes=int(vm.total),
                          available_bytes=int(vm.available))
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if ":" in line}
    except OSError:
        raise MemfitError("cannot read host memory: /proc/meminfo is missing and psutil is not "
                          "installed; `pip install psutil`") from None
    total, available = info["MemTotal"], info.get("MemAvailable", info.get("MemFree", 0))
    return HostMemory(used_bytes=total - available, total_bytes=total, available_bytes=available)


def read_gpus() -> tuple[list[GpuMemory], str, str | None]:
    """``(gpus, source, note)``: NVML if available, else CUDA through torch, else none."""
    try:
        import pynvml
    except ImportError:
        pynvml = None
    nvml_error = None
    if pynvml is not None:
        try:
            return _read_nvml(pynvml), "nvml", None
        except pynvml.NVMLError as exc:
            nvml_error = str(exc)
    if not _torch_might_see_a_gpu():
        return _no_gpu(nvml_error)
    import torch

    if torch.cuda.is_available():
        gpus = []
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            gpus.append(GpuMemory(index=i, name=torch.cuda.get_device_name(i),
                                  used_bytes=int(total - free), total_bytes=int(total),
                                  process_bytes=int(torch.cuda.memory_reserved(i))))
        note = ("nvidia-ml-py is not installed: GPUs read through torch.cuda "
                "(`pip install 'memfit[monitor]'` for NVML)") if pynvml is None else None
        return gpus, "torch", note
    return _no_gpu(nvml_error)


def _no_gpu(nvml_error: str | None) -> tuple[list[GpuMemory], str, str | None]:
    if nvml_error is not None:
        return [], "none", f"no GPU: NVML failed ({nvml_error}); showing host memory only"
    return [], "none", "no GPU found: showing host memory only"


_GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/nvidia[0-9]*", "/proc/driver/nvidia/version",
                     "/dev/kfd", "/dev/dxg")
"""The files a GPU driver makes on Linux: NVIDIA's, ROCm's (``/dev/kfd``: torch.cuda on AMD)
and WSL2's (``/dev/dxg``). torch.cuda finds no device without one of them."""


def gpu_device_files() -> list[str]:
    """The GPU driver device files on this host (Linux; empty elsewhere or with no GPU)."""
    return sorted(f for pattern in _GPU_DEVICE_FILES for f in glob.glob(pattern))


def _torch_might_see_a_gpu() -> bool:
    """Whether ``torch.cuda`` could find a device: torch is imported already (asking is then
    free), or it is installed and this host has a GPU driver's device files (on Linux; off
    Linux there is no such cheap check, so torch is asked). Without them the host-only
    reading skips importing torch, which takes seconds."""
    if "torch" in sys.modules:
        return True
    if importlib.util.find_spec("torch") is None:
        return False
    return not sys.platform.startswith("linux") or bool(gpu_device_files())


def _read_nvml(pynvml: Any) -> list[GpuMemory]:
    pynvml.nvmlInit()
    try:
        pid = os.getpid()
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            if isinstance(name, bytes):
                name = name.decode()
            mine: int | None = None
            try:
                for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    if proc.pid == pid and proc.usedGpuMemory is not None:
                        mine = (mine or 0) + int(proc.usedGpuMemory)
            except pynvml.NVMLError:
                mine = None
            gpus.append(GpuMemory(index=i, name=str(name), used_bytes=int(mem.used),
                                  total_bytes=int(mem.total), process_bytes=mine))
        return gpus
    finally:
        pynvml.nvmlShutdown()


def read_memory() -> MemoryReading:
    """One reading of every GPU and the host.

    >>> r = read_memory()
    >>> 0 < r.host.used_bytes <= r.host.total_bytes
    True
    """
    gpus, source, note = read_gpus()
    return MemoryReading(gpus=tuple(gpus), host=read_host(), gpu_source=source, note=note)


# -- alerts -----------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Alert:
    """A device passed the threshold."""

    device: str
    """``cuda:0`` ... or ``host``."""
    used_bytes: int
    total_bytes: int
    fraction: float
    threshold: float


def check_threshold(threshold: float, what: str = "threshold") -> float:
    if not isinstance(threshold, int | float) or not 0.0 < float(threshold) <= 1.0:
        raise MemfitError(f"{what} must be a fraction of memory in (0, 1], e.g. 0.9; got "
                          f"{threshold!r}")
    return float(threshold)


class Watcher:
    """Calls ``on_alert`` when a device's used memory passes ``threshold`` (once per crossing:
    it re-arms after usage falls back below). See :func:`watch`.

    Known limitations: it reads device-wide usage (every process on the GPU), between steps or
    every ``interval`` seconds: a spike inside one step that OOMs is not caught in time; profile
    that step with ``memfit profile`` instead.
    """

    def __init__(self, threshold: float, on_alert: Callable[[Alert], Any] | None, *,
                 interval: float | None, host: bool | None,
                 reader: Callable[[], MemoryReading] = read_memory) -> None:
        self.threshold = check_threshold(threshold)
        if interval is not None and not interval > 0:
            raise MemfitError(f"interval must be a positive number of seconds, got {interval!r}")
        self.on_alert = on_alert or _log_alert
        self.interval = interval
        self.host = host
        self.reader = reader
        self.alerts: list[Alert] = []
        self.last: MemoryReading | None = None
        self._over: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self) -> list[Alert]:
        """Read memory now; fire and return the alerts of devices that just crossed."""
        reading = self.reader()
        self.last = reading
        devices = [(f"cuda:{g.index}", g.used_bytes, g.total_bytes) for g in reading.gpus]
        if self.host or (self.host is None and not reading.gpus):
            h = reading.host
            devices.append(("host", h.used_bytes, h.total_bytes))
        fired = []
        for name, used, total in devices:
            fraction = used / total if total else 0.0
            if fraction >= self.threshold:
                if name not in self._over:
                    self._over.add(name)
                    alert = Alert(device=name, used_bytes=used, total_bytes=total,
                                  fraction=fraction, threshold=self.threshold)
                    fired.append(alert)
            else:
                self._over.discard(name)
        for alert in fired:
            self.alerts.append(alert)
            self.on_alert(alert)
        return fired

    def start(self) -> Watcher:
        if self.interval is None:
            raise MemfitError("this watcher has no interval; call watcher.check() each step, or "
                              "create it with memfit.watch(..., interval=1.0) for a thread")
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="memfit-watch", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        assert self.interval is not None
        while not self._stop.is_set():
            try:
                self.check()
            except Exception:  # a failing reader must not kill training; say so once
                log.exception("memfit.watch: reading memory failed; the watcher stops")
                return
            self._stop.wait(self.interval)

    def __enter__(self) -> Watcher:
        return self.start() if self.interval is not None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _log_alert(alert: Alert) -> None:
    log.warning("memfit: %s memory at %.1f%% (threshold %.0f%%): %d of %d bytes in use",
                alert.device, 100 * alert.fraction, 100 * alert.threshold, alert.used_bytes,
                alert.total_bytes)


def watch(threshold: float = 0.9, on_alert: Callable[[Alert], Any] | None = None, *,
          interval: float | None = None, host: bool | None = None) -> Watcher:
    """Alert before an OOM: ``on_alert(alert)`` when a device's used memory reaches
    ``threshold`` of its total (default: a warning on the ``memfit`` logger).

    Per step (no thread)::

        watcher = memfit.watch(0.9, on_alert=print)
        for batch in loader:
            train_step(batch)
            watcher.check()

    Or in the background: ``with memfit.watch(0.9, interval=1.0): train()``. ``host``: also watch
    host memory (default: only when there is no GPU).
    """
    return Watcher(threshold, on_alert, interval=interval, host=host)


# -- categories of a live model -----------------------------------------------------------------

def model_memory(model: Any, optimizer: Any = None) -> dict[str, int]:
    """Bytes of ``model``'s weights (parameters and buffers), gradients and ``optimizer``'s
    states, counted once per storage; on CUDA also ``allocated`` and ``reserved`` (this
    process) and ``other`` (allocated minus the three: activations and temporaries).

    >>> import torch
    >>> model_memory(torch.nn.Linear(4, 2))["weights"]
    40
    """
    import torch

    seen: dict[tuple[str, int], int] = {}
    totals = {"weights": 0, "gradients": 0, "optimizer_states": 0}

    def add(t: Any, key: str) -> None:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                return
            k = (str(t.device), st.data_ptr())
            if st.nbytes() and k not in seen:
                seen[k] = st.nbytes()
                totals[key] += st.nbytes()

    if model is not None:
        for p in model.parameters():
            add(p, "weights")
        for b in model.buffers():
            add(b, "weights")
        for p in model.parameters():
            add(p.grad, "gradients")
    if optimizer is not None:
        for state in optimizer.state.values():
            for v in state.values() if isinstance(state, dict) else ():
                add(v, "optimizer_states")
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        allocated = int(torch.cuda.memory_allocated())
        totals["allocated"] = allocated
        totals["reserved"] = int(torch.cuda.memory_reserved())
        totals["other"] = max(0, allocated - sum(
            totals[k] for k in ("weights", "gradients", "optimizer_states")))
    return totals


# -- Prometheus -------------------------------------------------------------------------------

def _label(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def prometheus_text(reading: MemoryReading) -> str:
    """The reading in the Prometheus text exposition format."""
    lines: list[str] = []

    def metric(name: str, help_: str, samples: list[tuple[str, int | float]]) -> None:
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} gauge")
        lines.extend(f"{name}{labels} {value}" for labels, value in samples)

    gpu_labels = [(f'{{gpu="{g.index}",name="{_label(g.name)}"}}', g) for g in reading.gpus]
    metric("memfit_gpu_memory_used_bytes", "GPU memory in use by all processes.",
           [(lab, g.used_bytes) for lab, g in gpu_labels])
    metric("memfit_gpu_memory_total_bytes", "GPU memory in total.",
           [(lab, g.total_bytes) for lab, g in gpu_labels])
    metric("memfit_gpu_memory_process_bytes", "GPU memory held by the monitored process.",
           [(lab, g.process_bytes) for lab, g in gpu_labels if g.process_bytes is not None])
    metric("memfit_host_memory_used_bytes", "Host memory in use (total minus available).",
           [("", reading.host.used_bytes)])
    metric("memfit_host_memory_total_bytes", "Host memory in total.",
           [("", reading.host.total_bytes)])
    return "\n".join(lines) + "\n"


class PrometheusExporter:
    """Serves ``/metrics`` (a fresh reading per scrape) from a background thread.

    >>> exporter = PrometheusExporter(0).start()   # port 0: any free port
    >>> exporter.port > 0
    True
    >>> exporter.close()
    """

    def __init__(self, port: int, *, bind: str = "127.0.0.1",
                 reader: Callable[[], MemoryReading] = read_memory) -> None:
        if not 0 <= port <= 65535:
            raise MemfitError(f"port must be in 0..65535, got {port}")
        self.reader = reader
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?")[0] not in ("/metrics", "/"):
                    self.send_error(404, "only /metrics is served")
                    return
                body = prometheus_text(exporter.reader()).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                return

        try:
            self.server = ThreadingHTTPServer((bind, port), Handler)
        except OSError as exc:
            raise MemfitError(f"cannot serve metrics on {bind}:{port} ({exc.strerror}); choose "
                              "another --prometheus port") from None
        self.server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def start(self) -> PrometheusExporter:
        self._thread = threading.Thread(target=self.server.serve_forever,
                                        name="memfit-prometheus", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread is not None:  # shutdown() waits for serve_forever: only if it runs
            self.server.shutdown()
            self._thread.join()
            self._thread = None
        self.server.server_close()


def reading_json(reading: MemoryReading) -> str:
    return json.dumps(reading.to_dict(), indent=2)
