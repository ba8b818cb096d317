"""Chunked cross-entropy: the language-model loss without materialising full fp32 logits.

A causal LM's loss normally builds ``logits = hidden @ W.T`` for every token (``[tokens, vocab]``,
upcast to fp32), then ``log_softmax`` (another ``[tokens, vocab]`` fp32 tensor saved for
backward), then in backward a gradient of the same size: at vocab 128k and 8k tokens that is
4 GiB per copy. :func:`chunked_cross_entropy` takes the hidden states and the LM-head weight
instead and works through ``chunk_size`` tokens at a time; backward recomputes each chunk's logits
from the saved hidden states, so at most one chunk's ``[chunk_size, vocab]`` fp32 logits (and its
softmax, written in place) exist at any time.

>>> loss = chunked_cross_entropy(hidden, model.lm_head.weight, labels, chunk_size=1024)
>>> apply_chunked_loss(model)        # HF-style causal LMs and memfit's builtin decoders

On CUDA, when ``liger_kernel`` is installed, its fused linear cross-entropy Triton kernel is used
instead (``use_liger=None``: automatically; ``False`` never; ``True`` require it).

Exactness: the loss is the same quantity as ``F.cross_entropy(logits.float(), labels)`` but sums
per chunk and then over chunks, and ``W``'s gradient accumulates chunk by chunk, so results differ
from the unchunked loss by float rounding only (fp32: relative 1e-6; the tests state it). With
a single chunk the order of operations is that of the dense computation.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memfit.errors import MemfitError

__all__ = ["apply_chunked_loss", "chunked_cross_entropy"]

log = logging.getLogger("memfit")


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Sum of per-token cross-entropy of ``hidden @ weight.T``; saves only inputs and per-token
    log-sum-exp (``tokens`` fp32 values)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                chunk_size: int, ignore_index: int) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            logits = (hidden[rows] @ weight.t()).float()
            target = labels[rows]
            valid = target != ignore_index
            picked = logits.gather(1, target.clamp(min=0).unsqueeze(1)).squeeze(1)
            # log-sum-exp in place: torch.logsumexp would allocate another chunk-sized buffer.
            peak = logits.amax(dim=-1, keepdim=True)
            lse[rows] = logits.sub_(peak).exp_().sum(dim=-1).log_().add_(peak.squeeze(1))
            total = total + torch.where(valid, lse[rows] - picked, 0.0).sum()
            del logits
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.chunk_size, ctx.ignore_index = chunk_size, ignore_index
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor) -> Any:
        hidden, weight, labels, lse = ctx.saved_tensors
        chunk_size, ignore_index = ctx.chunk_size, ctx.ignore_index
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            h = hidden[rows]
            # d(lse - logit[label]) / d logits = softmax - onehot, per valid token.
            grad = (h @ weight.t()).float()
            grad.sub_(lse[rows].unsqueeze(1)).exp_()
            target = labels[rows]
            valid = target != ignore_index
            grad.scatter_add_(1, target.clamp(min=0).unsqueeze(1),
                              torch.full((h.shape[0], 1), -1.0, device=grad.device))
            grad.mul_((valid.unsqueeze(1) * grad_total).to(grad.dtype))
            if grad_h is not None:
                grad_h[rows] = (grad.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_w is not None:
                grad_w.add_(grad.t() @ h.float())
            del grad
        return (grad_h, grad_w.to(weight.dtype) if grad_w is not None else None,
                None, None, None)


def _liger_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                ignore_index: int, reduction: str) -> torch.Tensor:
    from liger_kernel.transformers.fused_linear_cross_entropy import (
        LigerFusedLinearCrossEntropyLoss,
    )

    loss_fn = LigerFusedLinearCrossEntropyLoss(ignore_index=ignore_index, reduction=reduction)
    return loss_fn(weight, hidden, labels)


def _liger_available() -> bool:
    try:
        import liger_kernel.transformers.fused_linear_cross_entropy  # noqa: F401
    except ImportError:
        return False
    return True


REDUCTIONS = ("mean", "sum")


def chunked_cross_entropy(hidden: torch.Tensor, lm_head_weight: torch.Tensor,
                          labels: torch.Tensor, *, chunk_size: int = 1024,
                          ignore_index: int = -100, reduction: str = "mean",
                          num_items: int | torch.Tensor | None = None,
                          use_liger: bool | None = None) -> torch.Tensor:
    """``F.cross_entropy((hidden @ lm_head_weight.T).float(), labels)`` without ever holding
    more than ``chunk_size`` tokens' fp32 logits.

    ``hidden``: ``[..., hidden_size]``; ``labels``: the same leading shape, already aligned with
    ``hidden`` (shift them first for next-token prediction); tokens labelled ``ignore_index``
    do not count. ``reduction``: ``"mean"`` over counted tokens, or ``"sum"``; ``num_items``
    overrides the mean's denominator (gradient accumulation over the whole batch).

    >>> loss = chunked_cross_entropy(h, lm_head.weight, labels, chunk_size=2048)
    >>> loss.backward()
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise MemfitError(f"chunk_size must be a positive integer (tokens per chunk), got "
                          f"{chunk_size!r}; e.g. 1024")
    if reduction not in REDUCTIONS:
        raise MemfitError(f"reduction must be one of {', '.join(REDUCTIONS)}, got "
                          f"{reduction!r}")
    if hidden.shape[:-1] != labels.shape:
        raise MemfitError(f"labels shape {tuple(labels.shape)} does not match hidden states "
                          f"{tuple(hidden.shape)} without the last dimension; pass one label per "
                          "token (shift labels left by one for next-token prediction)")
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != hidden.shape[-1]:
        raise MemfitError(f"lm_head_weight must be [vocab, {hidden.shape[-1]}], got "
                          f"{tuple(lm_head_weight.shape)}")
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    liger = use_liger if use_liger is not None else (h.is_cuda and _liger_available())
    if liger:
        if not h.is_cuda:
            raise MemfitError("use_liger=True needs CUDA tensors (Liger's kernels are Triton); "
                              "use use_liger=None to fall back to the chunked PyTorch loss")
        if not _liger_available():
            raise MemfitError("use_liger=True but liger_kernel is not installed; "
                              "pip install 'memfit[liger]', or pass use_liger=None")
        if reduction == "mean" and num_items is None:
            return _liger_loss(h, lm_head_weight, y, ignore_index, "mean")
        total = _liger_loss(h, lm_head_weight, y, ignore_index, "sum")
    else:
        total = _ChunkedCrossEntropy.apply(h, lm_head_weight, y, chunk_size, ignore_index)
    if reduction == "sum":
        return total
    denominator = num_items if num_items is not None else (y != ignore_index).sum()
    return total / denominator


