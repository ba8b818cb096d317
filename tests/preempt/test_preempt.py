"""memfit.preemptible: a run stopped by SIGTERM and resumed ends with the weights of an
uninterrupted run, bit for bit; a torn checkpoint is never loaded."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import memfit
from memfit.preempt import EXIT_PREEMPTED, latest_complete

SCRIPT = Path(__file__).with_name("train_script.py")
STEPS, STOP_AT = 7, 3


def _env() -> dict[str, str]:
    src = str(Path(memfit.__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}


def _preempt_and_resume(tmp_path: Path, *device: str) -> None:
    ckpt = tmp_path / "ckpt"
    first = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(ckpt), str(STEPS), str(tmp_path / "never.pt"),
         "--pause-at", str(STOP_AT), *device],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    assert first.stdout is not None
    lines = []
    for line in first.stdout:  # wait until the run is inside step STOP_AT
        lines.append(line.strip())
        if line.startswith("paused"):
            break
    assert lines[-1] == f"paused {STOP_AT}", (lines, first.stderr and first.stderr.read())
    first.send_signal(signal.SIGTERM)
    out, err = first.communicate(timeout=60)
    assert first.returncode == EXIT_PREEMPTED == 143, err
    # the step in progress finished and was saved, and the process exited inside end_step
    assert f"step {STOP_AT}" not in out
    assert latest_complete(ckpt) == (STOP_AT, ckpt / f"step-{STOP_AT:09d}")
    assert not (tmp_path / "never.pt").exists()

    second = subprocess.run(
        [sys.executable, str(SCRIPT), str(ckpt), str(STEPS), str(tmp_path / "resumed.pt"),
         "--reference", str(tmp_path / "reference.pt"), *device],
        capture_output=True, text=True, env=_env(), timeout=60)
    assert second.returncode == 0, second.stderr
    assert second.stdout.splitlines()[0] == f"resumed {STOP_AT}"
    resumed = torch.load(tmp_path / "resumed.pt")
    reference = torch.load(tmp_path / "reference.pt")
    assert resumed.keys() == reference.keys()
    for name in reference:
        assert torch.equal(resumed[name], reference[name]), name
    # and the run did learn something (the comparison is not between two untouched models)
    torch.manual_seed(0)
    fresh = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.3), nn.Tanh(), nn.Linear(16, 1))
    assert not torch.equal(fresh[0].weight, reference["0.weight"])


def test_sigterm_mid_step_then_resume_is_bit_exact(tmp_path: Path) -> None:
    _preempt_and_resume(tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sigterm_then_resume_on_cuda_is_bit_exact(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA RNG (dropout on the GPU) is saved and restored too."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    _preempt_and_resume(tmp_path, "--device", "cuda")


def _train(p: memfit.Preemptible, model: nn.Module, opt: torch.optim.Optimizer,
           steps: int) -> None:
    for _ in range(p.step, steps):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        p.end_step()


def _setup() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def test_a_torn_checkpoint_is_never_loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt = _setup()
    with memfit.preemptible(tmp_path, model=model, optimizer=opt, every_steps=2, keep=5) as p:
        _train(p, model, opt, 4)  # complete checkpoints at steps 2 and 4
    at_4 = {k: v.clone() for k, v in model.state_dict().items()}
    momentum_at_4 = opt.state[model.weight]["momentum_buffer"].clone()

    # killed while writing step 6: DCP's files are there, the commit never happened
    from memfit.preempt import checkpoint

    def killed(*args: object) -> None:
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(checkpoint.Preemptible, "_commit", killed)
    with pytest.raises(KeyboardInterrupt), \
            memfit.preemptible(tmp_path, model=model, optimizer=opt, every_steps=2) as p:
        _train(p, model, opt, 6)
    monkeypatch.undo()
    assert (tmp_path / "step-000000006.partial" / ".metadata").is_file()
    # a folder named like a complete checkpoint, without COMPLETE (copied by hand, cut short)
    (tmp_path / "step-000000008").mkdir()
    (tmp_path / "step-000000008" / ".metadata").write_bytes(b"torn")

    model, opt = _setup()
    with memfit.preemptible(tmp_path, model=model, optimizer=opt) as p:
        assert p.step == 4
    for name, value in model.state_dict().items():
        assert torch.equal(value, at_4[name]), name
    assert torch.equal(opt.state[model.weight]["momentum_buffer"], momentum_at_4)


def test_keep_prunes_old_checkpoints_and_saves_once_per_step(tmp_path: Path) -> None:
    model, opt = _setup()
    with memfit.preemptible(tmp_path, model=model, optimizer=opt, every_steps=1, keep=2) as p:
        _train(p, model, opt, 5)
        assert p.saved_step == 5
    assert sorted(d.name for d in tmp_path.iterdir()) == ["step-000000004", "step-000000005"]


def test_handlers_are_installed_inside_the_context_only(tmp_path: Path) -> None:
    model, opt = _setup()
    before = signal.getsignal(signal.SIGUSR1)
    with memfit.preemptible(tmp_path, model=model, optimizer=opt,
                            signals=(signal.SIGUSR1,), exit_code=99) as p:
        assert signal.getsignal(signal.SIGUSR1) != before
        os.kill(os.getpid(), signal.SIGUSR1)
        assert p.should_stop() and p.signal_received == signal.SIGUSR1
        with pytest.raises(SystemExit) as stopped:
            _train(p, model, opt, 3)
        assert stopped.value.code == 99 and p.step == 1
    assert signal.getsignal(signal.SIGUSR1) == before
    assert latest_complete(tmp_path) == (1, tmp_path / "step-000000001")


@pytest.mark.parametrize("bad", [{"every_steps": 0}, {"every_seconds": 0.0}, {"keep": 0},
                                 {"data": object()}])
def test_bad_options_say_what_is_wrong(tmp_path: Path, bad: dict[str, object]) -> None:
    model, opt = _setup()
    with pytest.raises(memfit.MemfitError):
        memfit.preemptible(tmp_path, model=model, optimizer=opt, **bad)  # type: ignore[arg-type]


def test_the_next_save_removes_torn_saves(tmp_path: Path) -> None:
    (tmp_path / "step-000000007.partial").mkdir()
    model, opt = _setup()
    with memfit.preemptible(tmp_path, model=model, optimizer=opt, every_seconds=1e-9) as p:
        _train(p, model, opt, 2)  # every_seconds: due at every step
    assert sorted(d.name for d in tmp_path.iterdir()) == ["step-000000001", "step-000000002"]


def test_scaler_and_guard_state_are_restored(tmp_path: Path) -> None:
    def loss_fn(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return (m(batch[0]) - batch[1]).pow(2).mean()

    def run(resume_only: bool) -> tuple[torch.amp.GradScaler, memfit.GuardedStep]:
        model, opt = _setup()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
        guard = memfit.guard(model, opt, loss_fn, micro_batch_size=4, scaler=scaler,
                             log=False)
        with memfit.preemptible(tmp_path, model=model, optimizer=opt, scaler=scaler,
                                guard=guard, every_steps=3) as p:
            if not resume_only:
                guard.micro_batch_size = 2  # as if an OOM had halved it
                for _ in range(3):
                    guard((torch.randn(4, 4), torch.randn(4, 1)))
                    p.end_step()
        return scaler, guard

    scaler, _ = run(resume_only=False)
    assert scaler.get_scale() == 2.0**13  # grew once a step (growth_interval=1)
    scaler2, guard2 = run(resume_only=True)
    assert scaler2.get_scale() == 2.0**13
    assert (guard2.micro_batch_size, guard2.steps, guard2.history) == (2, 3, [2, 2, 2])


def test_outside_the_main_thread_it_says_so(tmp_path: Path) -> None:
    import threading

    model, opt = _setup()
    errors: list[BaseException] = []

    def enter() -> None:
        try:
            with memfit.preemptible(tmp_path, model=model, optimizer=opt):
                pass
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=enter)
    thread.start()
    thread.join()
    assert len(errors) == 1 and isinstance(errors[0], memfit.MemfitError)
    assert "main thread" in str(errors[0])


def test_a_second_signal_goes_to_the_previous_handler(tmp_path: Path) -> None:
    model, opt = _setup()
    seen: list[int] = []
    before = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        with memfit.preemptible(tmp_path, model=model, optimizer=opt,
                                signals=(signal.SIGUSR1,)) as p:
            os.kill(os.getpid(), signal.SIGUSR1)
            assert p.should_stop() and seen == []  # the first only asks to stop
            os.kill(os.getpid(), signal.SIGUSR1)
            assert seen == [signal.SIGUSR1]  # the second is the previous handler's
    finally:
        signal.signal(signal.SIGUSR1, before)


def _guarded_loop(tmp_path: Path | None, steps: range, *, micro: int | None,
                  grow_after: int | None, oom_at: set[int]) -> tuple[nn.Module,
                                                                   memfit.GuardedStep]:
    """Train a dropout MLP with the OOM guard over batches of 8 drawn from the step index; the
    first attempt of each step in ``oom_at`` raises ``torch.OutOfMemoryError`` after its forward
    (as an allocator failing mid-micro-batch would), so the guard backs off to micro-batch 4.
    With ``tmp_path``, inside ``memfit.preemptible`` (saving at step 3, resuming from it)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fired: set[int] = set()
    holder: list[memfit.GuardedStep] = []

    def loss_fn(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        loss = (m(batch[0]) - batch[1]).pow(2).mean()
        step = holder[0].steps
        if step in oom_at and step not in fired:
            fired.add(step)
            raise torch.OutOfMemoryError(f"injected in step {step}")
        return loss

    guard = memfit.guard(model, opt, loss_fn, micro_batch_size=micro, grow_after=grow_after,
                         log=False)
    holder.append(guard)
    torch.manual_seed(1)  # the dropout stream

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(100 + step)
        return torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)

    if tmp_path is None:
        for step in steps:
            guard(batch(step))
        return model, guard
    with memfit.preemptible(tmp_path, model=model, optimizer=opt, guard=guard,
                            every_steps=3) as p:
        for step in range(max(p.step, steps.start), steps.stop):
            guard(batch(step))
            p.end_step()
    return model, guard


