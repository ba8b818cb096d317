"""The fit search's request checks and its space: what :func:`memfit.fitting.fit` is asked for
(checked once, up front), and the technique dimensions it searches by default."""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from torch import nn

from memfit._loss import LossFn, check_loss_fn, check_reduction
from memfit._tensors import meta_copy, tensor_leaves
from memfit.errors import MemfitError, suggest
from memfit.fitting.config import CHECKPOINTING, PRECISIONS, SHARDING
from memfit.fitting.layouts import check_gpus
from memfit.fitting.plan import Rejected
from memfit.gpus import GpuSpec, get_gpu
from memfit.trace.estimate import TRACE_FITS_MARGIN

__all__ = ["SPACE_KEYS", "attention_choices", "check_request", "check_space", "default_space",
           "divisors", "leading", "seq_of", "uses_eager_attention"]

SPACE_KEYS = ("precision", "checkpointing", "micro_batch", "optimizer", "offload_states",
              "offload_activations", "chunked_loss", "attention", "sharding", "tp", "pp")
_EIGHT_BIT = {"adamw": "adamw-8bit", "adam": "adamw-8bit"}


def check_request(model: nn.Module, *, global_batch: int, gpu: str | GpuSpec | None,
                  budget_bytes: int | None, device: str, loss_fn: LossFn | None, reduction: str,
                  num_gpus: int, measure: bool, headroom: float | None, gpus: int | None,
                  gpus_per_node: int | None) -> tuple[GpuSpec | None, int, float]:
    """Check a :func:`memfit.fitting.fit` request (one line saying what is wrong and the fix);
    returns the GPU, the GPUs in all (``gpus`` when given) and the headroom (its default
    filled in)."""
    if gpus is not None or gpus_per_node is not None:
        if num_gpus != 1 and gpus is not None:
            raise MemfitError("give gpus= (layouts searched) or num_gpus= (ZeRO only), not "
                              "both")
        if gpus is None:
            raise MemfitError("gpus_per_node needs gpus=N (the GPUs in all)")
        check_gpus(gpus, gpus_per_node)
        if measure and gpus > 1:
            raise MemfitError("measure=True times steps on this one device; with gpus > 1 "
                              "drop measure (time the plan under torchrun instead)")
        num_gpus = gpus
    if not isinstance(model, nn.Module):
        raise MemfitError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    check_loss_fn(loss_fn)
    check_reduction(reduction)
    if device not in ("cuda", "cpu", "mps"):
        raise MemfitError(f"device must be 'cuda', 'mps' or 'cpu', got {device!r}")
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) \
            or global_batch < 1:
        raise MemfitError(f"global_batch must be a positive integer, got {global_batch!r}")
    if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 1:
        raise MemfitError(f"num_gpus must be a positive integer, got {num_gpus!r}")
    if global_batch % num_gpus and gpus is None:
        raise MemfitError(f"global_batch {global_batch} is not divisible by num_gpus "
                          f"{num_gpus}; pick a multiple")
    spec = get_gpu(gpu) if isinstance(gpu, str) else gpu
    if device == "cpu" and spec is not None:
        raise MemfitError("device='cpu' takes budget_bytes, not gpu=; drop gpu or use "
                          "device='cuda'")
    if spec is not None and (spec.target == "mps") != (device == "mps") and device != "cpu":
        raise MemfitError(f"{spec.label} is {'' if spec.target == 'mps' else 'not '}Apple "
                          f"silicon: use device={'mps' if spec.target == 'mps' else 'cuda'!r}")
    if budget_bytes is not None and (isinstance(budget_bytes, bool)
                                     or not isinstance(budget_bytes, int)
                                     or budget_bytes <= 0):
        raise MemfitError(f"budget_bytes must be a positive integer, got {budget_bytes!r}")
    if spec is None and budget_bytes is None:
        raise MemfitError("give a budget: gpu='a100-40gb' (see `memfit gpus`) or "
                          "budget_bytes=...")
    if headroom is None:
        headroom = 0.05 if device == "cpu" else TRACE_FITS_MARGIN
    if isinstance(headroom, bool) or not isinstance(headroom, int | float) \
            or not 0 <= headroom < 1:
        raise MemfitError(f"headroom must be a fraction in [0, 1), got {headroom!r}")
    return spec, num_gpus, headroom


