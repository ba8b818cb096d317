"""DTensor's sharding propagation and DeviceMesh, patched for a per-rank trace on fake tensors.

Each patch is a context manager that restores what it replaced on exit, and names the torch
source it mirrors and the version it was checked against. The private names are registered in
:data:`memfit._compat.torch_internals.PRIVATE_NAMES` and ``OPTIONAL_NAMES``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

__all__ = [
    "device_meshes_made_real",
    "dtensor_foreach_propagation_once_per_shape",
    "dtensor_meta_propagation_within",
]


@contextlib.contextmanager
def dtensor_meta_propagation_within(
        context: Callable[[], contextlib.AbstractContextManager[Any]]) -> Iterator[None]:
    """Within the context, DTensor's output-metadata propagation runs inside ``context()``.

    ``torch/distributed/tensor/_sharding_prop.py:
    ShardingPropagator._propagate_tensor_meta_non_cached`` (torch 2.13.0; since 2.5) derives an
    op's global output shape by running it on global-shape tensors made in the active fake mode
    (``detect_fake_mode() or FakeTensorMode()``, "so that it avoids materializing memory"). In a
    trace that mode is the tracking one, and those metadata-only tensors would count as
    allocations (the full size of every parameter an optimizer touches, at each cache miss).
    Patched on the class, restored on exit."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def propagate(self: Any, op_schema: Any) -> Any:
        with context():
            return original(self, op_schema)

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate  # type: ignore[method-assign]
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original  # type: ignore[method-assign]


@contextlib.contextmanager
def dtensor_foreach_propagation_once_per_shape() -> Iterator[None]:
    """Within the context, DTensor's sharding propagation of a foreach op (an optimizer's
    ``_foreach_*`` over every parameter) works once per distinct element, not once per element;
    its result is the same.

    Note: [DTensor's foreach propagation] ``torch/distributed/tensor/_sharding_prop.py:
    ShardingPropagator.propagate_op_sharding_non_cached`` (torch 2.13.0) costs, at the first
    call of each foreach op (its result is cached by schema after that), time quadratic in the
    list's length: about 11 of the 19-23 CPU-s of a process's first per-rank trace of a 64-way
    FSDP2 Llama-3-70B (its first AdamW step: 723 parameters, 7 foreach ops):

    - ``_expand_single_dim_strategy_to_mesh``'s ``expanded_foreach_strategy`` (``_ops/
      single_dim_strategy.py``) builds each element's schema with a pytree map over every list
      and expands each element's strategy. An element's strategy is a function of its own
      inputs' specs (the ``DTensorSpec`` of each list at that index: mesh, placements, shard
      order, strided flag, shape, stride, dtype), its output's ``TensorMeta`` and the arguments
      that are not lists of tensors, which all elements share. Here the elements are grouped by
      exactly those values, the original expands a schema holding one element of each group, and
      each element gets its group's strategy (the caller only reads it: ``_propagate_use_
      strided_shard_flag`` fixes it up idempotently, ``_select_min_cost_strategy`` selects, the
      specs are copied with each element's own tensor metadata).
    - ``_propagate_use_strided_shard_flag(strategy, op_schema)``, called for each element,
      rebuilds ``op_schema.args_spec`` (every list) and scans every spec's placements each time;
      it reads ``op_schema`` only through ``args_spec`` and returns at once when no spec holds a
      ``_StridedShard``. Here the specs are found once per ``op_schema`` and the function runs
      (on those specs) only when one does.

    - ``ShardingPropagator._propagate_tensor_meta_non_cached`` runs the op on global-shape fake
      tensors made from every element's spec to learn the outputs' ``TensorMeta`` (the meta
      kernel of each element in Python). A foreach op's output at an index is a function of the
      inputs at that index (the lists' specs, a scalar list's value) and of the shared scalars,
      so the op runs on one element of each group of identical indices and each element gets
      its group's ``TensorMeta`` (an immutable tuple). Only ops whose arguments are lists of
      specs or numbers and shared numbers are grouped; anything else runs as torch runs it.

    The first two are patched on ``_sharding_prop`` (the caller looks the names up there), the
    third on the class (on top of :func:`dtensor_meta_propagation_within`'s patch when that is
    entered first), each restored on exit; the first two are skipped where torch lacks them."""
    from torch.distributed.tensor import _sharding_prop

    flag = getattr(_sharding_prop, "_propagate_use_strided_shard_flag", None)
    expand = getattr(_sharding_prop, "_expand_single_dim_strategy_to_mesh", None)
    last: list[Any] = [None, None]  # the op_schema seen last, its specs if one is strided
    propagator = _sharding_prop.ShardingPropagator
    meta = propagator._propagate_tensor_meta_non_cached

    if flag is not None:
        _sharding_prop._propagate_use_strided_shard_flag = _strided_flag_once(flag, last)
    if expand is not None:
        _sharding_prop._expand_single_dim_strategy_to_mesh = _expand_grouped(expand)
    propagator._propagate_tensor_meta_non_cached = _meta_grouped(meta)  # type: ignore[method-assign]
    try:
        yield
    finally:
        if flag is not None:
            _sharding_prop._propagate_use_strided_shard_flag = flag
        if expand is not None:
            _sharding_prop._expand_single_dim_strategy_to_mesh = expand
        propagator._propagate_tensor_meta_non_cached = meta  # type: ignore[method-assign]
        last.clear()


