"""The on-disk cache of CPU-kernel scratch measurements (see :mod:`memfit.trace.cpu_kernels`).

Measuring a kernel's scratch means running it for real under the profiler; a 1B-parameter bf16
step on a CPU target measures dozens of signatures. The results depend only on the kernel, its
argument signature (shapes, strides, dtypes, scalars) and the machine and build that run it, so
they are kept across processes in one JSON file per machine fingerprint:

    $MEMFIT_CACHE_DIR, else $XDG_CACHE_HOME/memfit, else ~/.cache/memfit
        cpu-kernels-<hash of the fingerprint>.json

The fingerprint holds everything that selects a kernel path or sizes its buffers: the torch
version and git revision, the CPU capability ATen dispatches to (and ``ATEN_CPU_CAPABILITY``),
oneDNN's ISA limit (``ONEDNN_MAX_CPU_ISA`` / ``DNNL_MAX_CPU_ISA``) and fp-math mode, the CPU model
and flags (AVX-512-bf16 and AMX change oneDNN's bf16 GEMM scratch), the float32 matmul precision
and the intra-op thread count (CPU flash attention keeps one buffer per thread); and the
measuring code itself (a hash of ``cpu_kernels.py`` and ``cpu_peak.py``), so a memfit that
measures differently never reads an older memfit's numbers.

``MEMFIT_NO_CACHE=1`` turns the disk cache off (measurements then live for the process only).
The file is JSON, never pickle: a file that does not parse, or whose fingerprint or entries are
not what this module writes, is ignored and replaced at the next write. Writes go to a temporary
file renamed over the old one, so a reader never sees half a file; two processes writing at once
may each drop the other's new entries (they are measured again later), never corrupt them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Any

import torch

from memfit._files import write_atomic

FORMAT = 1
_ENV_VARS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA",
             "ONEDNN_DEFAULT_FPMATH_MODE", "DNNL_DEFAULT_FPMATH_MODE")
_loaded: dict[Path, dict[str, list[int | None]]] = {}
_cpu_id: str | None = None
_method: str | None = None


def cache_dir() -> Path | None:
    """Where the cache lives, or None when ``MEMFIT_NO_CACHE`` turns it off."""
    if os.environ.get("MEMFIT_NO_CACHE", "") not in ("", "0"):
        return None
    explicit = os.environ.get("MEMFIT_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME")
    if not base:
        try:
            base = str(Path.home() / ".cache")
        except RuntimeError:  # no home directory to be found: no disk cache
            return None
    return Path(base) / "memfit"


def _cpu_identity() -> str:
    """The CPU's model name and feature flags (Linux: /proc/cpuinfo), else the platform's
    processor string."""
    global _cpu_id
    if _cpu_id is None:
        model = flags = ""
        with contextlib.suppress(OSError):
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                name, _, value = line.partition(":")
                name = name.strip()
                if name == "model name" and not model:
                    model = value.strip()
                elif name in ("flags", "Features") and not flags:
                    flags = " ".join(sorted(value.split()))
                if model and flags:
                    break
        _cpu_id = f"{model or platform.processor()} | {flags}"
    return _cpu_id


def _method_hash() -> str:
    """A hash of the code that measures (module docstring)."""
    global _method
    if _method is None:
        from memfit import cpu_peak

        h = hashlib.sha256()
        # cpu_kernels.py by path: it imports this module, which must not import it back
        for path in (Path(__file__).with_name("cpu_kernels.py"), Path(cpu_peak.__file__)):
            with contextlib.suppress(OSError, TypeError):
                h.update(path.read_bytes())
        _method = h.hexdigest()[:16]
    return _method


def machine() -> dict[str, Any]:
    """The machine and build a CPU measurement holds for: :func:`fingerprint` without the
    measuring code's hash (the fit's CPU rates, :mod:`memfit.fitting.rates`, key on it too)."""
    return {
        "torch": torch.__version__,
        "git": getattr(torch.version, "git_version", None),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "env": {k: os.environ.get(k) for k in _ENV_VARS},
        "machine": platform.machine(),
        "cpu": hashlib.sha256(_cpu_identity().encode()).hexdigest()[:16],
        "mkldnn": bool(torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "threads": torch.get_num_threads(),
    }


def fingerprint() -> dict[str, Any]:
    """What a cached measurement is valid for (module docstring)."""
    return {**machine(), "method": _method_hash()}


def _encode(x: Any) -> Any:
    """A JSON value that writes ``x`` (part of an op signature) down exactly, or raises
    ``TypeError`` for anything else (such a signature is kept in memory only)."""
    if x is None or isinstance(x, bool | int | str):
        return x
    if isinstance(x, float):
        return {"f": x.hex()}  # exact, and distinct from an int of the same value
    if isinstance(x, list | tuple):
        return [_encode(v) for v in x]
    if isinstance(x, torch.dtype | torch.device | torch.layout | torch.memory_format):
        return {type(x).__name__: str(x)}
    raise TypeError(type(x).__name__)


def entry_key(key: tuple[Any, Any, Any]) -> str | None:
    """The cache key of ``(func, argument signature, keyword signature)``, or None when the
    signature holds a value this cache cannot write down exactly."""
    func, args, kwargs = key
    if not isinstance(func, torch._ops.OpOverload):
        return None
    try:
        return json.dumps([str(func._schema), _encode(args), _encode(kwargs)],
                          separators=(",", ":"))
    except (TypeError, ValueError):
        return None


def _path() -> tuple[Path, dict[str, Any]] | None:
    d = cache_dir()
    if d is None:
        return None
    fp = fingerprint()
    digest = hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:20]
    return d / f"cpu-kernels-{digest}.json", fp


def _valid(value: Any) -> bool:
    return (isinstance(value, list) and len(value) == 2
            and all(v is None or (type(v) is int and v >= 0) for v in value))


def _load(path: Path, fp: dict[str, Any]) -> dict[str, list[int | None]]:
    entries = _loaded.get(path)
    if entries is not None:
        return entries
    entries = {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        data = None  # missing or not JSON: start afresh (rewritten at the next put)
    if (isinstance(data, dict) and data.get("format") == FORMAT and data.get("machine") == fp
            and isinstance(data.get("entries"), dict)):
        entries = {k: v for k, v in data["entries"].items() if _valid(v)}
    _loaded[path] = entries
    return entries


def get(key: str) -> tuple[int | None, int | None] | None:
    """``(peak, workspace)`` cached for ``key`` on this machine, or None."""
    where = _path()
    if where is None:
        return None
    value = _load(*where).get(key)
    return (value[0], value[1]) if value is not None else None


def put(key: str, peak: int | None, workspace: int | None) -> None:
    """Record a measurement and write the file (best effort: an unwritable place is skipped)."""
    where = _path()
    if where is None:
        return
    path, fp = where
    entries = _load(path, fp)
    entries[key] = [peak, workspace]
    body = json.dumps({"format": FORMAT, "machine": fp, "entries": entries}, sort_keys=True)
    with contextlib.suppress(OSError):  # an unwritable cache only costs the next run time
        write_atomic(path, body)


def forget_loaded() -> None:
    """Drop what this process read from disk (the next lookup reads the file again)."""
    _loaded.clear()
