"""The analytic planner: per-GPU bytes by category for a model, a run and a GPU.

Pure functions of small frozen inputs (ModelSpec, RunConfig, GpuSpec); bytes are integers and
units are formatted only at the edge (CLI, reports).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any

from memfit import vocab
from memfit.analytic.activations import inference_activations, training_activations
from memfit.analytic.config import RunConfig
from memfit.analytic.kv_cache import kv_cache_bytes
from memfit.analytic.model_states import model_states, split_params
from memfit.analytic.table import (
    Column,
    MemoryTable,
    fit_verdict,
    format_params,
    reserve_not_modelled_note,
    suggestion_rows,
)
from memfit.categories import MemoryCategory, empty_breakdown
from memfit.dtypes import nbytes
from memfit.errors import MemfitError
from memfit.gpus import GpuSpec
from memfit.models.spec import ModelSpec, ParamCountSpec, TransformerSpec
from memfit.parallel.config import check_degrees
from memfit.runtime import cuda_runtime_bytes
from memfit.units import format_bytes

# "fits" keeps this share of the GPU free. Derived from evidence, not chosen: the analytic plan's
# worst under-prediction of a published GPU measurement is -18.7% (bert-large, fp16-mixed, eager
# attention, batch 4 x 512, Trainer on a V100: planned 11,335 MiB with the source's measured CUDA
# context, 13,939 MiB measured by nvidia-smi), so a plan "fits" only with at least 19% of the GPU
# left. Source: bench/results/published-2026-11-23.json, summary
# "plan_worst_under_prediction_pct" (python bench/published.py); tests/test_bench_published.py
# checks that this margin still covers the latest results. Re-derive it when the bench changes.
FITS_MARGIN = 0.19

GPUS_PER_NODE = 8
"""GPUs per node when the user does not say (DGX/HGX A100, H100, H200, B200 nodes)."""

ENGINE_LABELS: dict[str, str] = {
    "zero-paper": "the ZeRO paper's layout",
    "fsdp2": "PyTorch FSDP2",
    "ddp": "PyTorch DDP",
    "deepspeed": "DeepSpeed",
    "megatron": "Megatron-LM",
}
"""RunConfig.layout -> the engine's name, as the plan prints it."""

# DeepSpeed's defaults, in elements: deepspeed/runtime/zero/config.py (DeepSpeedZeroConfig:
# reduce_bucket_size, stage3_prefetch_bucket_size, sub_group_size) and offload_config.py
# (DeepSpeedZeroOffloadParamConfig: buffer_count 5, buffer_size 1e8;
# DeepSpeedZeroOffloadOptimizerConfig: buffer_count 4).
DS_REDUCE_BUCKET = 500_000_000
DS_PREFETCH_BUCKET = 50_000_000
DS_SUB_GROUP = 1_000_000_000
DS_PARAM_SWAP_BUFFERS = 5 * 100_000_000
DS_OPTIMIZER_SWAP_BUFFERS = 4

