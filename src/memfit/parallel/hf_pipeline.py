"""Pipeline and sequence parallelism on Hugging Face decoders (Llama, Mistral, Qwen2, Qwen3 as
transformers builds them), beside memfit's builtin decoders (``memfit.parallel.pipeline``,
``memfit.parallel.apply.tp_plan``).

A stage is :class:`HFStageModule`: the model's own submodules split as torchtitan splits its
Llama (``pipeline.stage_layers``), with a forward that runs the Hugging Face decoder layers as
the model's own ``forward`` does (transformers 5.x, ``models/llama/modeling_llama.py:
LlamaModel.forward``):

- the token embedding (``inputs_embeds = self.embed_tokens(input_ids)``, line 370);
- position ids ``torch.arange(seq).unsqueeze(0)`` (lines 375-378, no cache in training);
- the causal mask, ``masking_utils.create_causal_mask(config=..., inputs_embeds=...,
  attention_mask=None, cache=None, position_ids=...)`` (lines 380-386; the cache argument is
  ``past_key_values`` before transformers renamed it, see :func:`cache_keyword`): under SDPA
  with no padding mask it is None and SDPA runs ``is_causal`` (``masking_utils.py:
  sdpa_mask``); Mistral with a ``sliding_window`` uses ``create_sliding_window_causal_mask``
  (``modeling_mistral.py: MistralModel.forward``), Qwen2 / Qwen3 pick one per layer from
  ``config.layer_types`` (``modeling_qwen2.py: Qwen2Model.forward``: ``causal_mask_mapping``);
- the rotary embeddings from the model's own ``rotary_emb(hidden_states, position_ids)`` (line
  389), computed once per stage and given to every layer;
- each decoder layer called as in lines 391-400 (``attention_mask``, ``position_embeddings``,
  ``position_ids``); the final norm (line 402) and the head (``LlamaForCausalLM.forward``).

Sequence parallelism: Hugging Face's ``LlamaModel.forward`` reads the sequence length off the
embedding's output (``position_ids = torch.arange(inputs_embeds.shape[1])``, line 377), which
sequence parallelism splits; :func:`full_positions` gives the decoder the whole sequence's
``position_ids`` (its own argument) instead, and a stage computes them from the whole length.
The attention is called with keyword arguments only (``LlamaDecoderLayer.forward``:
``self.self_attn(hidden_states=hidden_states, ...)``), so the plan all-gathers its
``hidden_states`` keyword (:func:`attention_input`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

HF_DECODERS = ("llama", "mistral", "qwen2", "qwen3")
"""``config.model_type`` of the Hugging Face decoders whose stages :class:`HFStageModule` runs:
their ``*Model.forward`` is Llama's (embedding, position ids, causal mask(s), rotary
embeddings, the layers, the final norm) and their decoder layers take the same arguments."""


def is_hf_decoder(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers ``*ForCausalLM`` of :data:`HF_DECODERS`."""
    config = getattr(model, "config", None)
    inner = getattr(model, "model", None)
    return (type(model).__module__.startswith("transformers.")
            and getattr(config, "model_type", None) in HF_DECODERS
            and all(hasattr(inner, n) for n in ("embed_tokens", "layers", "norm", "rotary_emb"))
            and isinstance(getattr(model, "lm_head", None), nn.Linear))


