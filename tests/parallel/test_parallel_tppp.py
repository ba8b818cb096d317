"""Tensor parallelism inside each pipeline stage (memfit/parallel/pipeline_parallelize.py:
apply_tp_stages).

torchtitan's order (``torchtitan/distributed/pipeline_parallel.py: pipeline_llm`` splits the
model into stages, then ``torchtitan/models/llama3/infra/parallelize.py: parallelize_llama``
applies TP, then FSDP, to each model part): each stage's blocks get the Megatron plan
(``ColwiseParallel`` q/k/v and gate/up, ``RowwiseParallel`` o/down:
``torch/distributed/tensor/parallel/style.py``) over the ``tp`` dim of a ``(pp, tp)`` or
``(pp, dp, tp)`` DeviceMesh; the stages exchange plain full-width hidden states through
``torch.distributed.pipelining``'s PipelineStage / Schedule1F1B over the ``pp`` dim's group.

Expected values come from first principles (the parameters a rank holds: the stage's blocks
with their projections halved, the replicated embedding / norms / head whole, hand-counted)
or from real runs: one gloo process per rank running the same stage, TP plan and schedule under
the profiler (memfit/parallel/measure.py); those run in tests/parallel/test_parallel_combos.py
(test_pp_times_tp_matches_four_gloo_ranks_within_1_percent,
test_pp_tp_fsdp_matches_eight_gloo_ranks_within_1_percent), in the same sets of 4 and 8 gloo
processes as that module's cases.
"""

from __future__ import annotations

from _pipeline import per_rank, pp_case
from memfit.categories import MemoryCategory
from memfit.parallel import Parallel

_case, _per_rank = pp_case, per_rank


def test_each_stage_holds_its_blocks_with_the_projections_split() -> None:
    """pp 2 x tp 2 on tiny_spec(4) (hidden h = 64, MLP f = 128, vocab v = 256, head_dim 16,
    fp32): torchtitan's split puts the embedding and blocks 0-1 on stage 0, blocks 2-3, the
    final norm and head on stage 1. A block's projections (q, k, v, o: 4 h^2; gate, up,
    down: 3 h f) are halved by TP, its two norms (2 h) are whole; the embedding, final norm
    (h) and head (v h) are replicated. Each stage also keeps the rotary inverse frequencies
    (head_dim / 2 fp32 buffer). The two TP ranks of a stage hold the same shapes: one role
    each, stage 0 = ranks (0, 1), stage 1 = ranks (2, 3) (the (pp, tp) mesh, tp innermost)."""
    h, f, v, head_dim = 64, 128, 256, 16
    block = (4 * h * h + 3 * h * f) // 2 + 2 * h
    stage0 = 2 * block + v * h
    stage1 = 2 * block + h + v * h
    roles = _per_rank(_case(Parallel(gpus=4, pp=2, tp=2, microbatches=4)))
    assert [e.ranks for e in roles] == [(0, 1), (2, 3)]
    for est, params in zip(roles, (stage0, stage1), strict=True):
        weights = est.timeline[0].by_category()[MemoryCategory.WEIGHTS]
        assert weights == 4 * params + 4 * (head_dim // 2)
        assert est.breakdown[MemoryCategory.GRADIENTS] == 4 * params


def test_fsdp_over_tp_stages_shards_each_local_tensor() -> None:
    """pp 2 x fsdp 2 x tp 2 on 8 ranks, a (pp, dp, tp) mesh: FSDP2 after TP halves each
    stage's local tensors again (dim 0, even here), so a rank's weights are half the tp-only
    ones (the rotary buffer is not a parameter: whole); roles: one per stage."""
    h, f, v, head_dim = 64, 128, 256, 16
    block = (4 * h * h + 3 * h * f) // 2 + 2 * h
    stage0 = 2 * block + v * h
    roles = _per_rank(_case(Parallel(gpus=8, pp=2, tp=2, fsdp=2, microbatches=4)))
    assert [e.ranks for e in roles] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    weights = roles[0].timeline[0].by_category()[MemoryCategory.WEIGHTS]
    assert weights == 4 * stage0 // 2 + 4 * (head_dim // 2)


def test_sequence_parallel_stages_split_the_embedding_and_head() -> None:
    """With sp, the first stage's embedding is split by vocabulary rows (``RowwiseParallel``
    on an Embedding) and the last stage's head by output features (``ColwiseParallel``), as in
    torchtitan's plan; the final norm stays whole (``SequenceParallel`` replicates it). The
    stages exchange seq / tp rows of the hidden states."""
    h, f, v, head_dim = 64, 128, 256, 16
    block = (4 * h * h + 3 * h * f) // 2 + 2 * h
    roles = _per_rank(_case(Parallel(gpus=4, pp=2, tp=2, sp=True, microbatches=4)))
    assert [e.ranks for e in roles] == [(0, 1), (2, 3)]
    for est, params in zip(roles, (2 * block + v * h // 2, 2 * block + h + v * h // 2),
                           strict=True):
        weights = est.timeline[0].by_category()[MemoryCategory.WEIGHTS]
        assert weights == 4 * params + 4 * (head_dim // 2)
