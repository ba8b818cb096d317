"""Inference quantization through torchao: weight-only int8 / int4 post-training quantization,
and quantization-aware training (QAT) prepare / convert.

Weight bytes per ``out x in`` linear layer (fp32 before: ``4*in*out``):

- ``int8`` (``Int8WeightOnlyConfig``, per output channel, symmetric): ``in*out`` int8 values + one
  fp32 scale and one int8 zero point per output row: ~1.0 B/weight, 4x smaller than fp32.
  CPU and CUDA.
- ``int4`` (``Int4WeightOnlyConfig``, groups of ``group_size`` along ``in``, tinygemm packing):
  0.5 B/weight + a bf16 scale and zero point per group: ~0.56 B/weight at group 128, 7x
  smaller than fp32 (3.6x than bf16). torchao's int4 weight-only kernels are CUDA-only (the
  packed format needs bf16 weights on a CUDA device; the plain format needs the ``mslk``
  package), so on CPU this raises with the alternatives.

Activations are not quantized by weight-only schemes: the matmul dequantizes (or runs a mixed
int x float kernel), so outputs differ from fp32 by the weight rounding only.

QAT (:func:`prepare_qat` then :func:`convert_qat`) trains with fake-quantized weights (and, for
``int8-dynact-int4-weight``, fake-quantized int8 activations) in float, then converts to the
real quantized layers, which compute the same values the fake-quantized model did.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memfit._noise import require
from memfit.errors import MemfitError, suggest

__all__ = ["QAT_SCHEMES", "WEIGHT_ONLY_DTYPES", "convert_qat", "prepare_qat",
           "quantize_weights", "tensor_bytes", "weight_bytes"]

log = logging.getLogger("memfit")

WEIGHT_ONLY_DTYPES = ("int8", "int4")
QAT_SCHEMES = ("int8-dynact-int4-weight", "int4-weight")

FilterFn = Callable[[nn.Module, str], bool]


def _torchao(module: str = "torchao.quantization") -> Any:
    return require(module, "quant", "quantization")


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds; tensor subclasses (torchao's quantized tensors, NF4) by their inner
    tensors, recursively.

    >>> tensor_bytes(torch.zeros(4, 4, dtype=torch.int8))
    16
    """
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is not None and type(t) not in (torch.Tensor, nn.Parameter):
        names, _ = flatten()
        return sum(tensor_bytes(getattr(t, name)) for name in names)
    return t.untyped_storage().nbytes()


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers (each counted once), quantized or not."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            total += tensor_bytes(t)
    return total


def _filter_kwargs(filter_fn: FilterFn | None) -> dict[str, Any]:
    """torchao's own default (every linear layer, incl. its fake-quantized ones) unless given."""
    return {} if filter_fn is None else {"filter_fn": filter_fn}


def _check_group(group_size: int) -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1 or \
            group_size & (group_size - 1):
        raise MemfitError(f"group_size must be a power of two (32, 64, 128, 256), got "
                          f"{group_size!r}")


def _int4_config(ao: Any, model: nn.Module, group_size: int) -> Any:
    weights = [m.weight for m in model.modules() if isinstance(m, nn.Linear)]
    if not weights or any(w.device.type != "cuda" for w in weights):
        raise MemfitError(
            "int4 weight-only quantization needs the model on a CUDA GPU (torchao's int4 kernels "
            "are CUDA-only); on CPU use dtype='int8' (4x smaller than fp32), or QAT's "
            "'int4-weight' scheme (int4 values, stored unpacked in int8 on CPU)")
    if any(w.dtype != torch.bfloat16 for w in weights):
        raise MemfitError("int4 weight-only quantization needs bf16 weights; call "
                          "model.to(torch.bfloat16) first")
    kwargs: dict[str, Any] = {"group_size": group_size}
    if "int4_packing_format" in inspect.signature(ao.Int4WeightOnlyConfig).parameters:
        kwargs["int4_packing_format"] = "tile_packed_to_4d"  # tinygemm; "plain" needs mslk
    return ao.Int4WeightOnlyConfig(**kwargs)


