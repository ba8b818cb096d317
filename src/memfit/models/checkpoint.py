"""Exact parameter counts and stored dtypes from safetensors headers, without loading weights.

The safetensors format (https://huggingface.co/docs/safetensors/index, "Format"; the
huggingface/safetensors README) is: 8 bytes, an unsigned little-endian 64-bit integer N; N bytes
of UTF-8 JSON, an object mapping each tensor name to ``{"dtype", "shape", "data_offsets":
[begin, end]}`` (byte offsets into the buffer that follows) plus an optional ``__metadata__``
object of strings; then the tensors' bytes. Only the 8 + N header bytes are read here (the
reference implementation caps N at 100,000,000 bytes; so does this reader). Nothing is
unpickled, executed or loaded: ``json.loads`` of the header is all.

A sharded checkpoint has ``model.safetensors.index.json``: ``{"metadata": {"total_size": ...},
"weight_map": {tensor name: shard file}}`` (transformers' ``save_pretrained``); every shard's
header is read and each tensor counted once.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit.errors import MemfitError

__all__ = ["DTYPE_BITS", "CheckpointInfo", "checkpoint_for", "compare_with_config",
           "find_checkpoint", "read_safetensors", "tensor_entries"]

# safetensors dtype names -> bits per element (the format's Dtype enum).
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32, "C64": 64,
    "I64": 64, "U64": 64, "F64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit (MAX_HEADER_SIZE)
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


@dataclass(frozen=True, kw_only=True)
class CheckpointInfo:
    """What a safetensors checkpoint holds, from its headers."""

    params: int
    """Elements of all tensors, each tensor once (HF checkpoints store tied weights once)."""
    params_by_dtype: dict[str, int]
    bytes_by_dtype: dict[str, int]
    tensors: int
    files: tuple[Path, ...]

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_dtype.values())

    @property
    def main_dtype(self) -> str:
        """The dtype holding the most parameters (the checkpoint's weight dtype)."""
        return max(self.params_by_dtype, key=lambda d: self.params_by_dtype[d])


def _fail(path: Path, what: str) -> MemfitError:
    return MemfitError(f"{path}: not a valid safetensors file ({what}); re-download or re-save "
                       "the checkpoint, or pass its config.json file instead of the folder")


def _header(path: Path) -> tuple[dict[str, Any], int]:
    """The parsed header and the size of the data buffer after it."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise _fail(path, f"{size} bytes, shorter than the 8-byte header length")
            (length,) = struct.unpack("<Q", prefix)
            if length > MAX_HEADER_BYTES:
                raise _fail(path, f"header length {length:,} bytes exceeds the format's limit "
                            f"of {MAX_HEADER_BYTES:,}")
            if 8 + length > size:
                raise _fail(path, f"header length {length:,} bytes runs past the end of the "
                            f"{size:,}-byte file")
            raw = f.read(length)
    except OSError as exc:
        raise MemfitError(f"cannot read {path} ({exc}); check the file's permissions") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _fail(path, f"header is not UTF-8 JSON: {exc}") from None
    if not isinstance(header, dict):
        raise _fail(path, "header is not a JSON object")
    return header, size - 8 - length


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _tensors(path: Path) -> dict[str, tuple[str, int, int]]:
    """name -> (dtype, elements, bytes), validated against the data_offsets and file size."""
    header, buffer = _header(path)
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not isinstance(metadata, dict):
        raise _fail(path, "'__metadata__' is not an object")
    out: dict[str, tuple[str, int, int]] = {}
    for name, entry in header.items():
        if not isinstance(entry, dict):
            raise _fail(path, f"tensor {name!r} is not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in DTYPE_BITS:
            raise _fail(path, f"tensor {name!r} has unknown dtype {dtype!r}")
        if (not isinstance(shape, list) or any(isinstance(d, bool) or not isinstance(d, int)
                                               or d < 0 for d in shape)):
            raise _fail(path, f"tensor {name!r} has a bad shape {shape!r}")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or any(isinstance(o, bool) or not isinstance(o, int) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= buffer):
            raise _fail(path, f"tensor {name!r} has bad data_offsets {offsets!r} for a "
                        f"{buffer:,}-byte buffer")
        numel = _numel(shape)
        nbytes = offsets[1] - offsets[0]
        if nbytes != -(-numel * DTYPE_BITS[dtype] // 8):  # ceil: sub-byte dtypes pack
            raise _fail(path, f"tensor {name!r}: {nbytes} bytes for {numel} {dtype} elements")
        out[name] = (dtype, numel, nbytes)
    return out


def read_safetensors(path: str | Path) -> CheckpointInfo:
    """Parameter count and per-dtype bytes of a ``.safetensors`` file, or of a sharded
    checkpoint's ``model.safetensors.index.json`` (every shard it names), from the headers only.

    >>> info = read_safetensors("Llama-3.1-8B/model.safetensors.index.json")  # doctest: +SKIP
    >>> info.params, info.main_dtype
    (8030261248, 'BF16')

    Malformed headers, missing shards and tensors the index names but no shard holds raise
    MemfitError (one line).
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise MemfitError(f"{path}: no such file; pass a .safetensors file or a {INDEX_NAME}")
    if path.name.endswith(".json"):
        tensors, files = _sharded(path)
    else:
        tensors, files = _tensors(path), (path,)
    params_by: dict[str, int] = {}
    bytes_by: dict[str, int] = {}
    for dtype, numel, nbytes in tensors.values():
        params_by[dtype] = params_by.get(dtype, 0) + numel
        bytes_by[dtype] = bytes_by.get(dtype, 0) + nbytes
    return CheckpointInfo(params=sum(params_by.values()), params_by_dtype=params_by,
                          bytes_by_dtype=bytes_by, tensors=len(tensors), files=files)


def _sharded(index: Path) -> tuple[dict[str, tuple[str, int, int]], tuple[Path, ...]]:
    from memfit.errors import read_json_file

    data = read_json_file(index, what="safetensors index", fix=(
        "re-download it, or pass the config.json file instead of the folder"))
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()):
        raise MemfitError(f"{index}: no 'weight_map' of tensor name -> shard file; re-download "
                          "it, or pass the config.json file instead of the folder")
    shards = sorted(set(weight_map.values()))
    tensors: dict[str, tuple[str, int, int]] = {}
    files = []
    for shard in shards:
        shard_path = index.parent / shard
        if Path(shard).name != shard or not shard_path.is_file():
            raise MemfitError(f"{index}: shard {shard!r} is missing from {index.parent}; "
                              "download every shard, or pass the config.json file instead of "
                              "the folder")
        files.append(shard_path)
        for name, value in _tensors(shard_path).items():
            tensors.setdefault(name, value)
    missing = sorted(set(weight_map) - set(tensors))
    if missing:
        raise MemfitError(f"{index}: {len(missing)} tensors of the weight_map are in no shard "
                          f"(first: {missing[0]!r}); re-download the checkpoint")
    return tensors, tuple(files)


