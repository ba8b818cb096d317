"""Measure each rank's peak of a real data-parallel step: one process per rank over gloo (CPU).

The truth that :mod:`memfit.parallel.trace` is checked against. Every rank builds the model, applies
the layout with the same functions (``memfit.parallel.apply``) and runs the same step (the default
loss, ``backward``, ``optimizer.step()``, ``zero_grad(set_to_none=True)``), all under the PyTorch
profiler with ``profile_memory=True`` from before the model is built, so that every byte the rank
holds is an allocator event of the session (DDP's buckets and FSDP2's sharded parameters are made
in C++ and Python constructors, out of reach of a count of live tensors). The peak is the highest
running sum of those events inside the steps (``memfit.profiling.cpu``: the same event reading as
``measure_cpu_peak``).

>>> from memfit.models import TransformerSpec
>>> case = Case(spec=tiny_spec(), batch=2, seq=32, parallel=Parallel(gpus=2, fsdp=2))
>>> peaks = measure([case], world=2)        # doctest: +SKIP
>>> peaks[0]                                  # one peak per rank  # doctest: +SKIP
[1234567, 1234567]
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import tempfile
from pathlib import Path
from typing import Any

import torch

from memfit.parallel.config import Parallel

STEP_MARKER = "memfit::parallel_step"
"""The profiler range around each measured step."""


@dataclasses.dataclass(frozen=True)
class Case:
    """One layout of one model to measure (picklable: it travels to the rank processes)."""

    spec: Any
    """A :class:`memfit.models.TransformerSpec`, built with the builtin backend."""
    batch: int
    seq: int
    parallel: Parallel
    optimizer: str = "adamw"
    steps: int = 2


def tiny_spec(layers: int = 2) -> Any:
    """A tiny Llama-like decoder (hidden 64, 4 heads, vocab 256): a few MB per step."""
    from memfit.models import TransformerSpec

    return TransformerSpec(
        name="tiny-llama", family="llama", arch="decoder", hidden_size=64, num_layers=layers,
        num_heads=4, num_kv_heads=4, head_dim=16, intermediate_size=128, vocab_size=256,
        max_position_embeddings=512)


def build(case: Case) -> tuple[torch.nn.Module, Any]:
    """The case's model (real, CPU, seeded) and inputs."""
    from memfit.models.build import build_model, example_inputs

    torch.manual_seed(0)
    model = build_model(case.spec, backend="builtin", device="cpu")
    inputs = example_inputs(case.spec, batch=case.batch, seq=case.seq, device="cpu")
    return model, inputs


def _measure_case(case: Case) -> int:
    """This rank's peak bytes over the case's steps (see the module)."""
    import gc

    from memfit._loss import model_loss
    from memfit._noise import quiet_profile
    from memfit.parallel.apply import apply_model, apply_optimizer
    from memfit.profiling.cpu import _raw_events, session_events
    from memfit.trace.optim import make_optimizer

    gc.collect()
    gc.disable()
    try:
        with quiet_profile(activities=[torch.profiler.ProfilerActivity.CPU],
                           profile_memory=True) as prof:
            model, inputs = build(case)
            model = apply_model(model, case.parallel, "cpu")
            params = [p for p in model.parameters() if p.requires_grad]
            opt = apply_optimizer(make_optimizer(case.optimizer, params, cuda_target=False),
                                  case.parallel)
            for _ in range(case.steps):
                with torch.profiler.record_function(STEP_MARKER):
                    model_loss(model, inputs).backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            del model, opt, inputs, params
    finally:
        gc.enable()
    raw, markers = _raw_events(prof, "cpu", STEP_MARKER)
    start = min(m.start_time_ns for m in markers)
    end = max(m.end_time_ns for m in markers)
    running = peak = 0
    for time_ns, _, nbytes, *_ in session_events(raw):
        running += nbytes
        if start <= time_ns <= end:
            peak = max(peak, running)
    return peak


def _worker(rank: int, world: int, port: int, cases: list[Case], out: str) -> None:
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        peaks = [_measure_case(case) for case in cases]
        dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(peaks))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(cases: list[Case], world: int) -> list[list[int]]:
    """Run ``cases`` in ``world`` gloo processes (``torch.multiprocessing.spawn``); return, per
    case, each rank's peak bytes. Every case's layout must have ``gpus == world``."""
    import torch.multiprocessing as mp

    for case in cases:
        if case.parallel.gpus != world:
            raise ValueError(f"case {case.parallel.describe()} needs {case.parallel.gpus} ranks, "
                             f"not {world}")
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(world, _free_port(), cases, out), nprocs=world, join=True)
        per_rank = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
    return [[per_rank[r][i] for r in range(world)] for i in range(len(cases))]
