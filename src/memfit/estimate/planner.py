"""The analytic planner: per-GPU bytes by category for a model, a run and a GPU.

Pure functions of small frozen inputs (ModelSpec, RunConfig, GpuSpec); bytes are integers and
units are formatted only at the edge (CLI, reports).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from memfit.categories import MemoryCategory, empty_breakdown
from memfit.errors import MemfitError
from memfit.estimate.activations import inference_activations, training_activations
from memfit.estimate.config import RunConfig
from memfit.estimate.kv_cache import kv_cache_bytes
from memfit.estimate.model_states import model_states, split_params
from memfit.gpus import GpuSpec
from memfit.models.spec import ModelSpec, ParamCountSpec, TransformerSpec
from memfit.runtime import cuda_runtime_bytes

# "fits" keeps this share of the GPU free. Derived from evidence, not chosen: the analytic plan's
# worst under-prediction of a published GPU measurement is -18.7% (bert-large, fp16-mixed, eager
# attention, batch 4 x 512, Trainer on a V100: planned 11,335 MiB with the source's measured CUDA
# context, 13,939 MiB measured by nvidia-smi), so a plan "fits" only with at least 19% of the GPU
# left. Source: bench/results/published-2026-11-23.json, summary
# "plan_worst_under_prediction_pct" (python bench/published.py); tests/test_bench_published.py
# checks that this margin still covers the latest results. Re-derive it when the bench changes.
FITS_MARGIN = 0.19


@dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    """The planner's answer for the most loaded GPU."""

    model: ModelSpec
    run: RunConfig
    gpu: GpuSpec | None
    seq: int | None
    breakdown: dict[MemoryCategory, int]
    """Bytes per category on the most loaded GPU; activations are 0 when unknown."""
    activations_known: bool
    host_bytes: int
    """Host memory per GPU for offloaded states."""
    runtime_parts: dict[str, int]
    notes: tuple[str, ...] = field(default=())
    stage: int = 0
    """Pipeline stage of the most loaded GPU."""

    @property
    def total_bytes(self) -> int:
        return sum(self.breakdown.values())

    @property
    def capacity_bytes(self) -> int | None:
        return self.gpu.usable_bytes if self.gpu else None

    @property
    def headroom_bytes(self) -> int | None:
        cap = self.capacity_bytes
        return None if cap is None else cap - self.total_bytes

    @property
    def fits(self) -> bool | None:
        """Whether the step fits with :data:`FITS_MARGIN` of the GPU kept free (the analytic
        plan's worst under-prediction of published GPU measurements)."""
        headroom, cap = self.headroom_bytes, self.capacity_bytes
        if headroom is None or cap is None:
            return None
        return headroom >= FITS_MARGIN * cap

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` contract (keys are stable; more may be added)."""
        return {
            "model": {"name": self.model.name, "params": self.model.param_count()},
            "gpu": None if self.gpu is None else {
                "name": self.gpu.name, "capacity_bytes": self.gpu.usable_bytes},
            "per_gpu": {
                "total_bytes": self.total_bytes,
                "breakdown": {c.value: b for c, b in self.breakdown.items()},
            },
            "fits": self.fits,
            "headroom_bytes": self.headroom_bytes,
            "activations_known": self.activations_known,
            "host_bytes": self.host_bytes,
            "runtime_parts": dict(self.runtime_parts),
            "seq": self.seq,
            "stage": self.stage,
            "run": {k: (list(v) if isinstance(v, tuple) else v)
                    for k, v in self.run.__dict__.items()},
            "notes": list(self.notes),
        }


def _check_compatible(model: ModelSpec, run: RunConfig, gpu: GpuSpec | None) -> None:
    """Conflicting options, caught up front with the way around."""
    if gpu is not None:
        if run.precision in ("bf16", "bf16-mixed") and not gpu.bf16:
            raise MemfitError(
                f"{gpu.label} has no bf16 support (compute capability "
                f"{gpu.compute_capability}); use --precision fp16-mixed")
        needs_fp8 = run.precision == "fp8" or run.kv_cache_dtype == "fp8"
        if needs_fp8 and not gpu.fp8:
            raise MemfitError(
                f"{gpu.label} has no fp8 support; use bf16-mixed (or an fp8 GPU such as "
                "h100-sxm-80gb, h200, l40s, l4, rtx-4090)")
    elif run.precision == "fp8":
        raise MemfitError("fp8 needs a GPU that supports it: add --gpu (e.g. --gpu h100-80gb)")
    if isinstance(model, TransformerSpec):
        if model.num_heads % run.tp:
            raise MemfitError(
                f"--tp {run.tp} does not divide {model.name}'s {model.num_heads} attention "
                "heads; choose a tp that divides the head count")
        if model.num_kv_heads % run.tp and run.tp % model.num_kv_heads:
            raise MemfitError(
                f"--tp {run.tp} and {model.name}'s {model.num_kv_heads} KV heads do not "
                "divide one another; choose a tp that divides or is a multiple of them")
        if run.pp > model.num_layers:
            raise MemfitError(f"--pp {run.pp} exceeds {model.name}'s {model.num_layers} layers")
        check_model_options(model, run)


def check_model_options(model: TransformerSpec, run: RunConfig) -> None:
    """Options that make no sense for this model: tokens past its context, a LoRA rank past
    full rank (both methods check them up front)."""
    check_context(model, run)
    if run.mode in ("lora", "qlora"):
        _check_lora_rank(model, run)


def check_context(model: TransformerSpec, run: RunConfig) -> None:
    """Refuse tokens past the model's context (``max_position_embeddings``; prompt plus
    generated tokens for inference). Learned absolute position embeddings have no row for
    them (an index error in the real model). RoPE computes any position, but the model was
    trained to ``max_position_embeddings`` only; past it the output degrades unless the
    config stretches RoPE (``rope_scaling``: YaRN, linear, dynamic NTK), which then decides
    the context: with a ``rope_scaling`` the length is not checked."""
    limit = model.max_position_embeddings
    if model.arch == "vision" or limit <= 0 or run.seq is None:
        return
    tokens = run.seq + (run.new_tokens if run.mode == "inference" else 0)
    if tokens <= limit or (model.position == "rope" and model.rope_scaling):
        return
    what, fix = ((f"--seq {run.seq} + --new-tokens {run.new_tokens} = {tokens} tokens",
                  f"keep --seq + --new-tokens within {limit}") if tokens != run.seq
                 else (f"--seq {run.seq}", f"use --seq {limit} or less"))
    why = ("its learned position embeddings have no row past it" if model.position == "learned"
           else "RoPE without rope_scaling in its config")
    raise MemfitError(f"{what} exceeds {model.name}'s context of {limit} tokens ({why}); "
                      f"{fix}")


def _check_lora_rank(model: TransformerSpec, run: RunConfig) -> None:
    """A LoRA rank above a targeted layer's smaller dimension is past full rank: B @ A cannot
    have rank r, and the adapter holds more parameters than the layer (Hu et al. 2021)."""
    targeted = [s for s in model.linear_shapes() if s.role in run.lora_targets]
    if not targeted:
        return
    smallest = min(targeted, key=lambda s: min(s.in_features, s.out_features))
    full = min(smallest.in_features, smallest.out_features)
    if run.lora_rank > full:
        raise MemfitError(f"--lora-rank {run.lora_rank} exceeds full rank {full} of "
                          f"{model.name}'s {smallest.role} projection ({smallest.in_features} -> "
                          f"{smallest.out_features}); use --lora-rank {full} or less")


# Parameter-sized temporaries of one foreach optimizer step, in state-dtype elements per
# trainable parameter (torch/optim/adamw.py _multi_tensor_adamw: exp_avg_sq.sqrt() is taken out
# of place; Adafactor's variance estimate and Lion's update direction likewise). SGD updates in
# place; bitsandbytes' 8-bit step is one fused kernel.
STEP_TEMPORARIES_PER_PARAM: dict[str, int] = {
    "adam": 1, "adamw": 1, "lion": 1, "adafactor": 1,
    "sgd": 0, "sgd-momentum": 0, "adamw-8bit": 0,
}


def optimizer_step_temporaries(model: ModelSpec, run: RunConfig, stage: int) -> int:
    """Device bytes of the optimizer step's temporaries on one GPU (0 when offloaded)."""
    if not run.training or run.offload_optimizer:
        return 0
    trainable = split_params(model, run, stage=stage).trainable
    if run.zero >= 1:
        trainable = -(-trainable // run.dp)
    state_bytes = 2 if run.precision in ("bf16", "fp16") else 4
    return STEP_TEMPORARIES_PER_PARAM[run.optimizer] * state_bytes * trainable


def _plan_stage(model: ModelSpec, run: RunConfig, gpu: GpuSpec | None, seq: int | None,
                stage: int) -> MemoryPlan:
    states = model_states(model, run, stage=stage)
    breakdown = empty_breakdown()
    breakdown[MemoryCategory.WEIGHTS] = states.weights
    breakdown[MemoryCategory.GRADIENTS] = states.gradients
    breakdown[MemoryCategory.OPTIMIZER_STATES] = states.optimizer_states
    notes = list(states.notes)
    if run.mode == "train" and run.mixed:
        notes.append("mixed precision counted as in the ZeRO paper: 16-bit weights and "
                     "gradients, fp32 masters with the optimizer; plain torch.autocast keeps "
                     "fp32 gradients (+2 bytes/param): use --method trace to model that")
    known = isinstance(model, TransformerSpec)
    dp = run.dp
    if isinstance(model, TransformerSpec) and seq is not None:
        if run.training:
            acts = training_activations(model, run, seq, stage)
        else:
            acts = inference_activations(model, run, seq)
            if model.arch == "decoder":
                breakdown[MemoryCategory.KV_CACHE] = kv_cache_bytes(
                    model, run, seq + run.new_tokens)
        notes.extend(acts.notes)
        breakdown[MemoryCategory.ACTIVATIONS] = acts.activations
        temporaries = acts.temporaries
        if run.training:
            split = split_params(model, run, stage=stage)
            compute_bytes = 2 if run.compute_format != "fp32" else 4
            if run.zero == 3:
                # FSDP/ZeRO-3: the current block is all-gathered and the next one prefetched;
                # its full gradient exists before the reduce-scatter.
                gathered = 2 * split.largest_layer * compute_bytes
                temporaries += gathered + split.largest_layer * compute_bytes
                notes.append("ZeRO-3: two gathered blocks + one block's unsharded gradients "
                             "counted as temporaries")
            elif dp > 1 and run.zero == 0:
                # DDP copies gradients into its buckets unless gradient_as_bucket_view=True
                # (torch.nn.parallel.DistributedDataParallel docs: the saving "will be equal to
                # the total gradients size").
                temporaries += breakdown[MemoryCategory.GRADIENTS]
                notes.append("DDP gradient buckets: one extra copy of the gradients "
                             "(gradient_as_bucket_view=False, PyTorch's default)")
        breakdown[MemoryCategory.TEMPORARIES] = temporaries
    elif run.training or isinstance(model, ParamCountSpec):
        known = False
        notes.append("activations unknown: only the parameter count is given; "
                     "use a preset or config.json for activations")
    step_temporaries = optimizer_step_temporaries(model, run, stage)
    backward_peak = (breakdown[MemoryCategory.ACTIVATIONS]
                     + breakdown[MemoryCategory.TEMPORARIES])
    if step_temporaries > backward_peak:
        # The optimizer step runs after backward has freed the activations; its foreach
        # temporaries are the peak when they outgrow activations + backward temporaries.
        breakdown[MemoryCategory.ACTIVATIONS] = 0
        breakdown[MemoryCategory.TEMPORARIES] = step_temporaries
        notes.append("peak in the optimizer step: PyTorch's default foreach implementation "
                     "makes a parameter-sized temporary (fused=True avoids it)")
    runtime = cuda_runtime_bytes(gpu.name if gpu else None, num_gpus=run.gpus)
    breakdown[MemoryCategory.RUNTIME] = sum(runtime.values())
    return MemoryPlan(model=model, run=run, gpu=gpu, seq=seq, breakdown=breakdown,
                activations_known=known, host_bytes=states.host_bytes, runtime_parts=runtime,
                notes=tuple(dict.fromkeys(notes)), stage=stage)


def plan(model: ModelSpec, run: RunConfig | None = None, gpu: GpuSpec | None = None) -> MemoryPlan:
    """Plan one step of ``model`` run as ``run`` on ``gpu``; returns the most loaded GPU.

    >>> from memfit.models.spec import ParamCountSpec
    >>> p = plan(ParamCountSpec(name="7.5B", params=7_500_000_000),
    ...          RunConfig(precision="fp16-mixed", optimizer="adam", gpus=64, zero=3))
    >>> p.breakdown[MemoryCategory.WEIGHTS] + p.breakdown[MemoryCategory.OPTIMIZER_STATES] > 0
    True
    """
    run = run or RunConfig()
    _check_compatible(model, run, gpu)
    seq = None
    if isinstance(model, TransformerSpec):
        seq = run.seq or model.default_seq_len
        if model.arch == "vision" and run.seq and run.seq != model.default_seq_len:
            raise MemfitError(
                f"{model.name} sees {model.default_seq_len} tokens per image "
                f"({model.image_size}px / {model.patch_size}px patches + class token); "
                "drop --seq for vision models")
    stages = {0, run.pp - 1}
    plans = [_plan_stage(model, run, gpu, seq, stage) for stage in sorted(stages)]
    return max(plans, key=lambda p: p.total_bytes)


def with_changes(p: MemoryPlan, **changes: Any) -> MemoryPlan:
    """Re-plan with some run options changed (used by suggestions and searches)."""
    return plan(p.model, replace(p.run, **changes), p.gpu)
