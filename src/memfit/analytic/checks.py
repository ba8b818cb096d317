"""Run options the planner refuses up front, with the way around: a precision or KV-cache dtype
the GPU lacks, tensor/pipeline sizes that do not divide the model, tokens past its context, a
LoRA rank past full rank.
"""

from __future__ import annotations

from memfit import semi_structured, vocab
from memfit.analytic.config import RunConfig
from memfit.errors import MemfitError
from memfit.gpus import GpuSpec
from memfit.models.spec import ModelSpec, TransformerSpec
from memfit.parallel.config import check_degrees
from memfit.recipe import LORA_TARGETS


def _check_compatible(model: ModelSpec, run: RunConfig, gpu: GpuSpec | None) -> None:
    """Conflicting options, caught up front with the way around."""
    if run.sparsity != "none":
        if gpu is not None:
            semi_structured.check_gpu(gpu.label, gpu.compute_capability)
        if not isinstance(model, TransformerSpec):
            raise MemfitError(f"--sparsity {run.sparsity} compresses the blocks' linear weights; "
                              "a parameter count alone does not say which they are: give a "
                              "preset or a config.json instead of --params")
    if gpu is not None:
        if vocab.precision(run.precision).needs == "bf16" and not gpu.bf16:
            raise MemfitError(
                f"{gpu.label} has no bf16 support ("
                + (f"compute capability {gpu.compute_capability}" if gpu.compute_capability
                   else "not in its catalog entry")
                + "); use --precision fp16-mixed (fp16 for inference), "
                "or leave --precision out for the best this GPU supports; in Python, "
                # the caller may be the CLI or Python: both spellings, Python's exact for the mode
                f'RunConfig(precision="{"fp16" if run.mode == "inference" else "fp16-mixed"}")')
        needs_fp8 = vocab.precision(run.precision).needs == "fp8" or run.kv_cache_dtype == "fp8"
        if needs_fp8 and not gpu.fp8:
            raise MemfitError(
                f"{gpu.label} has no fp8 support; use bf16-mixed (or an fp8 GPU such as "
                "h100-sxm-80gb, h200, l40s, l4, rtx-4090)")
    elif vocab.precision(run.precision).needs == "fp8":
        raise MemfitError("fp8 needs a GPU that supports it: add --gpu (e.g. --gpu h100-80gb)")
    if isinstance(model, TransformerSpec):
        tp, pp = run.parallel.tp, run.parallel.pp
        check_degrees(tp, pp, heads=model.num_heads, kv_heads=model.num_kv_heads,
                      layers=model.num_layers, tp_name=f"--tp {tp}", pp_name=f"--pp {pp}",
                      owner=f"{model.name}'s", kv_replicated=True)
        check_model_options(model, run)
        if run.sparsity != "none":
            _check_sparse_shapes(model, run)


def check_model_options(model: TransformerSpec, run: RunConfig) -> None:
    """Options that make no sense for this model: tokens past its context, a LoRA rank past
    full rank (both methods check them up front). A model type the formulas do not cover (an
    :class:`~memfit.models.hf_auto.HFModelSpec`) is not checked here: its own code refuses
    what it cannot run, and the trace reports that in one line."""
    if not isinstance(model, TransformerSpec):
        return
    check_context(model, run)
    if run.mode in ("lora", "qlora"):
        _check_lora_rank(model, run)


