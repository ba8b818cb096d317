"""Activation offload: exact numerics, no cost on the CPU, real saving on a GPU, with AC."""

from __future__ import annotations

import contextlib
import copy
import gc
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from _models import MlpBlock
from memfit import estimate
from memfit.errors import MemfitError
from memfit.profiling import measure_cpu_peak
from memfit.techniques.checkpointing import EveryK, apply_activation_checkpointing
from memfit.techniques.offload import (
    OffloadActivations,
    apply_activation_offload,
    offload_activations,
)

DIM, VOCAB = 64, 256


class Net(nn.Module):
    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(MlpBlock(DIM, 4 * DIM, dropout=0.1) for _ in range(layers))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def loss_fn(logits: torch.Tensor) -> torch.Tensor:
    return logits.pow(2).mean()


class HostCopies(OffloadActivations):
    """Offload CPU tensors too (to another CPU buffer): runs the copy path without a GPU."""

    def _keep(self, t: torch.Tensor) -> bool:
        return isinstance(t, nn.Parameter) or t.numel() * t.element_size() < self.min_bytes


def loss_and_grads(model: nn.Module, x: torch.Tensor, hooks: Any = None
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(0)  # the same dropout masks
    with hooks if hooks is not None else warnings.catch_warnings():
        loss = loss_fn(model(x))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def assert_same(a: tuple[torch.Tensor, dict[str, torch.Tensor]],
                b: tuple[torch.Tensor, dict[str, torch.Tensor]]) -> None:
    assert torch.equal(a[0], b[0])
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), name


