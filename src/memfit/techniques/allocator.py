"""CUDA caching-allocator settings (``PYTORCH_CUDA_ALLOC_CONF``), applied safely.

PyTorch reads the allocator configuration from the environment once, when CUDA's allocator
initialises; setting the variable later does nothing, silently. :func:`configure_allocator`:

- before CUDA is initialised (``torch.cuda.is_initialized()`` is False): merges the options into
  ``PYTORCH_CUDA_ALLOC_CONF`` (and into ``PYTORCH_ALLOC_CONF`` when the user has set it: torch
  >= 2.9 reads that one first), keeping options already there that are not overridden;
- after: applies the options that PyTorch accepts at runtime through its allocator-settings
  call (``torch._C._accelerator_setAllocatorSettings`` in torch >= 2.9,
  ``torch.cuda.memory._set_allocator_settings`` before), and raises :class:`MemfitError` for
  the rest, or when the call is missing, saying to call it before any CUDA work or to set the
  variable in the shell.

Runtime effect (from the allocator's source, ``c10/cuda/CUDACachingAllocator.cpp``): the config
getters are read at every allocation, so ``max_split_size_mb``, ``roundup_power2_divisions`` and
``garbage_collection_threshold`` act on the next allocation, and ``expandable_segments`` on the
next *new* segment (segments already reserved keep their kind). The backend
(``cudaMallocAsync``) and pinned-memory options are fixed once CUDA is up.

Memory effect: ``expandable_segments:True`` maps one growing segment per stream instead of many
fixed ``cudaMalloc`` segments, removing most fragmentation (reserved - allocated) for workloads
whose tensor sizes change (variable sequence lengths, MoE); ``max_split_size_mb`` stops large
cached blocks from being split for small requests.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from memfit.errors import MemfitError

__all__ = ["RUNTIME_OPTIONS", "AllocatorSettings", "configure_allocator"]

log = logging.getLogger("memfit")

RUNTIME_OPTIONS = frozenset({"expandable_segments", "max_split_size_mb",
                             "roundup_power2_divisions", "garbage_collection_threshold"})
"""Options PyTorch's allocator-settings call accepts after CUDA is initialised."""

_ENV_NEW, _ENV_OLD = "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"


