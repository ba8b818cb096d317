"""Rates pinned by the user (``memfit fit --rates``, ``fit(rates=...)``, a rates file or a saved
plan's): parsed, checked for plausible units and merged; :func:`memfit.fitting.rates.target_rates`
puts them in place of the catalog's or the measured ones."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from memfit import vocab
from memfit.errors import MemfitError, read_json_file, suggest
from memfit.units import parse_rate

TFLOPS_KEY = {p: vocab.precision(p).matmul for p in ("fp32", "bf16-mixed", "bf16", "fp16-mixed")}
"""The catalog's matmul rate key of each precision fit costs."""
PINNABLE = ("flops", "bandwidth", "host_link", "gpu_link", "inter_node_link", "launch_s",
            "async_launch", "sac_op_s")
_UNIT = {"flops": "FLOP/s", "bandwidth": "B/s", "host_link": "B/s", "gpu_link": "B/s",
         "inter_node_link": "B/s", "launch_s": "s", "sac_op_s": "s"}


def _plausible(key: str, value: float, what: str) -> float:
    """Catch a rate written in the wrong unit (GFLOP/s for FLOP/s, microseconds for seconds)."""
    if key in ("launch_s", "sac_op_s") and value > 1:
        raise MemfitError(f"{what} is {value:g} s per op, over a second: write seconds, e.g. "
                          "8e-6 or '8us'")
    if key not in ("launch_s", "sac_op_s") and value < 1e6:
        unit = _UNIT[key]
        raise MemfitError(f"{what} is {value:g} {unit}, under a million: write {unit}, e.g. "
                          + ("113e9 or '113G'" if key == "flops" else "20e9 or '20GB/s'"))
    return value


def parse_pin(key: str, value: Any, what: str) -> Any:
    """One pinned rate, checked: ``flops`` is a rate in FLOP/s for every precision, an object
    ``{precision: rate}`` or the text ``"fp32=113G,bf16-mixed=40G"`` (``"*"``: every precision
    not named; returned as such an object); ``bandwidth``,
    ``host_link``, ``gpu_link`` (``None``: no link) and ``inter_node_link`` are bytes/s;
    ``launch_s`` and ``sac_op_s`` (0: none) seconds per op; ``async_launch`` a bool. Rates
    are numbers or text with an SI prefix (``20GB/s``, ``8us``). ``what`` names the value in
    an error."""
    if key == "async_launch":
        if not isinstance(value, bool):
            raise MemfitError(f"{what} must be true or false, got {value!r}")
        return value
    if key in ("gpu_link", "inter_node_link") and value is None:
        return None
    if key == "sac_op_s" and not isinstance(value, bool) and value in (0, "0"):
        return 0.0  # no selective-checkpointing term (a CPU target's; a saved CPU plan's)
    if key == "flops":
        if isinstance(value, str) and "=" in value:
            pairs = [part.partition("=") for part in value.split(",") if part.strip()]
            value = {name.strip(): rate.strip() for name, _, rate in pairs}
        if not isinstance(value, Mapping):
            value = {"*": value}
        if not value:
            raise MemfitError(f"{what} names no precision; write e.g. fp32=113G,bf16-mixed=40G")
        names = (*TFLOPS_KEY, "*")
        out = {}
        for name, rate in value.items():
            if name not in names:
                raise MemfitError(f"{what}: unknown precision {name!r}; valid: "
                                  f"{', '.join(names)}{suggest(str(name), names)}")
            label = what if name == "*" else f"{what} {name}"
            out[name] = _plausible(key, parse_rate(rate, what=label, unit="FLOP/s"), label)
        return out
    return _plausible(key, parse_rate(value, what=what, unit=_UNIT[key]), what)


def merge_pins(pins: dict[str, Any], more: Mapping[str, Any]) -> dict[str, Any]:
    """``pins`` with ``more`` (both checked, :func:`parse_pin`) over them: ``more``'s FLOP/s
    replace those of the precisions it names, all of them when it gives ``"*"``."""
    out = {**pins, **more}
    if "flops" in pins and "flops" in more and "*" not in more["flops"]:
        out["flops"] = {**pins["flops"], **more["flops"]}
    return out


def check_pins(data: Mapping[str, Any], *, source: str) -> dict[str, Any]:
    """``data``'s pinned rates, checked (:func:`parse_pin`), with ``"source"`` set to
    ``data["source"]`` or ``source``; a ``format`` key is ignored."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key in ("source", "format"):
            continue
        if key not in PINNABLE:
            raise MemfitError(f"{source}: unknown rate {key!r}; valid: {', '.join(PINNABLE)}"
                              f"{suggest(str(key), PINNABLE)}")
        out[key] = parse_pin(key, value, f"{source}: {key}")
    if not out:
        raise MemfitError(f"{source} pins no rate; give one of {', '.join(PINNABLE)}, e.g. "
                          "{\"flops\": 113e9, \"bandwidth\": 20e9, \"launch_s\": 4e-6}")
    out["source"] = str(data.get("source") or source)
    return out


def load_rates(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The pinned rates of a JSON file: an object of :func:`parse_pin`'s keys, or a plan saved
    by ``memfit fit --save`` / :meth:`memfit.Plan.save` (its ``rates``).

    >>> memfit.fit(model, batch, global_batch=64, budget_bytes=2**30, device="cpu",
    ...            rates=load_rates("rates.json"))
    """
    fix = ("write a JSON object such as {\"flops\": 113e9, \"bandwidth\": 20e9, \"launch_s\": "
           "4e-6}, or give a plan saved by memfit fit --save")
    data = read_json_file(os.fspath(path), what="rates file", fix=fix)
    source = f"rates file {path}"
    if isinstance(data, dict) and str(data.get("format", "")).startswith("memfit-plan/"):
        if not isinstance(data.get("rates"), dict):
            raise MemfitError(f"{source}: this plan has no rates (saved by an older memfit); "
                              "re-create it with memfit fit --save, or " + fix)
        data = data["rates"]
    if not isinstance(data, dict):
        raise MemfitError(f"{source} holds {type(data).__name__}, not an object; {fix}")
    return check_pins({k: v for k, v in data.items() if k != "source"}, source=source)


def describe_pins(pins: Mapping[str, Any]) -> str:
    flops = dict(pins.get("flops") or {})
    rest = flops.pop("*", None)
    parts = [f"{name} matmul {rate / 1e9:.0f} GFLOP/s" for name, rate in flops.items()]
    if rest is not None:
        parts.append(f"{'other precisions' if flops else 'matmul'} {rest / 1e9:.0f} GFLOP/s")
    for key, label in (("bandwidth", "memory"), ("host_link", "host link"),
                       ("gpu_link", "GPU link"), ("inter_node_link", "inter-node link")):
        if pins.get(key) is not None:
            parts.append(f"{label} {pins[key] / 1e9:.1f} GB/s")
    if "launch_s" in pins:
        parts.append(f"dispatch {pins['launch_s'] * 1e6:.1f} us")
    if "sac_op_s" in pins:
        parts.append(f"selective checkpointing {pins['sac_op_s'] * 1e6:.1f} us an op")
    return ", ".join(parts)
