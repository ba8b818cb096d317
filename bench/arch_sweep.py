"""Trace a tiny model of every transformers architecture in every cell memfit supports.

Run: ``python bench/arch_sweep.py [--jobs 2] [--only gpt2,t5] [--families causal-lm,...]``

For each model type in transformers' auto mappings (causal LM, masked LM, seq2seq LM, image
classification, speech seq2seq, CTC, audio classification), builds a tiny config from the model's
own config class (hidden 64, 2 layers, 4 heads, 4 experts... set only where the class has the
field, passed to the constructor so derived fields such as ``layer_types`` follow), then:

1. **buildable?** builds it with real weights on the CPU and runs one real forward and backward
   on generic inputs (token ids + labels; pixels; log-mel features; waveforms). An architecture
   that fails here needs inputs or settings this sweep does not give it: it is listed with the
   reason, not counted;
2. traces it with ``memfit.trace.estimate`` in every cell of {cuda, cpu} x {fp32, bf16-mixed} x
   {no checkpointing, Hugging Face's ``gradient_checkpointing_enable`` (non-reentrant)}, one step
   of AdamW, on meta weights. Models without ``supports_gradient_checkpointing`` skip the
   checkpointing cells (listed).

Prints a table (passed / traced per cell) and writes ``bench/results/arch-sweep-cpu-<date>.json``
with the counts per cell and every failure's reason.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import platform
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

from memfit.models.hf_auto import TASKS  # the tasks `memfit plan` builds

# The sweep's order (causal LM first); the mappings are memfit's (one list for both).
FAMILIES = {task: TASKS[task][0] for task in (
    "causal-lm", "masked-lm", "seq2seq-lm", "image-classification", "speech-seq2seq", "ctc",
    "audio-classification")}
CELLS = [(device, precision, ckpt) for device in ("cuda", "cpu")
         for precision in ("fp32", "bf16-mixed") for ckpt in (False, True)]

# Tiny sizes, set where the config class has the field (transformers' own tests use similar).
TINY: dict[str, Any] = {
    "hidden_size": 64, "d_model": 64, "n_embd": 64, "embed_dim": 64, "dim": 64,
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "n_layers": 2,
    "encoder_layers": 2, "decoder_layers": 2, "num_decoder_layers": 2,
    "num_attention_heads": 4, "n_head": 4, "num_heads": 4, "n_heads": 4,
    "encoder_attention_heads": 4, "decoder_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "kv_channels": 16, "d_kv": 16,
    "intermediate_size": 128, "n_inner": 128, "d_ff": 128, "ffn_dim": 128,
    "encoder_ffn_dim": 128, "decoder_ffn_dim": 128,
    "vocab_size": 512, "max_position_embeddings": 256, "n_positions": 256,
    "num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
    "image_size": 64, "max_source_positions": 32, "max_target_positions": 64,
    # multi-head latent attention (DeepSeek-V2/V3 style)
    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "kv_lora_rank": 32,
    "q_lora_rank": 32,
    "rotary_dim": 8,  # partial rotary (GPT-J, CodeGen): at most the tiny head_dim
    # hybrids: an attention layer and an MoE layer within two layers (Jamba, Qwen3-Next)
    "attn_layer_offset": 1, "attn_layer_period": 2, "expert_layer_offset": 1,
    "expert_layer_period": 2, "full_attention_interval": 2,
}
SEQ = 32
BATCH = 2
MAX_PARAMS = 30_000_000  # the real CPU step of the build check must stay small


def _mapping(family: str) -> dict[str, Any]:
    from transformers.models.auto import modeling_auto

    return dict(getattr(modeling_auto, FAMILIES[family]))


def tiny_config(model_type: str) -> Any:
    """The model type's config class with :data:`TINY` sizes where it has those fields."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    return cls(**_tiny_kwargs(cls))


