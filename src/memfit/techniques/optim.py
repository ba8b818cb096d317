"""Optimizers that hold less state or fewer temporaries: 8-bit AdamW, Adafactor, state offload,
and the foreach / fused / for-loop choice made explicit.

Memory per parameter, steady state (fp32 parameters, ``P`` = parameter count):

============================  ==========================  =====================================
optimizer                     state bytes                 step temporaries (extra, at the peak)
============================  ==========================  =====================================
``adamw`` / ``adam``          8 P (exp_avg, exp_avg_sq)   see ``impl`` below
``adamw-8bit``                ~2 P (+ 4 B per 256 values) fp32 copies of one parameter (*)
``adafactor``                 4 B x (rows + cols) per     one parameter's temporaries
                              matrix, 4 P for vectors
``sgd`` (momentum)            4 P (0 without momentum)    see ``impl``
any, ``offload_states=True``  0 on the device (on host)   one host copy of params + grads
============================  ==========================  =====================================

(*) bitsandbytes' CPU step, measured: about 5 fp32 copies of the parameter being updated (21 MB
for a 1024x1024 matrix); its CUDA kernel keeps them in registers. Parameters under 4096 values
keep fp32 states (bitsandbytes' and torchao's ``min_8bit_size``).

``impl`` (torch's three implementations of the same update; the math is the same):

- ``"for-loop"``: one parameter at a time; temporaries are those of the largest parameter.
  Slowest on GPUs (one kernel launch per op per parameter). torch's default on CPU.
- ``"foreach"``: each op runs over the whole parameter list (``torch._foreach_*``): few launches,
  but intermediate results exist for *all* parameters at once, e.g. AdamW's ``sqrt(exp_avg_sq)``
  denominator is a full extra copy of the parameters (4 P bytes in fp32). torch's default on CUDA.
- ``"fused"``: one kernel per parameter group that keeps intermediates in registers: fastest and
  no temporaries. AdamW/Adam/SGD/Adagrad on CUDA (and CPU for AdamW/Adam/SGD/Adagrad since torch
  2.4); not for Adafactor or 8-bit optimizers.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch

from memfit import vocab
from memfit._noise import quiet_import, require
from memfit.errors import MemfitError, suggest
from memfit.trace.host import host_memory
from memfit.trace.optim import OptimizerFactory
from memfit.trace.optim import make_optimizer as trace_optimizer

__all__ = ["IMPLS", "OPTIMIZER_NAMES", "CPUOffloadOptimizer", "constructor_settings",
           "make_optimizer", "state_bytes"]

OPTIMIZER_NAMES = vocab.names("optimizer", "apply")  # torch classes and the two 8-bit Adams
IMPLS = ("foreach", "fused", "for-loop")
BACKENDS_8BIT = ("auto", "bitsandbytes", "torchao")

_TORCH_CLASSES = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD", "adafactor": "Adafactor"}
_FUSED = frozenset({"adamw", "adam", "sgd"})
_DEFAULT_LR = {"sgd": 1e-2, "adafactor": 1e-2}


def _impl_kwargs(name: str, impl: str | None) -> dict[str, Any]:
    if impl is None:
        return {}
    if impl not in IMPLS:
        raise MemfitError(f"unknown impl {impl!r}{suggest(impl, IMPLS)}; valid: "
                          f"{', '.join(IMPLS)} (or None for torch's default)")
    if impl == "fused":
        if name not in _FUSED:
            raise MemfitError(f"optimizer {name!r} has no fused implementation; use "
                              f"impl='foreach' or 'for-loop' (fused: {', '.join(sorted(_FUSED))})")
        return {"fused": True}
    return {"foreach": impl == "foreach"}


def _eight_bit(name: str, params: list[Any], backend: str, kw: dict[str, Any]) -> Any:
    if backend not in BACKENDS_8BIT:
        raise MemfitError(f"unknown 8-bit backend {backend!r}{suggest(backend, BACKENDS_8BIT)}; "
                          f"valid: {', '.join(BACKENDS_8BIT)}")
    cls = "AdamW8bit" if name == "adamw-8bit" else "Adam8bit"
    if backend == "auto":
        # bitsandbytes first: its CPU path runs eagerly, torchao's compiles every step
        # (torch.compile, needs a C++ compiler on CPU).
        for module in ("bitsandbytes", "torchao"):
            try:
                quiet_import(module)
            except ImportError:
                continue
            backend = module
            break
        else:
            raise MemfitError(f"optimizer {name!r} needs bitsandbytes or torchao; run "
                              "pip install 'memfit[bnb]' or pip install 'memfit[quant]'")
    if backend == "bitsandbytes":
        bnb = require("bitsandbytes", "bnb", f"optimizer {name!r}")
        return getattr(bnb.optim, cls)(params, **kw)
    optim = require("torchao.optim", "quant", f"optimizer {name!r}")
    return getattr(optim, cls)(params, **kw)


def make_optimizer(params: Iterable[Any], name: str = "adamw", *, impl: str | None = None,
                   offload_states: bool = False, backend_8bit: str = "auto",
                   **kw: Any) -> torch.optim.Optimizer:
    """Build optimizer ``name`` over ``params`` with an explicit implementation.

    ``name``: one of :data:`OPTIMIZER_NAMES`. ``impl``: ``"foreach"``, ``"fused"``,
    ``"for-loop"`` or ``None`` (torch's default: foreach on CUDA, for-loop on CPU); see the module
    docstring for the memory each costs. ``offload_states=True`` keeps the optimizer (states and
    its step) on the host: :class:`CPUOffloadOptimizer`. ``backend_8bit`` picks bitsandbytes or
    torchao for the 8-bit optimizers (``"auto"``: whichever is installed, bitsandbytes first).
    Other keywords (``lr``, ``betas``, ``weight_decay``...) go to the optimizer; ``lr`` defaults
    to 1e-3 (1e-2 for sgd and adafactor).

    >>> opt = make_optimizer(model.parameters(), "adamw", impl="fused", lr=3e-4)
    """
    if not isinstance(name, str):
        raise MemfitError(f"optimizer name must be a string, not {type(name).__name__}")
    key = name.lower().replace("_", "-")
    if key not in OPTIMIZER_NAMES:
        raise MemfitError(f"unknown optimizer {name!r}{suggest(key, OPTIMIZER_NAMES)}; valid: "
                          f"{', '.join(OPTIMIZER_NAMES)}")
    params = list(params)
    if any(isinstance(p, dict) for p in params):
        raise MemfitError("make_optimizer takes a flat iterable of parameters, not parameter "
                          "groups; build per-group optimizers with torch.optim directly")
    if not params:
        raise MemfitError("the optimizer got no parameters; pass model.parameters() (with at "
                          "least one parameter that requires grad)")
    kw.setdefault("lr", _DEFAULT_LR.get(key, 1e-3))
    if offload_states:
        def inner(host_params: list[Any]) -> torch.optim.Optimizer:
            return make_optimizer(host_params, key, impl=impl, backend_8bit=backend_8bit, **kw)
        return CPUOffloadOptimizer(params, inner)
    if key.endswith("-8bit"):
        if impl is not None:
            raise MemfitError(f"optimizer {name!r} has one implementation; leave impl unset")
        return _eight_bit(key, params, backend_8bit, kw)  # type: ignore[no-any-return]
    cls = getattr(torch.optim, _TORCH_CLASSES[key], None)
    if cls is None:
        raise MemfitError(f"optimizer {name!r} needs torch >= 2.5 (torch.optim.Adafactor); "
                          "upgrade torch or use 'adamw-8bit'")
    return cls(params, **_impl_kwargs(key, impl), **kw)  # type: ignore[no-any-return]


class CPUOffloadOptimizer(torch.optim.Optimizer):
    """Keep an optimizer's states, and run its step, on the host; the device holds only the
    parameters and their gradients.

    Each step copies the gradients device -> host (into pinned buffers on CUDA), steps the inner
    optimizer over host copies of the parameters, and copies the parameters back. The update is
    the inner optimizer's, on the same dtypes, so with parameters already on the CPU the result
    is bit-identical to the plain optimizer (tested); on CUDA it is the CPU kernel's arithmetic.
    Device memory saved: the whole optimizer state (8 bytes/param for AdamW in fp32). Cost: one
    host copy of params + grads, and two transfers of the parameters per step.

    Known limitations: single device (no DTensor/FSDP); the transfers are synchronous (torchao's
    ``CPUOffloadOptimizer`` overlaps them with backward, on CUDA only); ``zero_grad`` always sets
    gradients to ``None``.

    >>> opt = CPUOffloadOptimizer(model.parameters(), lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    """

    def __init__(self, params: Iterable[Any],
                 optimizer_factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
                 *, host: str | torch.device = "cpu") -> None:
        # Deliberately no super().__init__: param_groups and state are the inner optimizer's
        # (the pattern of torchao's CPUOffloadOptimizer), so LR schedulers and state_dict work.
        self.device_params = [p for p in params if p.requires_grad]
        if not self.device_params:
            raise MemfitError("CPUOffloadOptimizer got no parameter that requires grad")
        self.host = torch.device(host)
        pin = torch.cuda.is_available() and any(p.is_cuda for p in self.device_params)
        self.host_params: list[torch.Tensor] = []
        # host_memory(): what is made here is host memory, also in a trace of a CUDA target
        with host_memory():
            for p in self.device_params:
                hp = torch.empty_like(p, device=self.host, pin_memory=pin)
                hp.copy_(p.detach())
                hp.requires_grad_(True)
                self.host_params.append(hp)
            self.inner = optimizer_factory(self.host_params)
        self._pin = pin
        self.defaults = self.inner.defaults
        self._optimizer_step_pre_hooks: dict[int, Any] = {}
        self._optimizer_step_post_hooks: dict[int, Any] = {}

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.inner.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.inner.state

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for p, hp in zip(self.device_params, self.host_params, strict=True):
            if p.grad is None:
                hp.grad = None
                continue
            if hp.grad is None:
                with host_memory():
                    hp.grad = torch.empty_like(hp, pin_memory=self._pin)
            hp.grad.copy_(p.grad, non_blocking=self._pin)
        if self._pin:
            torch.cuda.synchronize()
        with host_memory():  # the states and the step's temporaries
            self.inner.step()
        for p, hp in zip(self.device_params, self.host_params, strict=True):
            if hp.grad is not None:
                p.copy_(hp, non_blocking=self._pin)
        if self._pin:
            torch.cuda.synchronize()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.device_params:
            p.grad = None
        # the host gradients stay allocated (pinned buffers are costly to re-create)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"CPUOffloadOptimizer({self.inner!r})"


def constructor_settings(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.defaults`` restricted to what its class's constructor takes, to build another
    optimizer like it: some record extra keys (torch's AdamW stores ``decoupled_weight_decay``,
    which ``AdamW()`` rejects)."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    return {k: v for k, v in optimizer.defaults.items() if takes_any or k in accepted}


def state_bytes(optimizer: torch.optim.Optimizer, *, device: str | None = None) -> int:
    """Bytes of the optimizer's state tensors (counted by storage; tensor subclasses such as
    torchao's 8-bit states by their inner tensors), optionally only those on ``device`` type.

    >>> state_bytes(torch.optim.AdamW([torch.nn.Parameter(torch.ones(4))]))
    0
    """
    seen: dict[int, int] = {}

    def visit(t: torch.Tensor) -> None:
        flatten = getattr(t, "__tensor_flatten__", None)
        if flatten is not None and type(t) is not torch.Tensor and \
                type(t) is not torch.nn.Parameter:
            for attr in flatten()[0]:
                visit(getattr(t, attr))
            return
        if device is not None and t.device.type != device:
            return
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()

    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                visit(v)
    return sum(seen.values())


def offloaded(name: str) -> OptimizerFactory:
    """The optimizer ``name`` with its states and step on the host, as
    ``memfit.techniques.make_optimizer(..., offload_states=True)`` runs it: a
    ``CPUOffloadOptimizer`` whose inner optimizer is torch's CPU implementation."""
    def factory(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return CPUOffloadOptimizer(
            params, lambda host: trace_optimizer(name, host, cuda_target=False))
    factory.__name__ = f"{name}+offload"
    return factory
