"""Speculative decoding's KV cache in vLLM 0.33: the draft's layers and the lookahead.

Read in vLLM 0.33.0 (:data:`memfit.serving.vllm.VLLM_SOURCE`):

- A draft that runs attention keeps its KV in the target's pool. ``vllm/v1/spec_decode/
  llm_base_proposer.py: SpecDecodeBaseProposer.load_model`` loads the draft into the same
  static forward context and marks the attention layers it added ``is_draft_layer``;
  ``vllm/v1/worker/gpu_model_runner.py: GPUModelRunner.get_kv_cache_spec`` then gives every one
  of them a spec like any target layer, with ``is_draft=True``, which
  ``vllm/v1/kv_cache_interface.py: KVCacheSpec`` leaves out of equality ("never affects
  grouping"): a draft layer of the target's shape joins the target's group and widens every
  block by one page.
- ``eagle`` / ``eagle3``: the head's ``num_hidden_layers`` decoder layers (1 in the published
  heads), named after the target's (``vllm/model_executor/models/llama_eagle.py`` and
  ``llama_eagle3.py``: ``start_layer_id=target_layer_num``); ``--draft-layers`` sets the count,
  each of the target's full-attention shape (a sliding target layer's KV heads and head size,
  with no window: the heads' configs have none).
- ``mtp``: the checkpoint's ``num_nextn_predict_layers`` MTP layers
  (``vllm/model_executor/models/deepseek_mtp.py: DeepSeekMultiTokenPredictor``: layers
  ``num_hidden_layers .. + num_nextn_predict_layers``), each a decoder layer of the target's
  attention (MLA for DeepSeek-V3: one layer); ``num_speculative_tokens`` defaults to that count
  (``vllm/config/speculative.py: SpeculativeConfig.__post_init__``, ``n_predict``) and must be
  a multiple of it when larger.
- ``draft_model``: a separate model's layers (``--draft-model``, its config), in the target's
  dtype (the draft ``ModelConfig`` takes ``dtype=self.target_model_config.dtype``) and KV dtype
  (``SpeculativeConfig.kv_cache_dtype`` None: inherit); different pages make vLLM's one
  uniform-type group (:func:`memfit.serving.vllm.kv_cache_groups`).
- ``ngram``: no model, no layers.

The lookahead (``vllm/config/vllm.py: VllmConfig.num_lookahead_tokens``: ``K`` for EAGLE/MTP
and draft models, 0 for ngram) is reserved by ``allocate_slots`` at run time, capped at
``max_model_len`` (``vllm/v1/core/kv_cache_manager.py: KVCacheManager.allocate_slots``), so a
full-attention layer's per-request most (``FullAttentionSpec.max_memory_usage_bytes``) and thus
the startup check and "Maximum concurrency" do not change with ``K``. What ``K`` does change:

- a Mamba / linear layer keeps ``K`` more state pages per request, for every method ngram
  included (``vllm/model_executor/layers/mamba/abstract.py: MambaBase.get_kv_cache_spec``:
  ``num_speculative_blocks=vllm_config.num_speculative_tokens``;
  ``MambaSpec.max_memory_usage_bytes``);
- with multi-module MTP (``SpeculativeConfig.use_multi_module_mtp``:
  ``min(num_nextn_predict_layers, K) > 1``) a sliding layer keeps ``K - 1`` more tokens
  (``vllm/v1/core/kv_cache_planning.py: get_kv_cache_configs`` sets
  ``extra_retained_tokens = num_prefill_lookahead_tokens - 1``, and
  ``VllmConfig.num_prefill_lookahead_tokens`` is ``K`` there, 1 for other EAGLE-family
  drafts, 0 otherwise);
- ``max_num_batched_tokens`` must exceed the lookahead (``VllmConfig.__post_init__``).

Known limitations: the draft's weights, its profile-run activations and CUDA graphs are not in
the ``--gpu`` startup budget (give ``--kv-cache-memory``, or read "Available KV cache memory"
off the log); a draft with a TP size other than the target's, EAGLE heads on MLA or
state-space targets, DFlash/DSpark/suffix and the other methods are refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from memfit.errors import MemfitError
from memfit.serving.kv_spec import LayerKV, kv_spec, text_config

__all__ = ["SPECULATIVE_METHODS", "SpeculativeDecoding", "SpeculativeMethod", "draft_layers",
           "speculative_decoding"]

SpeculativeMethod = Literal["eagle", "eagle3", "mtp", "ngram", "draft_model"]
SPECULATIVE_METHODS: tuple[SpeculativeMethod, ...] = ("eagle", "eagle3", "mtp", "ngram",
                                                      "draft_model")
"""``--speculative-method`` values (a subset of ``vllm/config/speculative.py:
SpeculativeMethod``)."""


@dataclass(frozen=True, kw_only=True)
class SpeculativeDecoding:
    """The speculative settings that move vLLM's KV numbers."""

    method: SpeculativeMethod
    num_speculative_tokens: int
    """``K``: draft tokens per step. Adds ``K`` state pages per request to Mamba layers."""
    lookahead_tokens: int
    """``VllmConfig.num_lookahead_tokens``: KV slots reserved past the scheduled tokens (run
    time only; ``max_num_batched_tokens`` must exceed it)."""
    extra_retained_tokens: int
    """``SlidingWindowSpec.extra_retained_tokens``: ``K - 1`` with multi-module MTP, else 0."""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _mtp_layers(config: Mapping[str, Any]) -> int:
    n = text_config(config).get("num_nextn_predict_layers")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise MemfitError("--speculative-method mtp needs the model's MTP layers: its config has "
                          "no positive 'num_nextn_predict_layers' (DeepSeek-V3: 1); use eagle, "
                          "draft_model or ngram for this model")
    return n