def _tiny_kwargs(cls: Any) -> dict[str, Any]:
    default = cls()
    # Only fields holding a single int (lists such as Swin's per-stage num_heads keep theirs).
    kwargs = {k: v for k, v in TINY.items()
              if isinstance(getattr(default, k, None), int)
              and not isinstance(getattr(default, k), bool)
              and not isinstance(getattr(cls, k, None), property)}  # derived (Falcon's head_dim)
    if hasattr(default, "use_cache"):
        kwargs["use_cache"] = False  # a training step keeps no KV cache
    if "qk_rope_head_dim" in kwargs and "head_dim" in kwargs:
        kwargs["head_dim"] = kwargs["qk_rope_head_dim"]  # MLA: head_dim is the rotary part
    if isinstance(getattr(default, "num_heads", None), list | tuple):
        # per-stage heads (Swin-like): the width must stay divisible by each stage's heads
        for key in ("embed_dim", "hidden_size"):
            kwargs.pop(key, None)
    for key in getattr(cls, "sub_configs", {}) or {}:
        sub = getattr(default, key, None)
        if sub is not None and hasattr(sub, "to_dict"):
            sub_cls = type(sub)
            try:
                kwargs[key] = sub_cls(**_tiny_kwargs(sub_cls)).to_dict()
            except Exception:  # a sub-config that cannot take tiny sizes keeps its own
                pass
    vocab = kwargs.get("vocab_size")
    if vocab is not None:  # special token ids must stay inside the tiny vocabulary
        for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id",
                     "sep_token_id", "cls_token_id", "mask_token_id", "unk_token_id"):
            value = getattr(default, name, None)
            if isinstance(value, int) and value >= vocab:
                kwargs[name] = vocab - 1 - ("pad" in name)
    if getattr(default, "is_encoder_decoder", False) and getattr(
            default, "decoder_start_token_id", None) is None:
        # labels are shifted right into decoder inputs starting with this id (T5 uses the pad)
        kwargs["decoder_start_token_id"] = getattr(default, "pad_token_id", None) or 0
    return kwargs


def inputs_for(model: Any, config: Any, family: str, device: str = "cpu") -> dict[str, Any]:
    """Generic inputs for one step of ``family`` (real tensors on ``device``)."""
    g = torch.Generator().manual_seed(0)
    vocab = int(getattr(config, "vocab_size", None) or getattr(
        getattr(config, "text_config", None), "vocab_size", 512))
    name = getattr(model, "main_input_name", "input_ids")
    if family in ("causal-lm", "masked-lm", "seq2seq-lm"):
        ids = torch.randint(5, min(vocab, 400), (BATCH, SEQ), generator=g)
        return {"input_ids": ids.to(device), "labels": ids.to(device)}
    if family == "image-classification":
        size = int(getattr(config, "image_size", 64) or 64)
        if isinstance(getattr(config, "image_size", None), list | tuple):
            size = int(config.image_size[0])
        channels = int(getattr(config, "num_channels", 3) or 3)
        return {name: torch.randn(BATCH, channels, size, size, generator=g).to(device),
                "labels": torch.randint(0, config.num_labels, (BATCH,), generator=g).to(device)}
    if name == "input_features":
        mels = int(getattr(config, "num_mel_bins", 80))
        frames = 2 * int(getattr(config, "max_source_positions", 32))
        feats = torch.randn(BATCH, mels, frames, generator=g)
        labels = torch.randint(5, min(vocab, 400), (BATCH, 8), generator=g)
        return {name: feats.to(device), "labels": labels.to(device)}
    wave = torch.randn(BATCH, 16000, generator=g)
    if family == "ctc":
        labels = torch.randint(5, min(vocab, 30), (BATCH, 5), generator=g)
    elif family == "audio-classification":
        labels = torch.randint(0, config.num_labels, (BATCH,), generator=g)
    else:
        labels = torch.randint(5, min(vocab, 400), (BATCH, 8), generator=g)
    return {name: wave.to(device), "labels": labels.to(device)}


def _model_class(family: str, model_type: str) -> Any:
    import transformers

    names = _mapping(family)[model_type]
    name = names[0] if isinstance(names, list | tuple) else names
    return getattr(transformers, name)


def _reason(exc: BaseException) -> str:
    last = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = f" [{Path(last[0].filename).name}:{last[0].lineno}]" if last else ""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}{where}"


