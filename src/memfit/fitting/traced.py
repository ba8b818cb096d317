"""One traced step of the fit search: a technique combination at one micro-batch, run by the
trace engine on a meta copy of the model, and what the search reads from it (:class:`Traced`);
and the FLOPs of a step, counted once on fake tensors."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from memfit._loss import model_loss
from memfit._tensors import fake_inputs, fake_model, meta_batch, meta_copy, tensor_leaves
from memfit.categories import MemoryCategory
from memfit.errors import MemfitError
from memfit.fitting.config import FitConfig
from memfit.fitting.layouts import pipeline_runs
from memfit.gpus import GpuSpec
from memfit.models.anatomy import find_blocks
from memfit.parallel.config import Parallel
from memfit.recipe import Recipe
from memfit.techniques.recipe import apply_techniques
from memfit.trace.allocator_model import round_size
from memfit.trace.estimate import TRACKED

__all__ = ["ENGINE_FAILED", "Traced", "count_flops", "per_rank_traced", "sac_ops", "selective_ops",
           "trace_one"]

TRACKED_INDEX = {cat: i for i, cat in enumerate(TRACKED)}
ENGINE_FAILED = "the trace engine could not run this combination"
"""How a reason that the trace engine failed (not that the step is too big) begins."""


@dataclass(frozen=True)
class Traced:
    """What the search reads from one traced step (bytes)."""

    peak: int
    """Bytes compared to the budget (total on CUDA, peak on CPU)."""
    weights: int
    grads: int
    states: int
    peak_wo_states: int
    """The step's peak with the optimizer's states and step on the host."""
    peak_accum: int
    """The peak when gradients of earlier micro-batches are alive during forward and backward
    (accumulation > 1)."""
    peak_accum_wo_states: int
    activations_at_peak: int
    largest_module_activations: int
    saved_activations: int
    ops_per_micro: int
    checkpoint_modes: tuple[str | None, ...] | None
    checkpoint_budget: int | None
    host_peak: int = 0
    """Host memory the step's offload holds at its peak (traced with offload only)."""
    input_bytes: int = 0
    """Bytes of the traced micro-batch's tensors (the step holds the whole per-GPU batch)."""
    sac_ops_per_micro: int = 0
    """Ops selective checkpointing's dispatch modes see in one micro-batch
    (:func:`sac_ops`)."""


def per_rank_traced(par: Parallel) -> bool:
    """Whether the fit search traces ``par`` per rank: the data-parallel family (DDP, ZeRO-1,
    FSDP2, HSDP), tensor parallelism alone and tp x FSDP / HSDP, as
    ``memfit/parallel/apply.py: apply_model`` applies them, and pipelines alone, with tp and
    with DDP, ZeRO-1 or FSDP2 (``memfit/parallel/pipeline.py``: every stage's rank traced over
    the whole per-rank batch, :func:`memfit.fitting.layouts.traced_step`)."""
    if par.pp > 1:
        return pipeline_runs(par)
    if par.ep > 1:  # memfit/parallel/expert.py: check_experts
        if par.tp > 1:  # beside tp: ep over whole tp groups, FSDP2 or no data parallelism
            return par.ep % par.tp == 0 and par.strategy in ("fsdp", "none")
        return par.strategy in ("ddp", "fsdp")
    return par.tp == 1 or par.dp == 1 or par.strategy in ("fsdp", "hsdp")


