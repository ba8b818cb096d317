"""The CUDA autocast emulation against the installed torch's own autocast kernels.

A CPU-only build of torch still compiles ``aten/src/ATen/autocast_mode.cpp``: the AutocastCUDA
kernels (``TORCH_LIBRARY_IMPL(aten, Autocast, m)``, lists from ``autocast_mode.h``:
``AT_FORALL_LOWER_PRECISION_FP``, ``AT_FORALL_FP32``, ``AT_FORALL_FP32_SET_OPT_DTYPE``,
``AT_FORALL_PROMOTE``) are registered, and fake CUDA tensors run them for forward ops. So the
reference here is the installed torch itself, version for version:

- which ops carry an AutocastCUDA or an AutocastCPU kernel: the dispatcher
  (``torch._C._dispatch_has_kernel_for_dispatch_key``);
- what CUDA's kernel does: the op run on fake CUDA tensors under CUDA autocast, compared with
  the emulation (fake CPU tensors, CPU autocast and ``memfit.trace.autocast``'s mode), by output
  dtype and by the casts made (``aten._to_copy`` targets).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.trace import autocast as ac
from memfit.trace.sdpa import CudaRouting

BF16, F32 = torch.bfloat16, torch.float32


def _ops_with(key: str) -> set[str]:
    return {name for name in torch._C._dispatch_get_all_op_names()
            if torch._C._dispatch_has_kernel_for_dispatch_key(name, key)}


CUDA_OPS = _ops_with("AutocastCUDA")
CPU_OPS = _ops_with("AutocastCPU")

# aten ops (name without overload) -> the Python name the emulation catches them by.
_PY_NAME = {"linalg_vector_norm": "vector_norm", "linalg_matrix_norm": "matrix_norm",
            "linalg_multi_dot": "multi_dot", "native_layer_norm": "layer_norm",
            "grid_sampler": "grid_sample", "_thnn_fused_lstm_cell": "lstm_cell",
            "_thnn_fused_gru_cell": "gru_cell", "frobenius_norm": "norm",
            "nuclear_norm": "norm", "reflection_pad1d": "pad", "reflection_pad2d": "pad",
            "replication_pad1d": "pad", "replication_pad2d": "pad", "replication_pad3d": "pad"}
# CUDA-only autocast ops the emulation leaves alone, and why.
_NOT_EMULATED = {
    "_convolution": "F.conv* reach it through conv1d/2d/3d, lower precision on both devices",
    "convolution": "as _convolution",
    "cudnn_convolution": "not called from Python; convolutions are cast above it",
    "cudnn_convolution_transpose": "as cudnn_convolution",
    "_scaled_dot_product_flash_attention": "SDPA is lower precision on both (routing: sdpa.py)",
    "index_put": "reached from Python only in place (x[i] = v), which autocast does not touch",
    # CUDA builds only (aten/src/ATen/cudnn/AutocastRNN.cpp: _cudnn_rnn_cast_reflatten casts
    # input, hx and weights to fp16 whatever the autocast dtype, into a flat fp16 weight copy);
    # the trace runs RNNs through the CPU path and says so (README: known trace-engine gaps).
    "_cudnn_rnn": "cuDNN RNNs are not modelled; the estimate says so",
}


def _py_name(op: str) -> str:
    base = op.removeprefix("aten::").split(".")[0]
    if base.startswith(("upsample_", "_upsample_")):
        return "interpolate"
    return _PY_NAME.get(base, base)


def test_every_cuda_only_autocast_op_is_emulated() -> None:
    """Each op with an AutocastCUDA kernel and no AutocastCPU kernel in the installed torch
    (CPU autocast runs it in its input dtype) has an emulation rule or a stated reason; e.g.
    ``mv``, ``addmv``, ``addr`` run in lower precision on CUDA and stay fp32 on CPU."""
    emulated = {n for policy, names in ac.CUDA_RULES.items() if policy != "none" for n in names}
    missing = sorted(op for op in CUDA_OPS - CPU_OPS
                     if _py_name(op) not in emulated and _py_name(op) not in _NOT_EMULATED)
    assert not missing, f"CUDA autocast ops without an emulation rule: {missing}"
    for name in ("mv", "addmv", "addr"):
        assert f"aten::{name}" in CUDA_OPS and f"aten::{name}" not in CPU_OPS
        assert name in ac.CUDA_LOWER


def test_every_rule_names_a_registered_op() -> None:
    """No stale rule: each emulated name is an op with an AutocastCUDA kernel (or, for the "none"
    rules, an AutocastCPU kernel and no AutocastCUDA one) in the installed torch."""
    def names(ops: set[str]) -> set[str]:
        return {_py_name(op) for op in ops} | {op[6:].split(".")[0] for op in ops}

    cuda_names = names(CUDA_OPS)
    cpu_only = names(CPU_OPS - CUDA_OPS)
    python_only = {"__pow__", "__rpow__", "upsample", "upsample_nearest", "upsample_bilinear",
                   "interpolate"}  # Python spellings of pow / upsample_* ops
    for policy, names in ac.CUDA_RULES.items():
        pool = cpu_only if policy == "none" else cuda_names | python_only
        stale = [n for n in names if n not in pool and ac.rule_applies(n)]
        assert not stale, f"{policy}: {stale} have no such autocast kernel in torch " \
                          f"{torch.__version__}"


class _Casts(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.casts: list[torch.dtype] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default:
            self.casts.append(out.dtype)
        return out


Maker = Callable[[Callable[..., torch.Tensor]], tuple[Callable[..., Any], tuple[Any, ...]]]


def _long(e: Callable[..., torch.Tensor], *shape: int) -> torch.Tensor:
    return torch.zeros(*shape, dtype=torch.long, device=e(1).device)


# name -> (function, argument builder given a tensor factory e(*shape))
CASES: dict[str, tuple[Callable[..., Any], Callable[..., tuple[Any, ...]]]] = {
    "mv": (torch.mv, lambda e: (e(4, 4), e(4))),
    "addmv": (torch.addmv, lambda e: (e(4), e(4, 4), e(4))),
    "addr": (torch.addr, lambda e: (e(4, 4), e(4), e(4))),
    "chain_matmul": (torch.linalg.multi_dot, lambda e: ([e(4, 4), e(4, 4), e(4, 4)],)),
    "einsum": (torch.einsum, lambda e: ("ij,jk->ik", e(4, 4), e(4, 4))),
    "mm": (torch.mm, lambda e: (e(4, 4), e(4, 4))),
    "dot": (torch.dot, lambda e: (e(4), e(4))),
    "tensordot": (torch.tensordot, lambda e: (e(4, 4), e(4, 4))),
    "atan2": (torch.atan2, lambda e: (e(4), e(4))),
    "addcmul": (torch.addcmul, lambda e: (e(4), e(4), e(4))),
    "softmax": (torch.softmax, lambda e: (e(4, 4), -1)),
    "log_softmax": (F.log_softmax, lambda e: (e(4, 4), -1)),
    "sum": (torch.sum, lambda e: (e(4, 4),)),
    "prod": (torch.prod, lambda e: (e(4, 4),)),
    "cumsum": (torch.cumsum, lambda e: (e(4, 4), 0)),
    "layer_norm": (F.layer_norm, lambda e: (e(4, 4), (4,))),
    "group_norm": (F.group_norm, lambda e: (e(2, 4, 4), 2)),
    "rms_norm": (F.rms_norm, lambda e: (e(4, 4), (4,))),
    "exp": (torch.exp, lambda e: (e(4),)),
    "pow": (torch.pow, lambda e: (e(4), 2)),
    "rsqrt": (torch.rsqrt, lambda e: (e(4),)),
    "erfinv": (torch.erfinv, lambda e: (e(4),)),
    "logsumexp": (torch.logsumexp, lambda e: (e(4, 4), 1)),
    "vector_norm": (torch.linalg.vector_norm, lambda e: (e(4, 4),)),
    "norm": (torch.norm, lambda e: (e(4, 4),)),
    "softplus": (F.softplus, lambda e: (e(4),)),
    "cosine_similarity": (F.cosine_similarity, lambda e: (e(2, 4), e(2, 4))),
    "interpolate": (F.interpolate, lambda e: (e(1, 2, 4, 4), None, 2.0)),
    "mse_loss": (F.mse_loss, lambda e: (e(4), e(4))),
    "cross_entropy": (F.cross_entropy, lambda e: (e(4, 5), _long(e, 4))),
    "nll_loss": (F.nll_loss, lambda e: (e(4, 5), _long(e, 4))),
    "linear": (F.linear, lambda e: (e(4, 4), e(4, 4))),
    "avg_pool3d": (F.avg_pool3d, lambda e: (e(1, 1, 4, 4, 4), 2)),
    "reflect_pad": (F.pad, lambda e: (e(1, 2, 4, 4), (1, 1, 1, 1), "reflect")),
    "trace": (torch.trace, lambda e: (e(4, 4),)),
}


def _run(device: str, name: str, dtype: torch.dtype) -> tuple[torch.dtype, list[torch.dtype]]:
    fn, build = CASES[name]
    recorder = _Casts()
    with FakeTensorMode(allow_non_fake_inputs=True):
        def e(*shape: int) -> torch.Tensor:
            return torch.empty(*shape, dtype=dtype, device=device)

        args = build(e)
        if device == "cuda":
            torch.set_autocast_enabled("cuda", True)
            torch.set_autocast_dtype("cuda", BF16)
            try:
                with recorder:
                    out = fn(*args)
            finally:
                torch.set_autocast_enabled("cuda", False)
        else:
            # as the trace enters them: CUDA's kernel routing outside, autocast's lists inside
            with CudaRouting((9, 0), cuda_on_cpu=True), torch.autocast("cpu", dtype=BF16), \
                    ac.cuda_autocast_emulation(), recorder:
                out = fn(*args)
    return out.dtype, sorted(recorder.casts, key=str)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("name", sorted(CASES))
def test_emulation_does_what_cuda_autocast_does(name: str, dtype: torch.dtype) -> None:
    """Output dtype and the casts made, under bf16 autocast, equal those of the installed torch's
    AutocastCUDA kernel run on fake CUDA tensors (``autocast_mode.h: WrapFunction_``)."""
    assert _run("cpu", name, dtype) == _run("cuda", name, dtype)


def test_cpu_autocast_alone_differs_where_the_issue_says() -> None:
    """The emulation is needed: without it, CPU autocast leaves mv/addmv/addr in fp32 (issue 11,
    section 2) and layer_norm/softmax in bf16, unlike CUDA."""
    with FakeTensorMode():
        a, v = torch.empty(4, 4), torch.empty(4)
        with torch.autocast("cpu", dtype=BF16):
            assert torch.mv(a, v).dtype == F32
            assert torch.addr(a, v, v).dtype == F32
            assert F.layer_norm(a.bfloat16(), (4,)).dtype == BF16
        with torch.autocast("cpu", dtype=BF16), ac.cuda_autocast_emulation():
            assert torch.mv(a, v).dtype == BF16
            assert torch.addmv(v, a, v).dtype == BF16
            assert F.layer_norm(a.bfloat16(), (4,)).dtype == F32


def test_the_rms_norm_rule_follows_the_installed_torch() -> None:
    """rms_norm joined AT_FORALL_FP32 after torch 2.11 (2.11.0+cu130 registers no AutocastCUDA
    kernel for it; 2.13 does): the emulation applies the rule exactly when the dispatcher has
    the kernel, since the user's torch is the one that runs the step."""
    registered = torch._C._dispatch_has_kernel_for_dispatch_key("aten::rms_norm", "AutocastCUDA")
    assert ac.rule_applies("rms_norm") == registered
    assert ac.rule_applies("layer_norm")  # ungated
