"""MIG (Multi-Instance GPU) profiles: each GPU instance profile's memory, compute and memory
slices, and the placement rule that decides which profiles fit together on one GPU.

A GPU in MIG mode has 7 compute slices and 8 memory slices (NVIDIA MIG user guide,
"Supported MIG Profiles": each profile's "Fraction of SMs" in sevenths and "Fraction of
Memory" in eighths). A profile's **memory** here is the figure ``nvidia-smi mig -lgip`` lists
(its "Memory GiB" column), which is what a process on the instance can allocate from (less
than the name's GB: 1g.10gb is 9.75 GiB on an H100); a tenant on a profile gets that memory,
``compute_slices / 7`` of the SMs (the guide's fraction) and ``memory_slices / 8`` of the HBM
bandwidth (each memory slice owns its own memory controllers and DRAM channels: "separate and
isolated paths through the entire memory system", the guide's introduction).

Placement (which combinations are valid): every GPU instance sits at a start position in the
8 memory slices, from a fixed list per profile (NVML ``nvmlDeviceGetGpuInstancePossiblePlacements``;
the guide's "possible placements" figure for A100/H100): 1-slice profiles start at 0..6, a
2-memory-slice profile (``1g.20gb``, ``2g.*``) at 0, 2, 4 (``1g.20gb`` also 6), 3g at 0 or 4,
4g at 0, 7g at 0 taking all 8. A combination is valid when the instances can be placed without
overlap (:func:`valid_combination`); this implies the guide's sums (compute slices <= 7, memory
slices <= 8), and is stricter (3g + 3g + 1g sums to 7 compute slices but needs 9 memory slices).

GPUs listed (``MIG_GPUS``): A100 40 GB and 80 GB, H100 80 GB (SXM and PCIe: same profiles). The
H200's profiles (1g.18gb ... 7g.141gb) are not listed: no published ``-lgip`` memory figures
were found to cite; a H200 tenant on MIG is refused until they are.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache

from memfit.errors import MemfitError, suggest

__all__ = ["MIG_GPUS", "MIG_SOURCES", "MIG_UNLISTED", "MigProfile", "mig_profile", "mig_profiles",
           "valid_combination"]

GiB = 1 << 30

def _gib(text: str) -> int:
    """``"9.75"`` GiB as bytes, exactly (``-lgip`` prints two decimals of a multiple of
    1/8 GiB or 1/16 GiB: 9.62 is 9.625, 19.62 is 19.625, 39.38 is 39.375)."""
    whole, _, frac = text.partition(".")
    hundredths = int(whole) * 100 + int((frac + "00")[:2])
    # -lgip rounds to 2 decimals; the sizes are multiples of 1/16 GiB (64 MiB): snap to it
    return round(hundredths * 16 / 100) * (GiB // 16)


@dataclass(frozen=True, kw_only=True)
class MigProfile:
    """One GPU instance profile on one GPU model."""

    name: str
    """e.g. ``3g.40gb``."""
    compute_slices: int
    """Sevenths of the SMs (the ``Ng`` of the name)."""
    memory_slices: int
    """Eighths of the memory and of the HBM bandwidth."""
    memory_bytes: int
    """What ``nvidia-smi mig -lgip`` lists for the instance (GiB x 2**30)."""
    max_instances: int
    """How many of it one GPU holds (the guide's "Number of Instances Available")."""
    starts: tuple[int, ...]
    """The memory-slice positions an instance may start at (NVML's possible placements)."""

    @property
    def bandwidth_fraction(self) -> float:
        """The share of the GPU's HBM bandwidth: ``memory_slices / 8``."""
        return self.memory_slices / 8

    @property
    def compute_fraction(self) -> float:
        """The share of the GPU's SMs: ``compute_slices / 7``."""
        return self.compute_slices / 7


_STARTS = {  # memory slices taken -> start positions (NVML possible placements, A100 / H100)
    ("1g", 1): (0, 1, 2, 3, 4, 5, 6),
    ("1g", 2): (0, 2, 4, 6),
    ("2g", 2): (0, 2, 4),
    ("3g", 4): (0, 4),
    ("4g", 4): (0,),
    ("7g", 8): (0,),
}


def _table(rows: Sequence[tuple[str, int, str, int]]) -> tuple[MigProfile, ...]:
    out = []
    for name, mem_slices, gib, count in rows:
        g = name.split(".")[0]
        out.append(MigProfile(name=name, compute_slices=int(g[:-1]), memory_slices=mem_slices,
                              memory_bytes=_gib(gib), max_instances=count,
                              starts=_STARTS[(g, mem_slices)]))
    return tuple(out)


# (name, memory slices, -lgip GiB, instances per GPU). Sources in MIG_SOURCES.
_A100_40GB = _table([("1g.5gb", 1, "4.75", 7), ("1g.10gb", 2, "9.75", 4),
                     ("2g.10gb", 2, "9.75", 3), ("3g.20gb", 4, "19.62", 2),
                     ("4g.20gb", 4, "19.62", 1), ("7g.40gb", 8, "39.38", 1)])
_A100_80GB = _table([("1g.10gb", 1, "9.50", 7), ("1g.20gb", 2, "19.50", 4),
                     ("2g.20gb", 2, "19.50", 3), ("3g.40gb", 4, "39.25", 2),
                     ("4g.40gb", 4, "39.25", 1), ("7g.80gb", 8, "79.00", 1)])
_H100_80GB = _table([("1g.10gb", 1, "9.75", 7), ("1g.20gb", 2, "19.62", 4),
                     ("2g.20gb", 2, "19.62", 3), ("3g.40gb", 4, "39.50", 2),
                     ("4g.40gb", 4, "39.50", 1), ("7g.80gb", 8, "79.25", 1)])

MIG_GPUS: dict[str, tuple[MigProfile, ...]] = {
    "a100-sxm-40gb": _A100_40GB,
    "a100-sxm-80gb": _A100_80GB,
    "a100-pcie-80gb": _A100_80GB,
    "h100-sxm-80gb": _H100_80GB,
    "h100-pcie-80gb": _H100_80GB,
}
"""Catalog GPU name -> its MIG profiles, smallest first."""

MIG_UNLISTED = ("h100-nvl-94gb", "h200-141gb", "b200")
"""Catalog GPUs that have MIG (the guide's "Supported GPUs") whose profiles memfit does not list
yet (no published ``-lgip`` memory figures found to cite)."""

MIG_SOURCES = (
    "NVIDIA Multi-Instance GPU User Guide, 'Supported MIG Profiles' "
    "(docs.nvidia.com/datacenter/tesla/mig-user-guide/supported-mig-profiles.html): the "
    "fractions of memory (eighths) and SMs (sevenths) and the instances per GPU of each profile",
    "The same guide, 'Supported GPUs': A100 40/80 GB, H100 80/94 GB, H200 141 GB support MIG "
    "(up to 7 instances); compute capability >= 8.0",
    "A100 40 GB memory: `nvidia-smi mig -lgip` as in the guide's 'Getting Started' example "
    "(1g.5gb 4.75, 2g.10gb 9.75, 3g.20gb 19.62, 4g.20gb 19.62, 7g.40gb 39.38 GiB); 1g.10gb "
    "(R510+) has 2g.10gb's two memory slices",
    "A100 80 GB memory: `nvidia-smi mig -lgip` on A100-SXM4-80GB (1g.10gb 9.50, 1g.20gb / "
    "2g.20gb 19.50, 3g.40gb / 4g.40gb 39.25, 7g.80gb 79.00 GiB), as published in two "
    "independent listings",
    "H100 80 GB memory: `nvidia-smi mig -lgip` on H100 80GB HBM3 (1g.10gb 9.75, 1g.20gb / "
    "2g.20gb 19.62, 3g.40gb / 4g.40gb 39.50, 7g.80gb 79.25 GiB), as published in three "
    "independent listings (e.g. jbarrow.ai/field_notes/nvidia-mig)",
    "Placements: NVML nvmlDeviceGetGpuInstancePossiblePlacements (the start/size lists in "
    "NVIDIA/go-nvml pkg/nvml/mock/gpus/a100.go and h100.go)",
)


def mig_profiles(gpu_name: str) -> tuple[MigProfile, ...]:
    """The MIG profiles of a catalog GPU (empty: the GPU has no MIG, or memfit lists none)."""
    return MIG_GPUS.get(gpu_name, ())


def mig_profile(gpu_name: str, profile: str) -> MigProfile:
    """One profile of ``gpu_name`` by name; a GPU without MIG, or a name it lacks, raises one
    line naming the valid ones."""
    profiles = mig_profiles(gpu_name)
    if not profiles and gpu_name in MIG_UNLISTED:
        raise MemfitError(f"{gpu_name} has MIG, but memfit lists no MIG profiles for it yet "
                          f"(it does for {', '.join(MIG_GPUS)}); drop the tenant's `mig:`")
    if not profiles:
        raise MemfitError(f"MIG profile {profile!r} asked on {gpu_name}, which has no MIG "
                          f"(memfit lists MIG for {', '.join(MIG_GPUS)}); drop the tenant's "
                          "`mig:` or use a MIG GPU")
    names = [p.name for p in profiles]
    key = profile.strip().lower().removeprefix("mig-").removeprefix("mig ")
    for p in profiles:
        if p.name == key:
            return p
    raise MemfitError(f"{gpu_name} has no MIG profile {profile!r}{suggest(key, names)}; "
                      f"valid: {', '.join(names)}")


@cache
def _placeable(profiles: tuple[tuple[int, int, tuple[int, ...]], ...]) -> bool:
    """Whether instances ``(memory slices, start positions)`` (largest first) fit the 8
    memory slices without overlap: a depth-first search over start positions."""

    def place(i: int, used: int) -> bool:
        if i == len(profiles):
            return True
        size, _, starts = profiles[i]
        for s in starts:
            mask = ((1 << size) - 1) << s
            if not used & mask and place(i + 1, used | mask):
                return True
        return False

    return place(0, 0)


def valid_combination(profiles: Iterable[MigProfile]) -> bool:
    """Whether these profiles can be GPU instances on one GPU at once: each within its
    instance count, compute slices <= 7, and a non-overlapping placement in the 8 memory slices.

    >>> h = {p.name: p for p in MIG_GPUS["h100-sxm-80gb"]}
    >>> valid_combination([h["4g.40gb"], h["3g.40gb"]])
    True
    >>> valid_combination([h["3g.40gb"], h["3g.40gb"], h["1g.10gb"]])  # 9 memory slices
    False
    """
    items = list(profiles)
    if sum(p.compute_slices for p in items) > 7 or sum(p.memory_slices for p in items) > 8:
        return False
    counts = Counter(p.name for p in items)
    by_name = {p.name: p for p in items}
    if any(n > by_name[name].max_instances for name, n in counts.items()):
        return False
    key = tuple(sorted(((p.memory_slices, p.compute_slices, p.starts) for p in items),
                       reverse=True))
    return _placeable(key)
