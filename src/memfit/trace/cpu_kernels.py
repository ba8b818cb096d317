"""Transient memory inside opaque CPU kernels, measured by running the kernel once for real.

oneDNN-backed CPU kernels (convolution and its backward, the LSTM layer and its backward) allocate
reordered copies of their inputs, weights and outputs and scratch buffers through PyTorch's CPU
allocator while they run, and free them before returning. A fake kernel only produces the outputs,
so these transients are invisible to the trace; how large they are depends on the oneDNN version
and the CPU's instruction set (blocked layouts), so they are measured, not modelled: the op runs
once on real zero tensors of the same shapes under the profiler, and the peak of its allocation
events (outputs included) is cached per signature.

Three kernels are run smaller where their source shows the scratch does not depend on the
dimension cut, and what does grows linearly with it: the op runs at two small sizes and the peak is
extrapolated, exactly (each Note below gives the source; tests/trace/test_cpu_kernels_reduced.py
checks each against the full-size run): CPU flash attention at batch 1 with one and two heads, bf16
``mm`` at two row counts that are multiples of 256 x threads (oneDNN's blocking is then the same),
and mixed-dtype add/sub/mul/div at sizes 1 and 2 of one output dimension. On a 1B Llama step (bf16,
seq 4096) this cut the kernel runs from 3.6 to 1.3 CPU-s.

Known limitations: only ops whose inputs total at most ``CALIBRATION_CAP_BYTES`` are measured
(larger ones are assumed to need no transient), and none while a profiler is already running;
only CPU targets use this. The first measurement starts the profiler (a second or two, once).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.profiler import ProfilerActivity
from torch.utils._python_dispatch import _disable_current_modes

from memfit._noise import quiet_profile
from memfit.cpu_peak import allocator_deltas, running_peak
from memfit.trace import kernel_cache

aten = torch.ops.aten

OPAQUE_CPU_OPS = {
    op for op in (
        aten.convolution.default, aten.convolution_backward.default,
        getattr(aten, "mkldnn_rnn_layer", None) and aten.mkldnn_rnn_layer.default,
        getattr(aten, "mkldnn_rnn_layer_backward", None) and aten.mkldnn_rnn_layer_backward.default,
    ) if op
}
# Always measured on CPU: these kernels reorder/convert inputs and keep scratch (flash attention
# for CPU keeps per-thread buffers).
OPAQUE_CPU_OPS |= {
    op for op in (
        getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
        and aten._scaled_dot_product_flash_attention_for_cpu.default,
        getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
        and aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    ) if op
}
# Losses whose CPU kernels compute the elementwise loss into a temporary before reducing it (the
# fake kernels return only the reduced result).
OPAQUE_CPU_OPS |= {
    getattr(aten, name).default for name in (
        "mse_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
        "binary_cross_entropy_with_logits", "soft_margin_loss", "multilabel_margin_loss_forward",
        "multi_margin_loss", "kl_div") if hasattr(aten, name)
}
# Measured only in 16-bit formats (the fp32 kernels return what they allocate):
# - GEMMs: where oneDNN runs bf16/fp16 GEMMs (CPUs with AVX-512 bf16/fp16 or AMX) it allocates
#   packed and fp32 buffers (14 KB for a 16x32 @ 32x32 bf16 addmm on an AVX-512 EPYC); where it
#   does not (AVX2), the kernel allocates nothing. Which path a CPU takes is only known by running
#   the kernel, so it is measured, never assumed;
# - mean and sum into fp32: the CPU kernel casts a bf16/fp16 input to fp32 before reducing it
#   (aten/src/ATen/native/ReduceOps.cpp: mean_out, "cast_fp32 -> sum -> div"; sum_out through
#   ReduceOpsUtils.h: make_reduction, self.to(in_dtype)), an input-sized fp32 temporary. (Left
#   out, a bf16-mixed step whose peak is a mean was predicted 11.6% low on AVX2, where no GEMM
#   scratch hid it.)
LOW_PRECISION_OPAQUE_CPU_OPS = {
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
    aten._addmm_activation.default, aten.addbmm.default,
    aten.mean.default, aten.mean.dim, aten.sum.default, aten.sum.dim_IntList,
}
# Op namespaces of torch itself; ops of any other (custom kernels of libraries) are measured.
_TORCH_NAMESPACES = frozenset({"aten", "prims", "prim", "profiler", "_c10d_functional",
                               "c10d", "rngprims", "higher_order", "debugprims"})
CALIBRATION_CAP_BYTES = 64 * 2**20  # real kernels on real zeros: keep them small and quick


def is_opaque(func: Any, args: Any) -> bool:
    """Whether ``func`` on these arguments allocates memory it does not return (on CPU)."""
    if func in OPAQUE_CPU_OPS:
        return True
    if getattr(func, "namespace", "aten") not in _TORCH_NAMESPACES:
        return True  # a library's own kernel (bitsandbytes' dequantize...): scratch unknown
    if func in LOW_PRECISION_OPAQUE_CPU_OPS:
        return any(isinstance(a, torch.Tensor) and a.dtype in (torch.bfloat16, torch.float16)
                   for a in args)
    return _mixed_float_dtypes(func, args)


# Ops that convert between dtypes themselves (no promotion temporaries), and seeded random ops,
# which must not run for real here (they would advance the process's generator).
_CONVERTING = {aten._to_copy.default, aten.copy_.default, aten.copy.default,
               aten._foreach_copy_.default}


def _mixed_float_dtypes(func: Any, args: Any) -> bool:
    """An op on floating tensors of more than one dtype (a bf16 activation times an fp32 buffer
    under autocast, an fp32 residual plus a bf16 branch): on the CPU, TensorIterator makes a
    converted copy of each input whose dtype is not the common one before it computes
    (aten/src/ATen/TensorIterator.cpp: TensorIteratorBase::compute_types, "Promotes inputs by
    creating temporaries of the correct dtype", CPU only), and the fake kernel returns only the
    output. Zero-dimensional tensors take part in promotion as scalars (at most a few bytes)."""
    if func in _CONVERTING or torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
        return False
    dtypes = set()
    for a in args:
        for t in a if isinstance(a, list | tuple) else (a,):
            if isinstance(t, torch.Tensor) and t.dim() > 0 and t.is_floating_point():
                dtypes.add(t.dtype)
    return len(dtypes) > 1

_cache: dict[Any, int | None] = {}
_workspace: dict[Any, int] = {}


def _signature(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), tuple(x.stride()), x.dtype, x.storage_offset())
    if isinstance(x, list | tuple):
        return tuple(_signature(v) for v in x)
    return x


def _input_bytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.untyped_storage().nbytes()
    if isinstance(x, list | tuple):
        return sum(_input_bytes(v) for v in x)
    return 0


def _real(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        size = x.untyped_storage().nbytes()
        base = torch.zeros(max(size // max(x.element_size(), 1), 1), dtype=x.dtype)
        return base.as_strided(x.shape, x.stride(), x.storage_offset())
    if isinstance(x, list):
        return [_real(v) for v in x]
    if isinstance(x, tuple):
        return tuple(_real(v) for v in x)
    return x


def transient_peak(func: Any, args: Any, kwargs: dict[str, Any]) -> int | None:
    """Peak bytes the real CPU kernel allocates while it runs (its outputs included), or None
    when it was not measured (inputs too large).

    A measurement is kept in memory and, when its signature can be written down exactly, in the
    on-disk cache (:mod:`memfit.trace.kernel_cache`), so a later process on the same machine and
    torch build reads it instead of running the kernel again."""
    key = (func, _signature(args), _signature(tuple(sorted(kwargs.items()))))
    if key in _cache:
        return _cache[key]
    disk_key = kernel_cache.entry_key(key)
    if disk_key is not None:
        hit = kernel_cache.get(disk_key)
        if hit is not None:
            peak, workspace = hit
            _cache[key] = peak
            if workspace is not None:
                _workspace[key] = workspace
            return peak
    if torch.autograd.profiler._is_profiler_enabled:  # cannot nest a profiler inside another
        return None
    result, measured = _measure(func, args, kwargs, key)
    _cache[key] = result
    if measured and disk_key is not None:
        kernel_cache.put(disk_key, result, _workspace.get(key))
    return result


def _measure(func: Any, args: Any, kwargs: dict[str, Any], key: Any) -> tuple[int | None, bool]:
    """Run the real kernel on zeros under the profiler: ``(peak bytes or None, measured)``;
    ``measured`` is False when the inputs were over the cap (nothing learnt about the kernel)."""
    # The cap is checked before any zeros are made (making them first cost 0.3 s per trace of a
    # 1B model whose large GEMMs are over it).
    if _input_bytes(args) + _input_bytes(list(kwargs.values())) > CALIBRATION_CAP_BYTES:
        return None, False
    if func is _SDPA_CPU and _sdpa_reducible(args, kwargs):
        with _disable_current_modes():
            return _sdpa_reduced_peak(args, kwargs), True
    if func is aten.mm.default and (rows := _mm_reduced_rows(args)) is not None:
        with _disable_current_modes():
            return _mm_reduced_peak(args, rows), True
    if func in _PROMOTING_BINARY and (dim := _binary_reducible_dim(args)) is not None:
        with _disable_current_modes():
            return _binary_reduced_peak(func, args, kwargs, dim), True
    with _disable_current_modes():
        real_args = _real(args)
        real_kwargs = {k: _real(v) for k, v in kwargs.items()}
        try:
            if func is aten.mkldnn_rnn_layer_backward.default:
                real_args = _rnn_backward_args(real_args)
            with quiet_profile(activities=[ProfilerActivity.CPU],
                               profile_memory=True) as prof:  # see memfit._noise
                out = func(*real_args, **real_kwargs)
        except RuntimeError:  # a kernel refusing zeros (or this build): not measured
            return None, True
        if func is aten.mkldnn_rnn_layer.default and isinstance(out[3], torch.Tensor):
            _workspace[key] = out[3].untyped_storage().nbytes()
        del out
        result, _ = running_peak(allocator_deltas(prof))
    return result, True


_SDPA_CPU = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_SDPA_CPU = _SDPA_CPU.default if _SDPA_CPU is not None else None
_SDPA_KV_SPLIT = 512  # the kernel's kv_split_size, the same in all three q-length buckets


def _sdpa_reducible(args: Any, kwargs: dict[str, Any]) -> bool:
    """Whether CPU flash attention's scratch can be measured at batch 1 with one and two heads.

    Note [CPU flash attention at one and two heads]: ``cpu_flash_attention``
    (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp) allocates through ATen only ``buf``
    (``num_thread`` x (qSplitSize*rkvSplitSize + 2*qSplitSize + qSplitSize*rHeadSize), fp32) and
    ``buf_reduced`` (``num_thread`` x qSplitSize x ekvSplitSize, 16-bit types only); its packed
    key/value copies are ``std::make_unique`` arrays the allocator never sees. qSplitSize is
    chosen from the query length alone (``flash_attention_kernel_impl``: 256 at >= 768, 64 at
    >= 192, else 32), kvSplitSize = min(512, kv length), num_thread is the fingerprint's thread
    count. Batch and heads enter only through ``need_pack`` (fp16 with oneDNN packing:
    ``num_head >= 4`` and the pack/gemm size ratio), which rounds kvSplitSize and headSize up to
    64 and makes kvSplitSize even: with kvSplitSize a multiple of 64 (required here) and
    ``need_pack`` implying headSize % 64 == 0, neither buffer changes. The op's outputs
    (``_scaled_dot_product_flash_attention_cpu``, aten/src/ATen/native/transformers/
    attention.cpp: output (B, L, H, D) and logsumexp (B, L, H)) are linear in batch x heads.
    So the peak at batch x heads = n is p1 + (n - 1) * (p2 - p1), p1 and p2 measured at one and
    two heads (tests/trace/test_cpu_kernels_reduced.py compares it with the full-size measurement).
    Without a mask only (a mask's broadcast shape depends on batch and heads)."""
    if kwargs.get("attn_mask") is not None or len(args) != 5:
        return False
    q, k, v = args[:3]
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return False
    if not (q.shape[:2] == k.shape[:2] == v.shape[:2]) or q.shape[0] * q.shape[1] <= 2:
        return False
    return min(_SDPA_KV_SPLIT, k.shape[2]) % 64 == 0


def _sdpa_reduced_peak(args: Any, kwargs: dict[str, Any]) -> int | None:
    """The full-size peak of CPU flash attention from runs at one and two heads (Note [CPU
    flash attention at one and two heads])."""
    q, k, v, *rest = args
    peaks = []
    for heads in (1, 2):
        small = [_resized_like(t, {0: 1, 1: heads}) for t in (q, k, v)]
        try:
            peaks.append(_profiled_peak(_SDPA_CPU, (*small, *rest), kwargs))
        except RuntimeError:  # a kernel refusing zeros (or this build): not measured
            return None
    p1, p2 = peaks
    return p1 + (q.shape[0] * q.shape[1] - 1) * (p2 - p1)


# Binary pointwise ops built on TensorIterator (aten/src/ATen/native/BinaryOps.cpp:
# TORCH_IMPL_FUNC(add_out) / (mul_out) / (sub_out) / (div_out), build_borrowing_binary_op).
_PROMOTING_BINARY = {aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor}


def _binary_reducible_dim(args: Any) -> int | None:
    """The output dimension (counted from the right) along which a mixed-dtype binary op's
    scratch is measured at sizes 1 and 2, or None.

    Note [promotion temporaries are linear]: on the CPU, TensorIterator makes a converted copy of
    each input whose dtype is not the common one (aten/src/ATen/TensorIterator.cpp:
    TensorIteratorBase::compute_types, ``op.tensor().to(common_dtype_)``) and allocates the
    output (``allocate_or_resize_outputs``); all of them live until the kernel has run, so the
    peak is their sum. The copy of a dense input keeps its strides, that of any other input is
    contiguous: either way its bytes are its number of elements times the common dtype's size,
    as are the output's. Along an output dimension where each input has either the output's size
    or size 1 (broadcast), every one of these is constant or linear in that size, so the peak at
    size n is p1 + (n - 1) * (p2 - p1). The largest such dimension is chosen."""
    tensors = [a for a in args[:2] if isinstance(a, torch.Tensor)]
    if len(tensors) != 2 or any(t.dim() == 0 for t in tensors):
        return None
    shape = torch.broadcast_shapes(*(t.shape for t in tensors))
    best = None
    for d in range(1, len(shape) + 1):  # d-th dimension from the right
        n = shape[-d]
        if n <= 2 or (best is not None and n <= shape[-best]):
            continue
        ok = all(t.dim() < d or t.shape[-d] == 1 or t.stride(-d) != 0 for t in tensors)
        if ok:
            best = d
    return best


def _resized_like(x: torch.Tensor, sizes: dict[int, int]) -> torch.Tensor:
    """Zeros of ``x``'s shape with the dimensions in ``sizes`` (index: size) replaced, laid out
    in ``x``'s dimension order."""
    shape = [sizes.get(i, s) for i, s in enumerate(x.shape)]
    order = sorted(range(x.dim()), key=lambda d: (-x.stride(d), d))
    base = torch.zeros([shape[d] for d in order], dtype=x.dtype)
    return base.permute([order.index(d) for d in range(x.dim())])


def _binary_reduced_peak(func: Any, args: Any, kwargs: dict[str, Any], dim: int) -> int | None:
    """The full-size peak of a mixed-dtype binary op from runs with output dimension ``-dim`` at
    sizes 1 and 2 (Note [promotion temporaries are linear])."""
    n = torch.broadcast_shapes(*(a.shape for a in args[:2]))[-dim]
    peaks = []
    for m in (1, 2):
        small = [_resized_like(a, {a.dim() - dim: m} if a.dim() >= dim and a.shape[-dim] == n
                               else {}) for a in args[:2]]
        try:
            peaks.append(_profiled_peak(func, (*small, *args[2:]), kwargs))
        except RuntimeError:
            return None
    p1, p2 = peaks
    return p1 + (n - 1) * (p2 - p1)


def _dense_2d(x: Any) -> bool:
    """A 2-D tensor laid out row- or column-major without gaps."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or min(x.shape) < 2:
        return False
    rows, cols = x.shape
    return tuple(x.stride()) in ((cols, 1), (1, rows))


def _mm_reduced_rows(args: Any) -> int | None:
    """The smallest row count ``M1`` at which a bf16 ``mm``'s scratch is measured (with a second
    run at ``M1 + 256 * threads``), or None where that is not proven or gains nothing.

    Note [oneDNN bf16 matmul scratch does not depend on M]: a bf16 mm on the CPU goes to oneDNN's
    matmul through ideep (aten/src/ATen/native/mkldnn/Matmul.cpp: mkldnn_matmul / mkldnn_gemm)
    and oneDNN's problem has the same M (rows of the result). Its scratchpad is booked in
    oneDNN 3.12 (the version torch 2.13 ships, commit 80afa71) src/cpu/x64/matmul/
    brgemm_matmul_utils.cpp: init_scratchpad from nthr and the blocking that
    init_brgemm_matmul_conf / compute_blocking_heuristic chose. Without AMX, with nthr <=
    ceil(N / 64) (no "low_parallel_work": N_blk <= 64) and nthr_k = 1 (set only under
    low_parallel_work), M enters the blocking only through:
    - ``prefer_copy_a``: ``lda_big_pow2() && M >= 1024`` (A not transposed, K a power of two,
      K >= 4096 for 2-byte A), hence M1 >= 1024 there (a transposed A is always copied:
      ``is_copy_a_required``);
    - compute_blocking_heuristic_avx512 / _avx2's search over m_blk from min(256, M) down,
      keeping the first strict minimum of get_imbalance(): with M a multiple of 256 * nthr,
      m_blk = 256 leaves no M tail and an even split of the M/256 x N-chunk work over nthr
      threads, so for every n_chunk_size it scores the smallest value any m_blk can (the
      other terms do not depend on M and every term is >= 0), is not skipped, and comes first:
      the chosen blocking is the same for every such M;
    - thresholds (M == 1 gemv, M <= 40 and M <= 512 under low_parallel_work, f32-only and
      AMX-only ones) that M >= 512 and bf16 never reach.
    init_aux_values then sizes buffers A, B, C and the batch elements from M_blk, N_blk, K_blk,
    M_chunk_size and nthr_k, never M. What else the call allocates grows linearly with M (the
    result, a contiguous copy of A), so the peak at M is p1 + (M - M1) / step * (p2 - p1).
    Both operands must be dense row- or column-major (strides are part of oneDNN's problem)."""
    if len(args) != 2 or not all(_dense_2d(x) and x.dtype == torch.bfloat16 for x in args):
        return None
    if any("amx" in flag for flag in _cpu_flags()):
        return None  # AMX blocking (matmul_amx_blocking_params_*) is not covered by the Note
    (m, k), n = args[0].shape, args[1].shape[1]
    threads = torch.get_num_threads()
    step = 256 * threads
    if m % step or -(-n // 64) < threads:
        return None
    low = step
    transposed_a = args[0].stride(0) == 1
    if not transposed_a and k >= 4096 and k & (k - 1) == 0:  # lda_big_pow2 (prefer_copy_a)
        if m < 1024:
            return None
        low = -(-1024 // step) * step
    return low if 2 * low + step < m else None


def _cpu_flags() -> list[str]:
    """The CPU's feature flags as the kernel-cache fingerprint reads them (empty where unknown:
    then AMX cannot be ruled out and nothing is reduced)."""
    flags = kernel_cache._cpu_identity().rpartition("|")[2].split()
    return flags or ["amx?"]


def _mm_reduced_peak(args: Any, m1: int) -> int | None:
    """The full-size peak of a bf16 mm from runs at ``m1`` and ``m1 + 256 * threads`` rows
    (Note [oneDNN bf16 matmul scratch does not depend on M])."""
    a, b = args
    step = 256 * torch.get_num_threads()
    real_b = _real(b)
    peaks = []
    for rows in (m1, m1 + step):
        try:
            peaks.append(_profiled_peak(aten.mm.default,
                                        (_resized_like(a, {0: rows}), real_b), {}))
        except RuntimeError:
            return None
    p1, p2 = peaks
    return p1 + (a.shape[0] - m1) // step * (p2 - p1)


def _profiled_peak(func: Any, real_args: Any, real_kwargs: dict[str, Any]) -> int:
    with quiet_profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = func(*real_args, **real_kwargs)
    del out
    return running_peak(allocator_deltas(prof))[0]


def clear_memory_cache() -> None:
    """Forget this process's measurements (the on-disk cache stays): for tests."""
    _cache.clear()
    _workspace.clear()
    kernel_cache.forget_loaded()


def rnn_workspace_bytes(args: Any, kwargs: dict[str, Any]) -> int | None:
    """The real size of ``mkldnn_rnn_layer``'s workspace output (its meta kernel returns an empty
    one, yet the real workspace is saved for backward), once ``transient_peak`` measured it."""
    key = (aten.mkldnn_rnn_layer.default, _signature(args),
           _signature(tuple(sorted(kwargs.items()))))
    return _workspace.get(key)


def _rnn_backward_args(a: Any) -> Any:
    """Backward needs the workspace its forward really produced: run that forward first."""
    (inp, w1, w2, w3, w4, hx, cx, _out, _hy, _cy, g_out, g_hy, g_cy, reverse, mode, hidden,
     layers, has_biases, train, bidirectional, batch_sizes, batch_first, _ws) = a
    with torch.enable_grad():  # the kernel returns its workspace only with grad mode on
        out, hy, cy, ws = aten.mkldnn_rnn_layer.default(
            inp, w1, w2, w3, w4, hx, cx, reverse, batch_sizes, mode, hidden, layers, has_biases,
            bidirectional, batch_first, train)
    # g_out keeps the strides the traced gradient has (a batch_first LSTM's output gradient
    # arrives transposed, and the kernel then makes a contiguous copy of it).
    return (inp, w1, w2, w3, w4, hx, cx, out, hy, cy, g_out, g_hy, g_cy, reverse, mode, hidden,
            layers, has_biases, train, bidirectional, batch_sizes, batch_first, ws)
