"""memfit.profile on CPU against hand-computed bytes and the profiler's allocator events."""

from __future__ import annotations

import argparse
import json
import pickle
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from memfit.categories import MemoryCategory
from memfit.errors import MemfitError
from memfit.profiling import measure_cpu_peak
from memfit.profiling.session import profile

W, G, S, A, T = (MemoryCategory.WEIGHTS, MemoryCategory.GRADIENTS,
                 MemoryCategory.OPTIMIZER_STATES, MemoryCategory.ACTIVATIONS,
                 MemoryCategory.TEMPORARIES)
F32 = 4


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


MLP_PARAMS = 64 * 128 + 128 + 128 * 10 + 10  # 9610 parameters in 4 tensors


def train(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, steps: int = 2) -> None:
    for _ in range(steps):
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()


def test_inference_breakdown_is_exact() -> None:
    lin = nn.Linear(256, 128)
    x = torch.randn(32, 256)
    with torch.no_grad(), profile(device="cpu", baseline=(lin, x)) as prof:
        y = lin(x)
    r = prof.result
    assert r is not None
    weights = (256 * 128 + 128) * F32
    assert r.breakdown[W] == weights
    assert r.breakdown[A] == 32 * 256 * F32        # the batch fed to the model
    assert r.breakdown[T] == 32 * 128 * F32        # the output: not saved for backward
    assert r.peak_bytes == weights + (32 * 256 + 32 * 128) * F32
    assert r.peak_reserved_bytes is None           # CPU: no caching allocator
    assert r.baseline_bytes == weights + 32 * 256 * F32
    assert y.shape == (32, 128)


def test_training_peak_matches_allocator_events_and_categories_are_exact() -> None:
    model = mlp()
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(32, 64)
    reference = measure_cpu_peak(lambda: train(model, opt, x), model, opt, x)

    model = mlp()
    opt = torch.optim.Adam(model.parameters())
    with profile(device="cpu", baseline=(model, opt, x)) as prof:
        train(model, opt, x)
    r = prof.result
    assert r is not None
    # Independent measurement: the allocator's running sum, over the same steps of a twin model.
    # The profile's peak is the allocator's too, up to 8 bytes per Python scalar operand of the
    # op at the peak (here Adam's aten.div): under a Python dispatch mode each is wrapped into a
    # float64 0-dim tensor that lives while the op runs (a TorchDispatchMode that only forwards
    # the op measures 8020 bytes for `(a.sqrt() / 3.0).add_(1e-8)` on 1000 floats, 8012
    # without). The ledger cannot see those wrapped scalars: a few bytes each, freed inside the
    # op, which are all an MLP's kernels hold beyond its tensors.
    assert 0 <= r.peak_bytes - reference.peak_bytes <= 64
    assert 0 <= r.peak_bytes - r.tracked_peak_bytes <= 64
    assert r.baseline_bytes == reference.baseline_bytes == MLP_PARAMS * F32 + 32 * 64 * F32
    assert r.breakdown[W] == MLP_PARAMS * F32
    assert r.inside_kernels_bytes is not None and 0 <= r.inside_kernels_bytes <= 64
    assert sum(r.breakdown.values()) + r.inside_kernels_bytes == r.peak_bytes
    # After the last optimizer step: weights, gradients, Adam's exp_avg + exp_avg_sq, and one
    # float32 `step` scalar per parameter tensor (torch.optim.Adam, capturable=False).
    end = r.timeline[-1].by_category()
    assert end[W] == MLP_PARAMS * F32
    assert end[G] == MLP_PARAMS * F32
    assert end[S] == 2 * MLP_PARAMS * F32 + 4 * F32