@pytest.mark.parametrize(("micro", "grow_after", "history"), [
    (8, 3, [8, 4, 4, 4, 4, 8, 8]),      # backs off at step 1, grows back after 3 clean steps
    (None, None, [8, 4, 4, 4, 4, 4, 4]),  # micro-batch from the first batch, never grows
])
def test_a_guard_that_backed_off_resumes_backed_off_and_bit_exact(
        tmp_path: Path, micro: int | None, grow_after: int | None, history: list[int]) -> None:
    reference, ref_guard = _guarded_loop(None, range(7), micro=micro, grow_after=grow_after,
                                         oom_at={1})
    assert ref_guard.history == history  # the OOM really forced a back-off
    _guarded_loop(tmp_path, range(3), micro=micro, grow_after=grow_after, oom_at={1})
    assert latest_complete(tmp_path) == (3, tmp_path / "step-000000003")
    # a new process's guard: nothing injected, it only knows what the checkpoint holds
    resumed, guard = _guarded_loop(tmp_path, range(7), micro=micro, grow_after=grow_after,
                                   oom_at=set())
    assert guard.history == history and guard.steps == 7
    assert [(r.step, r.reason) for r in guard.recoveries] == \
        [(r.step, r.reason) for r in ref_guard.recoveries]
    for (name, p), q in zip(resumed.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_guard_state_dict_round_trips_and_rejects_other_dicts() -> None:
    model, opt = _setup()
    guard = memfit.guard(model, opt, lambda m, b: m(b).sum(), micro_batch_size=4, log=False)
    state = {"micro_batch_size": 2, "initial_micro_batch_size": 4, "clean_steps": 1,
             "steps": 5, "history": [4, 2, 2, 2, 2],
             "recoveries": [{"step": 1, "reason": "oom", "batch_size": 4,
                             "old_micro_batch_size": 4, "new_micro_batch_size": 2,
                             "predicted_bytes": None}]}
    guard.load_state_dict(state)
    assert guard.micro_batch_size == 2 and guard.recoveries[0].new_micro_batch_size == 2
    assert guard.state_dict() == state
    with pytest.raises(memfit.MemfitError, match="lacks clean_steps"):
        guard.load_state_dict({k: v for k, v in state.items() if k != "clean_steps"})