def trace_one(base: nn.Module, sample: Any, *, precision: str, ckpt: str, optimizer: str,
              chunked: bool, attention: str, m: int, per_gpu: int, device: str,
              gpu: GpuSpec | None, loss_fn: Any, num_gpus: int,
              offload_activations: bool = False, offload_states: bool = False,
              device_budget: int | None = None, modes: tuple[str | None, ...] | None = None,
              parallel: Parallel | None = None) -> Traced | str:
    """Trace one combination at micro-batch ``m`` (its :class:`memfit.Recipe` run by
    :func:`memfit.trace_recipe`); a string is why it cannot run. With the
    offload options, the step runs with them as ``Plan.apply`` sets them up (activation offload
    after checkpointing; the optimizer's states and step on the host). With ``modes`` (a
    checkpointing budget the search resolved) the blocks are checkpointed as they say; with
    ``parallel`` the step is traced per rank (the worst rank's, ``memfit/parallel/trace.py``).
    """
    from memfit.parallel.recipe import trace_recipe

    model = meta_copy(base)
    inputs = meta_batch(sample, m)
    # Note: [one traced step on CPU] The CPU has no caching allocator, so the second step's
    # peak is the first's forward/backward plus the optimizer states that then exist; one traced
    # step and that sum halve the search time. CUDA keeps two steps (allocator reuse matters).
    steps = 1 if device == "cpu" else 2
    try:
        ckpt_budget: int | None = None
        if ckpt == "budget" and modes is None:
            modes, ckpt_budget = _resolve_budget(base, inputs, chunked, attention, precision,
                                                 device_budget)
        elif ckpt in ("full", "selective") and modes is None:
            modes = tuple(ckpt for _ in find_blocks(model))
        recipe = Recipe(precision=precision, optimizer=optimizer, checkpointing=ckpt,
                        checkpoint_modes=modes if ckpt != "none" else None,
                        checkpoint_budget_bytes=ckpt_budget, micro_batch=m,
                        chunked_loss=chunked, attention=attention,
                        offload_activations=offload_activations, offload_states=offload_states,
                        parallel=parallel)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            est = trace_recipe(model, inputs, recipe, loss_fn=loss_fn, device=device, gpu=gpu,
                               steps=steps, num_gpus=num_gpus)
    except MemfitError as exc:
        return str(exc)
    except (RuntimeError, NotImplementedError) as exc:  # rejected with the reason, not hidden
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"{ENGINE_FAILED}: {first}"
    traced = _read(est, model, inputs, device=device, steps=steps, parallel=parallel,
                   modes=recipe.checkpoint_modes, ckpt_budget=ckpt_budget)
    if recipe.checkpoint_modes and "selective" in recipe.checkpoint_modes:
        traced = dataclasses.replace(traced, sac_ops_per_micro=sac_ops(
            base, inputs, recipe.checkpoint_modes, chunked=chunked, attention=attention))
    return traced


def sac_ops(base: nn.Module, inputs: Any, modes: tuple[str | None, ...], *, chunked: bool,
            attention: str) -> int:
    """Ops selective checkpointing's dispatch modes see in one micro-batch of ``base`` with
    ``modes`` per block (:func:`selective_ops`), with the recipe's attention and chunked loss
    applied to a meta copy."""
    model = meta_copy(base)
    apply_techniques(model, Recipe(attention=attention, chunked_loss=chunked))
    return selective_ops(model, inputs, modes)


def selective_ops(model: nn.Module, inputs: Any, modes: tuple[str | None, ...]) -> int:
    """Ops selective checkpointing's dispatch modes see in one micro-batch of ``model`` (not
    checkpointed; techniques that change the blocks' ops applied) with ``modes`` per block:
    each selective block's forward ops twice, once in the forward
    (``_CachingTorchDispatchMode``) and once in the recompute (``_CachedTorchDispatchMode``,
    which sees every op again, saved or not). Note: [selective checkpointing's dispatch] in
    :mod:`memfit.fitting.cost`. Counted on fake tensors without autocast (its casts are not
    counted)."""
    from memfit.techniques.block_profile import profile_blocks

    profiles = profile_blocks(model, find_blocks(model), inputs)
    return 2 * sum(p.ops for p, mode in zip(profiles, modes, strict=False)
                   if mode == "selective")


