"""The GPU catalog: capacity, bandwidth, FLOPS, links and price, loaded from a data file.

The catalog ships as ``memfit/data/gpus.json`` (data, not code). Users add or override entries with
their own JSON file in the same format: passed explicitly (``--gpu-file``), else named by
``$MEMFIT_GPU_FILE``, else ``~/.config/memfit/gpus.json`` (``$XDG_CONFIG_HOME`` is honoured) when it
exists. A user entry whose name (or alias) is already in the catalog overrides only the fields it
gives; any other name adds a GPU and must give every required field. User files are parsed with
``json.loads`` only and validated strictly: every problem is one ``MemfitError`` line naming the
file, the entry and the fix.

Example::

    >>> from memfit.gpus import get_gpu
    >>> gpu = get_gpu("h100-80gb")
    >>> gpu.name, gpu.memory_bytes == 81559 * 2**20, gpu.supports("fp8")
    ('h100-sxm-80gb', True, True)
"""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from memfit import vocab
from memfit.errors import MemfitError, read_json_file, suggest
from memfit.gpu_entries import REQUIRED_NEW as _REQUIRED_NEW
from memfit.gpu_entries import TFLOPS_KEYS
from memfit.gpu_entries import entries as _entries
from memfit.gpu_entries import key as _key
from memfit.gpu_entries import validate_entry as _validate_entry

__all__ = ["GpuSpec", "Link", "get_gpu", "list_gpus", "load_catalog", "user_gpu_file"]

ENV_VAR = "MEMFIT_GPU_FILE"
"""Formats with a dense peak TFLOPS figure in every entry (None: unsupported)."""
PRECISIONS = ("fp32", "tf32", "fp16", "bf16", "fp8")
"""What ``GpuSpec.supports`` answers for (``-mixed``/``-true`` suffixes are accepted)."""
VENDOR_TARGETS = {"nvidia": "cuda", "amd": "rocm", "apple": "mps"}
"""The PyTorch backend of each vendor's GPUs (a user GPU of another vendor plans as CUDA)."""


@dataclass(frozen=True, kw_only=True)
class Link:
    """A host or GPU-to-GPU interconnect."""

    kind: str
    """e.g. "PCIe 5.0 x16", "NVLink 4"."""
    gbps: float
    """Bandwidth in GB/s (1e9 bytes/s) per direction."""
    generation: int | None = None
    """PCIe or NVLink generation (4 for PCIe 4.0 or NVLink 4); None when not applicable."""


