"""``memfit plan``: per-GPU memory of a training or inference step, and whether it fits."""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import Any

from memfit.analytic.config import (
    ATTENTIONS,
    CHECKPOINTING,
    ENGINES,
    KV_DTYPES,
    MODES,
    OFFLOAD_TARGETS,
    OPTIMIZERS,
    PRECISIONS,
    WEIGHT_QUANTS,
    RunConfig,
)
from memfit.analytic.input_pipeline import default_sample_bytes, with_input_pipeline
from memfit.analytic.planner import (
    FITS_MARGIN,
    GPUS_PER_NODE,
    MemoryPlan,
    default_precision,
    plan,
)
from memfit.analytic.scale_out import gpus_needed, scale_out_line
from memfit.analytic.suggestions import suggest_changes, with_hints
from memfit.cli._common import (
    console,
    exit_status,
    nonneg_int,
    positive_int,
    print_fit_verdict,
    print_json,
)
from memfit.cli.layout import parallel_from_args
from memfit.errors import MemfitError
from memfit.models.spec import ModelSpec, ParamCountSpec
from memfit.parallel.config import PP_SCHEDULES
from memfit.runtime.input_pipeline import DataLoaderSpec, parse_dataloader
from memfit.units import parse_bytes, parse_count

EPILOG = """examples:
  memfit plan llama-3-8b --gpu rtx-4090 --mode lora --batch 4 --seq 2048
  memfit plan ./config.json --gpu h100-80gb --precision bf16-mixed --checkpointing full \\
      --gpus 8 --zero 3
  memfit plan --params 7.5e9 --precision fp16-mixed --optimizer adam --gpus 64 --zero 2
  memfit plan llama-3-8b --gpu h100-80gb --gpus 8 --fsdp      # traces each rank role
  memfit plan llama-3-8b --gpu h100-80gb --gpus 8 --fsdp --method analytic   # the formulas
  memfit plan llama-3-8b --gpu h100-80gb --gpus 16 --tp 2 --fsdp 8 --sp   # tp x fsdp, traced
  memfit plan llama-3-8b --gpu h100-80gb --gpus 8 --pp 4 --fsdp --pp-schedule gpipe
  memfit plan llama-3.1-8b --gpu h100-80gb --gpus 8 --engine fsdp2 --checkpointing selective \\
      --batch 2 --seq 8192
  memfit plan llama-2-7b --engine deepspeed --zero 3 --offload-optimizer --offload-params \\
      --offload-to nvme
  memfit plan llama-3-8b --mode inference --batch 8 --seq 4096 --new-tokens 512 --quant int4
  memfit plan llama-3-8b --gpu a100-40gb --mode inference --precision bf16 --sparsity 2:4
  memfit plan llama-3-8b --gpu h100-80gb --gpus 8 --method analytic --batch 8 --seq 8192 \\
      --dataloader workers=8,prefetch=4,pin=1,depth=1 --host-memory 1TiB
  memfit plan llama-3-8b --gpu l4 --mode qlora --checkpointing full --check && \\
      python train.py   # run only when it fits

exit status: 0 when the plan is answered (with --check: and the step fits), 1 with --check
when it does not fit, 2 for bad input (one line on stderr)
"""


