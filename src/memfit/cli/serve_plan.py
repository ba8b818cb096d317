"""``memfit serve-plan``: vLLM's startup budget and KV cache for a model, before launch.

With ``--gpu NAME`` the KV budget is vLLM's: ``--gpu-memory-utilization`` x the GPU's memory
less the weights, the profile run's activation peak, memory outside torch and the CUDA-graph
estimate (each printed). With ``--kv-cache-memory BYTES`` (vLLM's own option: no profile run)
the budget is the bytes given. Either way it prints the KV cache groups vLLM forms, the blocks,
the lines vLLM logs at startup ("Available KV cache memory", "GPU KV cache size", "Maximum
concurrency"), and the largest ``--max-model-len`` that fits. ``--check LOGFILE`` reads a vLLM
or SGLang startup log, takes the settings not given (and its KV budget) from it, and prints the
plan against the engine's figures (:mod:`memfit.serving.check`).
"""

from __future__ import annotations

import argparse
from typing import Any

from memfit.cli._common import console, fit_status, positive_int, print_json
from memfit.errors import MemfitError


def register(sub: Any) -> None:
    p = sub.add_parser("serve-plan", help="size vLLM's startup budget and KV cache (blocks, "
                       "tokens, concurrency)", description=__doc__)
    p.add_argument("model", help="a preset name (`memfit models`), a config.json or its folder, "
                   "or a hub id in the local cache")
    p.add_argument("--gpu", help="the GPU (`memfit gpus`): the budget from "
                   "--gpu-memory-utilization, as vLLM profiles it")
    p.add_argument("--gpu-memory-utilization",
                   help="vLLM's fraction of the GPU's memory, in (0, 1] (default 0.9)")
    p.add_argument("--kv-cache-memory", metavar="BYTES",
                   help="the KV budget per GPU, as vLLM's --kv-cache-memory (bytes, or 20GiB): "
                   "no profile run; with --check, the log's \"Available KV cache memory\" when "
                   "neither this nor --gpu is given")
    p.add_argument("--quant", help="awq, gptq, fp8, nvfp4 or bnb-4bit (default: the "
                   "checkpoint's quantization_config, else none)")
    p.add_argument("--activation-peak", metavar="BYTES",
                   help="the profile run's activation peak, given instead of traced (e.g. the "
                   "figure a startup log prints)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (vLLM's flag)")
    p.add_argument("--max-num-seqs", help="vLLM's scheduler limit (default as `vllm serve` "
                   "for the GPU: 1024 from 70 GiB except A100s, else 256)")
    p.add_argument("--concurrency", help="requests of --max-model-len wanted at once: prints "
                   "the --gpu-memory-utilization that holds them")
    p.add_argument("--tp", help="tensor-parallel size (default 1)")
    p.add_argument("--kv-cache-dtype", help="auto (the model's dtype, default) or fp8 (1 byte)")
    p.add_argument("--block-size", help="tokens per KV block (default: vLLM's, the attention "
                   "backend's preferred size on --gpu: 16, or 32 for MLA on Blackwell)")
    p.add_argument("--max-model-len", help="tokens per request (default: the model's context)")
    p.add_argument("--max-num-batched-tokens",
                   help="vLLM's scheduler budget (default as `vllm serve` for the GPU: 8192 on "
                   "an H100/H200, 2048 below 70 GiB and on A100s, 16384 from 160 GiB; 8192 "
                   "without --gpu)")
    p.add_argument("--no-async-scheduling", action="store_true",
                   help="one batch in flight instead of vLLM's default two")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="vLLM's --no-enable-prefix-caching (a hybrid Mamba model then holds one "
                   "state page per request, mamba_cache_mode none)")
    p.add_argument("--max-images", metavar="N", help="images per prompt, vLLM's "
                   "--limit-mm-per-prompt '{\"image\": N}' (default 999, vLLM's; 0: no image "
                   "encoder)")
    p.add_argument("--max-videos", metavar="N", help="videos per prompt (Qwen2-VL/2.5-VL; "
                   "default 999, vLLM's)")
    p.add_argument("--max-pixels", metavar="P", help="pixels of the largest image (Qwen2-VL/"
                   "2.5-VL's mm_processor_kwargs max_pixels; default the checkpoint's)")
    p.add_argument("--speculative-method",
                   choices=("eagle", "eagle3", "mtp", "ngram", "draft_model"),
                   help="vLLM's speculative_config method: the draft's layers share the KV pool "
                   "(ngram adds none)")
    p.add_argument("--num-speculative-tokens", metavar="K",
                   help="draft tokens per step (required but for mtp, whose default is the "
                   "model's num_nextn_predict_layers); K state pages more per Mamba layer")
    p.add_argument("--draft-layers", metavar="N",
                   help="eagle/eagle3: the head's decoder layers, of the target's attention "
                   "shape (default 1)")
    p.add_argument("--draft-model", metavar="MODEL",
                   help="draft_model: the draft's config.json, hub id or preset")
    p.add_argument("--engine-version",
                   help="the vLLM release whose startup rules size the budget: 0.33.0 "
                   "(default), 0.11.0, 0.7.3 or 0.6.4.post1 (the profile run's sampler, the "
                   "CUDA-graph sizes; the KV arithmetic is 0.33's)")
    p.add_argument("--engine", default="vllm", choices=("vllm", "sglang"),
                   help="the serving engine whose rules size the KV cache (default vllm; "
                   "sglang needs --gpu)")
    p.add_argument("--mem-fraction-static", metavar="F",
                   help="SGLang's share of the memory for weights and KV (default: SGLang's "
                   "own, by the GPU's memory and --tp)")
    p.add_argument("--check", metavar="LOGFILE",
                   help="a vLLM or SGLang startup log: fill the settings not given from it and "
                   "print the plan against the engine's figures, line by line")
    p.add_argument("--check-fit", action="store_true",
                   help="exit 1 when the plan does not fit (the weights leave no KV pool, or "
                   "one request of --max-model-len tokens does not fit in it), 0 when it fits, "
                   "as memfit plan --check; without it a plan answered exits 0")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run)


