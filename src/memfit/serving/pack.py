"""``memfit pack``: place several served models (tenants), each with its traffic, onto a GPU
pool, whole GPUs shared or MIG slices, with memory and HBM bandwidth both constraining.

Each tenant (:mod:`memfit.serving.tenants`) needs memory and HBM bandwidth on each GPU of its
TP group (:mod:`memfit.serving.pack_need` has the model).

Capacities: a whole GPU's ``usable_bytes`` and ``HBM_EFFICIENCY x`` its bandwidth; a MIG
instance its ``nvidia-smi`` memory and ``memory_slices / 8`` of that bandwidth
(:mod:`memfit.serving.mig`). Tenants sharing a whole GPU add up in both; a MIG instance holds
one tenant, and a GPU's instances must form a valid MIG combination.

The packer minimises (tenants left unplaced, GPUs used): first-fit decreasing by each tenant's
larger fraction of a GPU (memory or bandwidth), then, when the instance has at most
:data:`EXACT_MAX_TENANTS` tenants and :data:`EXACT_MAX_GPUS` GPUs, an exhaustive
branch-and-bound search whose answer replaces the heuristic's (first-fit decreasing can use
more GPUs than needed: items 5, 4, 3, 3, 3, 2 in bins of 10 take 3 bins, 2 suffice).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import combinations
from pathlib import Path
from typing import Any

from memfit.errors import MemfitError
from memfit.serving.mig import MigProfile, mig_profile, mig_profiles, valid_combination
from memfit.serving.pack_need import (
    HBM_EFFICIENCY,
    PREFILL_MFU,
    Demand,
    Device,
    device,
    model_key,
    parse_pool,
    tenant_demand,
    tenant_targets,
)
from memfit.serving.tenants import DEFAULT_TPOT_S, Tenant, load_tenants
from memfit.serving.tenants import tenant_from_dict as tenant_from_dict

__all__ = ["DEFAULT_TPOT_S", "EXACT_MAX_GPUS", "EXACT_MAX_TENANTS", "HBM_EFFICIENCY",
           "PREFILL_MFU", "Demand", "Item", "PackResult", "Packing", "Tenant", "load_tenants",
           "pack", "pack_items", "parse_pool", "tenant_demand"]

EXACT_MAX_TENANTS = 8
"""The exhaustive search runs when the instance has at most this many tenants ..."""
EXACT_MAX_GPUS = 6
"""... and at most this many GPUs in the pool."""


# --------------------------------------------------------------------------------------------
# The packer, on abstract items


@dataclass(frozen=True, kw_only=True)
class Item:
    """A tenant as the packer sees it: ``tp`` GPUs of one type, each needing ``needs[(gpu,
    profile name or None)] = (memory bytes, bandwidth bytes/s)``; only the devices where it
    fits alone are keys. ``mig``: it runs on MIG instances (else on shared whole GPUs)."""

    name: str
    needs: Mapping[tuple[str, str | None], tuple[int, float]]
    tp: int = 1
    mig: bool = False


@dataclass
class _Gpu:
    kind: str
    mode: str | None = None  # None (empty), "whole", "mig"
    memory: int = 0
    bandwidth: float = 0.0
    profiles: list[MigProfile] = field(default_factory=list)
    placed: list[tuple[int, str | None]] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class Packing:
    """Which GPU (index into the pool) holds which items: ``gpus[g]`` is a list of ``(item
    index, MIG profile name or None)``; ``unplaced`` the items left out."""

    gpus: tuple[tuple[tuple[int, str | None], ...], ...]
    unplaced: tuple[int, ...]
    method: str
    """``exhaustive`` (optimal) or ``first-fit-decreasing``."""

    @property
    def used(self) -> int:
        return sum(1 for g in self.gpus if g)

    @property
    def cost(self) -> tuple[int, int]:
        return len(self.unplaced), self.used


class _Search:
    """The shared state of the heuristic and the exhaustive search over one instance."""

    def __init__(self, items: Sequence[Item], pool: Sequence[Any]) -> None:
        self.items = items
        self.kinds = [g.name for g in pool]
        self.caps = {g.name: device(g) for g in pool}
        self.mig = {g.name: {p.name: p for p in mig_profiles(g.name)} for g in pool}

    def fresh(self) -> list[_Gpu]:
        return [_Gpu(kind=k) for k in self.kinds]

    def whole_fits(self, gpu: _Gpu, i: int) -> bool:
        need = self.items[i].needs.get((gpu.kind, None))
        if need is None or gpu.mode == "mig":
            return False
        cap = self.caps[gpu.kind]
        return (gpu.memory + need[0] <= cap.memory_bytes
                and gpu.bandwidth + need[1] <= cap.bandwidth_bytes_per_s * (1 + 1e-12))

    def mig_options(self, gpu: _Gpu, i: int) -> Iterator[MigProfile]:
        """The profiles ``i`` may take on ``gpu`` now, smallest first."""
        if gpu.mode == "whole":
            return
        for name, p in self.mig[gpu.kind].items():
            if (gpu.kind, name) in self.items[i].needs and valid_combination(
                    [*gpu.profiles, p]):
                yield p

    def put(self, gpu: _Gpu, i: int, profile: MigProfile | None) -> None:
        item = self.items[i]
        if profile is None:
            m, b = item.needs[(gpu.kind, None)]
            gpu.mode, gpu.memory, gpu.bandwidth = "whole", gpu.memory + m, gpu.bandwidth + b
        else:
            gpu.mode = "mig"
            gpu.profiles.append(profile)
        gpu.placed.append((i, None if profile is None else profile.name))

    def take(self, gpu: _Gpu, i: int, profile: MigProfile | None) -> None:
        item = self.items[i]
        gpu.placed.pop()
        if profile is None:
            m, b = item.needs[(gpu.kind, None)]
            gpu.memory, gpu.bandwidth = gpu.memory - m, gpu.bandwidth - b
        else:
            gpu.profiles.pop()
        if not gpu.placed:
            gpu.mode, gpu.memory, gpu.bandwidth = None, 0, 0.0

    def size(self, i: int) -> float:
        """The item's weighted size: its larger fraction (memory or bandwidth) of the device
        it needs least of, times its TP GPUs."""
        item, best = self.items[i], math.inf
        for (kind, prof), (m, b) in item.needs.items():
            cap = self.caps[kind]
            if prof is None:
                frac = max(m / cap.memory_bytes, b / cap.bandwidth_bytes_per_s)
            else:
                frac = self.mig[kind][prof].memory_slices / 8
            best = min(best, frac)
        return item.tp * best if best < math.inf else 0.0

    def result(self, gpus: list[_Gpu], unplaced: list[int], method: str) -> Packing:
        return Packing(gpus=tuple(tuple(g.placed) for g in gpus), unplaced=tuple(unplaced),
                       method=method)

    # -- first-fit decreasing --------------------------------------------------------------

    def first_fit(self, order: Sequence[int]) -> Packing:
        gpus, unplaced = self.fresh(), []
        for i in order:
            if not self._first_fit_one(gpus, i):
                unplaced.append(i)
        return self.result(gpus, sorted(unplaced), "first-fit-decreasing")

    def _first_fit_one(self, gpus: list[_Gpu], i: int) -> bool:
        item = self.items[i]
        # open GPUs first, then empty ones, each in pool order
        ranked = sorted(range(len(gpus)), key=lambda g: (gpus[g].mode is None, g))
        if item.mig:
            for g in ranked:
                for p in self.mig_options(gpus[g], i):
                    self.put(gpus[g], i, p)
                    return True
            return False
        for kind in dict.fromkeys(self.kinds):
            chosen = [g for g in ranked if gpus[g].kind == kind and
                      self.whole_fits(gpus[g], i)][:item.tp]
            if len(chosen) == item.tp:
                for g in chosen:
                    self.put(gpus[g], i, None)
                return True
        return False

    # -- exhaustive branch and bound -------------------------------------------------------

    def exhaustive(self, order: Sequence[int], bound: Packing) -> Packing:
        gpus = self.fresh()
        best = [bound]
        unplaced: list[int] = []

        def used() -> int:
            return sum(1 for g in gpus if g.mode is not None)

        def dfs(k: int) -> None:
            if (len(unplaced), used()) >= best[0].cost:
                return
            if k == len(order):
                best[0] = self.result(gpus, sorted(unplaced), "exhaustive")
                return
            i = order[k]
            for placement in self._options(gpus, i):
                for g, p in placement:
                    self.put(gpus[g], i, p)
                dfs(k + 1)
                for g, p in reversed(placement):
                    self.take(gpus[g], i, p)
            unplaced.append(i)
            dfs(k + 1)
            unplaced.pop()

        dfs(0)
        if best[0] is bound:  # the heuristic was optimal
            return dataclasses.replace(bound, method="exhaustive")
        return best[0]

    def _options(self, gpus: list[_Gpu], i: int) -> Iterator[list[tuple[int, MigProfile | None]]]:
        """Every way to place item ``i`` now, up to the symmetry of empty GPUs of a kind (only
        the first empty ones of each kind are tried)."""
        item = self.items[i]
        for kind in dict.fromkeys(self.kinds):
            open_ = [g for g, s in enumerate(gpus) if s.kind == kind and s.mode is not None]
            empty = [g for g, s in enumerate(gpus) if s.kind == kind and s.mode is None]
            if item.mig:
                for g in open_ + empty[:1]:
                    for p in self.mig_options(gpus[g], i):
                        yield [(g, p)]
                continue
            fit = [g for g in open_ if self.whole_fits(gpus[g], i)]
            fresh = empty if (kind, None) in item.needs else []
            for n_new in range(min(item.tp, len(fresh)) + 1):
                for chosen in combinations(fit, item.tp - n_new):
                    yield [(g, None) for g in (*chosen, *fresh[:n_new])]


def pack_items(items: Sequence[Item], pool: Sequence[Any], *,
               exact: bool | None = None) -> Packing:
    """Place ``items`` on ``pool`` (one ``GpuSpec`` per GPU), minimising (items unplaced, GPUs
    used): first-fit decreasing, then the exhaustive search when ``exact`` (default: the
    instance has at most :data:`EXACT_MAX_TENANTS` items and :data:`EXACT_MAX_GPUS` GPUs);
    ``exact=False`` gives the heuristic's answer alone."""
    search = _Search(items, pool)
    order = sorted(range(len(items)), key=lambda i: (-search.size(i), i))
    heuristic = search.first_fit(order)
    if exact is None:
        exact = len(items) <= EXACT_MAX_TENANTS and len(pool) <= EXACT_MAX_GPUS
    if not exact or heuristic.cost == (0, _lower_bound(search)):
        return heuristic if not exact else dataclasses.replace(heuristic, method="exhaustive")
    return search.exhaustive(order, heuristic)