@dataclass(frozen=True, kw_only=True)
class GpuSpec:
    """One GPU model.

    Known limitations: FLOPS are dense peak datasheet figures (no sparsity); real matmuls reach
    60-80% of them. Prices are typical on-demand cloud prices at the stated date. ``usable_bytes``
    equals ``memory_bytes`` unless PyTorch's ``total_memory`` was measured for that board; the CUDA
    context and library workspaces still come out of it (the planner's ``runtime`` category).
    """

    name: str
    """Canonical catalog key, e.g. ``h100-sxm-80gb``."""
    label: str
    """Marketing name, e.g. ``NVIDIA H100 SXM5 80GB``."""
    vendor: str
    memory_label: str
    """Marketing capacity, e.g. ``80 GB HBM3``."""
    memory_bytes: int
    """Total device memory as the driver reports it (nvidia-smi's MiB x 2**20) where known."""
    usable_bytes: int
    """What a framework can allocate from: ``torch.cuda.get_device_properties().total_memory``
    where known, else ``memory_bytes``. ``fits`` compares against this."""
    bandwidth_gbps: float
    """Memory bandwidth in GB/s."""
    tflops: dict[str, float | None]
    """Dense peak TFLOPS by format: keys fp32, tf32, fp16, bf16, fp8 (None: unsupported)."""
    bf16: bool
    fp8: bool
    compute_capability: str | None
    host_link: Link
    gpu_link: Link | None
    price_per_hour: float | None
    price_source: str | None
    price_date: str | None
    sources: tuple[str, ...] = ()
    aliases: tuple[str, ...] = field(default=())
    memory_basis: str = "driver"
    """Where ``memory_bytes`` comes from: ``driver`` (reported for this board),
    ``driver-sister-board`` (reported for a board with the same GPU and memory stacks),
    ``marketing`` (the label's decimal GB: a conservative fallback), ``user`` (a user file)."""
    notes: str = ""
    """Caveats for this entry: where a figure comes from, what is approximate."""
    usable_measured: bool = False
    """Whether ``usable_bytes`` is PyTorch's ``total_memory`` (cudaDeviceProp.totalGlobalMem)
    from a published measurement; False: it is the driver total ``memory_bytes`` (nvidia-smi),
    about 1-2% more than PyTorch's total on the boards measured (A100, T4, RTX 3090)."""
    unified_memory: bool = False
    """Whether the GPU shares system memory with the CPU (Jetson, Apple silicon): then what a
    run can use is ``memory_bytes`` less ``host_reserve_bytes``, not the whole memory."""
    host_reserve_bytes: int | None = None
    """Unified memory only: what the OS and the CPU side keep (Jetson: a documented default;
    ``memfit plan --host-reserve`` overrides it). None on Apple silicon: Metal's recommended
    working set decides (``memory_bytes - recommended_working_set_bytes``)."""
    recommended_working_set_bytes: int | None = None
    """Apple silicon only: Metal's ``recommendedMaxWorkingSetSize``
    (``torch.mps.recommended_max_memory()`` on the machine), which PyTorch's MPS allocator
    scales by ``PYTORCH_MPS_HIGH_WATERMARK_RATIO`` for its hard limit."""
    host_reserve_source: str = "catalog default"
    """Where ``host_reserve_bytes`` comes from: the catalog (its notes give the basis), a user
    file, or the option that set it for a plan (``--host-reserve``)."""
    host_memory_per_gpu_bytes: int | None = None
    """Host RAM per GPU of a cloud machine with this GPU (the machine's RAM over its GPUs), where
    the catalog knows one; :func:`memfit.fitting.rightsize.rightsize_training` drops the
    configurations whose offloaded states need more (None: its documented default)."""
    host_memory_source: str | None = None
    """The machine ``host_memory_per_gpu_bytes`` comes from, with its published figure."""
    mps_high_watermark_ratio: float | None = None
    """Apple silicon only: the ``PYTORCH_MPS_HIGH_WATERMARK_RATIO`` planned for (None: PyTorch's
    default, :data:`memfit.runtime.mps.DEFAULT_HIGH_WATERMARK_RATIO`)."""

    @property
    def target(self) -> str:
        """The PyTorch backend this GPU runs: ``cuda`` (NVIDIA), ``rocm`` (AMD, HIP) or
        ``mps`` (Apple); each has its own runtime constants (:mod:`memfit.runtime`).

        >>> get_gpu("mi300x").target, get_gpu("h100-80gb").target
        ('rocm', 'cuda')
        """
        return VENDOR_TARGETS.get(self.vendor, "cuda")

    def supports(self, precision: str) -> bool:
        """Whether the GPU computes in ``precision`` (fp32, tf32, fp16, bf16, fp8; a ``-mixed`` or
        ``-true`` suffix is ignored). fp32 and fp16 are always supported.

        >>> get_gpu("v100-16gb").supports("bf16-mixed")
        False
        """
        key = precision.strip().lower().replace("_", "-")
        for suffix in ("-mixed", "-true"):
            key = key.removesuffix(suffix)
        if key == "tf32":
            return self.tflops.get("tf32") is not None
        if key not in PRECISIONS:
            raise MemfitError(f"unknown precision {precision!r}{suggest(key, PRECISIONS)}; "
                              f"valid: {', '.join(PRECISIONS)}")
        needs = vocab.precision(key).needs  # fp32 and fp16 need nothing
        if needs == "bf16":
            return self.bf16
        if needs == "fp8":
            return self.fp8
        return True


# --------------------------------------------------------------------------------------------
# Lookup


def user_gpu_file(extra_file: str | Path | None = None) -> Path | None:
    """The user catalog file in effect: ``extra_file``, else ``$MEMFIT_GPU_FILE``, else
    ``$XDG_CONFIG_HOME/memfit/gpus.json`` (default ``~/.config``) when it exists, else None."""
    if extra_file is not None and str(extra_file) != "":
        return Path(extra_file).expanduser()
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env).expanduser()
    config_home = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    default = Path(config_home) / "memfit" / "gpus.json"
    return default if default.is_file() else None


