"""``serve-plan --check LOGFILE``: a plan's prediction against what the engine printed.

:func:`log_inputs` fills the plan's inputs the user left out from the engine's own startup log
(the settings it ran with, and its KV budget as ``--kv-cache-memory``), so the plan is made for
the run that was logged; :func:`check_plan` then lines the plan's figures up with the log's, one
row per figure both give, with the absolute and relative error. The error is the plan minus the
log; the log's figures carry the engine's rounding (0.01 GiB, 2 decimals of concurrency).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memfit.serving.logs import EngineLog

__all__ = ["CheckRow", "check_plan", "length_mismatch", "log_inputs"]

# (plan key, log key, what): the figures compared, in the order the engine prints them.
_ROWS = (
    ("weights_bytes", "weights_bytes", "weights"),
    ("activation_peak_bytes", "activation_peak_bytes", "activation peak"),
    ("non_torch_bytes", "non_torch_bytes", "memory outside torch"),
    ("cuda_graph_bytes", "cuda_graph_bytes", "CUDA graphs"),
    ("kv_cache_bytes", "kv_cache_bytes", "KV cache memory"),
    ("num_gpu_blocks", "num_gpu_blocks", "GPU blocks"),
    ("kv_cache_tokens", "kv_cache_tokens", "KV cache tokens"),
    ("max_concurrency", "max_concurrency", "max concurrency"),
)


# SGLang's --kv-cache-dtype names (sglang/srt/arg_groups/fields/model.py) -> vLLM's
_SGLANG_KV_DTYPES = {"fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2", "bf16": "bfloat16"}


@dataclass(frozen=True, kw_only=True)
class CheckRow:
    """One figure: the plan's, the log's, and the plan's error (None where the log's is 0)."""

    what: str
    key: str
    predicted: int | float
    logged: int | float
    from_log: bool = False
    """The plan took this figure from the log (an input, not a prediction)."""

    @property
    def error(self) -> int | float:
        error = self.predicted - self.logged
        return round(error, 6) if isinstance(error, float) else error

    @property
    def relative_error(self) -> float | None:
        return None if self.logged == 0 else self.error / self.logged

    def to_json(self) -> dict[str, Any]:
        return {"what": self.key, "predicted": self.predicted, "logged": self.logged,
                "error": self.error, "relative_error": self.relative_error,
                "from_log": self.from_log}


def log_inputs(log: EngineLog, **given: Any) -> dict[str, Any]:
    """``given`` (``serve_plan`` keyword arguments, None where the user gave none) with the
    gaps filled from ``log``: ``tp``, ``max_model_len`` (the config's, else the L of
    "Maximum concurrency for L tokens"), ``kv_cache_dtype``, ``block_size``,
    ``max_num_batched_tokens`` and, for ``kv_cache_memory``, the engine's KV budget
    ("Available KV cache memory"; ``--kv-cache-memory-bytes`` when the log names it).

    >>> from memfit.serving.logs import parse_engine_log
    >>> log = parse_engine_log("Maximum concurrency for 32,768 tokens per request: 1.30x\\n"
    ...                        "Available KV cache memory: 6.51 GiB")
    >>> log_inputs(log, tp=2, max_model_len=None)["max_model_len"]
    32768
    """
    found = {
        "tp": log.tp, "max_model_len": log.max_model_len or log.concurrency_len,
        "kv_cache_dtype": log.kv_cache_dtype, "block_size": log.block_size,
        "max_num_batched_tokens": log.max_num_batched_tokens,
        "kv_cache_memory": log.kv_cache_memory_bytes if log.kv_cache_memory_bytes is not None
        else log.kv_cache_bytes,
    }
    if log.engine == "sglang":
        # SGLang's page and prefill chunk are not vLLM's block and scheduler budget
        found["block_size"] = found["max_num_batched_tokens"] = None
        found["kv_cache_dtype"] = _SGLANG_KV_DTYPES.get(str(log.kv_cache_dtype),
                                                        log.kv_cache_dtype)
    out = dict(given)
    for key, value in found.items():
        if out.get(key) is None and value is not None:
            out[key] = value
    return out


# the figures that depend on the request length (vllm/v1/core/kv_cache_utils.py)
_BY_LENGTH = ("kv_cache_tokens", "max_concurrency")


def length_mismatch(plan: Any, log: EngineLog) -> tuple[int, int] | None:
    """(the plan's ``max_model_len``, the log's "Maximum concurrency for L tokens") when both
    are known and differ, else None."""
    predicted = plan if isinstance(plan, dict) else plan.to_json()
    ours, theirs = predicted.get("max_model_len"), log.concurrency_len
    if isinstance(ours, int) and theirs is not None and ours != theirs:
        return ours, theirs
    return None


def check_plan(plan: Any, log: EngineLog, *, from_log: tuple[str, ...] = ()) -> list[CheckRow]:
    """The rows where both the plan (its ``to_json()`` keys, or a dict of them) and the log
    give a figure; ``from_log`` names the plan keys that were taken from the log.

    A figure the plan leaves None (the weights, activation peak, memory outside torch and CUDA
    graphs until serve-plan predicts them) has no row; neither have the concurrency and the
    "GPU KV cache size" tokens (``int(concurrency x max_model_len)``) when the plan's
    ``max_model_len`` is not the length the log's concurrency line is for
    (:func:`length_mismatch`): they would compare two different request lengths.
    """
    predicted = plan if isinstance(plan, dict) else plan.to_json()
    logged = log.measured()
    by_length = length_mismatch(predicted, log) is not None
    rows = []
    for plan_key, log_key, what in _ROWS:
        p, g = predicted.get(plan_key), logged.get(log_key)
        if p is None or g is None or isinstance(p, bool):
            continue
        if by_length and plan_key in _BY_LENGTH:
            continue
        rows.append(CheckRow(what=what, key=plan_key, predicted=p, logged=g,
                             from_log=plan_key in from_log))
    return rows
