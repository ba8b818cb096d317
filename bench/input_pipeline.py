"""The input pipeline's host memory, predicted against measured, and DevicePrefetcher's extra
memory on the CPU, in the same run.

    python bench/input_pipeline.py [--sample-mib 2] [--batch 4] [--samples 48] [--out PATH]

A synthetic dataset (each sample a fresh float32 tensor of ``--sample-mib`` MiB; batches of
``--batch``), loaded by a ``torch.utils.data.DataLoader`` with forked workers:

- **0 workers**: the main process builds each batch; measured: the peak of the PyTorch
  profiler's allocator events while a loop takes every batch and holds it for its step
  (``memfit.profiling.measure_cpu_peak``); predicted: ``private_bytes`` (the batch in use, the
  next batch's samples and its collated batch).
- **2 and 4 workers, prefetch 2**: measured: the growth of the machine's shared memory
  (psutil's ``virtual_memory().shared``) at rest with the queue full, minus the same loader's
  with 4-float samples (the baseline, same run; ``memfit.data.measure``); predicted:
  ``shared_bytes`` (workers x prefetch batches in flight + the one in use). The workers' USS
  (psutil) is printed next to the predicted workers' memory (10 MiB at rest each, the default,
  + 2 batches each, WORKER_BATCHES): their basis, not part of the 5% check.
- **DevicePrefetcher depth 1 and 2** (CPU: batches pass through, ``depth`` taken ahead):
  measured: the loop's profiler peak with the prefetcher minus without (the baseline, same run);
  predicted: ``depth`` x the batch's bytes.

Writes ``bench/results/input-pipeline-cpu-<date>.json`` (or ``--out``) with the machine, torch
version, command and every row.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from memfit.data import DevicePrefetcher
from memfit.data.measure import measure_loader_memory
from memfit.profiling import measure_cpu_peak
from memfit.runtime.input_pipeline import DataLoaderSpec, input_pipeline_memory
from memfit.units import format_bytes

RESULTS = Path(__file__).resolve().parent / "results"


class Synthetic(Dataset):
    def __init__(self, floats: int, n: int = 48) -> None:
        self.floats, self.n = floats, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((self.floats,), float(i))


def loader(floats: int, batch: int, workers: int, n: int = 48) -> DataLoader:
    return DataLoader(Synthetic(floats, n), batch_size=batch, num_workers=workers,
                      prefetch_factor=2 if workers else None,
                      multiprocessing_context="fork" if workers else None)


def _loop(batches: Any) -> None:
    for b in batches:
        b.sum()  # the step


def _row(what: str, predicted: int, measured: int, **extra: Any) -> dict[str, Any]:
    return {"what": what, "predicted_bytes": predicted, "measured_bytes": measured,
            "error": (predicted - measured) / measured if measured else None, **extra}


def run(sample_mib: float = 2.0, batch: int = 4, n: int = 48) -> list[dict[str, Any]]:
    floats = int(sample_mib * (1 << 20)) // 4
    batch_bytes = floats * 4 * batch
    rows = []
    # 0 workers: the profiler's allocator events in this process
    peak = measure_cpu_peak(lambda: _loop(loader(floats, batch, 0, n))).peak_delta_bytes
    spec0 = DataLoaderSpec(batch_bytes=batch_bytes)
    rows.append(_row("0 workers: batches built in the main process (profiler peak)",
                     input_pipeline_memory(spec0).private_bytes, peak, workers=0))
    for workers in (2, 4):
        tiny = measure_loader_memory(loader(4, batch, workers, n))
        big = measure_loader_memory(loader(floats, batch, workers, n))
        spec = DataLoaderSpec(num_workers=workers, batch_bytes=big.batch_bytes)
        base = DataLoaderSpec(num_workers=workers, batch_bytes=tiny.batch_bytes)
        predicted = (input_pipeline_memory(spec).shared_bytes
                     - input_pipeline_memory(base).shared_bytes)
        rows.append(_row(f"{workers} workers x prefetch 2: shared memory (psutil), minus the "
                         "tiny-batch baseline", predicted, big.shared_bytes - tiny.shared_bytes,
                         workers=workers, baseline_shared_bytes=tiny.shared_bytes,
                         worker_uss_tiny=list(tiny.worker_uss), worker_uss=list(big.worker_uss),
                         worker_pss=list(big.worker_pss), main_uss=big.main_uss,
                         main_pss=big.main_pss,
                         predicted_worker_bytes=input_pipeline_memory(spec).worker_bytes))
    plain = measure_cpu_peak(lambda: _loop(loader(floats, batch, 0, n))).peak_delta_bytes
    for depth in (1, 2):
        ahead = measure_cpu_peak(lambda d=depth: _loop(DevicePrefetcher(
            loader(floats, batch, 0, n), "cpu", depth=d))).peak_delta_bytes
        rows.append(_row(f"DevicePrefetcher depth {depth} (CPU): profiler peak minus the plain "
                         "loop's", depth * batch_bytes, ahead - plain, depth=depth,
                         baseline_peak_bytes=plain))
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'case':<86} {'predicted':>11} {'measured':>11} {'error':>7}"]
    for r in rows:
        err = "" if r["error"] is None else f"{100 * r['error']:+.1f}%"
        lines.append(f"{r['what']:<86} {format_bytes(r['predicted_bytes']):>11} "
                     f"{format_bytes(r['measured_bytes']):>11} {err:>7}")
        if "worker_uss" in r:
            uss = ", ".join(format_bytes(u) for u in r["worker_uss"])
            tiny = ", ".join(format_bytes(u) for u in r["worker_uss_tiny"])
            lines.append(f"    workers' USS: {uss} (tiny batches: {tiny}); predicted workers' "
                         f"memory {format_bytes(r['predicted_worker_bytes'])} in all")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sample-mib", type=float, default=2.0)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--samples", type=int, default=48, help="samples in the dataset")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    rows = run(args.sample_mib, args.batch, args.samples)
    print(table(rows))
    out = args.out or RESULTS / f"input-pipeline-cpu-{dt.date.today().isoformat()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "machine": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "command": " ".join(["python", *sys.argv]),
        "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
