"""The layouts fit searches: a degree the user fixes is refused with the reason when the model
cannot take it, and "no layout" says why each was left out (no trace: layouts() alone)."""

from __future__ import annotations

import pytest

from memfit.errors import MemfitError
from memfit.fitting.layout_space import layouts
from memfit.fitting.layouts import ModelShape

# GPT-2's shape as fit measures it: 12 heads and blocks, no projections apply_tp splits
# (Conv1D c_attn / c_fc), no pipeline split (a tied head).
GPT2_LIKE = ModelShape(heads=12, kv_heads=12, layers=12, hidden=768, seq=128,
                       tp_splittable=False, pipeline_splittable=False,
                       block_numels=((7_000_000, 10_000),) * 12, first_numel=40_000_000,
                       last_numel=1_536)


def test_a_fixed_tp_the_model_cannot_take_is_refused_not_dropped() -> None:
    # --tp 5 --gpus 5 --global-batch 10: dp 5 divides the batch, so the search used to answer
    # with tp 1 layouts only, the asked tp silently gone
    with pytest.raises(MemfitError, match="space tp 5: the model's blocks have no projections"):
        layouts(gpus=5, gpus_per_node=None, global_batch=10, shape=GPT2_LIKE,
                space={"tp": [5]}, rejected=[])


def test_no_layout_names_why_each_was_left_out() -> None:
    # 2 GPUs, global batch 7: tp and pp are out for the model, dp 2 does not split 7; the
    # message said only "pick a global batch that divides" (right here, but not the only cause)
    with pytest.raises(MemfitError) as info:
        layouts(gpus=2, gpus_per_node=None, global_batch=7, shape=GPT2_LIKE, space={},
                rejected=[])
    message = str(info.value)
    assert "tensor parallelism: the model's blocks have no projections" in message
    assert "the global batch 7 does not split over 2 data-parallel ranks" in message
    assert "\n" not in message