def speculative_decoding(method: str, num_speculative_tokens: int | None,
                         config: Mapping[str, Any],
                         max_num_batched_tokens: int) -> SpeculativeDecoding:
    """Validate the flags as ``SpeculativeConfig.__post_init__`` and ``VllmConfig`` do.

    >>> speculative_decoding("eagle", 3, {}, 8192).lookahead_tokens
    3
    """
    if method not in SPECULATIVE_METHODS:
        raise MemfitError(f"--speculative-method must be one of {', '.join(SPECULATIVE_METHODS)}"
                          f", got {method!r}")
    k = num_speculative_tokens
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise MemfitError(f"--num-speculative-tokens must be a positive integer, got {k!r}")
    extra = 0
    if method == "mtp":
        n_predict = _mtp_layers(config)
        if k is None:  # SpeculativeConfig: "Default to max value defined in draft model config"
            k = n_predict
        elif k > n_predict and k % n_predict:
            raise MemfitError(f"--num-speculative-tokens {k} must be a multiple of the model's "
                              f"{n_predict} MTP layers when above it (vLLM refuses it)")
        if min(n_predict, k) > 1:  # use_multi_module_mtp -> num_prefill_lookahead_tokens = K
            extra = k - 1
    elif k is None:
        raise MemfitError(f"--speculative-method {method} needs --num-speculative-tokens K "
                          "(vLLM requires it: vllm/config/speculative.py)")
    lookahead = 0 if method == "ngram" else k
    if max_num_batched_tokens <= lookahead:
        raise MemfitError(f"--max-num-batched-tokens {max_num_batched_tokens} must exceed the "
                          f"{lookahead} lookahead tokens of --num-speculative-tokens {k} "
                          "(vllm/config/vllm.py: VllmConfig refuses it); raise it")
    return SpeculativeDecoding(method=method,  # type: ignore[arg-type]
                               num_speculative_tokens=k, lookahead_tokens=lookahead,
                               extra_retained_tokens=extra)


def _as_draft(layer: LayerKV, index: int) -> LayerKV:
    kind = "full" if layer.kind == "sliding" else layer.kind
    return dataclasses.replace(layer, index=index, kind=kind, sliding_window=None, sinks=False,
                               draft=True)


def draft_layers(spec: SpeculativeDecoding, target: list[LayerKV], config: Mapping[str, Any],
                 *, num_draft_layers: int | None = None,
                 draft_config: Mapping[str, Any] | None = None, tp: int = 1,
                 kv_cache_dtype: str = "auto") -> list[LayerKV]:
    """The draft's cache-holding layers on one TP rank, indexed after the target's.

    >>> llama = {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32,
    ...          "num_key_value_heads": 8, "num_hidden_layers": 32, "torch_dtype": "bfloat16"}
    >>> eagle = speculative_decoding("eagle", 2, llama, 8192)
    >>> [(d.index, d.bytes_per_token) for d in draft_layers(eagle, kv_spec(llama), llama)]
    [(32, 4096)]
    """
    start = len(target)
    if num_draft_layers is not None and spec.method not in ("eagle", "eagle3"):
        raise MemfitError("--draft-layers is for --speculative-method eagle or eagle3 (MTP reads "
                          "num_nextn_predict_layers, a draft model its config)")
    if draft_config is not None and spec.method != "draft_model":
        raise MemfitError("--draft-model is for --speculative-method draft_model")
    if spec.method == "ngram":
        return []
    if spec.method == "draft_model":
        if draft_config is None:
            raise MemfitError("--speculative-method draft_model needs --draft-model (the draft's "
                              "config.json, hub id or preset)")
        dtype = text_config(config).get("torch_dtype", config.get("torch_dtype"))
        cfg = {**dict(draft_config), "torch_dtype": dtype} if dtype else dict(draft_config)
        return [dataclasses.replace(layer, index=start + i, draft=True)
                for i, layer in enumerate(kv_spec(cfg, tp=tp, kv_cache_dtype=kv_cache_dtype))]
    if spec.method == "mtp":
        count = _mtp_layers(config)
        kinds: tuple[str, ...] = ("mla", "full", "sliding")
    else:
        count = 1 if num_draft_layers is None else num_draft_layers
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise MemfitError(f"--draft-layers must be a positive integer, got {count!r}")
        kinds = ("full", "sliding")
    shape = next((layer for layer in target if layer.kind in kinds), None)
    if shape is None or (spec.method != "mtp" and any(x.kind == "mla" for x in target)):
        raise MemfitError(f"--speculative-method {spec.method}: the target has no attention "
                          "layer of a shape the draft shares (EAGLE heads on MLA models are not "
                          "modelled); use --speculative-method draft_model --draft-model CONFIG")
    return [_as_draft(shape, start + i) for i in range(count)]
