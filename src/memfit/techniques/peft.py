"""Parameter-efficient fine-tuning: freeze the base model, train low-rank adapters (LoRA), and
optionally store the frozen base weights in 4 bits (QLoRA).

Memory: a frozen weight has no gradient and no optimizer state, so a LoRA model trains with the
base weights (4 B/param fp32, 2 B/param bf16) plus, per adapted ``in x out`` layer, ``r*(in+out)``
adapter parameters with their gradients and AdamW states (16 B each in fp32). QLoRA stores the
base weights in NF4 (Dettmers et al. 2023): 4 bits per weight plus one absmax scale per 64
weights (bitsandbytes: fp32 absmax, or 8-bit with double quantization; torchao: int8 scalers
with per-256 fp32 factors), about 0.53 B/param instead of 4; each layer's weight is dequantized
for its matmul, one layer at a time. Activations are unchanged (the base layers still need their
inputs for the adapters' and the inputs' gradients).

Backends:

- :func:`apply_lora` uses Hugging Face ``peft`` (``inject_adapter_in_model``, in place, any
  ``nn.Module``) when installed (``backend="auto"``), else memfit's :class:`LoRALinear`. Both
  compute ``base(x) + B(A(dropout(x))) * alpha / r`` with ``B = 0`` at init (peft's default), so
  a fresh adapter leaves the model's outputs bit-identical.
- :func:`apply_qlora` always uses :class:`LoRALinear` over a 4-bit base: bitsandbytes
  ``Linear4bit`` (NF4; runs on CPU with bitsandbytes >= 0.48 and on CUDA) or torchao's
  ``NF4Tensor`` (``to_nf4`` + ``linear_nf4``, the torchtune recipe; CPU and CUDA).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

import torch
from torch import nn

from memfit._noise import quiet_import, require
from memfit.errors import MemfitError, suggest
from memfit.models.anatomy import replace_module

__all__ = ["LORA_BACKENDS", "QUANT_BACKENDS", "LoRALinear", "NF4Linear", "apply_lora",
           "apply_qlora", "default_targets", "trainable_parameters"]

log = logging.getLogger("memfit")

LORA_BACKENDS = ("auto", "peft", "builtin")
QUANT_BACKENDS = ("auto", "bitsandbytes", "torchao")
_EXCLUDED_BY_DEFAULT = ("lm_head",)  # peft's "all-linear" also leaves the output layer alone


class LoRALinear(nn.Module):
    """``base(x) + lora_B(lora_A(dropout(x))) * (alpha / rank)`` over a frozen ``base`` layer.

    ``lora_A`` starts Kaiming-uniform (as ``nn.Linear`` and peft), ``lora_B`` at zero, so the
    layer starts out computing exactly ``base(x)``. The adapters live on the base weight's device
    in ``adapter_dtype`` (default: the base's compute dtype, fp32 for a 4-bit base).

    Known limitations: one adapter per layer; no merging back into a 4-bit base.
    """

    def __init__(self, base: nn.Module, in_features: int, out_features: int, *, rank: int,
                 alpha: float, dropout: float = 0.0, device: torch.device | None = None,
                 adapter_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.base = base
        self.in_features, self.out_features = in_features, out_features
        self.rank, self.scaling = rank, alpha / rank
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.lora_A = nn.Linear(in_features, rank, bias=False, device=device, dtype=adapter_dtype)
        self.lora_B = nn.Linear(rank, out_features, bias=False, device=device,
                                dtype=adapter_dtype)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    @property
    def weight(self) -> torch.Tensor:
        """The base layer's weight, as peft's LoRA layers expose it: model code reads it (t5's
        feed-forward casts to ``wo.weight.dtype``)."""
        weight = self.base.weight
        assert isinstance(weight, torch.Tensor)
        return weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base(x)
        update = self.lora_B(self.lora_A(self.lora_dropout(x.to(self.lora_A.weight.dtype))))
        return result + (update * self.scaling).to(result.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"rank={self.rank}, scaling={self.scaling:g}")


class NF4Linear(nn.Module):
    """A frozen linear layer whose weight is a torchao ``NF4Tensor`` (dequantized per matmul)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        require("torchao", "quant", "QLoRA with quant_backend='torchao'")
        nf4 = None
        # torchao >= 0.15 moved NF4 from torchao.dtypes into the quantization workflows
        for path in ("torchao.quantization.quantize_.workflows.nf4.nf4_tensor",
                     "torchao.dtypes.nf4tensor"):
            try:
                nf4 = quiet_import(path)
                break
            except ImportError:
                continue
        if nf4 is None:
            raise MemfitError("this torchao has no NF4 tensor; run pip install -U "
                              "'memfit[quant]' or use quant_backend='bitsandbytes'")
        self._linear_nf4 = nf4.linear_nf4
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(nf4.to_nf4(linear.weight.detach()), requires_grad=False)
        self.bias = (nn.Parameter(linear.bias.detach(), requires_grad=False)
                     if linear.bias is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self._linear_nf4(x, self.weight)
        return out + self.bias if self.bias is not None else out


def _installed(module: str) -> bool:
    try:
        quiet_import(module)
    except ImportError:
        return False
    return True


def _check(rank: int, alpha: float, dropout: float) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise MemfitError(f"rank must be a positive integer, got {rank!r}; typical: 8-64")
    if not alpha > 0:
        raise MemfitError(f"alpha must be positive, got {alpha!r}; typical: 2 * rank")
    if not 0.0 <= dropout < 1.0:
        raise MemfitError(f"dropout must be in [0, 1), got {dropout!r}")


def _targets(model: nn.Module, targets: str | Iterable[str]) -> list[str]:
    """Dotted names of the ``nn.Linear`` modules to adapt. ``"all-linear"``: every linear layer
    but ``lm_head``; otherwise names matched like peft's ``target_modules`` (the full name, or
    its last components: ``"q_proj"`` or ``"self_attn.q_proj"``)."""
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear) and name}
    if isinstance(targets, str) and targets == "all-linear":
        chosen = [n for n in linears if n.rsplit(".", 1)[-1] not in _EXCLUDED_BY_DEFAULT]
    else:
        wanted = [targets] if isinstance(targets, str) else list(targets)
        if not wanted:
            raise MemfitError("targets is empty; name the linear layers to adapt, e.g. "
                              "targets=('q_proj', 'v_proj'), or targets='all-linear'")
        chosen = [n for n in linears
                  if any(n == t or n.endswith("." + t) for t in wanted)]
        matched = {t for t in wanted for n in chosen if n == t or n.endswith("." + t)}
        missing = [t for t in wanted if t not in matched]
        if missing:
            short = sorted({n.rsplit(".", 1)[-1] for n in linears})
            raise MemfitError(
                f"no nn.Linear named {missing[0]!r} in the model{suggest(missing[0], short)}; "
                f"linear layers: {', '.join(short) or 'none'}")
    if not chosen:
        raise MemfitError("the model has no nn.Linear layer to adapt")
    return chosen


