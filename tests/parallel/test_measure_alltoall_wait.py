"""The gloo measurement's release wait reaches expert parallelism's backward exchange on every
supported torch (memfit/parallel/measure.py: ``_gloo_lets_go``, Note: [the all-to-all's C++
wait]).

torch 2.11 and 2.12 run ``all_to_all_single_autograd``'s backward in C++, waiting with the
dispatcher's ``wait_tensor``; 2.13 runs it in Python, waiting with the module's. The ranks below
run both: the installed torch's function, and 2.11's shape on it
(``bench/gloo_alltoall_wait.py: cxx_all_to_all``, a backward that waits with the dispatcher's op
as the C++ node did). Inside the measurement's context the backward's wait must go through
``torch.distributed._functional_collectives.wait_tensor``, where the measurement lets gloo's
worker drop the exchange's tensors before the step goes on; on 2.11 it did not, and the blocks
freed on that worker stayed counted (2-7% of pp 2 x DDP 2 x ep 2's peak).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from memfit.parallel.gloo import spawn


def _backward_waits(rank: int, world: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed import _functional_collectives as funcol

    from _bench import load_bench
    from memfit.parallel.measure import _gloo_lets_go

    group = dist.group.WORLD
    result = {}
    for name, fn in (("installed", funcol.all_to_all_single_autograd),
                     ("2.11", load_bench("gloo_alltoall_wait").cxx_all_to_all)):
        funcol.all_to_all_single_autograd = fn
        with _gloo_lets_go():
            waits = []
            released = funcol.wait_tensor

            def counted(tensor: torch.Tensor, released=released, waits=waits) -> torch.Tensor:
                waits.append(tensor.shape[0])
                return released(tensor)

            funcol.wait_tensor = counted
            x = torch.arange(8.0 * world).reshape(2 * world, 4).requires_grad_()
            y = funcol.all_to_all_single_autograd(x, None, None, group)
            y = y * (rank + 1)  # the forward's wait: an AsyncCollectiveTensor's first use
            forward = len(waits)
            y.sum().backward()
            result[name] = {"forward": forward, "backward": len(waits) - forward,
                            "grad": x.grad.tolist()}
        result[name]["restored"] = funcol.all_to_all_single_autograd is fn
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def test_the_backward_exchange_waits_through_the_measurements_release_on_2_11_and_2_13() -> None:
    """Two gloo ranks, an all-to-all of 4 rows by 4 each way, then rank r scales what it
    received by r + 1: each path waits once in the forward and once in the backward through the
    module's ``wait_tensor`` (2.11's path never did in the backward), the context gives
    ``all_to_all_single_autograd`` back as it found it, and both paths compute the same gradient:
    the rows rank r sent to rank j come back scaled by j + 1 (rows 0-1 went to rank 0, 2-3 to
    rank 1)."""
    with tempfile.TemporaryDirectory() as out:
        spawn(_backward_waits, 2, out)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]
    want = [[1.0] * 4] * 2 + [[2.0] * 4] * 2
    for got in ranks:
        for path in ("installed", "2.11"):
            assert got[path]["forward"] == 1, (path, got[path])
            assert got[path]["backward"] == 1, (path, got[path])
            assert got[path]["restored"], path
            assert got[path]["grad"] == want, (path, got[path]["grad"])
