"""Pipeline stages of any module, split at named submodules (``Parallel(pp_split_points=...)``),
or where transformers' ``config.base_model_pp_plan`` says.

torchtitan splits a model at ``pipeline_parallel_split_points`` (module names): each stage is a
deep copy of the model with the modules outside the stage deleted (``None``, and the layers
outside it removed from the ``ModuleDict``), and the model's forward tolerates that
(``torchtitan/distributed/pipeline_parallel.py: pipeline_module_split``; its Llama's forward:
``h = self.tok_embeddings(tokens) if self.tok_embeddings else tokens``). A custom module's forward
does not check for ``None``, so memfit asks a sequential-ish structure instead:

- the split points name elements of ONE ``nn.ModuleList`` or ``nn.Sequential`` (the
  *container*, e.g. ``blocks`` in ``blocks.2``), each the first element of a stage;
- the forward runs the container's elements in order by iterating it (``for block in
  self.blocks``), and passes one tensor between the stages: the first stage takes the token ids,
  the last returns the logits (a tensor, or an output whose ``.logits`` / first element is one);
- the children registered before the container (on each module on the path to it) run before
  it, on the first stage; those after it run after it, on the last stage. On the other stages
  they are ``nn.Identity`` (an embedding passes the hidden states through, a head its input).
  Children without parameters (rotary embeddings, dropout) stay on every stage.
- No module on the path to the container holds parameters of its own (they would be on every
  stage); wrap them in a submodule.

A stage is :class:`SplitStageModule`: a view of the model holding its own submodules (no copy:
the path's modules are shallow copies whose children are the model's, the container keeps the
stage's elements under their own names, so ``blocks.2.fc1.weight`` keeps its name). Each stage's
input and output shapes come from one forward of a meta copy of the model (no bytes).
The loss on the last stage is the builtin decoder's (next-token cross-entropy on ``labels``,
``memfit.parallel.pipeline.stage_loss``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from memfit.errors import MemfitError, suggest

__all__ = ["SplitStageModule", "check_untied_stages", "pp_plan_points", "split_points",
           "split_stage_modules"]

_EXAMPLE = "e.g. Parallel(pp=2, pp_split_points=['blocks.2'])"


def pp_plan_points(model: nn.Module, num_stages: int) -> tuple[str, ...] | None:
    """Split points from transformers' ``config.base_model_pp_plan`` (the base model's modules
    in forward order, e.g. ``{"embed_tokens": ..., "layers": ..., "norm": ...}``): the plan's
    ``nn.ModuleList`` (``<base_model_prefix>.layers``) split evenly as memfit splits a decoder
    (``memfit.parallel.pipeline.stage_layers``: the embedding and the head count as a layer
    each). None when the model's config has no plan."""
    from memfit.parallel.pipeline import stage_layers

    plan = getattr(getattr(model, "config", None), "base_model_pp_plan", None)
    if not plan:
        return None
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, model) if prefix else model
    for name in plan:
        container = getattr(base, name, None)
        if isinstance(container, nn.ModuleList):
            path = f"{prefix}.{name}" if base is not model else name
            ranges = stage_layers(len(container), num_stages)
            return tuple(f"{path}.{r.start}" for r in ranges[1:])
    return None


def split_points(model: nn.Module, points: tuple[str, ...]) -> tuple[str, list[int]]:
    """The container the ``points`` split and the index of each point in it, or a one-line
    error for a point that is not a submodule, not an element of a ``ModuleList`` /
    ``Sequential``, not in the same one as the others, or out of order."""
    names = dict(model.named_modules())
    container: str | None = None
    indices = []
    for point in points:
        if point not in names or not point:
            elements = [n for n, m in names.items() if n and isinstance(
                names.get(n.rpartition(".")[0] if "." in n else ""), nn.ModuleList | nn.Sequential)]
            raise MemfitError(f"Parallel(pp_split_points): {point!r} is not a submodule of "
                              f"{type(model).__name__}{suggest(point, elements)}; name elements "
                              f"of its ModuleList / Sequential, {_EXAMPLE}")
        parent, _, last = point.rpartition(".")
        holder = names.get(parent)
        if not isinstance(holder, nn.ModuleList | nn.Sequential) or not last.isdigit():
            raise MemfitError(f"Parallel(pp_split_points): {point!r} is not an element of an "
                              "nn.ModuleList or nn.Sequential; memfit splits a model at the "
                              f"elements of one, {_EXAMPLE}")
        if container is not None and parent != container:
            raise MemfitError(f"Parallel(pp_split_points): {point!r} is not in {container!r} "
                              "like the other split points; name elements of one container")
        container = parent
        indices.append(list(holder._modules).index(last))
    if indices != sorted(set(indices)) or (indices and indices[0] == 0):
        raise MemfitError(f"Parallel(pp_split_points={list(points)!r}): give increasing "
                          "elements after the container's first (each starts a stage)")
    assert container is not None
    _check_path(model, container)
    return container, indices


