"""How long memfit's trace engine takes on Llama-2-7B- and 70B-sized steps, next to MemTracker.

Run: ``python bench/trace_speed.py [--sizes 1b,7b,70b,hf-7b,hf-70b] [--targets cuda,cpu]
[--steps 2]``

Two kinds of model, both built on the meta device:
- ``1b``, ``7b``, ``70b``: a plain-torch Llama-like model (RMSNorm, RoPE, grouped-query SDPA
  attention, SwiGLU MLP), traced bf16-mixed at seq 4096 (``--seq``);
- ``hf-7b``, ``hf-70b``: Hugging Face ``LlamaForCausalLM`` with Llama-2-7B's and Llama-3-70B's
  configs, traced fp32 at seq 1024 with ``labels`` (the model's own loss): issue 13's rows.
Each times ``memfit.estimate`` (AdamW, batch 1) for each target and PyTorch's ``MemTracker``
(``torch.distributed._tools.mem_tracker``) running the same training step on the same meta model
in this process (fp32: the meta device has no autocast; MemTracker has no notion of a target, so
one MemTracker run is the baseline of both targets).

A CPU target also measures the scratch of opaque CPU kernels by running them once on real zeros
(``memfit/trace/cpu_kernels.py``), cached on disk (``memfit/trace/kernel_cache.py``). Its row is
timed twice: ``cold`` with an empty cache directory (the first run on a machine) and ``warm``
with the process's memory cleared but the file kept (every later run).

Prints the times (wall and process CPU: other processes on a shared machine inflate wall time),
the ratio to MemTracker (memfit / MemTracker, CPU time) and the peak RSS, and writes
``bench/results/trace-speed-cpu-<date>.json`` with the torch version and the command.
``--repeat N`` (default 3) runs MemTracker and each CUDA-target trace N times and reports the
run with the median CPU time (every run's in ``cpu_seconds_all``); before each CUDA-target run
the fake mode's dispatch cache and memfit's fast-key plans are emptied, so every run is a first
trace of that shape (a single run of the 1B trace varied by 0.36-0.48 s on this machine).

Profile before block replay (1b, CUDA target, 2 steps, torch 2.13 CPU build, a shared 2-core
machine; cProfile and a SIGPROF stack sampler, 2026-11-24): 9165 ops, about 80 us each once warm
(0.75 s CPU). Backward about 45% (autograd's C++ engine, which also asks ``prim.device`` of a
fake tensor 12,000 times, each a Python call), forward 30%, AdamW 15%. Per op: the fake kernel's
cache key and cached output about 40%, the ledger (``tracker.track``, allocator model) about 20%,
the two torch-function modes (autocast lists, SDPA routing) about 5%, dynamo's disable wrapper
around every ``__torch_dispatch__`` call (three per op) about 5% (now skipped where it does
nothing: ``trace/tracker.py``, Note: [dynamo's disable wrapper]). What was left per op was spread
thin, so the next factor was doing fewer ops: identical blocks are replayed
(``trace/blocks.py``, Note: [replaying identical blocks]).

Profile after (the same trace as a process's first, wall clock per phase, 2026-11-24): 0.36-0.43
s in all. Forward 0.09-0.11 s (the four blocks that run: 0.053 s, the 28 replayed: 0.012 s, the
embedding, rotary tables, head and loss: 0.026 s), backward 0.12-0.14 s, AdamW 0.08-0.10 s
(its first step makes two ``zeros_like`` states and one ``torch.tensor`` step per parameter: 442
ops, 25 ms), the fake model's copy 0.022 s, the result (timeline of 9165 points, replay at the
peak) 0.024 s. A first trace also misses the fake cache once per distinct op signature (about
370 misses, 0.1 s: the cold-to-warm difference). Seen and cut on the way: the replay's own tensor
calls passed through the trace's torch-function modes (``.grad``, making fake tensors), AdamW's
``.item()`` of its step counters took the fake mode's full path (``_dispatch_impl`` with
constant propagation: 588 calls, 0.1 s), ``_register_baseline`` walked every fake parameter's
attributes (13,230 calls), and the optimizer step passed two Python modes per op that never act
there.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

SIZES = {  # Llama 2 (Touvron et al. 2023, table 1 / HF configs); 1b: Llama 3.2 1B's config.json
    "1b": dict(dim=2048, layers=16, heads=32, kv_heads=8, ffn=8192, vocab=128256),
    "7b": dict(dim=4096, layers=32, heads=32, kv_heads=32, ffn=11008, vocab=32000),
    "70b": dict(dim=8192, layers=80, heads=64, kv_heads=8, ffn=28672, vocab=32000),
}
# Hugging Face configs: meta-llama/Llama-2-7b-hf and meta-llama/Meta-Llama-3-70B config.json.
HF_SIZES = {
    "hf-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                  max_position_embeddings=4096, rms_norm_eps=1e-5),
    "hf-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                   num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                   max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0),
}
HF_SEQ, HF_PRECISION = 1024, "fp32"


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


def build(size: str, seq: int) -> tuple[nn.Module, object, str]:
    """The meta model of ``size``, its inputs and the precision it is traced in."""
    if size in HF_SIZES:
        from transformers import LlamaConfig, LlamaForCausalLM

        with torch.device("meta"):
            model = LlamaForCausalLM(LlamaConfig(**HF_SIZES[size]))
        ids = torch.zeros(1, HF_SEQ, dtype=torch.long, device="meta")
        return model, {"input_ids": ids, "labels": ids}, HF_PRECISION
    with torch.device("meta"):
        model = Llama(**SIZES[size])
    return model, torch.zeros(1, seq, dtype=torch.long, device="meta"), "bf16-mixed"


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def time_memfit(model: nn.Module, idx: object, steps: int,
                target: str = "cuda", precision: str = "bf16-mixed") -> dict[str, object]:
    import memfit

    gpu = {"gpu": "h100-sxm-80gb"} if target == "cuda" else {}
    inputs = idx if isinstance(idx, dict) else (idx,)
    start, cpu_start = time.perf_counter(), time.process_time()
    est = memfit.estimate(model, inputs, optimizer="adamw", precision=precision, device=target,
                          steps=steps, **gpu)
    seconds = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu_start
    return {"seconds": round(seconds, 3), "cpu_seconds": round(cpu_seconds, 3),
            "seconds_per_step": round(seconds / steps, 3), "ops": est.num_ops,
            "peak_bytes": est.peak_bytes,
            "peak_reserved_bytes": est.peak_reserved_bytes,
            "peak_at": f"{est.peak_op} ({est.peak_phase}, step {est.peak_step})",
            "rss_mib_after": round(rss_mib(), 1)}


def clear_trace_caches() -> None:
    """Empty the caches a first trace fills (the fake mode's dispatch cache, memfit's fast-key
    plans), so that a repeated trace is a first one again (``--repeat``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memfit.trace import fastkey

    FakeTensorMode.cache_clear()
    fastkey._PLANS.clear()
    fastkey._TEMPLATES.clear()


def repeated(run: object, repeat: int, cold: bool) -> dict[str, object]:
    """``run()`` ``repeat`` times (with the caches cleared before each when ``cold``): the
    run with the median CPU time, with every run's CPU seconds in ``cpu_seconds_all``."""
    runs = []
    for _ in range(repeat):
        if cold:
            clear_trace_caches()
        runs.append(run())  # type: ignore[operator]
    ok = [r for r in runs if "cpu_seconds" in r]
    if not ok:
        return runs[0]
    ok.sort(key=lambda r: float(r["cpu_seconds"]))
    median = dict(ok[len(ok) // 2])
    if repeat > 1:
        median["cpu_seconds_all"] = [r["cpu_seconds"] for r in runs if "cpu_seconds" in r]
    return median


def time_memtracker(model: nn.Module, idx: object, steps: int) -> dict[str, object]:
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
                loss = model(**idx).loss if isinstance(idx, dict) else model(idx)
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


def time_cpu_target(model: nn.Module, idx: object, steps: int,
                    precision: str = "bf16-mixed") -> dict[str, object]:
    """The CPU-target trace with an empty kernel cache, then with the file the first run left."""
    from memfit.trace import cpu_kernels

    saved = os.environ.get("MEMFIT_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="memfit-bench-cache-") as cache:
        os.environ["MEMFIT_CACHE_DIR"] = cache
        try:
            cpu_kernels.clear_memory_cache()
            cold = time_memfit(model, idx, steps, "cpu", precision)
            cpu_kernels.clear_memory_cache()  # as a new process would start
            warm = time_memfit(model, idx, steps, "cpu", precision)
            cold["kernels_cached"] = sum(
                len(json.loads(p.read_text())["entries"]) for p in Path(cache).glob("*.json"))
        finally:
            cpu_kernels.clear_memory_cache()
            if saved is None:
                os.environ.pop("MEMFIT_CACHE_DIR", None)
            else:
                os.environ["MEMFIT_CACHE_DIR"] = saved
    if warm["peak_bytes"] != cold["peak_bytes"]:  # the cache must not change the answer
        warm["error"] = "warm-cache peak differs from the cold one"
    return {"cold": cold, "warm": warm}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1b,7b,70b,hf-7b,hf-70b")
    parser.add_argument("--targets", default="cuda,cpu")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--no-memtracker", action="store_true")
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs of MemTracker and of each CUDA-target trace (each a first "
                        "trace: the fake caches emptied before it); the median is reported")
    parser.add_argument("--out", help="the JSON file to write (default: "
                        "bench/results/trace-speed-cpu-<date>.json)")
    args = parser.parse_args()
    results: dict[str, object] = {
        "torch": torch.__version__, "python": platform.python_version(),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "command": " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "load_average_at_start": list(os.getloadavg()),
        "config": {"precision": "bf16-mixed", "optimizer": "adamw", "batch": 1, "seq": args.seq,
                   "hf": {"precision": HF_PRECISION, "seq": HF_SEQ, "loss": "labels"},
                   "steps": args.steps, "targets": args.targets, "repeat": args.repeat,
                   "cpu": torch.backends.cpu.get_cpu_capability()},
        "models": {},
    }
    # Warm up once on a tiny model: the first trace in a process pays one-off imports and
    # fake-tensor setup that a 7B number should not include.
    with torch.device("meta"):
        tiny = Llama(dim=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=256)
    time_memfit(tiny, torch.zeros(1, 16, dtype=torch.long, device="meta"), 1)
    if "cpu" in args.targets:  # and the profiler's one-off start (kineto's init), uncached
        os.environ["MEMFIT_NO_CACHE"], saved = "1", os.environ.get("MEMFIT_NO_CACHE")
        time_memfit(tiny, torch.zeros(1, 16, dtype=torch.long, device="meta"), 1, "cpu")
        if saved is None:
            del os.environ["MEMFIT_NO_CACHE"]
        else:
            os.environ["MEMFIT_NO_CACHE"] = saved
    if any(size in HF_SIZES for size in args.sizes.split(",")):  # transformers' first call
        from transformers import LlamaConfig, LlamaForCausalLM

        with torch.device("meta"):
            tiny_hf = LlamaForCausalLM(LlamaConfig(
                hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=256))
        ids = torch.zeros(1, 16, dtype=torch.long, device="meta")
        time_memfit(tiny_hf, {"input_ids": ids, "labels": ids}, 1, precision=HF_PRECISION)
    targets = args.targets.split(",")
    table = []
    for size in args.sizes.split(","):
        model, idx, precision = build(size, args.seq)
        n = sum(p.numel() for p in model.parameters())
        row: dict[str, object] = {"params": n}
        if not args.no_memtracker:
            row["memtracker"] = repeated(
                functools.partial(time_memtracker, model, idx, args.steps), args.repeat,
                cold=False)
        mt = row.get("memtracker") or {}
        for target in targets:
            if target == "cuda":
                runs = {"": repeated(functools.partial(time_memfit, model, idx, args.steps,
                                                       "cuda", precision),
                                     args.repeat, cold=True)}
                row["cuda"] = runs[""]
            else:
                row["cpu"] = time_cpu_target(model, idx, args.steps, precision)
                runs = {" cold": row["cpu"]["cold"], " warm": row["cpu"]["warm"]}
            for label, r in runs.items():
                ratio = (round(float(r["cpu_seconds"]) / float(mt["cpu_seconds"]), 3)
                         if "cpu_seconds" in mt else None)
                r["over_memtracker_cpu"] = ratio
                table.append((size, target + label, r["seconds"], r["cpu_seconds"],
                              mt.get("seconds"), mt.get("cpu_seconds"), ratio))
                print(f"{size:>4} {target + label:<9} memfit {r['seconds']:7.2f} s wall "
                      f"{r['cpu_seconds']:7.2f} s cpu   MemTracker {mt.get('seconds')} s wall "
                      f"{mt.get('cpu_seconds')} s cpu   ratio {ratio}", flush=True)
        results["models"][size] = row  # type: ignore[index]
        del model
    print("\n| model | target | memfit wall s | memfit CPU s | MemTracker wall s "
          "| MemTracker CPU s | ratio (CPU) |\n|---|---|---:|---:|---:|---:|---:|")
    for size, target, w, c, mw, mc, ratio in table:
        print(f"| {size} | {target} | {w} | {c} | {mw} | {mc} | {ratio} |")
    results["load_average_at_end"] = list(os.getloadavg())
    results["peak_rss_mib"] = round(rss_mib(), 1)
    print(f"peak RSS {results['peak_rss_mib']} MiB")
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / (
        f"trace-speed-cpu-{datetime.date.today().isoformat()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
