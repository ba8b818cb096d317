"""The playbook's "3-5x in cost" claim, as far as this machine allows: for each realistic workload,
the naive choice against memfit's, in predicted dollars and time.

    python bench/cost.py [--quick] [--out PATH] [--no-write]

Every figure here is **predicted** (nothing runs on a GPU): training step times come from
``memfit.fitting.fit``'s cost model on the catalog's FLOPS and bandwidth, serving latencies
from ``memfit.serving.simulate``'s roofline (vLLM's scheduling rules), prices from the catalog
(dated, sourced). Neither side is measured, so the ratio is memfit's model against itself: it
says what the choices are worth *if* the model is right (its measured errors: docs/fit.md,
docs/simulate.md).

The naive choice, per workload (what one does without a memory/cost model):

- **GPU**: the most expensive catalog GPU (``b200``, also the largest NVIDIA one).
- **Training**: fp32 weights, gradients and AdamW states, no activation checkpointing, no
  offload, no chunked loss (``fit`` restricted to that space, so the naive run is costed by the
  same model); on the fewest of those GPUs (1, 2, 4, 8) it fits on, sharded with FSDP (ZeRO-3)
  only when one GPU cannot hold it (without that it would not run at all). fp32 matmuls run at
  the GPU's fp32 rate (PyTorch's default ``float32_matmul_precision="highest"``: no TF32). A
  second naive row, ``naive_bf16``, is the same with bf16 autocast on: the ratio against it
  says how much of the gap is fp32 alone.
- **Serving**: the checkpoint's dtype (bf16: vLLM's ``--dtype auto`` serves even a float32
  checkpoint in 16 bits, so there is no fp32 serving to compare with), static batching (a batch
  is prefilled, decoded to its longest output, and only then is the next one taken), TP over the
  fewest GPUs that hold the weights, and the fewest replicas whose static capacity (requests
  per second with batches as full as the KV pool allows) covers the load. Its p95 TTFT and TPOT
  at that load are reported against the targets memfit's choice meets; where they miss,
  meeting them would take more replicas, so the ratio is then a lower bound.

memfit's choice: **training**: ``fit`` (its whole default space: precision, checkpointing, 8-bit
AdamW, offload, chunked loss, attention, and ZeRO-1/2/3 over the GPUs: ``num_gpus=N``, not the
slower TP/PP layout search) on each of a few catalog GPU x count pairs (the list per workload
below: a search over the whole catalog x counts takes hours on this 2-core machine), the
cheapest job kept; **serving**: ``memfit.serving.rightsize.rightsize_serving``'s cheapest
candidate (every listed GPU x TP x quantization, continuous batching, replicas to the targets).

Cost: training ``step_seconds x steps x GPUs x price``; serving ``GPUs x price x hours``. The
ratio is ``naive cost / memfit cost``. Writes ``bench/results/cost-cpu-<date>.json`` (device,
torch, command, every workload) or ``--out``. ``--quick`` (the smoke test) runs tiny versions
of the same workloads in seconds; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import math
import platform
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memfit.errors import MemfitError
from memfit.fitting import fit
from memfit.gpus import get_gpu, list_gpus
from memfit.models import resolve_model
from memfit.models.build import build_model, example_inputs
from memfit.models.spec import TransformerSpec
from memfit.serving import (
    Request,
    load_config,
    model_dtype_bytes,
    poisson_requests,
    roofline_for,
    serve_plan,
    simulate,
)
from memfit.serving.rightsize import rightsize_serving
from memfit.serving.simulate import percentile

ROOT = Path(__file__).resolve().parent
NAIVE_SPACE: dict[str, list[Any]] = {
    "precision": ["fp32"], "checkpointing": ["none"], "optimizer": ["adamw"],
    "offload_states": [False], "offload_activations": [False], "chunked_loss": [False]}
QUICK_SPACE: dict[str, list[Any]] = {
    "checkpointing": ["none"], "optimizer": ["adamw"], "offload_states": [False],
    "offload_activations": [False], "chunked_loss": [False]}
"""``--quick``: memfit's search over the precisions only (the smoke test's time)."""
LABEL = "predicted"
SATURATE = 4
"""The naive replica's capacity: ``SATURATE x max_num_seqs`` requests all waiting at once."""
CLAIM = (3.0, 5.0)


def naive_gpu() -> str:
    """The most expensive priced NVIDIA GPU of the catalog (serving is modelled on CUDA)."""
    priced = [g for g in list_gpus() if g.price_per_hour is not None and g.vendor == "nvidia"]
    return max(priced, key=lambda g: (g.price_per_hour, g.usable_bytes)).name