def _check_path(model: nn.Module, container: str) -> None:
    """One-line error for a module on the path to the container with parameters of its own."""
    parts = container.split(".")
    for depth in range(len(parts) + 1):
        name = ".".join(parts[:depth])
        module = model.get_submodule(name)
        own = [n for n, p in module._parameters.items() if p is not None]
        if own:
            where = f"{name}.{own[0]}" if name else own[0]
            raise MemfitError(f"Parallel(pp_split_points): {where} is a parameter of a module "
                              f"on the path to {container!r}, which would sit on every stage; "
                              "move it into a submodule (e.g. an nn.Embedding)")


def _view(module: nn.Module, parts: list[str], keep: range, first: bool, last: bool,
          ) -> nn.Module:
    """A shallow copy of ``module`` whose children are its own, except: on the path to the
    container (``parts``) a view again, siblings before it only on the first stage and after
    it only on the last (``nn.Identity`` elsewhere; parameter-less children everywhere); the
    container keeps the elements ``keep`` under their own names."""
    view = copy.copy(module)
    children = module._modules
    if not parts:  # the container
        names = list(children)
        view._modules = {names[i]: children[names[i]] for i in keep}
        return view
    order = list(children)
    at = order.index(parts[0])
    out: dict[str, nn.Module | None] = {}
    for position, (name, child) in enumerate(children.items()):
        if position == at:
            assert child is not None
            out[name] = _view(child, parts[1:], keep, first, last)
        elif child is None or not any(True for _ in child.parameters()):
            out[name] = child
        else:
            out[name] = child if (first if position < at else last) else nn.Identity()
    view._modules = out
    return view


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are meta tensors (no bytes), to run its
    forward for the shapes of the stages' inputs and outputs."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"),
                                   requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def output_tensor(output: Any) -> torch.Tensor:
    """A stage's output as the one tensor the schedule sends: the tensor itself, else
    ``.logits`` (a transformers ``CausalLMOutput``), else the first element of a tuple."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, list | tuple) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise MemfitError(f"Parallel(pp_split_points): a stage returned {type(output).__name__}; "
                      "the split model's forward must return a tensor (the logits), an output "
                      "with .logits, or a tuple whose first element is the tensor")


class _Shapes:
    """The stages' boundary tensors' (shape, dtype) per micro-batch shape, from one forward of
    the meta copy (hooks on the split points read their inputs)."""

    def __init__(self, model: nn.Module, container: str, indices: list[int]) -> None:
        self.meta = meta_copy(model)
        holder = self.meta.get_submodule(container)
        names = list(holder._modules)
        self.points: list[nn.Module] = [holder.get_submodule(names[i]) for i in indices]
        self.cache: dict[tuple[int, int, Any, Any], list[tuple[torch.Size, torch.dtype]]] = {}

    def boundaries(self, micro: int, seq: int, dtype: torch.dtype | None
                   ) -> list[tuple[torch.Size, torch.dtype]]:
        """The ids', each split point's input's and the output's (shape, dtype), in order."""
        from torch.utils._python_dispatch import _disable_current_modes

        from memfit._compat.transformers_internals import fake_tensors_look_eager
        from memfit.trace.fake_rules import grouped_mm_on_meta

        autocast = next((torch.get_autocast_dtype(d) for d in ("cuda", "cpu")
                         if torch.is_autocast_enabled(d)), None)
        key = (micro, seq, dtype, autocast)
        if key not in self.cache:
            if dtype is not None:
                self.meta.to(dtype)
            seen: list[tuple[torch.Size, torch.dtype]] = []

            def hook(_m: nn.Module, args: tuple) -> None:
                seen.append((args[0].shape, args[0].dtype))

            handles = [m.register_forward_pre_hook(hook) for m in self.points]
            try:  # outside the trace's fake mode and tracker: a meta forward holds no bytes
                # (transformers' masks: shapes only, without the .all() a meta tensor cannot
                # answer: Note: [libraries that detect fake tensors], the other way round;
                # transformers' MoE experts' fp32 grouped matmuls: grouped_mm_on_meta)
                with _disable_current_modes(), torch.no_grad(), fake_tensors_look_eager(True), \
                        grouped_mm_on_meta():
                    ids = torch.zeros(micro, seq, dtype=torch.long, device="meta")
                    out = output_tensor(self.meta(ids))
            finally:
                for h in handles:
                    h.remove()
            self.cache[key] = [(ids.shape, ids.dtype), *seen, (out.shape, out.dtype)]
        return self.cache[key]


class SplitStageModule(nn.Module):
    """One stage of a model split at ``pp_split_points`` (see the module), with the attributes
    the schedule and the data-parallel functions read from ``pipeline.StageModule``: ``index``,
    ``first``, ``last``, ``layers`` (the stage's elements of the container, by their name in
    it). Its forward is the model's own forward on the stage's view of it."""

    def __init__(self, view: nn.Module, container: str, shapes: _Shapes, *, index: int,
                 first: bool, last: bool) -> None:
        super().__init__()
        self.index, self.first, self.last = index, first, last
        self.inner = view
        self.container = container
        self.layers = dict(view.get_submodule(container)._modules)
        self.seq_shards = 1
        self.__dict__["_shapes"] = shapes  # not a submodule: the meta copy holds no stage state

    def block_names(self) -> list[str]:
        """The stage's elements of the container, named inside the stage (FSDP2's blocks)."""
        return [f"inner.{self.container}.{k}" for k in self.layers]

    def io_metas(self, micro: int, seq: int, dtype: torch.dtype | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Meta tensors of this stage's input and output for ``micro`` rows of ``seq`` tokens
        (``dtype``: the floating parameters' compute dtype, FSDP2's ``param_dtype``); the
        floating ones require grad (the gradients the stages send back)."""
        bounds = self.__dict__["_shapes"].boundaries(micro, seq, dtype)
        metas = []
        for shape, dt in (bounds[self.index], bounds[self.index + 1]):
            metas.append(torch.zeros(shape, dtype=dt, device="meta",
                                     requires_grad=dt.is_floating_point))
        return metas[0], metas[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return output_tensor(self.inner(x))


def split_stage_modules(model: nn.Module, points: tuple[str, ...], num_stages: int,
                        indices: list[int]) -> list[SplitStageModule]:
    """The stages ``indices`` of ``model`` split at ``points`` (``num_stages`` in all)."""
    container, starts = split_points(model, points)
    if len(starts) != num_stages - 1:
        raise MemfitError(f"Parallel(pp_split_points={list(points)!r}) makes {len(starts) + 1} "
                          f"stages; the layout runs {num_stages}")
    size = len(model.get_submodule(container)._modules)
    bounds = [0, *starts, size]
    shapes = _Shapes(model, container, starts)
    return [SplitStageModule(_view(model, container.split("."), range(bounds[i], bounds[i + 1]),
                                   i == 0, i == num_stages - 1),
                             container, shapes, index=i, first=i == 0, last=i == num_stages - 1)
            for i in indices]


def check_untied_stages(model: nn.Module, parallel: Any) -> None:
    """One-line error for a parameter that two stages of the split would hold (a head tied to
    the embedding): each stage would train its own copy. Every rank checks every stage, so all
    refuse alike."""
    from memfit.parallel.pipeline import split_of, stages_per_rank

    points = split_of(model, parallel)
    assert points is not None
    num_stages = parallel.pp * stages_per_rank(parallel)
    container, starts = split_points(model, points)
    size = len(model.get_submodule(container)._modules)
    bounds = [0, *starts, size]
    holder: dict[int, int] = {}
    for i in range(num_stages):
        view = _view(model, container.split("."), range(bounds[i], bounds[i + 1]), i == 0,
                     i == num_stages - 1)
        for name, p in view.named_parameters():
            if holder.setdefault(id(p), i) != i:
                raise MemfitError(f"Plan.apply cannot run this pipeline plan: {name} sits on "
                                  f"stages {holder[id(p)]} and {i} (a tied parameter); untie "
                                  "it or use pp=1")