def _budget(text: str, flag: str = "--kv-cache-memory") -> int:
    from memfit.units import parse_bytes

    if text.strip().startswith("-"):
        raise MemfitError(f"{flag} must be a number of bytes >= 0, got {text!r}")
    if text.strip() == "0":
        return 0
    return parse_bytes(text, what=flag)


def _utilization(text: str | None) -> float:
    """``--gpu-memory-utilization``, vLLM's default 0.9 when not given (None: the SGLang path
    refuses the flag only when it was given)."""
    if text is None:
        return 0.9
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 1:
        raise MemfitError(f"--gpu-memory-utilization must be a number in (0, 1], got {text!r}; "
                          "vLLM's default is 0.9")
    return value


# vllm/config/cache.py: BlockSize = Literal[1, 8, 16, 32, 64, 128, 256], the choices of
# `vllm serve --block-size` (a hybrid model's larger page is vLLM's own, never the flag's)
VLLM_BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)


def block_size_flag(text: str | None) -> int | None:
    """``--block-size`` as ``vllm serve`` takes it: one of :data:`VLLM_BLOCK_SIZES`."""
    value = positive_int(text, "--block-size")
    if value is not None and value not in VLLM_BLOCK_SIZES:
        raise MemfitError(f"--block-size {value} is not one vLLM takes (vllm/config/cache.py: "
                          f"BlockSize); choose one of {', '.join(map(str, VLLM_BLOCK_SIZES))}")
    return value


def _count(text: str | None, flag: str) -> int | None:
    if text is None:
        return None
    if not text.strip().isdigit():
        raise MemfitError(f"{flag} must be an integer >= 0 (vLLM's --limit-mm-per-prompt "
                          f"count), got {text!r}")
    return int(text)


