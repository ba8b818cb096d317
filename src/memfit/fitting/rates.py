"""The rates the fit's cost model runs at (:mod:`memfit.fitting.cost`): where they come from, how
this CPU's are measured and kept, and how a user pins them.

Note: [rates do not move with the load] A plan must not depend on what else the machine is
doing. A GPU target takes the catalog's numbers (:func:`gpu_rates`). A CPU target measures this
machine (:func:`cpu_rates`): a 512^3 matmul per dtype, a 32 MiB copy (a 4 MiB slice a run) and
the dispatch of 100 tiny ops, each timed again and again, on every intra-op thread and on one
(one thread needs only one free core), and kept at its *fastest* run. Another process can only
slow a run down, so the fastest run is the least disturbed one; runs go on until
:data:`PATIENCE` runs and :data:`PATIENCE_S` seconds have not beaten the best by 1% (at least
:data:`MIN_RUNS`, at most :data:`BUDGET_S` seconds a quantity), so a loaded machine keeps trying
for a quiet moment. On a 2-core AMX Xeon with 5-7 other processes running, the old best of 5
read fp32 10-19 GFLOP/s (once 168) and this 103-221, over 8 runs, against 209-290 at a quieter
moment: under heavy load a reading can still be low (by up to the thread count: the one-thread
run is its floor), so the source says the load average it was taken at.

The result is kept on disk, keyed by the machine and the build (``trace.kernel_cache.machine``:
CPU model and flags, torch version and git revision, ATen's ISA, oneDNN's limit, intra-op
threads), in ``cpu-rates-<hash>.json`` under ``trace.kernel_cache.cache_dir()``
(``$MEMFIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/memfit``, else ``~/.cache/memfit``;
``MEMFIT_NO_CACHE=1``: not kept), so every later plan on this machine uses the same numbers.
Delete the file to measure again.

Pinned rates (``fit(..., rates=...)``, ``memfit fit --rates FILE --flops --mem-bandwidth``)
replace what they name; with the FLOP/s of every CPU precision, the bandwidth and the dispatch
time pinned, a CPU target measures nothing (:func:`target_rates`).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import itertools
import json
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from memfit import vocab
from memfit.dtypes import torch_dtype
from memfit.errors import MemfitError
from memfit.fitting.rate_pins import (
    PINNABLE,
    TFLOPS_KEY,
    check_pins,
    describe_pins,
    load_rates,
    merge_pins,
    parse_pin,
)
from memfit.gpus import GpuSpec, get_gpu

__all__ = ["Rates", "cpu_rates", "gpu_rates", "load_rates", "merge_pins", "parse_pin",
           "target_rates"]

# Measured matmul ceiling / datasheet peak (shared/facts.md, bf16 8192^3 matmuls).
MATMUL_EFFICIENCY = {"a100": 271 / 312, "h100": 794 / 989, "h200": 790 / 989}
DEFAULT_EFFICIENCY = 0.80
CUDA_LAUNCH_S = 12.5e-6
"""Host seconds per eager op on a CUDA target (Python, autograd, the launch): a measured step of
an eager model too small to keep an H100 busy, over the ops its trace counts (1948 a step:
24.9 ms on an H100 host, 23.7 ms on an H200 host, 12.8 and 12.2 us an op;
``bench/step_cost_calibration.py``). It was 8 us, which put that step at 16 ms."""
CUDA_SAC_OP_S = 34.5e-6
"""Seconds per op of selective checkpointing's Python dispatch modes on a CUDA target
(``torch.utils.checkpoint``'s ``_CachingTorchDispatchMode`` in the forward,
``_CachedTorchDispatchMode`` in the recompute, each op through ``__torch_dispatch__`` and the
policy): calibrated by ``bench/step_cost_calibration.py`` on one model size (58.5 M parameters,
8 blocks, 4 x 512 tokens, fp32) on an H100 and an H200 host
(``bench/results/techniques-h100-2026-11-27.json``, ``techniques-h200-...``)."""
INTER_NODE_GBPS = 50.0
"""GB/s per direction per GPU between nodes: one 400 Gb/s NDR InfiniBand port (ConnectX-7)
per GPU, as NVIDIA's DGX H100 / H200 nodes are built (NVIDIA DGX H100 User Guide, §1.2.3
"Network Modules", Table 6: eight ConnectX-7 ports, one per GPU). The GPU catalog has no
inter-node figure (a node's network is not the GPU's); facts.md has none either."""

"""Precision -> the catalog's TFLOPS key: the format its matmuls run in."""