_NUMBERS = (int, float, bool, complex)

class _Specs:
    """What ``_propagate_use_strided_shard_flag`` reads of an ``OpSchema``: its ``args_spec``."""

    __slots__ = ("args_spec",)

    def __init__(self, specs: tuple[Any, ...]) -> None:
        self.args_spec = specs


def _strided_flag_once(flag: Callable[..., Any], last: list[Any]) -> Callable[..., Any]:
    """``_propagate_use_strided_shard_flag`` that finds an ``op_schema``'s specs once (``last``:
    the schema seen last, and its specs if one is strided) and runs ``flag`` on them only when
    one holds a ``_StridedShard`` (Note: [DTensor's foreach propagation], second item)."""
    from torch.distributed.tensor._op_schema import OpSchema
    from torch.distributed.tensor.placement_types import _StridedShard

    def propagate_flag(op_strategy: Any, op_schema: Any = None, *rest: Any, **kw: Any) -> Any:
        if rest or kw or type(op_schema) is not OpSchema:  # another signature
            return flag(op_strategy, op_schema, *rest, **kw)  # type: ignore[misc]
        if last[0] is not op_schema:
            specs = op_schema.args_spec
            strided = any(isinstance(p, _StridedShard) for s in specs for p in s.placements)
            last[0], last[1] = op_schema, _Specs(specs) if strided else None
        if last[1] is not None:
            flag(op_strategy, last[1])  # type: ignore[misc]
        return None

    return propagate_flag