def register(sub: Any) -> None:
    p = sub.add_parser("plan", help="predict per-GPU memory of a step and whether it fits",
                       description=__doc__, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", help="a preset name (`memfit models`), a local HF "
                   "config.json (or a folder holding one, with its safetensors), or a hub id "
                   "(org/name) already in the local Hugging Face cache")
    p.add_argument("--params", help="plan for a parameter count alone, e.g. 7.5e9 or 7.5B "
                   "(model states only)")
    p.add_argument("--gpu", help="GPU from the catalog (`memfit gpus`)")
    p.add_argument("--gpu-file", help="a JSON file adding or overriding catalog GPUs")
    p.add_argument("--host-reserve", metavar="BYTES",
                   help="unified memory (Jetson, Apple silicon): what the OS and the CPU side "
                   "keep, e.g. 2GiB (default: the catalog's; docs/edge.md)")
    p.add_argument("--mps-high-watermark", metavar="RATIO",
                   help="Apple silicon: the PYTORCH_MPS_HIGH_WATERMARK_RATIO planned for "
                   "(default: that variable, else PyTorch's 1.7)")
    p.add_argument("--mode", default="train", help=f"one of {', '.join(MODES)} (default train)")
    p.add_argument("--precision",
                   help=f"one of {', '.join(PRECISIONS)} (default: bf16-mixed; on a GPU without "
                   "bf16 such as v100 or t4, fp16-mixed to train and fp16 for inference)")
    p.add_argument("--optimizer",
                   help=f"one of {', '.join(OPTIMIZERS)} (default adamw; training modes only)")
    p.add_argument("--checkpointing", default="none",
                   help=f"activation checkpointing: {', '.join(CHECKPOINTING)} (selective: "
                   "op-level, keep matmul/attention outputs; torchtitan: torchtitan's op-level "
                   "policy, every second matmul recomputed; selective-attn: Korthikanti's "
                   "score-only recompute, analytic only)")
    p.add_argument("--attention", default="sdpa", help=f"one of {', '.join(ATTENTIONS)}")
    p.add_argument("--batch", default="1", help="micro-batch per GPU (default 1)")
    p.add_argument("--seq", help="sequence length (default: the model's, capped at 2048)")
    p.add_argument("--grad-accum", default="1", help="micro-batches per optimizer step")
    _parallel_options(p)
    p.add_argument("--offload-optimizer", action="store_true",
                   help="keep optimizer states in host memory")
    p.add_argument("--offload-params", action="store_true",
                   help="keep parameters in host memory (needs --zero 3)")
    p.add_argument("--offload-to", default="cpu",
                   help=f"where offloaded states go: {', '.join(OFFLOAD_TARGETS)} (nvme: "
                   "ZeRO-Infinity, DeepSpeed)")
    p.add_argument("--engine", default="auto",
                   help=f"training engine whose memory layout is planned: {', '.join(ENGINES)} "
                   "(auto: the ZeRO paper's layout, DeepSpeed's when offloading)")
    p.add_argument("--lora-rank", help="LoRA rank (default 16; --mode lora/qlora only)")
    p.add_argument("--lora-targets",
                   help="comma list of q,k,v,o,gate,up,down, or 'all' (default q,k,v,o; "
                   "--mode lora/qlora only); for a model type the formulas do not cover, its "
                   "own linear layers' names as peft's target_modules (default: peft's for "
                   "the type, else every linear layer but the head)")
    p.add_argument("--quant", default="none",
                   help=f"inference weight quantization: {', '.join(WEIGHT_QUANTS)}")
    p.add_argument("--sparsity", help="inference: 2:4 stores the blocks' linear weights as "
                   "torch's semi-structured sparse tensors (9/8 bytes per fp16/bf16 weight); "
                   "--mode train: torchao's SemiSparseLinear, dense weights plus compressed "
                   "copies held for backward (19/8 bytes per weight: saves compute, not "
                   "memory); needs compute capability 8.0+; docs/sparse.md")
    p.add_argument("--kv-cache-dtype", help=f"inference KV cache format: {', '.join(KV_DTYPES)}")
    p.add_argument("--new-tokens", help="inference: tokens generated after the "
                   "prompt (the KV cache holds seq + new tokens; default 0)")
    p.add_argument("--method", default=None, choices=["analytic", "trace"],
                   help="analytic formulas, or trace the real module on meta tensors (default: "
                   "the trace for --gpus > 1 when the model can be built, one row per rank "
                   "role, and for model types the formulas do not cover; else the formulas)")
    p.add_argument("--dataloader", metavar="KEY=VALUE,...",
                   help="the input pipeline per GPU: workers=N, prefetch=N (per worker; torch's "
                   "default 2), pin=0|1, sample-bytes=SIZE (x --batch) or batch-bytes=SIZE "
                   "(default: a language model's int64 ids and labels), worker-rss=SIZE, "
                   "depth=N (memfit.data.DevicePrefetcher batches on the GPU); reports its host "
                   "memory per GPU and per node (analytic plans)")
    p.add_argument("--host-memory", metavar="SIZE",
                   help="with --dataloader: the node's RAM, e.g. 1TiB; warns when the input "
                   "pipeline and offloaded states pass it, with settings that fit")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--check", action="store_true",
                   help="exit 1 when the step does not fit (0 when it does), for scripts; "
                   "needs --gpu")
    p.add_argument("--quiet", action="store_true", help="no progress display (--method trace)")
    p.set_defaults(func=run)


