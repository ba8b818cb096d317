"""memfit's vLLM / SGLang KV-cache arithmetic against public engine startup logs.

    python bench/serving_published.py [--only ID_SUBSTRING] [--activation-in ID_SUBSTRING]
                                      [--out PATH] [--no-write]

The logs live in ``bench/published/serving/logs.json``: ``models`` holds each model's
transformers config (the fields the KV layout needs, with the ``config.json`` it comes from;
nothing is downloaded), ``logs`` one entry per startup log with its source (``url``, or
``repo`` + ``path`` + ``commit``), the ``quote`` (the engine's lines, verbatim), the engine and
its version, GPU, TP, the settings that move the numbers, and the ``logged`` figures.

What is compared, per log (:func:`compare`):

- vLLM: from the log's own "Available KV cache memory: X GiB" (or V0's ``kv_cache_size``),
  memfit's KV tokens and maximum concurrency (:func:`memfit.serve_plan` with
  ``kv_cache_memory`` = X GiB) against the logged "GPU KV cache size: N tokens" (V0:
  ``# GPU blocks`` x block size) and "Maximum concurrency ...: C x". Where vLLM refused to start,
  the request's KV bytes ("(Y GiB KV cache is needed ...)") and "the estimated maximum model
  length is N" instead (memfit's ``request_bytes`` and ``max_model_len_that_fits``; vLLM 0.33
  holds back the null block's bytes first, older releases did not: one block, inside the
  budget's rounding in every such log here).
- SGLang: from the logged "K size: a GB, V size: b GB" (SGLang's GB is 2**30 bytes,
  ``sglang/srt/mem_cache/memory_pool.py``), the tokens that memfit's bytes per token put in
  ``a + b`` against the logged ``#tokens``.

Rounding: vLLM prints GiB with two decimals, so the budget is only known to +-0.005 GiB
(+-5.4 MB). Every prediction is made at both ends of that interval; a log is *within rounding*
when the logged figure lies in the predicted interval, and the reported error is that of the
interval's midpoint (a figure inside the interval is as exact as the log allows).

Beside memfit, two peers on the same budget:

- the **plain formula** ``2 x layers x kv_heads x head_dim x dtype bytes`` per token with
  ``head_dim = hidden_size / num_attention_heads``, ``kv_heads / tp`` per rank, every layer full
  attention, tokens = budget / that (no blocks);
- **llm-d-planner**'s (``llm-d-incubation/llm-d-planner``, ``src/planner/capacity_planner.py``
  at e50305af90f0812e77e1827f3bc740fe75b76370: ``KVCacheDetail.__recalculate`` and
  ``total_kv_blocks``): ``layers x 2 x head_dim x kv_heads x precision`` per token (``head_dim``
  from the config when it has one; MLA ``layers x (kv_lora_rank + qk_rope_head_dim) x
  precision``), divided by ``tp x pp`` per GPU; blocks = ``budget // (per-GPU bytes x 16)``,
  tokens = blocks x 16. Its precision is the model's dtype (``inference_dtype_byte``): the KV
  dtype flag is not read, sliding-window layers count as full, MLA is split by TP.

vLLM's log semantics move with its version (:func:`engine_rule`, documented rule):

- ``v0`` (the V0 engine, up to 0.7 and wherever it was forced): "# GPU blocks: B"; tokens =
  B x block size; concurrency = tokens / max_model_len.
- ``v1_groups`` (V1, 0.8 to 0.19): tokens = ``num_blocks // len(kv_cache_groups) x block
  size`` (vllm PR #40384 quotes it), concurrency = ``num_blocks / blocks one request takes``
  with a sliding layer holding ``window - 1 + max_num_batched_tokens`` tokens (one batch in
  flight: the 0.10.1.1 gpt-oss log below is 284.25x with one batch, 256.0x with two).
- ``v1_capacity`` (0.20 and later, memfit's 0.33.0 rules): tokens =
  ``int(max_concurrency x max_model_len)`` (vllm #51041), two batches in flight under async
  scheduling.
For one full-attention group the three agree, up to ``max_model_len`` not being a multiple of
the block size. A log whose version is not stated carries its rule in ``engine_rule`` with the
reason.

The startup budget's other terms, where a log prints them (:func:`budget_quantities`):

- **weights** ("Model loading took X GiB", V0's "Loading model weights took X GB" or "model
  weights take X GiB", SGLang's "Load weight end ... mem usage=X GB") against
  :func:`memfit.serving.weights.weights_from_config` for the log's model, ``quant`` and TP;
  beside it llm-d-planner's rule (:func:`llmd_weight_bytes`);
- the profile run's **activation peak** ("PyTorch activation peak memory takes X GiB"; V0.6's
  ``peak_torch_memory`` less the weights) against the ``activation_peak_bytes`` of
  :func:`memfit.serving.serve_plan`'s budget (its ``activation_source`` says whether that is the
  traced profile run or the placeholder), at the log's release as memfit models it
  (:func:`modelled_engine_version`: the sampler of 0.6.4.post1, 0.7.3, 0.11.0 or 0.33.0; each
  row's ``memfit_engine_version``, None where the release is not modelled and 0.33's rules
  are used);
- **CUDA-graph memory** ("Graph capturing finished in S secs, took X GiB") against the budget's
  ``cuda_graph_bytes`` (the modelled release's capture sizes and modes; 0.10.1.1's logs are not
  a modelled release, so 0.33's sizes and FULL_AND_PIECEWISE), and the same
  estimate (:func:`memfit.serving.budget.cudagraph_estimate_bytes`) at the log's own capture
  sizes and mode. Graph memory depends on the version's sizes and modes: no target, shown as is.
- SGLang: the ``#tokens`` :func:`memfit.serving.sglang_kv_tokens` derives from the log's free
  memory after the weights ("avail mem"), the free memory before them (avail + mem usage) and
  ``--mem-fraction-static``, where the log prints them.

Every prediction is CPU-side arithmetic (no GPU is used); the logged figures come from the GPUs
named in each entry.

Targets (issue 22): KV tokens within 1 % (median |error|) and 3 % (max) over the logs that
print tokens; weights within 1 % and the activation peak within 10 % on every log printing
them. The run prints the table and writes ``bench/results/serving-published-cpu-<date>.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import platform
import re
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
LOGS_FILE = HERE / "published" / "serving" / "logs.json"
RESULTS_DIR = HERE / "results"
sys.path.insert(0, str(HERE.parent / "src"))

from memfit.serving import kv_spec, serve_plan, sglang_plan  # noqa: E402
from memfit.serving.budget import (  # noqa: E402
    DEFAULT_ENGINE_VERSION,
    cudagraph_estimate_bytes,
)
from memfit.serving.multimodal import multimodal_budget  # noqa: E402
from memfit.serving.weights import (  # noqa: E402
    QUANT_FORMATS,
    pad_vocab_size,
    weights_from_config,
)

GiB = 2**30
ROUND_GIB = 0.005  # two decimals
TARGET_MEDIAN = 1.0  # percent
TARGET_MAX = 3.0
TARGET_WEIGHTS = 1.0  # percent, every log that prints the weights
TARGET_ACTIVATION = 10.0  # percent, every log that prints the profile run's activation peak
ENGINE_RULES = ("v0", "v1_groups", "v1_capacity", "v1_request_bytes")
LLMD_SOURCE = ("llm-d-incubation/llm-d-planner src/planner/capacity_planner.py "
               "@ e50305af90f0812e77e1827f3bc740fe75b76370")
_SHA = re.compile(r"^[0-9a-f]{40}$")
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 2}  # vLLM runs float32 in 16 bits
_KV_DTYPE_BYTES = {"fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
_MODELLED_MINOR = {(0, 6): "0.6.4.post1", (0, 7): "0.7.3", (0, 11): "0.11.0", (0, 33): "0.33.0"}


# ----------------------------------------------------------------------------- data
def load(path: Path = LOGS_FILE) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The models and the logs of the data file, each log checked (:func:`validate`)."""
    data = json.loads(path.read_text())
    models, logs = data["models"], data["logs"]
    problems = [p for log in logs for p in validate(log, models)]
    if problems:
        raise ValueError("; ".join(problems))
    return models, logs