def leading(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            raise MemfitError("sample_batch tensors need a batch dimension first")
        return int(batch.shape[0])
    values = list(batch.values()) if isinstance(batch, dict) else batch
    if isinstance(values, list | tuple):
        for v in values:
            if isinstance(v, torch.Tensor | dict | list | tuple):
                return leading(v)
    raise MemfitError(f"sample_batch must be a tensor or a tuple/list/dict of tensors, not "
                      f"{type(batch).__name__}")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_space(space: dict[str, Any] | None,
                defaults: dict[str, list[Any]]) -> dict[str, list[Any]]:
    out = dict(defaults)
    for key, values in (space or {}).items():
        if key not in SPACE_KEYS:
            raise MemfitError(f"unknown search-space key {key!r}{suggest(key, SPACE_KEYS)}; "
                              f"valid: {', '.join(SPACE_KEYS)}")
        if not isinstance(values, list | tuple) or not values:
            raise MemfitError(f"space[{key!r}] must be a non-empty list of values")
        out[key] = list(values)
    return out


def seq_of(batch: Any) -> int | None:
    """The sequence length of a sample batch: its first tensor's second dimension."""
    leaves = [t for t in tensor_leaves(batch) if t.dim() >= 2]
    return int(leaves[0].shape[1]) if leaves else None


def uses_eager_attention(model: nn.Module) -> bool:
    """Whether ``model`` runs eager attention that :func:`use_sdpa` can switch (Hugging Face
    models by their config, memfit's builtin models by their attention modules)."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "_attn_implementation"):
        return config._attn_implementation == "eager"
    from memfit.models.builtin_layers import Attention

    return any(isinstance(m, Attention) and m.eager for m in model.modules())


def attention_choices(base: nn.Module, rejected: list[Rejected]) -> list[str]:
    """``["model"]``, plus ``"sdpa"`` when the model runs eager attention and can be switched
    (SDPA never keeps the s x s scores, so it is searched, not assumed)."""
    if not uses_eager_attention(base):
        return ["model"]
    from memfit.techniques import use_sdpa

    try:
        use_sdpa(meta_copy(base))
    except MemfitError as exc:
        rejected.append(Rejected(what="attention sdpa", reason=str(exc)))
        return ["model"]
    return ["model", "sdpa"]


def default_space(base: nn.Module, optimizer: str, device: str, spec: GpuSpec | None,
                   num_gpus: int, per_gpu: int, rejected: list[Rejected]) -> dict[str, list[Any]]:
    from memfit.models.anatomy import find_blocks

    if device == "cpu":
        precisions = ["fp32", "bf16-mixed"]
    else:
        # Pure bf16 changes the math (updates under 2**-8 of a weight are lost), so it is
        # searched only when asked for: space={"precision": [..., "bf16"]}.
        precisions = [p for p in PRECISIONS
                      if p != "bf16" and (spec is None or spec.supports(p))]
        rejected.extend(Rejected(what=f"precision {p}", reason=f"{spec.name} has no {p}")
                        for p in PRECISIONS if p not in precisions and p != "bf16"
                        and spec is not None)
        rejected.append(Rejected(what="precision bf16 (pure)", reason=(
            "not searched by default: bf16 weights lose updates under 2**-8 of a weight; pass "
            "space={'precision': ['bf16-mixed', 'bf16']} to include it")))
    # torchtitan's policy sits between selective and full; searched when asked for (one more
    # trace per combination): space={"checkpointing": [..., "torchtitan"]}
    ckpts = [c for c in CHECKPOINTING if c != "torchtitan"]
    try:
        find_blocks(base)
    except MemfitError as exc:
        ckpts = ["none"]
        rejected.append(Rejected(what="activation checkpointing", reason=str(exc)))
    optimizers = [optimizer]
    eight = _EIGHT_BIT.get(optimizer)
    if eight and device == "cuda":
        if importlib.util.find_spec("bitsandbytes") or importlib.util.find_spec("torchao"):
            optimizers.append(eight)
        else:
            rejected.append(Rejected(what=eight, reason="needs bitsandbytes or torchao: pip "
                                     "install 'memfit[bnb]' or pip install 'memfit[quant]'"))
    chunked = [False]
    try:
        from memfit.techniques import apply_chunked_loss

        apply_chunked_loss(meta_copy(base))
        chunked.append(True)
    except MemfitError as exc:
        rejected.append(Rejected(what="chunked loss", reason=str(exc)))
    return {"precision": precisions, "checkpointing": ckpts,
            "micro_batch": divisors(per_gpu), "optimizer": optimizers,
            "offload_states": [False, True] if device == "cuda" else [False],
            "offload_activations": [False, True] if device == "cuda" else [False],
            "chunked_loss": chunked, "attention": attention_choices(base, rejected),
            "sharding": list(SHARDING) if num_gpus > 1 else ["none"]}