def _parallel_options(p: Any) -> None:
    """How the step is split over GPUs: data, tensor, pipeline and expert parallelism."""
    p.add_argument("--gpus", default="1", help="total GPUs (data x tensor x pipeline)")
    p.add_argument("--zero", default="0", help="ZeRO stage 0-3 over data-parallel ranks")
    p.add_argument("--fsdp", nargs="?", const="all", default=None, metavar="N",
                   help="FSDP full sharding (same as --zero 3) over every data-parallel rank, "
                   "or over N of them: HSDP, N-way sharded and replicated across the rest "
                   "(traced only)")
    p.add_argument("--gpus-per-node", default=None,
                   help="GPUs per node, for host memory per node (default 8)")
    p.add_argument("--tp", default="1", help="tensor-parallel size")
    p.add_argument("--pp", default="1", help="pipeline-parallel size (1F1B)")
    p.add_argument("--pp-schedule", default=None,
                   help=f"with --pp: torch.distributed.pipelining schedule, one of "
                   f"{', '.join(PP_SCHEDULES)} (default 1f1b; traced only)")
    p.add_argument("--pp-split", default=None, metavar="NAMES",
                   help="with --pp: where the pipeline splits the model, module names "
                   "separated by commas, each the first module of a stage (torchtitan's "
                   "pipeline_parallel_split_points), e.g. --pp 3 --pp-split model.layers.4,"
                   "model.layers.8 (default: the model's base_model_pp_plan or an even split "
                   "of its decoder layers; traced only)")
    p.add_argument("--microbatches", default=None, metavar="N",
                   help="with --pp: micro-batches of --batch rows per step (default: "
                   "--grad-accum when above 1, else --pp; traced only)")
    p.add_argument("--ep", default="1", help="expert-parallel size (memfit's builtin MoE "
                   "layers, transformers' MoE experts; traced only)")
    p.add_argument("--sequence-parallel", "--sp", action="store_true",
                   help="with --tp: shard norms/dropouts along the sequence (Megatron SP)")
    p.add_argument("--loss-parallel", action="store_true",
                   help="with --tp: cross-entropy on vocabulary-split logits (torch's "
                   "loss_parallel(); traced only)")
    p.add_argument("--tp-plan", default=None, metavar="JSON|FILE",
                   help="with --tp: the tensor-parallel plan, a JSON object (or a file holding "
                   "one) of module-name patterns to styles (colwise, rowwise, colwise_rep, "
                   "rowwise_rep, embedding_rowwise, sequence_parallel, replicate); default: the "
                   "model's own tp_plan, else memfit's projection names (traced only)")


def resolve(args: argparse.Namespace) -> tuple[ModelSpec, Any]:
    """The model and GPU the arguments name."""
    from memfit.gpus import get_gpu
    from memfit.models import resolve_model

    if args.model and args.params:
        raise MemfitError("give a model or --params, not both")
    if args.params:
        params = parse_count(args.params, what="--params")
        model: ModelSpec = ParamCountSpec(name=f"{params:,} parameters", params=params)
    elif args.model:
        model = resolve_model(args.model)
    else:
        raise MemfitError("name a model (`memfit models` lists presets; or a config.json path) "
                          "or give --params N")
    gpu = get_gpu(args.gpu, args.gpu_file) if args.gpu else None
    if args.gpu_file and not args.gpu:
        raise MemfitError("--gpu-file adds GPUs to the catalog; also name one with --gpu")
    return model, edge_options(args, gpu)


