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
           "torch.distributed.pipelining", "memfit.parallel.measure")
"""What the fork server imports once, before it forks a rank (``start_method="forkserver"``):
torch and the distributed modules the layouts run (DTensor, FSDP2 and pipelining import sympy
through ``torch.fx``: 1.8 CPU-seconds a rank that each forked rank would import again)."""


def spawn(fn: Callable[..., None], world: int, *args: Any, start_method: str = "spawn") -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` gloo processes; raise
    ``torch.multiprocessing.ProcessExitedException`` if any rank failed, after printing each
    failed rank's traceback to this process's stderr. ``fn`` must be importable (a
    module-level function): it travels to the ranks by name.

    ``start_method="spawn"`` (the default) starts each rank as a fresh interpreter, as
    ``torch.multiprocessing.spawn`` does: it imports torch first (about 2.5 CPU-seconds a rank)
    and inherits this process's environment and standard streams as they are at the call.
    ``"forkserver"`` forks each rank from a server that imported :data:`PRELOAD` once (0.5 s
    for 4 ranks instead of 6 s on a 2-core machine, measured in a 4-rank all-reduce); the rank
    is given this process's environment at the call, but writes to the server's streams (those
    of this process when the server started). It is not the default: once, in a whole-suite
    run, a forked rank's measured peak came out 32 KB above a spawned one's (commit b342997),
    which was never explained."""
    import multiprocessing
    import tempfile

    import torch.multiprocessing as mp

    if start_method not in ("spawn", "forkserver"):
        raise ValueError(f"start_method must be 'spawn' or 'forkserver', not {start_method!r}")
    if start_method == "forkserver":
        if "forkserver" not in multiprocessing.get_all_start_methods():
            start_method = "spawn"
        else:
            multiprocessing.get_context("forkserver").set_forkserver_preload(list(PRELOAD))
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
