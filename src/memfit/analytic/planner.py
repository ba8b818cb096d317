"""The analytic planner: per-GPU bytes by category for a model, a run and a GPU.

Pure functions of small frozen inputs (ModelSpec, RunConfig, GpuSpec); bytes are integers and
units are formatted only at the edge (CLI, reports).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from memfit.analytic.activations import (
    Activations,
    inference_activations,
    training_activations,
)
from memfit.analytic.budget import DeviceBudget, device_budget, device_runtime_bytes
from memfit.analytic.checks import _check_compatible
from memfit.analytic.config import RunConfig
from memfit.analytic.engine_buffers import (
    PERSISTENT_BUFFERS,
    _engine_step_temporaries,
    _fsdp2_backward_end,
    engine_buffers,
    fsdp2_buffers,
    nvme_host_buffers,
    optimizer_step_temporaries,
)
from memfit.analytic.kv_cache import kv_cache_bytes
from memfit.analytic.model_states import model_states, sparse_training_copies, split_params
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
    input_pipeline: Any = None
    """With a DataLoader (:func:`memfit.analytic.input_pipeline.with_input_pipeline`): its
    memory and the node's host check (``PipelineOnPlan``); its device bytes are in
    ``ACTIVATIONS``."""

    @property
    def engine_label(self) -> str:
        """The engine whose memory layout is planned, in words."""
        return ENGINE_LABELS[self.run.layout]

    @property
    def total_bytes(self) -> int:
        return sum(self.breakdown.values())

    @property
    def budget(self) -> DeviceBudget | None:
        """What the plan may fill on its GPU, by target (:mod:`memfit.analytic.budget`): a
        unified-memory device's memory less the host's share; MPS's limit on a Mac."""
        return device_budget(self.gpu) if self.gpu else None

    @property
    def capacity_bytes(self) -> int | None:
        budget = self.budget
        return budget.budget_bytes if budget else None

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
        if self.input_pipeline is not None:
            after += self.input_pipeline.lines()
        after += [f"note: {note}" for note in self.notes]
        budget_line = self.budget.line() if self.budget else None
        return MemoryTable(
            title="Memory per GPU" + (f" (pipeline stage {self.stage})" if self.run.parallel.pp > 1
                                      else ""),
            columns=(self.column(),), capacity=self.capacity_bytes,
            capacity_is_driver_total=(self.gpu is not None and not self.gpu.usable_measured
                                      and not self.gpu.unified_memory),
            footnotes=(reserve_not_modelled_note(FITS_MARGIN),),
            lines_before=(f"[bold]{self.model.name}[/bold] ({format_params(params)} params){gpu}",
                          self.describe(), *([budget_line] if budget_line else [])),
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
                "name": self.gpu.name, "capacity_bytes": self.capacity_bytes,
                # False: capacity_bytes is the driver's total, PyTorch's not measured
                "capacity_measured": self.gpu.usable_measured,
                # how the capacity was reached: the target, a unified device's host reserve,
                # MPS's limit (memfit.analytic.budget)
                "budget": self.budget.to_dict() if self.budget else None},
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
            "input_pipeline": (None if self.input_pipeline is None
                               else self.input_pipeline.to_dict()),
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
        if r.sparsity != "none":
            parts.append(f"{r.sparsity} sparse linear weights")
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


def _head_share(model: ModelSpec, gradients: int) -> int:
    """The share of ``gradients`` that belongs to the LM head (and a tied embedding)."""
    if not isinstance(model, TransformerSpec) or not model.param_count():
        return 0
    head = model.head_params() + (model.embedding_params() if model.tie_embeddings else 0)
    return gradients * head // model.param_count()


def _layout_notes(run: RunConfig) -> list[str]:
    """What planning without ``--engine`` (the ZeRO paper's layout) assumes."""
    if run.mode == "train" and run.mixed and run.layout == "zero-paper":
        return ["no --engine: mixed precision counted as in the ZeRO paper: 16-bit weights "
                "and gradients, fp32 masters with the optimizer; plain torch.autocast keeps "
                "fp32 gradients (+2 bytes/param): --engine ddp (or --method trace) models "
                "that"]
    if run.training and run.layout == "zero-paper" and run.parallel.gpus > 1:
        return ["no --engine: the ZeRO paper's layout; --engine picks fsdp2, ddp, "
                "deepspeed or megatron"]
    return []