def _lower_bound(search: _Search) -> int:
    """At least one GPU per TP rank of the largest item (0 without items)."""
    return max((it.tp for it in search.items), default=0)


# --------------------------------------------------------------------------------------------
# The answer


@dataclass(frozen=True, kw_only=True)
class PackResult:
    """A packing of tenants on a pool, with each tenant's need, device and headroom."""

    tenants: tuple[Tenant, ...]
    pool: tuple[str, ...]
    packing: Packing
    demands: tuple[Mapping[tuple[str, str | None], Demand], ...]
    """Per tenant: its need on each device it fits alone."""
    devices: Mapping[tuple[str, str | None], Device]
    nowhere: Mapping[int, str]
    """Tenants that fit no device of the pool even alone: why, and by how much."""

    @property
    def gpus_used(self) -> int:
        return self.packing.used

    def _where(self, t: int) -> list[tuple[int, str | None]]:
        return [(g, p) for g, slots in enumerate(self.packing.gpus) for i, p in slots if i == t]

    def _gpu_load(self, g: int) -> tuple[int, float]:
        kind = self.pool[g]
        mem = bw = 0.0
        for i, p in self.packing.gpus[g]:
            d = self.demands[i][(kind, p)]
            mem, bw = mem + d.memory_bytes, bw + d.bandwidth_bytes_per_s
        return int(mem), bw

    def tenant_rows(self) -> list[dict[str, Any]]:
        rows = []
        for t, tenant in enumerate(self.tenants):
            where = self._where(t)
            row: dict[str, Any] = {"name": tenant.name, "model": model_key(tenant.model),
                                   "tp": tenant.tp, "gpus": [g for g, _ in where],
                                   "mig_profile": where[0][1] if where else None,
                                   "placed": bool(where)}
            if not where:
                row["reason"] = self.nowhere.get(t) or self._no_room(t)
                rows.append(row)
                continue
            g, prof = where[0]
            kind = self.pool[g]
            d, dev = self.demands[t][(kind, prof)], self.devices[(kind, prof)]
            if prof is None:  # shared: the headroom the GPU has left, on the tightest rank
                loads = [self._gpu_load(gg) for gg, _ in where]
                mem_free = min(dev.memory_bytes - m for m, _ in loads)
                bw_free = min(dev.bandwidth_bytes_per_s - b for _, b in loads)
            else:
                mem_free = dev.memory_bytes - d.memory_bytes
                bw_free = dev.bandwidth_bytes_per_s - d.bandwidth_bytes_per_s
            row.update({
                "device": dev.label, "concurrency": d.concurrency,
                "prefill_seconds": round(d.prefill_s, 6),
                "request_seconds": None if d.request_s is None else round(d.request_s, 6),
                "tpot_seconds": tenant.tpot_s,
                "max_num_seqs": d.max_num_seqs,
                "max_num_batched_tokens": d.max_num_batched_tokens,
                "memory_bytes": d.memory_bytes, "memory_parts": dict(d.parts),
                "memory_capacity_bytes": dev.memory_bytes, "memory_headroom_bytes": mem_free,
                "bandwidth_bytes_per_s": round(d.bandwidth_bytes_per_s),
                "bandwidth_capacity_bytes_per_s": round(dev.bandwidth_bytes_per_s),
                "bandwidth_headroom_bytes_per_s": round(bw_free),
                "gpu_memory_utilization": math.ceil(
                    (d.memory_bytes - d.parts.get("baseline", 0)) / dev.memory_bytes * 1000)
                / 1000,
            })
            rows.append(row)
        return rows

    def _no_room(self, t: int) -> str:
        (kind, prof), d = min(self.demands[t].items(), key=lambda kv: kv[1].memory_bytes)
        return (f"no room left in the pool: it needs {_gib(d.memory_bytes)} and "
                f"{_tbs(d.bandwidth_bytes_per_s)} per GPU on "
                f"{self.devices[(kind, prof)].label}; add GPUs")

    def gpu_rows(self) -> list[dict[str, Any]]:
        rows = []
        for g, slots in enumerate(self.packing.gpus):
            kind = self.pool[g]
            dev = self.devices[(kind, None)]
            mem, bw = self._gpu_load(g)
            mig = any(p is not None for _, p in slots)
            rows.append({"gpu": g, "type": kind, "mode": None if not slots else
                         ("mig" if mig else "whole"),
                         "tenants": [{"name": self.tenants[i].name, "mig_profile": p}
                                     for i, p in slots],
                         "memory_capacity_bytes": dev.memory_bytes,
                         "memory_used_bytes": mem,
                         "bandwidth_capacity_bytes_per_s": round(dev.bandwidth_bytes_per_s),
                         "bandwidth_used_bytes_per_s": round(bw)})
        return rows

    def to_json(self) -> dict[str, Any]:
        """The stable ``--json`` keys (bytes as integers, bandwidth in bytes/s)."""
        return {
            "gpus_available": len(self.pool), "gpus_used": self.gpus_used,
            "method": self.packing.method, "optimal": self.packing.method == "exhaustive",
            "gpus": self.gpu_rows(), "tenants": self.tenant_rows(),
            "unplaced": [self.tenants[i].name for i in self.packing.unplaced],
            "assumptions": {"hbm_efficiency": HBM_EFFICIENCY, "prefill_mfu": PREFILL_MFU,
                            "default_tpot_seconds": DEFAULT_TPOT_S,
                            "exact_max_tenants": EXACT_MAX_TENANTS,
                            "exact_max_gpus": EXACT_MAX_GPUS,
                            "estimate": "request time from a roofline (prefill on FLOPS, "
                                        "decode on HBM bandwidth); Little's law concurrency"},
        }


