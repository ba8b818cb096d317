"""Model anatomy: where a model keeps its repeated blocks, how many attention heads and layers it
has, and how one of its submodules is swapped for another.

Read by the techniques (checkpointing wraps the blocks), the trace engine (per-block
attribution), the progress display (a layer counter) and the parallel layouts (FSDP units,
pipeline stages), so it lives below all of them.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from memfit.errors import MemfitError, suggest

__all__ = ["COLWISE_PROJECTIONS", "EXPERT_PARAMS", "ROWWISE_PROJECTIONS", "TP_PROJECTIONS",
           "config_int", "find_blocks", "model_shape", "replace_module"]

COLWISE_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
"""The linear projections of a block that tensor parallelism splits by output features
(``ColwiseParallel``): the attention's query, key and value, the MLP's gate and up."""
ROWWISE_PROJECTIONS = ("o_proj", "down_proj")
"""The projections split by input features (``RowwiseParallel``): attention output, MLP down."""
TP_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every projection memfit's tensor parallelism splits (:data:`COLWISE_PROJECTIONS` and
:data:`ROWWISE_PROJECTIONS`, in a block's order)."""
EXPERT_PARAMS = ("gate_proj", "up_proj", "down_proj", "gate_bias", "up_bias", "down_bias")
"""The builtin MoE's stacked expert parameters (dim 0: the expert), which expert parallelism
splits; the router stays replicated."""


def find_blocks(model: nn.Module,
                blocks: str | type | Sequence[str | type] | None = None) -> list[str]:
    """Names of the modules to checkpoint.

    ``blocks=None``: the children of the ``ModuleList``/``Sequential`` of two or more same-type
    modules holding the most parameters. A string names a container (its children are the blocks)
    or one block; a type selects every outermost module of that type; a list mixes them.

    >>> find_blocks(build_model(spec))
    ['model.layers.0', 'model.layers.1', ...]
    """
    modules = dict(model.named_modules())
    if blocks is None:
        return _auto_blocks(model)
    items: Sequence[str | type] = ([blocks] if isinstance(blocks, str | type) else list(blocks))
    names: list[str] = []
    for item in items:
        if isinstance(item, type):
            found = [n for n, m in modules.items() if isinstance(m, item) and n
                     and not any(n.startswith(o + ".") for o in names)]
            if not found:
                raise MemfitError(f"no module of type {item.__name__} in the model; pass block "
                                  "names or types that exist (see print(model))")
            names.extend(n for n in found if not any(n.startswith(o + ".") for o in found))
        elif isinstance(item, str):
            if item not in modules or not item:
                raise MemfitError(f"no module named {item!r} in the model"
                                  f"{suggest(item, [n for n in modules if n])}; pass a name from "
                                  "model.named_modules()")
            mod = modules[item]
            if isinstance(mod, nn.ModuleList | nn.Sequential):
                names.extend(f"{item}.{c}" for c, _ in mod.named_children())
            else:
                names.append(item)
        else:
            raise MemfitError(f"blocks must be names or module types, got {item!r}")
    return list(dict.fromkeys(names))


def _auto_blocks(model: nn.Module) -> list[str]:
    best: tuple[int, str, list[str]] | None = None
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList | nn.Sequential):
            continue
        children = list(mod.named_children())
        # A ModuleList of one block counts (a one-layer config); a Sequential needs two.
        minimum = 1 if isinstance(mod, nn.ModuleList) else 2
        if len(children) < minimum or len({type(c) for _, c in children}) != 1:
            continue
        if not any(True for _, c in children for _ in c.parameters()):
            continue
        params = sum(p.numel() for p in mod.parameters())
        prefix = f"{name}." if name else ""
        if best is None or params > best[0]:
            best = (params, name, [prefix + c for c, _ in children])
    if best is None:
        raise MemfitError(
            f"found no repeated blocks in {type(model).__name__} (a ModuleList or Sequential of "
            "two or more modules of one type); pass blocks= with block names or types")
    return best[2]


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` in place of the submodule ``name`` of ``model`` (a dotted name from
    ``model.named_modules()``)."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def config_int(model: nn.Module, names: tuple[str, ...]) -> int | None:
    """The first of ``names`` that the model's config (a transformers ``config``, or memfit's
    builtin ``spec``) holds as an integer; None where it holds none."""
    config = getattr(model, "config", None) or getattr(model, "spec", None)
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def _count(model: nn.Module, config_names: tuple[str, ...], attr: str) -> int | None:
    """A head count from the model's config, else from a module's own attribute (memfit's
    builtin Attention: ``num_heads``, ``num_kv_heads``)."""
    value = config_int(model, config_names)
    if value is not None:
        return value
    return next((getattr(m, attr) for m in model.modules()
                 if isinstance(getattr(m, attr, None), int)), None)


def model_shape(model: nn.Module) -> tuple[int | None, int | None, int | None]:
    """(attention heads, KV heads, layers) of a model, where its config or structure says them
    (None where it does not): the checks of a parallel layout read them.

    >>> model_shape(build_model(spec))
    (12, 12, 12)
    """
    heads = _count(model, ("num_attention_heads", "n_head", "num_heads"), "num_heads")
    kv_heads = _count(model, ("num_key_value_heads",), "num_kv_heads")
    try:
        layers: int | None = len(find_blocks(model)) or None
    except MemfitError:
        layers = None
    return heads, kv_heads, layers