def run_one(family: str, model_type: str, cells: list[tuple[str, str, bool]] | None = None,
            check_real: bool = True) -> dict[str, Any]:
    """Build check (a real step on the CPU, unless ``check_real=False``) and the traces of one
    architecture in ``cells`` (default: all eight)."""
    from memfit.trace import estimate

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    row: dict[str, Any] = {"family": family, "model_type": model_type, "cells": {}}
    try:
        cls = _model_class(family, model_type)
        row["class"] = cls.__name__
        config = tiny_config(model_type)
        with torch.device("meta"):
            sized = sum(p.numel() for p in cls(config).parameters())
        if sized > MAX_PARAMS:  # a field this sweep does not shrink keeps a full-size default
            raise ValueError(f"not tiny: {sized:,} parameters with the sweep's sizes (more than "
                             f"{MAX_PARAMS:,}); its config needs fields the sweep does not set")
        model = cls(config)
        batch = inputs_for(model, config, family)
        if check_real:
            model.train()
            out = model(**batch)
            loss = out.loss if getattr(out, "loss", None) is not None else out[0].float().sum()
            loss.backward()
            del out, loss
        del model
    except Exception as exc:  # any failure means "not buildable with these inputs"
        row["buildable"] = False
        row["reason"] = _reason(exc)
        return row
    row["buildable"] = True
    row["supports_checkpointing"] = bool(getattr(cls, "supports_gradient_checkpointing", False))
    for device, precision, ckpt in cells or CELLS:
        key = f"{device}/{precision}/{'ckpt' if ckpt else 'plain'}"
        if ckpt and not row["supports_checkpointing"]:
            row["cells"][key] = "n/a"
            continue
        started = time.perf_counter()
        try:
            with torch.device("meta"):
                model = cls(config)
            if ckpt:
                model.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()
            estimate(model, batch, precision=precision, device=device, steps=1)
            row["cells"][key] = "ok"
        except Exception as exc:  # recorded with its reason
            row["cells"][key] = _reason(exc)
        row.setdefault("seconds", {})[key] = round(time.perf_counter() - started, 2)
    return row


def architectures(families: list[str], only: set[str] | None) -> list[tuple[str, str]]:
    seen: set[str] = set()
    out = []
    for family in families:
        for model_type in _mapping(family):
            if only and model_type not in only:
                continue
            if model_type in seen:  # one family per architecture: the first listed
                continue
            seen.add(model_type)
            out.append((family, model_type))
    return out


def _run(args: tuple[str, str]) -> dict[str, Any]:
    return run_one(*args)


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    built = [r for r in rows if r.get("buildable")]
    cells: dict[str, dict[str, int]] = {}
    for device, precision, ckpt in CELLS:
        key = f"{device}/{precision}/{'ckpt' if ckpt else 'plain'}"
        applicable = [r for r in built if r["cells"].get(key) != "n/a"]
        passed = sum(r["cells"].get(key) == "ok" for r in applicable)
        cells[key] = {"passed": passed, "traced": len(applicable)}
    return {"architectures": len(rows), "buildable": len(built), "cells": cells}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--only", default="", help="comma-separated model types")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--out", default=None)
    parser.add_argument("--resume", default=None,
                        help="a JSON-lines file: rows are appended as they finish and the ones "
                             "already there are not run again")
    args = parser.parse_args(argv)
    import transformers

    only = {s for s in args.only.split(",") if s} or None
    todo = architectures(args.families.split(","), only)
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    partial = Path(args.resume) if args.resume else None
    if partial and partial.exists():  # rows already done (one JSON object per line)
        rows = [json.loads(line) for line in partial.read_text().splitlines() if line.strip()]
        done = {r["model_type"] for r in rows}
        todo = [t for t in todo if t[1] not in done]
    with multiprocessing.get_context("spawn").Pool(args.jobs, maxtasksperchild=8) as pool:
        for row in pool.imap_unordered(_run, todo):
            rows.append(row)
            if partial:
                with partial.open("a") as f:
                    f.write(json.dumps(row) + "\n")
            bad = [k for k, v in row["cells"].items() if v not in ("ok", "n/a")]
            state = ("not buildable" if not row.get("buildable") else
                     f"{8 - len(bad) - list(row['cells'].values()).count('n/a')} ok, "
                     f"{len(bad)} failed")
            print(f"[{len(rows)}] {row['model_type']:<28} {state}", flush=True)
    rows.sort(key=lambda r: (r["family"], r["model_type"]))
    summary = summarize(rows)
    print(f"\n{summary['buildable']} of {summary['architectures']} architectures buildable")
    print(f"{'cell':<26} {'passed':>7} {'traced':>7} {'rate':>7}")
    for key, c in summary["cells"].items():
        rate = c["passed"] / c["traced"] if c["traced"] else 0.0
        print(f"{key:<26} {c['passed']:>7} {c['traced']:>7} {rate:>7.1%}")
    date = datetime.date.today().isoformat()
    out = Path(args.out or Path(__file__).parent / "results" / f"arch-sweep-cpu-{date}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(), "seconds": round(time.perf_counter() - started),
        "summary": summary, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