def _step_activations(model: TransformerSpec, run: RunConfig, seq: int, stage: int,
                      buffers: dict[str, int]) -> tuple[Activations, dict[str, int]]:
    """The step's activations at its peak moment, and the engine's buffers at that moment
    (FSDP2's differ by moment: Note: [FSDP2 buffers by moment]; the others' do not)."""
    if not run.training:
        return inference_activations(model, run, seq), buffers
    fsdp2 = (fsdp2_buffers(model, run, stage) if run.layout == "fsdp2" else None)
    acts = training_activations(
        model, run, seq, stage,
        engine={m: sum(d.values()) for m, d in fsdp2.items()} if fsdp2 else None)
    if fsdp2:
        chosen = fsdp2.get(acts.moment, fsdp2["loss"])
        buffers = {name: b for name, b in chosen.items() if b}
    return acts, buffers


def _zero_paper_temporaries(model: ModelSpec, run: RunConfig, stage: int,
                            gradients: int) -> tuple[int, list[str]]:
    """The ZeRO paper's layout's gathered blocks (ZeRO-3) or DDP's gradient buckets, counted as
    temporaries (the engines' own layouts count theirs in ``engine_buffers``)."""
    if not (run.training and run.layout == "zero-paper"):
        return 0, []
    split = split_params(model, run, stage=stage)
    compute_bytes = nbytes(1, run.compute_format)
    if run.zero == 3:
        # FSDP/ZeRO-3: the current block is all-gathered and the next one prefetched;
        # its full gradient exists before the reduce-scatter.
        gathered = 2 * split.largest_layer * compute_bytes
        return gathered + split.largest_layer * compute_bytes, [
            "ZeRO-3: two gathered blocks + one block's unsharded gradients "
            "counted as temporaries"]
    if run.parallel.dp > 1 and run.zero == 0:
        # DDP copies gradients into its buckets unless gradient_as_bucket_view=True
        # (torch.nn.parallel.DistributedDataParallel docs: the saving "will be equal to
        # the total gradients size").
        return gradients, ["DDP gradient buckets: one extra copy of the gradients "
                           "(gradient_as_bucket_view=False, PyTorch's default)"]
    return 0, []


def _gradients_at_peak(model: TransformerSpec, run: RunConfig, moment: str,
                       all_gradients: int) -> tuple[int, str]:
    """The gradients that exist at the backward peak under PyTorch's engines (DDP, FSDP2),
    and the note that says so."""
    # PyTorch frees gradients between steps (torch/optim/optimizer.py: zero_grad(set_to_none
    # =True), the default since 2.0): at the loss none exist yet; in the last block's
    # backward only the head's (and a tied embedding's).
    # Under FSDP2 the root's gradients stay unsharded until the end of backward: they are
    # among the engine's buffers (Note: [FSDP2 buffers by moment]).
    gradients = (0 if moment != "block" or run.layout == "fsdp2"
                 else _head_share(model, all_gradients))
    where = {"loss": "backward peak at the loss", "block": "backward peak in the last block"
             }.get(moment, f"peak in the forward ({moment})")
    return gradients, (f"{where}: gradients are allocated during backward "
                       "(zero_grad sets them to None), so only those made by then are counted")


def _at_backward_end(breakdown: dict[MemoryCategory, int],
                     end: dict[str, int]) -> dict[str, int]:
    """Put FSDP2's end of backward in ``breakdown``; returns the engine's buffers then."""
    # Note: [FSDP2 root reduce-scatter] The end of backward: the root's post-backward
    # (_fsdp_param_group.py: FSDPParamGroup.post_backward) reshards its parameters, then
    # foreach_reduce holds its unsharded gradients and their reduce-scatter input (fp32)
    # together, while every block's sharded gradient already exists.
    buffers = {"root's unsharded gradients and reduce-scatter input":
               end["root's unsharded gradients and reduce-scatter input"]}
    breakdown[MemoryCategory.ACTIVATIONS] = 0
    breakdown[MemoryCategory.GRADIENTS] = end["gradients"]
    breakdown[MemoryCategory.TEMPORARIES] = sum(buffers.values())
    return buffers


