"""The caches behind the planner's hot path (a rightsize search makes ~20,000 plans) give what
the uncached code gave: each key holds everything its answer depends on, and no caller can
change a cached answer."""

from __future__ import annotations

import dataclasses

import pytest

from memfit.analytic.config import RunConfig
from memfit.analytic.model_states import model_states
from memfit.errors import MemfitError
from memfit.layout import Parallel
from memfit.models import get_preset
from memfit.runtime import target_runtime_bytes


def test_a_flag_given_as_1_is_refused_after_the_same_run_with_true() -> None:
    # the recipe refuses a flag that is not a bool; 1 == True and hash(1) == hash(True), so a
    # cache keyed by the values alone would let the second run through
    RunConfig(offload_optimizer=True, parallel=Parallel(gpus=2, zero=3))
    with pytest.raises(MemfitError, match="offload_states must be true or false, got 1"):
        RunConfig(offload_optimizer=1, parallel=Parallel(gpus=2, zero=3))  # type: ignore[arg-type]


def test_with_batch_is_replace_and_checks_the_batch() -> None:
    run = RunConfig(mode="lora", checkpointing="full", parallel=Parallel(gpus=4, zero=3))
    assert run.with_batch(4, 8) == dataclasses.replace(run, batch=4, grad_accum=8)
    assert (run.batch, run.grad_accum) == (1, 1)  # the original is unchanged
    for bad in (0, -1, True, 2.0):
        with pytest.raises(MemfitError, match="must be a positive integer"):
            run.with_batch(bad)  # type: ignore[arg-type]
        with pytest.raises(MemfitError, match="must be a positive integer"):
            run.with_batch(1, bad)  # type: ignore[arg-type]


def test_a_caller_cannot_change_the_cached_linear_shapes() -> None:
    spec = get_preset("llama-3-8b")
    shapes = spec.linear_shapes()
    shapes.clear()
    # q, k, v, o, gate, up, down (llama's SwiGLU MLP)
    assert [s.role for s in spec.linear_shapes()] == ["q", "k", "v", "o", "gate", "up", "down"]
    wider = dataclasses.replace(spec, intermediate_size=2 * spec.intermediate_size)
    assert wider.linear_shapes()[-1].in_features == 2 * 14336  # llama-3-8b's FFN is 14,336


def test_a_caller_cannot_change_the_cached_runtime_parts() -> None:
    parts = target_runtime_bytes("cuda", "8.0")
    parts["cublas_workspace"] = 0
    # two matmul threads x cuBLAS's default :4096:2:16:8 workspace (4096 KiB x 2 + 16 KiB x 8)
    assert target_runtime_bytes("cuda", "8.0")["cublas_workspace"] == 2 * 8_519_680
    assert target_runtime_bytes("cuda", "9.0")["cublas_workspace"] == 2 * 32 * 2**20


def test_the_model_states_are_kept_by_everything_but_the_micro_batch() -> None:
    spec = get_preset("llama-3-8b")
    psi = spec.param_count()
    adamw = model_states(spec, RunConfig(precision="bf16-mixed", optimizer="adamw", batch=4))
    sgd = model_states(spec, RunConfig(precision="bf16-mixed", optimizer="sgd", batch=4))
    # AdamW's two fp32 moments, 8 bytes a parameter, that plain SGD does not keep
    assert adamw.optimizer_states - sgd.optimizer_states == 8 * psi
    # ZeRO-3 over 8 GPUs: the same run sharded, not the one-GPU states again
    sharded = model_states(spec, RunConfig(precision="bf16-mixed", optimizer="adamw", batch=4,
                                           parallel=Parallel(gpus=8, zero=3)))
    assert sharded.optimizer_states == -(-adamw.optimizer_states // 8)
    # the states do not depend on the micro-batch and accumulation: one entry serves them all
    assert model_states(spec, RunConfig(precision="bf16-mixed", optimizer="adamw", batch=16,
                                        grad_accum=4)) == adamw