def _resolve_budget(base: nn.Module, inputs: Any, chunked: bool, attention: str,
                    precision: str, device_budget: int | None
                    ) -> tuple[tuple[str | None, ...], int]:
    """The activation budget a ``budget`` checkpointing is traced at, and the per-block modes it
    resolves to, profiled on a meta copy of ``base`` with the recipe's attention and chunked
    loss (what the traced step runs before checkpointing)."""
    from memfit.techniques.block_profile import predict_activation_bytes, profile_blocks
    from memfit.techniques.checkpointing import Budget

    model = meta_copy(base)
    apply_techniques(model, Recipe(attention=attention, chunked_loss=chunked))
    names = find_blocks(model)
    profiles = profile_blocks(model, names, inputs)
    floor = predict_activation_bytes(profiles, ["full"] * len(names))
    ceiling = predict_activation_bytes(profiles, [None] * len(names))
    ckpt_budget = max(1, (floor + ceiling) // 2)  # halfway: a real trade-off point
    if device_budget is not None:
        # Never above what the device leaves for activations once the weights and
        # gradients are in (a lower bound of the model states): a bigger budget is a
        # number no step can use (issue 12: "budget(328.16 GiB)" on a 40 GB GPU; the
        # halfway point of a large micro-batch's profile can be far above the device).
        # Where even that is below the floor, the budget is the floor: every block
        # checkpointed, which collapses to ckpt=full.
        room = device_budget - _weights_and_grads(model, precision)
        ckpt_budget = max(floor, min(ckpt_budget, room))
    modes = Budget(ckpt_budget).choose(names, lambda: profiles)
    return tuple(modes), ckpt_budget


def _read(est: Any, model: nn.Module, inputs: Any, *, device: str, steps: int,
          parallel: Parallel | None, modes: tuple[str | None, ...] | None,
          ckpt_budget: int | None) -> Traced:
    """What the search reads from the trace engine's estimate ``est`` of ``model``'s step on
    ``inputs`` (traced with ``steps`` steps)."""
    if steps == 1 and len(est.per_rank) > 1:
        # The worst rank once its optimizer states exist (Note: [one traced step on CPU]): the
        # first step's worst can be another (tests/fitting/test_fit_pipeline.py's pp 2 at
        # micro-batch 2 x 4: the first step's worst stage gave a peak 4.4% under the two-step
        # trace's).
        est = max(est.per_rank, key=_one_step_peak)
    cats = est.breakdown
    outside = est.total_bytes - est.peak_reserved_bytes
    reserve = est.peak_reserved_bytes - est.peak_bytes
    no_opt = max((p.total - p.by_category()[MemoryCategory.OPTIMIZER_STATES]
                  for p in est.timeline if p.phase != "optimizer"), default=0)
    weights = cats.get(MemoryCategory.WEIGHTS, 0)
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    if parallel is not None:  # this rank's gradients (shards), as the trace held them
        grads = max((p.by_category()[MemoryCategory.GRADIENTS] for p in est.timeline),
                    default=0)
    no_opt = max(no_opt, weights + grads) + reserve + outside
    states = max((p.by_category()[MemoryCategory.OPTIMIZER_STATES] for p in est.timeline),
                 default=0)
    peak = est.total_bytes if device == "cuda" else est.peak_bytes
    # The high points inside ops (a CPU kernel's scratch), which the timeline (bytes after each
    # op) does not show: without them a bf16-mixed step was under-predicted by 2-3%.
    fb_peaks = [v for (_, phase), v in est.phase_peaks.items() if phase in ("forward", "backward")]
    if steps == 1:  # see Note: [one traced step on CPU]
        final_states = est.timeline[-1].by_category()[MemoryCategory.OPTIMIZER_STATES] \
            if est.timeline else 0
        peak = max(peak, max(fb_peaks, default=0) + final_states)
    saved = sum(mod.activation_bytes for mod in est.modules.values())
    largest = max((mod.activation_bytes for mod in est.modules.values()), default=0)
    # Accumulation: from the second micro-batch on, every gradient exists during the forward
    # and backward. Each moment of the traced step is a moment of that micro-batch's step: its
    # live bytes without the gradients and states that exist then, plus all of them, plus the
    # gradient the op just made (the traced step makes it .grad; an accumulating one holds it
    # as a temporary until autograd adds it to the existing .grad). The moments are the points
    # after each op and the high points inside ops (a CPU kernel's scratch, measured), where
    # the op's own gradient is not made yet. (With one module's gradients added at every
    # moment instead, a bf16-mixed 4 x 4 step was 1.1% over on AVX2: its peak, a ReLU's
    # backward, holds no new gradient.)
    grad_i = TRACKED_INDEX[MemoryCategory.GRADIENTS]
    state_i = TRACKED_INDEX[MemoryCategory.OPTIMIZER_STATES]
    base_fb = prev_grads = prev_states = 0
    for p in est.timeline:
        g, s = p.bytes[grad_i], p.bytes[state_i]
        if p.phase in ("forward", "backward"):
            base_fb = max(base_fb, p.total - g - s + max(0, g - prev_grads))
            inside = est.op_peaks.get(p.index)
            if inside is not None:
                base_fb = max(base_fb, inside - prev_grads - prev_states)
        prev_grads, prev_states = g, s
    extra = reserve + outside
    peak_accum = max(peak, base_fb + grads + states + extra)
    peak_accum_wo = max(min(peak, no_opt), base_fb + grads + extra)
    return Traced(peak=peak, peak_accum=peak_accum, peak_accum_wo_states=peak_accum_wo,
                  weights=weights, grads=grads, states=states,
                  peak_wo_states=min(peak, no_opt),
                  activations_at_peak=cats.get(MemoryCategory.ACTIVATIONS, 0),
                  largest_module_activations=largest, saved_activations=saved,
                  ops_per_micro=max(1, est.num_ops // max(1, est.steps)),
                  checkpoint_modes=modes, checkpoint_budget=ckpt_budget,
                  host_peak=est.host_peak_bytes, input_bytes=_batch_bytes(inputs, device))


def _one_step_peak(est: Any) -> int:
    """A CPU trace's peak of the second step from its first (Note: [one traced step on CPU]):
    the forward / backward high points plus the optimizer states the first step made."""
    fb = [v for (_, phase), v in est.phase_peaks.items() if phase in ("forward", "backward")]
    states = (est.timeline[-1].by_category()[MemoryCategory.OPTIMIZER_STATES]
              if est.timeline else 0)
    return max(est.peak_bytes, max(fb, default=0) + states)


def _weights_and_grads(model: nn.Module, precision: str) -> int:
    """Bytes of the weights and of the trainable weights' gradients (2 bytes per element in
    pure bf16, else the parameters' own dtype: mixed precision keeps fp32 weights)."""
    return sum(p.numel() * (2 if precision == "bf16" else p.element_size())
               * (2 if p.requires_grad else 1) for p in model.parameters())


def _batch_bytes(batch: Any, device: str) -> int:
    """Bytes of a batch's distinct tensors (on CUDA, as the caching allocator rounds them)."""
    seen: dict[int, int] = {}
    for t in tensor_leaves(batch):
        nbytes = t.untyped_storage().nbytes()
        seen[int(t.untyped_storage()._cdata)] = (round_size(nbytes) if device == "cuda" and nbytes
                                                 else nbytes)
    return sum(seen.values())


def count_flops(base: nn.Module, sample: Any, cfg: FitConfig, loss_fn: Any
                ) -> tuple[float, float]:
    """FLOPs of forward + backward (with recompute), and of the forward alone, of one sample,
    on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memfit.trace.fake_rules import grouped_mm_rule

    # Note: [grouped_mm on fake tensors] (memfit/trace/fake_rules.py): transformers' MoE experts
    # run aten._grouped_mm in fp32, which torch's meta function refuses.
    with FakeTensorMode(allow_non_fake_inputs=True), grouped_mm_rule():
        # Fake CPU tensors, not meta: models that branch on data (``.item()`` in Hugging Face's
        # mask code) see fake tensors and take their tracing path, which meta tensors cannot.
        model = fake_model(base, "cpu")
        apply_techniques(model, cfg)
        inputs = fake_inputs(meta_batch(sample, 1), "cpu")
        with FlopCounterMode(display=False) as counter:
            loss = (loss_fn or model_loss)(model, inputs)
            forward = counter.get_total_flops()
            loss.backward()
    return float(counter.get_total_flops()), float(forward)