def default_targets(model_type: str) -> tuple[tuple[str, ...], str]:
    """The LoRA targets peft would pick for ``model_type`` and the line saying where they come
    from: its ``TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING`` (what ``LoraConfig()``
    without ``target_modules`` uses, e.g. ``("q", "v")`` for t5), else ``("all-linear",)``:
    every ``nn.Linear`` but the head, where peft names none (it would refuse) or is not
    installed.

    >>> default_targets("t5")  # doctest: +SKIP
    (('q', 'v'), "peft's default target_modules for t5")
    """
    try:
        peft_utils = quiet_import("peft.utils")
    except ImportError:
        return ("all-linear",), "every linear layer but the head (peft is not installed)"
    mapping = getattr(peft_utils, "TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING", {})
    names = mapping.get(model_type)
    if names:
        return tuple(names), f"peft's default target_modules for {model_type}"
    return ("all-linear",), (f"every linear layer but the head: peft "
                             f"{getattr(quiet_import('peft'), '__version__', '')} has no default "
                             f"target_modules for {model_type}")


def _freeze_all_but_lora(model: nn.Module) -> None:
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)


def trainable_parameters(model: nn.Module) -> int:
    """Number of parameters that require grad (counted once if tied)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def apply_lora(model: nn.Module, *, rank: int = 8, alpha: float = 16.0,
               targets: str | Iterable[str] = "all-linear", dropout: float = 0.0,
               backend: str = "auto") -> nn.Module:
    """Freeze ``model`` and add LoRA adapters to its ``targets`` linear layers, in place.

    ``targets``: ``"all-linear"`` (every ``nn.Linear`` except ``lm_head``) or names such as
    ``("q_proj", "v_proj")``. ``backend``: ``"peft"``, ``"builtin"`` (:class:`LoRALinear`) or
    ``"auto"`` (peft when installed). Returns the same model object; only parameters whose name
    contains ``lora_`` require grad afterwards.

    >>> model = apply_lora(model, rank=16, alpha=32, targets=("q_proj", "k_proj", "v_proj"))
    >>> opt = torch.optim.AdamW(p for p in model.parameters() if p.requires_grad)
    """
    _check(rank, alpha, dropout)
    if backend not in LORA_BACKENDS:
        raise MemfitError(f"unknown LoRA backend {backend!r}{suggest(backend, LORA_BACKENDS)}; "
                          f"valid: {', '.join(LORA_BACKENDS)}")
    names = _targets(model, targets)
    if backend == "auto":
        backend = "peft" if _installed("peft") else "builtin"
    if backend == "peft":
        peft = require("peft", "peft", "apply_lora(backend='peft')")
        config = peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout,
                                 target_modules=names)
        model = peft.inject_adapter_in_model(config, model)
    else:
        for name in names:
            linear = model.get_submodule(name)
            assert isinstance(linear, nn.Linear)
            replace_module(model, name, LoRALinear(
                linear, linear.in_features, linear.out_features, rank=rank, alpha=alpha,
                dropout=dropout, device=linear.weight.device, adapter_dtype=linear.weight.dtype))
    _freeze_all_but_lora(model)
    log.info("memfit: LoRA (%s, r=%d) on %d linear layers; %d trainable parameters", backend,
             rank, len(names), trainable_parameters(model))
    return model


def _bnb_4bit(linear: nn.Linear) -> nn.Module:
    bnb = require("bitsandbytes", "bnb", "QLoRA with quant_backend='bitsandbytes'")
    device = linear.weight.device
    layer = bnb.nn.Linear4bit(linear.in_features, linear.out_features,
                              bias=linear.bias is not None, compute_dtype=linear.weight.dtype,
                              quant_type="nf4", device="meta")
    layer.weight = bnb.nn.Params4bit(linear.weight.detach().to("cpu"), requires_grad=False,
                                     quant_type="nf4")
    if linear.bias is not None:
        layer.bias = nn.Parameter(linear.bias.detach().to("cpu"), requires_grad=False)
    return layer.to(device)  # Params4bit quantizes when moved to its device


def apply_qlora(model: nn.Module, *, rank: int = 8, alpha: float = 16.0,
                targets: str | Iterable[str] = "all-linear", dropout: float = 0.0,
                quant_backend: str = "auto") -> nn.Module:
    """Quantize the ``targets`` linear layers' frozen weights to NF4 and add LoRA adapters.

    ``quant_backend``: ``"bitsandbytes"`` (``Linear4bit``), ``"torchao"`` (``NF4Tensor``) or
    ``"auto"`` (bitsandbytes when installed, else torchao). Adapters are fp32 when the base is
    fp32, bf16 when it is bf16. Layers not targeted stay as they are, frozen.

    >>> model = apply_qlora(model.to(torch.bfloat16), rank=16, alpha=32)
    """
    _check(rank, alpha, dropout)
    if quant_backend not in QUANT_BACKENDS:
        raise MemfitError(f"unknown quant_backend {quant_backend!r}"
                          f"{suggest(quant_backend, QUANT_BACKENDS)}; valid: "
                          f"{', '.join(QUANT_BACKENDS)}")
    names = _targets(model, targets)
    if quant_backend == "auto":
        if _installed("bitsandbytes"):
            quant_backend = "bitsandbytes"
        elif _installed("torchao"):
            quant_backend = "torchao"
        else:
            raise MemfitError("QLoRA needs bitsandbytes or torchao for its 4-bit base; run "
                              "pip install 'memfit[bnb]' or pip install 'memfit[quant]'")
    for name in names:
        linear = model.get_submodule(name)
        assert isinstance(linear, nn.Linear)
        if linear.in_features % 64 or linear.weight.numel() % 256:
            raise MemfitError(f"layer {name!r} ({linear.in_features}x{linear.out_features}) "
                              "cannot be stored in NF4 blocks of 64 (scales per 256); leave it "
                              "out of targets")
        base = _bnb_4bit(linear) if quant_backend == "bitsandbytes" else NF4Linear(linear)
        replace_module(model, name, LoRALinear(
            base, linear.in_features, linear.out_features, rank=rank, alpha=alpha,
            dropout=dropout, device=linear.weight.device, adapter_dtype=linear.weight.dtype))
        del linear
    _freeze_all_but_lora(model)
    log.info("memfit: QLoRA (NF4 via %s, r=%d) on %d linear layers; %d trainable parameters",
             quant_backend, rank, len(names), trainable_parameters(model))
    return model