@dataclass(frozen=True, kw_only=True)
class AllocatorSettings:
    """What :func:`configure_allocator` did."""

    conf: str
    """The ``key:value,...`` string of the options given."""
    applied: str
    """``"env"`` (set before CUDA initialised) or ``"runtime"`` (through torch's setter)."""
    variables: tuple[str, ...]
    """The environment variables written (empty when applied at runtime)."""
    expandable_segments: bool
    """Whether expandable segments are on afterwards, as far as memfit can tell (the merged
    variable; at runtime, the option given): for ``memfit.estimate(expandable_segments=...)``."""

    def estimate_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :func:`memfit.estimate` that model these settings. (When
        applied through the environment, ``estimate`` reads the variable itself too:
        :meth:`memfit.trace.allocator.CachingAllocatorSim.for_gpu`.)"""
        return {"expandable_segments": self.expandable_segments}


def _options(expandable_segments: bool | None, max_split_size_mb: int | None,
             roundup_power2_divisions: int | None, garbage_collection_threshold: float | None,
             backend: str | None, pinned_use_host_register: bool | None) -> dict[str, str]:
    opts: dict[str, str] = {}
    if backend is not None:
        if backend not in ("native", "cudaMallocAsync"):
            raise MemfitError(f"backend must be 'native' or 'cudaMallocAsync', got {backend!r}")
        opts["backend"] = backend
    if expandable_segments is not None:
        opts["expandable_segments"] = str(bool(expandable_segments))
    if max_split_size_mb is not None:
        if isinstance(max_split_size_mb, bool) or not isinstance(max_split_size_mb, int) or \
                max_split_size_mb < 20:
            raise MemfitError(f"max_split_size_mb must be an integer >= 20 (MiB), got "
                              f"{max_split_size_mb!r}; e.g. 128 or 512")
        opts["max_split_size_mb"] = str(max_split_size_mb)
    if roundup_power2_divisions is not None:
        d = roundup_power2_divisions
        if isinstance(d, bool) or not isinstance(d, int) or d < 1 or d & (d - 1):
            raise MemfitError(f"roundup_power2_divisions must be a power of two (1, 2, 4, 8, "
                              f"16), got {d!r}")
        opts["roundup_power2_divisions"] = str(d)
    if garbage_collection_threshold is not None:
        t = garbage_collection_threshold
        if not isinstance(t, int | float) or not 0.0 < t < 1.0:
            raise MemfitError(f"garbage_collection_threshold must be in (0.0, 1.0), got {t!r}; "
                              "e.g. 0.8")
        opts["garbage_collection_threshold"] = repr(float(t))
    if pinned_use_host_register is not None:
        opts["pinned_use_cuda_host_register"] = str(bool(pinned_use_host_register))
    if not opts:
        raise MemfitError("configure_allocator got no option; pass e.g. "
                          "expandable_segments=True or max_split_size_mb=128")
    return opts


def _parse(conf: str) -> dict[str, str]:
    """``key:value`` pairs of an existing variable, in order (list-valued options kept whole)."""
    out: dict[str, str] = {}
    depth, start = 0, 0
    pieces: list[str] = []
    for i, ch in enumerate(conf):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            pieces.append(conf[start:i])
            start = i + 1
    pieces.append(conf[start:])
    for piece in pieces:
        key, sep, value = piece.strip().partition(":")
        if key and sep:
            out[key.strip()] = value.strip()
    return out


def _join(opts: dict[str, str]) -> str:
    return ",".join(f"{k}:{v}" for k, v in opts.items())


def _runtime_setter() -> Any:
    from memfit._compat.torch_internals import allocator_settings_setter

    return allocator_settings_setter()


def configure_allocator(*, expandable_segments: bool | None = None,
                        max_split_size_mb: int | None = None,
                        roundup_power2_divisions: int | None = None,
                        garbage_collection_threshold: float | None = None,
                        backend: str | None = None,
                        pinned_use_host_register: bool | None = None) -> AllocatorSettings:
    """Set CUDA caching-allocator options, before CUDA initialises or (where PyTorch allows it)
    after; raise :class:`MemfitError` when they can no longer take effect.

    Call it first thing in the training script, before anything touches CUDA. Options left as
    ``None`` are not changed. Returns what was applied; ``.estimate_kwargs()`` passes the
    settings the trace engine models on to :func:`memfit.estimate`.

    >>> settings = configure_allocator(expandable_segments=True, max_split_size_mb=256)
    >>> settings.conf
    'expandable_segments:True,max_split_size_mb:256'
    """
    opts = _options(expandable_segments, max_split_size_mb, roundup_power2_divisions,
                    garbage_collection_threshold, backend, pinned_use_host_register)
    conf = _join(opts)
    if not torch.cuda.is_initialized():
        # torch >= 2.9 reads PYTORCH_ALLOC_CONF first and falls back to the CUDA-specific name;
        # older torch reads only PYTORCH_CUDA_ALLOC_CONF: write that one always, and the new one
        # too when the user has set it (it would shadow ours).
        variables = [_ENV_OLD] + ([_ENV_NEW] if _ENV_NEW in os.environ else [])
        enabled = False
        for variable in variables:
            merged = _parse(os.environ.get(variable, ""))
            merged.update(opts)
            os.environ[variable] = _join(merged)
            log.info("memfit: %s=%s", variable, os.environ[variable])
            enabled = merged.get("expandable_segments", "False") in ("True", "true")
        return AllocatorSettings(conf=conf, applied="env", variables=tuple(variables),
                                 expandable_segments=enabled)
    fix = (f"call memfit.configure_allocator(...) before any CUDA work (first thing in the "
           f"script, before creating CUDA tensors or models), or start the process with "
           f"{_ENV_OLD}={conf} python train.py")
    fixed = sorted(set(opts) - RUNTIME_OPTIONS)
    if fixed:
        raise MemfitError(f"CUDA is already initialised, and {', '.join(fixed)} cannot change "
                          f"after that; {fix}")
    setter = _runtime_setter()
    if setter is None:
        raise MemfitError(f"CUDA is already initialised and this torch {torch.__version__} "
                          f"cannot change allocator settings at runtime; {fix}")
    setter(conf)
    log.info("memfit: allocator settings applied at runtime: %s (expandable_segments affects "
             "segments reserved from now on)", conf)
    return AllocatorSettings(conf=conf, applied="runtime", variables=(),
                             expandable_segments=opts.get("expandable_segments") == "True")
