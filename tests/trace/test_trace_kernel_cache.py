"""The on-disk cache of CPU-kernel scratch measurements (memfit/trace/kernel_cache.py).

A cached measurement must give the same estimate as a fresh one, run no kernel, and a cache file
that is not what memfit writes (garbage, a pickle, wrong-typed entries) must be ignored and
replaced, never trusted or unpickled.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from memfit.trace import cpu_kernels, estimate, kernel_cache


def _model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 16 * 16, 10))
    return model, torch.randn(2, 3, 16, 16)


def _trace() -> Any:
    model, x = _model()
    return estimate(model, x, optimizer="adamw", precision="bf16-mixed", device="cpu", steps=1)


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[int]:
    """A fresh cache directory, an empty in-memory cache, and a counter of real kernel runs."""
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MEMFIT_NO_CACHE", raising=False)
    cpu_kernels.clear_memory_cache()
    runs = [0]
    measure = cpu_kernels._measure

    def counting(*args: Any) -> Any:
        runs[0] += 1
        return measure(*args)

    monkeypatch.setattr(cpu_kernels, "_measure", counting)
    yield runs
    cpu_kernels.clear_memory_cache()


def _cache_file(tmp_path: Path) -> Path:
    files = list(tmp_path.glob("cpu-kernels-*.json"))
    assert len(files) == 1, files
    return files[0]


def test_second_process_reads_the_cache_and_runs_no_kernel(counted: list[int],
                                                           tmp_path: Path) -> None:
    """The first trace measures the conv and bf16 GEMM kernels for real and writes them; with
    the process's memory cleared (as in a new process) the same trace runs no kernel and gives
    the same peak, to the byte, and the same per-op peaks."""
    fresh = _trace()
    assert counted[0] > 0  # the convolution is always measured on a CPU target
    data = json.loads(_cache_file(tmp_path).read_text())
    assert data["format"] == kernel_cache.FORMAT and data["machine"] == kernel_cache.fingerprint()
    assert len(data["entries"]) == counted[0]
    cpu_kernels.clear_memory_cache()
    before = counted[0]
    cached = _trace()
    assert counted[0] == before
    assert cached.peak_bytes == fresh.peak_bytes
    assert cached.op_peaks == fresh.op_peaks


@pytest.mark.parametrize("content", [
    b"\x00\xffnot json", pickle.dumps({"format": 1, "entries": {}}), b'{"format": 1',
    b"[1, 2, 3]",
], ids=["garbage", "pickle", "truncated", "list"])
def test_unreadable_cache_is_ignored_and_rewritten(counted: list[int], tmp_path: Path,
                                                   content: bytes) -> None:
    """Garbage, a pickle (never unpickled: JSON only), truncated JSON or the wrong shape: the
    trace measures afresh, gives the uncached answer and leaves a valid file behind."""
    fresh = _trace()
    path = _cache_file(tmp_path)
    path.write_bytes(content)
    cpu_kernels.clear_memory_cache()
    runs = counted[0]
    again = _trace()
    assert counted[0] == 2 * runs  # every signature measured again
    assert again.peak_bytes == fresh.peak_bytes
    assert len(json.loads(path.read_text())["entries"]) == runs


def test_wrong_typed_entries_are_not_trusted(counted: list[int], tmp_path: Path) -> None:
    """An entry whose value is not ``[bytes or null, bytes or null]`` is dropped and measured."""
    fresh = _trace()
    path = _cache_file(tmp_path)
    data = json.loads(path.read_text())
    data["entries"] = {k: ["many", None] for k in data["entries"]}
    path.write_text(json.dumps(data))
    cpu_kernels.clear_memory_cache()
    runs = counted[0]
    assert _trace().peak_bytes == fresh.peak_bytes
    assert counted[0] == 2 * runs


def test_fingerprint_separates_isa_limits_threads_and_method(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """oneDNN's ISA limit, the thread count (CPU flash attention keeps a buffer per thread) and
    the measuring code's hash select another cache file."""
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    base = kernel_cache._path()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert kernel_cache._path()[0] != base[0]
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert kernel_cache._path()[0] != base[0]
    finally:
        torch.set_num_threads(threads)
    assert kernel_cache._path() == base
    monkeypatch.setattr(kernel_cache, "_method", "another memfit")
    assert kernel_cache._path()[0] != base[0]


def test_no_cache_writes_nothing(counted: list[int], monkeypatch: pytest.MonkeyPatch,
                                 tmp_path: Path) -> None:
    monkeypatch.setenv("MEMFIT_NO_CACHE", "1")
    _trace()
    assert counted[0] > 0
    assert list(tmp_path.iterdir()) == []


def test_entry_keys_are_exact() -> None:
    """1 and 1.0 are different scalars to a kernel; a value JSON cannot write exactly keeps the
    signature out of the disk cache."""
    op = torch.ops.aten.add.Tensor
    sig = ("T", (2, 3), (3, 1), torch.float32, 0)
    one, one_f = kernel_cache.entry_key((op, (sig, 1), ())), kernel_cache.entry_key(
        (op, (sig, 1.0), ()))
    assert one is not None and one_f is not None and one != one_f
    assert kernel_cache.entry_key((op, (sig, object()), ())) is None


def test_cache_location(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """$MEMFIT_CACHE_DIR, else $XDG_CACHE_HOME/memfit; MEMFIT_NO_CACHE=1 turns it off."""
    monkeypatch.delenv("MEMFIT_NO_CACHE", raising=False)
    monkeypatch.delenv("MEMFIT_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kernel_cache.cache_dir() == tmp_path / "xdg" / "memfit"
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path / "here"))
    assert kernel_cache.cache_dir() == tmp_path / "here"
    monkeypatch.setenv("MEMFIT_NO_CACHE", "1")
    assert kernel_cache.cache_dir() is None
