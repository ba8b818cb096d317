"""``PYTORCH_ALLOC_CONF`` / ``PYTORCH_CUDA_ALLOC_CONF``, parsed as PyTorch's allocator reads it
(``c10/core/AllocatorConfig.cpp``), into :class:`~memfit.trace.allocator.CachingAllocatorSim`
keyword arguments."""

from __future__ import annotations

import os
from typing import Any

from memfit.errors import MemfitError, suggest

MiB = 1 << 20

ALLOC_CONF_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
"""Read in this order (torch >= 2.9 reads ``PYTORCH_ALLOC_CONF`` first, ``c10/core/
AllocatorConfig.cpp: AcceleratorAllocatorConfig::parseArgs`` via ``getAllocatorConfigEnv``)."""


def allocator_options(conf: str | None = None) -> dict[str, Any]:
    """:class:`~memfit.trace.allocator.CachingAllocatorSim` keyword arguments for ``conf``, or,
    when ``conf`` is None, for the environment's ``PYTORCH_ALLOC_CONF`` /
    ``PYTORCH_CUDA_ALLOC_CONF`` (the first one set), as the allocator reads it at CUDA start.

    >>> allocator_options("max_split_size_mb:128")
    {'max_split_size': 134217728}
    """
    if conf is None:
        conf = next((os.environ[v] for v in ALLOC_CONF_VARIABLES if v in os.environ), "")
    return allocator_options_from_env(conf)


_BOOL_KEYS = ("release_lock_on_cudamalloc", "release_lock_on_hipmalloc",
              "pinned_use_cuda_host_register", "pinned_use_hip_host_register",
              "pinned_use_background_threads", "graph_capture_record_stream_reuse")
_INT_KEYS = ("pinned_num_register_threads", "pinned_reserve_segment_size_mb")
_KNOWN_KEYS = ("backend", "expandable_segments", "garbage_collection_threshold",
               "large_segment_size_mb", "max_non_split_rounding_mb", "max_split_size_mb",
               "roundup_power2_divisions",
               *_BOOL_KEYS, *_INT_KEYS)
_SPECIAL = ",:[]"


def _tokens(conf: str) -> list[str]:
    """``ConfigTokenizer``: ``, : [ ]`` are tokens of their own; spaces are dropped."""
    tokens: list[str] = []
    word = ""
    for ch in conf:
        if ch in _SPECIAL:
            if word:
                tokens.append(word)
                word = ""
            tokens.append(ch)
        elif ch != " ":
            word += ch
    if word:
        tokens.append(word)
    return tokens


def _bad(conf: str, what: str) -> MemfitError:
    return MemfitError(f"PYTORCH_CUDA_ALLOC_CONF {conf!r}: {what}; write comma-separated "
                       "key:value pairs, e.g. 'expandable_segments:True,max_split_size_mb:128'")


def allocator_options_from_env(conf: str) -> dict[str, Any]:
    """Parse a ``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF`` string into
    :class:`~memfit.trace.allocator.CachingAllocatorSim` keyword arguments.

    Follows ``AcceleratorAllocatorConfig::parseArgs`` (``c10/core/AllocatorConfig.cpp``):
    sizes in MiB become bytes (``max_split_size_mb`` and ``max_non_split_rounding_mb`` must be
    >= 20; ``large_segment_size_mb``, newest PyTorch only, must be even here),
    ``roundup_power2_divisions`` accepts one power of two or a list
    ``[256:1,512:2,>:4]`` (interval start in MiB: divisions) expanded to the 16-entry table.
    Options that do not change the simulated sizes (pinned memory, locks) are accepted and
    dropped; ``garbage_collection_threshold`` is kept (it acts only with a memory fraction,
    ``CachingAllocatorSim(allowed_memory_maximum=...)``); ``backend:cudaMallocAsync`` and unknown
    keys raise :class:`MemfitError`.

    >>> allocator_options_from_env("expandable_segments:True,max_split_size_mb:128")
    {'expandable_segments': True, 'max_split_size': 134217728}
    """
    tokens = _tokens(conf)
    options: dict[str, Any] = {}
    i = 0

    def value_at(j: int, key: str) -> str:
        if j >= len(tokens) or tokens[j] in _SPECIAL:
            raise _bad(conf, f"expected a value after {key}:")
        return tokens[j]

    while i < len(tokens):
        key = tokens[i]
        if key in _SPECIAL:
            raise _bad(conf, f"expected an option name, found {key!r}")
        if key not in _KNOWN_KEYS:
            hint = suggest(key, _KNOWN_KEYS) or f"; valid: {', '.join(sorted(_KNOWN_KEYS))}"
            raise _bad(conf, f"unknown option {key!r}{hint}")
        if i + 1 >= len(tokens) or tokens[i + 1] != ":":
            raise _bad(conf, f"expected ':' after {key}")
        i += 2
        if key == "roundup_power2_divisions" and i < len(tokens) and tokens[i] == "[":
            table, i = _parse_divisions_list(conf, tokens, i)
            options["roundup_power2_divisions"] = table
        else:
            value = value_at(i, key)
            _apply(conf, options, key, value)
        i += 1
        if i < len(tokens):
            if tokens[i] != ",":
                raise _bad(conf, f"expected ',' after the value of {key}, found {tokens[i]!r}")
            i += 1
            if i == len(tokens):
                raise _bad(conf, "trailing ','")
    return options


