"""Kernel scratch measured at a reduced size equals the full-size measurement
(memfit/trace/cpu_kernels.py, Note [CPU flash attention at one and two heads]).

CPU flash attention (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp: cpu_flash_attention)
allocates through ATen two per-thread buffers whose sizes depend on the thread count, the query
length's block (32 below 192, 64 below 768, else 256), min(512, kv length) and the head size,
never on batch or heads, and outputs linear in batch x heads; memfit measures it at batch 1 with
one and two heads and extrapolates. Each case here runs the real kernel at full size too: the
shapes cross the query-block boundaries (191/192, 767/768), kv lengths below, at and above the
512 split and with a tail, head sizes that are and are not multiples of 64, batch > 1, 4+ heads
(where fp16 packing may switch on), causal and not, the strided query layout that a
``(b, s, h, d)`` projection gives, and the three float types. Independent of the instruction set:
both sides are measured on the machine the test runs on.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import _disable_current_modes

from memfit.trace import cpu_kernels

THREADS = max(2, torch.get_num_threads())
"""The intra-op threads every test here runs on: at least two, so that the kernels' per-thread
blocking is exercised wherever the suite runs (pytest-xdist gives each worker one thread on a
two-core machine: tests/conftest.py)."""


@pytest.fixture(autouse=True)
def _threads():
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(before)

SDPA = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default

CASES = [  # (batch, heads, q_len, kv_len, head_dim, causal, dtype, query as (b, s, h, d))
    (1, 8, 800, 800, 64, True, torch.bfloat16, True),
    (2, 3, 767, 1000, 64, False, torch.bfloat16, False),
    (1, 6, 768, 512, 80, True, torch.float32, False),
    (3, 4, 192, 640, 128, False, torch.float16, True),
    (1, 5, 191, 128, 64, False, torch.bfloat16, False),
    (2, 4, 100, 1088, 32, True, torch.float16, False),
    (1, 16, 256, 256, 64, True, torch.float16, False),
]


def _inputs(b: int, h: int, lq: int, lk: int, d: int, dtype: torch.dtype,
            bshd: bool) -> tuple[torch.Tensor, ...]:
    q = (torch.zeros(b, lq, h, d, dtype=dtype).transpose(1, 2) if bshd
         else torch.zeros(b, h, lq, d, dtype=dtype))
    return q, torch.zeros(b, h, lk, d, dtype=dtype), torch.zeros(b, h, lk, d, dtype=dtype)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[:5])) + str(c[6])[6:])
def test_flash_attention_reduced_equals_full(case: tuple) -> None:
    """The peak extrapolated from one and two heads is the full-size kernel's peak, to the byte
    (FlashAttentionKernel.cpp: cpu_flash_attention sizes buf and buf_reduced without batch or
    heads)."""
    b, h, lq, lk, d, causal, dtype, bshd = case
    args = (*_inputs(b, h, lq, lk, d, dtype, bshd), 0.0, causal)
    assert cpu_kernels._sdpa_reducible(args, {})
    with _disable_current_modes():
        full = cpu_kernels._profiled_peak(SDPA, args, {})
        reduced = cpu_kernels._sdpa_reduced_peak(args, {})
    assert reduced == full
    # the outputs alone are not the answer: the kernel's buffers are in both
    out_bytes = b * h * lq * (d * dtype.itemsize + torch.finfo(torch.float32).bits // 8)
    assert full > out_bytes


def test_flash_attention_not_reduced_where_unproven() -> None:
    """A mask (its broadcast shape follows batch and heads), a kv length whose split is not a
    multiple of 64 (fp16 packing would round it up) and batch x heads <= 2 (nothing to gain) are
    measured at full size."""
    q, k, v = _inputs(1, 4, 64, 100, 64, torch.bfloat16, False)
    assert not cpu_kernels._sdpa_reducible((q, k, v, 0.0, False), {})
    q, k, v = _inputs(1, 4, 64, 128, 64, torch.bfloat16, False)
    assert cpu_kernels._sdpa_reducible((q, k, v, 0.0, False), {})
    mask = torch.zeros(1, 4, 64, 128, dtype=torch.bool)
    assert not cpu_kernels._sdpa_reducible((q, k, v, 0.0, False), {"attn_mask": mask})
    q, k, v = _inputs(1, 2, 64, 128, 64, torch.bfloat16, False)
    assert not cpu_kernels._sdpa_reducible((q, k, v, 0.0, False), {})


def _strided(shape: tuple[int, ...], dtype: torch.dtype, kind: str) -> torch.Tensor:
    """A zero tensor of ``shape``: contiguous, with its last two dims transposed in memory, or a
    slice of a wider tensor (not dense)."""
    if kind == "t":
        return torch.zeros(*shape[:-2], shape[-1], shape[-2], dtype=dtype).transpose(-1, -2)
    if kind == "slice":
        return torch.zeros(*shape[:-1], shape[-1] + 3, dtype=dtype)[..., :shape[-1]]
    return torch.zeros(shape, dtype=dtype)


BINARY_CASES = [  # (op, shape a, dtype a, layout a, shape b, dtype b, layout b)
    ("mul", (1, 32, 96, 64), torch.bfloat16, "t", (96, 64), torch.float32, "c"),
    ("mul", (2, 8, 96, 64), torch.float32, "c", (2, 1, 96, 64), torch.bfloat16, "c"),
    ("add", (1, 96, 160), torch.float32, "c", (1, 96, 160), torch.bfloat16, "slice"),
    ("sub", (7, 1, 33), torch.float16, "c", (5, 33), torch.float32, "c"),
    ("div", (3, 40, 24), torch.bfloat16, "slice", (24,), torch.float64, "c"),
]


@pytest.mark.parametrize("case", BINARY_CASES, ids=lambda c: f"{c[0]}-{c[3]}-{c[6]}")
def test_promoting_binary_reduced_equals_full(case: tuple) -> None:
    """A mixed-dtype binary op's peak, extrapolated from sizes 1 and 2 along one output
    dimension, is the full-size kernel's peak to the byte (aten/src/ATen/TensorIterator.cpp:
    TensorIteratorBase::compute_types makes an input-sized converted copy of each input not of
    the common dtype; the output and those copies are linear along a dimension each input
    either spans or broadcasts); broadcast dims, non-dense and transposed inputs included."""
    name, sa, da, la, sb, db, lb = case
    func = getattr(torch.ops.aten, name).Tensor
    args = (_strided(sa, da, la), _strided(sb, db, lb))
    dim = cpu_kernels._binary_reducible_dim(args)
    assert dim is not None
    with _disable_current_modes():
        full = cpu_kernels._profiled_peak(func, args, {})
        reduced = cpu_kernels._binary_reduced_peak(func, args, {}, dim)
    assert reduced == full
    out = torch.broadcast_shapes(sa, sb).numel() * torch.promote_types(da, db).itemsize
    assert full > out  # a promotion temporary is in the peak, not only the output


def test_binary_not_reduced_along_a_zero_stride_dimension() -> None:
    """An input expanded (stride 0) along the only dimension larger than 2 is measured at full
    size."""
    a = torch.zeros(1, 2).expand(50, 2)
    b = torch.zeros(50, 2, dtype=torch.bfloat16)
    assert cpu_kernels._binary_reducible_dim((a, b)) is None
    assert cpu_kernels._binary_reducible_dim((a.contiguous(), b)) == 2


def _matrix(rows: int, cols: int, column_major: bool) -> torch.Tensor:
    if column_major:
        return torch.zeros(cols, rows, dtype=torch.bfloat16).t()
    return torch.zeros(rows, cols, dtype=torch.bfloat16)


def _mm_cases() -> list[tuple[int, int, int, bool, bool]]:
    """(M, K, N, A column-major, B column-major) at this process's thread count: M a multiple
    of 256 x threads; K = 4096 (a power of two, where oneDNN copies A from M = 1024 on) with A
    row-major and column-major; N at its smallest (64 x threads) and not a multiple of 64."""
    step = 256 * THREADS
    big_pow2 = 2 * (-(-1024 // step) * step) + 2 * step
    return [
        (4 * step, 1536, 640, False, True),
        (4 * step, 2048, 192 * THREADS + 8, False, False),
        (big_pow2, 4096, 256, False, False),
        (4 * step, 4096, 320, True, False),
        (5 * step, 1024, 64 * THREADS, True, True),
    ]


@pytest.mark.parametrize("case", _mm_cases(), ids=lambda c: "x".join(map(str, c)))
def test_bf16_mm_reduced_equals_full(case: tuple) -> None:
    """A bf16 mm's peak, extrapolated from two row counts, is the full-size kernel's peak to
    the byte (oneDNN 3.12 src/cpu/x64/matmul/brgemm_matmul_utils.cpp: init_scratchpad sizes the
    scratchpad from a blocking that compute_blocking_heuristic_avx512 / _avx2 chooses the same
    for every M that is a multiple of 256 x threads; prefer_copy_a switches at M = 1024 when K
    is a power of two >= 4096), row- and column-major operands."""
    m, k, n, a_cm, b_cm = case
    args = (_matrix(m, k, a_cm), _matrix(k, n, b_cm))
    rows = cpu_kernels._mm_reduced_rows(args)
    if any("amx" in f for f in cpu_kernels._cpu_flags()):
        assert rows is None  # AMX blocking is not covered: measured at full size
        return
    assert rows is not None and 2 * rows + 256 * torch.get_num_threads() < m
    with _disable_current_modes():
        full = cpu_kernels._profiled_peak(torch.ops.aten.mm.default, args, {})
        reduced = cpu_kernels._mm_reduced_peak(args, rows)
    assert reduced == full
    assert full >= m * n * 2  # the result is in the peak


def test_bf16_mm_not_reduced_where_unproven() -> None:
    """M not a multiple of 256 x threads, too few 64-column blocks of N for the threads (oneDNN's
    low_parallel_work branch has M thresholds), fp32, and a non-dense operand are measured at
    full size."""
    step = 256 * torch.get_num_threads()
    b = _matrix(1024, 512, False)
    assert cpu_kernels._mm_reduced_rows((_matrix(4 * step + 256, 1024, False), b)) is None
    assert cpu_kernels._mm_reduced_rows((_matrix(4 * step, 1024, False).float(), b.float())) is None
    sliced = torch.zeros(4 * step, 1100, dtype=torch.bfloat16)[:, :1024]
    assert cpu_kernels._mm_reduced_rows((sliced, b)) is None
    if torch.get_num_threads() > 1:
        narrow = _matrix(1024, 64 * (torch.get_num_threads() - 1), False)
        assert cpu_kernels._mm_reduced_rows((_matrix(4 * step, 1024, False), narrow)) is None
