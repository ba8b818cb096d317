"""Run a function in ``world`` gloo processes on this machine, and end them without a teardown.

Each process joins a gloo process group on a free local port, runs ``fn(rank, world, *args)``,
waits for the others at a barrier, destroys its process group and leaves with ``os._exit``: the
exit code says whether ``fn`` raised (its traceback is printed first). The interpreter's own
teardown is skipped on purpose. After the work is done, gloo's worker threads and objects that
still hold a process group (a DDP reducer in a reference cycle, a finished ``Work``) can be
destroyed during interpreter finalization, and that aborts the process (``std::terminate``:
"terminate called without an active exception"; PyTorch PR #179291 describes the same crash
for a process group left alive at exit). A process that finished its work and wrote its
result must not fail the run for that.

>>> def hello(rank, world, out):                       # doctest: +SKIP
...     Path(out, f"{rank}").write_text(str(rank))
>>> spawn(hello, 2, "/tmp/out")                         # doctest: +SKIP
"""

from __future__ import annotations

import gc
import os
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, fn: Callable[..., None], world: int, port: int,
           args: tuple[Any, ...], errors: str | None = None,
           environ: dict[str, str] | None = None) -> None:
    import torch
    import torch.distributed as dist

    from memfit.trace.heap import mark_process_frozen

    if environ is not None:  # a fork server's rank has the server's environment: the caller's
        os.environ.clear()
        os.environ.update(environ)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    # What the rank holds before ``fn`` (torch and the modules it imported; under forkserver,
    # the server's imports) is alive for the whole rank: frozen (gc.freeze), the collections that
    # ``fn`` runs before each measured step walk only what the rank made since, not the
    # imported modules' million objects. The rank ends with os._exit: nothing to give back.
    gc.collect()
    gc.freeze()
    mark_process_frozen()
    code = 0
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        try:
            fn(rank, world, *args)
            dist.barrier()  # every rank is done before any tears its process group down
        except BaseException:
            # Reported before the teardown: the other ranks fail at their barrier only once this
            # rank has let go of the group, and the parent, which stops every rank as soon as one
            # has exited, then finds this rank's whole traceback, not a file half written.
            _report(rank, errors)
            code = 1
        finally:
            gc.collect()  # DDP reducers and FSDP states in reference cycles let go of the group
            dist.destroy_process_group()
    except BaseException:
        if code == 0:
            _report(rank, errors)
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _report(rank: int, errors: str | None) -> None:
    """Print the exception being handled, and give it to the parent in ``errors/rank<r>.txt``
    (written whole, then renamed: the parent never reads a part of it)."""
    traceback.print_exc()
    sys.stderr.flush()
    if errors is not None:  # for the parent, whose stderr a fork server's rank may not share
        path = os.path.join(errors, f"rank{rank}.txt")
        with open(path + ".part", "w", encoding="utf-8") as f:
            f.write(traceback.format_exc())
        os.replace(path + ".part", path)


PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp",
           "torch.distributed.pipelining", "memfit.parallel.measure",
           "transformers.modeling_utils")
"""What the fork server imports once, before it forks a rank (``start_method="forkserver"``):
torch and the distributed modules the layouts run (DTensor, FSDP2 and pipelining import sympy
through ``torch.fx``: 1.8 CPU-seconds a rank that each forked rank would import again), and
transformers' model base where it is installed (a module that is not is skipped): the 4 ranks
of tests/parallel/test_parallel_pp_split_ep.py (Mixtral, Qwen3-MoE) took 0.6 CPU-s each to
start and 2.8-3.8 to measure with it, 1.3-1.7 and 3.6-4.7 without."""


_IMPORT_TIME_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA",
                    "OMP_NUM_THREADS", "MKL_NUM_THREADS")
