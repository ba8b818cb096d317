"""Built-in model presets, shipped as data in ``memfit/data/models.json`` (shapes, no weights).

Each entry holds TransformerSpec's fields plus ``published_params`` (the published parameter
count, which ``param_count()`` reproduces exactly; tests check it) and ``aliases`` (Hugging Face
repo ids and common spellings). Names are matched case-insensitively, with ``_`` read as ``-``.

A *trace-only* entry holds ``hf_config`` (the model's config.json) instead of shapes: an
architecture the formulas cannot express (DeepSeek-V3's multi-head latent attention). It loads as
an :class:`~memfit.models.hf_auto.HFModelSpec` whose ``params`` is ``published_params`` (tests
check it against the transformers model built on meta); planning it traces that model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from functools import cache
from importlib import resources

from memfit.errors import MemfitError, suggest
from memfit.models.hf_auto import HFModelSpec
from memfit.models.spec import TransformerSpec

_SPEC_FIELDS = frozenset(f.name for f in fields(TransformerSpec))


@dataclass(frozen=True, kw_only=True)
class _Preset:
    spec: TransformerSpec | HFModelSpec
    published_params: int
    aliases: tuple[str, ...]


def _key(name: str) -> str:
    return name.strip().lower().replace("_", "-")


@cache
def _load() -> tuple[dict[str, _Preset], dict[str, str]]:
    """Presets by canonical name, and every lookup key (names and aliases) -> canonical name."""
    text = resources.files("memfit").joinpath("data/models.json").read_text(encoding="utf-8")
    presets: dict[str, _Preset] = {}
    index: dict[str, str] = {}
    for entry in json.loads(text)["presets"]:
        entry = dict(entry)
        published = entry.pop("published_params")
        aliases = tuple(entry.pop("aliases", ()))
        entry.pop("_comment", None)
        if "hf_config" in entry:
            spec: TransformerSpec | HFModelSpec = _trace_only(entry, published)
            presets[spec.name] = _Preset(spec=spec, published_params=published, aliases=aliases)
            _index(index, spec.name, aliases)
            continue
        unknown = set(entry) - _SPEC_FIELDS
        if unknown:  # a broken data file is our bug, not the user's
            raise RuntimeError(f"models.json: preset {entry.get('name')!r} has unknown fields "
                               f"{sorted(unknown)}")
        spec = TransformerSpec(**entry)
        presets[spec.name] = _Preset(spec=spec, published_params=published, aliases=aliases)
        _index(index, spec.name, aliases)
    return presets, index


def _index(index: dict[str, str], name: str, aliases: tuple[str, ...]) -> None:
    for key in (name, *aliases):
        if index.setdefault(_key(key), name) != name:
            raise RuntimeError(f"models.json: name {key!r} is used by two presets")


def _trace_only(entry: dict[str, object], published: int) -> HFModelSpec:
    config = entry["hf_config"]
    if not isinstance(config, dict) or set(entry) - {"name", "hf_config", "source"}:
        raise RuntimeError(f"models.json: trace-only preset {entry.get('name')!r} must hold "
                           "name, hf_config, source, published_params, aliases")
    return HFModelSpec(name=str(entry["name"]), params=published,
                       model_type=str(config["model_type"]), task="causal-lm", config=config,
                       source=str(entry.get("source")))


def _find(name: str) -> _Preset:
    presets, index = _load()
    canonical = index.get(_key(name))
    if canonical is None:
        hint = suggest(_key(name), presets) or suggest(_key(name), index)
        raise MemfitError(f"unknown model {name!r}{hint}; run `memfit models` for the presets, "
                          f"or pass a path to a Hugging Face config.json")
    return presets[canonical]


def is_preset(name: str) -> bool:
    """Whether ``name`` is a preset name or alias (case-insensitive)."""
    return _key(name) in _load()[1]


def get_preset(name: str) -> TransformerSpec | HFModelSpec:
    """The preset called ``name`` (or one of its aliases), case-insensitive.

    >>> get_preset("meta-llama/Meta-Llama-3-8B").param_count()
    8030261248

    Unknown names raise MemfitError suggesting the closest ones. Trace-only presets
    (``deepseek-v3``) are :class:`~memfit.models.hf_auto.HFModelSpec`.
    """
    return _find(name).spec


def published_params(name: str) -> int:
    """The published parameter count of a preset (tied weights counted once).

    >>> published_params("gpt2")
    124439808
    """
    return _find(name).published_params


def preset_aliases(name: str) -> tuple[str, ...]:
    """The other names a preset answers to (Hugging Face repo ids, common spellings)."""
    return _find(name).aliases


def list_presets(*, include_trace_only: bool = False) -> list[TransformerSpec]:
    """The presets the formulas cover, in the data file's order (by family, then size).

    ``include_trace_only=True`` adds the trace-only ones (HFModelSpec, e.g. ``deepseek-v3``) in
    their places; they have the same table attributes (``family``, ``num_layers``, ...).
    """
    return [p.spec for p in _load()[0].values()
            if include_trace_only or isinstance(p.spec, TransformerSpec)]  # type: ignore[misc]
