"""Mixed and low precision training: one object that gives the training loop what it needs.

>>> mp = apply_precision(model, "fp16-mixed")          # or bf16-mixed, bf16, fp8, fp32
>>> opt = mp.wrap_optimizer(torch.optim.AdamW(model.parameters()))
>>> for batch in data:
...     with mp.autocast():
...         loss = model(**batch)
...     mp.backward(loss)                               # scaled for fp16-mixed
...     mp.step(opt)                                    # unscale, skip on inf/nan, update scale
...     opt.zero_grad(set_to_none=True)

What each precision does to memory (per parameter ``P``, activations ``A``):

- ``"bf16-mixed"`` / ``"fp16-mixed"``: ``torch.autocast`` around forward and loss. Parameters,
  gradients and optimizer states stay fp32; matmul inputs saved for backward are bf16/fp16
  (activations roughly halve) and autocast keeps a low-precision copy of each weight used in the
  forward (+2 bytes/param until the forward's graph is freed). ``fp16-mixed`` adds dynamic loss
  scaling (``torch.amp.GradScaler``): fp16's 5-bit exponent underflows small gradients otherwise.
- ``"bf16"``: the model itself is cast to bf16 (weights, gradients and optimizer states at 2 bytes
  each). bf16 has 8 mantissa bits: an update smaller than 2**-8 of a weight is lost. With
  ``master_weights=True`` the optimizer keeps fp32 copies (:class:`MasterWeights`): +4 bytes/param
  for the copy, states in fp32, and a transient fp32 gradient during ``step``.
- ``"fp8"``: torchao's float8 training (``convert_to_float8_training``) swaps ``nn.Linear`` for
  float8 linears (matmuls in fp8 with dynamic scaling) under bf16 autocast. CUDA only, compute
  capability >= 8.9 (Ada, Hopper, Blackwell); ``pip install 'memfit[fp8]'`` (torchao).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memfit import vocab
from memfit.dtypes import torch_dtype
from memfit.errors import MemfitError

__all__ = ["PRECISIONS", "MasterWeights", "MixedPrecision", "apply_precision"]

log = logging.getLogger("memfit")

PRECISIONS = vocab.names("precision", "apply")
FP8_MIN_CAPABILITY = (8, 9)  # float8 tensor-core matmuls (torch._scaled_mm): Ada and newer


class MasterWeights(torch.optim.Optimizer):
    """Wraps an optimizer built over low-precision (bf16) parameters so that it updates fp32
    copies of them ("master weights") and writes the rounded result back after each step.

    The fp32 copies are made at the first :meth:`step` (so the wrapper can be built before the
    model is on its device); the optimizer's states are then fp32 too. During ``step`` each
    parameter's gradient is upcast to fp32 and freed right after the update.

    Known limitations: ``closure`` is passed to the inner optimizer but the gradients it computes
    are not upcast; loading a state dict before the first step is not supported (step once).
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        # Not calling Optimizer.__init__: the groups and state are the inner optimizer's.
        self.optimizer = optimizer
        self.defaults = optimizer.defaults
        self.params: list[nn.Parameter] = [p for g in optimizer.param_groups
                                           for p in g["params"]]
        self.masters: list[torch.Tensor] | None = None
        self._optimizer_step_pre_hooks: dict[int, Any] = {}
        self._optimizer_step_post_hooks: dict[int, Any] = {}

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.optimizer.state

    def _make_masters(self) -> list[torch.Tensor]:
        masters: dict[int, torch.Tensor] = {}
        for group in self.optimizer.param_groups:
            new = []
            for p in group["params"]:
                if id(p) not in masters:
                    masters[id(p)] = p.detach().to(torch.float32).requires_grad_(
                        p.requires_grad)
                new.append(masters[id(p)])
            group["params"] = new
        return [masters[id(p)] for p in self.params]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        if self.masters is None:
            self.masters = self._make_masters()
        for p, m in zip(self.params, self.masters, strict=True):
            m.grad = None if p.grad is None else p.grad.to(torch.float32)
        result = self.optimizer.step(closure)
        for p, m in zip(self.params, self.masters, strict=True):
            if m.grad is not None:
                p.copy_(m)
                m.grad = None
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.masters is None:
            raise MemfitError("MasterWeights.load_state_dict before the first step is not "
                              "supported; call step() once (or load into the inner optimizer)")
        self.optimizer.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"MasterWeights({self.optimizer!r})"


