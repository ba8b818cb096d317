"""The fields of a GPU entry, and the checks of an entry in a user's GPU file (``--gpu-file``).

``memfit.gpus`` builds the catalog from entries these checks have passed: every problem is one
``MemfitError`` line naming the file, the entry and the fix.
"""

from __future__ import annotations

import math
import re
from typing import Any

from memfit.errors import MemfitError, suggest

TFLOPS_KEYS = ("fp32", "tf32", "fp16", "bf16", "fp8")
MEMORY_BASES = ("driver", "driver-sister-board", "marketing", "label-gib", "user")


def key(name: str) -> str:
    """Lower-case kebab key: ``H100_SXM 80GB`` -> ``h100-sxm-80gb``."""
    return re.sub(r"[\s_\-]+", "-", name.strip().lower()).strip("-")


def entries(data: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(data, dict):
        unknown = set(data) - {"version", "notes", "gpus"}
        if unknown:
            raise MemfitError(f"{where}: unknown top-level keys {sorted(unknown)}; a GPU file is "
                              f"{{\"gpus\": [...]}} (optionally with \"version\" and \"notes\")")
        data = data.get("gpus")
    if not isinstance(data, list) or not data:
        raise MemfitError(f"{where}: expected a JSON object with a non-empty \"gpus\" list of GPU "
                          f"entries; see `memfit gpus` for the fields")
    for i, entry in enumerate(data):
        if not isinstance(entry, dict):
            raise MemfitError(f"{where}: entry {i} of \"gpus\" is {type(entry).__name__}, not an "
                              f"object; write each GPU as {{\"name\": ..., ...}}")
        if not isinstance(entry.get("name"), str) or not key(entry["name"]):
            raise MemfitError(f"{where}: entry {i} of \"gpus\" has no \"name\" string; give each "
                              f"GPU a name such as \"my-gpu-48gb\"")
    return [dict(e) for e in data]


REQUIRED_NEW = ("name", "memory_bytes", "bandwidth_gbps", "tflops", "bf16", "fp8", "host_link")
OPTIONAL = ("label", "vendor", "memory_label", "usable_bytes", "compute_capability", "gpu_link",
             "price_per_hour", "price_source", "price_date", "sources", "aliases", "memory_basis",
             "notes", "unified_memory", "host_reserve_bytes", "recommended_working_set_bytes",
             "host_memory_per_gpu_bytes", "host_memory_source")
FIELDS = (*REQUIRED_NEW, *OPTIONAL)


def validate_entry(entry: dict[str, Any], where: str, *, new: bool) -> None:
    """Raise MemfitError for the first problem in ``entry`` (``new``: every required field)."""
    gpu = entry["name"]
    for key in entry:
        if key not in FIELDS:
            raise MemfitError(f"{where}: GPU {gpu!r} has unknown field {key!r}"
                              f"{suggest(key, FIELDS)}; valid fields: {', '.join(FIELDS)}")
    if new:
        missing = [k for k in REQUIRED_NEW if k not in entry]
        if missing:
            raise MemfitError(f"{where}: new GPU {gpu!r} is missing required field(s) "
                              f"{', '.join(missing)}; a new GPU needs {', '.join(REQUIRED_NEW)} "
                              f"(or use the name of a catalog GPU to override only some fields)")

    def bad(fld: str, what: str) -> MemfitError:
        return MemfitError(f"{where}: GPU {gpu!r} field {fld!r} must be {what}, got "
                           f"{entry[fld]!r}; fix that value")

    for fld in ("memory_bytes", "usable_bytes", "host_reserve_bytes",
                "recommended_working_set_bytes", "host_memory_per_gpu_bytes"):
        if fld in entry and not (fld != "memory_bytes" and entry[fld] is None):
            if not is_number(entry[fld]) or entry[fld] <= 0 or not float(entry[fld]).is_integer():
                raise bad(fld, "a positive whole number of bytes (e.g. 85520809984)")
    if "bandwidth_gbps" in entry and (not is_number(entry["bandwidth_gbps"])
                                      or entry["bandwidth_gbps"] <= 0):
        raise bad("bandwidth_gbps", "a positive number of GB/s")
    if "price_per_hour" in entry and entry["price_per_hour"] is not None and (
            not is_number(entry["price_per_hour"]) or entry["price_per_hour"] < 0):
        raise bad("price_per_hour", "a non-negative number of US dollars, or null")
    for fld in ("bf16", "fp8", "unified_memory"):
        if fld in entry and not isinstance(entry[fld], bool):
            raise bad(fld, "true or false")
    for fld in ("label", "vendor", "memory_label", "notes"):
        if fld in entry and not isinstance(entry[fld], str):
            raise bad(fld, "a string")
    for fld in ("compute_capability", "price_source", "price_date", "host_memory_source"):
        if fld in entry and entry[fld] is not None and not isinstance(entry[fld], str):
            raise bad(fld, "a string or null")
    if entry.get("price_date") is not None and not re.fullmatch(
            r"\d{4}-\d{2}(-\d{2})?", entry["price_date"]):
        raise bad("price_date", "a date written YYYY-MM-DD (or YYYY-MM)")
    for fld in ("sources", "aliases"):
        if fld in entry and (not isinstance(entry[fld], list)
                             or not all(isinstance(s, str) and s for s in entry[fld])):
            raise bad(fld, "a list of non-empty strings")
    if "memory_basis" in entry and entry["memory_basis"] not in MEMORY_BASES:
        raise bad("memory_basis", f"one of {', '.join(MEMORY_BASES)}")
    if "tflops" in entry:
        tflops = entry["tflops"]
        if not isinstance(tflops, dict):
            raise bad("tflops", f"an object with keys {', '.join(TFLOPS_KEYS)}")
        for k, v in tflops.items():
            if k not in TFLOPS_KEYS:
                raise MemfitError(f"{where}: GPU {gpu!r} tflops has unknown key {k!r}"
                                  f"{suggest(k, TFLOPS_KEYS)}; valid: {', '.join(TFLOPS_KEYS)}")
            if v is not None and (not is_number(v) or v < 0):
                raise MemfitError(f"{where}: GPU {gpu!r} tflops.{k} must be a non-negative "
                                  f"number or null (unsupported), got {v!r}; fix that value")
    for fld in ("host_link", "gpu_link"):
        if fld not in entry or (fld == "gpu_link" and entry[fld] is None):
            continue
        link = entry[fld]
        if not isinstance(link, dict):
            raise bad(fld, "an object {\"kind\": str, \"gbps\": number}" +
                      (" or null" if fld == "gpu_link" else ""))
        for k in link:
            if k not in ("kind", "gbps", "generation"):
                raise MemfitError(f"{where}: GPU {gpu!r} {fld} has unknown key {k!r}; valid: "
                                  f"kind, gbps, generation")
        if "kind" in link and not isinstance(link["kind"], str):
            raise MemfitError(f"{where}: GPU {gpu!r} {fld}.kind must be a string such as "
                              f"\"PCIe 4.0 x16\", got {link['kind']!r}; fix that value")
        if "gbps" in link and (not is_number(link["gbps"]) or link["gbps"] <= 0):
            raise MemfitError(f"{where}: GPU {gpu!r} {fld}.gbps must be a positive number of GB/s "
                              f"per direction, got {link['gbps']!r}; fix that value")
        gen = link.get("generation")
        if gen is not None and (not is_number(gen) or gen < 1 or not float(gen).is_integer()):
            raise MemfitError(f"{where}: GPU {gpu!r} {fld}.generation must be a positive whole "
                              f"number or null, got {gen!r}; fix that value")


def is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))
