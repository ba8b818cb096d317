"""``memfit plan --method trace``: build the model from its config on meta tensors and trace
one real step with the trace engine, next to the analytic plan."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from rich.table import Table

from memfit.categories import MemoryCategory
from memfit.cli._common import console, print_fit_verdict, print_json
from memfit.errors import MemfitError
from memfit.estimate.config import RunConfig
from memfit.estimate.planner import check_model_options, plan
from memfit.gpus import GpuSpec
from memfit.models.spec import ModelSpec, TransformerSpec
from memfit.trace.estimate import TRACE_FITS_MARGIN
from memfit.units import format_bytes


def _check_traceable(model: ModelSpec, run: RunConfig) -> TransformerSpec:
    if not isinstance(model, TransformerSpec):
        raise MemfitError("--method trace needs the model's architecture; give a preset or a "
                          "config.json instead of --params")
    unsupported = []
    if run.gpus > 1:
        unsupported.append("--gpus > 1 (sharding, tp, pp)")
    if run.offload_params:
        unsupported.append("--offload-params")
    if run.weight_quant != "none" or run.kv_cache_dtype is not None or run.new_tokens:
        unsupported.append("--quant / --kv-cache-dtype / --new-tokens")
    if run.precision == "fp8":
        unsupported.append("--precision fp8")
    if unsupported:
        raise MemfitError(f"--method trace does not model {', '.join(unsupported)} yet; use the "
                          "default analytic method for these")
    return model


def traced_estimate(spec: TransformerSpec, run: RunConfig, gpu: GpuSpec | None) -> Any:
    """Build ``spec`` on meta (transformers when installed, else memfit's builtin modules),
    apply the run's checkpointing, and trace one step on the CUDA target."""
    from memfit.models.build import build_model, example_inputs
    from memfit.trace import estimate

    attn = "eager" if run.attention == "eager" else "sdpa"
    model = build_model(spec, device="meta", attn_implementation=attn)
    if run.mode in ("lora", "qlora"):
        _apply_adapters(model, run)
    if run.checkpointing != "none":
        from memfit.techniques.checkpointing import apply_activation_checkpointing

        apply_activation_checkpointing(model, policy=run.checkpointing)
    seq = None if spec.arch == "vision" else (run.seq or spec.default_seq_len)
    inputs = example_inputs(spec, batch=run.batch, seq=seq, device="meta")
    training = run.mode in ("train", "lora", "qlora")
    if not training:
        model.eval()
        inputs.pop("labels", None)
    optimizer: Any = run.optimizer if training else None
    if training and run.offload_optimizer:
        from memfit.trace.optim import offloaded

        optimizer = offloaded(run.optimizer)
    return estimate(model, inputs, optimizer=optimizer, precision=run.precision, device="cuda",
                    gpu=gpu, steps=2 if training else 1)


def _apply_adapters(model: Any, run: RunConfig) -> None:
    """``--mode lora``: the base frozen in bf16 (as the analytic plan counts it: 16-bit), fp32
    adapters of rank ``--lora-rank`` on the ``*_proj`` layers ``--lora-targets`` names.
    ``--mode qlora``: those layers' weights in NF4 (torchao's ``NF4Tensor``, which quantizes
    meta tensors: bitsandbytes needs real weights; both store 4.1 bits per weight) and fp32
    adapters; the rest of the base in bf16."""
    import torch

    from memfit.techniques.peft import apply_lora, apply_qlora

    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    targets = [f"{t}_proj" for t in run.lora_targets]
    missing = [t for t in targets if t not in names]
    if missing:
        raise MemfitError(f"--method trace --mode {run.mode}: this model has no "
                          f"{', '.join(missing)} layers (it names its projections differently); "
                          "use the default analytic method")
    model.to(torch.bfloat16)
    if run.mode == "qlora":
        # As a 4-bit load does (transformers' load_in_4bit): every linear layer but the head is
        # NF4, with or without an adapter.
        from torch import nn

        from memfit.techniques.peft import NF4Linear, _replace

        for name, mod in list(model.named_modules()):
            if (type(mod) is nn.Linear and name.rsplit(".", 1)[-1] not in targets
                    and not name.endswith("lm_head")):
                _replace(model, name, NF4Linear(mod))
        apply_qlora(model, rank=run.lora_rank, targets=targets, quant_backend="torchao")
    else:
        apply_lora(model, rank=run.lora_rank, targets=targets, backend="builtin")
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # adapters train in fp32 under autocast


def per_gpu_breakdown(est: Any) -> dict[MemoryCategory, int]:
    """The estimate's breakdown at the peak with the caching allocator's reserve beyond live
    bytes (peak reserved - peak allocated) added to ``runtime``: it sums to ``total_bytes``."""
    breakdown = {c: int(est.breakdown.get(c, 0)) for c in MemoryCategory}
    breakdown[MemoryCategory.RUNTIME] += est.peak_reserved_bytes - est.peak_bytes
    return breakdown


def run_trace(args: argparse.Namespace, model: ModelSpec, run: RunConfig,
              gpu: GpuSpec | None) -> int:
    spec = _check_traceable(model, run)
    check_model_options(spec, run)  # before the trace, not after it
    est = traced_estimate(spec, run, gpu)
    breakdown = per_gpu_breakdown(est)
    analytic = plan(spec, run, gpu)
    capacity = gpu.usable_bytes if gpu else None
    headroom = None if capacity is None else capacity - est.total_bytes
    if args.json:
        print_json({
            "method": "trace",
            "model": {"name": spec.name, "params": spec.param_count()},
            "gpu": None if gpu is None else {"name": gpu.name, "capacity_bytes": capacity},
            "per_gpu": {"total_bytes": est.total_bytes,
                        "breakdown": {c.value: b for c, b in breakdown.items()}},
            "peak_bytes": est.peak_bytes,
            "peak_reserved_bytes": est.peak_reserved_bytes,
            "host_peak_bytes": est.host_peak_bytes,
            "fits": None if headroom is None else headroom >= TRACE_FITS_MARGIN * capacity,
            "headroom_bytes": headroom,
            "peak": {"op": est.peak_op, "phase": est.peak_phase, "module": est.peak_module},
            "analytic_total_bytes": analytic.total_bytes,
            "trace_seconds": est.trace_seconds,
            "assumptions": list(est.assumptions),
            "run": {k: (list(v) if isinstance(v, tuple) else v)
                    for k, v in dataclasses.asdict(run).items()},
        })
        return 0
    out = console()
    out.print(f"[bold]{spec.name}[/bold] traced on meta tensors"
              f"{f' for {gpu.label}' if gpu else ' for CUDA'} in {est.trace_seconds:.1f} s")
    table = Table(title="Memory per GPU: trace vs analytic", title_justify="left")
    for col in ("category", "trace", "analytic"):
        table.add_column(col, justify="left" if col == "category" else "right")
    for category in MemoryCategory:
        table.add_row(category.value, format_bytes(breakdown[category]),
                      format_bytes(analytic.breakdown[category]))
    table.add_section()
    table.add_row("peak allocated", format_bytes(est.peak_bytes), "")
    table.add_row("peak reserved", format_bytes(est.peak_reserved_bytes), "")
    table.add_row("[bold]total[/bold] (reserved + runtime)",
                  f"[bold]{format_bytes(est.total_bytes)}[/bold]",
                  format_bytes(analytic.total_bytes))
    if capacity is not None:
        table.add_row("usable on GPU", format_bytes(capacity), "")
    out.print(table)
    if est.host_peak_bytes:
        out.print(f"host memory for offloaded states (peak): {format_bytes(est.host_peak_bytes)}")
    out.print(f"peak at {est.peak_op} in {est.peak_module or 'the model'} "
              f"({est.peak_phase}, step {est.peak_step})")
    if capacity is not None:
        print_fit_verdict(out, capacity, est.total_bytes, TRACE_FITS_MARGIN, "trace")
    for note in est.assumptions:
        out.print(f"assumed: {note}")
    return 0