CPU_PRECISIONS = ("fp32", "bf16-mixed", "bf16")
"""The precisions a CPU target has a rate for (bf16 and bf16-mixed: the bf16 matmul)."""
MATMUL_N = 512
MIN_RUNS = 10
PATIENCE = 20
"""Runs in a row that do not beat the best by :data:`IMPROVEMENT` before the timing stops."""
PATIENCE_S = 0.25
"""... and seconds: a fast kernel's 20 runs can all fall in one busy stretch."""
IMPROVEMENT = 0.01
BUDGET_S = 2.0
"""Seconds at most spent timing one quantity (once :data:`MIN_RUNS` have run)."""
MAX_RUNS = 2000
COPY_SLICES = 8
"""The copy is timed a 4 MiB slice at a time (see ``_measure_cpu``)."""
CACHE_FORMAT = "memfit-cpu-rates/1"


@dataclass(frozen=True, kw_only=True)
class Rates:
    """What one device sustains."""

    flops: dict[str, float]
    """Achievable matmul FLOP/s by precision (only the supported ones)."""
    bandwidth: float
    """Device memory bytes/s."""
    host_link: float
    """Host<->device bytes/s per direction (CPU: a memory copy)."""
    gpu_link: float | None
    """GPU<->GPU bytes/s per direction; None: no link."""
    launch_s: float
    """Seconds per eager op dispatch."""
    inter_node_link: float | None = None
    """Bytes/s per direction per GPU between nodes; None: :data:`INTER_NODE_GBPS`."""
    async_launch: bool = True
    """Whether dispatch overlaps the work (CUDA streams) or adds to it (CPU)."""
    sac_op_s: float = 0.0
    """Seconds of Python per op that selective checkpointing's dispatch modes add, in the
    forward and again in the recompute (:data:`CUDA_SAC_OP_S`; 0 on a CPU target)."""
    source: str
    """Where the numbers come from, for the report."""

    def to_dict(self) -> dict[str, Any]:
        """The numbers in SI units (FLOP/s, bytes/s, seconds): the ``rates`` of a saved plan,
        which ``memfit fit --rates`` reads back."""
        return {"flops": dict(self.flops), "bandwidth": self.bandwidth,
                "host_link": self.host_link, "gpu_link": self.gpu_link,
                "inter_node_link": self.inter_node_link, "launch_s": self.launch_s,
                "async_launch": self.async_launch, "sac_op_s": self.sac_op_s,
                "source": self.source}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Rates:
        """The inverse of :meth:`to_dict` (``KeyError`` / ``TypeError`` / ``ValueError`` on a
        malformed one)."""
        def number(x: Any) -> float:
            if isinstance(x, bool) or not isinstance(x, int | float):
                raise TypeError(f"{x!r} is not a number")
            return float(x)

        def optional(x: Any) -> float | None:
            return None if x is None else number(x)

        flops = data["flops"]
        if not isinstance(flops, dict):
            raise TypeError("flops is not an object")
        return cls(flops={str(k): number(v) for k, v in flops.items()},
                   bandwidth=number(data["bandwidth"]), host_link=number(data["host_link"]),
                   gpu_link=optional(data.get("gpu_link")),
                   inter_node_link=optional(data.get("inter_node_link")),
                   launch_s=number(data["launch_s"]),
                   async_launch=bool(data.get("async_launch", True)),
                   sac_op_s=number(data.get("sac_op_s", 0.0)),
                   source=str(data.get("source", "")))


# -- the catalog ----------------------------------------------------------------------------------

def _efficiency(gpu: GpuSpec) -> float:
    for prefix, eff in MATMUL_EFFICIENCY.items():
        if gpu.name.startswith(prefix):
            return eff
    return DEFAULT_EFFICIENCY


def gpu_rates(gpu: GpuSpec) -> Rates:
    """Rates of ``gpu`` from the catalog (dense peak x measured matmul efficiency)."""
    eff = _efficiency(gpu)
    flops = {}
    for precision, key in TFLOPS_KEY.items():
        tflops = gpu.tflops.get(key)
        if tflops and gpu.supports(precision):
            flops[precision] = tflops * 1e12 * eff
    return Rates(flops=flops, bandwidth=gpu.bandwidth_gbps * 1e9,
                 host_link=gpu.host_link.gbps * 1e9,
                 gpu_link=gpu.gpu_link.gbps * 1e9 if gpu.gpu_link else None,
                 launch_s=CUDA_LAUNCH_S, sac_op_s=CUDA_SAC_OP_S,
                 inter_node_link=INTER_NODE_GBPS * 1e9,
                 source=f"{gpu.name}: catalog peak TFLOPS x {eff:.2f} (measured matmul "
                        f"ceiling / peak), {gpu.bandwidth_gbps:g} GB/s, host link "
                        f"{gpu.host_link.gbps:g} GB/s")


