"""The settings of a serve plan (``memfit serve-plan ... --json``) that an engine's launch
command carries, read from the plan's JSON in one shape the vLLM and SGLang exporters read."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any

from memfit.errors import MemfitError

__all__ = ["ServeSettings", "is_serve_plan", "render_command", "render_python",
           "serve_settings"]

ENGINES = ("vllm", "sglang")


def is_serve_plan(data: Any) -> bool:
    """Whether ``data`` is a serve plan's JSON (``engine`` vllm or sglang, KV tokens sized)."""
    return isinstance(data, dict) and data.get("engine") in ENGINES and "kv_cache_tokens" in data


@dataclass(frozen=True, kw_only=True)
class ServeSettings:
    """What a serve plan chose, as the engines' launch flags need it."""

    engine: str
    """The engine whose rules sized the plan (vllm or sglang)."""
    model: str
    tp: int
    max_model_len: int
    kv_cache_dtype: str
    block_size: int
    max_num_batched_tokens: int
    async_scheduling: bool
    """False when the plan kept one batch in flight (``max_in_flight_tokens`` equals
    ``max_num_batched_tokens``)."""
    hybrid: bool
    """A Mamba / linear-attention group: planned without prefix caching, the block size the
    engine's own alignment."""
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    mem_fraction_static: float | None = None
    max_num_seqs: int | None = None
    enforce_eager: bool = False
    prefix_caching: bool = True
    """False when the plan was made without prefix caching (a hybrid model's
    ``mamba_cache_mode`` ``none``)."""


def _int(data: dict[str, Any], key: str, source: str, *, required: bool = True) -> int | None:
    value = data.get(key)
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise MemfitError(f"{source}: serve plan key {key!r} must be a positive integer, got "
                          f"{value!r}; write the plan with memfit serve-plan ... --json")
    return value


def _fraction(data: dict[str, Any], key: str, source: str) -> float | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise MemfitError(f"{source}: serve plan key {key!r} must be in (0, 1], got {value!r}")
    return float(value)


def serve_settings(data: dict[str, Any], source: str = "plan file") -> ServeSettings:
    """The launch settings of a serve plan's JSON; a missing or malformed key is a one-line
    MemfitError."""
    if data.get("engine") == "sglang":  # SGLang's names for the same settings
        data = {**data, "max_model_len": data.get("context_len"),
                "block_size": data.get("page_size"),
                "max_num_batched_tokens": data.get("chunked_prefill_size"),
                "max_in_flight_tokens": None}
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise MemfitError(f"{source}: serve plan has no \"model\"; write it with memfit "
                          "serve-plan MODEL ... --json")
    dtype = data.get("kv_cache_dtype") or "auto"
    batched = _int(data, "max_num_batched_tokens", source)
    assert batched is not None
    in_flight = data.get("max_in_flight_tokens")
    groups = data.get("kv_cache_groups") or []
    kv_bytes = data.get("kv_cache_bytes")
    if kv_bytes is not None and (isinstance(kv_bytes, bool) or not isinstance(kv_bytes, int)
                                 or kv_bytes < 0):
        raise MemfitError(f"{source}: serve plan key 'kv_cache_bytes' must be bytes >= 0, got "
                          f"{kv_bytes!r}")
    return ServeSettings(
        engine=str(data["engine"]), model=model, tp=_int(data, "tp", source) or 1,
        max_model_len=_int(data, "max_model_len", source) or 0, kv_cache_dtype=str(dtype),
        block_size=_int(data, "block_size", source) or 16, max_num_batched_tokens=batched,
        async_scheduling=in_flight != batched,
        hybrid=any(isinstance(g, dict) and g.get("kind") == "mamba" for g in groups),
        kv_cache_bytes=kv_bytes,
        gpu_memory_utilization=_fraction(data, "gpu_memory_utilization", source),
        mem_fraction_static=_fraction(data, "mem_fraction_static", source),
        max_num_seqs=_int(data, "max_num_seqs", source, required=False),
        enforce_eager=data.get("enforce_eager") is True,
        prefix_caching=data.get("mamba_cache_mode") != "none")


def looks_like_checkpoint(model: str) -> bool:
    """A hub id (``org/name``) or a path: something an engine loads as it is."""
    return "/" in model or model.startswith((".", "~"))


def render_command(argv: list[str]) -> str:
    """``argv`` as a shell command, one flag (and its value) per line."""
    head, rest = [], argv
    while rest and not rest[0].startswith("--"):
        head.append(rest[0])
        rest = rest[1:]
    parts = [" ".join(shlex.quote(a) for a in head)]
    while rest:
        flag, rest = rest[0], rest[1:]
        if rest and not rest[0].startswith("--"):
            parts.append(f"{flag} {shlex.quote(rest[0])}")
            rest = rest[1:]
        else:
            parts.append(flag)
    return " \\\n    ".join(parts) + "\n"


def render_python(imports: str, call: str, kwargs: dict[str, Any]) -> str:
    """``kwargs`` as a Python call, one keyword per line."""
    body = "".join(f"    {k}={v!r},\n" for k, v in kwargs.items())
    return f"{imports}\n\n{call}(\n{body})\n"
