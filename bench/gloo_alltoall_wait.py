"""Why torch 2.11's gloo check of pp 2 x DDP 2 x ep 2 measured 2-7% above the trace: every run's
per-rank peak, with the expert all-to-all as the installed torch runs it and as torch 2.11 and
2.12 ran it.

Run: ``python bench/gloo_alltoall_wait.py [--runs N] [--path torch|cxx|both]``

Expert parallelism exchanges tokens with
``torch.distributed._functional_collectives.all_to_all_single_autograd``. In torch 2.11 and
2.12 that calls ``_c10d_functional_autograd::all_to_all_single``, whose backward is C++
(``torch/csrc/distributed/c10d/Functional.cpp: AllToAllSingle::backward``) and waits for the
reverse exchange with the dispatcher's ``_c10d_functional::wait_tensor``; since 2.13
(pytorch#172792) it is ``all_to_all_single``, whose backward is Python
(``_functional_collectives.py: all_to_all_single_backward``) and waits with the module's
``wait_tensor``. ``--path cxx`` runs 2.11's shape on the installed torch: a Python autograd
function with the same forward and a backward that waits with the dispatcher's op, as the C++
one did (:func:`cxx_all_to_all`). The measurement (``memfit.parallel.measure``) runs each case
4 times in one set of 4 gloo ranks (spawned once per path) and prints every run's peak per
rank against the trace's. Writes ``bench/results/gloo-alltoall-wait-<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from memfit.parallel import Parallel
from memfit.parallel.measure import Case, tiny_moe_spec
from memfit.recipe import Recipe

CASE = Case(spec=tiny_moe_spec(4), batch=8, seq=64,
            recipe=Recipe(parallel=Parallel(gpus=4, pp=2, ep=2, microbatches=4)))


class _CxxAllToAll(torch.autograd.Function):
    """torch 2.11's ``AllToAllSingle`` (C++): the forward runs the exchange and returns without
    waiting; the backward makes the gradient contiguous, runs the reverse exchange and waits
    with ``torch.ops._c10d_functional.wait_tensor``, not through the Python module."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, splits: list[int], group_name: str) -> Any:
        ctx.splits, ctx.group_name = splits, group_name
        return torch.ops._c10d_functional.all_to_all_single(x, splits, splits, group_name)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        out = torch.ops._c10d_functional.all_to_all_single(
            grad.contiguous(), ctx.splits, ctx.splits, ctx.group_name)
        return torch.ops._c10d_functional.wait_tensor(out), None, None


def cxx_all_to_all(x: torch.Tensor, output_split_sizes: Any, input_split_sizes: Any,
                   group: Any, tag: str = "") -> torch.Tensor:
    """``all_to_all_single_autograd`` as torch 2.11 and 2.12 run it, equal splits only (what
    memfit's expert layers pass): the C++ node's exchange, wrapped in an AsyncCollectiveTensor
    (2.11: ``_FromTorchTensor.apply``; here the installed torch's ``_maybe_wrap_tensor``)."""
    from torch.distributed import _functional_collectives as funcol

    assert output_split_sizes is None and input_split_sizes is None
    splits = [x.shape[0] // group.size()] * group.size()
    return funcol._maybe_wrap_tensor(_CxxAllToAll.apply(x, splits, group.group_name))


def _worker(rank: int, world: int, path: str, runs: int, out: str) -> None:
    from torch.distributed import _functional_collectives as funcol

    from memfit.parallel.measure import rank_peaks

    if path == "cxx":
        funcol.all_to_all_single_autograd = cxx_all_to_all
    Path(out, f"rank{rank}.json").write_text(json.dumps(rank_peaks([CASE] * runs)))


def measure_path(path: str, runs: int) -> list[list[int]]:
    """Each run's peak, per rank: ``[[rank0, rank1, rank2, rank3] for each run]``."""
    from memfit.parallel.gloo import spawn

    with tempfile.TemporaryDirectory() as out:
        spawn(_worker, 4, path, runs, out)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(4)]
    return [[ranks[r][i]["peak"] for r in range(4)] for i in range(runs)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--path", choices=("torch", "cxx", "both"), default="both")
    args = parser.parse_args()
    import memfit
    from memfit.parallel.measure import build

    model, inputs = build(CASE)
    traced = {r: e.peak_bytes for e in memfit.estimate(model, inputs, device="cpu",
                                                       parallel=CASE.parallel).per_rank
              for r in e.ranks}
    result: dict[str, Any] = {"torch": torch.__version__, "platform": platform.platform(),
                              "command": " ".join(sys.argv), "traced": traced}
    for path in (("torch", "cxx") if args.path == "both" else (args.path,)):
        runs = measure_path(path, args.runs)
        result[path] = runs
        for i, peaks in enumerate(runs):
            off = ", ".join(f"{100 * (p - traced[r]) / traced[r]:+.2f}%"
                            for r, p in enumerate(peaks))
            print(f"{path} run {i}: {peaks} ({off} against the trace)", flush=True)
    name = f"gloo-alltoall-wait-{datetime.date.today().isoformat()}.json"
    Path(__file__).parent.joinpath("results", name).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
