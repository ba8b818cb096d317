"""The variants of a traced step, derived without a trace: a smaller micro-batch, accumulation,
offload, ZeRO sharding and the multi-GPU layouts, each a peak computed from one
:class:`memfit.fitting.traced.Traced` (the fit search then traces those that can win: Note:
[derived micro-batches are verified by a trace], Note: [offload is verified by a trace], Note:
[layouts are derived, then traced])."""

from __future__ import annotations

from memfit.fitting.layouts import pipeline_in_flight
from memfit.fitting.traced import Traced
from memfit.parallel.config import Parallel

__all__ = ["derive", "derive_layout", "plain_policy", "rest_of_batch", "scaled_budget"]


def derive(t: Traced, ref_m: int, m: int, offload_states: bool, offload_activations: bool,
           sharding: str, num_gpus: int, per_gpu: int) -> int:
    """Peak of a variant of the traced step (analytic, see the module docstring).

    - smaller micro-batch than traced: activations scale with it (linear in the batch);
    - accumulation (``m < per_gpu``): the earlier micro-batches' gradients exist, and the step
      holds the whole per-GPU batch while it runs one micro-batch of it;
    - activation offload: the activations at the peak leave the device except one module's;
    - state offload: the peak of the step with no optimizer state on the device;
    - ZeRO-1/2/3: states, + gradients, + weights divided over the GPUs (a gathered layer's
      weights are added back for ZeRO-3)."""
    shrink = t.activations_at_peak * (1 - m / ref_m)
    if m < per_gpu:
        # Over-states a smaller micro-batch: see Note: [derived micro-batches are verified by
        # a trace].
        peak = (t.peak_accum_wo_states if offload_states else t.peak_accum) - shrink
        peak += rest_of_batch(t, ref_m, per_gpu)
    else:
        peak = (t.peak_wo_states if offload_states else t.peak) - shrink
    acts = t.activations_at_peak * m / ref_m
    if offload_activations:
        peak -= max(0.0, acts - t.largest_module_activations * m / ref_m)
    if num_gpus > 1 and sharding != "none":
        keep = (num_gpus - 1) / num_gpus
        saved = 0 if offload_states else t.states * keep
        if sharding in ("zero2", "zero3"):
            saved += t.grads * keep
        if sharding == "zero3":
            saved += t.weights * keep
        peak -= saved
    return int(peak)


def derive_layout(t: Traced, ref_m: int, m: int, offload_states: bool,
                  offload_activations: bool, sharding: str, par: Parallel, per_rank: int,
                  share: float, act_factor: float,
                  units: tuple[float, float] = (0.0, 0.0)) -> int:
    """Peak of the most loaded rank of layout ``par`` (Note: [layouts are derived, then
    traced]), from the one-GPU trace ``t``: the one-GPU step at this rank's batch
    (:func:`derive`), less

    - the model states the rank does not hold: ``1 - share`` of them (tensor parallelism
      splits the blocks' projections, a pipeline stage holds its blocks; ``share`` is the
      most loaded rank's, :meth:`memfit.fitting.layouts.ModelShape.param_share`);
    - the activations it does not keep: a tensor-parallel rank keeps ``act_factor`` of them
      (:func:`memfit.fitting.layouts.activation_factor`) and the first pipeline stage
      ``1 / pp`` of each of the ``min(pp, micro-batches)`` it holds in flight (1F1B:
      memfit/analytic/activations.py);
    - the ZeRO-1/2/3 (and HSDP) shards of its states, gradients and weights over the ranks
      that shard them (``(n - 1) / n``);

    plus the buffers of the data-parallel engine (``units``: the largest block's and the
    root's shares of the parameters, :meth:`memfit.fitting.layouts.ModelShape.unit_shares`):
    DDP's (and ZeRO-1's) flat gradient buckets, a copy of the gradients
    (``torch/csrc/distributed/c10d/reducer.cpp: Reducer::initialize_buckets``; DDP's
    ``gradient_as_bucket_view`` is False by default); FSDP2 resharding after forward holds the
    gathered parameters of the block it runs and the one it prefetches and of the root, and a
    block's unsharded gradient before its reduce-scatter (``_fsdp_collectives.py:
    foreach_all_gather, foreach_reduce``); without resharding every block stays gathered from
    forward to backward beside its shard, with the unsharded gradient of a block and the root.
    (tests/fitting/test_fit_parallel.py's tiny model over 4 ranks, fp32, micro-batch 2: without
    these buffers the derivation gave 48-81% of the per-rank trace, with them 97.8-100%; in
    bf16-mixed with 2 micro-batches it gives 100-116%, over rather than under.)"""
    peak: float = derive(t, ref_m, m, offload_states, offload_activations, "none", 1, per_rank)
    acts = t.activations_at_peak * m / ref_m
    in_flight = pipeline_in_flight(par, per_rank // m)
    states = 0 if offload_states else t.states
    peak -= (t.weights + t.grads + states) * (1 - share)
    peak -= acts * (1 - act_factor * in_flight / par.pp)
    n = par.fsdp if sharding == "hsdp" else par.dp
    if n > 1 and sharding != "none":
        keep = (n - 1) / n
        saved = states * share * keep
        if sharding in ("zero2", "zero3", "hsdp"):
            saved += t.grads * share * keep
        if sharding in ("zero3", "hsdp"):
            saved += t.weights * share * keep
        peak -= saved
    if par.dp > 1:
        block, root = units  # shares of all the parameters (t.weights, t.grads: all of them)
        if sharding in ("none", "zero1"):
            peak += t.grads * share
        elif sharding == "zero2":
            peak += t.weights * share / n + (block + root) * t.grads
        else:
            peak += (2 * block + root) * t.weights + block * t.grads
    return int(peak)


def rest_of_batch(t: Traced, ref_m: int, per_gpu: int) -> int:
    """Bytes of the per-GPU batch beyond the ``ref_m`` samples traced: alive during every
    micro-batch, since the step is handed the whole batch and splits it."""
    # Note: [whole batch] Plan.apply's step (and accumulate()) takes the per-GPU batch and runs
    # views of it one micro-batch at a time, so all of it is alive at the peak. Leaving it out
    # under-predicted a 4 x 4 accumulation step by 6.5% (104,448 B of a 16-sample batch, in
    # tests/fitting/test_fit.py's model) while the 5% headroom hid it.
    return t.input_bytes * (per_gpu - ref_m) // ref_m


def plain_policy(ckpt: str, modes: tuple[str | None, ...] | None) -> str | None:
    """The plain policy a checkpointing budget resolved to when it chose the same for every
    block (``none`` when it checkpoints nothing); None when it mixes policies, or is not a
    budget."""
    if ckpt != "budget" or not modes or len(set(modes)) != 1:
        return None
    return modes[0] or "none"


def scaled_budget(ckpt_budget: int | None, m: int, ref_m: int,
                  plain: str | None) -> int | None:
    """The activation budget of a micro-batch costed from a traced ``ref_m`` (activations scale
    with the micro-batch); None for a plain policy."""
    if ckpt_budget is None or plain is not None:
        return None
    return max(1, ckpt_budget * m // ref_m)