def test_without_allocator_events_the_ledger_peak_is_within_scalars() -> None:
    # allocator_events=False: the ledger alone, a few wrapped scalars short of the allocator
    # (measured on a twin model: the same step, unprofiled).
    x = torch.randn(16, 64)
    twin = mlp()
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    reference = measure_cpu_peak(lambda: train(twin, twin_opt, x, steps=1), twin, twin_opt, x)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with profile(device="cpu", allocator_events=False, baseline=(model, opt, x)) as prof:
        train(model, opt, x, steps=1)
    r = prof.result
    assert r is not None and r.allocator_peak_bytes is None and r.inside_kernels_bytes is None
    assert r.peak_bytes == r.tracked_peak_bytes
    assert reference.peak_bytes - 64 <= r.peak_bytes <= reference.peak_bytes


def test_saved_for_backward_are_activations() -> None:
    model = mlp()
    x = torch.randn(32, 64)
    with profile(device="cpu", baseline=(model, x)) as prof:
        out = model(x)
        prof.mark("after forward")
        out.sum().backward()
    r = prof.result
    assert r is not None
    index, label = r.marks[0]
    assert label == "after forward"
    at_mark = r.timeline[index].by_category()
    # Linear saves its input (x), ReLU saves its output, which the second Linear saves too (same
    # storage); the pre-ReLU tensor is freed; `out` is held but not saved.
    assert at_mark[A] == 32 * 64 * F32 + 32 * 128 * F32
    assert at_mark[T] == 32 * 10 * F32
    assert at_mark[G] == 0
    assert r.timeline[index].op == "mark: after forward"


def test_per_module_attribution() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(8, 64)
    with profile(device="cpu", baseline=()) as prof:
        train(model, opt, x, steps=2)
    r = prof.result
    assert r is not None
    mods = {m.name: m.at_peak for m in r.modules}
    assert mods["0"][W] == (64 * 128 + 128) * F32
    assert mods["2"][W] == (128 * 10 + 10) * F32
    # SGD momentum keeps one buffer per parameter (made in step 1, alive in step 2), owned by
    # the parameter's module; the second Linear's backward runs first, so its gradients exist
    # whenever the first Linear's backward does.
    assert mods["0"][S] == (64 * 128 + 128) * F32
    assert mods["2"][S] == (128 * 10 + 10) * F32
    assert mods["2"][G] == (128 * 10 + 10) * F32


def test_memory_alive_before_counts_and_its_free_is_seen() -> None:
    holder = [torch.empty(256)]          # 1024 bytes alive before profiling
    with profile(device="cpu") as prof:
        holder.clear()                   # freed during the run
        torch.empty(64)                  # 256 bytes
    r = prof.result
    assert r is not None
    assert r.baseline_bytes >= 1024
    baseline_others = r.baseline_bytes - 1024
    # The peak is the start: 1024 freed before the 256-byte tensor exists.
    assert r.tracked_peak_bytes == r.baseline_bytes
    # Right after the only op returned: its 256-byte output is alive, the 1024 bytes are not.
    assert r.timeline[-1].total == baseline_others + 256
    assert r.peak_index == -1 and r.peak_op == "baseline"


def test_explicit_baseline_counts_unlisted_models_when_used() -> None:
    held = torch.empty(1000)             # alive, not listed: not counted
    lin = nn.Linear(10, 10)              # not listed: counted from its first forward
    x = torch.empty(4, 10)
    with profile(device="cpu", baseline=[{"x": x}]) as prof:
        lin(x)
    r = prof.result
    assert r is not None
    assert r.baseline_bytes == 4 * 10 * F32
    assert r.breakdown[W] == (10 * 10 + 10) * F32
    assert r.peak_bytes == (4 * 10 + 10 * 10 + 10 + 4 * 10) * F32   # x, weights, output
    assert held.numel() == 1000
    with pytest.raises(MemfitError, match="baseline 'all' is not supported"):
        profile(baseline="all")