def run(args: argparse.Namespace) -> int:
    from memfit.serving import VLLM_VERSION, serve_plan

    if args.engine == "sglang":
        from memfit.cli.serve_plan_sglang import run_sglang

        if args.speculative_method is not None:
            raise MemfitError("--speculative-method is modelled for vLLM only; drop it or "
                              "pass --engine vllm")
        if args.engine_version is not None:
            raise MemfitError("--engine-version picks a vLLM release; serve-plan models "
                              "SGLang's pool at one version (drop --engine-version)")

        return run_sglang(args)
    if args.mem_fraction_static is not None:
        raise MemfitError("--mem-fraction-static is SGLang's option; pass --engine sglang, or "
                          "--gpu-memory-utilization for vLLM")

    given: dict[str, Any] = dict(
        kv_cache_memory=None if args.kv_cache_memory is None else _budget(args.kv_cache_memory),
        tp=positive_int(args.tp, "--tp"), kv_cache_dtype=args.kv_cache_dtype,
        block_size=block_size_flag(args.block_size),
        max_model_len=positive_int(args.max_model_len, "--max-model-len"),
        max_num_batched_tokens=positive_int(args.max_num_batched_tokens,
                                            "--max-num-batched-tokens"))
    log = None
    inputs = dict(given)
    if args.check is not None:
        from memfit.serving import log_inputs, read_engine_log

        log = read_engine_log(args.check)
        inputs = log_inputs(log, **given)
        if args.gpu is not None and given["kv_cache_memory"] is None:
            inputs["kv_cache_memory"] = None  # --gpu: the budget is planned, not the log's
    if inputs["kv_cache_memory"] is None and args.gpu is None:
        raise MemfitError("serve-plan needs the KV budget: pass --gpu NAME (the budget from "
                          "--gpu-memory-utilization), --kv-cache-memory BYTES, or --check "
                          "LOGFILE with the engine's \"Available KV cache memory\" line")
    defaults: dict[str, Any] = {"tp": 1, "kv_cache_dtype": "auto"}
    plan = serve_plan(
        args.model, **{k: defaults[k] if v is None and k in defaults else v
                       for k, v in inputs.items()},
        gpu=args.gpu, gpu_memory_utilization=_utilization(args.gpu_memory_utilization),
        quant=args.quant, enforce_eager=args.enforce_eager,
        max_num_seqs=positive_int(args.max_num_seqs, "--max-num-seqs"),
        concurrency=positive_int(args.concurrency, "--concurrency"),
        async_scheduling=not args.no_async_scheduling,
        prefix_caching=not args.no_prefix_caching,
        max_images=_count(args.max_images, "--max-images"),
        max_videos=_count(args.max_videos, "--max-videos"),
        max_pixels=positive_int(args.max_pixels, "--max-pixels"),
        activation_peak_bytes=None if args.activation_peak is None else _budget(
            args.activation_peak, "--activation-peak"),
        speculative_method=args.speculative_method,
        num_speculative_tokens=positive_int(args.num_speculative_tokens,
                                            "--num-speculative-tokens"),
        draft_layers=positive_int(args.draft_layers, "--draft-layers"),
        draft_model=args.draft_model,
        engine_version=args.engine_version or VLLM_VERSION)
    if log is not None:
        from memfit.serving import check_plan
        from memfit.serving.check import length_mismatch

        rows = check_plan(plan, log, from_log=tuple(
            k if k != "kv_cache_memory" else "kv_cache_bytes" for k, v in given.items()
            if v is None and inputs[k] is not None))
        if args.json:
            print_json({"engine": log.engine, "engine_version": log.engine_version,
                        "log": str(args.check), "plan": plan.to_json(),
                        "check": [row.to_json() for row in rows]})
            return fit_status(args, plan.fits and plan.startup_oom is None)
        render(plan)
        render_check(log, rows, str(args.check))
        mismatch = length_mismatch(plan, log)
        if mismatch is not None:
            console().print(f"  max concurrency and KV cache tokens not compared: the plan's "
                            f"are for --max-model-len {mismatch[0]:,}, the log's for "
                            f"{mismatch[1]:,} tokens a request (drop --max-model-len to "
                            "compare them)", soft_wrap=True)
        return fit_status(args, plan.fits and plan.startup_oom is None)
    if args.json:
        print_json(plan.to_json())
    else:
        render(plan)
    return fit_status(args, plan.fits and plan.startup_oom is None)


def render(plan: Any) -> None:
    from rich.table import Table

    from memfit.units import format_bytes

    out = console()
    out.print(f"vLLM {plan.engine_version} KV cache for {plan.model}: tp {plan.tp}, "
              f"--kv-cache-dtype {plan.kv_cache_dtype}, --block-size {plan.block_size}, "
              f"--max-model-len {plan.max_model_len:,}")
    if plan.budget is None:
        out.print(f"KV budget per GPU (--kv-cache-memory): {plan.kv_cache_bytes:,} B "
                  f"({format_bytes(plan.kv_cache_bytes)})")
    else:
        render_budget(plan)
    table = Table(title="KV cache groups (per GPU)", title_justify="left")
    for col in ("group", "kind", "layers", "block", "page", "heads x dim", "window"):
        table.add_column(col, justify="left" if col in ("kind", "layers") else "right")
    for i, g in enumerate(plan.groups):
        s = g.spec
        layers = ",".join(map(str, g.layers)) if len(g.layers) <= 8 else \
            f"{len(g.layers)} layers ({g.layers[0]}..{g.layers[-1]})"
        heads = f"{s.num_kv_heads} x {s.head_size}" if s.num_kv_heads else "-"
        table.add_row(str(i), "uniform type" if g.uniform_type else s.kind, layers,
                      str(g.block_size), format_bytes(g.page_size_bytes), heads,
                      str(s.sliding_window or "-"))
    out.print(table)
    shared = [layer.index for layer in plan.layers if layer.kind == "shared"]
    if shared:
        out.print(f"layers {','.join(map(str, shared))} share an earlier layer's KV (no cache)")
    out.print(f"num_gpu_blocks: {plan.num_gpu_blocks:,}")
    out.print(f"bytes per block (all layers sharing it): {plan.bytes_per_block:,} B")
    out.print("vLLM logs:")
    if plan.budget is not None:
        for line in plan.budget.log_lines:
            out.print(f"  {line}", soft_wrap=True)
    out.print(f"  {plan.log_line}")
    need = (f"one request of {plan.max_model_len:,} tokens needs "
            f"{format_bytes(plan.request_bytes)}")
    if plan.fits:
        out.print(f"{need}: fits")
    else:
        out.print(f"{need}: does NOT fit beside the null block, vLLM refuses to start "
                  "(kv_cache_planning.py: _check_enough_kv_cache_memory)")
    out.print(f"largest --max-model-len that fits: {plan.max_model_len_that_fits:,}"
              + (f" (the model's context is {plan.model_context:,})" if plan.model_context
                 else ""))
    if plan.budget is not None and plan.concurrency is not None:
        util = plan.utilization_for_concurrency
        hold = (f"{plan.concurrency} requests of {plan.max_model_len:,} tokens need "
                f"{format_bytes(plan.kv_bytes_for_concurrency)} of KV")
        out.print(f"{hold}: set --gpu-memory-utilization {util:.4f}" if util <= 1 else
                  f"{hold}: more than this GPU holds at any --gpu-memory-utilization")
    if plan.startup_oom:
        out.print(f"WARNING: startup would fail: {plan.startup_oom}")