def find_checkpoint(folder: str | Path) -> CheckpointInfo | None:
    """The checkpoint in a model folder (sharded index first, then ``model.safetensors``), or
    None when it has neither."""
    folder = Path(folder)
    for name in (INDEX_NAME, SINGLE_NAME):
        if (folder / name).is_file():
            return read_safetensors(folder / name)
    return None


def tensor_entries(folder: str | Path) -> dict[str, tuple[str, int, int]] | None:
    """Each tensor of a model folder's checkpoint, ``name -> (dtype, elements, bytes)``, from
    the headers (sharded index first, then ``model.safetensors``); None when it has neither.
    For callers that need the tensors by name (``memfit.serving``'s per-rank sharding)."""
    folder = Path(folder)
    if (folder / INDEX_NAME).is_file():
        return _sharded(folder / INDEX_NAME)[0]
    if (folder / SINGLE_NAME).is_file():
        return _tensors(folder / SINGLE_NAME)
    return None


def compare_with_config(info: CheckpointInfo, spec: Any) -> str:
    """One line: the checkpoint's count and stored dtype against the config's count."""
    count = spec.param_count()
    dtypes = ", ".join(f"{d.lower()} {info.params_by_dtype[d]:,}" for d in sorted(
        info.params_by_dtype, key=lambda d: -info.params_by_dtype[d]))
    shards = f"{len(info.files)} safetensors files" if len(info.files) > 1 else info.files[0].name
    head = f"checkpoint ({shards}): {info.params:,} parameters stored as {dtypes}"
    diff = info.params - count
    if diff == 0:
        return f"{head}; matches the config's count"
    why = ""
    hidden, vocab = getattr(spec, "hidden_size", 0), getattr(spec, "vocab_size", 0)
    if hidden and vocab and diff == hidden * vocab and getattr(spec, "tie_embeddings", False):
        why = " (the checkpoint stores the LM head apart from the tied embeddings)"
    elif hidden and vocab and diff == -hidden * vocab:
        why = " (the checkpoint has no separate LM head: its embeddings are tied)"
    return (f"{head}; the config counts {count:,} ({diff:+,}){why}; memory is planned from "
            "the config")


def checkpoint_for(spec: Any) -> CheckpointInfo | None:
    """The safetensors checkpoint next to the config.json ``spec`` was read from (a local folder
    or a hub-cache snapshot), or None (presets, ``--params``, a folder without weights)."""
    source = getattr(spec, "source", None)
    if not source or not str(source).endswith(".json"):
        return None
    path = Path(source)
    return find_checkpoint(path.parent) if path.is_file() else None


def checkpoint_dict(info: CheckpointInfo, spec: Any) -> dict[str, Any]:
    """The JSON form: counts, bytes per dtype, files, the config's count."""
    return {"params": info.params, "config_params": spec.param_count(),
            "params_by_dtype": {d.lower(): n for d, n in info.params_by_dtype.items()},
            "bytes_by_dtype": {d.lower(): n for d, n in info.bytes_by_dtype.items()},
            "dtype": info.main_dtype.lower(), "tensors": info.tensors,
            "files": [str(f) for f in info.files]}