def price(gpu: str) -> float:
    value = get_gpu(gpu).price_per_hour
    if value is None:
        raise MemfitError(f"{gpu} has no catalog price")
    return float(value)


# -- a CNN: ResNet-50 (He et al. 2015, torchvision's layout), no preset or torchvision needed ----

class Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = 4 * width
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                   nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        return F.relu(self.bn3(self.conv3(y)) + self.down(x))


class ResNet(nn.Module):
    """ResNet-50 with ``blocks=(3, 4, 6, 3)``, ``base=64``: 25,557,032 parameters."""

    def __init__(self, blocks: Sequence[int] = (3, 4, 6, 3), base: int = 64,
                 classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, base, 7, 2, 3, bias=False), nn.BatchNorm2d(base),
                                  nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        layers: list[nn.Module] = []
        cin = base
        for i, n in enumerate(blocks):
            width = base * 2 ** i
            for j in range(n):
                layers.append(Bottleneck(cin, width, 2 if j == 0 and i > 0 else 1))
                cin = 4 * width
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The batch's mean cross-entropy (the model's own loss, as a Hugging Face model's)."""
        logits = self.fc(torch.flatten(F.adaptive_avg_pool2d(self.layers(self.stem(x)), 1), 1))
        return F.cross_entropy(logits, labels)


# -- the workloads -------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Training:
    name: str
    what: str
    build: Callable[[], tuple[nn.Module, Any]]
    """The model on the meta device and a sample batch; the model returns its loss."""
    global_batch: int
    samples: float
    """Samples the job trains on (sequences, images): steps = samples / global_batch."""
    memfit_gpus: tuple[tuple[str, int], ...]
    """The GPU x count pairs memfit's choice is searched over (fit on each, cheapest kept)."""
    memfit_space: dict[str, list[Any]] | None = None
    """``fit``'s space for memfit's choice: None, its whole default space."""


@dataclass(frozen=True, kw_only=True)
class Serving:
    name: str
    what: str
    model: str
    qps: float
    prompt_tokens: int
    output_tokens: int
    p95_ttft_s: float
    p95_tpot_s: float
    hours: float
    memfit_gpus: tuple[str, ...]
    tp: tuple[int, ...]
    quant: tuple[str, ...]
    num_requests: int
    max_model_len: int
    activation_peak_bytes: int | None = None
    """None: traced (vLLM's profile run); a number skips the trace (``--quick``)."""


def _preset(name: str, seq: int, **shrink: int) -> Callable[[], tuple[nn.Module, Any]]:
    """A preset on the meta device (``shrink``: fields replaced, for ``--quick``)."""
    def build() -> tuple[nn.Module, Any]:
        preset = resolve_model(name)
        if not isinstance(preset, TransformerSpec):
            raise MemfitError(f"{name} is not a memfit preset")
        spec = dataclasses.replace(preset, **shrink)  # type: ignore[arg-type]
        return build_model(spec, device="meta"), example_inputs(spec, batch=1, seq=seq)
    return build


def _resnet(blocks: Sequence[int], base: int, res: int) -> Callable[[], tuple[nn.Module, Any]]:
    def build() -> tuple[nn.Module, Any]:
        with torch.device("meta"):
            model = ResNet(blocks, base)
        x = torch.empty(1, 3, res, res, device="meta")
        return model, (x, torch.zeros(1, dtype=torch.long, device="meta"))
    return build