def test_stacks_point_at_the_allocating_line() -> None:
    def allocate_big() -> torch.Tensor:
        return torch.zeros(1000, 1000)   # 4 MB: the largest tensor at the peak

    with profile(device="cpu", stacks=True, baseline=()) as prof:
        big = allocate_big()
    r = prof.result
    assert r is not None
    top = r.top_tensors[0]
    assert top.nbytes == 1000 * 1000 * F32
    assert top.shape == (1000, 1000) and top.dtype == "float32"
    assert top.stack[0][0] == __file__ and top.stack[0][2] == "allocate_big"
    assert big.numel() == 10**6


def test_json_document_has_the_stable_keys() -> None:
    lin = nn.Linear(16, 16)
    with profile(device="cpu", baseline=()) as prof:
        lin(torch.randn(4, 16)).sum().backward()
    doc = json.loads(json.dumps(prof.to_dict()))
    assert doc["device"] == "cpu"
    assert isinstance(doc["peak_bytes"], int)
    assert doc["peak_reserved_bytes"] is None
    assert set(doc["breakdown"]) == {c.value for c in MemoryCategory}
    assert doc["breakdown"]["weights"] == (16 * 16 + 16) * F32
    # The peak comes in backward: either gradient, both or none may exist by then.
    assert doc["breakdown"]["gradients"] in (0, 16 * F32, 16 * 16 * F32, (16 * 16 + 16) * F32)
    assert isinstance(doc["inside_kernels_bytes"], int)
    assert sum(doc["breakdown"].values()) + doc["inside_kernels_bytes"] == doc["peak_bytes"]


def test_profiler_restores_global_state() -> None:
    from torch.nn.modules import module as module_mod
    from torch.optim import optimizer as optim_mod

    pre = dict(module_mod._global_forward_pre_hooks)
    post = dict(module_mod._global_forward_hooks)
    opt_pre = dict(optim_mod._global_optimizer_pre_hooks)
    lin = nn.Linear(4, 4)
    with profile(device="cpu"):
        assert len(module_mod._global_forward_pre_hooks) == len(pre) + 1
        assert torch._C._len_torch_dispatch_stack() == 1
        lin(torch.randn(2, 4)).sum().backward()
        assert lin.weight._post_accumulate_grad_hooks
    assert dict(module_mod._global_forward_pre_hooks) == pre
    assert dict(module_mod._global_forward_hooks) == post
    assert dict(optim_mod._global_optimizer_pre_hooks) == opt_pre
    assert torch._C._len_torch_dispatch_stack() == 0
    assert not lin.weight._post_accumulate_grad_hooks
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_bad_use_is_a_memfit_error() -> None:
    with pytest.raises(MemfitError, match="valid values: auto, cpu, cuda"):
        profile(device="tpu")
    prof = profile(device="cpu")
    with pytest.raises(MemfitError, match="after the"):
        _ = prof.peak_bytes
    with pytest.raises(MemfitError, match="inside the"):
        prof.mark("too early")
    with prof:
        pass
    with pytest.raises(MemfitError, match="entered once"), prof:
        pass
    with pytest.raises(MemfitError, match="no CUDA memory snapshot"):
        prof.save_snapshot("unused.pickle")


# -- the CLI ----------------------------------------------------------------------------------

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from torch import nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(int(sys.argv[1])):
        opt.zero_grad()
        model(torch.randn(32, 64)).pow(2).mean().backward()
        opt.step()
    if len(sys.argv) > 2:
        sys.exit(int(sys.argv[2]))