def validate(log: dict[str, Any], models: dict[str, Any]) -> list[str]:
    """Problems with one log entry (empty when it is well formed)."""
    lid = log.get("id", "<no id>")
    problems = [f"{lid}: missing {k!r}" for k in
                ("id", "engine", "engine_version", "source", "quote", "model", "gpu", "tp",
                 "settings", "logged", "layouts") if k not in log]
    if problems:
        return problems
    src = log["source"]
    if "url" not in src and not ({"repo", "path", "commit"} <= src.keys()
                                 and _SHA.match(src["commit"])):
        problems.append(f"{lid}: source needs a url, or repo + path + a 40-hex commit")
    if log["model"] not in models:
        problems.append(f"{lid}: model {log['model']!r} has no config in 'models'")
    if not log["quote"]:
        problems.append(f"{lid}: empty quote")
    if log["engine"] == "vllm" and engine_rule(log) not in ENGINE_RULES:
        problems.append(f"{lid}: engine_rule must be one of {ENGINE_RULES}")
    return problems


def engine_rule(log: dict[str, Any]) -> str:
    """Which vLLM log semantics the entry follows: ``engine_rule`` when the entry names it (a
    version not stated, or a refused start), else from ``engine_version``'s major.minor:
    below 0.8 ``v0``, 0.8 to 0.19 ``v1_groups``, from 0.20 ``v1_capacity``."""
    if "engine_rule" in log:
        return str(log["engine_rule"])
    m = re.match(r"(\d+)\.(\d+)", str(log["engine_version"]))
    if not m:
        return "unknown"
    version = (int(m[1]), int(m[2]))
    if version < (0, 8):
        return "v0"
    return "v1_groups" if version < (0, 20) else "v1_capacity"