def workloads(quick: bool) -> list[Training | Serving]:
    if quick:  # tiny versions of the same five, one GPU each, a narrowed search: seconds
        tiny = {"num_layers": 1, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 4,
                "head_dim": 16, "intermediate_size": 128, "vocab_size": 512}
        return [
            Training(name="finetune-llama-3-8b", what="quick: a 1-layer llama, seq 64",
                     build=_preset("llama-3-8b", 64, **tiny), global_batch=8, samples=8e3,
                     memfit_gpus=(("l4", 1),), memfit_space=QUICK_SPACE),
            Training(name="pretrain-llama-3.2-1b", what="quick: a 1-layer llama, seq 32",
                     build=_preset("llama-3.2-1b", 32, **tiny), global_batch=8, samples=8e3,
                     memfit_gpus=(("t4", 1),), memfit_space=QUICK_SPACE),
            Serving(name="serve-llama-3-8b", what="quick: gpt2", model="gpt2", qps=2.0,
                    prompt_tokens=64, output_tokens=16, p95_ttft_s=2.0, p95_tpot_s=0.05,
                    hours=24.0, memfit_gpus=("l4",), tp=(1,), quant=("none",),
                    num_requests=8, max_model_len=1024, activation_peak_bytes=2**28),
            Serving(name="serve-llama-3-70b", what="quick: gpt2-medium", model="gpt2-medium",
                    qps=2.0, prompt_tokens=64, output_tokens=16, p95_ttft_s=2.0,
                    p95_tpot_s=0.05, hours=24.0, memfit_gpus=("t4",), tp=(1,),
                    quant=("none",), num_requests=8, max_model_len=1024,
                    activation_peak_bytes=2**28),
            Training(name="train-resnet-50", what="quick: a 1-block ResNet at 32x32",
                     build=_resnet((1,), 8, 32), global_batch=8, samples=8e3,
                     memfit_gpus=(("t4", 1),), memfit_space=QUICK_SPACE),
        ]
    return [
        Training(name="finetune-llama-3-8b",
                 what="full fine-tune of llama-3-8b, seq 2048, global batch 64, 2e9 tokens",
                 build=_preset("llama-3-8b", 2048), global_batch=64,
                 samples=2e9 / 2048,
                 memfit_gpus=(("h100-sxm-80gb", 8), ("a100-sxm-80gb", 8))),
        Training(name="pretrain-llama-3.2-1b",
                 what="pre-train llama-3.2-1b, seq 2048, global batch 256, 2.5e10 tokens "
                      "(~20 tokens a parameter)",
                 build=_preset("llama-3.2-1b", 2048), global_batch=256,
                 samples=2.5e10 / 2048,
                 memfit_gpus=(("h100-sxm-80gb", 1), ("a100-sxm-80gb", 1))),
        Serving(name="serve-llama-3-8b",
                what="serve llama-3-8b: 10 req/s, 1000 prompt + 300 output tokens, "
                     "p95 TTFT 2 s, p95 TPOT 50 ms, for 24 h",
                model="llama-3-8b", qps=10.0, prompt_tokens=1000, output_tokens=300,
                p95_ttft_s=2.0, p95_tpot_s=0.05, hours=24.0,
                memfit_gpus=("l4", "a10g", "l40s", "a100-sxm-80gb", "h100-sxm-80gb",
                             "h200-141gb", "b200"),
                tp=(1, 2), quant=("none", "fp8"), num_requests=200, max_model_len=4096),
        Serving(name="serve-llama-3-70b",
                what="serve llama-3-70b: 20 req/s, 1000 prompt + 300 output tokens, "
                     "p95 TTFT 2 s, p95 TPOT 50 ms, for 24 h",
                model="llama-3-70b", qps=20.0, prompt_tokens=1000, output_tokens=300,
                p95_ttft_s=2.0, p95_tpot_s=0.05, hours=24.0,
                memfit_gpus=("a100-sxm-80gb", "h100-sxm-80gb", "h200-141gb", "b200"),
                tp=(1, 2, 4, 8), quant=("none", "fp8"), num_requests=200,
                max_model_len=4096),
        Training(name="train-resnet-50",
                 what="train ResNet-50 on ImageNet: 224x224, global batch 256, 90 epochs of "
                      "1,281,167 images",
                 build=_resnet((3, 4, 6, 3), 64, 224), global_batch=256,
                 samples=90 * 1_281_167,
                 memfit_gpus=(("l4", 1), ("l40s", 1), ("h100-sxm-80gb", 1))),
    ]


# -- training ------------------------------------------------------------------------------------

def _train_row(w: Training, gpu: str, count: int, space: dict[str, Any] | None,
               steps: float) -> dict[str, Any]:
    model, sample = w.build()
    plan = fit(model, sample, global_batch=w.global_batch, gpu=gpu,
               num_gpus=count, space=space, progress=False)
    step_s = plan.step_seconds
    per_hour = price(gpu)
    job_hours = step_s * steps / 3600
    return {"gpu": gpu, "count": count, "price_per_gpu_hour": per_hour,
            "config": plan.config.label(), "step_seconds": step_s, "job_hours": job_hours,
            "cost_usd": job_hours * count * per_hour, "peak_bytes": plan.peak_bytes,
            "label": LABEL}


