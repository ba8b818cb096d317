"""What is alive at a real CUDA step's peak, beside memfit's trace of the same step.

    python bench/cuda_peak_anatomy.py CONFIG [CONFIG ...] [--out PATH]

CONFIG is a ``memfit validate`` config name (``llama/fp32/sgd-momentum/ckpt-full/b8``; the
``medium`` zoo). For each, the real run (``memfit.validate``'s own steps) runs under
``torch.cuda.memory._record_memory_history``; the allocator's trace is replayed (``alloc`` adds
a block, ``free_requested`` removes it: when ``torch.cuda.memory_allocated`` drops) to the
moment of the peak, and the blocks alive then are grouped by the Python frames that allocated
them. The trace engine's estimate of the same config is printed beside it (its peak op and
categories). This is the tool for finding why a validate config is off; it needs a GPU.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path
from typing import Any

import torch

from memfit import validate as V
from memfit.trace import estimate

KEEP = ("memfit/", "torch/optim", "torch/distributed", "torch/amp", "torch/nn/modules",
        "torch/utils/checkpoint", "torch/autograd", "torch/nn/functional", "torch/_tensor",
        "bench/")


def _where(frames: list[dict[str, Any]]) -> str:
    picked = [f"{f['filename'].split('site-packages/')[-1]}:{f['line']}:{f['name']}"
              for f in frames if any(k in f["filename"] for k in KEEP)]
    return " < ".join(picked[:4]) or "(no python frame)"


def _config(name: str) -> V.Config:
    for c in V.matrix("medium"):
        if c.name == name:
            return c
    raise SystemExit(f"unknown config {name!r}; see memfit.validate.matrix('medium')")


def replay_peak(events: list[dict[str, Any]]) -> tuple[int, list[tuple[str, list[int]]], int]:
    """Replay the allocator's events to their peak: the peak's bytes, the blocks alive then
    grouped by the frames that allocated them (largest 25: where, [bytes, blocks]), and the
    index of the event at the peak."""
    live: dict[int, tuple[int, str, int]] = {}
    now = peak = peak_at = 0
    peak_live: dict[int, tuple[int, str, int]] = {}
    for i, ev in enumerate(events):
        if ev["action"] == "alloc":
            live[ev["addr"]] = (ev["size"], _where(ev.get("frames", [])), i)
            now += ev["size"]
            if now > peak:
                peak, peak_live, peak_at = now, dict(live), i
        elif ev["action"] == "free_requested" and ev["addr"] in live:
            now -= live.pop(ev["addr"])[0]
    groups: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for size, where, _ in peak_live.values():
        groups[where][0] += size
        groups[where][1] += 1
    return peak, sorted(groups.items(), key=lambda kv: -kv[1][0])[:25], peak_at


def anatomy(name: str) -> dict[str, Any]:
    config = _config(name)
    factory = V.zoo("medium")[config.family](config.batch)
    V._reset_cuda()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    measured, _, _ = V._measure(config, factory, "cuda", 2)
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    events = snap["device_traces"][torch.cuda.current_device()]
    peak, top, peak_at = replay_peak(events)
    last = events[peak_at]
    torch.manual_seed(0)
    meta_model, meta_inputs, meta_loss = factory("meta")
    est = estimate(meta_model, meta_inputs, optimizer=V._techniques(meta_model, config),
                   precision=config.precision, loss_fn=lambda m, b: meta_loss(m(*b)),
                   device="cuda", gpu="h100-sxm-80gb", steps=2, keep_output=True)
    return {
        "config": name, "measured_max_allocated": measured, "replayed_peak": peak,
        "events": len(events), "peak_event_index": peak_at,
        "allocation_at_peak": {"size": last["size"], "where": _where(last.get("frames", []))},
        "alive_at_peak": [{"where": w, "bytes": b, "blocks": n} for w, (b, n) in top],
        "predicted_peak": est.peak_bytes,
        "predicted_peak_at": (f"{est.peak_op} ({est.peak_phase}, step {est.peak_step}, "
                              f"{est.peak_module})"),
        "predicted_phase_peaks": {f"{s}/{p}": b for (s, p), b in est.phase_peaks.items()},
        "predicted_breakdown": {str(k.value): v for k, v in est.breakdown.items()},
    }


def big_ops(name: str, min_bytes: int = 64 << 20) -> dict[str, Any]:
    """The aten ops of the real run whose outputs are ``min_bytes`` or more (what made the big
    blocks the allocator trace shows without a Python frame), and which attention ops ran."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    seen: collections.Counter[str] = collections.Counter()
    attention: collections.Counter[str] = collections.Counter()

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            op = str(func)
            if "attention" in op or "softmax" in op or "dropout" in op:
                attention[op] += 1
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.numel() * t.element_size() >= min_bytes:
                    seen[f"{op} -> {tuple(t.shape)} {t.dtype}"] += 1
            return out

    config = _config(name)
    factory = V.zoo("medium")[config.family](config.batch)
    V._reset_cuda()
    with Log():
        measured, _, _ = V._measure(config, factory, "cuda", 2)
    return {"config": name, "measured": measured, "big_outputs": dict(seen.most_common(40)),
            "attention_ops": dict(attention)}