def render_budget(plan: Any) -> None:
    from memfit.units import format_bytes

    out = console()
    b = plan.budget
    out.print(f"GPU {b.gpu}: {b.total_bytes:,} B total; --gpu-memory-utilization "
              f"{b.gpu_memory_utilization} requests {b.requested_bytes:,} B "
              f"({format_bytes(b.requested_bytes)}); --max-num-seqs {plan.max_num_seqs}, "
              f"--max-num-batched-tokens {plan.max_num_batched_tokens}")
    act = {           "profile_run": "traced profile run", "given": "given"}[b.activation_source]
    graphs = ", ".join(f"{k}={v}" for k, v in b.cuda_graph_counts.items() if v) or "none"
    rows = [("weights", b.weights_bytes, ", ".join(
                f"{k} {format_bytes(v)}" for k, v in b.weights_parts.items() if v)),
            ("activation peak", b.activation_peak_bytes, act),
            *_vision_rows(b.multimodal),
            ("non-torch", b.non_torch_bytes, "estimate: kernels loaded after the baseline"),
            ("CUDA graphs", b.cuda_graph_bytes, f"estimate: {graphs}" + (
                "" if b.cuda_graphs_in_budget else f"; vLLM {b.engine_version} captures them "
                "after sizing the KV cache: not subtracted, they need the headroom")),
            ("KV cache", b.kv_cache_bytes, "what is left")]
    for label, value, note in rows:
        out.print(f"  {label:<16} {format_bytes(value):>12}  ({note})")
    out.print(f"  outside the budget (in vLLM's baseline): CUDA context, NCCL, cuBLAS "
              f"{format_bytes(b.baseline_bytes)}")


def _vision_rows(mm: Any) -> list[tuple[str, int, str]]:
    """The "vision encoder" line: its share of the activation peak is already in it."""
    from memfit.units import format_bytes

    if mm is None:
        return []
    return [("vision encoder", mm.encoder_peak_bytes,
             f"estimate, within the activation peak: {mm.items} {mm.modality} x "
             f"{mm.tokens_per_item:,} tokens; its outputs {format_bytes(mm.encoder_cache_bytes)} "
             f"stay cached through the decoder's run, + embeds buffer "
             f"{format_bytes(mm.embeds_buffer_bytes)}; the tower's "
             f"{format_bytes(mm.weights_bytes)} are in the weights")]


def render_check(log: Any, rows: list[Any], path: str) -> None:
    from memfit.units import format_bytes

    out = console()
    version = f" {log.engine_version}" if log.engine_version else ""
    out.print(f"\n{path}: {log.engine}{version}"
              + (f", {log.ranks} TP workers" if log.ranks > 1 else "")
              + " - the plan against the engine's startup figures")
    if not rows:
        out.print("no figure of the plan is in the log")
        return
    width = max(len(row.what) for row in rows)

    def fmt(key: str, value: float) -> str:
        if key.endswith("_bytes"):
            return f"{value:,} B ({format_bytes(int(value))})"
        return f"{value:.2f}x" if key == "max_concurrency" else f"{value:,}"

    for row in rows:
        rel = "" if row.relative_error is None else f" ({row.relative_error:+.2%})"
        tail = "  (from the log: an input)" if row.from_log else ""
        err = f"{row.error:+.2f}" if row.key == "max_concurrency" else f"{row.error:+,}"
        out.print(f"  {row.what:<{width}}  predicted {fmt(row.key, row.predicted)}, logged "
                  f"{fmt(row.key, row.logged)}, error {err}{rel}{tail}")