def _plan_stage(model: ModelSpec, run: RunConfig, gpu: GpuSpec | None, seq: int | None,
                stage: int) -> MemoryPlan:
    """One pipeline stage's most loaded GPU: the model states, then the activations, the
    engine's buffers and the temporaries of the moment that holds the most (in backward, at
    the end of backward, or in the optimizer step)."""
    states = model_states(model, run, stage=stage)
    breakdown = empty_breakdown()
    breakdown[MemoryCategory.WEIGHTS] = states.weights
    breakdown[MemoryCategory.GRADIENTS] = states.gradients
    breakdown[MemoryCategory.OPTIMIZER_STATES] = states.optimizer_states
    notes = list(states.notes) + _layout_notes(run)
    buffers = engine_buffers(model, run, stage, seq)
    known = isinstance(model, TransformerSpec)
    acts: Activations | None = None
    if isinstance(model, TransformerSpec) and seq is not None:
        acts, buffers = _step_activations(model, run, seq, stage, buffers)
        if not run.training and model.arch == "decoder":
            breakdown[MemoryCategory.KV_CACHE] = kv_cache_bytes(model, run, seq + run.new_tokens)
        notes.extend(acts.notes)
        breakdown[MemoryCategory.ACTIVATIONS] = acts.activations
        if run.training and run.sparsity == "2:4":
            copies, copies_note = sparse_training_copies(model, run, stage=stage)
            breakdown[MemoryCategory.ACTIVATIONS] += copies
            notes.append(copies_note)
        gathered, gathered_notes = _zero_paper_temporaries(
            model, run, stage, breakdown[MemoryCategory.GRADIENTS])
        notes.extend(gathered_notes)
        breakdown[MemoryCategory.TEMPORARIES] = acts.temporaries + gathered
    elif run.training or isinstance(model, ParamCountSpec):
        known = False
        notes.append("activations unknown: only the parameter count is given; "
                     "use a preset or config.json for activations")
    breakdown[MemoryCategory.TEMPORARIES] += sum(buffers.values())
    peak_phase = "backward" if run.training else "forward"
    if acts is not None and run.training and acts.moment.startswith("forward"):
        peak_phase = "forward"
    all_gradients = breakdown[MemoryCategory.GRADIENTS]
    if (run.training and acts is not None and isinstance(model, TransformerSpec)
            and run.layout in ("ddp", "fsdp2")):
        breakdown[MemoryCategory.GRADIENTS], note = _gradients_at_peak(
            model, run, acts.moment, all_gradients)
        notes.append(note)
    step_temporaries = optimizer_step_temporaries(model, run, stage)
    engine_step = _engine_step_temporaries(model, run, stage) if run.training else None
    if engine_step is not None:
        step_temporaries = engine_step
    step_temporaries += sum(b for name, b in buffers.items() if name in PERSISTENT_BUFFERS)
    backward_peak = (breakdown[MemoryCategory.ACTIVATIONS]
                     + breakdown[MemoryCategory.TEMPORARIES]
                     + breakdown[MemoryCategory.GRADIENTS])
    end = _fsdp2_backward_end(model, run, all_gradients) if acts is not None else None
    if end is not None and sum(end.values()) > backward_peak:
        buffers = _at_backward_end(breakdown, end)
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
    runtime = device_runtime_bytes(gpu, num_gpus=run.parallel.gpus)
    breakdown[MemoryCategory.RUNTIME] = sum(runtime.values())
    return MemoryPlan(model=model, run=run, gpu=gpu, seq=seq, breakdown=breakdown,
                      activations_known=known,
                      host_bytes=states.host_bytes + nvme_host_buffers(model, run, stage),
                      runtime_parts=runtime, notes=tuple(dict.fromkeys(notes)), stage=stage,
                      peak_phase=peak_phase, nvme_bytes=states.nvme_bytes,
                      engine_buffers=buffers)


def plan(model: ModelSpec | str, run: RunConfig | None = None,
         gpu: GpuSpec | str | None = None) -> MemoryPlan:
    """Plan one step of ``model`` run as ``run`` on ``gpu``; returns the most loaded GPU.
    ``model`` and ``gpu`` may be names, as ``memfit plan`` takes them (resolved with
    :func:`memfit.models.resolve_model` and :func:`memfit.gpus.get_gpu`).

    >>> from memfit.models.spec import ParamCountSpec
    >>> from memfit.parallel import Parallel
    >>> p = plan(ParamCountSpec(name="7.5B", params=7_500_000_000),
    ...          RunConfig(precision="fp16-mixed", optimizer="adam",
    ...                    parallel=Parallel(gpus=64, zero=3)))
    >>> p.breakdown[MemoryCategory.WEIGHTS] + p.breakdown[MemoryCategory.OPTIMIZER_STATES] > 0
    True
    """
    if isinstance(model, str):
        from memfit.models import resolve_model

        model = resolve_model(model)
    if isinstance(gpu, str):
        from memfit.gpus import get_gpu

        gpu = get_gpu(gpu)
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