def hf_decoder_parts(model: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """(``model.model``, ``model.lm_head``) of a Hugging Face decoder :class:`HFStageModule`
    splits, else None."""
    return (model.model, model.lm_head) if is_hf_decoder(model) else None


def mask_kind(config: Any, layer: int) -> str:
    """The mask a layer takes: ``config.layer_types[layer]`` where the config lists them (Qwen2,
    Qwen3), ``"sliding_attention"`` for Mistral with a ``sliding_window``, else
    ``"full_attention"``."""
    types = getattr(config, "layer_types", None)
    if types:
        return str(types[layer])
    if config.model_type == "mistral" and getattr(config, "sliding_window", None) is not None:
        return "sliding_attention"
    return "full_attention"


@functools.cache
def cache_keyword(function: Callable[..., Any]) -> str:
    """The name ``function`` (a ``transformers.masking_utils`` mask function) gives its cache
    argument: ``cache`` in current transformers 5.x, ``past_key_values`` before the rename (the
    old name still works there but warns, and goes in 5.40: ``@deprecate_kwarg(
    "past_key_values", "5.40.0", new_name="cache")``)."""
    return "cache" if "cache" in inspect.signature(function).parameters else "past_key_values"


class HFStageModule(nn.Module):
    """One pipeline stage of a Hugging Face decoder, holding the model's own submodules (no
    copy), with the attributes of ``pipeline.StageModule`` (``index``, ``first``, ``last``,
    ``hidden_size``, ``layers`` named by their index in the whole model, ``embed_tokens`` on the
    first stage, ``norm`` and ``lm_head`` on the last, ``seq_shards``), so that the pipeline's
    schedule, FSDP2 and tensor-parallel functions take it as they take a builtin stage. Its
    forward runs the layers as ``LlamaModel.forward`` does (see the module)."""

    def __init__(self, model: nn.Module, layers: range, *, index: int, first: bool,
                 last: bool) -> None:
        super().__init__()
        decoder, head = model.model, model.lm_head
        self.index, self.first, self.last = index, first, last
        self.config = decoder.config
        self.hidden_size = int(decoder.embed_tokens.weight.shape[1])
        self.embed_tokens = decoder.embed_tokens if first else None
        self.rotary_emb = decoder.rotary_emb
        self.layers = nn.ModuleDict({str(i): decoder.layers[i] for i in layers})
        self.norm = decoder.norm if last else None
        self.lm_head = head if last else None
        self.seq_shards = 1  # sequence parallelism: a later stage gets 1/tp of the sequence

    def _masks(self, x: torch.Tensor, seq: int, position_ids: torch.Tensor) -> dict[str, Any]:
        """The masks this stage's layers take, made as the model's forward makes them (from the
        whole sequence's shape: a zero-stride view of the local shard, no allocation)."""
        from transformers.masking_utils import (
            create_causal_mask,
            create_sliding_window_causal_mask,
        )

        embeds = x if x.shape[1] == seq else x[:, :1].expand(x.shape[0], seq, x.shape[-1])
        masks = {}
        for kind in sorted({mask_kind(self.config, int(i)) for i in self.layers}):
            make = (create_sliding_window_causal_mask if kind == "sliding_attention"
                    else create_causal_mask)
            masks[kind] = make(config=self.config, inputs_embeds=embeds, attention_mask=None,
                               position_ids=position_ids, **{cache_keyword(make): None})
        return masks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = x.shape[1] * (1 if self.first else self.seq_shards)
        if self.first:
            ids = x
            x = self.embed_tokens(ids)  # type: ignore[misc]
        position_ids = torch.arange(seq, device=x.device).unsqueeze(0)
        masks = self._masks(x, seq, position_ids) if len(self.layers) else {}
        position_embeddings = self.rotary_emb(x, position_ids=position_ids)
        for i, layer in self.layers.items():
            x = layer(x, attention_mask=masks[mask_kind(self.config, int(i))],
                      position_embeddings=position_embeddings, position_ids=position_ids)
        if self.last:
            x = self.lm_head(self.norm(x))  # type: ignore[misc]
        return x


# -- sequence parallelism ---------------------------------------------------------------------

def hf_sp_root(model: nn.Module) -> tuple[str, str, str] | None:
    """Names of the token embedding, final norm and head that sequence parallelism splits in a
    Hugging Face decoder (``model.embed_tokens``, ``model.norm``, ``lm_head``), None for other
    models."""
    return ("model.embed_tokens", "model.norm", "lm_head") if is_hf_decoder(model) else None


def is_hf_attention(module: nn.Module) -> bool:
    """A transformers attention module (``q_proj`` inside, from a ``transformers.`` module):
    its decoder layer calls it with keyword arguments only."""
    return hasattr(module, "q_proj") and type(module).__module__.startswith("transformers.")


def attention_input(shard: Any, replicate: Any) -> Any:
    """The attention's ``PrepareModuleInput`` for a Hugging Face decoder layer, which calls
    ``self.self_attn(hidden_states=..., position_embeddings=..., ...)`` with keywords
    (``modeling_llama.py: LlamaDecoderLayer.forward``): the ``hidden_states`` keyword is
    all-gathered from ``Shard(1)`` (torch's ``PrepareModuleInput(input_kwarg_layouts=...,
    desired_input_kwarg_layouts=...)``, ``torch/distributed/tensor/parallel/style.py``)."""
    from torch.distributed.tensor.parallel import PrepareModuleInput

    return PrepareModuleInput(input_kwarg_layouts={"hidden_states": shard},
                              desired_input_kwarg_layouts={"hidden_states": replicate})


def full_positions(model: nn.Module) -> None:
    """A forward pre-hook on a Hugging Face decoder's ``model.model`` giving it the whole
    sequence's ``position_ids`` (``torch.arange(seq).unsqueeze(0)``, as ``LlamaModel.forward``
    makes them, lines 375-378) when the caller gave none: under sequence parallelism the
    embedding's output holds ``seq / tp`` rows, which the model's forward would take for the
    sequence length (line 377)."""

    def hook(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if kwargs.get("position_ids") is not None or not isinstance(ids, torch.Tensor):
            return None
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        return args, {**kwargs, "position_ids": positions}

    model.model.register_forward_pre_hook(hook, with_kwargs=True)