def run_training(w: Training, gpu: str) -> dict[str, Any]:
    steps = w.samples / w.global_batch
    tried: list[dict[str, Any]] = []
    naive: dict[str, Any] | None = None
    for count in (1, 2, 4, 8):
        space = dict(NAIVE_SPACE)
        if count > 1:  # sharded (FSDP) only because one GPU cannot hold it
            space["sharding"] = ["zero3"]
        try:
            naive = _train_row(w, gpu, count, space, steps)
            break
        except MemfitError as exc:
            tried.append({"gpu": gpu, "count": count, "reason": str(exc)})
    if naive is None:
        raise MemfitError(f"{w.name}: the naive run fits on no count of {gpu}")
    naive["skipped"] = tried
    # the same, with autocast on: how much of the ratio is fp32 alone
    bf16 = {**NAIVE_SPACE, "precision": ["bf16-mixed"]}
    if naive["count"] > 1:
        bf16["sharding"] = ["zero3"]
    naive_bf16 = _train_row(w, gpu, naive["count"], bf16, steps)
    found, skipped = [], []
    for g, count in w.memfit_gpus:
        try:
            found.append(_train_row(w, g, count, w.memfit_space, steps))
        except MemfitError as exc:
            skipped.append({"gpu": g, "count": count, "reason": str(exc)})
    if not found:
        raise MemfitError(f"{w.name}: memfit's search fits on none of {w.memfit_gpus}")
    best = min(found, key=lambda r: r["cost_usd"])
    best = {**best, "searched": found, "skipped": skipped}
    return {"steps": steps, "naive": naive, "memfit": best, "naive_bf16": naive_bf16,
            "ratio_vs_naive_bf16": naive_bf16["cost_usd"] / best["cost_usd"],
            "time_ratio": naive["job_hours"] / best["job_hours"]}


# -- serving -------------------------------------------------------------------------------------

def _naive_serving(w: Serving, gpu: str) -> dict[str, Any]:
    """The checkpoint's dtype on the fewest TP GPUs that hold it, static batching, and the
    fewest replicas whose static-batching capacity covers the load: capacity is requests per
    second with every request waiting from the start (``SATURATE`` x ``max_num_seqs`` of them,
    so batches are as full as the KV pool and ``max_num_seqs`` allow: the most a replica can
    serve, which sizes the naive side as small as it can be). Its p95s come from the workload's
    Poisson arrivals at ``qps / replicas``, reported beside the targets."""
    _, config = load_config(w.model)
    last: Exception | None = None
    for tp in (1, 2, 4, 8):
        try:
            plan = serve_plan(config, gpu=gpu, tp=tp, max_model_len=w.max_model_len,
                              activation_peak_bytes=w.activation_peak_bytes)
            if plan.fits and plan.num_gpu_blocks >= 2:
                break
        except MemfitError as exc:
            last = exc
    else:
        raise MemfitError(f"{w.name}: the weights fit on no TP size of {gpu} ({last})")
    roofline = roofline_for(plan, gpu=gpu, config=config)
    waiting = [Request(arrival_time=0.0, prompt_tokens=w.prompt_tokens,
                       output_tokens=w.output_tokens)
               for _ in range(SATURATE * plan.max_num_seqs)]
    full = simulate(plan, waiting, roofline=roofline).static
    assert full is not None
    capacity = full.request_throughput
    r = math.ceil(w.qps / capacity)
    reqs = poisson_requests(w.num_requests, w.qps / r, prompt_tokens=w.prompt_tokens,
                            output_tokens=w.output_tokens, seed=0)
    at_load = simulate(plan, reqs, roofline=roofline).static
    assert at_load is not None
    ttft, tpot = percentile(at_load.ttft_s, 95), percentile(at_load.tpot_s, 95)
    per_hour = price(gpu)
    count = r * tp
    return {"gpu": gpu, "count": count, "tp": tp, "replicas": r,
            "quant": f"none ({model_dtype_bytes(config) * 8}-bit)", "batching": "static",
            "static_capacity_rps": capacity,
            "price_per_gpu_hour": per_hour, "p95_ttft_s": ttft, "p95_tpot_s": tpot,
            "meets_targets": ttft <= w.p95_ttft_s and tpot <= w.p95_tpot_s,
            "cost_per_hour": count * per_hour, "hours": w.hours,
            "cost_usd": count * per_hour * w.hours,
            "usd_per_million_tokens": count * per_hour / (w.qps * 3600 * w.output_tokens) * 1e6,
            "label": LABEL}