def load_catalog(extra_file: str | Path | None = None) -> dict[str, GpuSpec]:
    """Every GPU by canonical name: the built-in catalog merged with the user file in effect
    (see ``user_gpu_file``). The built-in part is parsed once and cached.

    >>> catalog = load_catalog()
    >>> catalog["a100-sxm-80gb"].bandwidth_gbps
    2039.0
    """
    path = user_gpu_file(extra_file)
    if path is None:
        return dict(_builtin())
    return _merge(_builtin_raw(), _read_user_file(path), str(path))


def list_gpus(extra_file: str | Path | None = None) -> list[GpuSpec]:
    """The catalog in file order (built-in first, then user additions)."""
    return list(load_catalog(extra_file).values())


def get_gpu(name: str, extra_file: str | Path | None = None) -> GpuSpec:
    """Look up a GPU by canonical name, alias or the label ``memfit plan`` prints
    (case-insensitive; ``_`` and spaces read as ``-``).

    A name that fits several GPUs of the catalog (``a100``: the 40 and 80 GB boards) is refused
    with the candidates, never resolved to one of them.

    >>> get_gpu("RTX_4090").name, get_gpu("NVIDIA GeForce RTX 4090").name
    ('rtx-4090', 'rtx-4090')
    """
    catalog = load_catalog(extra_file)
    canonical = _index(catalog).get(_key(name))
    if canonical is not None:
        return catalog[canonical]
    candidates = _matching(catalog, name)
    if len(candidates) > 1:
        listed = ", ".join(f"{c.name} ({c.memory_label})" for c in candidates)
        raise MemfitError(f"GPU {name!r} fits {len(candidates)} catalog GPUs: {listed}; name "
                          "one of them (`memfit gpus` lists the catalog)")
    close = [c.name for c in candidates] or _closest(catalog, name)
    hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
    raise MemfitError(
        f"unknown GPU {name!r}{hint}; run `memfit gpus` to list the catalog, or pass "
        f"--gpu-file FILE (or set ${ENV_VAR}) to add your own")


def _tokens(text: str) -> set[str]:
    """The words of a name: ``NVIDIA A100 SXM4 80GB`` -> {nvidia, a100, sxm4, 80gb}."""
    return {t for t in re.split(r"[^a-z0-9.]+", text.lower()) if t}


def _matching(catalog: Mapping[str, GpuSpec], name: str) -> list[GpuSpec]:
    """The GPUs whose names (canonical, aliases, label) hold every word of ``name``, in catalog
    order: ``h100`` -> the SXM, PCIe and NVL boards; ``geforce 4090`` -> rtx-4090."""
    words = _tokens(name)
    if not words:
        return []
    return [spec for spec in catalog.values()
            if words <= set().union(*(_tokens(k) for k in (spec.name, *spec.aliases, spec.label)))]


def _closest(catalog: Mapping[str, GpuSpec], name: str, n: int = 3) -> list[str]:
    """The canonical names (the ones `memfit gpus` lists) of the GPUs with a spelling closest
    to ``name``: "h10" finds the h100 boards through their aliases."""
    spellings: dict[str, str] = {}
    for spec in catalog.values():
        for key in (spec.name, *spec.aliases, spec.label):
            spellings.setdefault(_key(key), spec.name)
    close = difflib.get_close_matches(_key(name), list(spellings), n=4 * n, cutoff=0.5)
    return list(dict.fromkeys(spellings[c] for c in close))[:n]


def _index(catalog: Mapping[str, GpuSpec]) -> dict[str, str]:
    """Lookup key -> canonical name: every name and alias, and each label that one GPU has."""
    index: dict[str, str] = {}
    for spec in catalog.values():
        for key in (spec.name, *spec.aliases):
            index.setdefault(_key(key), spec.name)
    labels = [_key(spec.label) for spec in catalog.values()]
    for spec, label in zip(catalog.values(), labels, strict=True):
        if labels.count(label) == 1:
            index.setdefault(label, spec.name)
    return index


