"""How much ``memfit.profile`` slows a CPU training step, with stacks off and on.

Run: ``python bench/profile_overhead.py [--configs gpt,small] [--pairs 12]``

For each model it times one training step (forward, backward, AdamW) plainly, inside a no-op
``TorchDispatchMode`` (the floor of any op-level instrumentation), and inside
``memfit.profile(device="cpu")`` with stacks off and on and with the allocator's events off
(the tensor ledger alone), in turn, ``--pairs`` times. Time is
process CPU time with one intra-op thread by default (steady on a shared machine); each slowdown
is the median over pairs of the variant's step over the plain step just before it. The
profile's one-off costs (the gc scan at entry, building the result at exit) are timed apart: they
are paid once per ``with`` block, not per step. Writes
``bench/results/profile-overhead-cpu-<date>.json`` with the torch version and the command.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.profiling.session import profile

CONFIGS = {
    # A GPT-2-small-width stack of pre-norm transformer blocks, 4 layers, 8 x 128 tokens.
    "gpt": dict(dim=768, layers=4, heads=12, batch=8, seq=128),
    # A deliberately small model (short kernels): the per-op cost shows most here.
    "small": dict(dim=128, layers=2, heads=4, batch=4, seq=64),
}


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


def build(cfg: dict[str, int]) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(cfg["dim"], cfg["heads"]) for _ in range(cfg["layers"])])
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(cfg["batch"], cfg["seq"], cfg["dim"])
    return model, opt, x


def step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()


def timed_steps(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
                n: int) -> list[float]:
    # Note: [CPU time] process CPU time, not wall time: on a shared machine other processes
    # inflate wall time by tens of percent, which would swamp the overhead being measured.
    times = []
    for _ in range(n):
        t0 = time.process_time()
        step(model, opt, x)
        times.append(time.process_time() - t0)
    return times


class _BareMode(TorchDispatchMode):
    """A dispatch mode that does nothing: the floor any op-level instrumentation pays."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def one_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
             ctx: Any) -> tuple[float, int]:
    """CPU seconds of one step run inside ``ctx`` (its enter/exit not timed), and its ops."""
    with ctx:
        t0 = time.process_time()
        step(model, opt, x)
        elapsed = time.process_time() - t0
    result = getattr(ctx, "result", None)
    return elapsed, (result.num_ops if result is not None else 0)


def measure(name: str, cfg: dict[str, int], pairs: int) -> dict[str, object]:
    model, opt, x = build(cfg)
    timed_steps(model, opt, x, 3)  # warm up: allocator, oneDNN primitives, Adam state
    variants = {"plain": lambda: contextlib.nullcontext(), "bare_mode": _BareMode,
                "profiled": lambda: profile(device="cpu"),
                # Tensor ledger only: what the default (the allocator's events too) adds.
                "profiled_ledger_only": lambda: profile(device="cpu", allocator_events=False),
                "profiled_stacks": lambda: profile(device="cpu", stacks=True)}
    times: dict[str, list[float]] = {k: [] for k in variants}
    ops = 0
    enter_exit: list[float] = []
    # Note: [paired samples] the variants run one step each, in turn, `pairs` times; each
    # slowdown is the median over pairs of (variant step / the plain step just before it), so
    # slow drift of a shared machine cancels.
    for _ in range(pairs):
        for key, make in variants.items():
            t0 = time.process_time()
            elapsed, n = one_step(model, opt, x, make())
            if key == "profiled":
                ops = n
                enter_exit.append(time.process_time() - t0 - elapsed)
            times[key].append(elapsed)
    plain = times["plain"]

    def slowdown(key: str) -> float:
        ratios = [v / p for v, p in zip(times[key], plain, strict=True)]
        return round(100 * (statistics.median(ratios) - 1), 2)

    return {
        "config": name, **cfg,
        "params": sum(p.numel() for p in model.parameters()),
        "ops_per_step": ops,
        "metric": "process CPU time per step; slowdown = median of paired ratios",
        "step_ms_plain": round(1000 * statistics.median(plain), 3),
        "step_ms_bare_mode": round(1000 * statistics.median(times["bare_mode"]), 3),
        "step_ms_profiled": round(1000 * statistics.median(times["profiled"]), 3),
        "step_ms_profiled_stacks": round(1000 * statistics.median(times["profiled_stacks"]), 3),
        "slowdown_pct_bare_mode": slowdown("bare_mode"),
        "slowdown_pct": slowdown("profiled"),
        "slowdown_pct_stacks": slowdown("profiled_stacks"),
        "slowdown_pct_ledger_only": slowdown("profiled_ledger_only"),
        "overhead_us_per_op": round(1e6 * (statistics.median(times["profiled"])
                                           - statistics.median(plain)) / max(ops, 1), 1),
        "enter_exit_ms": round(1000 * statistics.median(enter_exit), 2),
        "pairs": pairs,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="gpt,small")
    parser.add_argument("--pairs", type=int, default=12,
                        help="steps per variant, run in turn (default 12)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: steadiest CPU time)")
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/...)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for name in args.configs.split(","):
        if name not in CONFIGS:
            parser.error(f"unknown config {name!r}; valid: {', '.join(CONFIGS)}")
        rows.append(measure(name, CONFIGS[name], args.pairs))
    print(f"CPU time per training step (AdamW), {torch.get_num_threads()} thread(s); slowdown "
          "vs the plain step run just before (median of pairs)")
    header = (f"{'config':8} {'params':>10} {'ops/step':>9} {'plain ms':>9} {'bare mode':>10} "
              f"{'profiled':>9} {'+stacks':>9} {'ledger':>9} {'us/op':>6} {'enter+exit ms':>14}")
    print(header)
    for r in rows:
        print(f"{r['config']:8} {r['params']:>10,} {r['ops_per_step']:>9} "
              f"{r['step_ms_plain']:>9.2f} {r['slowdown_pct_bare_mode']:>+9.1f}% "
              f"{r['slowdown_pct']:>+8.1f}% {r['slowdown_pct_stacks']:>+8.1f}% "
              f"{r['slowdown_pct_ledger_only']:>+8.1f}% "
              f"{r['overhead_us_per_op']:>6.1f} {r['enter_exit_ms']:>14.1f}")
    date = datetime.date.today().isoformat()
    out = Path(args.out) if args.out else (
        Path(__file__).parent / "results" / f"profile-overhead-cpu-{date}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"date": date, "torch": torch.__version__, "python": platform.python_version(),
           "machine": platform.machine(), "cpu_threads": torch.get_num_threads(),
           "command": " ".join([sys.executable, *sys.argv]), "results": rows}
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
