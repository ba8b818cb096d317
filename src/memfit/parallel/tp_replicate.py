"""Tensor parallelism's other parameters: what a plan leaves plain becomes a replicated DTensor
on the mesh, with hooks so that no op mixes plain tensors and DTensors
(:func:`replicate_the_rest`, used by ``memfit.parallel.apply.apply_tp``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def is_norm(module: nn.Module) -> bool:
    """A LayerNorm or an RMS norm (torch's or a model's own class named ``*RMSNorm``)."""
    return isinstance(module, nn.LayerNorm | nn.RMSNorm) or type(module).__name__.endswith(
        "RMSNorm")


def replicate_the_rest(model: nn.Module, mesh: Any, plan: dict[str, Any]) -> None:
    """Every parameter the plan left a plain tensor becomes a replicated DTensor on ``mesh``
    (``distribute_tensor(..., [Replicate()])``), and the modules that hold them take plain
    inputs as replicated DTensors and give plain outputs back, so that no op mixes the two.

    Note: [one kind of parameter] Without sequence parallelism the norms, the embedding and
    (without loss parallelism) the head are not in the plan. Their parameters stayed plain
    tensors beside the projections' DTensors, and the optimizer's foreach kernels, which torch
    picks for CUDA parameters (``torch/optim/optimizer.py: _default_to_fused_or_foreach``;
    DTensor adds itself to ``_foreach_supported_types``), refuse the mix: "aten._foreach_mul_
    got mixed torch.Tensor and DTensor" on every CUDA-target trace of tp without sp. torchtitan
    keeps every parameter on the mesh for the same reason (its ``NoParallel`` style: "to ensure
    all parameters are on the same 1D/2D mesh, which is assumed by ... optimizer fused
    implementation"). A replicated DTensor holds the same local bytes; tied weights stay one
    parameter."""
    from torch.distributed.tensor.parallel import PrepareModuleInput

    # a module the plan only prepares inputs for (sequence parallelism's attention and MLP)
    # keeps its own submodules out of the plan: Qwen3's per-head q_norm / k_norm
    inside = tuple(f"{name}." for name, style in plan.items()
                   if not isinstance(style, PrepareModuleInput))
    # a plan entry naming a parameter (transformers' MoE experts) hands its module to the style
    owners = {name.rpartition(".")[0] for name in plan if "." in name}
    plan = {**plan, **dict.fromkeys(n for n in owners if _holds_param_entry(n, plan, model))}
    made: dict[int, nn.Parameter] = {}

    def replicate_own(module: nn.Module) -> bool:
        return _replicate_own(module, mesh, made)

    planned = [f"{name}." for name in plan]
    whole: tuple[str, ...] = ()  # modules running every parameter below them locally
    for name, module in model.named_modules():
        if name in plan or name.startswith(inside):
            continue
        if whole and name.startswith(whole):  # made replicated; its root runs them locally
            replicate_own(module)
            continue
        leaf_kind = isinstance(module, nn.Linear | nn.Embedding) or is_norm(module)
        if (name and not leaf_kind and next(module.children(), None) is not None
                and not isinstance(module, nn.ModuleList | nn.ModuleDict)  # never called
                and not any(p.startswith(f"{name}.") for p in planned)
                and any(True for _ in module.parameters())):
            # Note: [untouched subtrees] a module the plan touches nowhere (a Mamba mixer, a
            # shared expert) runs every parameter below it locally, so that it can read a
            # child's parameter directly (causal_conv1d_fn(x, self.conv1d.weight)).
            whole += (f"{name}.",)
            replicate_own(module)
            module.register_forward_pre_hook(_local_params(recurse=True))
            module.register_forward_hook(_restore_params)
            continue
        # children no style touches whose parameters the module may read itself
        # (gated-delta-net's causal_conv1d_fn(x, self.conv1d.weight))
        also: tuple[nn.Module, ...] = ()
        if not leaf_kind:
            prefix = f"{name}." if name else ""
            also = tuple(c for n, c in module.named_children()
                         if f"{prefix}{n}" not in plan
                         and not (isinstance(c, nn.Linear | nn.Embedding) or is_norm(c))
                         and not any(p.startswith(f"{prefix}{n}.") for p in planned)
                         and any(True for _ in c.parameters(recurse=False)))
        if not replicate_own(module) and not also:
            continue
        if leaf_kind:
            module.register_forward_pre_hook(_wrap(mesh))
            module.register_forward_hook(_unwrap)
        else:
            # Note: [other modules' own parameters] A module that computes with its own
            # parameters beside plain tensors it makes or gets from submodules (gpt-oss's
            # attention sinks, a MoE's stacked experts indexed by plain routing tensors) runs
            # with the parameters' local tensors, as transformers' LocalParamsParallel does; the
            # gradient reaches the replicated DTensor through to_local's backward.
            module.register_forward_pre_hook(_local_params(recurse=False, also=also))
            module.register_forward_hook(_restore_params)


def _holds_param_entry(module_name: str, plan: dict[str, Any], model: nn.Module) -> bool:
    """Whether some entry of ``plan`` names a parameter of the module ``module_name``."""
    params = dict(model.get_submodule(module_name).named_parameters(recurse=False))
    prefix = f"{module_name}." if module_name else ""
    return any(name.startswith(prefix) and name[len(prefix):] in params for name in plan)


def _wrap(mesh: Any) -> Any:
    """A forward pre-hook: plain tensor inputs as replicated DTensors on ``mesh``."""
    from torch.distributed.tensor import DTensor, Replicate

    def wrap(_module: nn.Module, args: tuple) -> tuple:
        return tuple(DTensor.from_local(a, mesh, [Replicate()], run_check=False)
                     if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) else a
                     for a in args)
    return wrap


def _unwrap(_module: nn.Module, _args: tuple, out: Any) -> Any:
    """A forward hook: DTensor outputs back to plain tensors."""
    from torch.distributed.tensor import DTensor

    if isinstance(out, tuple):  # a router's (logits, weights, indices)
        return tuple(o.to_local() if isinstance(o, DTensor) else o for o in out)
    return out.to_local() if isinstance(out, DTensor) else out


def _local_params(recurse: bool, also: tuple[nn.Module, ...] = ()) -> Any:
    """A forward pre-hook running the module (and ``also``) with its parameters' local tensors
    (:func:`_restore_params` puts the DTensors back)."""
    from torch.distributed.tensor import DTensor

    def hook(module: nn.Module, _args: tuple) -> None:
        held = [(m, k, p) for m in (module.modules() if recurse else (module, *also))
                for k, p in m._parameters.items() if isinstance(p, DTensor)]
        module.__dict__.setdefault("_memfit_replicated", []).append(held)
        for m, k, p in held:
            m._parameters[k] = p.to_local()  # type: ignore[assignment, union-attr]
    return hook


def _restore_params(module: nn.Module, _args: tuple, _out: Any) -> None:
    for m, k, p in module.__dict__["_memfit_replicated"].pop():
        m._parameters[k] = p


def _replicate_own(module: nn.Module, mesh: Any, made: dict[int, nn.Parameter]) -> bool:
    """The module's own plain parameters made replicated DTensors (a tied one once: ``made``);
    whether it had any."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    plain = [(key, p) for key, p in module.named_parameters(recurse=False)
             if not isinstance(p, DTensor)]
    for key, param in plain:
        if id(param) not in made:
            made[id(param)] = nn.Parameter(distribute_tensor(param.data, mesh, [Replicate()]),
                                           requires_grad=param.requires_grad)
        setattr(module, key, made[id(param)])
    return bool(plain)
