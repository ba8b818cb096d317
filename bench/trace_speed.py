"""How long memfit's trace engine takes on Llama-2-7B- and 70B-sized steps, next to MemTracker.

Run: ``python bench/trace_speed.py [--sizes 7b,70b] [--steps 2]``

Builds a plain-torch Llama-like model (RMSNorm, RoPE, grouped-query SDPA attention, SwiGLU MLP) on
the meta device, then times ``memfit.trace.estimate`` (bf16-mixed, AdamW, batch 1, seq 4096,
CUDA target) and PyTorch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``) running the
same training step on the same meta model in this process (fp32: the meta device has no autocast).
Prints the times (wall and process CPU: other processes on a shared machine inflate wall time),
the ratio and the peak RSS, and writes
``bench/results/trace-speed-cpu-<date>.json`` with the torch version and the command.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

SIZES = {  # Llama 2 (Touvron et al. 2023, table 1 / HF configs)
    "7b": dict(dim=4096, layers=32, heads=32, kv_heads=32, ffn=11008, vocab=32000),
    "70b": dict(dim=8192, layers=80, heads=64, kv_heads=8, ffn=28672, vocab=32000),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
        return self.weight * h.to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


class Layer(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, ffn: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.attn_norm, self.mlp_norm = RMSNorm(dim), RMSNorm(dim)
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.v = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.gate = nn.Linear(dim, ffn, bias=False)
        self.up = nn.Linear(dim, ffn, bias=False)
        self.down = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.attn_norm(x)
        q = self.q(h).view(b, s, self.heads, self.hd).transpose(1, 2)
        k = self.k(h).view(b, s, self.kv_heads, self.hd).transpose(1, 2)
        v = self.v(h).view(b, s, self.kv_heads, self.hd).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        if self.kv_heads != self.heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self, dim: int, layers: int, heads: int, kv_heads: int, ffn: int,
                 vocab: int) -> None:
        super().__init__()
        self.hd = dim // heads
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Layer(dim, heads, kv_heads, ffn) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        s = idx.shape[1]
        inv = 1.0 / (10000 ** (torch.arange(0, self.hd, 2, device=idx.device).float() / self.hd))
        freqs = torch.outer(torch.arange(s, device=idx.device).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        x = self.emb(idx)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), idx.view(-1))


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def time_memfit(model: nn.Module, idx: torch.Tensor, steps: int) -> dict[str, object]:
    from memfit.trace import estimate

    start, cpu_start = time.perf_counter(), time.process_time()
    est = estimate(model, (idx,), optimizer="adamw", precision="bf16-mixed", device="cuda",
                   gpu="h100-sxm-80gb", steps=steps)
    seconds = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu_start
    return {"seconds": round(seconds, 3), "cpu_seconds": round(cpu_seconds, 3),
            "seconds_per_step": round(seconds / steps, 3), "ops": est.num_ops,
            "peak_bytes": est.peak_bytes,
            "peak_reserved_bytes": est.peak_reserved_bytes,
            "peak_at": f"{est.peak_op} ({est.peak_phase}, step {est.peak_step})",
            "rss_mib_after": round(rss_mib(), 1)}


def time_memtracker(model: nn.Module, idx: torch.Tensor, steps: int) -> dict[str, object]:
    try:
        from torch.distributed._tools.mem_tracker import MemTracker
    except ImportError as exc:  # torch built without distributed
        return {"error": f"MemTracker unavailable: {exc}"}
    start, cpu_start = time.perf_counter(), time.process_time()
    try:
        opt = torch.optim.AdamW(model.parameters(), foreach=True)
        tracker = MemTracker()
        tracker.track_external(model, opt)
        with tracker:
            for step in range(steps):
                if step:
                    tracker.reset_mod_stats()  # MemTracker refuses a second iteration otherwise
                loss = model(idx)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                del loss
        peak = tracker.get_tracker_snapshot("peak")
        total = sum(d.get("Total", 0) for d in peak.values())
    except Exception as exc:  # report, do not hide: the ratio needs both numbers
        return {"error": f"{type(exc).__name__}: {exc}",
                "seconds": round(time.perf_counter() - start, 3)}
    return {"seconds": round(time.perf_counter() - start, 3),
            "cpu_seconds": round(time.process_time() - cpu_start, 3), "peak_bytes": total,
            "rss_mib_after": round(rss_mib(), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="7b,70b")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--no-memtracker", action="store_true")
    args = parser.parse_args()
    results: dict[str, object] = {
        "torch": torch.__version__, "python": platform.python_version(),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "command": " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "load_average_at_start": list(os.getloadavg()),
        "config": {"precision": "bf16-mixed", "optimizer": "adamw", "batch": 1, "seq": args.seq,
                   "steps": args.steps, "device": "cuda (modelled)"},
        "models": {},
    }
    # Warm up once on a tiny model: the first trace in a process pays one-off imports and
    # fake-tensor setup that a 7B number should not include.
    with torch.device("meta"):
        tiny = Llama(dim=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=256)
    time_memfit(tiny, torch.zeros(1, 16, dtype=torch.long, device="meta"), 1)
    for size in args.sizes.split(","):
        with torch.device("meta"):
            model = Llama(**SIZES[size])
        idx = torch.zeros(1, args.seq, dtype=torch.long, device="meta")
        n = sum(p.numel() for p in model.parameters())
        row: dict[str, object] = {"params": n, "memfit": time_memfit(model, idx, args.steps)}
        if not args.no_memtracker:
            row["memtracker"] = time_memtracker(model, idx, args.steps)
            mt = row["memtracker"]
            if isinstance(mt, dict) and "seconds" in mt:
                row["memtracker_over_memfit"] = round(
                    float(mt["seconds"]) / float(row["memfit"]["seconds"]), 2)  # type: ignore[index]
        results["models"][size] = row  # type: ignore[index]
        del model
        print(f"{size}: {n / 1e9:.2f}B params  memfit {row['memfit']}  "
              f"memtracker {row.get('memtracker')}", flush=True)
    results["peak_rss_mib"] = round(rss_mib(), 1)
    print(f"peak RSS {results['peak_rss_mib']} MiB")
    out = Path(__file__).parent / "results" / (
        f"trace-speed-cpu-{datetime.date.today().isoformat()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