def _assumed_gpu_rates() -> Rates:
    """``device="cuda"`` with no GPU named: the A100-40GB's."""
    rates = gpu_rates(get_gpu("a100-40gb"))
    return replace(rates, inter_node_link=None,
                   source="no GPU named: A100-40GB rates assumed; " + rates.source)


# -- this CPU, measured ---------------------------------------------------------------------------

def _timed(fn: Callable[[], object]) -> float:
    """Wall seconds of one call of ``fn`` (the tests replace this to script the timings)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def best_seconds(fn: Callable[[], object]) -> tuple[float, int]:
    """``(fastest seconds, runs)`` of ``fn`` timed again and again: at least :data:`MIN_RUNS`
    runs, then until the best has not improved by :data:`IMPROVEMENT` for :data:`PATIENCE` runs
    and :data:`PATIENCE_S` seconds, or the runs took :data:`BUDGET_S` seconds (Note: [rates do
    not move with the load]). Seconds are the runs' own, summed."""
    best, runs, since, spent, since_s = math.inf, 0, 0, 0.0, 0.0
    while runs < MAX_RUNS:
        seconds = _timed(fn)
        runs += 1
        spent += seconds
        if seconds < best * (1 - IMPROVEMENT):
            since, since_s = 0, 0.0
        else:
            since, since_s = since + 1, since_s + seconds
        best = min(best, seconds)
        if runs >= MIN_RUNS and ((since >= PATIENCE and since_s >= PATIENCE_S)
                                 or spent >= BUDGET_S):
            break
    return best, runs


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    """Run the block's kernels on ``n`` intra-op threads, then restore the count."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _best_of_both(fn: Callable[[], object]) -> tuple[float, int]:
    """``(fastest seconds, runs)`` of ``fn`` on every intra-op thread, and on one thread when
    that is faster (Note: [rates do not move with the load]: one thread needs one free core)."""
    seconds, runs = best_seconds(fn)
    if torch.get_num_threads() > 1:
        with _threads(1):
            fn()  # warm-up
            one, more = best_seconds(fn)
        seconds, runs = min(seconds, one), runs + more
    return seconds, runs


def _measure_cpu() -> Rates:
    """Time this CPU (Note: [rates do not move with the load]); ``source`` without the cache's
    path."""
    n = MATMUL_N
    threads = torch.get_num_threads()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    flops: dict[str, float] = {}
    runs: list[int] = []
    for precision in ("fp32", "bf16-mixed"):
        dtype = torch_dtype(vocab.precision(precision).matmul)
        a = torch.randn(n, n, dtype=dtype)
        b = torch.randn(n, n, dtype=dtype)
        for _ in range(2):
            torch.mm(a, b)  # warm-up (thread pool, oneDNN primitives)
        seconds, k = _best_of_both(lambda a=a, b=b: torch.mm(a, b))
        flops[precision] = 2 * n**3 / seconds
        runs.append(k)
    flops["bf16"] = flops["bf16-mixed"]
    # A 32 MiB copy, run as its 8 slices in turn: a short run fits between two of another
    # process's time slices, where the whole copy (~1 ms quiet, 13 ms on a loaded 2-core
    # machine) rarely does.
    src = torch.empty(8 * 2**20)
    dst = torch.empty_like(src)
    dst.copy_(src)
    slices = itertools.cycle(list(zip(src.chunk(COPY_SLICES), dst.chunk(COPY_SLICES),
                                      strict=True)))

    def copy_slice() -> None:
        part, into = next(slices)
        into.copy_(part)

    copy_s, k = _best_of_both(copy_slice)
    runs.append(k)
    bandwidth = 2 * src.nbytes / COPY_SLICES / copy_s  # read + write
    tiny = torch.ones(4)
    launch_s, k = best_seconds(lambda: [tiny.add(1) for _ in range(100)])
    runs.append(k)
    launch = launch_s / 100
    today = datetime.date.today().isoformat()
    busy = ""
    if load is not None:
        busy = f", load average {load:.1f} on {os.cpu_count()} CPUs"
        if load > 0.5 * (os.cpu_count() or 1):
            busy += " (busy: may read low; pin with --rates, or delete the file below when quiet)"
    return Rates(flops=flops, bandwidth=bandwidth, host_link=bandwidth / 2, gpu_link=None,
                 launch_s=launch, async_launch=False,
                 source=f"this CPU, measured {today} on {threads} threads{busy}: fp32 matmul "
                        f"{flops['fp32'] / 1e9:.0f} GFLOP/s, bf16 "
                        f"{flops['bf16-mixed'] / 1e9:.0f} GFLOP/s, copy "
                        f"{bandwidth / 1e9:.1f} GB/s, dispatch {launch * 1e6:.1f} us, each the "
                        f"fastest of {min(runs)}-{max(runs)} runs")


def cpu_cache_path() -> Path | None:
    """The file this machine's measured rates are kept in, or None when the disk cache is off
    (``MEMFIT_NO_CACHE``)."""
    from memfit.trace import kernel_cache

    where = kernel_cache.cache_dir()
    if where is None:
        return None
    key = {**kernel_cache.machine(), "format": CACHE_FORMAT}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return where / f"cpu-rates-{digest}.json"


def _read_cache(path: Path) -> Rates | None:
    with contextlib.suppress(OSError, ValueError, UnicodeDecodeError, KeyError, TypeError):
        data = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(data, dict) and data.get("format") == CACHE_FORMAT:
            rates = Rates.from_dict(data["rates"])
            if all(rates.flops.get(p, 0) > 0 for p in CPU_PRECISIONS) and rates.bandwidth > 0 \
                    and rates.launch_s > 0:
                return rates
    return None  # missing, or not what this module writes: measured again and replaced


_process_rates: dict[Path | None, Rates] = {}


def cpu_rates() -> Rates:
    """This machine's CPU rates: read from the disk cache, else measured and written there
    (Note: [rates do not move with the load]); once per process and cache file.

    >>> cpu_rates().source
    'this CPU, measured 2026-...: fp32 matmul 270 GFLOP/s, ...; cached in ~/.cache/memfit/...'
    """
    path = cpu_cache_path()
    if path in _process_rates:
        return _process_rates[path]
    measured = _read_cache(path) if path is not None else None
    if measured is None:
        measured = _measure_cpu()
        if path is not None:
            from memfit._files import write_atomic

            body = json.dumps({"format": CACHE_FORMAT, "rates": measured.to_dict()}, indent=1)
            with contextlib.suppress(OSError):  # unwritable: the next process measures again
                write_atomic(path, body + "\n")
    where = (f"cached in {path} (delete it to measure again)" if path is not None
             else "not cached (MEMFIT_NO_CACHE is set)")
    rates = replace(measured, source=f"{measured.source}; {where}")
    _process_rates[path] = rates
    return rates


def forget_measured() -> None:
    """Drop this process's copy of the measured CPU rates (the next :func:`cpu_rates` reads the
    disk cache again, or measures)."""
    _process_rates.clear()


def target_rates(device: str, gpu: GpuSpec | None,
                 pinned: Rates | Mapping[str, Any] | str | os.PathLike[str] | None = None
                 ) -> Rates:
    """The rates a fit for ``device`` (and ``gpu``) costs its candidates at: ``pinned`` as is
    when it is a :class:`Rates`; else the catalog's (a GPU; the A100-40GB's when none is named)
    or this CPU's, measured (:func:`cpu_rates`), with what ``pinned`` names (a dict of
    :func:`parse_pin`'s keys, or a rates file, :func:`load_rates`) in their place. A CPU
    target whose FLOP/s (every precision), bandwidth and dispatch time are all pinned measures
    nothing (Note: [rates do not move with the load])."""
    if isinstance(pinned, Rates):
        return pinned
    if pinned is None:
        pins: dict[str, Any] = {}
    elif isinstance(pinned, str | os.PathLike):
        pins = load_rates(pinned)
    elif isinstance(pinned, Mapping):
        pins = check_pins(pinned, source="fit(rates=...)")
    else:
        raise MemfitError(f"rates must be a memfit.fitting.Rates, a dict of rates or a rates "
                          f"file's path, not {type(pinned).__name__}")
    cpu = device == "cpu"
    if cpu:
        default: Callable[[], Rates] = cpu_rates
    elif gpu is not None:
        def default() -> Rates:
            return gpu_rates(gpu)
    else:
        default = _assumed_gpu_rates
    if not pins:
        return default()
    flops_pin = dict(pins.get("flops") or {})
    complete = cpu and "bandwidth" in pins and "launch_s" in pins \
        and ("*" in flops_pin or all(p in flops_pin for p in CPU_PRECISIONS))
    if complete:
        base = Rates(flops={}, bandwidth=pins["bandwidth"], host_link=pins["bandwidth"] / 2,
                     gpu_link=None, launch_s=pins["launch_s"], async_launch=False, source="")
    else:
        base = default()
    flops = dict(base.flops)
    if "*" in flops_pin:
        flops = dict.fromkeys(CPU_PRECISIONS if cpu else base.flops, flops_pin.pop("*"))
    flops.update(flops_pin)
    fields = {k: pins[k] for k in PINNABLE if k in pins and k != "flops"}
    if cpu and "bandwidth" in pins and "host_link" not in pins:
        fields["host_link"] = pins["bandwidth"] / 2  # a copy: read + write (see _measure_cpu)
    source = f"pinned by {pins['source']}: {describe_pins(pins)}"
    if not complete:
        source += f"; the rest: {base.source}"
    return replace(base, flops=flops, **fields, source=source)
