"""The CUDA target's attention and dropout, checked against PyTorch's source.

Sources (torch 2.11, the GPU machines' release, and ``main`` where noted):
``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`` (backend filters and priority),
``aten/src/ATen/native/transformers/attention.cpp`` (what ``scaled_dot_product_attention`` does
before the kernel), ``torch/_meta_registrations.py`` (what each kernel returns and saves) and
``aten/src/ATen/native/Dropout.cpp`` (``dropout``: the fused kernel on CUDA). Expected bytes are
hand-computed from those rules.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from memfit.errors import MemfitError
from memfit.trace import estimate
from memfit.trace.sdpa import (
    CUDNN,
    CUDNN_ORDER,
    CUDNN_PREFERRED_SINCE,
    DEFAULT_ORDER,
    EFFICIENT,
    FLASH,
    MATH,
    choose_cuda_backend,
    minimum_gemm_alignment,
    priority_order,
    torch_release,
)

ALL = (FLASH, EFFICIENT, MATH, CUDNN)
A100, A10G, L4, H100, B200, RTX5090, V100, T4 = (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (
    12, 0), (7, 0), (7, 5)
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
R211, R210, R214 = (2, 11), (2, 10), (2, 14)


def qkv(*, b: int = 2, hq: int = 8, hkv: int | None = None, lq: int = 64, lk: int | None = None,
        d: int = 64, dv: int | None = None, dtype: torch.dtype = BF16
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hkv = hq if hkv is None else hkv
    lk = lq if lk is None else lk
    q = torch.empty(b, hq, lq, d, dtype=dtype, device="meta")
    k = torch.empty(b, hkv, lk, d, dtype=dtype, device="meta")
    v = torch.empty(b, hkv, lk, d if dv is None else dv, dtype=dtype, device="meta")
    return q, k, v


def mask(shape: tuple[int, ...], dtype: torch.dtype = torch.bool) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


# (id, inputs, options, expected): each row names the sdp_utils.cpp filter it exercises.
ROUTES: list[tuple[str, dict[str, Any], dict[str, Any], str]] = [
    # select_sdp_backend with the default priority_order (flash, efficient, math, cudnn)
    ("flash-first", {}, {"cc": A100}, FLASH),
    # check_dtypes_flash_attention: fp16/bf16 only
    ("flash-refuses-fp32", {"dtype": FP32}, {"cc": A100}, EFFICIENT),
    # check_for_attn_mask: flash takes no explicit mask; memory-efficient does
    ("flash-refuses-mask", {}, {"cc": A100, "mask": (2, 1, 64, 64)}, EFFICIENT),
    # check_flash_causal_non_square_seqlens: causal with seq_q != seq_k refused
    ("flash-causal-nonsquare", {"lq": 16, "lk": 64}, {"cc": A100, "is_causal": True},
     EFFICIENT),
    ("flash-causal-square", {}, {"cc": A100, "is_causal": True}, FLASH),
    ("flash-noncausal-nonsquare", {"lq": 16, "lk": 64}, {"cc": A100}, FLASH),
    # check_head_dim_size_flash: equal head dims, <= 256 (no multiple-of-8 rule for dense inputs:
    # attention.cpp pads); check_head_dim_size_mem_efficient then needs alignment 8 for bf16
    ("flash-head-dim-100", {"d": 100}, {"cc": A100}, FLASH),
    ("flash-head-dim-264", {"d": 264}, {"cc": A100}, EFFICIENT),
    ("flash-unequal-dims", {"d": 64, "dv": 128}, {"cc": A100}, EFFICIENT),
    # check_flash_attention_hardware_support: sm80..sm121
    ("flash-needs-sm80", {"dtype": FP16}, {"cc": T4}, EFFICIENT),
    # check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120: training with
    # head_dim in (192, 224], or > 224 with dropout, refused on sm86-89 and sm120-121
    ("sm86-train-d200", {"d": 200}, {"cc": A10G, "grad": True}, EFFICIENT),
    ("sm86-infer-d200", {"d": 200}, {"cc": A10G, "grad": False}, FLASH),
    ("sm89-train-d256", {"d": 256}, {"cc": L4, "grad": True}, FLASH),
    ("sm89-train-d256-dropout", {"d": 256}, {"cc": L4, "grad": True, "dropout_p": 0.1},
     EFFICIENT),
    ("sm120-train-d200", {"d": 200}, {"cc": RTX5090, "grad": True}, EFFICIENT),
    ("sm80-train-d200", {"d": 200}, {"cc": A100, "grad": True}, FLASH),
    # check_head_dim_size_mem_efficient with minimum_gemm_alignment: bf16/fp16 8, fp32 4 on sm80+
    ("efficient-bf16-d100-mask", {"d": 100}, {"cc": A100, "mask": (2, 1, 64, 64)}, MATH),
    ("efficient-fp32-d100-mask", {"d": 100, "dtype": FP32}, {"cc": A100,
                                                             "mask": (2, 1, 64, 64)}, EFFICIENT),
    ("efficient-fp32-d30-sm80", {"d": 30, "dtype": FP32}, {"cc": A100}, MATH),
    # ... fp32 on sm70 has no tensor cores: alignment 1
    ("efficient-fp32-d30-sm70", {"d": 30, "dtype": FP32}, {"cc": V100}, EFFICIENT),
    ("efficient-fp16-d100-sm70", {"d": 100, "dtype": FP16}, {"cc": V100}, MATH),
    # can_use_mem_efficient_attention's dtypes: bf16 only from sm80
    ("efficient-bf16-needs-sm80", {}, {"cc": T4}, MATH),
    # check_batch_size_and_num_heads_dense<true>: flash takes grouped-query K/V with enable_gqa
    ("gqa-flash", {"hq": 32, "hkv": 8}, {"cc": A100, "enable_gqa": True}, FLASH),
    ("gqa-without-flag", {"hq": 32, "hkv": 8}, {"cc": A100}, MATH),
    # ... the memory-efficient kernel does not in 2.11 (<false>); pytorch#191085 adds it later
    ("gqa-masked-2.11", {"hq": 32, "hkv": 8}, {"cc": A100, "enable_gqa": True,
                                               "mask": (2, 1, 64, 64)}, MATH),
    ("gqa-masked-2.14", {"hq": 32, "hkv": 8}, {"cc": A100, "enable_gqa": True,
                                               "mask": (2, 1, 64, 64), "release": R214},
     EFFICIENT),
    # check_prefer_cudnn_attention: cuDNN first on sm90/sm100 once wheels bundle cuDNN > 9.15
    ("cudnn-first-h100", {}, {"cc": H100}, CUDNN),
    ("cudnn-first-b200", {}, {"cc": B200}, CUDNN),
    ("cudnn-not-before-2.11", {}, {"cc": H100, "release": R210}, FLASH),
    ("cudnn-not-sm120", {}, {"cc": RTX5090}, FLASH),
    ("cudnn-gqa-h100", {"hq": 32, "hkv": 8}, {"cc": H100, "enable_gqa": True}, CUDNN),
    ("cudnn-masked-h100", {}, {"cc": H100, "mask": (2, 1, 64, 64)}, CUDNN),
    # check_attn_mask_shape: 2-D or 4-D masks only
    ("cudnn-mask-3d", {}, {"cc": H100, "mask": (2, 64, 64)}, EFFICIENT),
    # check_cudnn_tensor_shapes: head_dim <= 128 and a multiple of 8, no key sequence of 1
    ("cudnn-d256", {"d": 256}, {"cc": H100}, FLASH),
    ("cudnn-d100", {"d": 100}, {"cc": H100}, FLASH),
    ("cudnn-sk1", {"lq": 1, "lk": 1}, {"cc": H100}, FLASH),
    # check_cudnn_dropout: probabilities in steps of 1/16
    ("cudnn-dropout-0.1", {}, {"cc": H100, "dropout_p": 0.1}, FLASH),
    ("cudnn-dropout-0.125", {}, {"cc": H100, "dropout_p": 0.125}, CUDNN),
    # check_cudnn_hardware_support and check_dtypes_low_precision
    ("cudnn-fp32-h100", {"dtype": FP32}, {"cc": H100}, EFFICIENT),
    # check_runtime_disabled_*: disabled backends are skipped
    ("flash-disabled", {}, {"cc": A100, "enabled": (EFFICIENT, MATH, CUDNN)}, EFFICIENT),
    ("math-only", {}, {"cc": H100, "enabled": (MATH,)}, MATH),
    # a user-set priority order (sdpa_kernel(..., set_priority=True)) is followed as given
    ("user-order", {}, {"cc": H100, "order": (EFFICIENT, FLASH, MATH, CUDNN)}, EFFICIENT),
]


@pytest.mark.parametrize(("inputs", "opts", "expected"),
                         [pytest.param(i, o, e, id=n) for n, i, o, e in ROUTES])
def test_choose_cuda_backend(inputs: dict[str, Any], opts: dict[str, Any], expected: str,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    """``sdp_utils.cpp: select_sdp_backend`` case by case (each row cites its filter)."""
    monkeypatch.delenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", raising=False)
    q, k, v = qkv(**inputs)
    m = mask(opts["mask"]) if "mask" in opts else None
    got = choose_cuda_backend(
        q, k, v, m, opts["cc"], dropout_p=opts.get("dropout_p", 0.0),
        is_causal=opts.get("is_causal", False), enable_gqa=opts.get("enable_gqa", False),
        requires_grad=opts.get("grad", True), enabled=opts.get("enabled", ALL),
        order=opts.get("order"), release=opts.get("release", R211))
    assert got == expected


def test_mask_with_strided_last_dim_takes_math() -> None:
    """``sdp_utils_cpp.h: check_last_dim_stride_equals_1_dense``: on GPUs the mask's last
    dimension must have stride 1 (a mask broadcast along it is refused by the fused kernels)."""
    q, k, v = qkv(dtype=FP32)
    m = torch.empty(2, 1, 64, 1, dtype=torch.bool, device="meta").expand(2, 1, 64, 64)
    assert choose_cuda_backend(q, k, v, m, A100, enabled=ALL, release=R211) == MATH
    assert choose_cuda_backend(q, k, v, m.contiguous(), A100, enabled=ALL,
                               release=R211) == EFFICIENT


def test_three_dimensional_inputs_take_math() -> None:
    """``sdp_utils_cpp.h: check_tensor_shapes``: the fused kernels need 4-D q, k, v."""
    q = k = v = torch.empty(8, 64, 64, dtype=BF16, device="meta")
    assert choose_cuda_backend(q, k, v, None, A100, enabled=ALL, release=R211) == MATH


def test_no_enabled_backend_raises() -> None:
    """``sdp_utils.cpp: select_sdp_backend`` fails ("No available kernel") when nothing is left."""
    with pytest.raises(MemfitError, match="enable_math_sdp"):
        choose_cuda_backend(*qkv(dtype=FP32, d=30), None, A100, enabled=(FLASH, CUDNN),
                            release=R211)


@pytest.mark.parametrize(("dtype", "cc", "expected"), [
    (FP16, (7, 0), 8), (FP32, (7, 0), 1), (FP32, (8, 0), 4), (BF16, (8, 0), 8),
    (FP16, (6, 1), 1), (FP32, (9, 0), 4)])
def test_minimum_gemm_alignment(dtype: torch.dtype, cc: tuple[int, int], expected: int) -> None:
    """``sdp_utils.cpp: minimum_gemm_alignment`` and ``use_tensor_cores``: 4 from sm80, raised to
    128 bits per element group where tensor cores run (sm80+; half precision from sm70)."""
    assert minimum_gemm_alignment(dtype, cc) == expected


def test_priority_order_follows_cudnn_preference(monkeypatch: pytest.MonkeyPatch) -> None:
    """``sdp_utils.cpp: priority_order`` / ``check_prefer_cudnn_attention``: cuDNN first on sm90
    and sm100 from 2.11, not on sm80/sm120, not with ``TORCH_CUDNN_SDPA_DEPRIORITIZED=1``."""
    monkeypatch.delenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", raising=False)
    assert priority_order(H100, R211) == CUDNN_ORDER
    assert priority_order(B200, R211) == CUDNN_ORDER
    assert priority_order(A100, R211) == DEFAULT_ORDER
    assert priority_order(RTX5090, R211) == DEFAULT_ORDER
    assert priority_order(H100, R210) == DEFAULT_ORDER
    monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "1")
    assert priority_order(H100, R211) == DEFAULT_ORDER


def test_sdpa_kernel_flags_are_read() -> None:
    """``sdp_utils.cpp: check_runtime_disabled_flash`` and ``priority_order`` read the global
    context that ``torch.nn.attention.sdpa_kernel`` sets; the routing reads the same flags."""
    q, k, v = qkv()
    assert choose_cuda_backend(q, k, v, None, A100, release=R211) == FLASH
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        assert choose_cuda_backend(q, k, v, None, A100, release=R211) == EFFICIENT
    with sdpa_kernel([SDPBackend.MATH, SDPBackend.FLASH_ATTENTION], set_priority=True):
        assert choose_cuda_backend(q, k, v, None, A100, release=R211) == MATH
    assert choose_cuda_backend(q, k, v, None, A100, release=R211) == FLASH


# -- bytes through memfit.estimate ------------------------------------------------------------

def forward_saved(est: Any, module: str) -> int:
    """Bytes a module's forward (its submodules' included) created that were still alive when the
    forward ended (the tensors autograd saved for backward), first step."""
    return sum(m.activation_bytes for name, m in est.modules.items()
               if name == module or name.startswith(module + "."))


class LlamaAttention(nn.Module):
    """Llama-style attention, as Hugging Face's SDPA path calls it without a mask."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.h, self.kv, self.d = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.h, self.d).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv, self.d).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv, self.d).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=self.kv != self.h)
        return self.o_proj(o.transpose(1, 2).reshape(b, s, self.h * self.d))


