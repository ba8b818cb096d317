"""memfit profile's peak is the allocator's peak (issue 13): a conv net's three training steps
on CPU, profiled through the Python API and as a script, against the PyTorch profiler's allocator
events read here, in the test, by code independent of memfit's.

The reference runs the same steps on the same machine, so it sees the same kernel scratch
whatever the CPU's instruction set (oneDNN picks AVX2 or AVX-512 kernels, whose scratch differs);
these tests also pass under ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``.
"""

from __future__ import annotations

import json
import re
import runpy
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity
from torch.profiler import profile as torch_profile

from _models import Classifier
from memfit.categories import MemoryCategory
from memfit.cli import main
from memfit.profiling import profile
from memfit.units import format_bytes

F32, I64 = 4, 8
BATCH, SIDE, C1, C2, CLASSES = 32, 32, 64, 128, 10

CONVNET = textwrap.dedent(f"""
    import torch
    from torch import nn

    def convnet():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Conv2d(3, {C1}, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d({C1}, {C2}, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
            nn.Flatten(), nn.Linear({C2} * 16, {CLASSES}))

    def batch():
        torch.manual_seed(1)
        return torch.randn({BATCH}, 3, {SIDE}, {SIDE}), torch.randint(0, {CLASSES}, ({BATCH},))

    def train(model, opt, x, y, steps=3):
        for _ in range(steps):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

    if __name__ == "__main__":
        model = convnet()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        train(model, opt, *batch())
""")
PARAMS = (3 * 9 * C1 + C1) + (C1 * 9 * C2 + C2) + (C2 * 16 * CLASSES + CLASSES)
BATCH_BYTES = BATCH * 3 * SIDE * SIDE * F32 + BATCH * I64


def _convnet_module(tmp_path: Path) -> dict[str, Callable[..., object]]:
    path = tmp_path / "convnet.py"
    path.write_text(CONVNET)
    return runpy.run_path(str(path))  # the functions only: run_name is not __main__


def allocator_peak(fn: Callable[[], object]) -> int:
    """Peak of the running sum of the CPU allocator's events while ``fn`` runs, above what was
    alive before (written here, apart from memfit.profiling.cpu, so the two cannot share a bug).

    A free is counted only if this session saw the block allocated: PyTorch's CPU allocator may
    report the free of a block allocated before with a stale size
    (c10/core/CPUAllocator.cpp: ProfiledCPUMemoryReporter::Delete looks the size up in a table
    that only profiled allocations fill)."""
    with torch_profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = []
    todo = list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        event = todo.pop()
        todo.extend(event.children)
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            events.append((event.start_time_ns, event.extra_fields.ptr,
                           event.extra_fields.alloc_size))
    events.sort(key=lambda e: e[0])
    sizes: dict[int, int] = {}
    running = peak = 0
    for _, ptr, nbytes in events:
        if nbytes > 0:
            sizes[ptr] = nbytes
        elif sizes.pop(ptr, None) is None:
            continue
        running += nbytes
        peak = max(peak, running)
    return peak


def test_api_peak_is_the_allocator_peak(tmp_path: Path) -> None:
    net = _convnet_module(tmp_path)

    def steps() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
        model = net["convnet"]()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3), *net["batch"]()

    model, opt, x, y = steps()
    # Alive before: parameters and the batch (first principles); AdamW's state starts empty.
    truth = PARAMS * F32 + BATCH_BYTES + allocator_peak(lambda: net["train"](model, opt, x, y))

    model, opt, x, y = steps()
    with profile(device="cpu", baseline=(model, opt, x, y)) as prof:
        net["train"](model, opt, x, y)
    r = prof.result
    assert r is not None
    assert r.baseline_bytes == PARAMS * F32 + BATCH_BYTES
    # Exact: the same steps, shapes and kernels on the same machine allocate the same blocks in
    # the same order (both runs keep Python's cycle collector as it is; these steps make no
    # reference cycles, so it frees nothing either way).
    assert r.peak_bytes == truth
    assert r.allocator_peak_bytes == truth
    # The ledger's categories and the scratch inside kernels add up to the allocator's peak; the
    # ledger alone never sees more than the allocator did.
    assert r.inside_kernels_bytes is not None and r.inside_kernels_bytes >= 0
    assert sum(r.breakdown.values()) + r.inside_kernels_bytes == r.peak_bytes
    assert r.tracked_peak_bytes <= r.peak_bytes
    assert r.breakdown[MemoryCategory.WEIGHTS] == PARAMS * F32


