"""``memfit serve-plan --engine sglang``: SGLang's KV pool on a GPU, and the lines it logs.

The rules are :mod:`memfit.serving.sglang`'s; this module parses the flags SGLang shares with
vLLM, refuses vLLM's own, and prints the plan.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from memfit.cli._common import (
    EXIT_DOES_NOT_FIT,
    console,
    fit_status,
    positive_int,
    print_json,
)
from memfit.errors import DoesNotFitError, MemfitError

# vLLM's options that SGLang has no counterpart for in serve-plan (its page is --page-size 1,
# its budget --mem-fraction-static, it always captures CUDA graphs within that share)
_VLLM_ONLY = (("kv_cache_memory", "--kv-cache-memory"), ("block_size", "--block-size"),
              ("max_num_batched_tokens", "--max-num-batched-tokens"),
              ("max_num_seqs", "--max-num-seqs"), ("concurrency", "--concurrency"),
              ("check", "--check"))
# serve-plan's options that size parts of a vLLM plan the SGLang plan does not model
_VLLM_MODELLED = (("activation_peak", "--activation-peak"), ("max_images", "--max-images"),
                  ("max_videos", "--max-videos"), ("max_pixels", "--max-pixels"),
                  ("num_speculative_tokens", "--num-speculative-tokens"),
                  ("draft_layers", "--draft-layers"), ("draft_model", "--draft-model"))


def run_sglang(args: argparse.Namespace) -> int:
    from memfit.serving import sglang_serve_plan

    for attr, flag in _VLLM_ONLY:
        if getattr(args, attr) is not None:
            raise MemfitError(f"{flag} is vLLM's; with --engine sglang pass --gpu and, if "
                              "needed, --mem-fraction-static")
    for attr, flag in _VLLM_MODELLED:
        if getattr(args, attr) is not None:
            raise MemfitError(f"{flag} is modelled for vLLM only (the SGLang plan is weights, "
                              "CUDA context and the KV pool); drop it or pass --engine vllm")
    if args.enforce_eager or args.no_async_scheduling or args.no_prefix_caching \
            or args.gpu_memory_utilization is not None:
        raise MemfitError("--enforce-eager, --gpu-memory-utilization, --no-async-scheduling "
                          "and --no-prefix-caching are vLLM's; with --engine sglang the share "
                          "is --mem-fraction-static")
    if args.gpu is None:
        raise MemfitError("--engine sglang sizes the pool from the GPU's memory: pass --gpu "
                          "NAME (`memfit gpus`)")
    fraction = None
    if args.mem_fraction_static is not None:
        try:
            fraction = float(args.mem_fraction_static)
        except ValueError:
            raise MemfitError(f"--mem-fraction-static must be a number in (0, 1), got "
                              f"{args.mem_fraction_static!r}") from None
    try:
        plan = sglang_serve_plan(
            args.model, gpu=args.gpu, tp=positive_int(args.tp, "--tp") or 1,
            quant=args.quant, kv_cache_dtype=args.kv_cache_dtype or "auto",
            mem_fraction_static=fraction,
            max_model_len=positive_int(args.max_model_len, "--max-model-len"))
    except DoesNotFitError as exc:
        if not args.check_fit:
            raise
        print(f"memfit: does not fit: {exc}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    if args.json:
        print_json(plan.to_json())
    else:
        render_sglang(plan)
    return fit_status(args, plan.kv_cache_tokens >= plan.context_len)


def render_sglang(plan: Any) -> None:
    from memfit.units import format_bytes

    out = console()
    p = plan.pool
    default = " (SGLang's default for this GPU and --tp)" if \
        plan.mem_fraction_static_is_default else ""
    out.print(f"SGLang {plan.engine_version} KV pool for {plan.model}: --tp-size {plan.tp}, "
              f"--kv-cache-dtype {plan.kv_cache_dtype}, --page-size {plan.page_size}, "
              f"--context-length {plan.context_len:,}")
    out.print(f"--mem-fraction-static {plan.mem_fraction_static}{default}")
    rows = [("GPU memory", plan.total_bytes, "the card's total"),
            ("before weights", plan.non_torch_bytes, "CUDA context and NCCL (estimate)"),
            ("weights", plan.weights_bytes, "per GPU, as loaded"),
            ("left after weights", plan.available_bytes_after_weights, ""),
            ("KV pool", p.kv_bytes, f"{p.cell_size:,} B a token")]
    for label, value, note in rows:
        out.print(f"  {label:<18} {format_bytes(value):>12}" + (f"  ({note})" if note else ""))
    out.print("SGLang logs:")
    for line in plan.log_lines:
        out.print(f"  {line}", soft_wrap=True)
    fits = "fits" if plan.kv_cache_tokens >= plan.context_len else \
        "does NOT fit: SGLang warns and refuses or truncates longer requests"
    out.print(f"one request of {plan.context_len:,} tokens: {fits}")
    out.print(f"requests of {plan.context_len:,} tokens at once: {plan.max_concurrency:.2f}")
