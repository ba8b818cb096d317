"""Time real optimizer steps of the top candidates (``fit(..., measure=True)``)."""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from memfit.fitting.plan import Candidate
from memfit.progress import Progress

__all__ = ["measure_candidates", "real_batch"]


def real_batch(sample: Any, size: int, device: str) -> Any:
    """A batch of ``size`` like ``sample``: its rows repeated (cycled) on ``device``."""
    if isinstance(sample, torch.Tensor):
        idx = torch.arange(size) % sample.shape[0]
        return sample[idx].to(device)
    if isinstance(sample, dict):
        return {k: real_batch(v, size, device) for k, v in sample.items()}
    if isinstance(sample, list | tuple):
        return type(sample)(real_batch(v, size, device) for v in sample)
    return sample


def time_steps(step: Any, batch: Any, *, device: str, steps: int) -> list[float]:
    """Wall seconds of ``steps`` calls of ``step(batch)``, each synchronised on CUDA."""
    times = []
    for _ in range(steps):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step(batch)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def measure_candidates(model: nn.Module, sample: Any, candidates: Sequence[Candidate], *,
                       device: str, global_batch: int, loss_fn: Any = None,
                       reduction: str = "mean", count_fn: Any = None, steps: int = 3
                       ) -> dict[int, tuple[float, int]]:
    """``(seconds per step, OOM recoveries)`` of each candidate: the best of ``steps`` timed
    steps after one warm-up, on a copy of ``model``, and how many times the OOM guard had to
    split the micro-batch (a misprediction). Every candidate here was predicted to fit: this
    never launches one that was not."""
    from memfit.fitting.apply import apply_config

    batch = real_batch(sample, global_batch, device)
    results: dict[int, tuple[float, int]] = {}
    with Progress("memfit fit: timing real steps", total=len(candidates),
                  unit="candidates") as bar:
        for i, cand in enumerate(bar.track(candidates)):
            bar.phase(cand.config.label())
            trial = copy.deepcopy(model).to(device)
            _, _, step = apply_config(trial, cand.config, loss_fn=loss_fn, reduction=reduction,
                                      count_fn=count_fn, log_recoveries=False)
            best = min(time_steps(step, batch, device=device, steps=steps + 1))
            results[i] = (best, len(getattr(step, "recoveries", ())))
            del trial, step
            if device == "cuda":
                torch.cuda.empty_cache()
    return results
