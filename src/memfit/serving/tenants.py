"""The tenants file of ``memfit pack``: each served model (a tenant) with its traffic, parsed
and checked (keys as in docs/pack.md). :mod:`memfit.serving.pack_need` turns a tenant into its
memory and bandwidth need; :mod:`memfit.serving.pack` places the tenants on a GPU pool.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit.errors import MemfitError, suggest

__all__ = ["DEFAULT_TPOT_S", "Tenant", "load_tenants", "tenant_from_dict"]

DEFAULT_TPOT_S = 0.05
"""A tenant's decode step (time per output token) target when it sets none: 50 ms."""

_TENANT_KEYS = ("name", "model", "qps", "prompt_tokens", "output_tokens", "concurrency",
                "context", "tp", "quant", "kv_cache_dtype", "max_model_len", "max_num_seqs",
                "max_num_batched_tokens", "enforce_eager", "tpot_ms", "ttft_ms", "mig",
                "activation_peak_bytes", "cuda_graph_bytes")


@dataclass(frozen=True, kw_only=True)
class Tenant:
    """One served model and its traffic: ``qps`` with ``prompt_tokens`` and ``output_tokens``
    (Little's law gives the concurrency), or ``concurrency`` requests of ``context`` tokens.

    Known limitations: the request-time model is a roofline estimate
    (:mod:`memfit.serving.pack_need`); MoE models count every expert's parameters for the
    prefill FLOPs (slower prefill, larger concurrency: conservative).
    """

    name: str
    model: str | Mapping[str, Any]
    """Anything ``serve_plan`` takes: a preset, a config.json or its folder, a cached hub id."""
    qps: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    concurrency: int | None = None
    """Requests in flight, given instead of ``qps`` (then ``context`` tokens each)."""
    context: int | None = None
    tp: int = 1
    quant: str | None = None
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None
    """vLLM's ``--max-model-len`` (default: prompt + output, or ``context``)."""
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enforce_eager: bool = False
    tpot_s: float = DEFAULT_TPOT_S
    """The decode step target (s): the bandwidth need is the bytes of one step over it."""
    ttft_s: float | None = None
    """A prefill-time limit (s): a device whose estimated prefill is longer does not fit."""
    mig: str | None = None
    """None: share whole GPUs; ``auto``: any MIG profile that fits; or a profile name."""
    activation_peak_bytes: int | None = None
    """Skip the traced profile run with this activation peak (as ``serve_plan``)."""
    cuda_graph_bytes: int | None = None

    def __post_init__(self) -> None:
        where = f"tenant {self.name!r}"
        if self.concurrency is None:
            if self.qps is None or self.prompt_tokens is None or self.output_tokens is None:
                raise MemfitError(f"{where}: give qps, prompt_tokens and output_tokens (or "
                                  "concurrency and context)")
            if not self.qps > 0 or not math.isfinite(self.qps):
                raise MemfitError(f"{where}: qps must be a number > 0, got {self.qps!r}")
        elif self.qps is not None:
            raise MemfitError(f"{where}: give qps (with prompt/output tokens) or concurrency "
                              "(with context), not both")
        elif self.context is None:
            raise MemfitError(f"{where}: concurrency needs context (tokens per request)")
        # Note: [keys that do nothing] each traffic form refuses the other's keys
        if self.concurrency is None and self.context is not None:
            raise MemfitError(f"{where}: context goes with concurrency; with qps give "
                              "prompt_tokens and output_tokens")
        if self.concurrency is not None and (self.prompt_tokens is not None or
                                             self.output_tokens is not None
                                             or self.ttft_s is not None):
            raise MemfitError(f"{where}: prompt_tokens, output_tokens and ttft_ms go with qps; "
                              "with concurrency give context")
        if self.max_model_len is not None and self.max_model_len < self.request_tokens:
            raise MemfitError(f"{where}: max_model_len {self.max_model_len} is below the "
                              f"{self.request_tokens} tokens of one request; raise it or drop it")
        for key in ("tpot_s", "ttft_s"):
            v = getattr(self, key)
            if v is not None and (not v > 0 or not math.isfinite(v)):
                raise MemfitError(f"{where}: {key.replace('_s', '_ms')} must be > 0")

    @property
    def request_tokens(self) -> int:
        """Tokens one request holds at its end: prompt + output, or ``context``."""
        if self.concurrency is not None:
            assert self.context is not None
            return self.context
        assert self.prompt_tokens is not None and self.output_tokens is not None
        return self.prompt_tokens + self.output_tokens

    @property
    def decode_context(self) -> int:
        """The mean context a decode step reads per request: prompt + output / 2 (the full
        ``context`` when the concurrency is given)."""
        if self.concurrency is not None:
            return self.request_tokens
        assert self.prompt_tokens is not None and self.output_tokens is not None
        return self.prompt_tokens + self.output_tokens // 2


def _number(value: Any, key: str, where: str, *, integer: bool) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        hint = ""
        if isinstance(value, str):
            try:
                float(value)
                hint = (" (YAML 1.1 reads an exponent without a dot, like 1e9, as text: "
                        "write 1.0e+9 or 1000000000)")
            except ValueError:
                pass
        raise MemfitError(f"{where}: {key} must be a number, got {value!r}{hint}")
    if integer:
        if not float(value).is_integer() or value <= 0:
            raise MemfitError(f"{where}: {key} must be a positive integer, got {value!r}")
        return int(value)
    if not math.isfinite(value) or value <= 0:
        raise MemfitError(f"{where}: {key} must be a number > 0, got {value!r}")
    return float(value)