"""The environment variables that pick torch's CPU kernels and thread pools when torch starts
(``ATEN_CPU_CAPABILITY`` at its import, oneDNN's ISA and the OpenMP/MKL pools at their first
use, which the server's imports may have made): a forked rank inherits their effect from the
fork server, whatever its own environment says. Variables read later (``PYTORCH_*`` at the
allocator's first use, ``MEMFIT_*``) are the rank's own, set before ``fn`` runs. A check of
every ``TORCH*``/``PYTORCH_*``/``PYTHON*`` variable too sent one whole-suite run's later ranks
to spawn (test_parallel_gloo.py's tiny ranks 4.1-4.7 s instead of 0.8-1.3 s forked): some
test or library had set one of them; which one was not found."""

_server_env: dict[str, str] | None = None
"""The import-time variables of this process when it started its fork server (the server
inherits the environment of that moment)."""


def _import_time_env() -> dict[str, str]:
    return {k: os.environ[k] for k in _IMPORT_TIME_ENV if k in os.environ}


def _method(start_method: str) -> str:
    """``start_method``, or ``"spawn"`` where a fork server cannot stand for a fresh
    interpreter: none on this platform, or this process's server started under other
    import-time variables than the caller's now (a test that set ``ATEN_CPU_CAPABILITY``)."""
    import multiprocessing

    global _server_env
    if start_method not in ("spawn", "forkserver"):
        raise ValueError(f"start_method must be 'spawn' or 'forkserver', not {start_method!r}")
    if start_method == "spawn" or "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    if _server_env is None:
        _server_env = _import_time_env()
        multiprocessing.get_context("forkserver").set_forkserver_preload(list(PRELOAD))
    return "forkserver" if _import_time_env() == _server_env else "spawn"


def spawn(fn: Callable[..., None], world: int, *args: Any,
          start_method: str = "forkserver") -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` gloo processes; raise
    ``torch.multiprocessing.ProcessExitedException`` if any rank failed, after printing each
    failed rank's traceback to this process's stderr. ``fn`` must be importable (a
    module-level function): it travels to the ranks by name.

    ``start_method="forkserver"`` (the default) forks each rank from a server that imported
    :data:`PRELOAD` once: 3.1-4.2 s for a 2-rank measurement of seven layouts instead of
    7.2-8.5 s spawned (a 2-core Xeon; a spawned rank imports torch and its distributed modules
    again, about 2 CPU-seconds). The rank is given this process's environment at the call, but
    writes to the server's streams (those of this process when the server started), and it
    runs with what torch read from the environment at the server's import: where those
    variables (:data:`_IMPORT_TIME_ENV`) changed since, the ranks are spawned.
    ``"spawn"`` starts each rank as a fresh interpreter, as ``torch.multiprocessing.spawn``
    does, with this process's environment and standard streams as they are at the call.

    Note: [forked and spawned ranks measure the same] Commit b342997 went back to spawn after a
    forked rank measured 32 KB above a spawned one once in a whole-suite run. Measured since
    (the same seven 2-rank layouts, FSDP2, DDP, ZeRO-1, TP, 1F1B, GPipe and EP, three rounds of
    spawn, forkserver, forkserver, spawn): the two give the same peaks and the same spread of
    gloo's timing, which both show (DDP +4 and +596 B, ZeRO-1's second rank up to +457 KB,
    EP +64 KiB, in runs of either kind). A 32 KiB block is what gloo's worker holds past a
    tensor-parallel collective (Note: [gloo's worker lets go] in memfit/parallel/measure.py),
    so that one run was that delay, not the fork."""
    import tempfile

    import torch.multiprocessing as mp

    start_method = _method(start_method)
    with tempfile.TemporaryDirectory(prefix="memfit-gloo-") as errors:
        try:
            environ = dict(os.environ) if start_method == "forkserver" else None
            mp.start_processes(_entry, args=(fn, world, free_port(), args, errors, environ),
                               nprocs=world, join=True, start_method=start_method)
        except mp.ProcessExitedException:
            for name in sorted(n for n in os.listdir(errors) if n.endswith(".txt")):
                with open(os.path.join(errors, name), encoding="utf-8") as f:
                    print(f"[{name[:-4]}] {f.read()}", file=sys.stderr, end="")
            raise