# --------------------------------------------------------------------------------------------
# Loading and validation


@cache
def _builtin_text() -> str:
    return resources.files("memfit").joinpath("data/gpus.json").read_text(encoding="utf-8")


@cache
def _builtin_raw() -> tuple[tuple[str, dict[str, Any]], ...]:
    """The packaged entries, validated, as (canonical name, raw dict) pairs in file order."""
    try:
        entries = _entries(json.loads(_builtin_text()), "gpus.json (built-in)")
        for entry in entries:
            _validate_entry(entry, "gpus.json (built-in)", new=True)
    except MemfitError as exc:  # a broken packaged file is our bug, not the user's
        raise RuntimeError(str(exc)) from None
    return tuple((_key(entry["name"]), entry) for entry in entries)


@cache
def _builtin() -> dict[str, GpuSpec]:
    try:
        specs = {name: _build(entry, "gpus.json (built-in)") for name, entry in _builtin_raw()}
        _check_unique_names(specs, "gpus.json (built-in)")
    except MemfitError as exc:
        raise RuntimeError(str(exc)) from None
    return specs


def _read_user_file(path: Path) -> list[dict[str, Any]]:
    data = read_json_file(path, what="GPU file", fix=(
        f"pass a JSON object with a \"gpus\" list to --gpu-file (or fix ${ENV_VAR})"))
    return _entries(data, str(path))


def _link(raw: dict[str, Any] | None, where: str, gpu: str, fld: str) -> Link | None:
    if raw is None:
        return None
    for k in ("kind", "gbps"):
        if k not in raw:
            raise MemfitError(f"{where}: GPU {gpu!r} {fld} is missing {k!r}; write it as "
                              f"{{\"kind\": \"PCIe 4.0 x16\", \"gbps\": 31.5}}")
    gen = raw.get("generation")
    return Link(kind=raw["kind"], gbps=float(raw["gbps"]),
                generation=None if gen is None else int(gen))


def _build(entry: dict[str, Any], where: str, *, user_reserve: bool = False) -> GpuSpec:
    """A GpuSpec from a validated, merged raw entry; derives the optional fields' defaults
    (``user_reserve``: the user file gave ``host_reserve_bytes``)."""
    name = _key(entry["name"])
    memory_bytes = int(entry["memory_bytes"])
    usable = entry.get("usable_bytes")
    usable_bytes = memory_bytes if usable is None else int(usable)
    if usable_bytes > memory_bytes:
        raise MemfitError(f"{where}: GPU {name!r} usable_bytes ({usable_bytes}) exceeds "
                          f"memory_bytes ({memory_bytes}); usable memory cannot exceed the total, "
                          f"fix one of them")
    unified = bool(entry.get("unified_memory", False))
    reserve = entry.get("host_reserve_bytes")
    recommended = entry.get("recommended_working_set_bytes")
    for fld, value in (("host_reserve_bytes", reserve),
                       ("recommended_working_set_bytes", recommended)):
        if value is not None and not unified:
            raise MemfitError(f"{where}: GPU {name!r} gives {fld} but not \"unified_memory\": "
                              f"true; it applies only where the GPU shares system memory")
        if value is not None and int(value) >= memory_bytes:
            raise MemfitError(f"{where}: GPU {name!r} {fld} ({int(value)}) is not below "
                              f"memory_bytes ({memory_bytes}); fix one of them")
    tflops_raw = entry["tflops"]
    tflops = {k: (None if tflops_raw.get(k) is None else float(tflops_raw[k]))
              for k in TFLOPS_KEYS}
    host_link = _link(entry["host_link"], where, name, "host_link")
    assert host_link is not None  # validated: host_link is required and not null
    return GpuSpec(
        name=name,
        label=entry.get("label", name),
        vendor=entry.get("vendor", "custom"),
        memory_label=entry.get("memory_label", f"{memory_bytes / 1e9:.0f} GB"),
        memory_bytes=memory_bytes,
        usable_bytes=usable_bytes,
        bandwidth_gbps=float(entry["bandwidth_gbps"]),
        tflops=tflops,
        bf16=entry["bf16"],
        fp8=entry["fp8"],
        compute_capability=entry.get("compute_capability"),
        host_link=host_link,
        gpu_link=_link(entry.get("gpu_link"), where, name, "gpu_link"),
        price_per_hour=(None if entry.get("price_per_hour") is None
                        else float(entry["price_per_hour"])),
        price_source=entry.get("price_source"),
        price_date=entry.get("price_date"),
        sources=tuple(entry.get("sources", ())),
        aliases=tuple(_key(a) for a in entry.get("aliases", ())),
        memory_basis=entry.get("memory_basis", "user"),
        notes=entry.get("notes", ""),
        usable_measured=usable is not None,
        unified_memory=unified,
        host_reserve_bytes=None if reserve is None else int(reserve),
        host_reserve_source=f"user file {where}" if user_reserve else "catalog default",
        recommended_working_set_bytes=None if recommended is None else int(recommended),
        host_memory_per_gpu_bytes=(None if entry.get("host_memory_per_gpu_bytes") is None
                                   else int(entry["host_memory_per_gpu_bytes"])),
        host_memory_source=entry.get("host_memory_source"),
    )


