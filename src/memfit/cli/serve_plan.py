"""``memfit serve-plan``: vLLM's KV cache for a model and a KV budget, layer group by group.

With ``--kv-cache-memory BYTES`` (vLLM's own option: the KV pool is sized from the bytes given,
no profile run) it prints the KV cache groups vLLM forms, the blocks, and the lines vLLM logs at
startup ("GPU KV cache size", "Maximum concurrency"), and the largest ``--max-model-len`` that
fits. The weights, activation peak and CUDA graphs that choose the budget from
``--gpu-memory-utilization`` come in a later part. ``--check LOGFILE`` reads a vLLM or SGLang
startup log, takes the settings not given (and its KV budget) from it, and prints the plan
against the engine's figures (:mod:`memfit.serving.check`).
"""

from __future__ import annotations

import argparse
from typing import Any

from memfit.cli._common import console, positive_int, print_json
from memfit.errors import MemfitError


def register(sub: Any) -> None:
    p = sub.add_parser("serve-plan", help="size vLLM's KV cache (blocks, tokens, concurrency)",
                       description=__doc__)
    p.add_argument("model", help="a preset name (`memfit models`), a config.json or its folder, "
                   "or a hub id in the local cache")
    p.add_argument("--kv-cache-memory", metavar="BYTES",
                   help="the KV budget per GPU, as vLLM's --kv-cache-memory (bytes, or 20GiB); "
                   "with --check, the log's \"Available KV cache memory\" when not given")
    p.add_argument("--tp", help="tensor-parallel size (default 1)")
    p.add_argument("--kv-cache-dtype", help="auto (the model's dtype, default) or fp8 (1 byte)")
    p.add_argument("--block-size", help="tokens per KV block (default 16)")
    p.add_argument("--max-model-len", help="tokens per request (default: the model's context)")
    p.add_argument("--max-num-batched-tokens",
                   help="vLLM's scheduler budget (default 8192, `vllm serve` on an H100/H200); "
                   "moves sliding-window layers' per-request most only")
    p.add_argument("--no-async-scheduling", action="store_true",
                   help="one batch in flight instead of vLLM's default two")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="vLLM's --no-enable-prefix-caching (needed for hybrid Mamba models "
                   "in this version of serve-plan)")
    p.add_argument("--check", metavar="LOGFILE",
                   help="a vLLM or SGLang startup log: fill the settings not given from it and "
                   "print the plan against the engine's figures, line by line")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run)


def _budget(text: str) -> int:
    from memfit.units import parse_bytes

    if text.strip().startswith("-"):
        raise MemfitError(f"--kv-cache-memory must be a number of bytes >= 0, got {text!r}")
    if text.strip() == "0":
        return 0
    return parse_bytes(text, what="--kv-cache-memory")


def run(args: argparse.Namespace) -> int:
    from memfit.serving import serve_plan

    given: dict[str, Any] = dict(
        kv_cache_memory=None if args.kv_cache_memory is None else _budget(args.kv_cache_memory),
        tp=positive_int(args.tp, "--tp"), kv_cache_dtype=args.kv_cache_dtype,
        block_size=positive_int(args.block_size, "--block-size"),
        max_model_len=positive_int(args.max_model_len, "--max-model-len"),
        max_num_batched_tokens=positive_int(args.max_num_batched_tokens,
                                            "--max-num-batched-tokens"))
    log = None
    inputs = dict(given)
    if args.check is not None:
        from memfit.serving import log_inputs, read_engine_log

        log = read_engine_log(args.check)
        inputs = log_inputs(log, **given)
    if inputs["kv_cache_memory"] is None:
        raise MemfitError("serve-plan needs the KV budget: pass --kv-cache-memory BYTES (or "
                          "--check LOGFILE with the engine's \"Available KV cache memory\" line)")
    defaults: dict[str, Any] = {"tp": 1, "kv_cache_dtype": "auto", "block_size": 16,
                "max_num_batched_tokens": 8192}
    plan = serve_plan(
        args.model, **{k: defaults[k] if v is None and k in defaults else v
                       for k, v in inputs.items()},
        async_scheduling=not args.no_async_scheduling,
        prefix_caching=not args.no_prefix_caching)
    if log is not None:
        from memfit.serving import check_plan

        rows = check_plan(plan, log, from_log=tuple(
            k if k != "kv_cache_memory" else "kv_cache_bytes" for k, v in given.items()
            if v is None and inputs[k] is not None))
        if args.json:
            print_json({"engine": log.engine, "engine_version": log.engine_version,
                        "log": str(args.check), "plan": plan.to_json(),
                        "check": [row.to_json() for row in rows]})
            return 0
        render(plan)
        render_check(log, rows, str(args.check))
        return 0
    if args.json:
        print_json(plan.to_json())
        return 0
    render(plan)
    return 0


def render(plan: Any) -> None:
    from rich.table import Table

    from memfit.units import format_bytes

    out = console()
    out.print(f"vLLM {plan.engine_version} KV cache for {plan.model}: tp {plan.tp}, "
              f"--kv-cache-dtype {plan.kv_cache_dtype}, --block-size {plan.block_size}, "
              f"--max-model-len {plan.max_model_len:,}")
    out.print(f"KV budget per GPU (--kv-cache-memory): {plan.kv_cache_bytes:,} B "
              f"({format_bytes(plan.kv_cache_bytes)})")
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