def modelled_engine_version(log: dict[str, Any]) -> str | None:
    """The release of ``memfit.serving.budget.ENGINE_VERSIONS`` whose startup rules the log's
    budget figures are predicted with: the one of the log's major.minor (0.6 -> 0.6.4.post1,
    0.7 -> 0.7.3, 0.11 -> 0.11.0, 0.33 -> 0.33.0); a V0 log whose version is not stated ->
    0.7.3 (V0's profile run and sampler are the same in 0.6.4.post1 and 0.7.3). None for the
    others (0.8-0.10, 0.19, V1 logs not stated): memfit's default, 0.33.0's rules, is used and
    the row says so."""
    if log["engine"] != "vllm":
        return None
    m = re.match(r"v?(\d+)\.(\d+)", str(log["engine_version"]))
    if m:
        return _MODELLED_MINOR.get((int(m[1]), int(m[2])))
    return "0.7.3" if engine_rule(log) == "v0" else None


# ----------------------------------------------------------------------------- predictions
def _memfit_vllm(config: dict[str, Any], log: dict[str, Any], budget: int) -> dict[str, float]:
    """memfit's tokens, concurrency and request bytes for a budget of ``budget`` bytes, read
    the way the log's engine version prints them."""
    s, rule = log["settings"], engine_rule(log)
    method, k = s.get("speculative_method"), s.get("num_speculative_tokens")
    if method is not None and k is None:
        # The log does not state K and vLLM has no default for eagle; a full-attention model's
        # blocks and tokens do not depend on it (tests/serving/test_speculative.py), so K = 1.
        k = 1
    plan = serve_plan(config, kv_cache_memory=budget, tp=log["tp"],
                      speculative_method=method, num_speculative_tokens=k,
                      draft_layers=s.get("draft_layers"),
                      kv_cache_dtype=s.get("kv_cache_dtype", "auto"),
                      block_size=s.get("block_size", 16), max_model_len=s["max_model_len"],
                      max_num_batched_tokens=s.get("max_num_batched_tokens", 8192),
                      async_scheduling=rule == "v1_capacity",
                      prefix_caching=s.get("prefix_caching", True))
    if rule == "v1_capacity":
        tokens = plan.kv_cache_tokens
    else:  # v0 and v1_groups: blocks per group x block size
        tokens = plan.num_gpu_blocks // len(plan.groups) * min(g.block_size for g in plan.groups)
    concurrency = tokens / plan.max_model_len if rule == "v0" else plan.max_concurrency
    return {"kv_tokens": tokens, "max_concurrency": concurrency,
            "request_kv_gib": plan.request_bytes / GiB,
            "max_model_len_fit": plan.max_model_len_that_fits}


def _bytes_per_token(config: dict[str, Any], tp: int, kv_cache_dtype: str) -> int:
    """memfit's cache bytes per token on one rank, over every layer that holds cache."""
    return sum(layer.bytes_per_token for layer in kv_spec(config, tp=tp,
                                                          kv_cache_dtype=kv_cache_dtype))