@dataclass
class MixedPrecision:
    """The training-loop side of a precision: autocast, (scaled) backward and optimizer step.

    Known limitations: one ``GradScaler`` per object (one per model/optimizer pair); the fp8
    path keeps torchao's defaults (dynamic tensorwise scaling, all ``nn.Linear`` converted
    except those whose dimensions are not multiples of 16).
    """

    precision: str
    """One of :data:`PRECISIONS`."""
    device_type: str
    """``"cuda"`` or ``"cpu"``: where autocast and the scaler run."""
    master_weights: bool = False
    """For ``"bf16"``: :meth:`wrap_optimizer` returns a :class:`MasterWeights` optimizer."""
    scaler: Any = field(default=None)
    """``torch.amp.GradScaler`` for ``"fp16-mixed"``; ``None`` otherwise."""

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        fmt = vocab.precision(self.precision).autocast
        return torch_dtype(fmt) if fmt else None

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """Wrap the forward and the loss (not the backward, not the optimizer step)."""
        dtype = self.autocast_dtype
        if dtype is None:
            yield
            return
        with torch.autocast(self.device_type, dtype=dtype):
            yield

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, scaled by the current loss scale for ``fp16-mixed``."""
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale gradients in place before clipping them (fp16-mixed); otherwise nothing."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step the optimizer; for ``fp16-mixed`` skip it when a gradient is inf/nan and update
        the loss scale (halve on overflow, double after ``growth_interval`` clean steps).
        Returns whether the parameters were updated."""
        if self.scaler is None:
            optimizer.step()
            return True
        scale = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        return not self.scaler.get_scale() < scale

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer to use: :class:`MasterWeights` around it for ``bf16`` with
        ``master_weights=True``, else itself."""
        if self.precision == "bf16" and self.master_weights:
            return MasterWeights(optimizer)
        return optimizer


def _device_type(model: nn.Module, device_type: str | None) -> str:
    if device_type is not None:
        if device_type not in ("cuda", "cpu"):
            raise MemfitError(f"device_type must be 'cuda' or 'cpu', got {device_type!r}")
        return device_type
    for p in model.parameters():
        if p.device.type in ("cuda", "cpu"):
            return p.device.type
    return "cuda" if torch.cuda.is_available() else "cpu"


def _check_fp8(device_type: str) -> Any:
    if device_type != "cuda" or not torch.cuda.is_available():
        raise MemfitError("fp8 training needs a CUDA GPU with compute capability >= 8.9 (Ada, "
                          "Hopper, Blackwell), not the CPU; use precision='bf16-mixed'")
    capability = torch.cuda.get_device_capability()
    if capability < FP8_MIN_CAPABILITY:
        raise MemfitError(f"fp8 training needs compute capability >= 8.9; this GPU "
                          f"({torch.cuda.get_device_name()}) has {capability[0]}.{capability[1]}; "
                          "use precision='bf16-mixed' (or 'fp16-mixed' before 8.0)")
    try:
        from memfit._noise import quiet_imports

        with quiet_imports():
            from torchao.float8 import convert_to_float8_training
    except ImportError:
        raise MemfitError("fp8 training needs torchao: pip install 'memfit[fp8]' (or "
                          "pip install torchao)") from None
    return convert_to_float8_training


def _fp8_filter(module: nn.Module, _fqn: str) -> bool:
    # torch._scaled_mm needs both matmul dimensions divisible by 16.
    return (isinstance(module, nn.Linear) and module.in_features % 16 == 0
            and module.out_features % 16 == 0)


def apply_precision(model: nn.Module, precision: str = "bf16-mixed", *,
                    master_weights: bool = False, device_type: str | None = None,
                    init_scale: float = 2.0**16) -> MixedPrecision:
    """Prepare ``model`` for ``precision`` (in place for ``bf16`` and ``fp8``) and return the
    :class:`MixedPrecision` the training loop uses.

    ``device_type`` defaults to the model's device. ``init_scale``: the first loss scale of
    ``fp16-mixed`` (GradScaler's default).

    >>> mp = apply_precision(model, "bf16", master_weights=True)
    >>> opt = mp.wrap_optimizer(torch.optim.AdamW(model.parameters()))
    """
    vocab.check("precision", precision, "apply")
    spec = vocab.precision(precision)
    if master_weights and spec.params == "fp32":
        raise MemfitError(f"master_weights=True only applies to precision='bf16' (the "
                          f"parameters of {precision!r} are already fp32)")
    device = _device_type(model, device_type)
    if device == "cuda" and spec.needs == "bf16" and torch.cuda.is_available() \
            and not torch.cuda.is_bf16_supported():
        raise MemfitError(f"{precision} needs a GPU with bf16 (compute capability 8.0, "
                          "Ampere or newer); use precision='fp16-mixed' on V100/T4")
    scaler = None
    if spec.grad_scaler:
        scaler = torch.amp.GradScaler(device, init_scale=init_scale)
    elif spec.params != "fp32":
        model.to(torch_dtype(spec.params))
    elif spec.matmul == "fp8":  # torchao float8 linears
        convert = _check_fp8(device)
        convert(model, module_filter_fn=_fp8_filter)
    log.info("memfit: precision %s%s", precision,
             " with fp32 master weights" if master_weights else "")
    return MixedPrecision(precision=precision, device_type=device,
                          master_weights=master_weights, scaler=scaler)
