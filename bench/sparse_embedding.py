"""Sparse embedding gradients against dense ones on a recommender: peak memory, measured and
predicted, in the same run.

    python bench/sparse_embedding.py [--rows 2000000] [--dim 16] [--batch 2048] [--out PATH]

A DLRM-style model (an item table of ``--rows`` rows looked up once per field, 8 fields; a
multi-hot history ``EmbeddingBag`` over ``rows / 20`` rows, 20 ids per sample; an MLP 144-64-1
on the concatenated embeddings; a click loss), trained for two steps (forward, backward,
``optimizer.step()``, ``zero_grad(set_to_none=True)``) with each optimizer family, once with
dense gradients (``sparse=False``) and once with ``memfit.techniques.apply_sparse_embeddings``:

- SGD: ``torch.optim.SGD`` both ways;
- Adagrad: ``torch.optim.Adagrad`` both ways;
- Adam: ``torch.optim.Adam`` (dense) against ``SparseAdamWithDense`` (SparseAdam for the tables,
  Adam for the MLP). Not the same optimizer: SparseAdam's moments only move for touched rows.

Peak: CPU, the PyTorch profiler's allocator events over the two steps plus the bytes alive before
them (``memfit.profiling.measure_cpu_peak``). Predicted: ``memfit.estimate(..., device="cpu")``
on the same model and batch (real ids: the unique rows are counted). Ids are skewed (a cubed
uniform), so a batch touches fewer rows than it has ids.

Writes ``bench/results/sparse-embedding-cpu-<date>.json`` (or ``--out``) with the device, torch
version, command and every row.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import memfit
from memfit.profiling import measure_cpu_peak
from memfit.techniques import SparseAdamWithDense, apply_sparse_embeddings

FIELDS = 8
HISTORY = 20


class Recommender(nn.Module):
    """Item table per field + history bag + a small MLP (see the module docstring)."""

    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        self.items = nn.Embedding(rows, dim)
        self.history = nn.EmbeddingBag(rows // 20, dim, mode="sum")
        self.mlp = nn.Sequential(nn.Linear(dim * (FIELDS + 1), 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, ids: torch.Tensor, history: torch.Tensor,
                clicks: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.items(ids).flatten(1), self.history(history)], 1)
        return F.binary_cross_entropy_with_logits(self.mlp(x), clicks)


OptFactory = Callable[[Any], torch.optim.Optimizer]
FAMILIES: dict[str, tuple[OptFactory, OptFactory]] = {
    # family: (dense-gradient optimizer, sparse-gradient optimizer)
    "sgd": (lambda ps: torch.optim.SGD(ps, lr=0.1), lambda ps: torch.optim.SGD(ps, lr=0.1)),
    "adagrad": (lambda ps: torch.optim.Adagrad(ps, lr=0.1),
                lambda ps: torch.optim.Adagrad(ps, lr=0.1)),
    "adam": (lambda ps: torch.optim.Adam(ps, lr=1e-3),
             lambda ps: SparseAdamWithDense(ps, lr=1e-3)),
}


def batch(rows: int, size: int, seed: int = 1) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)

    def skewed(n: int, k: int, r: int) -> torch.Tensor:
        return (torch.rand(n, k, generator=g) ** 3 * r).long()

    return (skewed(size, FIELDS, rows), skewed(size, HISTORY, rows // 20),
            torch.randint(0, 2, (size, 1), generator=g).float())


def run(rows: int, dim: int, inputs: tuple[torch.Tensor, ...], factory: OptFactory,
        sparse: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Recommender(rows, dim)
    if sparse:
        apply_sparse_embeddings(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = memfit.estimate(model, inputs, optimizer=factory, device="cpu", steps=2,
                              loss_fn=lambda m, b: m(*b))
    opt = factory(model.parameters())
    grad_bytes: list[int] = []
    times: list[float] = []

    def steps() -> None:
        for _ in range(2):
            start = time.perf_counter()
            loss = model(*inputs)
            loss.backward()
            del loss
            g = model.items.weight.grad
            grad_bytes.append(g._values().nbytes + g._indices().nbytes if g.is_sparse
                              else g.nbytes)
            del g  # (held across the next backward, it would be counted twice)
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peak = measure_cpu_peak(steps, model, inputs, opt)
    return {"measured_peak_bytes": peak.peak_bytes, "predicted_peak_bytes": est.peak_bytes,
            "item_table_grad_bytes": grad_bytes[-1], "step_seconds": times[-1],
            "assumptions": list(est.assumptions)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    inputs = batch(args.rows, args.batch)
    unique = int(inputs[0].unique().numel())
    print(f"item table {args.rows} x {args.dim} fp32 ({args.rows * args.dim * 4 / 2**20:.0f} "
          f"MiB); batch {args.batch}: {inputs[0].numel()} item ids, {unique} unique")
    print(f"{'optimizer':10} {'grads':6} {'measured MiB':>13} {'predicted MiB':>14} "
          f"{'error':>7} {'item grad MiB':>14} {'saving':>7}")
    rows = []
    for family, (dense_opt, sparse_opt) in FAMILIES.items():
        base = run(args.rows, args.dim, inputs, dense_opt, sparse=False)
        sparse = run(args.rows, args.dim, inputs, sparse_opt, sparse=True)
        for kind, r in (("dense", base), ("sparse", sparse)):
            r.update(optimizer=family, gradients=kind)
            r["saving_vs_dense"] = 1 - r["measured_peak_bytes"] / base["measured_peak_bytes"]
            error = r["predicted_peak_bytes"] / r["measured_peak_bytes"] - 1
            print(f"{family:10} {kind:6} {r['measured_peak_bytes'] / 2**20:13.1f} "
                  f"{r['predicted_peak_bytes'] / 2**20:14.1f} {100 * error:+6.2f}% "
                  f"{r['item_table_grad_bytes'] / 2**20:14.2f} "
                  f"{100 * r['saving_vs_dense']:6.1f}%")
            rows.append(r)
    out = args.out or Path(f"bench/results/sparse-embedding-cpu-{dt.date.today().isoformat()}"
                           ".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "device": "cpu", "device_name": platform.processor() or platform.machine(),
        "torch": torch.__version__, "python": platform.python_version(),
        "command": " ".join(["python", *sys.argv]) if argv is None
        else " ".join(["python", "bench/sparse_embedding.py", *argv]),
        "rows": args.rows, "dim": args.dim, "batch": args.batch, "item_ids": inputs[0].numel(),
        "unique_item_ids": unique, "results": rows,
    }, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