def quantize_weights(model: nn.Module, dtype: str = "int8", *, group_size: int = 128,
                     filter_fn: FilterFn | None = None) -> nn.Module:
    """Quantize the weights of ``model``'s linear layers in place (torchao ``quantize_``) for
    inference, and return the model.

    ``dtype``: ``"int8"`` (CPU and CUDA) or ``"int4"`` (CUDA, bf16 weights; ``group_size``
    weights share a scale). ``filter_fn(module, fqn)`` picks the layers (default: every
    ``nn.Linear``).

    >>> model = quantize_weights(model.eval(), "int8")
    """
    if dtype not in WEIGHT_ONLY_DTYPES:
        raise MemfitError(f"unknown weight-only dtype {dtype!r}"
                          f"{suggest(dtype, WEIGHT_ONLY_DTYPES)}; valid: "
                          f"{', '.join(WEIGHT_ONLY_DTYPES)}")
    _check_group(group_size)
    ao = _torchao()
    before = weight_bytes(model)
    config = ao.Int8WeightOnlyConfig() if dtype == "int8" else _int4_config(ao, model, group_size)
    ao.quantize_(model, config, **_filter_kwargs(filter_fn))
    log.info("memfit: %s weight-only quantization: weights %d -> %d bytes", dtype, before,
             weight_bytes(model))
    return model


def _qat_base_config(scheme: str, group_size: int) -> Any:
    if scheme not in QAT_SCHEMES:
        raise MemfitError(f"unknown QAT scheme {scheme!r}{suggest(scheme, QAT_SCHEMES)}; "
                          f"valid: {', '.join(QAT_SCHEMES)}")
    _check_group(group_size)
    ao = _torchao()
    granularity = _torchao("torchao.quantization.granularity").PerGroup(group_size)
    if scheme == "int8-dynact-int4-weight":
        return ao.Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4,  # type: ignore[attr-defined]
                                                        weight_granularity=granularity)
    return ao.IntxWeightOnlyConfig(weight_dtype=torch.int4,  # type: ignore[attr-defined]
                                   granularity=granularity)


def _qat(model: nn.Module, scheme: str, group_size: int, step: str,
         filter_fn: FilterFn | None) -> nn.Module:
    base = _qat_base_config(scheme, group_size)
    qat = _torchao("torchao.quantization.qat")
    if not hasattr(qat, "QATConfig"):
        raise MemfitError("QAT needs torchao >= 0.13 (torchao.quantization.qat.QATConfig); run "
                          "pip install -U 'memfit[quant]'")
    _torchao().quantize_(model, qat.QATConfig(base, step=step), **_filter_kwargs(filter_fn))
    log.info("memfit: QAT %s (%s, group %d)", step, scheme, group_size)
    return model


def prepare_qat(model: nn.Module, scheme: str = "int8-dynact-int4-weight", *,
                group_size: int = 32, filter_fn: FilterFn | None = None) -> nn.Module:
    """Swap ``model``'s linear layers for fake-quantized ones (in place) to fine-tune with the
    quantization error in the loop; then :func:`convert_qat` with the same arguments.

    ``scheme``: ``"int8-dynact-int4-weight"`` (int8 dynamic per-token activations, int4
    per-group weights) or ``"int4-weight"`` (int4 per-group weights only).

    >>> model = prepare_qat(model); train(model); model = convert_qat(model)
    """
    return _qat(model, scheme, group_size, "prepare", filter_fn)


def convert_qat(model: nn.Module, scheme: str = "int8-dynact-int4-weight", *,
                group_size: int = 32, filter_fn: FilterFn | None = None) -> nn.Module:
    """Replace the fake-quantized layers :func:`prepare_qat` made with real quantized ones (in
    place). On CPU the int4 values are stored one per int8 byte (torchao's unpacked format)."""
    return _qat(model, scheme, group_size, "convert", filter_fn)
