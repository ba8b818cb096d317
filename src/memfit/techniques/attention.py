"""Attention through PyTorch's ``scaled_dot_product_attention`` (SDPA), with pinned backends.

Eager attention materialises the ``batch x heads x seq x seq`` scores and probabilities and keeps
the probabilities for backward (Korthikanti et al. 2022's ``5as/h`` term per layer). SDPA's fused
kernels (flash attention, memory-efficient attention; on CPU the flash-attention CPU kernel) keep
only the output and one log-sum-exp value per query row, so attention activations go from
O(seq^2) to O(seq) per head. The math is the same softmax(QK^T/sqrt(d))V, rounded differently.

- :func:`use_sdpa` / :func:`set_attn_implementation` switch a model's attention in place:
  Hugging Face models through ``set_attn_implementation`` (transformers 5.x has it) and
  memfit's builtin models (``memfit.models.build``) through their attention modules.
- :func:`sdpa_backends` pins which kernels SDPA may use (``torch.nn.attention.sdpa_kernel``):
  by default flash and memory-efficient only, so a shape or dtype that would silently fall back to
  the O(seq^2) math kernel raises instead ("No available kernel").
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from torch import nn

from memfit.errors import MemfitError, suggest

__all__ = ["ATTN_IMPLEMENTATIONS", "SDPA_BACKENDS", "sdpa_backends", "set_attn_implementation",
           "use_sdpa"]

log = logging.getLogger("memfit")

ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
SDPA_BACKENDS = ("flash", "efficient", "cudnn", "math")
_BACKEND_ENUM = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                 "cudnn": "CUDNN_ATTENTION", "math": "MATH"}


def _is_hf(model: nn.Module) -> bool:
    return hasattr(model, "config") and hasattr(model.config, "_attn_implementation")


def set_attn_implementation(model: nn.Module, implementation: str) -> nn.Module:
    """Switch ``model``'s attention to ``"sdpa"`` or ``"eager"`` in place and return it.

    Hugging Face models: ``model.set_attn_implementation(...)`` (which also checks that the
    model class supports it). memfit's builtin models: every attention module. Anything else
    raises :class:`MemfitError` (write the model with ``F.scaled_dot_product_attention``).

    >>> model = set_attn_implementation(model, "sdpa")
    """
    if implementation not in ATTN_IMPLEMENTATIONS:
        raise MemfitError(f"unknown attention implementation {implementation!r}"
                          f"{suggest(implementation, ATTN_IMPLEMENTATIONS)}; valid: "
                          f"{', '.join(ATTN_IMPLEMENTATIONS)}")
    if _is_hf(model):
        setter = getattr(model, "set_attn_implementation", None)
        if setter is None:
            raise MemfitError(
                "this transformers version cannot switch attention after loading; load the "
                f"model with from_pretrained(..., attn_implementation={implementation!r}) or "
                "upgrade transformers (5.x has model.set_attn_implementation)")
        try:
            setter(implementation)
        except (ValueError, ImportError) as exc:
            raise MemfitError(f"{type(model).__name__} cannot use {implementation!r} attention: "
                              f"{exc}") from None
        log.info("memfit: attention of %s set to %s", type(model).__name__, implementation)
        return model
    from memfit.models.builtin_layers import Attention

    switched = 0
    for module in model.modules():
        if isinstance(module, Attention):
            module.eager = implementation == "eager"
            switched += 1
    if not switched:
        raise MemfitError(
            f"found no attention to switch in {type(model).__name__}: supported are Hugging Face "
            "models and memfit's builtin models; in your own model call "
            "torch.nn.functional.scaled_dot_product_attention(q, k, v) instead of "
            "softmax(q @ k.T) @ v")
    log.info("memfit: %d attention modules set to %s", switched, implementation)
    return model


def use_sdpa(model: nn.Module) -> nn.Module:
    """Switch ``model``'s attention to SDPA in place (see :func:`set_attn_implementation`).

    >>> model = use_sdpa(AutoModelForCausalLM.from_pretrained(name, attn_implementation="eager"))
    """
    return set_attn_implementation(model, "sdpa")


@contextlib.contextmanager
def sdpa_backends(*backends: str) -> Iterator[None]:
    """Let SDPA use only ``backends`` (default: ``"flash", "efficient"``) inside the block.

    Valid names: ``flash``, ``efficient``, ``cudnn``, ``math``. Without ``math`` in the list, an
    input no fused kernel supports (e.g. fp32 on flash-only GPUs, an explicit attention mask
    with flash) raises torch's "No available kernel" instead of silently using the O(seq^2) math
    path. Restores the previous settings on exit.

    >>> with sdpa_backends("flash", "efficient"):
    ...     loss = model(**batch).loss
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names = backends or ("flash", "efficient")
    chosen: list[Any] = []
    for name in names:
        if name not in SDPA_BACKENDS:
            raise MemfitError(f"unknown SDPA backend {name!r}{suggest(name, SDPA_BACKENDS)}; "
                              f"valid: {', '.join(SDPA_BACKENDS)}")
        value = getattr(SDPBackend, _BACKEND_ENUM[name], None)
        if value is None:
            raise MemfitError(f"SDPA backend {name!r} needs a newer torch; upgrade torch or "
                              "leave it out")
        chosen.append(value)
    with sdpa_kernel(chosen):
        yield