def saved_bytes(model: nn.Module, x: torch.Tensor, min_bytes: int) -> int:
    """Bytes of the non-parameter tensors autograd saves that are >= min_bytes (an independent
    count with plain hooks)."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        nbytes = t.numel() * t.element_size()
        if not isinstance(t, nn.Parameter) and nbytes >= min_bytes:
            total += nbytes
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_fn(model(x))
    return total


# -- exactness -----------------------------------------------------------------------------------

@pytest.mark.parametrize("checkpoint", [False, True])
def test_copy_path_is_bit_exact_and_moves_what_is_saved(checkpoint: bool) -> None:
    # Copying a tensor to host memory and back is exact; dropout masks are the same because the
    # hooks draw no random numbers.
    torch.manual_seed(0)
    base = Net()
    model = copy.deepcopy(base)
    if checkpoint:
        apply_activation_checkpointing(model, EveryK(2))
    x = torch.randint(0, VOCAB, (4, 32))
    hooks = HostCopies(min_bytes=4096)
    assert_same(loss_and_grads(base, x), loss_and_grads(model, x, hooks))
    assert hooks.stats.offloaded > 0 and hooks.stats.kept > 0  # the threshold keeps small ones
    assert hooks.stats.prefetched > 0  # prefetched copies served backward, exactly
    assert hooks.stats.offloaded_bytes == saved_bytes(model, x, 4096)
    if checkpoint:
        # Note: [offload after checkpointing]: checkpointed blocks save nothing through autograd.
        assert hooks.stats.offloaded_bytes < saved_bytes(base, x, 4096)


def test_cpu_tensors_pass_through_untouched_with_one_warning() -> None:
    torch.manual_seed(0)
    base = Net()
    model = copy.deepcopy(base)
    apply_activation_checkpointing(model, EveryK(2))
    hooks = apply_activation_offload(model, min_bytes=0)
    x = torch.randint(0, VOCAB, (4, 32))
    with pytest.warns(UserWarning, match="saves nothing") as record:
        got = loss_and_grads(model, x)
    assert len([w for w in record if "saves nothing" in str(w.message)]) == 1
    ref = copy.deepcopy(base)
    apply_activation_checkpointing(ref, EveryK(2))
    assert_same(loss_and_grads(ref, x), got)
    assert hooks.stats.offloaded == 0 and hooks.stats.kept > 0


def test_context_manager_gives_its_stats() -> None:
    torch.manual_seed(0)
    model, x = relu_mlp(2, 32), torch.randn(64, 32)
    with HostCopies(min_bytes=64 * 32 * 4) as off:  # activations (8 KiB), not weights (4 KiB)
        loss = model(x).sum()
    loss.backward()
    assert off.stats.offloaded == 3  # x and the two ReLU outputs, each copied once


def test_bad_threshold_raises() -> None:
    with pytest.raises(MemfitError, match="min_bytes"):
        offload_activations(min_bytes=-1)


# -- measured and predicted effect on the CPU: none, by design -----------------------------------

def train_step(model: nn.Module, x: torch.Tensor) -> Any:
    gc.collect()

    def run() -> None:
        loss_fn(model(x)).backward()
    return run


def test_cpu_peak_is_unchanged_and_estimated() -> None:
    # On the CPU offload must cost nothing: no copy is made, so the allocator sees exactly the
    # same allocations as without it.
    torch.manual_seed(0)
    base = Net()
    model = copy.deepcopy(base)
    apply_activation_offload(model)
    x = torch.randint(0, VOCAB, (8, 128))
    real0 = measure_cpu_peak(train_step(base, x), base, x).peak_bytes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        real1 = measure_cpu_peak(train_step(model, x), model, x).peak_bytes
        est = estimate(model, (x,), optimizer="sgd", loss_fn=lambda m, b: loss_fn(m(*b)),
                       device="cpu", steps=1)
    assert real1 == real0
    assert abs(est.peak_bytes - real1) <= 0.01 * real1, (est.peak_bytes, real1)


def relu_mlp(layers: int, dim: int) -> nn.Module:
    return nn.Sequential(*[m for _ in range(layers)
                           for m in (nn.Linear(dim, dim, bias=False), nn.ReLU())])


@pytest.mark.parametrize("prefetch", [False, True])
def test_estimate_predicts_the_cuda_saving_and_the_host_memory(prefetch: bool) -> None:
    # L blocks of Linear(d, d) -> ReLU on a (B, d) input, fp32, plain SGD (no state). Every
    # activation is A = B*d*4 bytes = 1 MiB (a multiple of CUDA's 512-byte blocks); a weight
    # is W = d*d*4 = 16 KiB, under min_bytes, so it stays.
    #   Without offload the peak is at the first backward ops: the input x and the L ReLU
    #   outputs (saved by each ReLU and the next Linear) plus one gradient: (L + 2) A.
    #   With offload, each saved ReLU output leaves the device once its block has run; in the
    #   backward a Linear's node holds the incoming gradient, its input brought back and the
    #   input gradient it computes, besides x: 4 A. Prefetch adds the tensor saved before its
    #   input, already on its way back: 5 A.
    #   Host: one copy of x and of each ReLU output (saved twice, copied once): (L + 1) A.
    L, d, B = 8, 64, 4096
    A, W = B * d * 4, d * d * 4
    base = relu_mlp(L, d)
    model = copy.deepcopy(base)
    hooks = apply_activation_offload(model, min_bytes=2**16, prefetch=prefetch)
    x = torch.randn(B, d)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est0 = estimate(base, (x,), optimizer="sgd", device="cuda", steps=1)
        est1 = estimate(model, (x,), optimizer="sgd", device="cuda", steps=1)
    # cuBLAS workspaces are allocated through the caching allocator: take them out
    dev0, dev1 = (e.peak_bytes - sum(e.runtime[k] for k in e.runtime_in_allocator)
                  for e in (est0, est1))
    # weights L*W, plus at most L*W of weight gradients and a few 512-byte scalars
    assert (L + 2) * A + L * W <= dev0 <= (L + 2) * A + 2 * L * W + 8 * 512, dev0 / A
    held = 5 if prefetch else 4
    assert held * A + L * W <= dev1 <= held * A + 2 * L * W + 8 * 512, dev1 / A
    assert est1.host_peak_bytes == (L + 1) * A
    assert est0.host_peak_bytes == 0
    # the prefetch itself is seen in the bytes above (5 A against 4 A); the user's hooks ran
    # nothing: estimate traces a copy of the model and leaves the original untouched
    assert (hooks.stats.offloaded, hooks.stats.prefetched) == (0, 0)


class MetaHost(OffloadActivations):
    """Offload CPU tensors to the meta device, a "host" whose memory costs nothing, and bring
    them back as new CPU tensors: the CPU allocator then sees exactly what a GPU's sees with
    real offload (copy out and free; allocate again when backward needs it, or ahead of need
    when prefetching). The values are lost, so this is for measuring memory only."""

    def _keep(self, t: torch.Tensor) -> bool:
        return isinstance(t, nn.Parameter) or t.numel() * t.element_size() < self.min_bytes

    def _fetch(self, packed: Any, *, ahead: bool) -> torch.Tensor:
        return torch.empty_like(packed.cpu, device=packed.device)


@pytest.mark.parametrize("offload", ["none", "offload", "offload+prefetch"])
def test_cuda_prediction_matches_the_same_allocations_measured_on_the_cpu(
        offload: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # An independent measurement of the device side of offload without a GPU: the CPU
    # allocator's events (profiler) for a run that offloads to the meta device (MetaHost).
    # The CUDA-target prediction must match it up to CUDA's 512-byte rounding of the few
    # scalars (the big tensors are multiples of 512 bytes).
    import memfit.techniques.offload as offload_module

    monkeypatch.setattr(offload_module, "copy_to_host",
                        lambda t, pin_memory=False: t.detach().to("meta"))
    L, d, B = 6, 64, 2048
    torch.manual_seed(0)
    model, x = relu_mlp(L, d), torch.randn(B, d)
    prefetch = offload == "offload+prefetch"
    hooks = MetaHost(min_bytes=2**16, prefetch=prefetch) if offload != "none" else None

    def step() -> None:
        with hooks if hooks is not None else contextlib.nullcontext():
            loss = model(x).sum()
        loss.backward()

    gc.collect()
    real = measure_cpu_peak(step, model, x).peak_bytes
    model.zero_grad(set_to_none=True)
    monkeypatch.undo()
    traced = copy.deepcopy(model)
    if hooks is not None:
        apply_activation_offload(traced, min_bytes=2**16, prefetch=prefetch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = estimate(traced, (x,), optimizer="sgd", device="cuda", steps=1)
    pred = est.peak_bytes - sum(est.runtime[k] for k in est.runtime_in_allocator)
    assert abs(pred - real) <= 8 * 512, (pred, real)
    if hooks is not None:
        assert (hooks.stats.offloaded, hooks.stats.prefetched) == (L + 1, L if prefetch else 0)


def test_a_tensor_saved_twice_is_copied_once() -> None:
    # A ReLU's output is saved by the ReLU (its backward needs it) and by the next Linear: one
    # host copy serves both. Saved: x and L ReLU outputs, L - 1 of them twice (the last ReLU's
    # output feeds no Linear): 2L packs, L + 1 copies.
    L = 4
    torch.manual_seed(0)
    base = relu_mlp(L, 32)
    model = copy.deepcopy(base)
    x = torch.randn(64, 32)
    packs = 0

    def count(t: torch.Tensor) -> torch.Tensor:
        nonlocal packs
        packs += not isinstance(t, nn.Parameter) and t.numel() >= 64 * 32
        return t

    with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
        model(x).sum()
    hooks = HostCopies(min_bytes=64 * 32 * 4)
    with hooks:
        loss = model(x).sum()
    loss.backward()
    assert packs == 2 * L
    assert hooks.stats.offloaded == L + 1
    assert hooks.stats.offloaded_bytes == (L + 1) * 64 * 32 * 4
    ref = base(x).sum()
    ref.backward()
    assert torch.equal(loss, ref)
    for p, q in zip(model.parameters(), base.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


# -- on a GPU --------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("use_streams", "prefetch"), [(True, True), (True, False),
                                                     (False, False)])
def test_cuda_offload_is_exact_and_saves_memory(use_streams: bool, prefetch: bool) -> None:
    torch.manual_seed(0)
    base = Net(layers=8).cuda()
    model = copy.deepcopy(base)
    x = torch.randint(0, VOCAB, (16, 512), device="cuda")
    hooks = offload_activations(min_bytes=2**16, use_streams=use_streams, prefetch=prefetch,
                                model=model)
    # The embedding's CUDA backward accumulates with atomics: two runs of the same model differ
    # in the last bits (seen on an H100) unless torch's deterministic kernels are asked for.
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        assert_same(loss_and_grads(base, x), loss_and_grads(model, x, hooks))
    finally:
        torch.use_deterministic_algorithms(deterministic)
    assert hooks.stats.offloaded_bytes > 0
    assert (hooks.stats.prefetched > 0) == prefetch

    def peak(m: nn.Module, h: Any) -> int:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        loss_and_grads(m, x, h)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()

    # Saved activations per block ~ (1 + 4 + 4 + 1 + ...) * d * 4 bytes per token: all but the
    # block being recomputed/consumed leave the GPU, so at least a third of the peak goes.
    p0, p1 = peak(base, None), peak(model, offload_activations(
        min_bytes=2**16, use_streams=use_streams, prefetch=prefetch))
    assert p1 <= 0.67 * p0, (p0, p1)


def test_composes_with_chunked_loss_and_checkpointing_in_the_documented_order() -> None:
    # Order: chunked loss (replaces the head's loss) -> checkpointing (wraps blocks) -> offload
    # (wraps the whole forward). Every step keeps the math: gradients stay bit-exact.
    from memfit.models.build import build_model, example_inputs
    from memfit.models.spec import TransformerSpec
    from memfit.techniques.loss import apply_chunked_loss

    spec = TransformerSpec(name="t", family="llama", arch="decoder", hidden_size=32,
                           num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                           intermediate_size=64, vocab_size=512, norm="rmsnorm",
                           position="rope", mlp="swiglu")
    torch.manual_seed(0)
    base = apply_chunked_loss(build_model(spec, backend="builtin", device="cpu"), chunk_size=16)
    model = copy.deepcopy(base)
    apply_activation_checkpointing(model, "selective")
    hooks = apply_activation_offload(model, min_bytes=0)
    inputs = example_inputs(spec, batch=2, seq=24, device="cpu")
    results = []
    for m in (base, model):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss = m(**inputs)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in m.named_parameters()}))
    assert_same(results[0], results[1])
    assert hooks.stats.kept > 0  # the offload hooks saw the saved tensors
    logits = model(input_ids=inputs["input_ids"])
    assert logits.shape == (2, 24, 512)


class SavedOnCpu(nn.Module):
    """A model whose forward runs under torch's own ``save_on_cpu``."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            return self.inner(x)