def _gib(b: float) -> str:
    return f"{b / 2**30:.1f} GiB"


def _tbs(b: float) -> str:
    return f"{b / 1e12:.2f} TB/s"


def _shortfall(tenant: Tenant, tries: Sequence[tuple[Device, Demand]]) -> str:
    """Why ``tenant`` fits no device alone, and by how much, on the device it comes closest."""
    def gap(x: tuple[Device, Demand]) -> float:
        dev, d = x
        return max(d.memory_bytes / dev.memory_bytes,
                   d.bandwidth_bytes_per_s / dev.bandwidth_bytes_per_s)

    dev, d = min(tries, key=gap)
    if d.too_slow and d.memory_bytes <= dev.memory_bytes and \
            d.bandwidth_bytes_per_s <= dev.bandwidth_bytes_per_s:
        return d.too_slow
    bits = []
    if d.memory_bytes > dev.memory_bytes:
        short = _gib(d.memory_bytes - dev.memory_bytes)
        bits.append(f"{_gib(d.memory_bytes)} of memory ({dev.label} has "
                    f"{_gib(dev.memory_bytes)}: short by {short})")
    if d.bandwidth_bytes_per_s > dev.bandwidth_bytes_per_s:
        bits.append(f"{_tbs(d.bandwidth_bytes_per_s)} of HBM bandwidth for its "
                    f"{tenant.tpot_s * 1e3:g} ms TPOT ({dev.label} streams "
                    f"{_tbs(dev.bandwidth_bytes_per_s)}: short by "
                    f"{_tbs(d.bandwidth_bytes_per_s - dev.bandwidth_bytes_per_s)})")
    if d.too_slow:
        bits.append(d.too_slow)
    return f"tenant {tenant.name!r} fits no device of the pool: it needs " + "; ".join(bits) + \
        " (raise tp, quantize, lower its traffic, or relax tpot_ms)"