def edge_options(args: argparse.Namespace, gpu: Any) -> Any:
    """The GPU with ``--host-reserve`` and the MPS high-watermark ratio applied (unified
    memory, Apple silicon: memfit.analytic.budget)."""
    import os

    from memfit.analytic.budget import planned_on
    from memfit.runtime.mps import HIGH_WATERMARK_ENV
    from memfit.units import parse_bytes

    reserve = getattr(args, "host_reserve", None)
    ratio = getattr(args, "mps_high_watermark", None)
    if gpu is None:
        if reserve is not None or ratio is not None:
            raise MemfitError("--host-reserve and --mps-high-watermark describe a GPU: name "
                              "one with --gpu")
        return None
    if ratio is None and gpu.target == "mps":
        ratio = os.environ.get(HIGH_WATERMARK_ENV) or None
    return planned_on(gpu, host_reserve_bytes=None if reserve is None else
                      parse_bytes(reserve, what="--host-reserve"),
                      mps_high_watermark_ratio=ratio)


def run_config(args: argparse.Namespace) -> RunConfig:
    # Note: [options that do nothing] in analytic/config.py: a flag given explicitly (its
    # default is None) that cannot act in this mode is refused, whatever its value.
    given = {"--optimizer": args.optimizer, "--new-tokens": args.new_tokens,
             "--lora-rank": args.lora_rank, "--lora-targets": args.lora_targets}
    useless = {"--optimizer": args.mode == "inference",
               "--new-tokens": args.mode != "inference",
               "--lora-rank": args.mode not in ("lora", "qlora"),
               "--lora-targets": args.mode not in ("lora", "qlora")}
    for flag, value in given.items():
        if value is not None and useless[flag]:
            needs = {"--optimizer": "a training mode (train, lora, qlora)",
                     "--new-tokens": "--mode inference"}.get(flag, "--mode lora or qlora")
            raise MemfitError(f"{flag} {value} does nothing in --mode {args.mode}; it needs "
                              f"{needs}: drop it or change --mode")
    targets = tuple(t.strip() for t in (args.lora_targets or "q,k,v,o").split(",") if t.strip())
    if targets == ("all",):
        targets = ("q", "k", "v", "o", "gate", "up", "down")
    return RunConfig(
        mode=args.mode, precision=args.precision, optimizer=args.optimizer or "adamw",
        checkpointing=args.checkpointing, attention=args.attention,
        batch=positive_int(args.batch, "--batch") or 1,
        seq=positive_int(args.seq, "--seq"),
        grad_accum=positive_int(args.grad_accum, "--grad-accum") or 1,
        parallel=parallel_from_args(args),
        offload_optimizer=args.offload_optimizer, offload_params=args.offload_params,
        offload_to=args.offload_to, engine=args.engine,
        lora_rank=positive_int(args.lora_rank, "--lora-rank") or 16,
        lora_targets=targets,
        weight_quant=args.quant, kv_cache_dtype=args.kv_cache_dtype,
        new_tokens=nonneg_int(args.new_tokens, "--new-tokens") or 0,
        sparsity=args.sparsity or "none",
    )


def dataloader_from_args(args: argparse.Namespace, model: ModelSpec,
                         config: RunConfig) -> DataLoaderSpec | None:
    """``--dataloader`` as a spec (its batch: ``sample-bytes`` x ``--batch``), or None."""
    if args.dataloader is None:
        if args.host_memory is not None:
            raise MemfitError("--host-memory checks the input pipeline's host memory: give "
                              "--dataloader too (e.g. --dataloader workers=8,prefetch=2)")
        return None
    sample = default_sample_bytes(model, config.seq)
    return parse_dataloader(args.dataloader, batch=config.batch, default_sample_bytes=sample)


