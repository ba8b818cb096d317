"""Technique 10, allocator settings: applied before CUDA initialises, at runtime where PyTorch
allows it, a clear error otherwise; predicted effect through the trace engine's allocator model.

There is no caching allocator on CPU, so the measured effect needs a GPU (the ``gpu`` test at the
end runs two fresh processes and compares ``torch.cuda.max_memory_reserved``).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from memfit.errors import MemfitError
from memfit.runtime import allocator_options_from_env
from memfit.techniques.allocator import configure_allocator
from memfit.trace import estimate

OLD, NEW = "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    # setenv first: monkeypatch then restores the variables (unset) after the test, so what
    # configure_allocator writes cannot reach other tests' estimates (they read the variable).
    for name in (OLD, NEW):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    return monkeypatch


def test_before_cuda_sets_the_variable(clean_env: pytest.MonkeyPatch) -> None:
    s = configure_allocator(expandable_segments=True, max_split_size_mb=128)
    assert os.environ[OLD] == "expandable_segments:True,max_split_size_mb:128"
    assert NEW not in os.environ
    assert (s.applied, s.variables, s.expandable_segments) == ("env", (OLD,), True)
    # The string is one PyTorch's parser accepts (memfit's port of parseArgs).
    assert allocator_options_from_env(os.environ[OLD]) == {
        "expandable_segments": True, "max_split_size": 128 << 20}
    assert s.estimate_kwargs() == {"expandable_segments": True}


def test_merges_with_existing_options(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv(OLD, "roundup_power2_divisions:[256:1,>:4],expandable_segments:True")
    s = configure_allocator(max_split_size_mb=64)
    assert os.environ[OLD] == ("roundup_power2_divisions:[256:1,>:4],expandable_segments:True,"
                               "max_split_size_mb:64")
    assert s.expandable_segments  # already on from the user's variable
    configure_allocator(expandable_segments=False)
    assert "expandable_segments:False" in os.environ[OLD]


def test_new_variable_is_written_too_when_set(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv(NEW, "garbage_collection_threshold:0.6")
    s = configure_allocator(expandable_segments=True)
    assert os.environ[NEW] == "garbage_collection_threshold:0.6,expandable_segments:True"
    assert os.environ[OLD] == "expandable_segments:True"
    assert s.variables == (OLD, NEW)


def test_after_cuda_applies_runtime_options(clean_env: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    clean_env.setattr(torch.cuda, "is_initialized", lambda: True)
    clean_env.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append,
                      raising=False)
    s = configure_allocator(expandable_segments=True, garbage_collection_threshold=0.8)
    assert calls == ["expandable_segments:True,garbage_collection_threshold:0.8"]
    assert s.applied == "runtime" and OLD not in os.environ


def test_after_cuda_old_torch_setter(clean_env: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    clean_env.setattr(torch.cuda, "is_initialized", lambda: True)
    clean_env.delattr(torch._C, "_accelerator_setAllocatorSettings", raising=False)
    clean_env.setattr(torch._C, "_cuda_cudaCachingAllocator_set_allocator_settings",
                      calls.append, raising=False)
    configure_allocator(max_split_size_mb=256)
    assert calls == ["max_split_size_mb:256"]


def test_too_late_raises_with_the_fix(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(MemfitError, match="backend cannot change") as info:
        configure_allocator(backend="cudaMallocAsync", expandable_segments=True)
    assert "before any CUDA work" in str(info.value)
    assert f"{OLD}=backend:cudaMallocAsync,expandable_segments:True python" in str(info.value)
    clean_env.delattr(torch._C, "_accelerator_setAllocatorSettings", raising=False)
    clean_env.delattr(torch._C, "_cuda_cudaCachingAllocator_set_allocator_settings",
                      raising=False)
    with pytest.raises(MemfitError, match="cannot change allocator settings at runtime"):
        configure_allocator(expandable_segments=True)
    assert OLD not in os.environ


def test_bad_values(clean_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(MemfitError, match=">= 20"):
        configure_allocator(max_split_size_mb=8)
    with pytest.raises(MemfitError, match="power of two"):
        configure_allocator(roundup_power2_divisions=3)
    with pytest.raises(MemfitError, match=r"\(0.0, 1.0\)"):
        configure_allocator(garbage_collection_threshold=1.5)
    with pytest.raises(MemfitError, match="no option"):
        configure_allocator()
    assert OLD not in os.environ


class Widening(nn.Module):
    """Linear layers of growing width: every activation a new size, so freed blocks rarely fit
    the next request (fragmentation the expandable segment avoids)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(1024 + 96 * i, 1024 + 96 * (i + 1))
                                    for i in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def test_estimate_predicts_less_reserved_with_expandable_segments(
        clean_env: pytest.MonkeyPatch) -> None:
    """The trace reads PYTORCH_CUDA_ALLOC_CONF as the allocator does at CUDA start
    (``c10/core/AllocatorConfig.cpp: AcceleratorAllocatorConfig::parseArgs``), so the setting
    made by configure_allocator reaches ``estimate`` without an argument too."""
    with torch.device("meta"):
        model = Widening()
    x = torch.empty(3000, 1024, device="meta")
    plain = estimate(model, x, device="cuda", gpu="a100-80gb")
    settings = configure_allocator(expandable_segments=True)
    expandable = estimate(model, x, device="cuda", gpu="a100-80gb", **settings.estimate_kwargs())
    from_env = estimate(model, x, device="cuda", gpu="a100-80gb")
    assert from_env.peak_reserved_bytes == expandable.peak_reserved_bytes
    # should_split splits every expandable block (remainder >= 512): never more allocated
    assert expandable.peak_bytes <= plain.peak_bytes
    assert plain.peak_bytes <= expandable.peak_reserved_bytes < plain.peak_reserved_bytes


_WORKLOAD = """
import sys, torch
from memfit.techniques.allocator import configure_allocator
if sys.argv[1] == "1":
    configure_allocator(expandable_segments=True)
xs = []
for i in range(40):
    xs.append(torch.empty((1 + i % 7) * (3 << 20), dtype=torch.uint8, device="cuda"))
    if i % 3:
        del xs[0]
print(torch.cuda.max_memory_reserved())
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_expandable_segments_reduce_reserved_on_cuda() -> None:
    env = {k: v for k, v in os.environ.items() if k not in (OLD, NEW)}
    reserved = [int(subprocess.run([sys.executable, "-c", _WORKLOAD, flag], env=env, check=True,
                                   capture_output=True, text=True).stdout.split()[-1])
                for flag in ("0", "1")]
    assert reserved[1] <= reserved[0]