# -- applying it to a model -----------------------------------------------------------------------

def _base_and_head(model: nn.Module) -> tuple[nn.Module, nn.Linear]:
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear):
        raise MemfitError(f"{type(model).__name__} has no lm_head Linear; apply_chunked_loss "
                          "supports Hugging Face *ForCausalLM models and memfit's builtin "
                          "decoders; call chunked_cross_entropy(hidden, weight, labels) yourself")
    if head.bias is not None:
        raise MemfitError("apply_chunked_loss supports an LM head without bias; call "
                          "chunked_cross_entropy yourself and add the bias term")
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "final_logit_softcapping", None):
        raise MemfitError("this model soft-caps its logits (final_logit_softcapping), which the "
                          "chunked loss does not reproduce; leave its loss as it is")
    base = getattr(model, "base_model", None) if config is not None else None
    if base is None or base is model:
        base = getattr(model, "model", None)
    if not isinstance(base, nn.Module):
        raise MemfitError(f"cannot find the decoder of {type(model).__name__} (model.model or "
                          "Hugging Face's base_model); call chunked_cross_entropy yourself")
    return base, head


def _chunked_forward(forward: Any, model: nn.Module, base: nn.Module, head: nn.Linear,
                     chunk_size: int, use_liger: bool | None, *args: Any,
                     labels: torch.Tensor | None = None, **kwargs: Any) -> Any:
    if labels is None:
        return forward(*args, **kwargs)
    num_items = kwargs.pop("num_items_in_batch", None)
    kwargs.pop("logits_to_keep", None)
    hf = getattr(model, "config", None) is not None
    out = base(*args, **kwargs)
    hidden = out if isinstance(out, torch.Tensor) else out[0]
    # Next-token labels, as Hugging Face's ForCausalLMLoss: shift left, pad with ignore_index.
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
    loss = chunked_cross_entropy(hidden, head.weight, shifted, chunk_size=chunk_size,
                                 num_items=num_items, use_liger=use_liger)
    if not hf:
        return loss
    from transformers.modeling_outputs import CausalLMOutputWithPast

    # The cache under the name this transformers' outputs have: ``cache`` in current 5.x,
    # ``past_key_values`` before the rename (reading or passing the old name there logs a
    # deprecation line: transformers/utils/generic.py, ModelOutput._replace_old_cache_name).
    key = ("cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)}
           else "past_key_values")
    return CausalLMOutputWithPast(loss=loss, logits=None, **{key: getattr(out, key, None)})


def apply_chunked_loss(model: nn.Module, *, chunk_size: int = 1024,
                       use_liger: bool | None = None) -> nn.Module:
    """Make ``model(input_ids, labels=labels)`` compute its loss with
    :func:`chunked_cross_entropy` (in place; returns ``model``). Without labels the model is
    unchanged (it returns logits). With labels, Hugging Face models return ``logits=None``.

    Works for Hugging Face ``*ForCausalLM`` models with an ``lm_head`` and memfit's builtin
    decoders (``build_model(spec, backend="builtin")``).

    >>> apply_chunked_loss(model, chunk_size=2048)
    >>> model(**batch).loss.backward()
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise MemfitError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    base, head = _base_and_head(model)
    # Without labels the forward the model has now runs. With labels the decoder is called
    # directly: apply this before apply_activation_offload, which wraps the whole forward.
    model.forward = functools.partial(  # type: ignore[method-assign]
        _chunked_forward, model.forward, model, base, head, chunk_size, use_liger)
    log.info("memfit: chunked cross-entropy loss, %d tokens per chunk", chunk_size)
    return model