def _text(config: dict[str, Any]) -> dict[str, Any]:
    return dict(config.get("text_config") or config)


def _dtype_bytes(config: dict[str, Any], kv_cache_dtype: str) -> int:
    if kv_cache_dtype in _KV_DTYPE_BYTES:
        return _KV_DTYPE_BYTES[kv_cache_dtype]
    return _DTYPE_BYTES[str(config.get("torch_dtype", "bfloat16"))]


def plain_bytes_per_token(config: dict[str, Any], tp: int, kv_cache_dtype: str) -> float:
    """The plain formula: ``2 x layers x kv_heads/tp x hidden/heads x dtype`` (every layer full
    attention, the KV heads split by TP, ``head_dim`` from the hidden size)."""
    t = _text(config)
    kv_heads = t.get("num_key_value_heads") or t["num_attention_heads"]
    head_dim = t["hidden_size"] / t["num_attention_heads"]
    return 2 * t["num_hidden_layers"] * kv_heads / tp * head_dim * _dtype_bytes(
        config, kv_cache_dtype)


def llmd_bytes_per_token(config: dict[str, Any], tp: int) -> float:
    """llm-d-planner's per-GPU bytes per token (``KVCacheDetail.__recalculate`` divided by
    ``tp x pp``, pp = 1): the model's dtype, every layer full, MLA's latent split by TP."""
    t = _text(config)
    precision = _DTYPE_BYTES[str(config.get("torch_dtype", "bfloat16"))]
    if any(a in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
           for a in config.get("architectures", [])):
        per_token = t["num_hidden_layers"] * (t["kv_lora_rank"] + t["qk_rope_head_dim"]) \
            * precision
    else:
        head_dim = t.get("head_dim") or int(t["hidden_size"] / t["num_attention_heads"])
        per_token = t["num_hidden_layers"] * 2 * head_dim * t["num_key_value_heads"] * precision
    return per_token / tp