""")


def _cli(argv: list[str]) -> int:
    from memfit.cli import profile as profile_cli

    parser = argparse.ArgumentParser()
    profile_cli.register(parser.add_subparsers())
    args = parser.parse_args(["profile", *argv])
    return int(args.func(args))


def test_cli_profiles_a_script(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "report.json"
    html = tmp_path / "report.html"
    argv = sys.argv[:]
    code = _cli(["--json", str(out), "--html", str(html), "--predict", "--",
                 "python", str(script), "2"])
    assert code == 0
    assert sys.argv == argv
    doc = json.loads(out.read_text())
    assert doc["device"] == "cpu"
    assert doc["breakdown"]["weights"] == MLP_PARAMS * F32
    # AdamW: exp_avg + exp_avg_sq per parameter plus 4 float32 step scalars, all alive at a
    # peak that is in the second step's optimizer update.
    assert doc["breakdown"]["optimizer_states"] == 2 * MLP_PARAMS * F32 + 4 * F32
    assert doc["predicted"]["breakdown"]["weights"] == MLP_PARAMS * F32
    assert "<svg id=\"timeline\"" in html.read_text()
    assert "optimizer_states" in capsys.readouterr().out


def test_cli_runs_a_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "mytrain.py").write_text(SCRIPT)
    monkeypatch.chdir(tmp_path)
    path = sys.path[:]
    out = tmp_path / "r.json"
    assert _cli(["--json", str(out), "--", "python", "-m", "mytrain", "1"]) == 0
    assert sys.path == path
    assert json.loads(out.read_text())["breakdown"]["weights"] == MLP_PARAMS * F32
    sys.modules.pop("mytrain", None)


def test_cli_writes_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the PNG export needs memfit[report]")
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    png = tmp_path / "timeline.png"
    assert _cli(["--png", str(png), "--", str(script), "1"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_predict_needs_positional_inputs(tmp_path: Path) -> None:
    script = tmp_path / "kw.py"
    script.write_text("import torch\nlin = torch.nn.Linear(4, 4)\n"
                      "lin(input=torch.randn(2, 4)).sum().backward()\n")
    with pytest.raises(MemfitError, match="keyword arguments only"):
        _cli(["--predict", "--", str(script)])


def test_cli_returns_the_script_exit_code(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    assert _cli(["--", "python", str(script), "1", "3"]) == 3


def test_cli_reports_a_script_that_fails(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "boom.py"
    script.write_text("import torch\nkeep = torch.empty(1000)\nraise RuntimeError('boom')\n")
    out = tmp_path / "r.json"
    assert _cli(["--json", str(out), "--", str(script)]) == 1
    assert "RuntimeError: boom" in capsys.readouterr().err
    doc = json.loads(out.read_text())
    last = doc["timeline"]["points"][-1]
    assert sum(last["bytes"]) - doc["baseline_bytes"] == 1000 * F32   # alive when it failed


def test_cli_errors(tmp_path: Path) -> None:
    with pytest.raises(MemfitError, match="not found"):
        _cli(["--", "python", str(tmp_path / "missing.py")])
    with pytest.raises(MemfitError, match="no script"):
        _cli(["--"])
    script = tmp_path / "t.py"
    script.write_text("x = 1\n")
    with pytest.raises(MemfitError, match="folder does not exist"):
        _cli(["--json", str(tmp_path / "no" / "r.json"), "--", str(script)])
    with pytest.raises(MemfitError, match="no model call"):
        _cli(["--predict", "--", str(script)])


# -- CUDA ---------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_profile_reads_the_allocator(tmp_path: Path) -> None:
    model = mlp().cuda()
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(32, 64, device="cuda")
    with profile(device="cuda") as prof:
        train(model, opt, x)
    r = prof.result
    assert r is not None
    # Each storage is a 512-byte-rounded block in the caching allocator.
    rounded = sum(-(-p.numel() * F32 // 512) * 512 for p in model.parameters())
    assert r.breakdown[W] == rounded
    assert r.peak_reserved_bytes is not None and r.peak_reserved_bytes >= r.peak_bytes
    assert r.peak_bytes >= r.tracked_peak_bytes - 512
    assert r.timeline[-1].allocated is not None
    assert r.cuda is not None and 0.0 <= r.cuda["fragmentation"] <= 1.0
    path = tmp_path / "snap.pickle"
    prof.save_snapshot(path)
    with open(path, "rb") as f:  # our own file, written just above
        snap = pickle.load(f)
    assert "segments" in snap and "device_traces" in snap
