"""CUDA's fused RMSNorm on the CPU stand-in (``memfit/trace/norms.py``).

What the fused kernel allocates and keeps comes from PyTorch's source, not from memfit:
``aten/src/ATen/native/layer_norm.cpp: rms_norm_symint`` calls ``_fused_rms_norm`` unless the
input is channels-last or complex or the weight's dtype differs; ``derivatives.yaml`` saves
``input``, ``weight`` and ``result1`` (rstd, one accumulation-type value per row) and
``_fused_rms_norm_backward`` writes the input's and the weight's gradients.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.trace.sdpa import CudaRouting


class _Allocs(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.outputs: list[tuple[torch.dtype, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.ops.append(str(func.overloadpacket.__name__))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t._base is None and func.overloadpacket not in (
                    torch.ops.aten.detach, torch.ops.aten.view, torch.ops.aten._unsafe_view):
                self.outputs.append((t.dtype, t.numel()))
        return out


def _run(dtype: torch.dtype, weight_dtype: torch.dtype) -> tuple[_Allocs, _Allocs, list[Any]]:
    saved: list[Any] = []
    with FakeTensorMode():
        x = torch.empty(4, 6, 8, dtype=dtype, requires_grad=True)
        w = torch.empty(8, dtype=weight_dtype, requires_grad=True)
        fwd, bwd = _Allocs(), _Allocs()
        with CudaRouting((9, 0), cuda_on_cpu=True):
            with torch.autograd.graph.saved_tensors_hooks(
                    lambda t: saved.append((t.dtype, t.numel())) or t, lambda t: t), fwd:
                y = F.rms_norm(x, (8,), w, 1e-6)
            g = torch.empty_like(y)
            with bwd:
                y.backward(g)
    return fwd, bwd, saved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rms_norm_allocates_and_saves_what_cuda_does(dtype: torch.dtype) -> None:
    fwd, bwd, saved = _run(dtype, dtype)
    rows = 4 * 6
    # forward: the output (input's dtype) and rstd (fp32, one per row); nothing of the composite
    assert sorted(fwd.outputs, key=str) == sorted([(dtype, rows * 8), (torch.float32, rows)],
                                                  key=str)
    assert not {"pow", "mean", "rsqrt", "_to_copy"} & set(fwd.ops)
    # saved for backward: input, weight, rstd (derivatives.yaml: _fused_rms_norm)
    assert sorted(saved, key=str) == sorted([(dtype, rows * 8), (dtype, 8), (torch.float32, rows)],
                                            key=str)
    # backward writes the input's and the weight's gradients
    assert (dtype, rows * 8) in bwd.outputs and (dtype, 8) in bwd.outputs


def test_weight_of_another_dtype_takes_the_composite() -> None:
    """rms_norm_symint: a weight whose dtype differs from the input's is not fused (the case of
    a bf16 activation and an fp32 weight when autocast has no rms_norm rule, as in torch 2.11)."""
    fwd, _, _ = _run(torch.bfloat16, torch.float32)
    assert "pow" in fwd.ops and "rsqrt" in fwd.ops


def test_without_the_routing_the_cpu_composite_runs() -> None:
    """The CPU's own path differs: it is what the stand-in would count without the routing."""
    with FakeTensorMode():
        x = torch.empty(4, 6, 8, dtype=torch.bfloat16, requires_grad=True)
        rec = _Allocs()
        with rec:
            F.rms_norm(x, (8,))
    assert "_to_copy" in rec.ops and "pow" in rec.ops
