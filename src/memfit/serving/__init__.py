"""Serving: size an inference engine's KV cache before launch, layer by layer (issue 22).

:func:`kv_spec` reads each decoder layer's cache from a transformers config (full, sliding,
MLA, Mamba / linear state, shared-KV; per TP rank, in the KV dtype); :mod:`memfit.serving.vllm`
restates vLLM's paging (pages, KV cache groups, blocks, tokens, concurrency) with each rule's
source named; :func:`serve_plan` puts them together for a KV budget in bytes (vLLM's
``--kv-cache-memory``). Torch-free: the analytic CLI answers without importing torch.
"""

from memfit.serving.check import CheckRow, check_plan, log_inputs
from memfit.serving.kv_spec import (
    KV_DTYPES,
    LayerKV,
    kv_spec,
    model_context_length,
    model_dtype_bytes,
    text_config,
)
from memfit.serving.logs import EngineLog, parse_engine_log, read_engine_log
from memfit.serving.multimodal import MultimodalBudget, multimodal_budget
from memfit.serving.plan import ServePlan, load_config, serve_plan, vllm_layer_specs
from memfit.serving.sglang import (
    SGLANG_HYBRID_SWA_ARCHS,
    SGLANG_KV_DTYPES,
    SGLANG_SOURCE,
    SGLANG_VERSION,
    SGLangKVPool,
    default_mem_fraction_static,
    gpu_memory_defaults,
    mamba_cache_per_req,
    sglang_cell_size,
    sglang_kv_tokens,
    sglang_layers,
    sglang_log_lines,
)
from memfit.serving.sglang_startup import SGLangPlan, sglang_plan, sglang_serve_plan
from memfit.serving.vllm import (
    VLLM_SOURCE,
    VLLM_VERSION,
    EngineLayerSpec,
    KVCacheGroup,
    align_hybrid_block_size,
    bytes_per_block,
    fits,
    kv_cache_groups,
    kv_cache_tokens,
    max_concurrency,
    max_memory_usage_bytes,
    max_model_len_that_fits,
    num_gpu_blocks,
)

__all__ = [
    "KV_DTYPES",
    "SGLANG_HYBRID_SWA_ARCHS",
    "SGLANG_KV_DTYPES",
    "SGLANG_SOURCE",
    "SGLANG_VERSION",
    "VLLM_SOURCE",
    "VLLM_VERSION",
    "CheckRow",
    "EngineLayerSpec",
    "EngineLog",
    "KVCacheGroup",
    "LayerKV",
    "MultimodalBudget",
    "SGLangKVPool",
    "SGLangPlan",
    "ServePlan",
    "align_hybrid_block_size",
    "bytes_per_block",
    "check_plan",
    "default_mem_fraction_static",
    "fits",
    "gpu_memory_defaults",
    "kv_cache_groups",
    "kv_cache_tokens",
    "kv_spec",
    "load_config",
    "log_inputs",
    "mamba_cache_per_req",
    "max_concurrency",
    "max_memory_usage_bytes",
    "max_model_len_that_fits",
    "model_context_length",
    "model_dtype_bytes",
    "multimodal_budget",
    "num_gpu_blocks",
    "parse_engine_log",
    "read_engine_log",
    "serve_plan",
    "sglang_cell_size",
    "sglang_kv_tokens",
    "sglang_layers",
    "sglang_log_lines",
    "sglang_plan",
    "sglang_serve_plan",
    "text_config",
    "vllm_layer_specs",
]

# The continuous-batching simulator (issue 23).
from memfit.serving.roofline import Roofline, model_flop_params
from memfit.serving.simulate import (
    BatchingStats,
    Simulation,
    roofline_for,
    simulate,
)
from memfit.serving.workload import Request, poisson_requests, read_trace

__all__ += ["BatchingStats", "Request", "Roofline", "Simulation", "model_flop_params",
            "poisson_requests", "read_trace", "roofline_for", "simulate"]
