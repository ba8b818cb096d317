"""memfit.parallel.gloo.spawn: every rank runs, a rank that raises fails the run with its
traceback, and a rank that finished is not failed by what happens after (no interpreter
teardown)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from memfit.parallel.gloo import spawn


def _sum_ranks(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist

    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    Path(out, str(rank)).write_text(f"{world} {float(t)}")


def _second_rank_raises(rank: int, world: int) -> None:
    if rank == 1:
        raise RuntimeError("rank 1 fails on purpose")


def _aborts_at_exit(rank: int, world: int, out: str) -> None:
    import atexit
    import os

    # What gloo's threads do at interpreter teardown, made certain: a process that reaches its
    # teardown dies of SIGABRT. spawn's ranks never reach it.
    atexit.register(os.abort)
    Path(out, str(rank)).write_text("done")


def test_every_rank_runs_in_one_group() -> None:
    with tempfile.TemporaryDirectory() as out:
        spawn(_sum_ranks, 2, out)
        assert [Path(out, str(r)).read_text() for r in range(2)] == ["2 3.0", "2 3.0"]


def test_a_rank_that_raises_fails_the_run(capfd: pytest.CaptureFixture[str]) -> None:
    import torch.multiprocessing as mp

    with pytest.raises(mp.ProcessExitedException, match="exit code 1"):
        spawn(_second_rank_raises, 2)
    assert "rank 1 fails on purpose" in capfd.readouterr().err


def test_a_finished_rank_skips_the_teardown() -> None:
    with tempfile.TemporaryDirectory() as out:
        spawn(_aborts_at_exit, 2, out)
        assert [Path(out, str(r)).read_text() for r in range(2)] == ["done", "done"]


def _env_and_raise(rank: int, world: int, out: str) -> None:
    import os

    Path(out, str(rank)).write_text(os.environ.get("MEMFIT_GLOO_TEST", "unset"))
    if rank == 1:
        raise RuntimeError("rank 1 fails on purpose")


def test_forkserver_ranks_take_the_callers_environment_and_report_their_traceback(
        capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank forked from the fork server has the server's environment and streams: spawn gives
    it the caller's environment at the call, and the parent prints its traceback."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        spawn(_sum_ranks, 2, out, start_method="forkserver")  # the server starts here
        monkeypatch.setenv("MEMFIT_GLOO_TEST", "set after the server started")
        capfd.readouterr()
        with pytest.raises(mp.ProcessExitedException, match="exit code 1"):
            spawn(_env_and_raise, 2, out, start_method="forkserver")
        assert [Path(out, str(r)).read_text() for r in range(2)] == [
            "set after the server started"] * 2
    err = capfd.readouterr().err
    assert "[rank1] Traceback" in err and "rank 1 fails on purpose" in err


def test_a_changed_import_time_environment_spawns_fresh_ranks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """torch reads ``ATEN_CPU_CAPABILITY`` when it is imported, and a forked rank has the fork
    server's torch: once the variable differs from the server's, ranks are spawned (fresh
    interpreters that read it); a variable torch does not read at import keeps the server."""
    from memfit.parallel import gloo

    monkeypatch.setattr(gloo, "_server_env", None)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    assert gloo._method("forkserver") == "forkserver"  # the server's environment recorded
    monkeypatch.setenv("MEMFIT_GLOO_TEST", "not read at import")
    assert gloo._method("forkserver") == "forkserver"
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert gloo._method("forkserver") == "spawn"
    assert gloo._method("spawn") == "spawn"


def test_an_unknown_start_method_is_refused() -> None:
    with pytest.raises(ValueError, match="'spawn' or 'forkserver'"):
        spawn(_sum_ranks, 2, "/nonexistent", start_method="fork")