def test_estimate_predicts_torchs_save_on_cpu() -> None:
    # The model of test_estimate_predicts_the_cuda_saving_and_the_host_memory under torch's
    # save_on_cpu instead of memfit's hooks. The device side is the same as memfit's offload
    # without prefetch, 4 A in backward; the host holds a copy per save, not per tensor: x, the
    # L ReLU outputs saved by their ReLU and the L - 1 saved again by the next Linear: 2L A.
    # save_on_cpu copies parameters too: the weights the L - 1 Linears after the first save
    # for their input gradient (the first one's input needs none): (L - 1) W.
    L, d, B = 8, 64, 4096
    A, W = B * d * 4, d * d * 4
    x = torch.randn(B, d)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = estimate(SavedOnCpu(relu_mlp(L, d)), (x,), optimizer="sgd", device="cuda",
                       steps=1)
    dev = est.peak_bytes - sum(est.runtime[k] for k in est.runtime_in_allocator)
    assert 4 * A + L * W <= dev <= 4 * A + 2 * L * W + 8 * 512, dev / A
    assert est.host_peak_bytes == 2 * L * A + (L - 1) * W
    # patched for the trace only: torch's own class is back
    assert torch.autograd.graph.save_on_cpu.__init__.__module__ == "torch.autograd.graph"


def test_a_model_whose_hooks_hold_streams_can_be_estimated() -> None:
    # On a GPU the hooks keep their CUDA streams after a real step, and torch.cuda.Stream cannot
    # be deep-copied: memfit.estimate failed with "cannot pickle 'Stream'" (first GPU run). A
    # lock stands in for the stream here (it cannot be pickled either).
    import threading

    torch.manual_seed(0)
    model = Net(layers=2)
    hooks = apply_activation_offload(model, min_bytes=2**16)
    x = torch.randint(0, VOCAB, (4, 64))
    expected = estimate(model, (x,), loss_fn=lambda m, b: loss_fn(m(*b)), device="cpu")
    hooks._stream = hooks._h2d = threading.Lock()
    got = estimate(model, (x,), loss_fn=lambda m, b: loss_fn(m(*b)), device="cpu")
    assert got.peak_bytes == expected.peak_bytes
    assert hooks._stream is not None  # the user's hooks are untouched