def test_script_peak_is_the_allocator_peak(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "convnet.py"
    script.write_text(CONVNET)
    argv = sys.argv[:]
    try:
        sys.argv = [str(script)]
        # The script creates everything it uses, so nothing alive before counts.
        truth = allocator_peak(lambda: runpy.run_path(str(script), run_name="__main__"))
    finally:
        sys.argv = argv
    out, html = tmp_path / "profile.json", tmp_path / "profile.html"
    assert main(["profile", "--json", str(out), "--html", str(html), "--predict", "--",
                 "python", str(script)]) == 0
    doc = json.loads(out.read_text())
    assert doc["peak_bytes"] == truth
    assert doc["allocator_peak_bytes"] == truth
    assert sum(doc["breakdown"].values()) + doc["inside_kernels_bytes"] == truth
    # --predict compares the trace's peak with the allocator's: in the text table and in the
    # report's peak row (predicted, then predicted − measured against the allocator's peak).
    predicted = doc["predicted"]["peak_bytes"]
    text = capsys.readouterr().out
    assert "inside kernels" in text
    row = re.search(r'<tr id="peak-row">(.*?)</tr>', html.read_text(encoding="utf-8"), re.S)
    assert row is not None
    cells = re.findall(r'<th class="num[^"]*">([^<]*)</th>', row.group(1))
    assert cells[:2] == [format_bytes(truth), format_bytes(predicted)]
    diff = predicted - truth
    assert cells[2].startswith(format_bytes(diff)) and f"({100 * diff / truth:+.1f}%)" in cells[2]


def test_without_allocator_events_the_ledger_is_the_peak() -> None:
    lin = nn.Linear(256, 128)
    x = torch.randn(32, 256)
    with torch.no_grad(), profile(device="cpu", baseline=(lin, x),
                                  allocator_events=False) as prof:
        lin(x)
    r = prof.result
    assert r is not None
    assert r.inside_kernels_bytes is None and r.allocator_peak_bytes is None
    assert r.peak_bytes == r.tracked_peak_bytes == ((256 * 128 + 128) + 32 * 256 + 32 * 128) * F32


def test_a_model_made_before_and_met_inside_counts_from_its_first_call() -> None:
    """``baseline=()``: a model created before the block is counted when its forward first runs.
    The allocator never saw its weights allocated, so the ledger's count of them is merged into
    the allocator's running sum: the peak is the weights (first principles) plus the allocator's
    peak of the same step."""
    def step(model: nn.Module) -> None:
        x = torch.randn(64, 512)
        model(x).relu().sum().backward()

    torch.manual_seed(0)
    reference = nn.Linear(512, 1024)
    truth = (512 * 1024 + 1024) * F32 + allocator_peak(lambda: step(reference))
    torch.manual_seed(0)
    model = nn.Linear(512, 1024)
    with profile(device="cpu", baseline=()) as prof:
        step(model)
    r = prof.result
    assert r is not None
    assert r.baseline_bytes == 0
    assert r.peak_bytes == truth
    assert r.breakdown[MemoryCategory.WEIGHTS] == (512 * 1024 + 1024) * F32



def test_tensors_alive_before_and_freed_inside_are_seen_freed() -> None:
    """Gradients left by an earlier step are freed by ``zero_grad()`` inside the block; the
    allocator never reports that free (the blocks were allocated before it listened), the ledger
    does, and the merge lowers the running sum there. So the step's peak equals that of a fresh
    model that had no gradients to free: weights + batch (first principles) + its allocator peak.
    """
    def step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
        opt.zero_grad()  # set_to_none: frees the gradients
        model(x).relu().sum().backward()
        opt.step()

    x = torch.randn(64, 512)
    weights = (512 * 1024 + 1024) * F32
    fresh = nn.Linear(512, 1024)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1)
    truth = weights + 64 * 512 * F32 + allocator_peak(lambda: step(fresh, fresh_opt, x))
    model = nn.Linear(512, 1024)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step(model, opt, x)  # leaves 2 MiB of gradients alive
    with profile(device="cpu", baseline=(model, opt, x)) as prof:
        step(model, opt, x)
    r = prof.result
    assert r is not None
    assert r.baseline_bytes == 2 * weights + 64 * 512 * F32
    assert r.peak_bytes == truth