def without_cudnn(name: str) -> dict[str, Any]:
    """The real run with cuDNN off (``torch.backends.cudnn.flags(enabled=False)``): if the gap
    to the trace closes, it was cuDNN's workspace."""
    config = _config(name)
    factory = V.zoo("medium")[config.family](config.batch)
    V._reset_cuda()
    with torch.backends.cudnn.flags(enabled=False):
        measured, reserved, _ = V._measure(config, factory, "cuda", 2)
    return {"config": name, "cudnn": False, "measured": measured, "reserved": reserved}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", nargs="+")
    ap.add_argument("--out", type=Path, default=Path("cuda-peak-anatomy.json"))
    ap.add_argument("--ops", action="store_true",
                    help="log the ops with large outputs and the attention ops instead")
    ap.add_argument("--no-cudnn", action="store_true", help="measure with cuDNN off instead")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("cuda_peak_anatomy: needs a CUDA device", file=sys.stderr)
        return 2
    results = []
    for name in args.configs:
        if args.ops or args.no_cudnn:
            try:
                r = big_ops(name) if args.ops else without_cudnn(name)
            except Exception as exc:
                r = {"config": name, "error": f"{type(exc).__name__}: {exc}"}
            results.append(r)
            print(json.dumps(r, indent=1))
            args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                            "torch": torch.__version__, "results": results},
                                           indent=1) + "\n")
            continue
        try:
            r = anatomy(name)
        except Exception as exc:  # one config's failure must not lose the others
            print(f"== {name}: {type(exc).__name__}: {exc}")
            continue
        results.append(r)
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                        "torch": torch.__version__, "results": results},
                                       indent=1) + "\n")
        mib = 1 << 20
        print(f"== {name}: measured {r['measured_max_allocated'] / mib:.1f} MiB (replayed "
              f"{r['replayed_peak'] / mib:.1f}), predicted {r['predicted_peak'] / mib:.1f} MiB")
        print(f"   peak reached by {r['allocation_at_peak']['size'] / mib:.1f} MiB at "
              f"{r['allocation_at_peak']['where']}")
        for g in r["alive_at_peak"][:12]:
            print(f"   {g['bytes'] / mib:9.1f} MiB {g['blocks']:5d}  {g['where']}")
        print(f"   predicted peak at {r['predicted_peak_at']}; by category (MiB): "
              + ", ".join(f"{k} {v / mib:.1f}" for k, v in r["predicted_breakdown"].items()
                          if v))
    return 0


if __name__ == "__main__":
    sys.exit(main())