def _llmd_tokens(config: dict[str, Any], tp: int, budget: float, block: int = 16) -> float:
    """llm-d-planner's ``total_kv_blocks`` x block size."""
    return (budget // (llmd_bytes_per_token(config, tp) * block)) * block


def llmd_weight_bytes(config: dict[str, Any], tp: int, quant: str | None) -> float:
    """llm-d-planner's per-GPU weights (``capacity_planner.py: model_memory_req`` over
    ``per_gpu_model_memory_required``): the safetensors headers' parameter count per dtype x
    that dtype's bytes (sub-16-bit dtypes at the quantization's bytes; packed int32 as stored),
    summed, divided by ``tp x pp``. No vocabulary padding, no RoPE cache, nothing replicated
    across TP ranks (norms, KV heads at ``tp > kv_heads``). The bench has no headers offline, so
    the stored tensors are those of the config (the embedding, the LM head unless tied, each
    layer) at the checkpoint dtype: memfit's TP-1 layout less its padding and RoPE cache."""
    fmt = QUANT_FORMATS.get(quant) if quant else None
    whole = weights_from_config(config, tp=1, dtype_bytes=_DTYPE_BYTES[str(
        config.get("torch_dtype", "bfloat16"))], quant=fmt)
    t = _text(config)
    dtype_bytes = _DTYPE_BYTES[str(config.get("torch_dtype", "bfloat16"))]
    heads = 1 if t.get("tie_word_embeddings", config.get("tie_word_embeddings")) else 2
    padding = (pad_vocab_size(t["vocab_size"]) - t["vocab_size"]) * t["hidden_size"] \
        * dtype_bytes * heads
    return (whole.total - whole.parts["rope_cache"] - padding) / tp


# ----------------------------------------------------------------------------- comparison
def _err(pred: float, logged: float) -> float:
    return 100.0 * (pred - logged) / logged


# The logged figure's own rounding: concurrency "%.2fx", GiB "%.2f"; token counts are exact.
_LOGGED_HALF_STEP = {"max_concurrency": 0.005, "request_kv_gib": 0.005, "kv_tokens": 0.0,
                     "max_model_len_fit": 0.0, "kv_tokens_sglang_plan": 0.0}


def _gib_half_step(value: float) -> float:
    """Half the last printed digit of a GiB figure ("%.4f" for vLLM's weights, "%.2f" else)."""
    decimals = len(repr(float(value)).split(".")[1])
    return 0.5 * 10.0 ** -max(2, decimals)


def _quantity(key: str, lo: float, mid: float, hi: float, logged: float) -> dict[str, Any]:
    """A prediction interval (the budget's rounding) against a logged figure (with its own
    rounding): within rounding when the two intervals meet."""
    low, high = min(lo, hi), max(lo, hi)
    half = _LOGGED_HALF_STEP[key] if key in _LOGGED_HALF_STEP else _gib_half_step(logged)
    return {"logged": logged, "predicted": mid, "interval": [low, high],
            "error_pct": _err(mid, logged),
            "within_rounding": low - half <= logged <= high + half}


def compare(log: dict[str, Any], models: dict[str, Any], *,
            activation: bool = True) -> dict[str, Any]:
    """One log's row: each logged quantity against memfit (with the rounding interval) and the
    two peers (at the budget's midpoint); the activation peak only with ``activation``."""
    config = models[log["model"]]["config"]
    logged, s, tp = log["logged"], log["settings"], log["tp"]
    kv_dtype = s.get("kv_cache_dtype", "auto")
    row: dict[str, Any] = {"id": log["id"], "engine": log["engine"],
                           "engine_version": log["engine_version"], "model": log["model"],
                           "gpu": log["gpu"], "tp": tp, "layouts": log["layouts"],
                           "quantities": {}}
    if log["engine"] == "sglang":
        rule = "sglang"
        gib = logged["k_gib"] + logged["v_gib"]
        per_token = _bytes_per_token(config, tp, kv_dtype)
        # two GB figures rounded to 2 decimals each: +-0.01 GiB on their sum
        lo, mid, hi = ((gib + d) * GiB / per_token for d in (-2 * ROUND_GIB, 0.0, 2 * ROUND_GIB))
        q = _quantity("kv_tokens", lo, mid, hi, logged["kv_tokens"])
        budget = gib * GiB
        q["plain"] = budget / plain_bytes_per_token(config, tp, kv_dtype)
        q["llm_d_planner"] = budget / llmd_bytes_per_token(config, tp)
        row["quantities"]["kv_tokens"] = q
    else:
        rule = engine_rule(log)
        gib = logged["available_kv_gib"]
        budgets = [round((gib + d) * GiB) for d in (-ROUND_GIB, 0.0, ROUND_GIB - 1e-12)]
        preds = [_memfit_vllm(config, log, b) for b in budgets]
        for key in ("kv_tokens", "max_concurrency", "request_kv_gib", "max_model_len_fit"):
            if key in logged:
                lo, mid, hi = (p[key] for p in preds)
                row["quantities"][key] = _quantity(key, lo, mid, hi, logged[key])
        if "kv_tokens" in row["quantities"]:
            q = row["quantities"]["kv_tokens"]
            q["plain"] = budgets[1] / plain_bytes_per_token(config, tp, kv_dtype)
            q["llm_d_planner"] = _llmd_tokens(config, tp, budgets[1])
        if "request_kv_gib" in row["quantities"]:
            q = row["quantities"]["request_kv_gib"]
            n = s["max_model_len"]
            q["plain"] = plain_bytes_per_token(config, tp, kv_dtype) * n / GiB
            q["llm_d_planner"] = llmd_bytes_per_token(config, tp) * n / GiB
        if "max_model_len_fit" in row["quantities"]:
            # the peers' answer: budget / bytes per token (llm-d-planner's auto_max_model_len)
            q = row["quantities"]["max_model_len_fit"]
            q["plain"] = budgets[1] // plain_bytes_per_token(config, tp, kv_dtype)
            q["llm_d_planner"] = budgets[1] // llmd_bytes_per_token(config, tp)
    row["rule"] = rule
    row["memfit_engine_version"] = modelled_engine_version(log)
    row["quantities"].update(budget_quantities(log, models, activation=activation))
    row["not_compared"] = not_compared(log)
    for q in row["quantities"].values():
        for peer in ("plain", "llm_d_planner"):
            if peer in q:
                q[f"{peer}_error_pct"] = _err(q[peer], q["logged"])
    return row


def _exact(key: str, pred: float, logged: float) -> dict[str, Any]:
    return _quantity(key, pred, pred, pred, logged)


def not_compared(log: dict[str, Any]) -> dict[str, str]:
    """The budget figures a log prints that the bench does not predict, and why."""
    out = {}
    quant = log["settings"].get("quant")
    if "weights_gib" in log["logged"] and quant and quant not in QUANT_FORMATS:
        out["weights_gib"] = (f"{quant} weights: not a memfit --quant format; memfit sizes them "
                              "only from the checkpoint's safetensors headers, not stored here")
    return out


def budget_quantities(log: dict[str, Any], models: dict[str, Any], *,
                      activation: bool = True) -> dict[str, Any]:
    """The logged weights, activation peak and CUDA-graph memory against memfit's budget terms
    (and llm-d-planner's weights), plus SGLang's ``#tokens`` through its memory rule; only the
    figures the log prints. GiB throughout. ``activation=False`` leaves the activation peak out
    (no trace: a quick run)."""
    config = models[log["model"]]["config"]
    logged, s, tp = log["logged"], log["settings"], log["tp"]
    quant = s.get("quant")
    dtype_bytes = _DTYPE_BYTES[str(config.get("torch_dtype", "bfloat16"))]
    out: dict[str, Any] = {}
    if "weights_gib" in logged and "weights_gib" not in not_compared(log):
        fmt = QUANT_FORMATS.get(quant) if quant else None
        if fmt is not None and s.get("quant_group_size"):
            fmt = dataclasses.replace(fmt, group_size=s["quant_group_size"])
        pred = weights_from_config(config, tp=tp, dtype_bytes=dtype_bytes, quant=fmt).total
        mm = multimodal_budget(config, tp=tp, dtype_bytes=dtype_bytes)
        pred += 0 if mm is None else mm.weights_bytes  # a VLM's vision tower and projector
        q = _exact("weights_gib", pred / GiB, logged["weights_gib"])
        q["llm_d_planner"] = llmd_weight_bytes(config, tp, quant) / GiB
        out["weights_gib"] = q
    gpu = s.get("memfit_gpu")
    traced = activation and "activation_gib" in logged
    if gpu and log["engine"] == "vllm" and (traced or "cuda_graph_gib" in logged):
        plan = serve_plan(config, gpu=gpu, gpu_memory_utilization=s.get(
            "gpu_memory_utilization", 0.9), tp=tp, max_model_len=s["max_model_len"],
            max_num_seqs=s.get("max_num_seqs"), max_num_batched_tokens=s.get(
                "max_num_batched_tokens"), quant=quant,
            prefix_caching=s.get("prefix_caching", True),
            engine_version=modelled_engine_version(log) or DEFAULT_ENGINE_VERSION,
            activation_peak_bytes=None if traced else 0)  # no trace where none is compared
        budget = plan.budget
        assert budget is not None
        if traced:
            q = _exact("activation_gib", budget.activation_peak_bytes / GiB,
                       logged["activation_gib"])
            q["source"] = budget.activation_source
            q["engine_version"] = budget.engine_version
            out["activation_gib"] = q
        if "cuda_graph_gib" in logged:
            q = _exact("cuda_graph_gib", budget.cuda_graph_bytes / GiB, logged["cuda_graph_gib"])
            q["graphs"] = dict(budget.cuda_graph_counts)
            q["engine_version"] = budget.engine_version
            sizes = s.get("cudagraph_capture_sizes")
            if sizes:
                # the log's own sizes; FULL graphs only where the log's mode captures them
                full_upto = 0 if s.get("cudagraph_mode") == "PIECEWISE" else s["max_num_seqs"]
                at_log = cudagraph_estimate_bytes(config, sizes=sizes, max_num_seqs=full_upto,
                                                  tp=tp, dtype_bytes=dtype_bytes)
                q["at_log_sizes"] = at_log / GiB
                q["at_log_sizes_error_pct"] = _err(at_log / GiB, logged["cuda_graph_gib"])
            out["cuda_graph_gib"] = q
    if log["engine"] == "sglang" and "avail_mem_after_weights_gib" in s:
        # sglang_plan: pre-load free memory = avail + mem usage (both printed, GB = GiB);
        # the GPU's total only fixes what was resident before (non_torch_bytes)
        from memfit.gpus import get_gpu

        total = get_gpu(s["memfit_gpu"]).usable_bytes
        ends = []
        for d in (-0.005, 0.0, 0.005):  # the printed figures' rounding, both ways at once
            pre_load = round((s["avail_mem_after_weights_gib"] + logged["weights_gib"] + d)
                             * GiB)
            weights = round((logged["weights_gib"]) * GiB)
            sgl = sglang_plan(config, total_bytes=total, weights_bytes=weights,
                               non_torch_bytes=total - pre_load, tp=tp,
                               kv_cache_dtype=s.get("kv_cache_dtype", "auto"),
                               mem_fraction_static=s["mem_fraction_static"],
                               max_model_len=s.get("context_len"),
                               page_size=s.get("page_size", 1))
            ends.append(sgl.pool.max_total_num_tokens)
        out["kv_tokens_sglang_plan"] = _quantity("kv_tokens_sglang_plan", ends[0], ends[1],
                                                 ends[2], logged["kv_tokens"])
    return out


def _target(rows: list[dict[str, Any]], key: str, limit: float) -> dict[str, Any]:
    """memfit's (and llm-d-planner's, where given) |error| on ``key`` and which logs miss."""
    have = [r for r in rows if key in r["quantities"]]
    out: dict[str, Any] = {"logs": [r["id"] for r in have]}
    if not have:
        return out
    errs = [abs(r["quantities"][key]["error_pct"]) for r in have]
    out.update({"median_abs_error_pct": statistics.median(errs),
                "max_abs_error_pct": max(errs),
                "misses": {r["id"]: round(r["quantities"][key]["error_pct"], 2) for r in have
                           if abs(r["quantities"][key]["error_pct"]) > limit},
                "met": max(errs) <= limit})
    peer = [abs(r["quantities"][key]["llm_d_planner_error_pct"]) for r in have
            if "llm_d_planner_error_pct" in r["quantities"][key]]
    if peer:
        out["llm_d_planner"] = {"median_abs_error_pct": statistics.median(peer),
                                "max_abs_error_pct": max(peer)}
    return out


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and max |error| of the KV tokens for memfit and the peers, the misses (memfit
    outside 3 %), and whether the issue's targets are met."""
    tok = [r for r in rows if "kv_tokens" in r["quantities"]]
    out: dict[str, Any] = {"logs": len(rows), "logs_with_tokens": len(tok),
                           "layouts": sorted({la for r in rows for la in r["layouts"]})}
    for who, key in (("memfit", "error_pct"), ("plain", "plain_error_pct"),
                     ("llm_d_planner", "llm_d_planner_error_pct")):
        errs = [abs(r["quantities"]["kv_tokens"][key]) for r in tok]
        out[who] = {"median_abs_error_pct": statistics.median(errs),
                    "max_abs_error_pct": max(errs)}
    conc = [abs(r["quantities"]["max_concurrency"]["error_pct"]) for r in rows
            if "max_concurrency" in r["quantities"]]
    out["memfit_concurrency"] = {"logs": len(conc), "median_abs_error_pct":
                                 statistics.median(conc), "max_abs_error_pct": max(conc)}
    for key in ("request_kv_gib", "max_model_len_fit"):
        errs = [abs(r["quantities"][key]["error_pct"]) for r in rows if key in r["quantities"]]
        if errs:
            out[f"memfit_{key}"] = {"logs": len(errs), "median_abs_error_pct":
                                    statistics.median(errs), "max_abs_error_pct": max(errs)}
    out["within_rounding"] = [r["id"] for r in tok
                              if r["quantities"]["kv_tokens"]["within_rounding"]]
    out["misses"] = {r["id"]: round(r["quantities"]["kv_tokens"]["error_pct"], 2) for r in tok
                     if abs(r["quantities"]["kv_tokens"]["error_pct"]) > TARGET_MAX}
    m = out["memfit"]
    out["weights"] = _target(rows, "weights_gib", TARGET_WEIGHTS)
    out["activation"] = _target(rows, "activation_gib", TARGET_ACTIVATION)
    out["activation"]["sources"] = sorted({r["quantities"]["activation_gib"]["source"]
                                           for r in rows if "activation_gib" in r["quantities"]})
    out["cuda_graph"] = _target(rows, "cuda_graph_gib", float("inf"))
    out["sglang_plan_tokens"] = _target(rows, "kv_tokens_sglang_plan", TARGET_MAX)
    out["not_compared"] = {r["id"]: r["not_compared"] for r in rows if r["not_compared"]}
    out["targets"] = {"median_le_1pct": m["median_abs_error_pct"] <= TARGET_MEDIAN,
                      "max_le_3pct": m["max_abs_error_pct"] <= TARGET_MAX,
                      "weights_le_1pct": out["weights"].get("met"),
                      "activation_le_10pct": out["activation"].get("met")}
    return out


def run(only: str | None = None, activation_in: str | list[str] | None = None,
        ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every log (or those whose id contains ``only``); the activation peak, which traces the
    model's forward, only on the logs whose id contains one of ``activation_in`` when given."""
    models, logs = load()
    wanted = [activation_in] if isinstance(activation_in, str) else activation_in
    rows = [compare(log, models,
                    activation=wanted is None or any(w in log["id"] for w in wanted))
            for log in logs if not only or only in log["id"]]
    return rows, summarize(rows)


# ----------------------------------------------------------------------------- output
def _fmt(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'log':44} {'rule':12} {'quantity':15} {'logged':>11} {'memfit':>11} {'err%':>7} "
            f"{'rnd':>3} {'plain%':>8} {'llm-d%':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        for key, q in r["quantities"].items():
            lines.append(
                f"{r['id'][:44]:44} {r['rule']:12} {key:15} {_fmt(q['logged']):>11} "
                f"{_fmt(q['predicted']):>11} {q['error_pct']:>+7.2f} "
                f"{'yes' if q['within_rounding'] else 'no':>3} "
                + (f"{q['plain_error_pct']:>+8.1f}" if "plain_error_pct" in q else f"{'':>8}")
                + (f" {q['llm_d_planner_error_pct']:>+8.1f}" if "llm_d_planner_error_pct" in q
                   else f" {'':>8}"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", help="run the logs whose id contains this")
    parser.add_argument("--activation-in", help="trace the activation peak only on the logs "
                        "whose id contains one of these (comma-separated; '' traces none: a "
                        "quick run)")
    parser.add_argument("--out", type=Path, help="where to write the JSON")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    rows, summary = run(args.only, None if args.activation_in is None
                        else [w for w in args.activation_in.split(",") if w])
    print(table(rows))
    print()
    for who in ("memfit", "plain", "llm_d_planner"):
        s = summary[who]
        print(f"KV tokens, {who:13}: median |err| {s['median_abs_error_pct']:.2f} %, "
              f"max {s['max_abs_error_pct']:.2f} % over {summary['logs_with_tokens']} logs")
    c = summary["memfit_concurrency"]
    print(f"max concurrency, memfit: median |err| {c['median_abs_error_pct']:.2f} %, "
          f"max {c['max_abs_error_pct']:.2f} % over {c['logs']} logs")
    print(f"within the log's own rounding: {len(summary['within_rounding'])} of "
          f"{summary['logs_with_tokens']}; misses (> {TARGET_MAX:g} %): {summary['misses']}")
    for name, key in (("weights", "weights"), ("activation peak", "activation"),
                      ("CUDA graphs", "cuda_graph"), ("SGLang #tokens (rule)",
                                                      "sglang_plan_tokens")):
        t = summary[key]
        if "median_abs_error_pct" in t:
            print(f"{name}, memfit: median |err| {t['median_abs_error_pct']:.2f} %, max "
                  f"{t['max_abs_error_pct']:.2f} % over {len(t['logs'])} logs; misses "
                  f"{t['misses']}")
    print(f"activation source: {summary['activation']['sources']}; not compared: "
          f"{summary['not_compared']}")
    print(f"targets: {summary['targets']}")
    if not args.no_write:
        out = args.out or RESULTS_DIR / f"serving-published-cpu-{dt.date.today().isoformat()}.json"
        out.write_text(json.dumps({
            "bench": "serving_published", "date": dt.datetime.now(dt.UTC).isoformat(),
            "machine": platform.platform(), "python": platform.python_version(),
            "rounding": "vLLM logs GiB to 2 decimals: predictions at +-0.005 GiB bound it",
            "device": "cpu: published GPU startup logs compared with memfit's CPU-side "
                      "predictions; no GPU ran here",
            "llm_d_planner_source": LLMD_SOURCE,
            "summary": summary, "rows": rows}, indent=1, default=float) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
