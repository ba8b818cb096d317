"""How a training step is spread over GPUs: the :class:`Parallel` layout a per-rank trace runs
(re-exported by :mod:`memfit.parallel.config`; it lives here, below the layers that read it).

Pure data (no torch import), so the CLI can build and check one without torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from dataclasses import replace as dataclasses_replace
from typing import Any

from memfit.errors import MemfitError, suggest

_DTYPES = ("fp32", "bf16", "fp16")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
TP_STYLE_NAMES = ("colwise", "rowwise", "colwise_rep", "rowwise_rep", "embedding_rowwise",
                  "sequence_parallel", "replicate")
"""The styles a :attr:`Parallel.tp_plan` may name as strings (the CLI's and plan files'),
transformers' spellings (``transformers/distributed/tensor_parallel.py``), each one torch
``ParallelStyle`` (``memfit.parallel.tp_plans.torch_style``): ``colwise`` =
``ColwiseParallel()``; ``rowwise`` = ``RowwiseParallel()``; ``colwise_rep`` =
``ColwiseParallel(output_layouts=Replicate())`` (the output all-gathered); ``rowwise_rep`` =
``RowwiseParallel(input_layouts=Replicate())`` (a replicated input, split locally);
``embedding_rowwise``: an ``nn.Embedding`` split by vocabulary rows, its output all-reduced;
``sequence_parallel`` = ``SequenceParallel()``; ``replicate``: left whole on every rank."""
TP_STYLE_ALIASES = {"colwise_gather_output": "colwise_rep", "rowwise_split_input": "rowwise_rep",
                    "replicated_with_grad_allreduce": "replicate"}
"""transformers' other names for the same styles."""


