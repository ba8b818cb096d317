"""Survive a preemption: on SIGTERM finish the step, save a resumable checkpoint, exit; resume.

The checkpoint layout (one folder per saved step, in the spirit of torchtitan's
``CheckpointManager``: ``step-<n>`` folders written by :func:`torch.distributed.checkpoint.save`)::

    DIR/step-000000120/            a complete checkpoint (only these are ever loaded)
        .metadata, __0_0.distcp …  model and optimizer, DCP (sharded under FSDP2: each rank
                                   writes its own shards)
        rank0.pt, rank1.pt …       each rank's RNGs, the data position, scaler, scheduler, guard
        COMPLETE                   written last, {"step", "world_size"}
    DIR/step-000000130.partial/    a save in progress, or one killed while writing: never loaded

Note: [atomic checkpoint] A save writes into ``step-<n>.partial``; DCP's file writer fsyncs every
file it writes (``sync_files=True``), the per-rank files are fsynced here; after a barrier, rank 0
writes ``COMPLETE``, fsyncs it and the folder, renames the folder to ``step-<n>`` (``os.replace``:
atomic on a POSIX file system) and fsyncs the parent. A process killed at any moment leaves either
a ``.partial`` folder (never loaded, removed by the next save) or a complete checkpoint.
Loading takes the highest ``step-<n>`` that holds ``COMPLETE`` (torchtitan keys on DCP's
``.metadata`` file the same way); a folder without it (copied by hand, a file system without
atomic rename) is skipped.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import threading
import time
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import torch
from torch import nn

from memfit.errors import MemfitError

EXIT_PREEMPTED = 143
"""The exit code after a preemption checkpoint: 128 + SIGTERM (15), what a shell, Kubernetes
and Slurm report for a process that SIGTERM ended. A supervisor that already treats "ended by
SIGTERM" as "preempted: restart and resume" (a managed spot job, a requeue) does the same here,
and nothing mistakes it for success (0) or a crash (1). Pass ``exit_code=`` for another."""

COMPLETE = "COMPLETE"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def latest_complete(directory: str | os.PathLike[str]) -> tuple[int, Path] | None:
    """The highest-numbered complete checkpoint in ``directory`` (its step and folder), or
    ``None``. ``.partial`` folders and folders without ``COMPLETE`` are skipped."""
    root = Path(directory)
    if not root.is_dir():
        return None
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and child.is_dir() and (child / COMPLETE).is_file():
            found.append((int(match.group(1)), child))
    return max(found) if found else None


def _dist() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    import torch.distributed as dist

    if _dist()[1] > 1:
        dist.barrier()


@contextlib.contextmanager
def _single_process_quiet(world: int) -> Iterator[None]:
    """DCP warns on every single-process save and load that it assumes one process: meant."""
    with warnings.catch_warnings():
        if world == 1:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class Preemptible:
    """Checkpoint a training loop on preemption (SIGTERM) and every so often; resume it.

    >>> with memfit.preemptible("ckpt", model=model, optimizer=opt, every_steps=500) as p:
    ...     for step in range(p.step, total_steps):   # p.step: steps already done (resumed)
    ...         train_one_step(next(batches))
    ...         p.end_step()     # saves when due; after SIGTERM saves and exits with 143

    Entering the context loads the latest complete checkpoint in ``directory`` (when
    ``resume``) and installs a handler for each of ``signals`` that only sets a flag; leaving it
    restores the handlers that were there and waits for an asynchronous save. Nothing is
    installed at import.

    :meth:`end_step`, called after each optimizer step, counts the step; saves when
    ``every_steps`` steps or ``every_seconds`` seconds passed since the last save; and when a
    signal arrived, saves (unless it just did) and raises ``SystemExit(exit_code)``. Under
    ``torch.distributed`` the ranks agree each step (one all-reduce of two numbers) on whether
    to save and stop: a signal seen by one rank stops them all at the same step. Call
    :meth:`should_stop` to ask whether a signal arrived (this rank) without stopping.

    A checkpoint holds: the model and optimizer through
    ``torch.distributed.checkpoint.state_dict.get_state_dict`` and ``dcp.save`` (a plain module,
    DDP, or FSDP2 sharded states); and per rank, the CPU, CUDA (every device), Python and NumPy
    RNG states, ``scaler`` (GradScaler), ``scheduler`` (LR scheduler), ``data`` (anything with
    ``state_dict``/``load_state_dict``: a ``StatefulDataLoader``, a sampler), the OOM guard's
    state (``guard``, a :class:`memfit.GuardedStep`: :meth:`~memfit.GuardedStep.state_dict`,
    the micro-batch size it backed off to, the size it grows back to and its clean-step count,
    its steps, history and recoveries), and the step count :attr:`step`. Restoring them all
    makes the resumed run's weights equal an uninterrupted run's bit for bit (on the same
    hardware and software). See Note: [atomic
    checkpoint] in this module for how a torn checkpoint is never loaded.

    ``async_save=True`` writes with ``dcp.async_save`` (the states are staged to memory, the
    files written by a thread while training continues); a save is finished (renamed to
    complete) at the next save, at a stop, or on leaving the context.

    Known limitations: the signal handlers can only be installed from the main thread. Resuming
    needs the world size the checkpoint was saved with (the per-rank RNG states). A
    ``DataLoader`` without ``state_dict`` is not repositioned: derive the data from
    :attr:`step` (seed, skip) or pass a stateful one. The guard's per-shape micro-batch caps are
    predicted again after a resume, not saved. Old checkpoints beyond ``keep`` are deleted.
    """

    def __init__(self, directory: str | os.PathLike[str], *, model: nn.Module,
                 optimizer: torch.optim.Optimizer, scaler: Any = None, scheduler: Any = None,
                 data: Any = None, guard: Any = None, every_steps: int | None = None,
                 every_seconds: float | None = None,
                 signals: Iterable[int] = (signal.SIGTERM,), exit_code: int = EXIT_PREEMPTED,
                 keep: int = 2, async_save: bool = False, resume: bool = True) -> None:
        if not isinstance(model, nn.Module):
            raise MemfitError(f"model must be a torch.nn.Module, not {type(model).__name__}")
        if every_steps is not None and (isinstance(every_steps, bool) or every_steps < 1):
            raise MemfitError(f"every_steps must be a positive integer or None, "
                              f"got {every_steps!r}")
        if every_seconds is not None and not every_seconds > 0:
            raise MemfitError(f"every_seconds must be > 0 or None, got {every_seconds!r} (the "
                              "Young/Daly interval: memfit.spot_plan(...).interval_s)")
        if keep < 1:
            raise MemfitError(f"keep must be at least 1 (checkpoints kept), got {keep}")
        for name, obj in (("data", data), ("scaler", scaler), ("scheduler", scheduler),
                          ("guard", guard)):
            if obj is not None and not (hasattr(obj, "state_dict")
                                        and hasattr(obj, "load_state_dict")):
                raise MemfitError(f"{name} must have state_dict() and load_state_dict(); "
                                  f"{type(obj).__name__} has not")
        self.directory = Path(directory)
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler
        self.scheduler = scheduler
        self.data = data
        self.guard = guard
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.signals = tuple(signals)
        self.exit_code = exit_code
        self.keep = keep
        self.async_save = async_save
        self.resume_on_enter = resume
        self.step = 0
        """Optimizer steps done: after a resume, the step to continue from."""
        self.saved_step: int | None = None
        """The step of the last checkpoint saved or loaded."""
        self.signal_received: int | None = None
        """The signal number that asked to stop, once one arrived."""
        self._previous: dict[int, Any] = {}
        self._last_save_time = time.monotonic()
        self._pending: tuple[Any, Path, Path, int] | None = None
        self._group: Any = None

    # -- the context: signal handlers ------------------------------------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.signal_received is None:
            self.signal_received = signum
            return
        # A second signal does what it would have done without us (SIGTERM's default: end the
        # process): a loop hung in a collective, never reaching end_step, can still be stopped.
        signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
        signal.raise_signal(signum)

    def __enter__(self) -> Preemptible:
        if self.signals and threading.current_thread() is not threading.main_thread():
            raise MemfitError("memfit.preemptible installs its signal handlers from the main "
                              "thread only (Python's rule); enter it there, or pass "
                              "signals=() and stop the loop yourself")
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        try:
            if self.resume_on_enter:
                self.resume()
        except BaseException:
            self._restore_handlers()
            raise
        return self

    def _restore_handlers(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            self._finish_pending()
        finally:
            self._restore_handlers()

    # -- the loop's hooks ------------------------------------------------------------------------

    def should_stop(self) -> bool:
        """Whether a signal asked this rank to stop (:meth:`end_step` acts on it)."""
        return self.signal_received is not None

    def _due(self) -> bool:
        if self.every_steps is not None and self.step % self.every_steps == 0:
            return True
        return (self.every_seconds is not None
                and time.monotonic() - self._last_save_time >= self.every_seconds)

    def end_step(self) -> bool:
        """Count one finished optimizer step; save when due; after a signal, save and raise
        ``SystemExit(exit_code)``. Returns whether it saved."""
        self.step += 1
        stop, due = self.should_stop(), self._due()
        world = _dist()[1]
        if world > 1:  # every rank saves and stops at the same step, or none does
            import torch.distributed as dist

            device = (torch.device("cuda", torch.cuda.current_device())
                      if "nccl" in str(dist.get_backend()) else torch.device("cpu"))
            flags = torch.tensor([int(stop), int(due)], device=device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            stop, due = bool(flags[0]), bool(flags[1])
        saved = False
        if (due or stop) and self.saved_step != self.step:
            self.save()
            saved = True
        if stop:
            self._finish_pending()
            raise SystemExit(self.exit_code)
        return saved

    # -- saving ----------------------------------------------------------------------------------

    def _model_and_optim(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optimizer": optim_sd}

    def _rank_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "step": self.step,
            "rng_cpu": torch.get_rng_state(),
            "rng_python": random.getstate(),
        }
        if torch.cuda.is_available():
            state["rng_cuda"] = torch.cuda.get_rng_state_all()
        try:
            import numpy as np
        except ImportError:  # numpy is optional for torch; nothing of it to save then
            pass
        else:
            state["rng_numpy"] = np.random.get_state()
        for name in ("scaler", "scheduler", "data"):
            obj = getattr(self, name)
            if obj is not None:
                state[name] = obj.state_dict()
        if self.guard is not None:
            state["guard"] = self.guard.state_dict()
        return state

    def save(self) -> Path:
        """Save a checkpoint of step :attr:`step` now (every rank calls it); returns its folder
        (for ``async_save``, where it will be once finished)."""
        import io

        import torch.distributed.checkpoint as dcp

        self._finish_pending()
        rank, world = _dist()
        final = self.directory / f"step-{self.step:09d}"
        partial = self.directory / f"step-{self.step:09d}.partial"
        if rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            for torn in self.directory.glob("step-*.partial"):  # saves killed earlier
                shutil.rmtree(torn, ignore_errors=True)
            partial.mkdir()
        _barrier()
        buffer = io.BytesIO()
        torch.save(self._rank_state(), buffer)
        _write_synced(partial / f"rank{rank}.pt", buffer.getvalue())
        states = self._model_and_optim()
        with _single_process_quiet(world):
            if self.async_save:
                future = dcp.async_save(states, checkpoint_id=partial, no_dist=world == 1,
                                        process_group=self._async_group(world))
                self._pending = (future, partial, final, self.step)
            else:
                dcp.save(states, checkpoint_id=partial, no_dist=world == 1)
                self._commit(partial, final, self.step)
        self.saved_step = self.step
        self._last_save_time = time.monotonic()
        return final

    def _async_group(self, world: int) -> Any:
        # Note: [async save group] The writer thread's collectives (DCP's plan and metadata
        # gathers) go over a gloo group of their own, as torchtitan does: on the default group
        # they would interleave with the training loop's collectives on another thread.
        if world == 1:
            return None
        if self._group is None:
            import torch.distributed as dist

            self._group = dist.new_group(backend="gloo")
        return self._group

    def _finish_pending(self) -> None:
        if self._pending is None:
            return
        future, partial, final, step = self._pending
        self._pending = None
        result = future.result()  # an AsyncSaveResponse on newer torch: wait for its upload
        upload = getattr(result, "upload_completion", None)
        if upload is not None:
            upload.result()
        self._commit(partial, final, step)

    def _commit(self, partial: Path, final: Path, step: int) -> None:
        """Note: [atomic checkpoint]."""
        rank, world = _dist()
        _barrier()  # every rank's files are written and fsynced
        if rank == 0:
            _write_synced(partial / COMPLETE,
                          json.dumps({"step": step, "world_size": world}).encode())
            _fsync_path(partial)
            if final.exists():  # the same step saved before (a resumed run saving it again)
                shutil.rmtree(final)
            os.replace(partial, final)
            _fsync_path(self.directory)
            self._prune()
        _barrier()

    def _prune(self) -> None:
        steps = sorted((int(m.group(1)), child) for child in self.directory.iterdir()
                       if (m := _STEP_DIR.match(child.name)) and (child / COMPLETE).is_file())
        for _, old in steps[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    # -- resuming --------------------------------------------------------------------------------

    def resume(self) -> int:
        """Load the latest complete checkpoint into the model, optimizer and the rest; returns
        the step to continue from (0 when there is none)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        rank, world = _dist()
        found = [latest_complete(self.directory)]
        if world > 1:  # rank 0's listing for all: a file system may show a new folder late
            import torch.distributed as dist

            dist.broadcast_object_list(found, src=0)
        latest = found[0]
        if latest is None:
            return self.step
        step, folder = latest
        saved_world = json.loads((folder / COMPLETE).read_text())["world_size"]
        if saved_world != world:
            raise MemfitError(f"{folder} was saved by {saved_world} ranks, and this run has "
                              f"{world}: each rank's RNG state cannot be restored; resume with "
                              f"{saved_world} ranks, or start a new directory")
        states = self._model_and_optim()
        with _single_process_quiet(world):
            dcp.load(states, checkpoint_id=folder, no_dist=world == 1)
        set_state_dict(self.model, self.optimizer, model_state_dict=states["model"],
                       optim_state_dict=states["optimizer"])
        # our own file, written by save(): it holds NumPy's RNG tuple and user state dicts
        extra = torch.load(folder / f"rank{rank}.pt", weights_only=False)
        self._load_rank_state(extra)
        self.step = self.saved_step = step
        self._last_save_time = time.monotonic()
        return step

    def _load_rank_state(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["rng_cpu"])
        random.setstate(state["rng_python"])
        if "rng_cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng_cuda"])
        if "rng_numpy" in state:
            import numpy as np

            np.random.set_state(state["rng_numpy"])
        for name in ("scaler", "scheduler", "data", "guard"):
            obj = getattr(self, name)
            if obj is not None and name in state:
                obj.load_state_dict(state[name])


def preemptible(directory: str | os.PathLike[str], *, model: nn.Module,
                optimizer: torch.optim.Optimizer, **options: Any) -> Preemptible:
    """A :class:`Preemptible` for a training loop (use it as a context manager).

    >>> with memfit.preemptible("ckpt", model=model, optimizer=opt, every_steps=100) as p:
    ...     for step in range(p.step, total_steps):
    ...         train_one_step()
    ...         p.end_step()
    """
    return Preemptible(directory, model=model, optimizer=optimizer, **options)
