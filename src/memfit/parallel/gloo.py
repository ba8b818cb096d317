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
           args: tuple[Any, ...]) -> None:
    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    code = 0
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        try:
            fn(rank, world, *args)
            dist.barrier()  # every rank is done before any tears its process group down
        finally:
            gc.collect()  # DDP reducers and FSDP states in reference cycles let go of the group
            dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def spawn(fn: Callable[..., None], world: int, *args: Any) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` gloo processes (``torch.multiprocessing``'s
    spawn start method, so ``fn`` must be importable: a module-level function); raise
    ``torch.multiprocessing.ProcessExitedException`` if any rank failed."""
    import torch.multiprocessing as mp

    mp.spawn(_entry, args=(fn, world, free_port(), args), nprocs=world, join=True)
