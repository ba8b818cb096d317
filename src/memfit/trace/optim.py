"""Optimizers by name, built on the traced (fake) parameters the way a user would build them.

On a CUDA target the named torch optimizers use ``foreach=True`` (what torch picks by default for
CUDA parameters: its choice cannot be left to torch here because fake parameters are not plain
``torch.Tensor``, or are CPU stand-ins on a CPU-only build); on a CPU target torch's own default
(the for-loop implementation) is kept.

Optimizers torch does not ship are emulated with the same state memory:
- ``lion``: one momentum buffer per parameter (the update is sign-based, no second moment).
- ``adamw-8bit``: bitsandbytes-style 8-bit blockwise states: two uint8 states per parameter
  (2 bytes/param) plus one fp32 absmax per 256-element block per state; the update is computed
  through a dequantized fp32 copy of one parameter at a time (the temporary bitsandbytes' kernels
  keep in registers is not counted on CUDA). On a CPU target with bitsandbytes installed,
  bitsandbytes' own ``AdamW8bit`` runs instead (its CPU step's temporaries are then counted).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable
from typing import Any

import torch

from memfit import vocab
from memfit.errors import MemfitError, suggest

OptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]

_BLOCK_8BIT = 256


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023): one momentum buffer per parameter."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-4,
                 betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                exp_avg = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                update = exp_avg.mul(beta1).add_(p.grad, alpha=1 - beta1).sign_()
                p.add_(update, alpha=-group["lr"])
                exp_avg.mul_(beta2).add_(p.grad, alpha=1 - beta2)


class AdamW8bit(torch.optim.Optimizer):
    """Memory model of a blockwise 8-bit AdamW (bitsandbytes ``AdamW8bit``): see the module."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    blocks = -(-p.numel() // _BLOCK_8BIT)
                    state["state1"] = torch.zeros(p.shape, dtype=torch.uint8, device=p.device)
                    state["state2"] = torch.zeros(p.shape, dtype=torch.uint8, device=p.device)
                    state["absmax1"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
                    state["absmax2"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
                p.add_(p.grad, alpha=-group["lr"])


def _adamw_8bit(params: list[torch.nn.Parameter], *, cpu_target: bool) -> torch.optim.Optimizer:
    """bitsandbytes' own ``AdamW8bit`` for a CPU target when it is installed (its CPU step makes
    fp32 copies of each parameter's states while it updates it, which the emulation does not
    model); the emulation otherwise, and for CUDA, where the update is one fused kernel."""
    if cpu_target and importlib.util.find_spec("bitsandbytes") is not None:
        from memfit._noise import quiet_import

        bitsandbytes = quiet_import("bitsandbytes")
        return bitsandbytes.optim.AdamW8bit(params, lr=1e-3)  # type: ignore[no-any-return]
    return AdamW8bit(params)


def _torch_optimizer(name: str) -> type[torch.optim.Optimizer]:
    cls = getattr(torch.optim, name, None)
    if cls is None:
        raise MemfitError(f"optimizer {name!r} needs a newer torch (it has no torch.optim.{name}); "
                          f"upgrade torch or pass a callable params -> Optimizer")
    return cls  # type: ignore[no-any-return]


def _named(name: str, foreach: bool | None) -> OptimizerFactory:
    kw: dict[str, Any] = {} if foreach is None else {"foreach": foreach}
    table: dict[str, OptimizerFactory] = {
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, **kw),
        "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3, **kw),
        "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-3, **kw),
        "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, **kw),
        "adafactor": lambda ps: _torch_optimizer("Adafactor")(ps, lr=1e-2, **kw),
        "adamw-8bit": lambda ps: _adamw_8bit(ps, cpu_target=foreach is None),
        "lion": lambda ps: Lion(ps),
    }
    try:
        return table[name]
    except KeyError:
        raise MemfitError(
            f"unknown optimizer {name!r}{suggest(name, table)}; valid: {', '.join(table)}, "
            f"None (inference) or a callable params -> torch.optim.Optimizer") from None


OPTIMIZERS = vocab.names("optimizer", "trace")


def make_optimizer(spec: str | OptimizerFactory, params: list[torch.nn.Parameter], *,
                   cuda_target: bool) -> torch.optim.Optimizer:
    """Build the optimizer ``spec`` names (or that the callable makes) over ``params``."""
    if callable(spec):
        opt = spec(params)
        if not isinstance(opt, torch.optim.Optimizer):
            raise MemfitError(f"the optimizer callable returned {type(opt).__name__}, not a "
                              f"torch.optim.Optimizer; return e.g. torch.optim.AdamW(params)")
        if cuda_target:
            _default_as_on_cuda(opt)
        return opt
    if not isinstance(spec, str):
        raise MemfitError(f"optimizer must be a name ({', '.join(OPTIMIZERS)}), None or a "
                          f"callable params -> Optimizer, not {type(spec).__name__}")
    name = spec.lower().replace("_", "-")
    return _named(name, True if cuda_target else None)(params)


def _default_as_on_cuda(opt: torch.optim.Optimizer) -> None:
    """Make a user-built torch optimizer take the implementation torch picks for real CUDA
    parameters.

    Note: [torch's default optimizer implementation on CUDA] A torch optimizer built without
    ``foreach`` / ``fused`` decides at its first step (``torch/optim/optimizer.py:
    _default_to_fused_or_foreach``): foreach when every parameter's ``type`` is in
    ``torch.utils._foreach_utils._foreach_supported_types`` (Tensor, Parameter, DTensor) and its
    device is a foreach device (CUDA), unless ``differentiable``; Adam and AdamW then fall back
    to the for-loop for a tensor ``lr`` without ``capturable`` (``torch/optim/adam.py: adam``).
    The traced parameters are fake tensors (not a supported type; CPU stand-ins on a CPU-only
    build), so torch would pick the for-loop, whose temporaries are one parameter's; foreach's
    ``_foreach_sqrt`` holds one for every parameter at once (AdamW's step peaks at 5x the fp32
    parameters). Found on the first GPU run (H100, torch 2.11): a ViT-B/16 with a user-built
    AdamW measured 5.0x its parameters, traced 4.4x (``bench/results/validate-*-2026-11-27``)."""
    for group in opt.param_groups:
        if "foreach" not in group or group["foreach"] is not None or group.get("fused"):
            continue  # not a foreach-capable torch optimizer, or the user chose
        if group.get("differentiable", False):
            continue
        if isinstance(group.get("lr"), torch.Tensor) and not group.get("capturable", False):
            continue
        group["foreach"] = True
