"""`memfit validate`'s matrix and runner, on the CPU (small sizes): the configs it holds, and the
offload configs predicted against real runs."""

from __future__ import annotations

import warnings

import pytest

from memfit import validate
from memfit.validate import matrix, run_config


def test_matrix_holds_every_family_and_the_offload_configs() -> None:
    configs = matrix("small")
    # 7 families x 2 precisions x 2 checkpointing x 2 (optimizer, batch), less full
    # checkpointing for the 2 families without repeated blocks (2 x 2 each), plus 2 decoder
    # families x 2 checkpointing x 2 offload kinds.
    assert len(configs) == 7 * 8 - 2 * 4 + 2 * 2 * 2
    assert len({c.name for c in configs}) == len(configs)
    assert {c.offload for c in configs} == {"none", "activations", "states"}


@pytest.mark.parametrize("offload", ["activations", "states"])
def test_offload_configs_match_real_cpu_runs(offload: str) -> None:
    # On the CPU, activation offload moves nothing (host memory is the device's) and state
    # offload adds the host copies of parameters and gradients: both must be predicted.
    config = next(c for c in matrix("small", families=["llama"])
                  if c.offload == offload and c.checkpointing == "full")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = run_config(config, size="small", device="cpu", gpu=None)
    assert abs(result.error_allocated) <= 0.01, result


def test_quick_matrix_covers_every_family_and_axis_in_nine_configs() -> None:
    # The CPU default (`memfit validate --device cpu`): one config per family and one per
    # offload kind, every value of every axis run by some family; all of them are in the full
    # matrix.
    full = matrix("tiny")
    quick = matrix("tiny", quick=True)
    assert len(quick) == 7 + 2
    assert set(quick) <= set(full)
    assert {c.family for c in quick} == {c.family for c in full}
    for axis in ("precision", "optimizer", "checkpointing", "batch", "offload"):
        assert {getattr(c, axis) for c in quick} == {getattr(c, axis) for c in full}, axis


def test_tiny_config_matches_its_real_cpu_run() -> None:
    config = next(c for c in matrix("tiny", quick=True) if c.family == "gpt2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = run_config(config, size="tiny", device="cpu", gpu=None)
    assert abs(result.error_allocated) <= 0.01, result


@pytest.mark.parametrize("size", validate.SIZES)
def test_every_family_builds_at_every_size(size: str) -> None:
    # The GPU matrix ("medium") was never run before a GPU was lent: its ViT had no spec, so
    # every vit config would have failed on the first GPU. Build each family on meta.
    for family, with_batch in validate.zoo(size).items():
        model, inputs, _loss = with_batch(2)("meta")
        assert sum(p.numel() for p in model.parameters()) > 0, family
        assert all(t.device.type == "meta" for t in inputs), family
