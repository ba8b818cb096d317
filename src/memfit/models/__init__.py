"""Model specs: presets shipped as data, Hugging Face config.json files, or a parameter count."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from memfit.errors import MemfitError
from memfit.models.hf_auto import HFModelSpec
from memfit.models.hf_config import SUPPORTED_MODEL_TYPES, load_hf_config
from memfit.models.hub import cached_snapshot, looks_like_hub_id
from memfit.models.presets import (
    get_preset,
    is_preset,
    list_presets,
    preset_aliases,
    published_params,
)
from memfit.models.spec import LinearShape, ModelSpec, ParamCountSpec, TransformerSpec

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "HFModelSpec",
    "LinearShape",
    "ModelSpec",
    "ParamCountSpec",
    "TransformerSpec",
    "get_preset",
    "is_preset",
    "list_presets",
    "load_hf_config",
    "preset_aliases",
    "published_params",
    "resolve_model",
]


def _looks_like_path(text: str) -> bool:
    return ("/" in text or "\\" in text or text.lower().endswith(".json")
            or text.startswith((".", "~")))


def resolve_model(name_or_path: str | Path) -> TransformerSpec | HFModelSpec:
    """A preset name/alias, a path to a Hugging Face config.json (or its directory), or a hub id
    (``org/name``) found in the local Hugging Face cache (never downloaded).

    >>> resolve_model("llama-3-8b").num_layers
    32

    An existing local path wins over a preset alias that looks like a path (a local
    ``meta-llama/Meta-Llama-3-8B`` snapshot is read from disk, as transformers would); a string
    that looks like a path but does not exist raises MemfitError, as does an unknown name. An
    ``org/name`` that is neither a local path nor a preset alias is looked up in the hub cache
    (:func:`memfit.models.hub.cached_snapshot`); not cached, the error says how to get it.
    """
    text = str(name_or_path).strip()
    if not text:
        raise MemfitError("empty model name; pass a preset name (run `memfit models`) or a path "
                          "to a Hugging Face config.json")
    path = Path(text).expanduser()
    looks_like_path = _looks_like_path(text)
    if is_preset(text) and not (looks_like_path and path.exists()):
        return get_preset(text)
    if path.is_file() or (path.is_dir() and looks_like_path):
        return load_hf_config(path)
    if path.is_dir() and (path / "config.json").is_file():
        return load_hf_config(path)
    if looks_like_hub_id(text) and not is_preset(text):
        # Named by its hub id, not by the snapshot folder (a commit hash).
        return dataclasses.replace(load_hf_config(cached_snapshot(text)), name=text)
    if looks_like_path:
        raise MemfitError(f"{text}: no such file or directory; pass a path to a Hugging Face "
                          f"config.json (or its directory) or a preset name (run `memfit models`)")
    return get_preset(text)  # raises: unknown model, with the closest names