def tenant_from_dict(data: Mapping[str, Any], index: int = 0) -> Tenant:
    """A :class:`Tenant` from one entry of a tenants file (keys as in docs/pack.md)."""
    where = f"tenant {index}"
    if not isinstance(data, Mapping):
        raise MemfitError(f"{where}: expected a mapping of keys (name, model, qps, ...), got "
                          f"{type(data).__name__}")
    for key in data:
        if key not in _TENANT_KEYS:
            raise MemfitError(f"{where}: unknown key {key!r}{suggest(str(key), _TENANT_KEYS)}; "
                              f"valid: {', '.join(_TENANT_KEYS)}")
    name = data.get("name", data.get("model"))
    if not isinstance(name, str) or not name:
        raise MemfitError(f"{where}: give it a name (a string)")
    where = f"tenant {name!r}"
    model = data.get("model")
    if not (isinstance(model, str) and model) and not isinstance(model, Mapping):
        raise MemfitError(f"{where}: model must be a preset, config.json path or hub id")
    kw: dict[str, Any] = {"name": name, "model": model}
    for key in ("prompt_tokens", "output_tokens", "concurrency", "context", "tp",
                "max_model_len", "max_num_seqs", "max_num_batched_tokens"):
        if data.get(key) is not None:
            kw[key] = _number(data[key], key, where, integer=True)
    for key in ("activation_peak_bytes", "cuda_graph_bytes"):
        if data.get(key) is not None:
            v = data[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise MemfitError(f"{where}: {key} must be a whole number of bytes >= 0")
            kw[key] = v
    if "qps" in data:
        qps = data["qps"]
        if isinstance(qps, (int, float)) and not isinstance(qps, bool) and qps <= 0:
            raise MemfitError(f"{where}: qps must be a number > 0, got {qps!r}; a tenant with "
                              "no traffic needs no GPU (remove it)")
        kw["qps"] = _number(qps, "qps", where, integer=False)
    for key in ("tpot_ms", "ttft_ms"):
        if data.get(key) is not None:
            kw[key.replace("_ms", "_s")] = _number(data[key], key, where, integer=False) / 1e3
    for key in ("quant", "kv_cache_dtype"):
        if data.get(key) is not None:
            kw[key] = str(data[key])
    if data.get("enforce_eager") is not None:
        eager = data["enforce_eager"]
        if not isinstance(eager, bool):  # bool("false") is True
            raise MemfitError(f"{where}: enforce_eager must be true or false, got {eager!r}")
        kw["enforce_eager"] = eager
    mig = data.get("mig")
    if mig is not None and mig is not False:
        kw["mig"] = "auto" if mig is True else str(mig).strip().lower()
    return Tenant(**kw)


def load_tenants(source: str | Path | Sequence[Any] | Mapping[str, Any]) -> list[Tenant]:
    """Tenants from a YAML or JSON file (YAML through ``yaml.safe_load`` only), or the parsed
    data: a list of tenants, or ``{"defaults": {...}, "tenants": [...]}`` where ``defaults``
    fills each tenant's missing keys."""
    data: Any = source
    if isinstance(source, (str, Path)):
        path = Path(source).expanduser()
        if not path.is_file():
            raise MemfitError(f"tenants file {str(path)!r} not found; pass a YAML or JSON file "
                              "(docs/pack.md shows the format)")
        text = path.read_text(encoding="utf-8")
        if path.suffix.lower() == ".json":
            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                raise MemfitError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}); "
                                  "fix the file") from None
        else:
            try:
                import yaml  # type: ignore[import-untyped]
            except ImportError:
                raise MemfitError("reading YAML needs PyYAML: pip install pyyaml (or pass the "
                                  "tenants as a .json file)") from None
            try:
                data = yaml.safe_load(text)
            except yaml.YAMLError as exc:
                mark = getattr(exc, "problem_mark", None)
                at = f" at line {mark.line + 1}" if mark is not None else ""
                raise MemfitError(f"{path}: not valid YAML{at}; fix the file "
                                  "(docs/pack.md shows the format)") from None
    defaults: Mapping[str, Any] = {}
    if isinstance(data, Mapping):
        unknown = set(data) - {"tenants", "defaults"}
        if unknown:
            raise MemfitError(f"unknown top-level keys {sorted(unknown)}; a tenants file is "
                              "{tenants: [...], defaults: {...}} or a list of tenants")
        defaults = data.get("defaults") or {}
        if not isinstance(defaults, Mapping):
            raise MemfitError("defaults must be a mapping of tenant keys")
        data = data.get("tenants")
    if not isinstance(data, list) or not data:
        raise MemfitError("expected a non-empty list of tenants (each with name, model and "
                          "qps / prompt_tokens / output_tokens); see docs/pack.md")
    tenants = [t if isinstance(t, Tenant) else
               tenant_from_dict({**defaults, **t} if isinstance(t, Mapping) else t, i)
               for i, t in enumerate(data)]
    names = [t.name for t in tenants]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise MemfitError(f"tenant names must be unique; repeated: {', '.join(dup)}")
    return tenants