@dataclass(frozen=True, kw_only=True)
class Parallel:
    """A data/tensor/pipeline-parallel layout of ``gpus`` ranks.

    The data-parallel degree is what ``tp * pp`` leaves: ``gpus // (tp * pp)`` ranks, of which
    ``fsdp`` shard the model (FSDP2 ``fully_shard``) and ``replicate = dp // fsdp`` hold
    replicas (DDP when ``fsdp == 1``; HSDP on a 2-D mesh when both are > 1).

    >>> Parallel(gpus=8, fsdp=8).strategy
    'fsdp'
    >>> Parallel(gpus=8, fsdp=4).strategy, Parallel(gpus=8, fsdp=4).replicate
    ('hsdp', 2)
    >>> Parallel(gpus=4).strategy, Parallel(gpus=4, zero=1).strategy
    ('ddp', 'zero1')

    Known limitations: the trace runs the data-parallel family (DDP, ZeRO-1, FSDP2, HSDP),
    tensor parallelism alone (``tp == gpus``) and tensor parallelism with FSDP2 over the other
    dim of a 2-D ``("dp", "tp")`` mesh (``Parallel(gpus=4, tp=2, fsdp=2)``) or HSDP on a 3-D
    ``("replicate", "shard", "tp")`` one; tp with DDP or ZeRO-1 is refused (torchtitan
    refuses it too). Tensor parallelism splits what ``tp_plan`` names (any module: torch's
    ``ParallelStyle`` s on its linear layers and embeddings, each split dim a multiple of
    ``tp``), else the model's own plan (transformers' ``tp_plan``, with transformers' styles),
    else the projections memfit knows by name (``q_proj`` ... ``down_proj``); a ``tp_plan``
    beside ``pp`` is refused (the stages split by memfit's names).
    Sequence parallelism (``sp=True``) is traced for memfit's builtin decoders and Hugging
    Face's Llama, Mistral, Qwen2 and Qwen3 modules (untied embeddings, rotary positions), as is
    loss parallelism (``loss_parallel=True``: the
    model's own cross-entropy on vocabulary-split logits).
    Expert parallelism (``memfit/parallel/expert.py``) runs on memfit's builtin MoE layers and
    on transformers' experts modules of fused 3-D parameters (Mixtral, Qwen3-MoE, DeepSeek-V3,
    gpt-oss: ``memfit/parallel/hf_expert.py``, whose forward it replaces by the same
    fixed-capacity exchange, dropping tokens past an expert's capacity where transformers drops
    none), with FSDP2 over every data-parallel rank for the other
    parameters (the ``dp / ep`` ranks that hold the same experts shard them), or DDP when ``ep``
    is every data-parallel rank; HSDP, ZeRO-1, DDP with ``ep`` below the data-parallel ranks
    and FSDP2's dtype and offload policies are refused; beside pp the same runs on
    each stage over its data-parallel ranks (a ``(pp, efsdp, ep)`` mesh). Beside tp (alone or
    with pp; no sp, no ``tp_plan`` or ``pp_split_points`` of the user's) it runs as torchtitan
    does with whole experts (etp = 1): ``ep``, a multiple of ``tp``, spans whole tp groups of
    the ``dp * tp`` ranks (of a stage), each tp rank routing its ``1/tp`` of the tokens
    (``Parallel(gpus=4, tp=2, fsdp=2, ep=2)``; FSDP2 or nothing over dp). ``ep`` must divide
    the experts, and ``dp * tp / ep`` each rank's experts. Its token exchange has fixed sizes
    (each expert's buffer holds ``capacity`` slots, balanced routing at the default capacity
    factor 1.0), so a rank's bytes do not depend on the router. Its gloo check needs the
    measurement's own all-to-all backward on torch 2.11 and 2.12, whose C++ one freed blocks
    unseen (Note: [the all-to-all's C++ wait] in memfit/parallel/measure.py); the trace is the
    same.
    Pipeline parallelism is traced alone (``pp == gpus``), with FSDP2, DDP or ZeRO-1 on each
    stage over the other ranks (a ``(pp, dp)`` mesh), HSDP (a ``(pp, replicate, shard)``
    mesh), and with tensor (and sequence, and loss) parallelism inside each stage (a
    ``(pp, tp)``, ``(pp, dp, tp)`` or ``(pp, replicate, shard, tp)`` mesh with FSDP2 / HSDP;
    DDP and ZeRO-1 beside ``pp x tp`` are refused as torchtitan refuses them), and with ep
    (above), on
    memfit's builtin decoders (``memfit.models.build_model``) and Hugging Face's Llama,
    Mistral, Qwen2 and Qwen3 modules (``memfit/parallel/hf_pipeline.py``),
    with the model's own loss on the
    last stage (a ``loss_fn`` is not used) and the batch as ``example_inputs`` gives it
    (``input_ids``, ``labels``); each pipeline rank is one rank role. Any other module is split
    at ``pp_split_points`` (or a transformers config's ``base_model_pp_plan``): elements of one
    ``ModuleList`` / ``Sequential`` that its forward iterates, the modules before it on the
    first stage and after it on the last (``nn.Identity`` elsewhere), one tensor between the
    stages and the logits' next-token cross-entropy as the loss
    (``memfit/parallel/pipeline_split.py``); data parallelism beside it, ep on the stages'
    MoE layers (builtin or transformers', e.g. Mixtral split at its ``base_model_pp_plan``),
    and tp from a ``tp_plan`` of the user's (each stage its part: ``tp_plans.stage_plan``).
    ``Plan.apply`` runs pp beside DDP, ZeRO-1, FSDP2, HSDP (without tp) and tp with FSDP2.
    """

    gpus: int
    """Ranks in all (one per GPU)."""
    gpus_per_node: int | None = None
    """GPUs per node (None: all on one node). Sets the HSDP mesh's shape check and, later, which
    links collectives cross."""
    fsdp: int = 1
    """Ranks that shard parameters, gradients and optimizer states (FSDP2 ``fully_shard``)."""
    tp: int = 1
    """Tensor-parallel degree (must divide the attention heads)."""
    pp: int = 1
    """Pipeline stages (at most the number of layers)."""
    ep: int = 1
    """Expert-parallel degree (MoE): each rank keeps ``num_experts / ep`` experts and exchanges
    tokens with the others by all-to-all."""
    sp: bool = False
    """Sequence parallelism with ``tp`` (Megatron-SP, torchtitan's plan): the norms, the
    residual stream and the embedding's output are split along the sequence over the ``tp``
    ranks (their activations are ``1/tp`` of the unsplit ones); the attention and the MLP
    all-gather their input and reduce-scatter their output instead of all-reducing it."""
    loss_parallel: bool = False
    """With ``tp``: the head's logits stay split by vocabulary over the ``tp`` ranks and the
    cross-entropy runs on the shards (torch's ``loss_parallel()``, torchtitan's default), so
    each rank holds ``1/tp`` of the logits and their gradient; False: the head all-gathers
    them."""
    zero: int | None = None
    """ZeRO stage as a name for the data-parallel sharding: 1 = DDP with
    ``ZeroRedundancyOptimizer`` (states sharded); 2 = FSDP2 without resharding after forward
    (``fsdp`` defaults to every data-parallel rank); 3 = FSDP2 with it; None: as ``fsdp`` says."""
    reshard_after_forward: bool | None = None
    """FSDP2: free each block's gathered parameters after its forward (True, default) or keep
    them until its backward (False; more memory, one all-gather less). None: True, except
    ``zero=2``."""
    param_dtype: str | None = None
    """FSDP2 ``MixedPrecisionPolicy.param_dtype``: the dtype parameters are all-gathered and
    computed in (None: their own)."""
    reduce_dtype: str | None = None
    """FSDP2 ``MixedPrecisionPolicy.reduce_dtype``: the dtype gradients are reduced in."""
    cpu_offload: bool = False
    """FSDP2 ``CPUOffloadPolicy``: sharded parameters, gradients and optimizer states on the
    host. A CUDA-target trace reports the device's bytes as its peak and the host's apart
    (``Estimate.host_peak_bytes``); a CPU target has one memory, whose peak is the total (see
    Note: [CPU offload in a trace] in memfit/parallel/rank.py)."""
    bucket_cap_mb: float = 25.0
    """DDP ``bucket_cap_mb``: gradients are all-reduced in flat buckets of about this size."""
    pp_schedule: str = "1f1b"
    """Pipeline schedule (``torch.distributed.pipelining``): ``gpipe`` (every micro-batch's
    forward, then every backward: all micro-batches' activations alive), ``1f1b`` (at most
    ``pp - stage`` micro-batches in flight) or ``interleaved-1f1b`` (two stages per rank)."""
    microbatches: int | None = None
    """Micro-batches per step, each ``batch / microbatches`` rows (None: ``pp``)."""
    pp_split_points: tuple[str, ...] | None = None
    """Where the pipeline splits the model, torchtitan's ``pipeline_parallel_split_points``:
    names of elements of one ``nn.ModuleList`` / ``nn.Sequential`` (e.g. ``("blocks.2",)``),
    each the first module of a stage; one fewer than the stages (``pp``, or ``2 * pp``
    interleaved). None: transformers' ``config.base_model_pp_plan`` where the model has one,
    else memfit's even split of its decoder layers (``memfit/parallel/pipeline_split.py``)."""
    tp_plan: Mapping[str, Any] | None = field(default=None, hash=False)
    """Tensor parallelism's plan: module-name patterns (relative to the model's root, ``fnmatch``
    per dotted part, as ``parallelize_module`` takes them: ``"blocks.*.q"``) to torch
    ``ParallelStyle`` objects (``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``,
    ``PrepareModuleInput`` / ``Output``) or the names of :data:`TP_STYLE_NAMES` (the only form
    a plan file saves). None: the model's own (transformers' ``tp_plan``: the config's
    ``base_model_tp_plan`` and the class's ``_tp_plan``), else memfit's projection names. The
    plan is applied as given: with ``sp`` / ``loss_parallel`` it must hold their styles
    itself, and the model's forward must read its head counts off the local widths (``view(b,
    s, -1, head_dim)``)."""

    def __post_init__(self) -> None:
        for name in ("gpus", "fsdp", "tp", "pp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise MemfitError(f"Parallel({name}={value!r}): must be a positive integer")
        if self.gpus_per_node is not None and (
                not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1
                or self.gpus % self.gpus_per_node):
            raise MemfitError(f"Parallel(gpus_per_node={self.gpus_per_node!r}) must be a positive "
                              f"integer dividing gpus={self.gpus}")
        if self.sp is not False and (self.sp is not True or self.tp == 1):
            raise MemfitError(f"Parallel(sp={self.sp!r}, tp={self.tp}): sequence parallelism "
                              "splits the tensor-parallel ranks' activations; use sp=True with "
                              "tp > 1, or sp=False")
        if self.loss_parallel is not False and (self.loss_parallel is not True or self.tp == 1):
            raise MemfitError(f"Parallel(loss_parallel={self.loss_parallel!r}, tp={self.tp}): "
                              "loss parallelism splits the logits over the tensor-parallel "
                              "ranks; use loss_parallel=True with tp > 1, or False")
        if self.zero not in (None, 1, 2, 3):
            raise MemfitError(f"Parallel(zero={self.zero!r}): valid stages are 1, 2, 3 or None")
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and value not in _DTYPES:
                raise MemfitError(f"Parallel({name}={value!r}){suggest(str(value), _DTYPES)}; "
                                  f"valid: {', '.join(_DTYPES)} or None")
        if self.pp_schedule not in PP_SCHEDULES:
            raise MemfitError(f"Parallel(pp_schedule={self.pp_schedule!r})"
                              f"{suggest(str(self.pp_schedule), PP_SCHEDULES)}; valid: "
                              f"{', '.join(PP_SCHEDULES)}")
        if self.microbatches is not None and (
                not isinstance(self.microbatches, int) or isinstance(self.microbatches, bool)
                or self.microbatches < 1):
            raise MemfitError(f"Parallel(microbatches={self.microbatches!r}): must be a positive "
                              "integer or None (pp micro-batches)")
        if self.pp_split_points is not None:
            self._check_split_points()
        if self.tp_plan is not None:
            _check_tp_plan(self.tp_plan, self.tp)
            object.__setattr__(self, "tp_plan", dict(self.tp_plan))  # the caller's stays theirs
        if self.bucket_cap_mb <= 0:
            raise MemfitError(f"Parallel(bucket_cap_mb={self.bucket_cap_mb!r}) must be > 0")
        model_parallel = self.tp * self.pp
        if self.gpus % model_parallel:
            raise MemfitError(f"Parallel: tp*pp = {self.tp}*{self.pp} = {model_parallel} does not "
                              f"divide gpus={self.gpus}; choose degrees whose product divides it")
        dp = self.gpus // model_parallel
        if self.zero in (2, 3) and self.fsdp == 1:
            object.__setattr__(self, "fsdp", dp)  # ZeRO-2/3 shard over every data-parallel rank
        if self.zero == 1 and self.fsdp > 1:
            raise MemfitError(f"Parallel(zero=1, fsdp={self.fsdp}): ZeRO-1 shards only optimizer "
                              "states (DDP + ZeroRedundancyOptimizer); drop fsdp or use zero=2/3")
        if self.zero == 2 and self.reshard_after_forward:
            raise MemfitError("Parallel(zero=2, reshard_after_forward=True) is ZeRO-3; use zero=3"
                              " or drop reshard_after_forward")
        if dp % self.fsdp:
            raise MemfitError(f"Parallel: fsdp={self.fsdp} does not divide the {dp} data-parallel "
                              f"ranks (gpus={self.gpus} / (tp*pp)={model_parallel})")
        if (dp * self.tp) % self.ep:  # the ranks ep borrows from (torchtitan's dp_shard * tp)
            ranks = (f"{dp} data-parallel ranks (gpus={self.gpus} / (tp*pp)={model_parallel})"
                     if self.tp == 1 else f"{dp * self.tp} data- and tensor-parallel ranks "
                     f"(gpus={self.gpus} / pp={self.pp})")
            raise MemfitError(f"Parallel: ep={self.ep} does not divide the {ranks}")
        if self.reshard_after_forward is None:
            object.__setattr__(self, "reshard_after_forward", self.zero != 2)
        if (self.cpu_offload or self.param_dtype or self.reduce_dtype) and self.fsdp == 1:
            raise MemfitError("Parallel: param_dtype, reduce_dtype and cpu_offload are FSDP2 "
                              "policies; set fsdp > 1 (or zero=2/3) to use them")

    def _check_split_points(self) -> None:
        """``pp_split_points`` as a tuple of names, one fewer than the stages (one line)."""
        points = self.pp_split_points
        if isinstance(points, str) or not isinstance(points, list | tuple) or not all(
                isinstance(p, str) and p for p in points):
            raise MemfitError(f"Parallel(pp_split_points={points!r}): give a list of module "
                              "names, e.g. pp_split_points=['blocks.2']")
        object.__setattr__(self, "pp_split_points", tuple(points))
        stages = self.pp * (2 if self.pp_schedule == "interleaved-1f1b" else 1)
        if len(points) != stages - 1:
            raise MemfitError(f"Parallel(pp={self.pp}, pp_split_points={list(points)!r}) names "
                              f"{len(points)} split point(s); {stages} stages "
                              f"({self.pp_schedule}) need {stages - 1}")

    @property
    def dp(self) -> int:
        """Data-parallel ranks: ``gpus // (tp * pp)``."""
        return self.gpus // (self.tp * self.pp)

    @property
    def replicate(self) -> int:
        """Replicas among the data-parallel ranks (HSDP's replicate degree): ``dp // fsdp``."""
        return self.dp // self.fsdp

    @property
    def strategy(self) -> str:
        """``fsdp``, ``hsdp``, ``ddp``, ``zero1`` or ``none`` (one rank's data parallelism)."""
        if self.fsdp > 1:
            return "hsdp" if self.replicate > 1 else "fsdp"
        if self.dp == 1:
            return "none"
        return "zero1" if self.zero == 1 else "ddp"

    def describe(self) -> str:
        """One line, e.g. ``fsdp 8 (reshard after forward) x tp 1 x pp 1 on 8 GPUs``."""
        parts = [self.strategy if self.strategy != "none" else "dp 1"]
        if self.fsdp > 1:
            parts[0] += f" {self.fsdp}" + (f"x{self.replicate}" if self.replicate > 1 else "")
            parts[0] += (" (reshard after forward" if self.reshard_after_forward
                         else " (no reshard after forward")
            parts[0] += ", cpu offload)" if self.cpu_offload else ")"
        elif self.dp > 1:
            parts[0] += f" {self.dp}"
        tp_notes = [n for n, on in (("sp", self.sp), ("loss parallel", self.loss_parallel),
                                    ("user plan", self.tp_plan is not None)) if on]
        pp = f"pp {self.pp}" + (f" ({self.pp_schedule}, {self.microbatches or self.pp} "
                                 "micro-batches" + (f", split at {', '.join(self.pp_split_points)}"
                                                    if self.pp_split_points else "") + ")"
                                 if self.pp > 1 else "")
        parts += [f"tp {self.tp}" + (f" ({', '.join(tp_notes)})" if tp_notes else ""),
                  pp] + ([f"ep {self.ep}"] if self.ep > 1 else [])
        return " x ".join(parts) + f" on {self.gpus} GPUs"

    def to_dict(self) -> dict[str, Any]:
        """The layout as a JSON object: every field, as resolved (``fsdp`` and
        ``reshard_after_forward`` as ZeRO-2/3 set them); :meth:`from_dict` reads it back.
        A ``tp_plan`` is saved with its styles' names (and left out when None, as files written
        before it read); a ``ParallelStyle`` object has no name: a one-line error."""
        plan = self.tp_plan
        if plan is not None and any(not isinstance(v, str) for v in plan.values()):
            raise MemfitError("Parallel(tp_plan=...) with ParallelStyle objects cannot be saved; "
                              f"name the styles as strings ({', '.join(TP_STYLE_NAMES)})")
        data = asdict(dataclasses_replace(self, tp_plan=None))
        del data["tp_plan"]
        if plan is not None:
            data["tp_plan"] = dict(plan)
        return data

    @classmethod
    def from_dict(cls, data: Any, where: str = "parallel") -> Parallel:
        """The layout a :meth:`to_dict` object names; an unknown field or a bad value is a
        one-line MemfitError."""
        if not isinstance(data, dict):
            raise MemfitError(f"{where}: a parallel layout must be a JSON object, got "
                              f"{type(data).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise MemfitError(f"{where}: unknown parallel field(s) {', '.join(unknown)}; valid: "
                              f"{', '.join(known)}")
        if "gpus" not in data:
            raise MemfitError(f"{where}: a parallel layout needs gpus (the ranks in all)")
        return cls(**data)

    def check_model(self, *, heads: int | None, layers: int | None,
                    kv_heads: int | None = None) -> None:
        """One-line errors for degrees the model cannot take (:func:`check_degrees`); the
        trace's ``ColwiseParallel`` splits the key/value projections, so ``tp`` must divide the
        KV heads too (no replication)."""
        check_degrees(self.tp, self.pp, heads=heads, kv_heads=kv_heads, layers=layers,
                      tp_name=f"Parallel(tp={self.tp})", pp_name=f"Parallel(pp={self.pp})",
                      owner="the model's", kv_replicated=False)


def _check_tp_plan(plan: Any, tp: int) -> None:
    """One-line errors for a ``tp_plan`` that is not a mapping of names to styles (the style
    objects are checked where they are applied: this module imports no torch)."""
    if tp == 1:
        raise MemfitError("Parallel(tp_plan=...) splits modules over the tensor-parallel ranks; "
                          "set tp > 1, or drop tp_plan")
    if not isinstance(plan, Mapping) or not plan:
        raise MemfitError(f"Parallel(tp_plan={plan!r}): must be a non-empty dict of module-name "
                          "patterns to styles, e.g. {'blocks.*.q': 'colwise'}")
    valid = TP_STYLE_NAMES + tuple(TP_STYLE_ALIASES)
    for name, style in plan.items():
        if not isinstance(name, str) or not name:
            raise MemfitError(f"Parallel(tp_plan=...): {name!r} is not a module-name pattern; "
                              "use names like 'blocks.*.q'")
        if isinstance(style, str) and style not in valid:
            raise MemfitError(f"Parallel(tp_plan=...): {name!r}: unknown style {style!r}"
                              f"{suggest(style, valid)}; valid: {', '.join(TP_STYLE_NAMES)} "
                              "(or a torch ParallelStyle)")


def check_degrees(tp: int, pp: int, *, heads: int | None, kv_heads: int | None,
                  layers: int | None, tp_name: str, pp_name: str, owner: str,
                  kv_replicated: bool) -> None:
    """The layout checks the plan (``--tp``, ``--pp``) and the trace (``Parallel``) share: ``tp``
    divides the attention heads, and the KV heads (or, where the engine replicates KV heads, as
    Megatron does, is a multiple of them); ``pp`` is at most the layers. One line each."""
    if heads is not None and heads % tp:
        raise MemfitError(f"{tp_name} does not divide {owner} {heads} attention heads; choose a "
                          f"tp that divides {heads}")
    if kv_heads is not None and kv_heads % tp and not (kv_replicated and tp % kv_heads == 0):
        more = " or is a multiple of" if kv_replicated else ""
        raise MemfitError(f"{tp_name} does not divide {owner} {kv_heads} KV heads; choose a tp "
                          f"that divides{more} {kv_heads}")
    if layers is not None and pp > layers:
        raise MemfitError(f"{pp_name} is more stages than {owner} {layers} layers; use pp <= "
                          f"{layers}")