def check_context(model: TransformerSpec, run: RunConfig) -> None:
    """Refuse tokens past the model's context (``max_position_embeddings``; prompt plus
    generated tokens for inference). Learned absolute position embeddings have no row for
    them (an index error in the real model). RoPE computes any position, but the model was
    trained to ``max_position_embeddings`` only; past it the output degrades unless the
    config stretches RoPE (``rope_scaling``: YaRN, linear, dynamic NTK), which then decides
    the context: with a ``rope_scaling`` the length is not checked."""
    limit = model.max_position_embeddings
    if model.arch == "vision" or limit <= 0 or run.seq is None:
        return
    tokens = run.seq + (run.new_tokens if run.mode == "inference" else 0)
    if tokens <= limit or (model.position == "rope" and model.rope_scaling):
        return
    what, fix = ((f"--seq {run.seq} + --new-tokens {run.new_tokens} = {tokens} tokens",
                  f"keep --seq + --new-tokens within {limit}") if tokens != run.seq
                 else (f"--seq {run.seq}", f"use --seq {limit} or less"))
    why = ("its learned position embeddings have no row past it" if model.position == "learned"
           else "RoPE without rope_scaling in its config")
    raise MemfitError(f"{what} exceeds {model.name}'s context of {limit} tokens ({why}); "
                      f"{fix}")


def _check_lora_rank(model: TransformerSpec, run: RunConfig) -> None:
    """LoRA targets the formulas price (memfit's projection names; another model's own layer
    names are for a model type they do not cover, which the trace resolves). A LoRA rank above
    a targeted layer's smaller dimension is past full rank: B @ A cannot have rank r, and the
    adapter holds more parameters than the layer (Hu et al. 2021)."""
    bad = [t for t in run.lora_targets if t not in LORA_TARGETS]
    if bad:
        raise MemfitError(f"unknown LoRA target(s) {', '.join(bad)} for {model.name}; valid: "
                          f"{', '.join(LORA_TARGETS)} (or 'all'); a layer's own name is for a "
                          "config.json of a model type the formulas do not cover")
    targeted = [s for s in model.linear_shapes() if s.role in run.lora_targets]
    if not targeted:
        return
    smallest = min(targeted, key=lambda s: min(s.in_features, s.out_features))
    full = min(smallest.in_features, smallest.out_features)
    if run.lora_rank > full:
        raise MemfitError(f"--lora-rank {run.lora_rank} exceeds full rank {full} of "
                          f"{model.name}'s {smallest.role} projection ({smallest.in_features} -> "
                          f"{smallest.out_features}); use --lora-rank {full} or less")



ROW_PARALLEL = ("o", "down")
"""Projections tensor parallelism splits along their input (Megatron's RowParallelLinear); the
others are split along their output (ColumnParallelLinear)."""


def sparse_shard_shapes(model: TransformerSpec, run: RunConfig) -> list[tuple[str, int, int, int]]:
    """``(role, rows, cols, count)`` of each projection's weight on one GPU (its tensor-parallel
    shard): what 2:4 compresses."""
    tp = run.parallel.tp
    shapes = []
    for s in model.linear_shapes():
        rows, cols = s.out_features, s.in_features
        if s.role in ROW_PARALLEL:
            cols //= tp
        else:
            rows //= tp
        shapes.append((s.role, rows, cols, s.count))
    return shapes


def _check_sparse_shapes(model: TransformerSpec, run: RunConfig) -> None:
    """Refuse 2:4 for a projection (its tensor-parallel shard) that torch's kernels cannot
    take: for inference, cuSPARSELt's conversion (rows and columns multiples of 16 for
    fp16/bf16); for training, the tile kernel torchao's SemiSparseLinear runs (multiples of
    128)."""
    fmt = vocab.precision(run.precision).matmul
    tp = run.parallel.tp
    for role, rows, cols, _ in sparse_shard_shapes(model, run):
        why = (semi_structured.training_shape_problem(rows, cols, fmt) if run.training
               else semi_structured.shape_problem(rows, cols, fmt, "cusparselt"))
        if why is not None:
            shard = f" (its --tp {tp} shard)" if tp > 1 else ""
            raise MemfitError(f"--sparsity {run.sparsity}: {model.name}'s {role} projection"
                              f"{shard} {why}, so torch cannot "
                              f"{'sparsify it in training' if run.training else 'compress it'}"
                              "; drop --sparsity")
