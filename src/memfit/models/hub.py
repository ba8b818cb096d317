"""Hugging Face hub ids (``meta-llama/Llama-3.1-8B``) from the local hub cache, never the network.

The cache layout is the one huggingface_hub documents ("Hub Local Cache",
https://huggingface.co/docs/hub/local-cache; "Manage huggingface_hub cache-system",
https://huggingface.co/docs/huggingface_hub/guides/manage-cache)::

    <cache>/models--<org>--<name>/refs/main              the commit hash "main" points at
    <cache>/models--<org>--<name>/snapshots/<hash>/config.json

where ``<cache>`` is ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
``~/.cache/huggingface/hub`` (``$XDG_CACHE_HOME/huggingface/hub`` when that is set, as
huggingface_hub's ``constants.py`` computes ``HF_HOME``). When huggingface_hub is installed its
``try_to_load_from_cache`` (a pure file-system lookup) answers; without it the layout above is
read directly. Either way only ``refs/main`` is followed, as
``from_pretrained(..., local_files_only=True)`` would.
"""

from __future__ import annotations

import importlib
import os
import re
from pathlib import Path

from memfit.errors import MemfitError

__all__ = ["cached_snapshot", "hub_cache_dir", "looks_like_hub_id"]

# "org/name": the Hub's repo id rules (letters, digits, '-', '_', '.'; one '/').
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_REVISION = re.compile(r"^[A-Za-z0-9_.-]+$")  # a snapshot folder name (a commit hash)


def looks_like_hub_id(text: str) -> bool:
    """``org/name`` with no path-like parts (``./``, ``~``, a ``.json`` file name)."""
    return bool(_HUB_ID.match(text)) and not text.lower().endswith(".json") and ".." not in text


def hub_cache_dir() -> Path:
    """Where huggingface_hub keeps downloads on this machine (the environment, read now)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):  # the second is the legacy name
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path("~/.cache").expanduser()
    return base / "huggingface" / "hub"


def _snapshot_by_layout(repo_id: str, cache: Path) -> Path | None:
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    ref = repo / "refs" / "main"
    if not ref.is_file():
        return None
    commit = ref.read_text(encoding="utf-8", errors="replace").strip()
    if not _REVISION.match(commit) or commit.strip(".") == "":
        return None
    config = repo / "snapshots" / commit / "config.json"
    return config if config.is_file() else None


def _snapshot_by_hub(repo_id: str, cache: Path) -> Path | bool | None:
    """huggingface_hub's own lookup; False when huggingface_hub is not installed."""
    try:
        hub = importlib.import_module("huggingface_hub")
    except ImportError:
        return False
    try:
        found = hub.try_to_load_from_cache(repo_id, "config.json", cache_dir=str(cache))
    except ValueError:  # huggingface_hub's HFValidationError: not a valid repo id
        return None
    return Path(found) if isinstance(found, str) else None  # None or _CACHED_NO_EXIST


def cached_snapshot(repo_id: str) -> Path:
    """The cached snapshot folder (the one ``refs/main`` names) holding ``repo_id``'s
    config.json. Reads the file system only.

    >>> cached_snapshot("Qwen/Qwen3-8B")  # doctest: +SKIP
    PosixPath('/home/me/.cache/huggingface/hub/models--Qwen--Qwen3-8B/snapshots/b968.../')

    Not cached: MemfitError saying how to get the config (one file, a few KiB).
    """
    cache = hub_cache_dir()
    found = _snapshot_by_hub(repo_id, cache)
    if found is False:
        found = _snapshot_by_layout(repo_id, cache)
    if isinstance(found, Path):
        return found.parent
    raise MemfitError(
        f"{repo_id}: not in the local Hugging Face cache ({cache}; memfit never downloads); get "
        f"its config with `huggingface-cli download {repo_id} config.json` (or `hf download`), "
        "or pass a path to a config.json, or a preset name (run `memfit models`)")