def _as_int(conf: str, key: str, value: str) -> int:
    if not value.isdigit():
        raise _bad(conf, f"{key} must be a whole number, got {value!r}")
    return int(value)


def _as_bool(conf: str, key: str, value: str) -> bool:
    # c10/core/AllocatorConfig.h: ConfigTokenizer::toBool accepts exactly "True" or "False"
    if value == "True":
        return True
    if value == "False":
        return False
    raise _bad(conf, f"{key} must be True or False, got {value!r}")


def _apply(conf: str, options: dict[str, Any], key: str, value: str) -> None:
    if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
        mb = _as_int(conf, key, value)
        if mb < 20:  # kLargeBuffer / kMB
            raise _bad(conf, f"{key} must be >= 20 (MiB), got {mb}")
        name = "max_split_size" if key == "max_split_size_mb" else "max_non_split_rounding_size"
        options[name] = mb * MiB
    elif key == "large_segment_size_mb":
        mb = _as_int(conf, key, value)
        if mb == 0 or mb % 2:
            raise _bad(conf, f"large_segment_size_mb must be a positive multiple of 2 (MiB), "
                             f"got {mb}")
        options["large_segment_size"] = mb * MiB
    elif key == "expandable_segments":
        options["expandable_segments"] = _as_bool(conf, key, value)
    elif key == "roundup_power2_divisions":
        divisions = _as_int(conf, key, value)
        if divisions == 0 or divisions & (divisions - 1):
            raise _bad(conf, f"roundup_power2_divisions must be a power of two, got {divisions}")
        options["roundup_power2_divisions"] = [divisions] * 16
    elif key == "garbage_collection_threshold":
        try:
            threshold = float(value)
        except ValueError:
            raise _bad(conf, f"garbage_collection_threshold must be a number, got {value!r}"
                       ) from None
        if not 0.0 < threshold < 1.0:
            raise _bad(conf, f"garbage_collection_threshold must be in (0.0, 1.0), got {value}")
        # Acts only after set_per_process_memory_fraction (CachingAllocatorSim's
        # allowed_memory_maximum): garbage_collect_cached_blocks runs under `set_fraction`.
        options["garbage_collection_threshold"] = threshold
    elif key == "backend":
        if value == "cudaMallocAsync":
            raise _bad(conf, "backend:cudaMallocAsync is not modelled (memfit simulates the "
                             "native caching allocator); remove it or use backend:native")
        if value != "native":
            raise _bad(conf, f"backend must be native or cudaMallocAsync, got {value!r}")
    elif key in _BOOL_KEYS:
        _as_bool(conf, key, value)
    else:  # _INT_KEYS
        _as_int(conf, key, value)


def _parse_divisions_list(conf: str, tokens: list[str], i: int) -> tuple[list[int], int]:
    """``parseRoundUpPower2Divisions``' list form; returns (table, index of the ']')."""
    table = [0] * 16
    first = True
    last_index = 0
    i += 1  # past '['
    while i < len(tokens) and tokens[i] != "]":
        boundary = tokens[i]
        if i + 2 >= len(tokens) or tokens[i + 1] != ":":
            raise _bad(conf, f"roundup_power2_divisions entries are size_mb:divisions, got "
                             f"{boundary!r}")
        divisions = _as_int(conf, "roundup_power2_divisions", tokens[i + 2])
        if divisions & (divisions - 1):
            raise _bad(conf, f"roundup_power2_divisions must be powers of two or 0, got "
                             f"{divisions}")
        if boundary == ">":
            # AcceleratorAllocatorConfig::parseRoundUpPower2Divisions (torch >= 2.9): from
            # last_index + 1 on; torch <= 2.8 filled from last_index, overwriting that entry.
            table[last_index + 1:] = [divisions] * (15 - last_index)
        else:
            size_mb = _as_int(conf, "roundup_power2_divisions", boundary)
            if size_mb == 0 or size_mb & (size_mb - 1):
                raise _bad(conf, f"roundup_power2_divisions intervals must be powers of two "
                                 f"(MiB), got {size_mb}")
            index = min(size_mb.bit_length() - 1, 15)
            if first:
                table[:index] = [divisions] * index
                first = False
            table[index] = divisions
            last_index = index
        i += 3
        if i < len(tokens) and tokens[i] == ",":
            i += 1
    if i >= len(tokens):
        raise _bad(conf, "roundup_power2_divisions list has no closing ']'")
    return table, i