def choose_precision(args: argparse.Namespace, gpu: Any) -> str | None:
    """Without --precision: the best the GPU supports (:func:`default_precision`); returns the
    line saying so when the GPU changed the choice from the documented bf16-mixed."""
    if args.precision is not None:
        return None
    args.precision = default_precision(gpu, args.mode)
    if args.precision == "bf16-mixed":
        return None
    why = (f"compute capability {gpu.compute_capability}" if gpu.compute_capability
           else "not in its catalog entry")
    return (f"precision {args.precision}: the best the {gpu.label} supports (no bf16: {why}); "
            "give --precision to choose another")


def choose_method(args: argparse.Namespace, model: Any, config: RunConfig) -> None:
    """``args.method`` where the model or the options decide it (a model the formulas do not
    cover is traced; 2:4 sparsity is planned by the formulas)."""
    from memfit.models.hf_auto import HFModelSpec

    if isinstance(model, HFModelSpec):
        if args.method == "analytic":
            raise MemfitError(f"--method analytic: memfit's formulas do not cover model_type "
                              f"{model.model_type!r}; use --method trace (or leave --method "
                              "out)")
        if args.method is None and not args.json:
            console().print(f"{model.model_type}: not covered by the analytic formulas; "
                            "tracing the real transformers module on meta tensors",
                            soft_wrap=True)
        args.method = "trace"
    if config.sparsity != "none":
        if args.method == "trace":
            raise MemfitError(f"--sparsity {config.sparsity} is planned by the formulas; the "
                              "trace builds dense weights on meta tensors (torch's 2:4 tensors "
                              "need CUDA): use --method analytic with a preset or config.json")
        args.method = "analytic"


def run(args: argparse.Namespace) -> int:
    args.started = time.perf_counter()  # a traced plan's header says how long it took
    model, gpu = resolve(args)
    if args.check and gpu is None:
        raise MemfitError("--check exits 1 when the step does not fit a GPU: name one with "
                          "--gpu (`memfit gpus` lists them)")
    args.precision_note = choose_precision(args, gpu)
    config = run_config(args)
    choose_method(args, model, config)
    asked = args.method
    args.method = args.method or "analytic"
    from memfit.models.checkpoint import checkpoint_dict, checkpoint_for, compare_with_config

    # A folder (or cached hub id) is read with its weights' headers; a config.json file alone.
    given = Path(args.model).expanduser() if args.model else None
    checkpoint = checkpoint_for(model) if given is not None and not given.is_file() else None
    if checkpoint is not None and not args.json:
        console().print(compare_with_config(checkpoint, model), soft_wrap=True)
    per_node = positive_int(args.gpus_per_node, "--gpus-per-node") or GPUS_PER_NODE
    pipeline = dataloader_from_args(args, model, config)
    if pipeline is not None and (args.method == "trace" or (config.gpus > 1 and asked is None)):
        raise MemfitError("--dataloader is planned by the formulas only: add --method analytic "
                          "(in Python, memfit.estimate(..., dataloader=) traces it)")
    hsdp = config.parallel.strategy == "hsdp"
    from memfit.cli.parallel_plan import trace_flags

    only_traced = trace_flags(args, config)
    method_note = None
    if config.gpus > 1 and asked != "analytic":
        # Several GPUs: trace each rank role of the real parallel step when the model can be
        # built (cli/parallel_plan.py); the formulas answer otherwise, with one line saying why.
        from memfit.cli.parallel_plan import run_parallel_plan

        explicit = ("--method trace" if asked == "trace"
                    else f"--fsdp {config.parallel.fsdp} (HSDP)" if hsdp
                    else ", ".join(only_traced) if only_traced else None)
        outcome = run_parallel_plan(args, model, config, gpu, explicit=explicit)
        if isinstance(outcome, int):
            return outcome
        method_note = f"method: the formulas, not the per-rank trace: {outcome}"
        args.method = "analytic"
    elif only_traced:
        raise MemfitError(f"{', '.join(only_traced)}: the formulas do not model this; it is "
                          "traced (drop --method analytic; needs --gpus > 1)")
    elif hsdp:
        raise MemfitError(f"--fsdp {config.parallel.fsdp} of {config.dp} data-parallel ranks is "
                          "HSDP, which the formulas do not model (they shard over every "
                          "data-parallel rank); drop --method analytic to trace it, or give "
                          "--fsdp alone")
    if args.method == "trace":
        from memfit import vocab
        from memfit.cli.trace_plan import run_trace

        vocab.check("checkpointing", config.checkpointing, "trace",
                    what="checkpointing policy")
        if config.engine != "auto" or config.offload_to != "cpu":
            raise MemfitError("--method trace runs plain PyTorch on one GPU; --engine and "
                              "--offload-to are analytic only: use --method analytic")

        args.checkpoint_json = (None if checkpoint is None
                                else checkpoint_dict(checkpoint, model))
        return run_trace(args, model, config, gpu)
    return answer_analytic(args, model, config, gpu, pipeline=pipeline, per_node=per_node,
                           checkpoint=checkpoint, method_note=method_note)