def llama_estimate(kv_heads: int, gpu: str, seq: int = 256) -> Any:
    with torch.device("meta"):
        model = nn.Sequential(LlamaAttention(4096, 32, kv_heads, 128)).to(BF16)
    x = torch.zeros(1, seq, 4096, dtype=BF16, device="meta", requires_grad=True)
    return estimate(model, x, precision="bf16", device="cuda", gpu=gpu, steps=1)


@pytest.mark.parametrize("gpu", ["a100-sxm-80gb", "h100-sxm-80gb"])
def test_gqa_keys_and_values_stay_unexpanded(gpu: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``sdp_utils.cpp: can_use_flash_attention`` / ``can_use_cudnn_attention`` instantiate
    ``check_batch_size_and_num_heads_dense`` with GQA support, and ``attention.cpp:
    scaled_dot_product_attention`` hands them K/V as given (only the math path calls
    ``pre_process_group_query_attention_input``). So a bf16 Llama layer with 8 KV heads saves
    K and V of 8 heads: 2 x (32 - 8) heads x 256 tokens x 128 x 2 B less than with 32."""
    monkeypatch.delenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", raising=False)
    mha, gqa = llama_estimate(32, gpu), llama_estimate(8, gpu)
    assert forward_saved(mha, "0") - forward_saved(gqa, "0") == 2 * 24 * 256 * 128 * 2
    ops = {str(p.op) for p in gqa.timeline}
    assert not any("repeat_interleave" in op or "index_select" in op for op in ops)
    cudnn = gpu.startswith("h100") and torch_release() >= CUDNN_PREFERRED_SINCE
    assert any(("_cudnn_attention" if cudnn else "_flash_attention") in op for op in ops)


def test_math_path_expands_gqa_itself() -> None:
    """``attention.cpp: _scaled_dot_product_attention_math``: grouped-query K/V reach the math
    path unexpanded and it repeats them (``pre_process_group_query_attention_input``:
    ``repeat_interleave``, an unsqueeze-expand-clone copy) after upcasting bf16 to float32
    (``allowFP16BF16ReductionMathSDP`` is off by default), casting the output back. A masked GQA
    call on an A100 takes math in 2.11 (see the routing table)."""
    from memfit.trace.sdpa import cuda_sdpa

    q, k, v = (torch.zeros(1, h, 64, 64, dtype=BF16, requires_grad=True) for h in (8, 2, 2))
    m = torch.ones(1, 1, 64, 64, dtype=torch.bool)
    out = cuda_sdpa(q, k, v, m, enable_gqa=True, compute_capability=A100)
    assert out.shape == (1, 8, 64, 64) and out.dtype == BF16
    seen, stack = set(), [out.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is not None and fn not in seen:
            seen.add(fn)
            stack.extend(n for n, _ in fn.next_functions)
    names = {type(fn).__name__ for fn in seen}
    assert {"ToCopyBackward0", "ExpandBackward0", "CloneBackward0"} <= names
    out.float().sum().backward()
    assert k.grad is not None and k.grad.shape == k.shape


class Kernel(nn.Module):
    """Attention on given q, k, v (inputs, so only what the kernel creates is counted); the
    estimate needs a parameter to train, so one unused scalar."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self.unused = nn.Parameter(torch.zeros(1))
        self.kwargs = kwargs

    def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.scaled_dot_product_attention(inputs["q"], inputs["k"], inputs["v"],
                                              attn_mask=inputs.get("m"), **self.kwargs)


def kernel_estimate(inputs: dict[str, torch.Tensor], precision: str, gpu: str = "a100-sxm-80gb",
                    **kwargs: Any) -> Any:
    with torch.device("meta"):
        model = nn.Sequential(Kernel(**kwargs))
    return estimate(model, (inputs,), optimizer="sgd", precision=precision, device="cuda",
                    gpu=gpu, steps=1, loss_fn=lambda m, b: m(*b).float().sum())


def masked_saved(s: int, mask_dtype: torch.dtype) -> int:
    b, h, L, d = 2, 8, 64, 64
    q = torch.zeros(b, h, L, d, dtype=FP16, device="meta", requires_grad=True)
    k = torch.zeros(b, h, s, d, dtype=FP16, device="meta", requires_grad=True)
    v = torch.zeros(b, h, s, d, dtype=FP16, device="meta", requires_grad=True)
    m = torch.zeros(b, 1, L, s, dtype=mask_dtype, device="meta")
    return forward_saved(kernel_estimate({"q": q, "k": k, "v": v, "m": m}, "fp16"), "0")


def test_masked_efficient_attention_pads_unaligned_masks() -> None:
    """``attention.cpp: preprocess_mask``: the memory-efficient kernel's mask is copied with its
    last dimension padded (``pad_bias<8>``) only when ``aligned_tensor<8>`` fails, then expanded
    as a view; the kernel saves it for backward. An fp16 (B=2, 1, L=64, S) mask: S = 1000 and
    S = 1008 are multiples of 8 (no copy, same saved bytes: output, logsumexp and RNG scalars
    do not depend on S); S = 1001 adds a copy of 2 x 64 x 1008 x 2 B."""
    s1000, s1008, s1001 = (masked_saved(s, FP16) for s in (1000, 1008, 1001))
    assert s1000 == s1008
    assert s1001 - s1000 == 2 * 1 * 64 * 1008 * 2


def test_boolean_mask_is_converted_and_saved() -> None:
    """``attention.cpp: convert_boolean_attn_mask``: a boolean mask becomes an additive fp16 one of
    its own shape, which the memory-efficient kernel saves: 2 x 64 x 1000 x 2 B more than an
    fp16 mask given as such (an input, not created by the forward)."""
    assert masked_saved(1000, torch.bool) - masked_saved(1000, FP16) == 2 * 64 * 1000 * 2


@pytest.mark.parametrize("head_dim", [96, 100])
def test_flash_pads_head_dim_to_multiple_of_8(head_dim: int) -> None:
    """``attention.cpp: scaled_dot_product_attention`` pads q, k, v with ``pad_last_dim<8, false>``
    for flash (copies the kernel saves) and slices the output back; ``_meta_registrations.py:
    meta__scaled_dot_product_flash_attention`` gives the output like the (padded) query and a
    float32 logsumexp [B, H, L]. B=2, H=8, L=S=128, bf16 on an A100."""
    b, h, L = 2, 8, 128
    t = [torch.zeros(b, h, L, head_dim, dtype=BF16, device="meta", requires_grad=True)
         for _ in range(3)]
    est = kernel_estimate({"q": t[0], "k": t[1], "v": t[2]}, "bf16")
    padded = math.ceil(head_dim / 8) * 8
    rng = sum(r.nbytes for r in aten_flash_meta(t)[6:8])
    copies = 3 if padded != head_dim else 0
    expected = (copies + 1) * b * h * L * padded * 2 + b * h * L * 4 + rng
    assert forward_saved(est, "0") == expected


@pytest.mark.skipif(torch_release() < CUDNN_PREFERRED_SINCE,
                    reason="cuDNN attention is preferred from torch 2.11")
def test_cudnn_attention_saves_output_and_stats(monkeypatch: pytest.MonkeyPatch) -> None:
    """On an H100 (``sdp_utils.cpp: check_prefer_cudnn_attention``) a bf16 call without a mask
    takes cuDNN, which keeps (``_meta_registrations.py:
    meta__scaled_dot_product_cudnn_attention``) the output [B, H, L, Dv] and float32 softmax
    stats [B, H, L, 1] besides its RNG seed and offset; grouped-query K/V stay unexpanded. B=2,
    H=8 (2 KV heads), L=S=128, D=64."""
    monkeypatch.delenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", raising=False)
    b, h, L, d = 2, 8, 128, 64
    q = torch.zeros(b, h, L, d, dtype=BF16, device="meta", requires_grad=True)
    k, v = (torch.zeros(b, 2, L, d, dtype=BF16, device="meta", requires_grad=True)
            for _ in range(2))
    est = kernel_estimate({"q": q, "k": k, "v": v}, "bf16", gpu="h100-sxm-80gb",
                          enable_gqa=True)
    rng = 2 * 8  # the seed and offset: int64 scalars in the meta registration
    assert forward_saved(est, "0") == b * h * L * d * 2 + b * h * L * 4 + rng
    assert any("_cudnn_attention" in p.op for p in est.timeline)


def aten_flash_meta(t: list[torch.Tensor]) -> Any:
    return torch.ops.aten._scaled_dot_product_flash_attention(t[0], t[1], t[2])


# -- dropout ----------------------------------------------------------------------------------

class Scaled(nn.Module):
    def __init__(self, dropout: nn.Module) -> None:
        super().__init__()
        self.dropout = dropout
        self.unused = nn.Parameter(torch.zeros(1))  # the estimate trains something

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(x * 2)


@pytest.mark.parametrize("dtype", [FP32, BF16])
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_dropout_keeps_a_one_byte_mask_on_cuda(dtype: torch.dtype, device: str) -> None:
    """``Dropout.cpp: dropout``: on CUDA ``is_fused_kernel_acceptable`` holds (0 < p < 1, numel > 0)
    and ``native_dropout`` saves only its boolean mask (1 B per element); on the CPU
    ``_dropout_impl`` multiplies by a noise tensor of the input's dtype and saves that."""
    n = 64 * 1024
    with torch.device("meta"):
        model = nn.Sequential(Scaled(nn.Dropout(0.1)))
    x = torch.zeros(64, 1024, dtype=dtype, device="meta", requires_grad=True)
    precision = "fp32" if dtype == FP32 else "bf16"
    est = estimate(model, x, optimizer="sgd", precision=precision,
                   device=device, steps=1, loss_fn=lambda m, b: m(b).float().sum())
    # x * 2 is not saved (mul by a constant keeps nothing); the dropout keeps its mask.
    per_element = 1 if device == "cuda" else dtype.itemsize
    assert forward_saved(est, "0.dropout") == n * per_element


class SquareThroughDropout(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * self.scale  # mul by a parameter saves x
        return y * F.dropout(y, self.p, True)  # saves y and the dropout's output


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_dropout_with_p_zero_returns_its_input_on_cuda(dtype: torch.dtype) -> None:
    """``Dropout.cpp: _dropout_impl``: "if (p == 0 || !train || input.sym_numel() == 0) return
    input;" — the same tensor, no copy (checked on real tensors here too). The last mul then
    saves y twice, one storage: of what the forward made, y stays (64 Ki elements, besides
    scalars under 512 B); a copy would add another 64 Ki elements."""
    t = torch.randn(3, requires_grad=True)
    assert F.dropout(t, 0.0, True) is t
    n = 64 * 1024
    with torch.device("meta"):
        model = SquareThroughDropout(0.0).to(dtype)
    x = torch.zeros(64, 1024, dtype=dtype, device="meta")
    precision = "fp32" if dtype == FP32 else "bf16"
    est = estimate(model, x, optimizer="sgd", precision=precision, device="cuda", steps=1,
                   loss_fn=lambda m, b: m(b).float().sum())
    assert n * dtype.itemsize <= forward_saved(est, "") < n * dtype.itemsize + 512


def test_inplace_dropout_keeps_input_dtype_noise_on_cuda() -> None:
    """``Dropout.cpp: dropout_`` runs ``_dropout<true>`` (noise of the input's dtype) on CUDA
    too: only the out-of-place ``dropout`` has the fused path."""
    with torch.device("meta"):
        model = nn.Sequential(Scaled(nn.Dropout(0.1, inplace=True)))
    x = torch.zeros(64, 1024, device="meta", requires_grad=True)
    est = estimate(model, x, optimizer="sgd", device="cuda", steps=1,
                   loss_fn=lambda m, b: m(b).sum())
    assert forward_saved(est, "0.dropout") == 64 * 1024 * 4


def test_math_sdpa_dropout_uses_the_fused_kernel() -> None:
    """``attention.cpp: _scaled_dot_product_attention_math`` drops out with ``at::dropout``,
    which on CUDA is ``native_dropout`` (``Dropout.cpp: dropout``): fp32, head_dim 30 on an
    A100 goes to math (flash needs half precision, memory-efficient a head_dim multiple of 4),
    and its dropout keeps a bool mask [B, H, L, S], not a float32 noise tensor."""
    t = [torch.zeros(2, 4, 64, 30, device="meta", requires_grad=True) for _ in range(3)]
    est = kernel_estimate({"q": t[0], "k": t[1], "v": t[2]}, "fp32", dropout_p=0.1)
    ops = [str(p.op) for p in est.timeline if p.phase == "forward"]
    assert any("native_dropout" in op for op in ops)
    assert not any("bernoulli" in op for op in ops)


def test_routing_holds_in_checkpoint_recompute() -> None:
    """The recompute of ``torch.utils.checkpoint`` runs in backward: the fused dropout
    (``Dropout.cpp: dropout``) and the CUDA attention kernel must be taken there as in the
    forward, or the recomputed tensors differ from the saved ones."""
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = LlamaAttention(256, 4, 2, 64)
            self.drop = nn.Dropout(0.1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.utils.checkpoint.checkpoint(
                lambda y: self.drop(self.attn(y)), x, use_reentrant=False)

    with torch.device("meta"):
        model = nn.Sequential(Block()).to(BF16)
    x = torch.zeros(2, 128, 256, dtype=BF16, device="meta", requires_grad=True)
    est = estimate(model, x, precision="bf16", device="cuda", gpu="a100-sxm-80gb", steps=1)
    backward = [str(p.op) for p in est.timeline if p.phase == "backward"]
    assert any("native_dropout." in op for op in backward)
    assert any("_scaled_dot_product_flash_attention." in op for op in backward)
    assert not any("bernoulli" in op for op in backward)


def test_routing_accepts_keyword_inputs() -> None:
    """``F.scaled_dot_product_attention(query=..., key=..., value=...)`` is routed like the
    positional call (meta tensors: the fused ops' meta kernels give the shapes)."""
    from memfit.trace.sdpa import CudaRouting

    q = torch.empty(1, 4, 32, 64, dtype=BF16, device="meta")
    with CudaRouting(A100, cuda_on_cpu=False):
        out = F.scaled_dot_product_attention(query=q, key=q, value=q, is_causal=True)
    assert out.shape == q.shape and out.dtype == BF16
