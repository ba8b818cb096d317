"""Small Hugging Face models on meta for the trace tests (one builder, not one per file)."""

from __future__ import annotations

import torch
from torch import nn


def tiny_hf_llama(layers: int = 2) -> nn.Module:
    """A ``LlamaForCausalLM`` on meta: hidden 64, 4 heads, 2 KV heads (grouped-query
    attention), MLP 128, vocabulary 128."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)
