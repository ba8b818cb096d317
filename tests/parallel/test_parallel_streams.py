"""FSDP2's side streams in the per-rank trace of a CUDA target (memfit/parallel/streams.py,
Note: [FSDP2's streams]).

Expected values from first principles. The tiny decoder (``tiny_spec``: hidden 64, MLP 128,
vocab 256, 2 blocks, untied head, fp32) under FSDP2 over 2 ranks: a block holds
4 * 64 * 64 + 3 * 64 * 128 + 2 * 64 = 41,088 parameters, the root (embedding, final norm, head)
256 * 64 + 64 + 256 * 64 = 32,832; every dim 0 is even, so no padding. FSDP2's all-gather
output (``foreach_all_gather``: ``all_gather_copy_in`` under ``all_gather_copy_in_stream``) is
the whole group, 41,088 * 4 = 164,352 B for a block and 131,328 B for the root; the
reduce-scatter output (``foreach_reduce``, under ``reduce_scatter_stream``), whose views
become the sharded gradients, is half of that: 82,176 and 65,664 B. A block is gathered in
forward and again in backward (``reshard_after_forward``), so 2 blocks x 2 x 2 steps = 8
all-gathers of 164,352 B; each block is reduce-scattered once a step: 4 outputs of 82,176 B.
All these are under 1 MiB, so CUDA's caching allocator serves them from 2 MiB small segments
(``CUDACachingAllocator.cpp: kSmallSize, kSmallBuffer``), one pool per stream.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Any

import pytest

import memfit
from memfit.parallel.config import Parallel
from memfit.parallel.measure import Case, build, tiny_spec
from memfit.parallel.streams import FIRST_STREAM
from memfit.recipe import Recipe
from memfit.trace import allocator as allocator_mod

MIB = 2**20


def _trace(monkeypatch: pytest.MonkeyPatch, *, streams: bool) -> tuple[Any, list, Any]:
    calls: list[tuple[int, int]] = []
    seen: list[Any] = []
    original = allocator_mod.CachingAllocatorSim.malloc

    def malloc(self: Any, nbytes: int, stream: int = 0) -> int:
        calls.append((nbytes, stream))
        if not seen:
            seen.append(self)
        return original(self, nbytes, stream)

    with monkeypatch.context() as m:
        m.setattr(allocator_mod.CachingAllocatorSim, "malloc", malloc)
        if not streams:
            import memfit.parallel.streams as streams_mod

            m.setattr(streams_mod, "fsdp_streams", lambda tracker: contextlib.nullcontext())
        case = Case(spec=tiny_spec(), batch=2, seq=32,
                    recipe=Recipe(parallel=Parallel(gpus=2, fsdp=2)))
        model, inputs = build(case)
        est = memfit.estimate(model, inputs, device="cuda", gpu="h100-80gb",
                              parallel=case.parallel)
    return est, calls, seen[0]


def test_fsdp2_buffers_come_from_their_streams_pools(monkeypatch: pytest.MonkeyPatch) -> None:
    _, calls, allocator = _trace(monkeypatch, streams=True)
    side = collections.Counter((n, s) for n, s in calls if s != 0)
    copy_in, reduce_scatter = FIRST_STREAM, FIRST_STREAM + 2  # all_gather_stream allocates none
    assert side == {(164_352, copy_in): 8, (131_328, copy_in): 4,
                    (82_176, reduce_scatter): 4, (65_664, reduce_scatter): 2}
    side_segments = [s for s in allocator.snapshot() if s["stream"] != 0]
    assert sorted((s["stream"], s["segment_type"], s["total_size"]) for s in side_segments) == [
        (copy_in, "small", 2 * MIB), (reduce_scatter, "small", 2 * MIB)]


def test_streams_change_what_is_reserved_not_what_is_allocated(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Allocated bytes do not depend on the stream; each side stream reserves its own small
    segment, which the default stream cannot use (here the default pool's segments are the same
    either way, so the difference is exactly the two 2 MiB segments)."""
    with_streams, _, _ = _trace(monkeypatch, streams=True)
    one_stream, calls, _ = _trace(monkeypatch, streams=False)
    assert {s for _, s in calls} == {0}
    assert with_streams.peak_bytes == one_stream.peak_bytes
    assert with_streams.peak_reserved_bytes == one_stream.peak_reserved_bytes + 2 * 2 * MIB


def test_torch_cpu_stream_is_restored_after_the_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.cpu

    original = torch.cpu.stream
    _trace(monkeypatch, streams=True)
    assert torch.cpu.stream is original
