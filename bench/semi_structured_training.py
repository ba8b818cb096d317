"""2:4 training (torchao's SemiSparseLinear) against the dense baseline, in the same run: memory
and step time of a stack of llama-3-8b MLP projections.

    python bench/semi_structured_training.py [--layers 2] [--tokens 8192] [--dtype bf16]
                                             [--quick] [--out PATH]

The model: ``layers`` x (up ``[14336, 4096]``, ReLU, down ``[4096, 14336]``), its input a hidden
state that needs a gradient (as inside a transformer), trained with AdamW. On CUDA (compute
capability 8.0+, cuSPARSELt, torchao) it runs three steps of each, dense first, swapped second
(``apply_semi_structured_sparsity(mode="training")``), and measures the third:

- ``held_after_forward``: ``torch.cuda.memory_allocated`` after the forward, minus before;
- ``peak``: ``max_memory_allocated`` over forward, backward and the optimizer step, minus before;
- ``step_ms``: the median of ``--repeats`` timed steps (CUDA events).

The prediction is :func:`memfit.semi_structured.training_bytes` of every swapped layer: what the
swapped model holds after the forward beyond the dense one. Without such a GPU it writes the
predictions alone and says so. ``--quick`` divides each side by 8.

Writes ``bench/results/semi-structured-training-<device>-<date>.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memfit.dtypes import torch_dtype
from memfit.semi_structured import training_bytes
from memfit.techniques import apply_semi_structured_sparsity

HIDDEN, MLP = 4096, 14336  # llama-3-8b


def _why_not_cuda() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    if torch.cuda.get_device_capability() < (8, 0):
        return "compute capability below 8.0"
    from torch.backends import cusparselt

    if not cusparselt.is_available():
        return "torch without cuSPARSELt"
    try:
        import torchao.sparsity.training  # noqa: F401
    except ImportError:
        return "torchao is not installed"
    return None


def build(layers: int, hidden: int, mlp: int) -> nn.Sequential:
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(hidden, mlp, bias=False), nn.ReLU(), nn.Linear(mlp, hidden, bias=False)]
    return nn.Sequential(*mods)


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> dict[str, Any]:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    loss = model(x).float().square().mean()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    end.record()
    torch.cuda.synchronize()
    return {"held_after_forward": held, "peak": torch.cuda.max_memory_allocated() - base,
            "step_ms": start.elapsed_time(end)}


def measure(model: nn.Module, x: torch.Tensor, repeats: int) -> dict[str, Any]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    for _ in range(3):  # the optimizer's states, cuBLAS/cuSPARSELt handles and workspaces
        warm = _step(model, opt, x)
    times = [_step(model, opt, x)["step_ms"] for _ in range(repeats)]
    return {**warm, "step_ms": statistics.median(times)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="each side / 8")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    scale = 8 if args.quick else 1
    hidden, mlp, tokens = HIDDEN // scale, MLP // scale, args.tokens // scale
    shapes = [(mlp, hidden), (hidden, mlp)] * args.layers
    predicted = [training_bytes(o, i, args.dtype).total for o, i in shapes]
    why_not = _why_not_cuda()
    report: dict[str, Any] = {
        "device": "cpu" if why_not else "cuda",
        "device_name": (platform.processor() or platform.machine() if why_not
                        else torch.cuda.get_device_name()),
        "torch": torch.__version__, "python": platform.python_version(),
        "command": " ".join(["python", *sys.argv]) if argv is None
        else " ".join(["python", "bench/semi_structured_training.py", *argv]),
        "dtype": args.dtype, "layers": args.layers, "tokens": tokens,
        "shapes": [list(s) for s in shapes],
        "dense_weight_bytes": sum(o * i * 2 for o, i in shapes),
        "predicted_extra_held_bytes": sum(predicted), "predicted_per_layer": predicted,
        "dense": None, "semi_sparse": None, "not_measured": why_not,
    }
    print(f"{args.layers} x (up [{mlp}, {hidden}], down [{hidden}, {mlp}]), {args.dtype}, "
          f"{tokens} tokens; 2:4 training adds {sum(predicted) / 2**20:.2f} MiB per forward "
          f"(predicted), on {report['dense_weight_bytes'] / 2**20:.2f} MiB of dense weights")
    if why_not is None:
        torch.manual_seed(0)
        dense = build(args.layers, hidden, mlp).to("cuda", torch_dtype(args.dtype))
        sparse = copy.deepcopy(dense)
        applied = apply_semi_structured_sparsity(sparse, mode="training")
        assert applied.training_bytes == sum(predicted), applied
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch_dtype(args.dtype),
                        requires_grad=True)
        report["dense"] = measure(dense, x, args.repeats)
        report["semi_sparse"] = measure(sparse, x, args.repeats)
        d, s = report["dense"], report["semi_sparse"]
        held = s["held_after_forward"] - d["held_after_forward"]
        report["measured_extra_held_bytes"] = held
        report["measured_extra_peak_bytes"] = s["peak"] - d["peak"]
        print(f"{'':12} {'held (MiB)':>11} {'peak (MiB)':>11} {'step (ms)':>10}")
        for name, r in (("dense", d), ("2:4 train", s)):
            print(f"{name:12} {r['held_after_forward'] / 2**20:11.2f} {r['peak'] / 2**20:11.2f} "
                  f"{r['step_ms']:10.2f}")
        print(f"extra held after forward: measured {held / 2**20:.2f} MiB, predicted "
              f"{sum(predicted) / 2**20:.2f} MiB; step time {s['step_ms'] / d['step_ms']:.2f}x "
              "dense")
    else:
        print(f"not measured: {why_not} (needs CUDA, compute capability 8.0+, cuSPARSELt and "
              "torchao)")
    out = args.out or Path(f"bench/results/semi-structured-training-{report['device']}-"
                           f"{dt.date.today().isoformat()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
