"""KV cache bytes for inference.

bytes = 2 (K and V) x layers x kv_heads x head_dim x bytes_per_element x tokens x batch.
Llama-3-8B (32 layers, 8 KV heads, head dim 128) in bf16: 128 KiB per token.
"""

from __future__ import annotations

from memfit.analytic.config import RunConfig
from memfit.dtypes import nbytes
from memfit.models.spec import TransformerSpec


def kv_cache_bytes(spec: TransformerSpec, run: RunConfig, tokens: int) -> int:
    """KV cache on one GPU: KV heads split over tp (replicated when fewer than tp), layers over
    pp."""
    fmt = run.kv_cache_dtype or run.compute_format
    kv_heads = max(spec.num_kv_heads // run.parallel.tp, 1)
    layers = -(-spec.num_layers // run.parallel.pp)
    elements = 2 * layers * kv_heads * spec.head_dim * tokens * run.batch
    return nbytes(elements, fmt)