def test_a_step_that_traces_inside_the_block_is_counted_once() -> None:
    """Plan.apply's step is OOM-guarded with the plan's budget: its first batch is predicted by
    memfit's trace, a fake copy of the model and its optimizer run under a FakeTensorMode,
    inside the profiled block. That work holds no memory and must not count (issue 20: the fake
    copy's weights and states doubled the tracked peak above the allocator's, "inside kernels"
    went negative and every module was listed twice, as ``Clf.blocks.0.fc1`` and
    ``blocks.0.fc1``)."""
    from memfit.fitting import FitConfig
    from memfit.fitting.apply import apply_config

    inp, d, h, n, classes = 32, 64, 256, 2, 10
    params = (inp * d + d) + n * (2 * d + (d * h + h) + (h * d + d)) + (d * classes + classes)
    tensors = 2 + n * 6 + 2  # weight and bias of every Linear and LayerNorm
    torch.manual_seed(0)
    model = Classifier(inp, d, h, n, classes)
    x, y = torch.randn(64, inp), torch.randint(0, classes, (64,))
    # What Plan.apply runs (fitting/plan.py: Plan.apply -> apply_config, budget_bytes=the plan's)
    config = FitConfig(precision="fp32", checkpointing="none", micro_batch=16, accumulation=4,
                       optimizer="adamw")
    model, opt, step = apply_config(model, config, budget_bytes=2**30, log_recoveries=False)
    # baseline=: the objects of this step only, not what earlier tests left alive.
    with profile(device="cpu", baseline=(model, opt, x, y)) as prof:
        step((x, y))
        step((x, y))
    r = prof.result
    assert r is not None and step.history == [16, 16]
    assert r.inside_kernels_bytes is not None and r.inside_kernels_bytes >= 0
    assert r.tracked_peak_bytes <= r.peak_bytes
    assert sum(r.breakdown.values()) + r.inside_kernels_bytes == r.peak_bytes
    # Each parameter once; AdamW's two fp32 states per parameter and a 4-byte step per tensor
    # (the peak is in the second step, its states made by the first).
    assert r.breakdown[MemoryCategory.WEIGHTS] == params * F32
    assert r.breakdown[MemoryCategory.OPTIMIZER_STATES] == 2 * params * F32 + tensors * F32
    assert r.breakdown[MemoryCategory.GRADIENTS] <= params * F32
    names = {name for name, _ in model.named_modules()}
    listed = [m.name for m in r.modules]
    assert len(listed) == len(set(listed)) and set(listed) <= names
    assert {p.module for p in r.timeline} <= names
    assert prof.optimizers == [opt]
    # The trace's fake ops are not on the timeline: two guarded steps of 4 micro-batches each,
    # not the trace's thousands more.
    with profile(device="cpu", baseline=()) as plain:
        step((x, y))
    assert plain.result is not None and r.num_ops < 3 * plain.result.num_ops


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_peak_is_max_memory_allocated(tmp_path: Path) -> None:
    """On CUDA ``peak_bytes`` is ``torch.cuda.max_memory_allocated()`` over the block, peak stats
    reset at entry (torch/cuda/memory.py: ``max_memory_allocated`` returns
    ``memory_stats()["allocated_bytes.all.peak"]``, which ``reset_peak_memory_stats`` resets to
    the bytes allocated now). The reference measures the same steps with those two calls; a
    warm-up step first makes the cuBLAS/cuDNN workspaces (kept by the caching allocator), so both
    runs start with them allocated."""
    net = _convnet_module(tmp_path)

    def fresh() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
        model = net["convnet"]().cuda()
        x, y = net["batch"]()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3), x.cuda(), y.cuda()

    net["train"](*fresh(), steps=1)
    torch.cuda.synchronize()
    model, opt, x, y = fresh()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    net["train"](model, opt, x, y)
    torch.cuda.synchronize()
    truth = torch.cuda.max_memory_allocated()
    del model, opt, x, y
    model, opt, x, y = fresh()
    with profile(device="cuda", baseline=(model, opt, x, y), record_history=False) as prof:
        net["train"](model, opt, x, y)
    r = prof.result
    assert r is not None
    assert r.peak_bytes == truth
    assert r.inside_kernels_bytes is not None
    assert sum(r.breakdown.values()) + r.inside_kernels_bytes == r.peak_bytes
