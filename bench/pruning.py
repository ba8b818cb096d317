"""Pruning is not a memory saving by itself: dense, pruned and sparsified (CSR / BSR) weights of
an MLP, their bytes and forward times, measured in the same run.

    python bench/pruning.py [--features 1024] [--hidden 4096] [--batch 64] [--repeats 20]
                            [--out PATH]

An inference MLP ``Linear(features, hidden) -> ReLU -> Linear(hidden, features)`` (fp32, CPU, one
thread), in these variants:

- ``dense``: the model as built;
- ``pruned``: ``torch.nn.utils.prune.l1_unstructured`` at 50% and 90% (the model keeps
  ``weight_orig``, ``weight_mask`` and the recomputed weight);
- ``csr``: ``l1_unstructured`` at 1 - density, then ``memfit.techniques.sparsify(format="csr")``
  (``prune.remove``, then CSR with int32 indices where it saves bytes);
- ``bsr``: 16 x 16 blocks pruned by their L1 norm (``prune.custom_from_mask``) to the density,
  then ``sparsify(format="bsr")``.

Bytes: the storages the Linear layers' weights hold (parameters, buffers and the pruned
``weight`` attribute; a sparse tensor's values and indices), read from the tensors, next to what
memfit reports (``sparsify``'s report; for a pruned model ``memfit.trace.pruning``). Time: the
median of ``--repeats`` no-grad forwards of a ``--batch`` x ``--features`` input; the variants
take turns in each round, and the ratio to the dense model is the median of the rounds' ratios.
Writes ``bench/results/pruning-cpu-<date>.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.utils import prune

from memfit.techniques import sparsify
from memfit.trace.pruning import pruned_tensors

PRUNED = (0.5, 0.9)
CSR_DENSITIES = (0.5, 0.3, 0.1, 0.05, 0.01)
BSR_DENSITIES = (0.5, 0.25, 0.1, 0.05, 0.01)
BLOCK = 16


def mlp(features: int, hidden: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, features))


def linears(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "in_features")]


def held_bytes(model: nn.Module) -> int:
    """The storages the layers' weights hold, each counted once, read from torch."""
    seen: dict[int, int] = {}
    for mod in linears(model):
        for key in ("weight", "weight_orig", "weight_mask"):
            t = getattr(mod, key, None)
            if not isinstance(t, torch.Tensor):
                continue
            parts = ((t.values(), t.crow_indices(), t.col_indices())
                     if t.layout in (torch.sparse_csr, torch.sparse_bsr) else (t,))
            for p in parts:
                st = p.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def block_prune(model: nn.Module, density: float) -> None:
    """Keep the ``density`` share of each weight's 16 x 16 blocks with the largest L1 norm."""
    for mod in linears(model):
        w = mod.weight.detach()
        rows, cols = w.shape
        norms = w.abs().reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK).sum(dim=(1, 3))
        keep = max(1, round(density * norms.numel()))
        top = torch.zeros(norms.numel())
        top[norms.flatten().topk(keep).indices] = 1
        mask = top.reshape(norms.shape).repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
        prune.custom_from_mask(mod, "weight", mask)


def forward_times(models: list[nn.Module], x: torch.Tensor, repeats: int
                  ) -> tuple[list[float], list[float]]:
    """Each model's median no-grad forward time, and the median of its per-round ratio to the
    first model's: the models take turns in each round, so a load change on a shared machine
    moves all of a round's times together."""
    rounds: list[list[float]] = []
    with torch.no_grad():
        for model in models:
            model(x)  # warm-up
        for _ in range(repeats):
            times = []
            for model in models:
                start = time.perf_counter()
                model(x)
                times.append(time.perf_counter() - start)
            rounds.append(times)
    medians = [statistics.median(r[i] for r in rounds) for i in range(len(models))]
    ratios = [statistics.median(r[i] / r[0] for r in rounds) for i in range(len(models))]
    return medians, ratios


def variants(features: int, hidden: int) -> list[tuple[str, float, nn.Module, int]]:
    """(kind, density, model, bytes memfit reports for its weights)."""
    out: list[tuple[str, float, nn.Module, int]] = []
    dense = mlp(features, hidden)
    out.append(("dense", 1.0, dense, sum(m.weight.nbytes for m in linears(dense))))
    for amount in PRUNED:
        model = mlp(features, hidden)
        for mod in linears(model):
            prune.l1_unstructured(mod, "weight", amount=amount)
        reported = sum(p.orig_bytes + p.extra_bytes for p in pruned_tensors(model))
        out.append(("pruned", 1 - amount, model, reported))
    for density in CSR_DENSITIES:
        model = mlp(features, hidden)
        for mod in linears(model):
            prune.l1_unstructured(mod, "weight", amount=1 - density)
        out.append(("csr", density, model, sparsify(model, format="csr").bytes_after))
    for density in BSR_DENSITIES:
        model = mlp(features, hidden)
        block_prune(model, density)
        report = sparsify(model, format="bsr", blocksize=(BLOCK, BLOCK))
        out.append(("bsr", density, model, report.bytes_after))
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--features", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    x = torch.randn(args.batch, args.features)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "sparse CSR support is in beta"
        found = variants(args.features, args.hidden)
        seconds, ratios = forward_times([v[2] for v in found], x, args.repeats)
    rows: list[dict[str, Any]] = []
    for (kind, density, model, reported), sec, ratio in zip(found, seconds, ratios, strict=True):
        rows.append({"kind": kind, "density": density, "held_bytes": held_bytes(model),
                     "reported_bytes": reported,
                     "layouts": [str(m.weight.layout).removeprefix("torch.")
                                 for m in linears(model)],
                     "forward_seconds": sec, "time_vs_dense": ratio})
    dense = rows[0]
    print(f"MLP {args.features}-{args.hidden}-{args.features} fp32, batch {args.batch}, CPU, "
          f"1 thread; weights {dense['held_bytes'] / 2**20:.2f} MiB dense")
    print(f"{'variant':8} {'density':>8} {'layout':>10} {'held MiB':>9} {'vs dense':>9} "
          f"{'reported MiB':>13} {'forward ms':>11} {'time vs dense':>14}")
    for r in rows:
        r["bytes_vs_dense"] = r["held_bytes"] / dense["held_bytes"]
        print(f"{r['kind']:8} {r['density']:8.0%} {r['layouts'][0]:>10} "
              f"{r['held_bytes'] / 2**20:9.2f} {r['bytes_vs_dense']:8.2f}x "
              f"{r['reported_bytes'] / 2**20:13.2f} {1000 * r['forward_seconds']:11.2f} "
              f"{r['time_vs_dense']:13.2f}x")
    out = args.out or Path(f"bench/results/pruning-cpu-{dt.date.today().isoformat()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "device": "cpu", "device_name": platform.processor() or platform.machine(),
        "torch": torch.__version__, "python": platform.python_version(), "threads": 1,
        "command": " ".join(["python", *sys.argv]) if argv is None
        else " ".join(["python", "bench/pruning.py", *argv]),
        "features": args.features, "hidden": args.hidden, "batch": args.batch,
        "repeats": args.repeats, "results": rows,
    }
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