def pack(tenants: str | Path | Sequence[Any] | Mapping[str, Any], *, gpus: str | Sequence[Any],
         mig: str = "off", exact: bool | None = None) -> PackResult:
    """Place ``tenants`` (a tenants file, or its parsed data, or :class:`Tenant` objects) on
    the pool ``gpus`` (``"4xh100-sxm-80gb"``). ``mig``: ``off`` (tenants without a ``mig:``
    key share whole GPUs) or ``auto`` (they take the smallest MIG profile that fits).

    >>> r = pack([{"name": "a", "model": "llama-3-8b", "qps": 1, "prompt_tokens": 512,
    ...            "output_tokens": 128, "activation_peak_bytes": 2**30,
    ...            "cuda_graph_bytes": 0}], gpus="2xh100-sxm-80gb")
    >>> r.gpus_used, r.packing.method
    (1, 'exhaustive')
    """
    if mig not in ("off", "auto"):
        raise MemfitError(f"--mig must be off or auto, got {mig!r}")
    people = load_tenants(tenants)
    if mig == "auto":
        people = [t if t.mig is not None else dataclasses.replace(t, mig="auto")
                  for t in people]
    pool = parse_pool(gpus) if isinstance(gpus, str) else list(gpus)
    kinds = list(dict.fromkeys(g.name for g in pool))
    specs = {g.name: g for g in pool}
    devices: dict[tuple[str, str | None], Device] = {}
    for k in kinds:
        devices[(k, None)] = device(specs[k])
        for p in mig_profiles(k):
            devices[(k, p.name)] = device(specs[k], p)
    demands: list[dict[tuple[str, str | None], Demand]] = []
    items, nowhere = [], {}
    for t, tenant in enumerate(people):
        targets = tenant_targets(tenant, kinds)
        need: dict[tuple[str, str | None], Demand] = {}
        tries = []
        for key in targets:
            d = tenant_demand(tenant, specs[key[0]],
                              None if key[1] is None else mig_profile(key[0], key[1]))
            need[key] = d
            tries.append((devices[key], d))
        demands.append(need)
        fits = {key: (d.memory_bytes, d.bandwidth_bytes_per_s) for key, d in need.items()
                if d.memory_bytes <= devices[key].memory_bytes
                and d.bandwidth_bytes_per_s <= devices[key].bandwidth_bytes_per_s
                and d.too_slow is None}
        if not fits or (tenant.tp > sum(1 for g in pool if (g.name, None) in fits)
                        and tenant.mig is None):
            nowhere[t] = _shortfall(tenant, tries) if not fits else (
                f"tenant {tenant.name!r} needs {tenant.tp} GPUs (tp) and the pool has fewer "
                "of a type it fits")
        items.append(Item(name=tenant.name, needs=fits, tp=tenant.tp,
                          mig=tenant.mig is not None))
    if len(nowhere) == len(people):
        raise MemfitError("; ".join(nowhere.values()))
    packing = pack_items(items, pool, exact=exact)
    return PackResult(tenants=tuple(people), pool=tuple(g.name for g in pool),
                      packing=packing, demands=tuple(demands), devices=devices,
                      nowhere=nowhere)


