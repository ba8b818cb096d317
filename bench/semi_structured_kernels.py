"""Which 2:4 kernels run on this GPU and torch: a probe, one line each, written as JSON.

    python bench/semi_structured_kernels.py [--out PATH]

For a bf16 and an fp16 weight of 256 x 256 (2:4-pruned): torch's ``to_sparse_semi_structured``
with each backend (CUTLASS: ``SparseSemiStructuredTensor._FORCE_CUTLASS``; cuSPARSELt) and one
matmul with it; torchao's ``SemiSparseLinear`` forward and backward on a 2-D and a 3-D input;
and the same training forward with the packed tensors viewed as 2-D (as torch's own
``SparseSemiStructuredTensorCUSPARSELT.prune_dense_static_sort`` does since it was written that
way), to tell torch's kernels from torchao's construction. Each probe records "ok" or the
error's first line. Needs CUDA."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def _try(fn: Callable[[], Any]) -> str:
    try:
        fn()
        torch.cuda.synchronize()
        return "ok"
    except Exception as e:  # a probe records what broke
        return f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"


@contextlib.contextmanager
def _cutlass(force: bool) -> Any:
    from torch.sparse import SparseSemiStructuredTensor

    before = SparseSemiStructuredTensor._FORCE_CUTLASS
    SparseSemiStructuredTensor._FORCE_CUTLASS = force
    try:
        yield
    finally:
        SparseSemiStructuredTensor._FORCE_CUTLASS = before


def probes(dtype: torch.dtype) -> dict[str, str]:
    from torch.sparse import to_sparse_semi_structured

    torch.manual_seed(0)
    w = torch.randn(256, 256, device="cuda", dtype=dtype)
    keep = w.abs().view(-1, 4).argsort(dim=1)[:, 2:]
    mask = torch.zeros_like(w).view(-1, 4).scatter_(1, keep, 1).view_as(w).bool()
    w = w * mask
    x = torch.randn(64, 256, device="cuda", dtype=dtype)
    out: dict[str, str] = {}
    for name, force in (("cutlass", True), ("cusparselt", False)):
        with _cutlass(force):
            out[f"{name}: to_sparse_semi_structured"] = _try(lambda: to_sparse_semi_structured(w))
            out[f"{name}: linear"] = _try(
                lambda: torch.nn.functional.linear(x, to_sparse_semi_structured(w)))
    try:
        from torchao.sparsity.training import SemiSparseLinear
    except ImportError as e:
        out["torchao"] = f"ImportError: {e}"
        return out
    for shape in ((64, 256), (4, 16, 256)):
        def step(shape: tuple[int, ...] = shape) -> None:
            lin = SemiSparseLinear.from_dense(torch.nn.Linear(256, 256).to("cuda", dtype))
            xi = torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=True)
            lin(xi).float().square().mean().backward()
        out[f"torchao SemiSparseLinear fwd+bwd {list(shape)}"] = _try(step)

    def viewed() -> None:  # torch's own construction: the packed values viewed as 2-D
        from torch.sparse import SparseSemiStructuredTensorCUSPARSELT as Lt

        sw = Lt.prune_dense_static_sort(w)
        torch.nn.functional.linear(x, sw)
    out["torch prune_dense_static_sort + linear (cuSPARSELt)"] = _try(viewed)

    def tile_shapes() -> None:
        packed, meta, packed_t, meta_t, bitmask = torch._sparse_semi_structured_tile(
            w, algorithm="", use_cutlass=False)
        out["tile outputs (cuSPARSELt)"] = str([list(t.shape) if t is not None else None
                                               for t in (packed, meta, packed_t, meta_t,
                                                         bitmask)])
    out["tile"] = _try(tile_shapes)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/semi_structured_kernels.py needs a CUDA GPU", file=sys.stderr)
        return 2
    doc: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "capability": list(torch.cuda.get_device_capability()), "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "command": "python bench/semi_structured_kernels.py " + " ".join(argv or sys.argv[1:])}
    with contextlib.suppress(Exception):
        doc["cusparselt"] = torch.backends.cusparselt.version()
    with contextlib.suppress(ImportError):
        import torchao
        doc["torchao"] = torchao.__version__
    for dtype in (torch.bfloat16, torch.float16):
        doc[str(dtype)] = probes(dtype)
        for k, v in doc[str(dtype)].items():
            print(f"{dtype!s:15s} {k:55s} {v}")
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
