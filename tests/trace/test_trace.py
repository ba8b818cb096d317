"""The trace engine's accounting rules, each checked against hand-computed bytes."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import memfit.trace
from memfit.categories import MemoryCategory
from memfit.errors import MemfitError
from memfit.trace import Estimate, estimate
from memfit.trace.estimate import PHASES

MiB = 2**20
ACT, W, G, S = (MemoryCategory.ACTIVATIONS, MemoryCategory.WEIGHTS, MemoryCategory.GRADIENTS,
                MemoryCategory.OPTIMIZER_STATES)


def test_exported_names() -> None:
    assert set(memfit.trace.__all__) == {"OPTIMIZERS", "PRECISIONS", "Estimate", "ModuleMemory",
                                         "TimelinePoint", "default_loss", "estimate"}


def _end_of_forward(est: Estimate, step: int = 0) -> dict[MemoryCategory, int]:
    last = [p for p in est.timeline if p.phase == "forward" and p.step == step][-1]
    return last.by_category()


def test_weights_and_inputs_counted_inference() -> None:
    with torch.device("meta"):
        model = nn.Linear(256, 128, bias=False)           # 256*128*4 = 131072 bytes
    x = torch.empty(64, 256, device="meta")               # 65536 bytes
    est = estimate(model, x, optimizer=None, device="cpu")
    # weights + input + output (64*128*4 = 32768), nothing else in a no_grad forward.
    assert est.peak_bytes == 131072 + 65536 + 32768
    assert est.breakdown[W] == 131072
    assert est.peak_reserved_bytes == est.peak_bytes
    assert est.runtime == {}


def test_tied_weights_counted_once() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(1000, 64)
            self.out = nn.Linear(64, 1000, bias=False)
            self.out.weight = self.emb.weight

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return self.out(self.emb(idx))

    est = estimate(Tied(), torch.zeros(2, 8, dtype=torch.long), optimizer=None, device="cpu")
    first = est.timeline[0].by_category()
    assert first[W] == 1000 * 64 * 4


def test_views_and_inplace_not_double_counted() -> None:
    class ViewsInplace(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x * 2                  # one new 4 KiB storage
            y.add_(1).relu_()          # in place: none
            z = y.view(32, 32).t()[1:]  # views: none
            return z

    x = torch.empty(1024)
    est = estimate(ViewsInplace(), x, optimizer=None, device="cpu")
    assert est.peak_bytes == 4096 + 4096


def test_adam_states_created_in_first_step_and_steady_in_second() -> None:
    model = nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 128))
    n_params = 2 * (128 * 128 + 128)
    est = estimate(model, torch.empty(16, 128), optimizer="adam", device="cpu", steps=2)
    peak_by_step = [max(p.total for p in est.timeline if p.step == s) for s in (0, 1)]
    assert peak_by_step[1] >= peak_by_step[0]
    # Two fp32 states per parameter plus a 4-byte step counter per parameter tensor.
    end = est.timeline[-1].by_category()
    assert end[S] == 2 * 4 * n_params + 4 * 4
    assert end[G] == 0  # zero_grad(set_to_none=True)


def test_sgd_has_no_state_and_momentum_has_one() -> None:
    model = nn.Linear(64, 64, bias=False)
    x = torch.empty(8, 64)
    plain = estimate(model, x, optimizer="sgd", device="cpu")
    mom = estimate(model, x, optimizer="sgd-momentum", device="cpu")
    assert plain.timeline[-1].by_category()[S] == 0
    assert mom.timeline[-1].by_category()[S] == 64 * 64 * 4


def test_model_unchanged() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = [id(p) for p in model.parameters()]
    estimate(model, torch.randn(4, 8), optimizer="adamw", device="cpu")
    estimate(model, torch.randn(4, 8), optimizer="adamw", precision="bf16-mixed", device="cuda")
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert [id(p) for p in model.parameters()] == params
    assert all(p.device.type == "cpu" and p.grad is None for p in model.parameters())
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_data_dependent_ops_warn_once_and_do_not_crash() -> None:
    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            picked = h[h > 0]                        # boolean indexing
            idx = torch.nonzero(h > 0.5)
            if (h > 0).any():                        # .item()
                picked = picked * 2
            return picked.sum() + idx.shape[0] + torch.unique(x).sum()

    with torch.device("meta"):  # no values: the assumptions answer
        model = Masked()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        est = estimate(model, torch.empty(8, 16, device="meta"), optimizer="adamw",
                       device="cpu")
    ours = [w for w in caught if "memfit: assumed" in str(w.message)]
    assert len(ours) == 1
    assert est.assumptions and "data-dependent" in est.assumptions[0]
    # Real weights and inputs: a real forward answers every one of them (Note: [real values of
    # a real step] in trace/real_values.py), without a warning.
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        est = estimate(Masked(), torch.randn(8, 16), optimizer="adamw", device="cpu")
    assert not [w for w in caught if "memfit: assumed" in str(w.message)]
    # 4 values: the mask's size, nonzero's size, .any()'s answer, unique's sizes.
    assert est.assumptions == ("data-dependent values (4 per forward) read from a real forward "
                               "of the given inputs (no_grad, CPU)",)


def test_cuda_bf16_mixed_saves_bf16_activations() -> None:
    # Two bias-free Linear layers, input x [512, 1024] fp32, loss = out.float().sum().
    # At the end of the forward under CUDA bf16 autocast the live activations are: the fp32
    # input (2 MiB), its bf16 cast (1 MiB, saved for the first weight's grad), the second
    # weight's bf16 cast (2 MiB, saved for the hidden's grad), the bf16 hidden (1 MiB) and the
    # bf16 output (1 MiB), plus the loss (4 bytes, one 512-byte block). The first weight's bf16
    # cast is not saved (the input needs no grad, so mm does not keep it) and dies when autocast
    # exits and clears its cast cache. In fp32: input, hidden and output at 2 MiB each.
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(1024, 1024, bias=False), nn.Linear(1024, 1024, bias=False))
    x = torch.empty(512, 1024, device="meta")

    def loss(o: torch.Tensor) -> torch.Tensor:
        return o.float().sum()

    # keep_output: the loop holds the output through the backward, so it is alive at the end
    # of the forward.
    mixed = estimate(model, x, precision="bf16-mixed", device="cuda",
                     loss_fn=lambda m, b: loss(m(b)),
                     keep_output=True)
    fp32 = estimate(model, x, precision="fp32", device="cuda", loss_fn=lambda m, b: loss(m(b)),
                    keep_output=True)
    assert _end_of_forward(mixed)[ACT] == (2 + 1 + 2 + 1 + 1) * MiB + 512
    assert _end_of_forward(fp32)[ACT] == (2 + 2 + 2) * MiB + 512
    assert mixed.peak_reserved_bytes >= mixed.peak_bytes
    assert mixed.peak_bytes % 512 == 0


def test_cuda_sdpa_flash_saves_logsumexp_not_scores() -> None:
    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q = nn.Linear(64, 64, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q = self.q(x).view(2, 512, 4, 16).transpose(1, 2)
            return nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)

    x = torch.empty(2, 512, 64, device="meta")
    est = estimate(Attn(), x, precision="bf16", device="cuda", gpu="a100-80gb",
                   loss_fn=lambda m, b: m(b).sum())
    assert "flash" in " ".join(p.op for p in est.timeline)
    scores = 2 * 4 * 512 * 512 * 2  # what math attention would materialise, per copy
    assert _end_of_forward(est)[ACT] < scores


def test_bad_inputs_raise_memfit_error() -> None:
    model = nn.Linear(4, 4)
    x = torch.empty(2, 4)
    with pytest.raises(MemfitError, match="adamw"):
        estimate(model, x, optimizer="adamww")
    with pytest.raises(MemfitError, match="bf16-mixed"):
        estimate(model, x, precision="bf16mixed")
    with pytest.raises(MemfitError, match="cuda"):
        estimate(model, x, device="gpu")
    with pytest.raises(MemfitError, match="steps"):
        estimate(model, x, steps=0)


def test_small_model_prints() -> None:
    # (Its speed, a target and not a unit test's business, is timed in bench/speed_targets.py.)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])
    est = estimate(model, torch.empty(32, 256), device="cuda", gpu="a100-80gb",
                   precision="bf16-mixed")
    text = str(est)
    assert "peak allocated" in text and "optimizer_states" in text
    assert est.total_bytes >= est.peak_reserved_bytes


def test_cuda_autocast_runs_layer_norm_in_fp32() -> None:
    # CUDA autocast's fp32 list includes layer_norm (CPU autocast's does not). Linear(1024) then
    # LayerNorm on x [512, 1024] fp32: at the end of the forward the live activations are the
    # input (2 MiB), its bf16 cast (1 MiB, saved for the weight's grad), the fp32 cast of the bf16
    # hidden that layer_norm saves (2 MiB), layer_norm's fp32 mean and rstd (512 floats each:
    # 2 KiB) and the loss (one 512-byte block). The bf16 hidden itself is not saved by anything
    # and dies after the cast; the fp32 output (2 MiB) is not saved by the sum and dies with the
    # model output (keep_output=False).
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(1024, 1024, bias=False), nn.LayerNorm(1024))
    x = torch.empty(512, 1024, device="meta")
    est = estimate(model, x, precision="bf16-mixed", device="cuda", loss_fn=lambda m, b: m(b).sum())
    assert _end_of_forward(est)[ACT] == (2 + 1 + 2) * MiB + 2 * 2048 + 512



def test_module_attribution_of_saved_activations() -> None:
    # Linear(256->512), ReLU, Linear(512->256) on x [64, 256] fp32: the first Linear's output is
    # not saved (ReLU saves its own output, addmm saves its input), so it is freed in the
    # forward; ReLU's output (64*512*4) is saved; the last Linear's output (64*256*4) is the
    # model output: the sum does not save it, so it is alive when the forward ends only if the
    # loop keeps the output (keep_output=True).
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256))
    for keep_output, output_bytes in ((False, 0), (True, 64 * 256 * 4)):
        est = estimate(model, torch.empty(64, 256), optimizer="sgd", device="cpu",
                       loss_fn=lambda m, b: m(b).sum(), keep_output=keep_output)
        assert est.modules["1"].activation_bytes == 64 * 512 * 4
        assert est.modules["2"].activation_bytes == output_bytes
    assert "0" not in est.modules or est.modules["0"].activation_bytes == 0
    assert {"forward", "backward", "optimizer"} <= {p.phase for p in est.timeline} <= set(PHASES)
    assert est.peak_phase in {"forward", "backward", "optimizer"}


def test_tensor_attributes_are_faked_and_counted() -> None:
    class WithTables(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 16, bias=False)              # 1024 bytes
            self.table = torch.zeros(256)                          # plain attribute: 1024
            self.tables = [torch.zeros(128), torch.zeros(128)]     # in a list: 2 x 512

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) + self.table[:16] + self.tables[0][:16]

    model = WithTables()
    est = estimate(model, torch.empty(4, 16), optimizer=None, device="cpu")
    assert est.timeline[0].by_category()[W] == 1024 + 1024 + 2 * 512
    assert model.tables[0].device.type == "cpu" and not isinstance(
        model.tables[0], torch._subclasses.fake_tensor.FakeTensor)


def test_cuda_workspaces_inside_allocator_context_outside() -> None:
    # cuBLAS workspaces are allocated through the caching allocator on the first matmul of each
    # thread (forward: main thread, backward: autograd's thread), so torch's allocator statistics
    # include them; the CUDA context and NCCL buffers are outside and only enter total_bytes.
    with torch.device("meta"):
        model = nn.Linear(64, 64, bias=False)
    est = estimate(model, torch.empty(8, 64, device="meta"), device="cuda", gpu="a100-80gb",
                   optimizer="sgd", steps=1)
    inside = sum(est.runtime[k] for k in est.runtime_in_allocator)
    outside = sum(v for k, v in est.runtime.items() if k not in est.runtime_in_allocator)
    assert est.runtime_in_allocator == {"cublas_workspace", "cublaslt_workspace"}
    assert inside > 0 and outside > 0
    assert est.timeline[-1].by_category()[MemoryCategory.RUNTIME] == inside
    assert est.peak_bytes > inside
    assert est.breakdown[MemoryCategory.RUNTIME] == inside + outside
    assert est.total_bytes == est.peak_reserved_bytes + outside
    assert sum(est.breakdown.values()) == est.peak_bytes + outside
    forward = {p.by_category()[MemoryCategory.RUNTIME] for p in est.timeline
               if p.phase == "forward"}
    assert forward == {0, inside // 2}  # before / after the first matmul; backward's come later


def test_cuda_target_runs_model_code_that_names_cuda() -> None:
    class NamesCuda(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(32, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            bias = torch.zeros(32, device="cuda") + torch.ones(32).cuda().to("cuda")
            return self.lin(x.to(torch.device("cuda"))) + bias

    est = estimate(NamesCuda(), torch.empty(4, 32), device="cuda", optimizer="adamw")
    assert est.peak_bytes > 0


def test_default_loss_choices() -> None:
    from memfit.trace import default_loss

    w = torch.ones(3, requires_grad=True)
    scalar = (w * 2).sum()
    assert default_loss(scalar) is scalar
    assert default_loss((scalar, w * 3)) is scalar                  # loss-first tuple
    assert default_loss({"loss": scalar, "logits": w * 3}) is scalar
    summed = default_loss([w * 2, w * 3])                           # sum of every output
    assert summed.shape == () and float(summed.detach()) == 15.0
    with pytest.raises(MemfitError, match="loss_fn"):
        default_loss(torch.ones(3))


@pytest.mark.parametrize("gpu", ["nonsense-gpu", "h100-sxm-80gb"])
def test_a_gpu_with_a_cpu_target_is_refused(gpu: str) -> None:
    # device="cpu" models the host; gpu= was dropped without a word, whatever it named
    with torch.device("meta"):
        net = nn.Linear(8, 8)
    with pytest.raises(MemfitError, match="device='cpu' models this machine's host memory"):
        estimate(net, (torch.empty(2, 8, device="meta"),), device="cpu", gpu=gpu)


def test_host_memory_without_offload_is_adams_step_counters() -> None:
    # torch's foreach AdamW keeps state["step"] as a 4-byte CPU tensor per parameter (2 here)
    # and adds a 4-byte CPU tensor(1.0) to them each step: 12 bytes, not offloaded states
    with torch.device("meta"):
        net = nn.Sequential(nn.Linear(64, 64, bias=False), nn.ReLU(),
                            nn.Linear(64, 64, bias=False))
    est = estimate(net, (torch.empty(8, 64, device="meta"),), optimizer="adamw", device="cuda")
    assert est.host_peak_bytes == 2 * 4 + 4
    text = str(est)
    assert "host memory (peak)" in text and "offload" not in text