def _merge(builtin: tuple[tuple[str, dict[str, Any]], ...], user: list[dict[str, Any]],
           where: str) -> dict[str, GpuSpec]:
    """Built-in raw entries overlaid with the user's: partial overrides by name or alias, nested
    ``tflops``/links merged key by key; new names added after the built-in ones."""
    merged: dict[str, dict[str, Any]] = {name: dict(entry) for name, entry in builtin}
    index: dict[str, str] = {}
    for name, entry in builtin:
        for key in (name, *entry.get("aliases", ())):
            index.setdefault(_key(key), name)
    seen: set[str] = set()
    for entry in user:
        key = _key(entry["name"])
        target = index.get(key, key if key in merged else None)
        if target in seen or (target is None and key in seen):
            raise MemfitError(f"{where}: GPU {entry['name']!r} appears twice; keep one entry per "
                              f"GPU")
        if target is not None:  # override an existing entry, field by field
            _validate_entry(entry, where, new=False)
            base = merged[target]
            # Note: [stale provenance] a changed figure must not keep the built-in's provenance:
            # a new total resets the derived usable bytes and the memory basis, a new price
            # drops the built-in's source and date unless the user gives their own.
            if "memory_bytes" in entry:
                base.update(usable_bytes=None, memory_basis="user")
            if "price_per_hour" in entry:
                base.update(price_source=f"user file {where}", price_date=None)
            if "host_memory_per_gpu_bytes" in entry:
                base.update(host_memory_source=f"user file {where}")
            for fld, value in entry.items():
                if fld == "name":
                    continue
                if fld in ("tflops", "host_link", "gpu_link") and isinstance(value, dict) \
                        and isinstance(base.get(fld), dict):
                    base[fld] = {**base[fld], **value}
                else:
                    base[fld] = value
            seen.add(target)
        else:
            close = [spec.name for spec in _matching(_builtin(), key)]
            if close and any(k not in entry for k in _REQUIRED_NEW):
                raise MemfitError(f"{where}: GPU {entry['name']!r} is not a catalog name; to "
                                  f"override some fields use one of {', '.join(close)}, or give "
                                  f"every required field ({', '.join(_REQUIRED_NEW)}) to add it")
            _validate_entry(entry, where, new=True)
            merged[key] = dict(entry, name=key)
            seen.add(key)
    reserved = {index.get(_key(e["name"]), _key(e["name"])) for e in user
                if "host_reserve_bytes" in e}
    specs = {name: _build(entry, where, user_reserve=name in reserved)
             for name, entry in merged.items()}
    _check_unique_names(specs, where)
    return specs


def _check_unique_names(specs: Mapping[str, GpuSpec], where: str) -> None:
    owner: dict[str, str] = {}
    for spec in specs.values():
        for key in (spec.name, *spec.aliases):
            other = owner.setdefault(key, spec.name)
            if other != spec.name:
                raise MemfitError(f"{where}: name or alias {key!r} is used by both {other!r} and "
                                  f"{spec.name!r}; give each GPU distinct names")