def answer_analytic(args: argparse.Namespace, model: Any, config: RunConfig, gpu: Any, *,
                    pipeline: Any, per_node: int, checkpoint: Any,
                    method_note: str | None) -> int:
    """The formulas' plan: the table (or JSON), the changes that would fit, the scale-out."""
    from memfit.models.checkpoint import checkpoint_dict

    result = with_hints(plan(model, config, gpu))
    if pipeline is not None:
        result = with_input_pipeline(result, pipeline, gpus_per_node=per_node,
                                     host_memory=None if args.host_memory is None else
                                     parse_bytes(args.host_memory, what="--host-memory"))
    suggestions = suggest_changes(result) if result.fits is False else []
    # A unified-memory device (Jetson, Mac) is one machine: more of them is no plan step.
    scale_out = result.fits is False and not (gpu and gpu.unified_memory)
    scale = gpus_needed(result, gpus_per_node=per_node) if scale_out else None
    if args.json:
        out = result.to_dict()
        if args.precision_note:
            out["notes"] = [args.precision_note, *out["notes"]]
        if method_note:
            out["method"] = "analytic"
            out["notes"] = [method_note, *out["notes"]]
        out["scale_out"] = None if scale is None else scale.to_dict()
        out["suggestions"] = [
            {"change": s.change, "saved_bytes": s.saved_bytes,
             "total_bytes": s.plan.total_bytes, "fits": s.plan.fits} for s in suggestions]
        if checkpoint is not None:
            out["checkpoint"] = checkpoint_dict(checkpoint, model)
        print_json(out)
        return exit_status(args, result.capacity_bytes, result.total_bytes, FITS_MARGIN)
    render(result, suggestions, per_node,
           scale_out_line(result, scale, gpus_per_node=per_node) if scale_out
           else None, args.precision_note, method_note)
    return exit_status(args, result.capacity_bytes, result.total_bytes, FITS_MARGIN)


def render(p: MemoryPlan, suggestions: list[Any], gpus_per_node: int = GPUS_PER_NODE,
           scale_out: str | None = None, precision_note: str | None = None,
           method_note: str | None = None) -> None:
    """The shared memory table (:meth:`MemoryPlan.table`), the fit verdict, the notes, the
    single changes that would save memory, then how many GPUs it needs when one will not do:
    a change of options comes before more hardware."""
    table = p.table(suggestions, gpus_per_node=gpus_per_node)
    if scale_out:
        if any(s.plan.fits for s in suggestions):
            scale_out = f"or, with none of these changes: {scale_out}"
        table = dataclasses.replace(table, closing=(scale_out,))
    if precision_note:  # the precision chosen for this GPU, under the run's description
        table = dataclasses.replace(table, lines_before=(*table.lines_before, precision_note))
    if method_note:  # why several GPUs were not traced
        table = dataclasses.replace(table, lines_before=(*table.lines_before, method_note))
    table.print(console(), verdict=lambda out: print_fit_verdict(
        out, p.capacity_bytes, p.total_bytes, FITS_MARGIN, "analytic plan"))
