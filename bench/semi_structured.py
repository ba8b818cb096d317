"""2:4 semi-structured weights against dense ones: the bytes of llama-3-8b's projections, by
torch's backend layout, with the dense baseline in the same run.

    python bench/semi_structured.py [--model llama-3-8b] [--dtype bf16] [--quick] [--out PATH]

For each projection of one decoder block (q, k, v, o, gate, up, down):

- dense: the bf16 weight as torch stores it (``numel * element_size``, measured on a real
  tensor);
- CUTLASS: torch's own conversion (``sparse_semi_structured_from_dense_cutlass``, Python, it
  runs on CPU) of the magnitude-pruned weight: the bytes of its ``packed`` and ``meta`` tensors,
  measured, against :func:`memfit.semi_structured.compressed_bytes`;
- cuSPARSELt: ``_cslt_compress`` runs on CUDA only; where CUDA with compute capability 8.0+ is
  present, ``to_sparse_semi_structured`` of the weight is measured, else the row gives the
  cited formula alone (``numel * 9 / 16`` elements) and says so.

Then the whole model: the decoder's projections in all blocks, and ``memfit plan``'s weights
for inference without and with ``--sparsity 2:4`` (embeddings, head and norms stay dense).
``--quick`` converts each projection at 1/8 of its size per side (the bytes scale exactly).

Writes ``bench/results/semi-structured-<device>-<date>.json`` (or ``--out``) with the device,
torch version, command and every row.
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
from torch.sparse._semi_structured_conversions import sparse_semi_structured_from_dense_cutlass

import memfit
from memfit.analytic.config import RunConfig
from memfit.categories import MemoryCategory
from memfit.dtypes import torch_dtype
from memfit.models import resolve_model
from memfit.semi_structured import compressed_bytes
from memfit.techniques import mask_2_4


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _cuda_ok() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)


def measure(out_f: int, in_f: int, fmt: str) -> dict[str, Any]:
    """One weight: dense bytes, CUTLASS bytes measured on CPU, cuSPARSELt measured on CUDA
    (or None), and the predictions."""
    torch.manual_seed(0)
    dense = torch.randn(out_f, in_f).to(torch_dtype(fmt))
    dense = dense * mask_2_4(dense)
    packed, meta = sparse_semi_structured_from_dense_cutlass(dense)
    row: dict[str, Any] = {
        "shape": [out_f, in_f], "dense_bytes": _nbytes(dense),
        "cutlass_bytes": _nbytes(packed, meta),
        "cutlass_predicted_bytes": compressed_bytes(out_f, in_f, fmt, "cutlass").total,
        "cusparselt_predicted_bytes": compressed_bytes(out_f, in_f, fmt, "cusparselt").total,
        "cusparselt_bytes": None,
    }
    if _cuda_ok():
        from torch.sparse import SparseSemiStructuredTensorCUSPARSELT

        w = SparseSemiStructuredTensorCUSPARSELT.from_dense(dense.cuda())
        row["cusparselt_bytes"] = _nbytes(w.packed, w.meta)
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--quick", action="store_true", help="convert at 1/8 of each side")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    spec = resolve_model(args.model)
    scale = 8 if args.quick else 1
    print(f"{args.model}, {args.dtype}, one block's projections"
          f"{' at 1/8 per side (--quick)' if args.quick else ''}; MiB")
    print(f"{'proj':6} {'shape':>13} {'dense':>9} {'CUTLASS':>9} {'predicted':>9} "
          f"{'cuSPARSELt':>10} {'predicted':>9} {'saving':>7}")
    rows = []
    for s in spec.linear_shapes():
        r = measure(s.out_features // scale, s.in_features // scale, args.dtype)
        r.update(role=s.role, per_block=s.count)
        rows.append(r)
        measured_lt = ("n/a (CPU)" if r["cusparselt_bytes"] is None
                       else f"{r['cusparselt_bytes'] / 2**20:.2f}")
        print(f"{s.role:6} {tuple(r['shape'])!s:>13} {r['dense_bytes'] / 2**20:9.2f} "
              f"{r['cutlass_bytes'] / 2**20:9.2f} {r['cutlass_predicted_bytes'] / 2**20:9.2f} "
              f"{measured_lt:>10} {r['cusparselt_predicted_bytes'] / 2**20:9.2f} "
              f"{100 * (1 - r['cutlass_bytes'] / r['dense_bytes']):6.2f}%")
    blocks = spec.num_layers * scale * scale  # full-size bytes from the scaled rows
    proj_dense = blocks * sum(r["dense_bytes"] * r["per_block"] for r in rows)
    proj_sparse = blocks * sum(r["cutlass_bytes"] * r["per_block"] for r in rows)
    run = {"mode": "inference", "precision": args.dtype}
    plan_dense = memfit.plan(spec, RunConfig(**run)).breakdown[MemoryCategory.WEIGHTS]
    plan_sparse = memfit.plan(spec, RunConfig(**run, sparsity="2:4")).breakdown[
        MemoryCategory.WEIGHTS]
    print(f"all {spec.num_layers} blocks' projections: dense {proj_dense / 2**30:.2f} GiB, 2:4 "
          f"{proj_sparse / 2**30:.2f} GiB (measured CUTLASS layout)")
    print(f"memfit plan weights (inference): dense {plan_dense / 2**30:.2f} GiB, --sparsity 2:4 "
          f"{plan_sparse / 2**30:.2f} GiB ({100 * (1 - plan_sparse / plan_dense):.1f}% less; "
          "embeddings, head and norms stay dense)")
    device = "cuda" if _cuda_ok() else "cpu"
    out = args.out or Path(f"bench/results/semi-structured-{device}-"
                           f"{dt.date.today().isoformat()}.json")
    report = {
        "device": device,
        "device_name": (torch.cuda.get_device_name() if device == "cuda"
                        else platform.processor() or platform.machine()),
        "torch": torch.__version__, "python": platform.python_version(),
        "command": " ".join(["python", *sys.argv]) if argv is None
        else " ".join(["python", "bench/semi_structured.py", *argv]),
        "model": args.model, "dtype": args.dtype, "scale": scale, "rows": rows,
        "projections_dense_bytes": proj_dense, "projections_2_4_bytes": proj_sparse,
        "plan_weights_dense_bytes": plan_dense, "plan_weights_2_4_bytes": plan_sparse,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