def _expand_grouped(expand: Callable[..., Any]) -> Callable[..., Any]:
    """``_expand_single_dim_strategy_to_mesh`` expanding one element of each group of identical
    list elements of a foreach op, each element getting its group's strategy (Note: [DTensor's
    foreach propagation], first item); any other call goes to ``expand``."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, TupleStrategy

    def element_key(child: Any) -> Any:
        """The whole state of a list element's input strategy as ``_wrap_with_op_strategy``
        makes it (one ``OpSpec`` of one ``DTensorSpec``), or None for any other shape."""
        if type(child) is not OpStrategy or len(child.strategies) != 1:
            return None
        spec = child.strategies[0]
        out = spec.output_specs
        if (type(spec) is not OpSpec or spec.input_specs is not None
                or spec.redistribute_cost is not None or type(out) is not DTensorSpec):
            return None
        return out, out.use_strided_shard_as_shard_order

    def expand_grouped(*call: Any, **kw: Any) -> Any:
        if len(call) != 4 or kw or type(call[1]) is not OpSchema:  # another signature
            return expand(*call, **kw)  # type: ignore[misc]
        mesh, op_schema, info, out_meta = call
        args = op_schema.args_schema
        lists = [i for i, a in enumerate(args) if type(a) is TupleStrategy]
        if not lists or not op_schema.op.name().startswith(
                ("aten::_foreach_", "aten::_amp_foreach_", "aten::_fused_")):
            return expand(mesh, op_schema, info, out_meta)  # type: ignore[misc]
        length = len(args[lists[0]].children)
        if any(len(args[i].children) != length for i in lists) or (
                out_meta is not None and (not isinstance(out_meta, (list, tuple))
                                          or len(out_meta) != length)):
            return expand(mesh, op_schema, info, out_meta)  # type: ignore[misc]
        group_of: dict[Any, int] = {}
        groups: list[int] = []
        firsts: list[int] = []
        for j in range(length):
            key = tuple(element_key(args[i].children[j]) for i in lists)
            if None in key:
                return expand(mesh, op_schema, info, out_meta)  # type: ignore[misc]
            key += (out_meta[j] if out_meta is not None else None,)
            g = group_of.setdefault(key, len(group_of))
            if g == len(firsts):
                firsts.append(j)
            groups.append(g)
        if len(firsts) == length:
            return expand(mesh, op_schema, info, out_meta)  # type: ignore[misc]
        reduced = OpSchema(op_schema.op, tuple(
            TupleStrategy([a.children[j] for j in firsts]) if i in lists else a
            for i, a in enumerate(args)), op_schema.kwargs_schema,
            schema_info=op_schema.schema_info)
        reduced_meta = None if out_meta is None else [out_meta[j] for j in firsts]
        run = expand(mesh, reduced, info, reduced_meta)  # type: ignore[misc]

        def expanded(op: Any, _args: Any, _kwargs: Any) -> Any:
            children = run(op, reduced.args_meta, reduced.kwargs_meta).children
            return TupleStrategy([children[g] for g in groups])

        return expanded

    return expand_grouped


def _meta_grouped(meta: Callable[..., Any]) -> Callable[..., Any]:
    """``ShardingPropagator._propagate_tensor_meta_non_cached`` running a foreach op on one
    element of each group of identical indices, each element getting its group's
    ``TensorMeta`` (Note: [DTensor's foreach propagation], third item); anything else goes to
    ``meta``."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._op_schema import OpSchema

    def meta_grouped(self: Any, op_schema: Any) -> Any:
        args = op_schema.args_schema
        if (type(op_schema) is not OpSchema or op_schema.kwargs_schema
                or not op_schema.op.name().startswith(("aten::_foreach_", "aten::_fused_"))):
            return meta(self, op_schema)
        lists = [i for i, a in enumerate(args) if isinstance(a, list | tuple)]
        length = len(args[lists[0]]) if lists else 0
        for i, a in enumerate(args):
            if i in lists:
                if len(a) != length or not all(type(x) is DTensorSpec or type(x) in _NUMBERS
                                               for x in a):
                    return meta(self, op_schema)
            elif not (a is None or type(a) in _NUMBERS):  # a tensor, a spec: shared, keep
                return meta(self, op_schema)
        if not any(type(args[i][0]) is DTensorSpec for i in lists):
            return meta(self, op_schema)
        group_of: dict[Any, int] = {}
        groups: list[int] = []
        firsts: list[int] = []
        for j in range(length):
            key = tuple((args[i][j], args[i][j].use_strided_shard_as_shard_order)
                        if type(args[i][j]) is DTensorSpec else (type(args[i][j]), args[i][j])
                        for i in lists)
            g = group_of.setdefault(key, len(group_of))
            if g == len(firsts):
                firsts.append(j)
            groups.append(g)
        if len(firsts) == length:
            return meta(self, op_schema)
        reduced = OpSchema(op_schema.op, tuple(
            type(a)(a[j] for j in firsts) if i in lists else a for i, a in enumerate(args)),
            {}, schema_info=op_schema.schema_info)
        out = meta(self, reduced)
        if out is None:
            return None
        if not isinstance(out, list | tuple) or len(out) != len(firsts):
            return meta(self, op_schema)
        return type(out)(out[g] for g in groups)

    return meta_grouped


@contextlib.contextmanager
def device_meshes_made_real() -> Iterator[None]:
    """Inside the block, a ``DeviceMesh`` is constructed outside the fake mode; restored after.

    Note: [FSDP2 over tensor parallelism in a trace] ``fully_shard`` over DTensor parameters
    builds each parameter's 2-D ``(dp, tp)`` mesh while it shards (``torch/distributed/fsdp/
    _fully_shard/_fsdp_param.py: FSDPParam._init_sharding_spec_tp`` -> ``DeviceMesh.
    _concatenate``), and a mesh finds its own coordinates with ``(mesh == rank).nonzero()``
    on its rank map (``device_mesh.py: DeviceMesh._compute_coordinates_from_mesh``), a real
    CPU tensor that a fake mode would turn into a fake one of unknown size. A mesh holds no
    device memory."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        with unset_fake_temporarily():
            original(self, *args, **kwargs)

    DeviceMesh.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        DeviceMesh.__init__ = original  # type: ignore[method-assign]
