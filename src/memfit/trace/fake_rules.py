"""Rules that make the fake step behave as the real one: ``aten._grouped_mm`` on fake tensors
with the dtypes its kernels take, libraries' eager paths where they detect fake tensors
(transformers), and the CPU RNG states ``torch.utils.checkpoint`` saves on CPU targets.
Each is a context the engine enters around the trace.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from memfit._compat import torch_internals, transformers_internals
from memfit.trace.tracker import Tracker


@contextlib.contextmanager
def _count_cpu_rng_states(tracker: Tracker) -> Iterator[None]:
    """torch.utils.checkpoint saves the CPU RNG state (a real 5 KB tensor) per checkpointed call;
    count it on CPU targets, where it lives in the same memory."""
    with torch_internals.reporting_get_rng_state(tracker.track):
        yield


@contextlib.contextmanager
def _eager_library_paths() -> Iterator[None]:
    """Make libraries that branch on "is this a FakeTensor?" take their eager path.

    Note: [libraries that detect fake tensors] Hugging Face transformers treats a FakeTensor as
    "being traced by torch.compile/export" (``transformers.utils.import_utils.is_fake_tensor``,
    used by ``is_tracing``) and then skips its data-dependent shortcuts: it materialises a causal
    mask for SDPA instead of passing ``is_causal=True`` when the attention mask is all ones, and
    assumes packed sequences. The real eager step takes the shortcut, so the trace must too: the
    check answers False for the duration of the trace, and the data-dependent ``.all()`` it then
    evaluates is answered by ``datadep.py``: from the real values when the attention mask was
    given as a real tensor (a padded batch takes the masked path, as for real), else ``True``
    (no padding, no packing; an assumption the engine states).
    """
    with transformers_internals.fake_tensors_look_eager():
        yield


@contextlib.contextmanager
def grouped_mm_rule() -> Iterator[None]:
    """Fake tensors take ``aten._grouped_mm`` (the mixture-of-experts matmul) with the dtypes the
    real kernels take.

    Note: [grouped_mm on fake tensors] torch's meta function (``torch/_meta_registrations.py:
    _meta_grouped_mm_common``) still requires bf16 inputs, while the kernels it describes accept
    fp32, bf16 and fp16 (``aten/src/ATen/native/GroupedMMUtils.h: _grouped_mm_validate_inputs``;
    ``aten/src/ATen/native/cuda/GroupedBlas.cpp: _grouped_mm_cuda`` runs bf16 on sm90/sm100 with
    CUTLASS and everything else through ``_grouped_mm_fallback``, one ``mm_out`` per group into
    the same output; the CPU kernel runs that fallback too). transformers' MoE layers call it
    with fp32 weights under fp32 and under autocast (``integrations/moe.py: _grouped_mm`` casts
    the input to the weight dtype), so every MoE model failed to trace. The rule here makes the
    output as ``create_grouped_gemm_output_tensor`` (GroupedMMUtils.h) does on CUDA and CPU (not
    ROCm): dtype ``out_dtype`` or the input's, last dimension's stride padded to 16 bytes.
    """
    from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager

    if not hasattr(torch.ops.aten, "_grouped_mm"):  # torch < 2.8 has no such op: nothing to fix
        yield
        return
    ops = {torch.ops.aten._grouped_mm.default}

    def rule(fake_mode: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        size, stride, dtype = _grouped_mm_layout(*args, **kwargs)
        with in_kernel_invocation_manager(fake_mode):
            out = torch.empty_strided(size, stride, dtype=dtype, device="meta")
        return FakeTensor(fake_mode, out, args[0].device)

    with torch_internals.fake_op_rule(ops, rule):
        yield


def _grouped_mm_layout(mat_a: torch.Tensor, mat_b: torch.Tensor,
                       offs: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                       out_dtype: torch.dtype | None = None,
                       ) -> tuple[list[int], list[int], torch.dtype]:
    """The (size, stride, dtype) of ``aten._grouped_mm``'s output as
    ``create_grouped_gemm_output_tensor`` makes it (Note: [grouped_mm on fake tensors]), or the
    kernels' errors for inputs they refuse."""
    for name, m in (("mat_a", mat_a), ("mat_b", mat_b)):
        if m.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise RuntimeError(f"Expected {name} to be Float32, BFloat16 or Float16 matrix, "
                               f"got {m.dtype}")
    if mat_a.dim() not in (2, 3) or mat_b.dim() not in (2, 3):
        raise RuntimeError("mat_a and mat_b have to be 2 or 3d")
    a2, b2 = mat_a.dim() == 2, mat_b.dim() == 2
    if not (a2 and b2) and mat_a.shape[-1] != mat_b.shape[-2]:
        raise RuntimeError("contraction dimension of mat_a and mat_b must match")
    if a2 and b2:
        size = [offs.shape[0] if offs is not None else 1, mat_a.shape[0], mat_b.shape[1]]
    elif a2:
        size = [mat_a.shape[0], mat_b.shape[-1]]
    elif b2:
        size = [mat_a.shape[1], mat_b.shape[1]]
    else:
        size = [mat_a.shape[0], mat_a.shape[1], mat_b.shape[-1]]
    dtype = out_dtype or mat_a.dtype
    align = 16 // dtype.itemsize
    padded = -(-size[-1] // align) * align
    stride = [padded, 1] if a2 != b2 else [size[1] * padded, padded, 1]
    return size, stride, dtype


@contextlib.contextmanager
def grouped_mm_on_meta() -> Iterator[None]:
    """Plain meta tensors (not fake ones) take ``aten._grouped_mm`` with the dtypes the real
    kernels take, as :func:`grouped_mm_rule` does for fake tensors (Note: [grouped_mm on fake
    tensors]): for a forward on a meta copy of a model that only reads shapes (the stages'
    boundaries of a split pipeline, ``memfit.parallel.pipeline_split``), outside any fake
    mode. Fake tensors pass through to their mode."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    op = getattr(torch.ops.aten, "_grouped_mm", None)
    if op is None:  # torch < 2.8 has no such op: nothing to fix
        yield
        return
    target = op.default

    class _MetaGroupedMM(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if func is target and not any(isinstance(a, FakeTensor) for a in args[:2]):
                size, stride, dtype = _grouped_mm_layout(*args, **kwargs)
                return torch.empty_strided(size, stride, dtype=dtype, device="meta")
            return func(*args, **kwargs)

    with _MetaGroupedMM():
        yield
