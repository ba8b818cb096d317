"""DTensor's sharding propagation of foreach ops, once per distinct element
(memfit/_compat/torch_dtensor.py: dtensor_foreach_propagation_once_per_shape).

The patch must give exactly torch's answer. torch/distributed/tensor/_sharding_prop.py:
ShardingPropagator.propagate_op_sharding_non_cached expands each element of a foreach op
(_ops/single_dim_strategy.py: _expand_single_dim_strategy_to_mesh, its
expanded_foreach_strategy) and calls _propagate_use_strided_shard_flag once per element; the
patch expands one element per group of identical elements. Each test compares the patched
propagation with torch's own on the same schema (the expected value is torch's unpatched
output), over lists that mix shapes, dtypes and placements, including elements that need a
redistribution and a 2-D mesh with _StridedShard placements (FSDP2 + TP's layout).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from memfit._compat import torch_dtensor, torch_fsdp
from memfit.parallel.trace import fake_world

pytest.importorskip("torch.distributed.tensor")

from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._ops import single_dim_strategy
from torch.distributed.tensor.placement_types import _StridedShard

aten = torch.ops.aten


@contextlib.contextmanager
def _world(shape: tuple[int, ...]) -> Iterator[Any]:
    world = 1
    for n in shape:
        world *= n
    with fake_world(world, 0):
        yield init_device_mesh("cpu", shape)


def _dt(mesh: Any, shape: tuple[int, ...], placements: tuple[Any, ...],
        dtype: torch.dtype = torch.float32) -> DTensor:
    """A DTensor of global ``shape`` (its local shard made from the placements' sizes)."""
    return DTensor.from_local(torch.zeros(_local(shape, mesh, placements), dtype=dtype), mesh,
                              placements, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride(),
                              run_check=False)


def _local(shape: tuple[int, ...], mesh: Any, placements: tuple[Any, ...]) -> tuple[int, ...]:
    local = list(shape)
    for dim_size, p in zip(mesh.shape, placements, strict=True):
        if isinstance(p, Shard):
            local[p.dim] = -(-local[p.dim] // dim_size)
    return tuple(local)


def _propagate(op: Any, args: tuple[Any, ...], patched: bool) -> tuple[Any, int]:
    """torch's output sharding for ``op(*args)`` and how many element strategies it prepared
    (``_PreparedSingleDimStrategy``: one per element expanded)."""
    dispatcher = DTensor._op_dispatcher
    info = dispatcher.unwrap_to_op_info(op, args, {})
    prepared = single_dim_strategy._PreparedSingleDimStrategy
    original_init = prepared.__init__
    count = [0]

    def counting(self: Any, *a: Any, **k: Any) -> None:
        count[0] += 1
        original_init(self, *a, **k)

    prepared.__init__ = counting  # type: ignore[method-assign]
    try:
        with torch_dtensor.dtensor_foreach_propagation_once_per_shape() if patched \
                else contextlib.nullcontext():
            out = dispatcher.sharding_propagator.propagate_op_sharding_non_cached(info.schema)
    finally:
        prepared.__init__ = original_init  # type: ignore[method-assign]
    return out, count[0]


def _same(a: Any, b: Any) -> None:
    assert a.output_spec == b.output_spec
    assert [getattr(s, "use_strided_shard_as_shard_order", None) for s in a.output_spec or ()] \
        == [getattr(s, "use_strided_shard_as_shard_order", None) for s in b.output_spec or ()]
    assert a.needs_redistribute == b.needs_redistribute
    assert a.use_val_from_redistribute_schema == b.use_val_from_redistribute_schema
    if a.redistribute_schema is None or b.redistribute_schema is None:
        assert a.redistribute_schema is b.redistribute_schema is None
    else:
        assert a.redistribute_schema.args_schema == b.redistribute_schema.args_schema


def test_foreach_propagation_equals_torchs_and_expands_each_distinct_element_once() -> None:
    with _world((4,)) as mesh:
        shapes = [(8, 4), (8, 4), (16,), (8, 4), (16,), (6, 2)]  # 3 distinct; (6, 2) uneven
        params = [_dt(mesh, s, (Shard(0),)) for s in shapes]
        grads = [_dt(mesh, s, (Shard(0),)) for s in shapes]
        grads[4] = _dt(mesh, shapes[4], (Replicate(),))  # needs a redistribution
        halves = [_dt(mesh, s, (Shard(0),), torch.bfloat16) for s in shapes]
        replicated = list(params)  # element 4 replicated in both lists: its output is too
        replicated[4] = _dt(mesh, shapes[4], (Replicate(),))
        for op, args in [(aten._foreach_lerp_.Scalar, (params, grads, 0.1)),
                         (aten._foreach_addcmul_.Scalar, (params, grads, grads, 0.5)),
                         (aten._foreach_mul.Scalar, (params, 2.0)),
                         (aten._foreach_add.List, (params, grads)),
                         (aten._foreach_add.List, (replicated, grads)),
                         (aten._foreach_div_.ScalarList, (params, [1.0 + i for i in
                                                                  range(len(shapes))])),
                         (aten._foreach_add.ScalarList, (params, [1.0, 1.0, 2.0, 1.0, 2.0, 1.0])),
                         (aten._foreach_sqrt.default, (halves,))]:
            want, torch_expanded = _propagate(op, args, patched=False)
            got, expanded = _propagate(op, args, patched=True)
            _same(got, want)
            if args[0] is replicated:
                assert got.output_spec[4].placements == (Replicate(),)
            lists = [a for a in args if isinstance(a, list) and isinstance(a[0], DTensor)]
            distinct = len({tuple((t.shape, t.dtype, t.placements) for t in ts)
                            for ts in zip(*lists, strict=True)})
            assert torch_expanded >= len(shapes), op
            assert expanded == distinct < len(shapes), op


def test_strided_shards_on_a_2d_mesh_get_torchs_flags() -> None:
    # FSDP2 over TP shards a parameter's dim 0 on both mesh dims: _StridedShard on the
    # data-parallel dim (torch/distributed/fsdp/_fully_shard/_fsdp_param.py: FSDPParam.
    # _init_sharded_dtensor_param_metadata), so _propagate_use_strided_shard_flag does work.
    with _world((2, 2)) as mesh:
        strided = (_StridedShard(0, split_factor=2), Shard(0))
        shapes = [(8, 4), (8, 4), (8,), (8, 4)]
        params = [_dt(mesh, s, strided) for s in shapes]
        grads = [_dt(mesh, s, strided) for s in shapes]
        for op, args in [(aten._foreach_lerp_.Scalar, (params, grads, 0.1)),
                         (aten._foreach_add.List, (params, grads))]:
            want, _ = _propagate(op, args, patched=False)
            got, expanded = _propagate(op, args, patched=True)
            _same(got, want)
            assert expanded == 2


def test_the_patch_is_restored() -> None:
    from torch.distributed.tensor import _sharding_prop

    names = ("_propagate_use_strided_shard_flag", "_expand_single_dim_strategy_to_mesh")
    before = [getattr(_sharding_prop, n, None) for n in names]
    assert all(before), (f"torch {torch.__version__} lacks torch.distributed.tensor."
                         f"_sharding_prop.{names}: dtensor_foreach_propagation_once_per_shape "
                         "patches nothing (the 70B FSDP trace is slow again)")
    with torch_dtensor.dtensor_foreach_propagation_once_per_shape():
        assert [getattr(_sharding_prop, n) for n in names] != before
    assert [getattr(_sharding_prop, n) for n in names] == before


# -- FSDP2's chunks, made when read (torch_fsdp.fsdp_chunks_on_demand) ----------------------


@pytest.mark.parametrize(("shape", "parts", "dim"), [
    ((128, 8), 64, 0), ((130, 8), 64, 0), ((6, 2), 4, 0), ((3,), 8, 0), ((1, 5), 64, 0),
    ((4, 10), 3, 1), ((64,), 64, 0), ((7, 3, 2), 2, 2)])
def test_chunks_on_demand_are_torchs_chunks(shape: tuple[int, ...], parts: int, dim: int) -> None:
    # the expected chunks: torch/distributed/fsdp/_fully_shard/_fsdp_common.py:
    # _chunk_with_empty (torch.chunk, then new_empty(0) for each missing chunk)
    from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

    t = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    want = _chunk_with_empty(t, parts, dim)
    got = torch_fsdp._ChunksOnDemand(t, parts, dim)
    assert len(got) == len(want) == parts
    for i in (*range(parts), -1):
        w, g = want[i], got[i]
        assert (g.shape, g.stride(), g.storage_offset(), g.dtype) == \
            (w.shape, w.stride(), w.storage_offset(), w.dtype), i
        same_storage = g.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
        assert same_storage == (w.untyped_storage().data_ptr() == t.untyped_storage().data_ptr())
        assert torch.equal(g, w)


def test_fully_shard_with_chunks_on_demand_shards_as_torch() -> None:
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    def sharded(patched: bool) -> list[tuple[Any, ...]]:
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(6, 130), nn.Linear(130, 3), nn.LayerNorm(3))
        with fake_world(64, 63), torch_fsdp.fsdp_chunks_on_demand() if patched \
                else contextlib.nullcontext():
            mesh = init_device_mesh("cpu", (64,))
            fully_shard(model, mesh=mesh, reshard_after_forward=8)
        state = fully_shard.state(model)  # type: ignore[attr-defined]
        return [(p.sharded_size, p.padded_sharded_param_size, p.sharded_post_forward_size,
                 p._sharded_param_data.shape, p.sharded_param._local_tensor.shape)
                for p in state._fsdp_param_group.fsdp_params]

    want = sharded(False)
    assert want[0][0] == torch.Size([0, 6])  # rank 63 of 64 holds none of 130 rows
    assert sharded(True) == want
