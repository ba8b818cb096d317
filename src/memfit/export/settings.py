"""The settings a plan chose, read from either kind of plan, in one shape every exporter reads.

Two plans carry training settings:

- a fit plan (``memfit fit --save plan.json`` / ``--json``, :class:`memfit.fitting.Plan`, JSON
  ``"format": "memfit-plan/1"``): the chosen configuration;
- an analytic or traced plan (``memfit plan ... --json``): its ``"run"`` object.

The layout is read into one :class:`memfit.Parallel` (:attr:`PlanSettings.parallel`): a fit
plan's is ``Plan.parallel``; a ``memfit plan`` run names it in a nested ``"parallel"`` object
(:meth:`Parallel.to_dict`), and plan files written before the layout was one type name its
sizes flat (``gpus``, ``dp``, ``tp``, ``pp``, ``ep``, ``fsdp``, ``zero``, ``replicate``, ...)
or nested in those names; all are read. A field this
module does not know is kept in :attr:`PlanSettings.unknown`, and every export reports it as a
setting it did not carry (never dropped silently).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from memfit.errors import MemfitError
from memfit.layout import Parallel
from memfit.recipe import Recipe

__all__ = ["PlanSettings", "settings_from_dict", "settings_from_plan"]

FIT_FORMAT = "memfit-plan/1"

GPUS_PER_NODE = 8
"""GPUs per node when a plan names none (the launchers' node count)."""

# Keys of a fit plan's chosen config / an analytic plan's run that carry nothing an exporter
# writes (bookkeeping, or a detail of a key read elsewhere).
_BOOKKEEPING = {"checkpoint_budget_bytes", "checkpoint_modes", "seq", "lora_targets",
                "kv_cache_dtype", "new_tokens"}


@dataclass(frozen=True, kw_only=True)
class PlanSettings:
    """Everything an exporter needs from a plan: the :class:`memfit.Recipe` it chose
    (:attr:`recipe`, which the exporters read) and what is the plan's own (where it came from,
    its mode, the engine it names, the device, the fields nobody reads). Sizes are per run;
    ``dp * tp * pp == gpus``.

    Known limitations: a plan names no learning rate, scheduler, model or dataset; the exports
    carry only what the plan chose.
    """

    source: str
    """``fit`` (memfit fit) or ``plan`` (memfit plan --json, analytic or traced)."""
    recipe: Recipe = field(default_factory=Recipe)
    """What the plan chose (precision, optimizer, checkpointing, micro-batch and accumulation,
    offload and its target, attention, chunked loss, LoRA, weight quantization) and its
    layout (``recipe.parallel``; None: one GPU). Validated there (one place)."""
    mode: str = "train"
    """train, lora or qlora."""
    engine: str | None = None
    """The engine the plan names (fsdp2, deepspeed, megatron, ddp, or another name a plan file
    carries: reported, not refused), or None (not named)."""
    device: str = "cuda"
    """Where the plan trains: ``cuda`` (GPUs), or ``cpu`` (``memfit fit --device cpu``): the
    exports then target the CPU (Lightning ``accelerator: cpu``, Accelerate ``use_cpu``, ...)."""
    unknown: dict[str, Any] = field(default_factory=dict)
    """Plan fields this exporter does not understand (reported by every export)."""

    @property
    def parallel(self) -> Parallel:
        """The layout (:class:`memfit.Parallel`, the house's one layout type):
        ``recipe.parallel``, or one GPU when the recipe names none. The exporters read its
        ``gpus``, ``dp``, ``tp``, ``pp``, ``ep``, ``sp`` and, through :attr:`zero`,
        :attr:`replicate`, :attr:`shard`, :attr:`nodes`, its sharding and nodes."""
        return self.recipe.parallel or _ONE_GPU

    @property
    def zero(self) -> int:
        """ZeRO stage over the data-parallel ranks, 0-3 (3 = parameters sharded: ZeRO-3 or
        FSDP): ``parallel.zero``, or 3 for an FSDP2 layout that names none (``fsdp > 1``)."""
        return self.parallel.zero or (3 if self.parallel.fsdp > 1 else 0)

    @property
    def replicate(self) -> int:
        """HSDP: replicas of the sharded group (``dp = replicate * shard``); 1 without HSDP."""
        return self.parallel.replicate if self.parallel.strategy == "hsdp" else 1

    @property
    def shard(self) -> int:
        """Ranks each sharded group spans (``dp`` without HSDP)."""
        return self.parallel.dp // self.replicate

    @property
    def gpus_per_node(self) -> int:
        """GPUs per node: ``parallel.gpus_per_node``, or :data:`GPUS_PER_NODE` when the plan
        names none."""
        return self.parallel.gpus_per_node or GPUS_PER_NODE

    @property
    def global_batch(self) -> int:
        return self.recipe.global_batch_per_rank * self.parallel.dp

    @property
    def nodes(self) -> int:
        return math.ceil(self.parallel.gpus / self.gpus_per_node)

    def __post_init__(self) -> None:
        if not isinstance(self.recipe, Recipe):
            raise MemfitError(f"plan: recipe must be a memfit.Recipe, got "
                              f"{type(self.recipe).__name__}")
        if self.recipe.offload_params and self.zero != 3:
            raise MemfitError(f"plan: parameter offload needs ZeRO-3/FSDP, but the plan has "
                              f"ZeRO-{self.zero}; re-plan with --zero 3 or without "
                              "--offload-params")
        if self.replicate > 1 and self.zero != 3:
            raise MemfitError("plan: HSDP replicas need sharded parameters (ZeRO-3/FSDP)")
        if self.device not in ("cuda", "cpu"):
            raise MemfitError(f"plan: device must be cuda or cpu, got {self.device!r}")
        if self.mode not in ("train", "lora", "qlora"):
            raise MemfitError(f"plan: mode {self.mode!r} trains nothing; export takes a "
                              "training plan (memfit plan --mode train|lora|qlora, or memfit fit)")


_ONE_GPU = Parallel(gpus=1)


def plan_recipe(where: str, **fields: Any) -> Recipe:
    """A :class:`memfit.Recipe` of a plan's fields, its one-line errors naming ``where``."""
    try:
        return Recipe(**fields)
    except MemfitError as exc:
        raise MemfitError(f"{where}: {str(exc).removeprefix(Recipe.where + ': ')}") from None


# -- reading ----------------------------------------------------------------------------------

_SHARDING = {"none": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3, "fsdp2": 3, "hsdp": 3}


def _int(data: dict[str, Any], key: str, default: int, where: str) -> int:
    value = data.pop(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise MemfitError(f"{where}: {key} must be an integer, got {value!r}")
    return value


def _bool(data: dict[str, Any], key: str, where: str) -> bool:
    value = data.pop(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise MemfitError(f"{where}: {key} must be true or false, got {value!r}")
    return value


_PARALLEL_OWN = ("loss_parallel", "pp_schedule", "microbatches", "reshard_after_forward",
                 "param_dtype", "reduce_dtype", "cpu_offload", "bucket_cap_mb")
"""``Parallel``'s fields that the exporters' flat vocabulary has no name for (read from a
nested :meth:`Parallel.to_dict` object)."""


def _layout(data: dict[str, Any], where: str) -> tuple[Parallel, str | None]:
    """The :class:`Parallel` a plan's scale-out fields name, and the engine it names (None:
    not named), consumed from ``data``.

    The fields are flat (``gpus``, ``dp``, ``tp``, ``pp``, ``ep``, ``fsdp``, ``zero``,
    ``sharding``, ``replicate``, ``sequence_parallel``, ``gpus_per_node``: plan files written
    before the layout was one type) or under ``"parallel"`` (:meth:`Parallel.to_dict`, or the
    same flat names)."""
    nested = data.pop("parallel", None)
    if nested is not None:
        if not isinstance(nested, dict):
            raise MemfitError(f"{where}: parallel must be a JSON object")
        # A size given both inside and beside "parallel" must agree, except a default of 1
        # beside it (RunConfig's tp=1, pp=1 next to a parallel layout).
        clash = sorted(k for k in set(nested) & set(data)
                       if data[k] != nested[k] and data[k] not in (None, 1, 0, False))
        if clash:
            raise MemfitError(f"{where}: {', '.join(clash)} differ inside and beside "
                              "\"parallel\"; keep one")
        data.update(nested)
    gpus = _int(data, "gpus", 1, where)
    tp, pp, ep = (_int(data, key, 1, where) for key in ("tp", "pp", "ep"))
    per_node = data.pop("gpus_per_node", None)
    if per_node is not None and (isinstance(per_node, bool) or not isinstance(per_node, int)):
        raise MemfitError(f"{where}: gpus_per_node must be an integer, got {per_node!r}")
    sp = _bool(data, "sequence_parallel", where) | _bool(data, "sp", where)
    own = {key: data.pop(key) for key in _PARALLEL_OWN if key in data}
    zero = data.pop("zero", None)
    sharding = data.pop("sharding", None)
    fsdp = data.pop("fsdp", None)
    replicate = _int(data, "replicate", 1, where)
    dp = data.pop("dp", None)
    engine = data.pop("engine", None)
    stage = 0
    if sharding is not None:
        if sharding not in _SHARDING:
            raise MemfitError(f"{where}: sharding {sharding!r} is not one of "
                              f"{', '.join(_SHARDING)}")
        stage = _SHARDING[sharding]
    if zero is not None:
        if isinstance(zero, bool) or zero not in (0, 1, 2, 3):
            raise MemfitError(f"{where}: zero must be a ZeRO stage 0-3, got {zero!r}")
        if sharding is not None and stage not in (0, zero):
            raise MemfitError(f"{where}: sharding {sharding!r} conflicts with zero {zero}")
        stage = max(stage, zero)
    fsdp_size = None
    if fsdp is True or (not isinstance(fsdp, bool) and fsdp not in (None, 0, 1)):
        # fsdp: true (shard over every data-parallel rank) or the shard-group size (HSDP when
        # smaller than dp); with zero 2, Parallel's ZeRO-2 (FSDP2 without resharding).
        if stage not in (0, 3) and not (stage == 2 and fsdp is not True):
            raise MemfitError(f"{where}: fsdp shards parameters (ZeRO-3); it conflicts with "
                              f"zero {stage}")
        stage = stage or 3
        engine = engine if engine is not None else "fsdp2"
        fsdp_size = None if fsdp is True else fsdp
    if engine is not None and not isinstance(engine, str):
        raise MemfitError(f"{where}: engine must be a name, got {engine!r}")
    if tp * pp < 1 or gpus % (tp * pp):
        raise MemfitError(f"plan: {gpus} GPUs do not split into tp {tp} x pp {pp}; the GPU "
                          "count must be a multiple of tp*pp")
    dp_ranks = gpus // (tp * pp)
    if dp is not None:
        if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
            raise MemfitError(f"{where}: dp must be a positive integer, got {dp!r}")
        if dp * tp * pp != gpus:
            raise MemfitError(f"{where}: dp {dp} x tp {tp} x pp {pp} = {dp * tp * pp}, but the "
                              f"plan has {gpus} GPUs")
    if fsdp_size is not None:
        if isinstance(fsdp_size, bool) or not isinstance(fsdp_size, int) or fsdp_size < 1:
            raise MemfitError(f"{where}: fsdp must be true or a shard-group size")
        if dp_ranks % fsdp_size:
            raise MemfitError(f"{where}: fsdp {fsdp_size} must divide the data-parallel "
                              f"ranks (gpus {gpus} / (tp {tp} x pp {pp}))")
        if replicate not in (1, dp_ranks // fsdp_size):
            raise MemfitError(f"{where}: replicate {replicate} x fsdp {fsdp_size} != "
                              f"{dp_ranks} data-parallel ranks")
    elif replicate > 1:
        if stage != 3:
            raise MemfitError("plan: HSDP replicas need sharded parameters (ZeRO-3/FSDP)")
        if dp_ranks % replicate:
            raise MemfitError(f"plan: {dp_ranks} data-parallel ranks do not split into "
                              f"{replicate} HSDP replicas")
        fsdp_size = dp_ranks // replicate
    try:
        layout = Parallel(gpus=gpus, gpus_per_node=per_node, tp=tp, pp=pp, ep=ep,
                          sp=sp and tp > 1, zero=stage or None,
                          fsdp=fsdp_size if stage in (2, 3) and fsdp_size else 1, **own)
    except (MemfitError, TypeError) as exc:
        raise MemfitError(f"{where}: {exc}") from None
    return layout, engine


def settings_from_plan(plan: Any) -> PlanSettings:
    """The settings of a :class:`memfit.fitting.Plan` (``memfit fit``)."""
    return settings_from_dict(plan.to_dict(), source="plan")


def settings_from_dict(data: Any, source: str = "plan file") -> PlanSettings:
    """The settings of a plan's JSON (a fit plan or ``memfit plan --json``). Anything else is
    a one-line MemfitError."""
    if not isinstance(data, dict):
        raise MemfitError(f"{source}: not a memfit plan (a JSON object); write one with "
                          "memfit fit --save plan.json or memfit plan ... --json > plan.json")
    if data.get("format") == FIT_FORMAT:
        return _from_fit(data, source)
    if isinstance(data.get("run"), dict) and "per_gpu" in data:
        return _from_run(data, source)
    fmt = data.get("format")
    what = f"format {fmt!r}" if fmt is not None else "no \"format\" and no \"run\""
    raise MemfitError(f"{source}: not a memfit plan ({what}); write one with memfit fit --save "
                      f"plan.json (format {FIT_FORMAT}) or memfit plan ... --json > plan.json")


def _from_fit(data: dict[str, Any], source: str) -> PlanSettings:
    from memfit.fitting.plan import Plan

    plan = Plan.from_dict(data, source=source)  # validates the whole file
    where = f"{source}: chosen config"
    config = plan.config.to_dict()
    for key in _BOOKKEEPING:
        config.pop(key, None)
    config.pop("sharding")
    config.pop("parallel", None)  # plan.parallel is the layout, sharding and all
    chosen = {
        "precision": config.pop("precision"), "checkpointing": config.pop("checkpointing"),
        "checkpoint_modes": plan.config.checkpoint_modes,
        "micro_batch": config.pop("micro_batch"), "accumulation": config.pop("accumulation"),
        "optimizer": config.pop("optimizer"), "offload_states": config.pop("offload_states"),
        "offload_activations": config.pop("offload_activations"),
        "chunked_loss": config.pop("chunked_loss"), "attention": config.pop("attention"),
        "offload_params": _bool(config, "offload_params", where),
        "offload_gradients": _bool(config, "offload_gradients", where),
        "offload_to": config.pop("offload_to", None) or "cpu",
    }
    # "cuda:0" trains on GPUs as "cuda" does; anything else that is not the CPU (a plan made
    # for another accelerator) is exported for GPUs too.
    device = "cpu" if plan.device.split(":")[0] == "cpu" else "cuda"
    settings = PlanSettings(source="fit", recipe=plan_recipe(where, **chosen,
                                                             parallel=plan.parallel),
                            device=device,
                            unknown={k: v for k, v in config.items() if v not in (None, False)})
    if settings.global_batch != plan.global_batch:
        raise MemfitError(f"{source}: micro-batch {settings.recipe.micro_batch} x accumulation "
                          f"{settings.recipe.accumulation} x {settings.parallel.dp} data-parallel "
                          f"ranks = "
                          f"{settings.global_batch}, but the plan's global batch is "
                          f"{plan.global_batch}; re-create it with memfit fit --save")
    return settings


def _from_run(data: dict[str, Any], source: str) -> PlanSettings:
    where = f"{source}: run"
    run = dict(data["run"])
    for key in _BOOKKEEPING:
        run.pop(key, None)
    if run.get("sparsity") == "none":  # dense weights: nothing to carry (2:4 stays unknown)
        run.pop("sparsity")
    layout, engine = _layout(run, where)
    offload_to = run.pop("offload_to", None)  # RunConfig's name for the offload device
    try:
        mode = run.pop("mode", "train")
        chosen = {
            "precision": run.pop("precision"), "checkpointing": run.pop("checkpointing"),
            "micro_batch": _int(run, "batch", 1, where),
            "accumulation": _int(run, "grad_accum", 1, where),
            "optimizer": run.pop("optimizer", "adamw"),
            "attention": run.pop("attention", "sdpa"),
            "offload_states": _bool(run, "offload_optimizer", where),
            "offload_params": _bool(run, "offload_params", where),
            "offload_gradients": _bool(run, "offload_gradients", where),
            "offload_activations": _bool(run, "offload_activations", where),
            "offload_to": run.pop("offload_device", None) or offload_to or "cpu",
            "chunked_loss": _bool(run, "chunked_loss", where),
            "weight_quant": run.pop("weight_quant", "none") or "none",
        }
    except KeyError as exc:
        raise MemfitError(f"{where}: missing {exc.args[0]!r}; re-create the plan with memfit "
                          "plan ... --json") from None
    rank = run.pop("lora_rank", None)
    if not isinstance(mode, str):
        raise MemfitError(f"{where}: mode must be a name, got {mode!r}")
    if mode in ("lora", "qlora"):
        chosen["lora_rank"] = rank
        chosen["qlora"] = mode == "qlora" and rank is not None
    for name in ("precision", "checkpointing", "optimizer", "attention"):
        if not isinstance(chosen[name], str):
            raise MemfitError(f"{where}: {name} must be a name, got {chosen[name]!r}")
    return PlanSettings(source="plan", mode=mode,
                        recipe=plan_recipe(where, **chosen, parallel=layout), engine=engine,
                        unknown={k: v for k, v in run.items() if v not in (None, False)})