def run_serving(w: Serving, gpu: str) -> dict[str, Any]:
    naive = _naive_serving(w, gpu)
    result = rightsize_serving(w.model, qps=w.qps, prompt_tokens=w.prompt_tokens,
                               output_tokens=w.output_tokens, p95_ttft_s=w.p95_ttft_s,
                               p95_tpot_s=w.p95_tpot_s, gpus=list(w.memfit_gpus), tp=w.tp,
                               quant=w.quant, num_requests=w.num_requests,
                               max_model_len=w.max_model_len,
                               activation_peak_bytes=w.activation_peak_bytes)
    best = result.candidates[0].to_json()
    best |= {"batching": "continuous", "hours": w.hours,
             "cost_usd": best["cost_per_hour"] * w.hours, "label": LABEL,
             "candidates": len(result.candidates), "skipped": len(result.skipped)}
    return {"naive": naive, "memfit": best,
            "latency_ratio_p95_ttft": naive["p95_ttft_s"] / best["p95_ttft_s"]}


# -- the table -----------------------------------------------------------------------------------

def verdict(ratio: float) -> str:
    lo, hi = CLAIM
    return "below 3x" if ratio < lo else ("within 3-5x" if ratio <= hi else "above 5x")


def _describe(kind: str, side: dict[str, Any]) -> str:
    if kind == "training":
        return f"{side['count']}x {side['gpu']} {side['config']}"
    return (f"{side['count']}x {side['gpu']} tp{side['tp']} {side['quant']} "
            f"{side['batching']}")


def _time(kind: str, side: dict[str, Any]) -> str:
    if kind == "training":
        return f"{side['job_hours']:,.1f} h"
    return (f"p95 TTFT {side['p95_ttft_s'] * 1e3:,.0f} ms, "
            f"TPOT {side['p95_tpot_s'] * 1e3:,.1f} ms")


def render(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["workload | naive (predicted) | memfit (predicted) | naive $ | memfit $ | "
             "naive/memfit | naive bf16/memfit | claim 3-5x",
             "--- | --- | --- | --- | --- | --- | --- | ---"]
    for r in rows:
        n, m = r["naive"], r["memfit"]
        bf16 = f"{r['ratio_vs_naive_bf16']:.1f}x" if "ratio_vs_naive_bf16" in r else "-"
        lines.append(
            f"{r['name']} | {_describe(r['kind'], n)}, {_time(r['kind'], n)} | "
            f"{_describe(r['kind'], m)}, {_time(r['kind'], m)} | {n['cost_usd']:,.0f} | "
            f"{m['cost_usd']:,.0f} | {r['ratio']:.1f}x | {bf16} | {r['verdict']}")
    return "\n".join(lines)


def run(quick: bool) -> list[dict[str, Any]]:
    gpu = naive_gpu()
    rows = []
    for w in workloads(quick):
        started = time.perf_counter()
        kind = "training" if isinstance(w, Training) else "serving"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the catalog's stale-price notes, DCP's and such
            body = run_training(w, gpu) if isinstance(w, Training) else run_serving(w, gpu)
        ratio = body["naive"]["cost_usd"] / body["memfit"]["cost_usd"]
        row = {"name": w.name, "kind": kind, "what": w.what, **body, "ratio": ratio,
               "verdict": verdict(ratio), "seconds": time.perf_counter() - started}
        print(f"{w.name}: {ratio:.2f}x ({row['seconds']:.0f} s)", file=sys.stderr)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny workloads (the smoke test)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    started = time.perf_counter()
    rows = run(args.quick)
    ratios = [r["ratio"] for r in rows]
    report = {
        "bench": "cost", "date": dt.date.today().isoformat(), "device": "cpu",
        "device_name": platform.processor() or platform.machine(), "torch": torch.__version__,
        "python": sys.version.split()[0],
        "command": " ".join(["python", "bench/cost.py", *(argv if argv is not None
                                                         else sys.argv[1:])]),
        "quick": args.quick, "naive_gpu": naive_gpu(), "claim": list(CLAIM),
        "labels": "every $ and time figure is predicted (memfit's cost model and simulator, "
                  "catalog prices); none is measured",
        "workloads": rows,
        "summary": {"ratios": {r["name"]: r["ratio"] for r in rows},
                    "min_ratio": min(ratios), "max_ratio": max(ratios),
                    "within_claim": [r["name"] for r in rows if r["verdict"] == "within 3-5x"]},
        "seconds": time.perf_counter() - started,
    }
    print(render(rows))
    if not args.no_write:
        path = args.out or ROOT / "results" / f"cost-cpu-{report['date']}.json"
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {path}")
    return report


if __name__ == "__main__":
    main()