PERSISTENT_BUFFERS = frozenset({"DDP gradient buckets", "reduce bucket"})
"""Engine buffers allocated once and kept through the optimizer step (the others are freed
after each module's backward)."""


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
    peak_phase: str = "backward"
    """Where the planned peak is: ``backward`` (activations saved, backward temporaries),
    ``optimizer`` (the optimizer step's temporaries outgrow them) or ``forward`` (inference)."""
    nvme_bytes: int = 0
    """NVMe bytes per GPU for states offloaded to ZeRO-Infinity's NVMe tier."""
    engine_buffers: dict[str, int] = field(default_factory=dict)
    """The engine's own GPU buffers, counted in ``temporaries`` (gathered parameters, reduce
    buckets), by name."""

    @property
    def engine_label(self) -> str:
        """The engine whose memory layout is planned, in words."""
        return ENGINE_LABELS[self.run.layout]

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

    def describe(self) -> str:
        """One line: the mode, precision, optimizer, batch and parallelism planned."""
        return describe_run(self.run, self.seq)

    def column(self, name: str = "bytes") -> Column:
        """This plan's numbers as a column of the shared memory table."""
        return Column(name=name, breakdown=dict(self.breakdown), allocator_reserve=None,
                      activations_known=self.activations_known)

    def table(self, suggestions: Sequence[Any] = (), *,
              gpus_per_node: int = GPUS_PER_NODE) -> MemoryTable:
        """The memory table ``memfit plan`` prints (and ``str(plan)``)."""
        params = self.model.param_count()
        gpu = f" on {self.gpu.label}" if self.gpu else ""
        after = []
        if self.host_bytes:
            per_node = ""
            if self.run.parallel.gpus > 1:
                on_node = min(self.run.parallel.gpus, gpus_per_node)
                per_node = (f", {format_bytes(self.host_bytes * on_node)} per node of "
                            f"{on_node} GPUs")
            after.append(f"host memory for offloaded states: {format_bytes(self.host_bytes)} "
                         f"per GPU{per_node}")
        if self.nvme_bytes:
            after.append(f"NVMe for offloaded states (ZeRO-Infinity): "
                         f"{format_bytes(self.nvme_bytes)} per GPU")
        if self.engine_buffers:
            parts = ", ".join(f"{name} {format_bytes(b)}" for name, b in
                              self.engine_buffers.items())
            after.append(f"{self.engine_label} buffers in temporaries: {parts}")
        after += [f"note: {note}" for note in self.notes]
        return MemoryTable(
            title="Memory per GPU" + (f" (pipeline stage {self.stage})" if self.run.parallel.pp > 1
                                      else ""),
            columns=(self.column(),), capacity=self.capacity_bytes,
            capacity_is_driver_total=self.gpu is not None and not self.gpu.usable_measured,
            footnotes=(reserve_not_modelled_note(FITS_MARGIN),),
            lines_before=(f"[bold]{self.model.name}[/bold] ({format_params(params)} params){gpu}",
                          self.describe()),
            lines_after=tuple(after), suggestions=suggestion_rows(suggestions))

    def verdict(self) -> str:
        """The fit verdict line (rich markup), as ``memfit plan`` prints it."""
        return fit_verdict(self.capacity_bytes, self.total_bytes, FITS_MARGIN, "analytic plan")

    def __str__(self) -> str:
        return self.table().text(verdict=lambda out: out.print(self.verdict()))

    def __repr__(self) -> str:
        fits = {True: "fits", False: "does not fit", None: "no GPU"}[self.fits]
        gpu = f" on {self.gpu.name}" if self.gpu else ""
        return (f"<MemoryPlan {self.model.name}{gpu}: {self.describe()}; "
                f"total {format_bytes(self.total_bytes)} per GPU, {fits}>")

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` contract (keys are stable; more may be added)."""
        return {
            "model": {"name": self.model.name, "params": self.model.param_count()},
            "gpu": None if self.gpu is None else {
                "name": self.gpu.name, "capacity_bytes": self.gpu.usable_bytes,
                # False: capacity_bytes is the driver's total, PyTorch's not measured
                "capacity_measured": self.gpu.usable_measured},
            "per_gpu": {
                "total_bytes": self.total_bytes,
                "breakdown": {c.value: b for c, b in self.breakdown.items()},
                # the trace's "peak reserved - peak allocated"; not modelled here
                "allocator_reserve_bytes": None,
            },
            "fits": self.fits,
            "headroom_bytes": self.headroom_bytes,
            "activations_known": self.activations_known,
            "host_bytes": self.host_bytes,
            "nvme_bytes": self.nvme_bytes,
            "engine": self.run.layout,
            "engine_buffers": dict(self.engine_buffers),
            "runtime_parts": dict(self.runtime_parts),
            "stage": self.stage,
            # One source of truth for the sequence: the length planned (the model's default when
            # --seq is not given), inside "run" with the other options.
            "run": {**self.run.to_dict(), "seq": self.seq},
            "notes": list(self.notes),
        }


def describe_run(run: RunConfig, seq: int | None) -> str:
    """One line: the mode, precision, optimizer, batch, ``seq`` (the tokens per row planned,
    when the model has a sequence) and parallelism of ``run``."""
    r = run
    parts: list[str] = [r.mode, r.precision]
    if r.training:
        parts += [r.optimizer, f"checkpointing {r.checkpointing}"]
    parts.append(f"batch {r.batch}")
    if seq:
        parts.append(f"seq {seq}")
    if r.grad_accum > 1:
        parts.append(f"grad-accum {r.grad_accum}")
    if r.gpus > 1:
        parts.append(f"{r.gpus} GPUs (dp {r.dp}, tp {r.tp}, pp {r.pp}, zero {r.zero})")
    if r.training and r.layout != "zero-paper":  # (the notes name the default layout)
        parts.append(f"engine: {ENGINE_LABELS[r.layout]}")
    if r.mode in ("lora", "qlora"):
        parts.append(f"rank {r.lora_rank} on {','.join(r.lora_targets)}")
    if r.mode == "inference":
        if r.weight_quant != "none":
            parts.append(f"weights {r.weight_quant}")
        if r.new_tokens:
            parts.append(f"+{r.new_tokens} new tokens")
    return ", ".join(parts)


def default_precision(gpu: GpuSpec | None, mode: str) -> str:
    """The best precision ``gpu`` supports, for when the user names none: bf16-mixed where the
    GPU has bf16 (compute capability 8.0 and up; also with no GPU named), else fp16-mixed for
    training and fp16 for inference (V100, T4: 16-bit weights without fp32 masters).

    >>> from memfit.gpus import get_gpu
    >>> default_precision(get_gpu("t4"), "inference"), default_precision(get_gpu("t4"), "lora")
    ('fp16', 'fp16-mixed')
    """
    if gpu is None or gpu.supports("bf16"):
        return "bf16-mixed"
    return "fp16" if mode == "inference" else "fp16-mixed"


def _check_compatible(model: ModelSpec, run: RunConfig, gpu: GpuSpec | None) -> None:
    """Conflicting options, caught up front with the way around."""
    if gpu is not None:
        if vocab.precision(run.precision).needs == "bf16" and not gpu.bf16:
            raise MemfitError(
                f"{gpu.label} has no bf16 support (compute capability "
                f"{gpu.compute_capability}); use --precision fp16-mixed (fp16 for inference), "
                "or leave --precision out for the best this GPU supports")
        needs_fp8 = vocab.precision(run.precision).needs == "fp8" or run.kv_cache_dtype == "fp8"
        if needs_fp8 and not gpu.fp8:
            raise MemfitError(
                f"{gpu.label} has no fp8 support; use bf16-mixed (or an fp8 GPU such as "
                "h100-sxm-80gb, h200, l40s, l4, rtx-4090)")
    elif vocab.precision(run.precision).needs == "fp8":
        raise MemfitError("fp8 needs a GPU that supports it: add --gpu (e.g. --gpu h100-80gb)")
    if isinstance(model, TransformerSpec):
        tp, pp = run.parallel.tp, run.parallel.pp
        check_degrees(tp, pp, heads=model.num_heads, kv_heads=model.num_kv_heads,
                      layers=model.num_layers, tp_name=f"--tp {tp}", pp_name=f"--pp {pp}",
                      owner=f"{model.name}'s", kv_replicated=True)
        check_model_options(model, run)


def check_model_options(model: TransformerSpec, run: RunConfig) -> None:
    """Options that make no sense for this model: tokens past its context, a LoRA rank past
    full rank (both methods check them up front). A model type the formulas do not cover (an
    :class:`~memfit.models.hf_auto.HFModelSpec`) is not checked here: its own code refuses
    what it cannot run, and the trace reports that in one line."""
    if not isinstance(model, TransformerSpec):
        return
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
    if not run.training or run.offload_optimizer or (run.layout == "fsdp2"
                                                      and run.offload_params):
        return 0  # the step runs on the host
    trainable = split_params(model, run, stage=stage).trainable
    if run.zero >= 1:
        trainable = -(-trainable // run.parallel.dp)
    state_bytes = vocab.precision(run.precision).weight_bytes  # states in the parameters' dtype
    return STEP_TEMPORARIES_PER_PARAM[run.optimizer] * state_bytes * trainable


def _head_share(model: ModelSpec, gradients: int) -> int:
    """The share of ``gradients`` that belongs to the LM head (and a tied embedding)."""
    if not isinstance(model, TransformerSpec) or not model.param_count():
        return 0
    head = model.head_params() + (model.embedding_params() if model.tie_embeddings else 0)
    return gradients * head // model.param_count()


def largest_module_params(model: ModelSpec, run: RunConfig) -> int:
    """DeepSpeed's "largest layer": the most parameters one module holds itself (stage3.py:
    model_to_params sums ``m.parameters(recurse=False)`` per module): the embedding, the LM head
    or one linear layer, divided by tp. 0 when only the parameter count is known."""
    if not isinstance(model, TransformerSpec):
        return 0
    h = model.hidden_size
    largest = max(s.in_features * s.out_features for s in model.linear_shapes())
    if model.arch != "vision":
        largest = max(largest, model.vocab_size * h)
    return -(-largest // run.parallel.tp)


def fsdp_root_params(model: ModelSpec, run: RunConfig) -> int:
    """The root fully_shard unit: every parameter outside the blocks (embeddings, final norm and
    an untied LM head). ``fully_shard(model)`` after each block puts them in one
    FSDPParamGroup, and FSDPParamGroup.unshard all-gathers a group's parameters together
    (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py: foreach_all_gather), so an untied
    embedding and head are gathered at once."""
    if not isinstance(model, TransformerSpec):
        return 0
    return -(-(model.embedding_params() + model.head_params()) // run.parallel.tp)


def fsdp_unit_params(model: ModelSpec, run: RunConfig) -> int:
    """The largest fully_shard unit: a block, or the root (torchtitan shards each block and the
    root; the root gathers its own parameters, embedding and untied head together)."""
    if not isinstance(model, TransformerSpec):
        return 0
    return max(-(-model.layer_params() // run.parallel.tp), fsdp_root_params(model, run))


def fsdp2_buffers(model: ModelSpec, run: RunConfig, stage: int) -> dict[str, dict[str, int]]:
    """FSDP2's buffers at each moment of a training step that competes for the peak (the
    moments of ``Activations.moment``): by moment, by name.

    Note: [FSDP2 buffers by moment] (torch/distributed/fsdp/_fully_shard/, torch 2.13; the
    same functions in 2.11)
    - At the loss: the root gathered, and the last block's all-gather output, which forward
      keeps until the next copy-out (below). No gradient exists yet (zero_grad(set_to_none=
      True)).
    - Start of backward: with ``reshard_after_forward=True`` passed to every fully_shard call
      (memfit/parallel/apply.py: apply_fsdp, as torchtitan does) the root is resharded after
      its forward too (FSDPState._lazy_init keeps it gathered only when the argument is left to
      its default, ``_auto_reshard_after_forward``); its pre-backward gathers it again, and
      during that copy-out its all_gather_output and its unsharded parameters are both alive
      (FSDPParamGroup.wait_for_unshard frees the output "immediately after the current
      copy-out" in backward): twice the root, with every activation.
    - In a block's backward: the root, the block being run and the one prefetched; the block's
      unsharded gradients (param dtype) until FSDPParamGroup.post_backward hands them to
      foreach_reduce (_fsdp_collectives.py), which copies them into reduce_scatter_input
      (reduce_dtype: fp32 under torchtitan's MixedPrecisionPolicy) before
      ``unsharded_grads.clear()`` frees them; and the root's own gradients made so far (the
      final norm's and the LM head's, or a tied embedding's; an untied input embedding's
      gradient comes after the blocks), which stay unsharded until the root's post-backward at
      the end of backward.
    - In forward, FSDPParamGroup.wait_for_unshard keeps the previous group's all-gather result
      (its all_gather_output, as large as its unsharded parameters) "to free after the next
      copy-out" (implicit prefetching): while block i's parameters are copied out of their own
      all_gather_output, the previous group's output is still alive. At the first block that
      previous group is the root: root twice and block twice; later a block: root and three
      blocks. With LoRA's small activations these are the step's peak."""
    split = split_params(model, run, stage=stage)
    cb = nbytes(1, run.compute_format)
    reduce = vocab.precision(run.precision).grad_bytes
    trained = Fraction(split.trainable, split.total) if split.total else Fraction(1)
    root, block = fsdp_root_params(model, run), split.largest_layer
    if not isinstance(model, TransformerSpec):  # only the parameter count: the old bound
        root = block
    root_grads = 0
    if isinstance(model, TransformerSpec) and run.mode == "train":
        # trained in full fine-tuning, frozen under LoRA. In a block's backward only the root's
        # parameters used after the blocks have gradients: the final norm, the head (a tied
        # embedding's through it), BERT's pooler; an untied input embedding's gradient is made
        # last, after every block's backward.
        tied = model.vocab_size * model.hidden_size if (
            model.arch == "decoder" and model.tie_embeddings) else 0
        root_grads = -(-(model.head_params() + tied) // run.parallel.tp) * cb
    at_loss = {"all-gathered parameters": (root + block) * cb}
    in_backward = {"all-gathered parameters": (root + 2 * block) * cb,
                   "unsharded gradients": int(block * trained) * (cb + reduce) + root_grads}
    gathering = "all-gathered parameters and all-gather outputs"
    forward_end = {gathering: (root + 3 * block) * cb}
    forward_start = {gathering: (2 * root + 2 * block) * cb}
    backward_start = {gathering: 2 * root * cb}
    return {"loss": at_loss, "block": in_backward, "forward end": forward_end,
            "forward start": forward_start, "backward start": backward_start}


def _fsdp2_backward_end(model: ModelSpec, run: RunConfig, all_gradients: int
                        ) -> dict[str, int] | None:
    """FSDP2 at the end of backward (Note: [FSDP2 root reduce-scatter]): every block's sharded
    gradient, and the root's unsharded gradients with their reduce-scatter input. None when the
    root has no trained parameter (LoRA) or the layout is not FSDP2."""
    if (run.layout != "fsdp2" or not run.training or run.mode != "train"
            or not isinstance(model, TransformerSpec) or not model.param_count()):
        return None
    cb = nbytes(1, run.compute_format)
    reduce = vocab.precision(run.precision).grad_bytes
    root = fsdp_root_params(model, run)
    blocks_sharded = all_gradients - all_gradients * root * run.parallel.tp // model.param_count()
    # Just before: the input embedding's backward (the root's last op), with the root still
    # gathered, its gradients (the head's, a tied embedding's through it) and the embedding's
    # new gradient (a tied one's twice, until AccumulateGrad sums them), and the first block's
    # fp32 reduce-scatter input, which FSDPParamGroup.post_backward keeps in
    # comm_ctx.reduce_scatter_states (torch 2.13; reduce_scatter_state in 2.11) until the next
    # group's post_backward, the root's, reclaims it.
    tied = -(-model.vocab_size * model.hidden_size // run.parallel.tp) if (
        model.arch == "decoder" and model.tie_embeddings) else 0
    first_block = -(-model.layer_params() // run.parallel.tp)
    at_embedding = root * cb + (root + tied) * cb + first_block * reduce
    return {"gradients": blocks_sharded,
            "root's unsharded gradients and reduce-scatter input": max(root * (cb + reduce),
                                                                      at_embedding)}


def engine_buffers(model: ModelSpec, run: RunConfig, stage: int) -> dict[str, int]:
    """GPU bytes of the engine's own buffers during backward, by name (Note: [engine layouts] in
    model_states.py for the states themselves). The ZeRO paper's layout has none here (its
    gathered blocks are counted in ``_plan_stage``)."""
    if not run.training or run.layout == "zero-paper":
        return {}
    split = split_params(model, run, stage=stage)
    cb = nbytes(1, run.compute_format)
    out: dict[str, int] = {}
    layout, dp = run.layout, run.parallel.dp
    if layout == "fsdp2":
        # the buffers of a block's backward (Note: [FSDP2 buffers by moment]); _plan_stage
        # takes those at the loss when that is the peak
        out.update(fsdp2_buffers(model, run, stage)["block"])
    elif layout == "ddp" and dp > 1:
        # DDP copies gradients into its buckets unless gradient_as_bucket_view=True
        # (torch.nn.parallel.DistributedDataParallel docs: the saving "will be equal to the total
        # gradients size")
        out["DDP gradient buckets"] = split.trainable * vocab.precision(run.precision).grad_bytes
    elif layout == "deepspeed":
        if run.zero >= 1:
            # stage_1_and_2.py: setup_buckets / stage3.py: _setup_for_real_optimizer allocate
            # torch.empty(reduce_bucket_size) in the 16-bit dtype (contiguous_gradients, on by
            # default and forced on by cpu_offload)
            out["reduce bucket"] = DS_REDUCE_BUCKET * cb
        elif dp > 1:
            out["reduce bucket"] = min(DS_REDUCE_BUCKET, split.trainable) * cb
        if run.zero == 3:
            largest = largest_module_params(model, run)
            # the module being run, gathered, and its 16-bit gradient: 4 bytes per parameter of
            # the largest module, DeepSpeed's largest_layer_memory (stage3.py:
            # estimate_zero3_model_states_mem_needs)
            out["gathered module and its gradient"] = largest * 2 * cb
            out["prefetch bucket"] = min(DS_PREFETCH_BUCKET,
                                         split.total - largest) * cb if split.total else 0
    return {name: b for name, b in out.items() if b}


def _engine_step_temporaries(model: ModelSpec, run: RunConfig, stage: int) -> int | None:
    """The optimizer step's device temporaries where the engine decides them; None: PyTorch's
    foreach optimizer (``optimizer_step_temporaries``)."""
    if run.layout == "deepspeed":
        if run.offload_optimizer:
            return 0  # DeepSpeedCPUAdam steps on the host
        trainable = split_params(model, run, stage=stage).trainable
        part = -(-trainable // run.parallel.dp) if run.zero >= 1 else trainable
        if run.zero == 3:
            part = min(part, DS_SUB_GROUP)  # stage3.py: _prepare_fp32_grad_for_sub_group
        # stage_1_and_2.py: step() casts the flat 16-bit gradient partition to fp32
        # (flat_grad_partition.to(fp32)); FusedAdam keeps no temporaries
        return 4 * part
    if run.layout == "megatron":
        return 0  # fused Adam over the fp32 main grads already counted
    return None


def nvme_host_buffers(model: ModelSpec, run: RunConfig, stage: int) -> int:
    """Pinned host buffers ZeRO-Infinity swaps NVMe through (offload_config.py defaults)."""
    if run.offload_to != "nvme":
        return 0
    cb = nbytes(1, run.compute_format)
    total = 0
    if run.offload_params:
        total += DS_PARAM_SWAP_BUFFERS * cb
    if run.offload_optimizer:
        trainable = split_params(model, run, stage=stage).trainable
        part = -(-trainable // run.parallel.dp) if run.zero >= 1 else trainable
        total += DS_OPTIMIZER_SWAP_BUFFERS * min(part, DS_SUB_GROUP) * 4
    return total


def _plan_stage(model: ModelSpec, run: RunConfig, gpu: GpuSpec | None, seq: int | None,
                stage: int) -> MemoryPlan:
    states = model_states(model, run, stage=stage)
    breakdown = empty_breakdown()
    breakdown[MemoryCategory.WEIGHTS] = states.weights
    breakdown[MemoryCategory.GRADIENTS] = states.gradients
    breakdown[MemoryCategory.OPTIMIZER_STATES] = states.optimizer_states
    notes = list(states.notes)
    buffers = engine_buffers(model, run, stage)
    if run.mode == "train" and run.mixed and run.layout == "zero-paper":
        notes.append("no --engine: mixed precision counted as in the ZeRO paper: 16-bit weights "
                     "and gradients, fp32 masters with the optimizer; plain torch.autocast keeps "
                     "fp32 gradients (+2 bytes/param): --engine ddp (or --method trace) models "
                     "that")
    elif run.training and run.layout == "zero-paper" and run.parallel.gpus > 1:
        notes.append("no --engine: the ZeRO paper's layout; --engine picks fsdp2, ddp, "
                     "deepspeed or megatron")
    known = isinstance(model, TransformerSpec)
    dp = run.parallel.dp
    if isinstance(model, TransformerSpec) and seq is not None:
        if run.training:
            fsdp2 = (fsdp2_buffers(model, run, stage) if run.layout == "fsdp2" else None)
            acts = training_activations(
                model, run, seq, stage,
                engine={m: sum(d.values()) for m, d in fsdp2.items()} if fsdp2 else None)
            if fsdp2:
                chosen = fsdp2.get(acts.moment, fsdp2["loss"])
                buffers = {name: b for name, b in chosen.items() if b}
        else:
            acts = inference_activations(model, run, seq)
            if model.arch == "decoder":
                breakdown[MemoryCategory.KV_CACHE] = kv_cache_bytes(
                    model, run, seq + run.new_tokens)
        notes.extend(acts.notes)
        breakdown[MemoryCategory.ACTIVATIONS] = acts.activations
        temporaries = acts.temporaries
        if run.training and run.layout == "zero-paper":
            split = split_params(model, run, stage=stage)
            compute_bytes = nbytes(1, run.compute_format)
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
    breakdown[MemoryCategory.TEMPORARIES] += sum(buffers.values())
    peak_phase = "backward" if run.training else "forward"
    if known and seq is not None and run.training and acts.moment.startswith("forward"):
        peak_phase = "forward"
    all_gradients = breakdown[MemoryCategory.GRADIENTS]
    if (run.training and known and seq is not None and isinstance(model, TransformerSpec)
            and run.layout in ("ddp", "fsdp2")):
        # PyTorch frees gradients between steps (torch/optim/optimizer.py: zero_grad(set_to_none
        # =True), the default since 2.0): at the loss none exist yet; in the last block's
        # backward only the head's (and a tied embedding's).
        # Under FSDP2 the root's gradients stay unsharded until the end of backward: they are
        # among the engine's buffers (Note: [FSDP2 buffers by moment]).
        breakdown[MemoryCategory.GRADIENTS] = (
            0 if acts.moment != "block" or run.layout == "fsdp2"
            else _head_share(model, all_gradients))
        where = {"loss": "backward peak at the loss", "block": "backward peak in the last block"
                 }.get(acts.moment, f"peak in the forward ({acts.moment})")
        notes.append(f"{where}: gradients are allocated during backward "
                     "(zero_grad sets them to None), so only those made by then are counted")
    step_temporaries = optimizer_step_temporaries(model, run, stage)
    engine_step = _engine_step_temporaries(model, run, stage) if run.training else None
    if engine_step is not None:
        step_temporaries = engine_step
    step_temporaries += sum(b for name, b in buffers.items() if name in PERSISTENT_BUFFERS)
    backward_peak = (breakdown[MemoryCategory.ACTIVATIONS]
                     + breakdown[MemoryCategory.TEMPORARIES]
                     + breakdown[MemoryCategory.GRADIENTS])
    end = _fsdp2_backward_end(model, run, all_gradients) if known and seq is not None else None
    if end is not None and sum(end.values()) > backward_peak:
        # Note: [FSDP2 root reduce-scatter] The end of backward: the root's post-backward
        # (_fsdp_param_group.py: FSDPParamGroup.post_backward) reshards its parameters, then
        # foreach_reduce holds its unsharded gradients and their reduce-scatter input (fp32)
        # together, while every block's sharded gradient already exists.
        buffers = {"root's unsharded gradients and reduce-scatter input":
                   end["root's unsharded gradients and reduce-scatter input"]}
        breakdown[MemoryCategory.ACTIVATIONS] = 0
        breakdown[MemoryCategory.GRADIENTS] = end["gradients"]
        breakdown[MemoryCategory.TEMPORARIES] = sum(buffers.values())
        backward_peak = sum(end.values())
        peak_phase = "backward"
        notes.append("peak at the end of backward: the input embedding's backward with the "
                     "root gathered and the first block's fp32 reduce-scatter input still held, "
                     "or FSDP2's reduce-scatter of the root's gradients (embeddings, head), "
                     "last, from an fp32 copy")
    if step_temporaries + all_gradients > backward_peak:
        # The optimizer step runs after backward has freed the activations; its foreach
        # temporaries are the peak when they outgrow activations + backward temporaries.
        breakdown[MemoryCategory.ACTIVATIONS] = 0
        breakdown[MemoryCategory.GRADIENTS] = all_gradients
        breakdown[MemoryCategory.TEMPORARIES] = step_temporaries
        peak_phase = "optimizer"
        notes.append("peak in the optimizer step: PyTorch's default foreach implementation "
                     "makes a parameter-sized temporary (fused=True avoids it)"
                     if engine_step is None else
                     "peak in the optimizer step: DeepSpeed casts the gradient partition to "
                     "fp32 for the step")
    runtime = cuda_runtime_bytes(gpu.name if gpu else None, num_gpus=run.parallel.gpus)
    breakdown[MemoryCategory.RUNTIME] = sum(runtime.values())
    return MemoryPlan(model=model, run=run, gpu=gpu, seq=seq, breakdown=breakdown,
                      activations_known=known,
                      host_bytes=states.host_bytes + nvme_host_buffers(model, run, stage),
                      runtime_parts=runtime, notes=tuple(dict.fromkeys(notes)), stage=stage,
                      peak_phase=peak_phase, nvme_bytes=states.nvme_bytes,
                      engine_buffers=buffers)


def plan(model: ModelSpec, run: RunConfig | None = None, gpu: GpuSpec | None = None) -> MemoryPlan:
    """Plan one step of ``model`` run as ``run`` on ``gpu``; returns the most loaded GPU.

    >>> from memfit.models.spec import ParamCountSpec
    >>> from memfit.parallel import Parallel
    >>> p = plan(ParamCountSpec(name="7.5B", params=7_500_000_000),
    ...          RunConfig(precision="fp16-mixed", optimizer="adam",
    ...                    parallel=Parallel(gpus=64, zero=3)))
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
    stages = {0, run.parallel.pp - 1}
    plans = [_plan_stage(model, run, gpu, seq, stage) for stage in sorted(stages)]
    return max(plans, key=lambda p: p.total_bytes)


def with_changes(p: MemoryPlan, **changes: Any) -> MemoryPlan:
    """Re-plan with some run options changed (used by suggestions and searches); a layout
    option (``gpus``, ``tp``, ``pp``, ``zero``) changes ``run.parallel``."""
    layout = {k: changes.pop(k) for k in ("gpus", "tp", "pp", "zero") if k in changes}
    run = replace(p.run, **changes)
    return plan(p.model, run.relayout(**layout) if layout else run, p.gpu)

MAX_GPUS = 4096
"""The largest GPU count :func:`gpus_needed` tries."""


@dataclass(frozen=True, kw_only=True)
class ScaleOut:
    """The fewest GPUs that hold a step that does not fit on the planned count."""

    plan: MemoryPlan
    """The plan on ``plan.run.parallel.gpus`` GPUs; it fits with :data:`FITS_MARGIN`."""
    strategy: str
    """How the GPUs split the work, in words (e.g. ``ZeRO-3 / FSDP``)."""
    gpus_per_node: int

    @property
    def gpus(self) -> int:
        return self.plan.run.parallel.gpus

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.gpus_per_node)

    @property
    def host_bytes_per_node(self) -> int:
        """Host memory of one full node for what the plan offloads: the per-GPU offloaded
        states times the GPUs on the node."""
        return self.plan.host_bytes * min(self.gpus, self.gpus_per_node)

    @property
    def flags(self) -> str:
        """The CLI options that give this plan."""
        r = self.plan.run
        out = [f"--gpus {r.gpus}"]
        if r.zero:
            out.append(f"--zero {r.zero}")
        if r.tp > 1:
            out.append(f"--tp {r.tp}")
        if r.pp > 1:
            out.append(f"--pp {r.pp}")
        return " ".join(out)

    def to_dict(self) -> dict[str, Any]:
        r = self.plan.run
        return {"gpus": r.gpus, "zero": r.zero, "tp": r.tp, "pp": r.pp, "flags": self.flags,
                "strategy": self.strategy, "per_gpu_total_bytes": self.plan.total_bytes,
                "headroom_bytes": self.plan.headroom_bytes, "gpus_per_node": self.gpus_per_node,
                "nodes": self.nodes, "host_bytes_per_gpu": self.plan.host_bytes,
                "host_bytes_per_node": self.host_bytes_per_node}


def _widest_zero(run: RunConfig) -> int:
    """The most sharding the run's engine offers when adding data-parallel ranks: ZeRO-3 (FSDP,
    DeepSpeed), the distributed optimizer (Megatron) or ZeroRedundancyOptimizer (DDP)."""
    return 1 if run.engine in ("megatron", "ddp") else 3


def _fits(model: ModelSpec, run: RunConfig, gpu: GpuSpec) -> MemoryPlan | None:
    try:
        p = plan(model, run, gpu)
    except MemfitError:
        return None  # e.g. a tp that does not divide the heads
    return p if p.fits else None


def gpus_needed(p: MemoryPlan, *, gpus_per_node: int = GPUS_PER_NODE,
                max_gpus: int = MAX_GPUS) -> ScaleOut | None:
    """The fewest GPUs on which ``p``'s step fits with :data:`FITS_MARGIN`, or None when none up
    to ``max_gpus`` does (or no GPU is named).

    Training keeps the given tensor and pipeline sizes and adds data-parallel ranks with the
    given ZeRO stage, ZeRO-3 / FSDP when none is given: the sharded model states shrink with
    the ranks, the activations of a micro-batch do not (ZeRO paper, Fig. 1). The per-GPU bytes
    never grow with the ranks, so a bisection finds the fewest. Inference splits the model with
    tensor parallelism within a node (a tp that divides the heads), then pipeline stages.

    >>> from memfit.gpus import get_gpu
    >>> from memfit.models import get_preset
    >>> one = plan(get_preset("llama-3-8b"), RunConfig(checkpointing="full"), get_gpu("a100-40gb"))
    >>> one.fits, gpus_needed(one).strategy
    (False, 'ZeRO-3 / FSDP')
    """
    if p.gpu is None or gpus_per_node < 1:
        return None
    model, run, gpu = p.model, p.run, p.gpu
    if run.training:
        zero = run.zero or _widest_zero(run)
        step = run.parallel.tp * run.parallel.pp

        def at(dp: int) -> MemoryPlan | None:
            return _fits(model, run.relayout(gpus=dp * step, zero=zero), gpu)

        lo, hi = run.parallel.dp + 1, max_gpus // step
        if hi < lo or at(hi) is None:
            return None
        while lo < hi:  # the fewest data-parallel ranks that fit
            mid = (lo + hi) // 2
            if at(mid) is None:
                lo = mid + 1
            else:
                hi = mid
        found = at(lo)
        assert found is not None
        strategy = {1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3 / FSDP"}[zero]
        if run.engine == "megatron":
            strategy = "Megatron distributed optimizer"
        if step > 1:
            strategy += f" with tp {run.parallel.tp} x pp {run.parallel.pp}"
        return ScaleOut(plan=found, strategy=strategy, gpus_per_node=gpus_per_node)
    heads = model.num_heads if isinstance(model, TransformerSpec) else 1
    layers = model.num_layers if isinstance(model, TransformerSpec) else 1
    tps = [t for t in range(1, min(heads, gpus_per_node) + 1) if heads % t == 0]
    options = sorted((t * pp, pp, t) for t in tps for pp in range(1, layers + 1)
                      if run.parallel.gpus < t * pp <= max_gpus)
    for _, pp, t in options:
        found = _fits(model, run.relayout(gpus=t * pp, tp=t, pp=pp), gpu)
        if found is not None:
            strategy = " x ".join(([f"tensor parallel {t}"] if t > 1 else [])
                                  + ([f"{pp} pipeline stages"] if pp > 1 else []))
            return ScaleOut(plan=found, strategy=strategy, gpus_per_node=gpus_per_node)
    return None


def unshrinkable(p: MemoryPlan) -> MemoryPlan:
    """``p``'s step with so many data-parallel ranks (one per parameter, and the ZeRO stage
    :func:`gpus_needed` adds ranks with) that every sharded state is down to a few bytes: the
    per-GPU bytes no number of GPUs removes (one micro-batch's activations and temporaries, the
    runtime, what the ZeRO stage does not shard)."""
    run = p.run
    step = run.parallel.tp * run.parallel.pp
    ranks = max(p.model.param_count(), MAX_GPUS)
    return plan(p.model, run.relayout(gpus=ranks * step, zero=run.zero or _widest_zero(run)),
                p.gpu)


def scale_out_line(p: MemoryPlan, scale: ScaleOut | None, *,
                   gpus_per_node: int = GPUS_PER_NODE) -> str:
    """The line ``memfit plan`` prints when ``p`` does not fit: how many GPUs it needs, or why
    no count up to :data:`MAX_GPUS` will do: what does not shrink with more GPUs is over the
    GPU's budget (:func:`unshrinkable`), or the sharded states still are at that count."""
    if scale is None:
        if p.run.training:
            zero = p.run.zero or _widest_zero(p.run)
            step = p.run.parallel.tp * p.run.parallel.pp
            # the largest count searched (or the one planned, past it): per-GPU bytes never grow
            # with the ranks, so none below it holds the step either
            top = max(MAX_GPUS // step * step, p.run.parallel.gpus)
            widest = plan(p.model, p.run.relayout(gpus=top, zero=zero), p.gpu)
            floor = unshrinkable(p)
            head = f"no number of GPUs up to {top} holds this step with ZeRO-{zero}"
            if zero < 3:
                head += f" ({widest.engine_label})"
            unknown = ("" if p.activations_known else
                       " (activations not counted: only the parameter count is given)")
            if floor.fits:  # what is left at MAX_GPUS is sharded: more GPUs would shrink it
                return (f"{head}: each of {top} GPUs still needs "
                        f"{format_bytes(widest.total_bytes)}, all but "
                        f"{format_bytes(floor.total_bytes)} of it sharded states, which more "
                        f"GPUs shrink{unknown}; plan a larger --gpus, or fewer bytes per "
                        "parameter (--offload-optimizer, --optimizer adamw-8bit)")
            budget = (p.capacity_bytes or 0) - int(FITS_MARGIN * (p.capacity_bytes or 0))
            # the sharded states are down to a few bytes each: name the parts of a MiB or more
            parts = ", ".join(f"{c.value} {format_bytes(b)}" for c, b in floor.breakdown.items()
                              if b >= 2**20)
            fix = ("try --tp, --pp or an engine that shards parameters (--engine fsdp2)"
                   if zero < 3 else "try --checkpointing full, a smaller --batch, or --tp")
            return (f"{head}: what more GPUs do not shrink is {format_bytes(floor.total_bytes)} "
                    f"per GPU ({parts}){unknown}, over the {format_bytes(budget)} the fit "
                    f"margin leaves; {fix}")
        return (f"no tensor/pipeline split up to {MAX_GPUS} GPUs holds this step; try --quant, "
                "--kv-cache-dtype or a smaller --batch")
    q = scale.plan
    line = (f"this needs {scale.gpus} GPUs ({scale.strategy}: {scale.flags}), "
            f"{format_bytes(q.total_bytes)} per GPU, {format_bytes(q.headroom_bytes)} headroom")
    if scale.gpus > gpus_per_node:
        line += f"; {scale.nodes} nodes of {gpus_per_node} GPUs"
    if q.host_bytes:
        # Note: the per-GPU share is of this count of GPUs, not of the plan above it.
        line += (f"; host memory for offloaded states on {scale.gpus} GPUs: "
                 f"{format_bytes(q.host_bytes)} per GPU, "
                 f"{format_bytes(scale.host_bytes_per_node)} per node of "
                 f"{min(scale.gpus, gpus_per_node)} GPUs")
    return line
