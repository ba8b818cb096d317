"""vLLM 0.33.0's startup memory budget: what ``determine_available_memory`` subtracts from
``gpu_memory_utilization x total`` before the rest becomes the KV cache.

What vLLM does (``vllm/v1/worker/gpu_worker.py``):

1. ``init_device`` creates the CUDA context, initialises NCCL (``init_worker_distributed_
   environment``) and the cuBLAS/cuBLASLt handles (a ``torch.mm`` and an ``F.linear``), *then*
   takes the baseline snapshot and ``requested_memory = ceil(total x util)``
   (``vllm/v1/worker/utils.py: request_memory``), refusing to start when the free memory at
   that snapshot is below it. So the context, NCCL and cuBLAS workspace are **not** subtracted
   from the budget: they must fit in ``(1 - util) x total`` (:attr:`Budget.baseline`).
2. ``determine_available_memory`` runs the profile run inside ``memory_profiling``
   (``vllm/utils/mem_utils.py``): ``non_kv_cache_memory = total_consumed +
   transient_peak_headroom``, where ``total_consumed`` (free memory at the baseline minus free
   after the run) holds the weights and whatever grew outside torch meanwhile (lazily loaded
   kernels, backend workspaces), and ``transient_peak_headroom = torch_peak - torch_allocated``
   is the profile run's activation peak.
3. The CUDA-graph estimate. 0.33 runs Model Runner V2 by default (``vllm/config/vllm.py:
   VllmConfig.use_v2_model_runner``: on unless ``VLLM_USE_V2_MODEL_RUNNER=0`` or a feature it
   lacks), whose ``profile_cudagraph_memory`` (``vllm/v1/worker/gpu/cudagraph_utils.py``)
   captures every PIECEWISE graph and the two largest FULL graphs into a throwaway pool,
   measures the free-memory drop, and extrapolates the FULL ones
   (``_extrapolate_full_graph_memory``: first capture + ``(n - 1) x`` the second, at least
   1 MiB each). V1's runner (``gpu_model_runner.py: profile_cudagraph_memory``) samples two
   graphs per mode. Subtracted since v0.21 (``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS``
   defaults to 1 in ``vllm/envs.py``).
4. ``available = requested - non_kv_cache_memory - cudagraph_estimate``, logged as
   ``Available KV cache memory: X GiB`` (``format_gib``: ``round(b / 2**30, 2)``).

memfit computes each term without a GPU; which are from source and which are estimates is
said on each function.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from memfit.errors import MemfitError
from memfit.serving.kv_spec import text_config

__all__ = ["CUDA_GRAPH_PER_GRAPH_BYTES", "DEFAULT_ENGINE_VERSION", "ENGINE_VERSIONS",
           "NON_TORCH_INCREASE_BYTES", "Budget", "EngineVersion", "baseline_bytes",
           "cudagraph_capture_sizes", "cudagraph_counts", "cudagraph_estimate_bytes",
           "default_batch_limits", "engine_version", "format_gib",
           "requested_memory"]

GiB = 1 << 30
MiB = 1 << 20

CUDA_GRAPH_PER_GRAPH_BYTES = 24 * MiB
"""Estimate: one more captured graph's memory. vLLM measures it on the second-largest graph
(at least 1 MiB); published: "the real FULL graphs cost ~24 MiB each" (vllm #50780, title),
and 0.36 GiB for 16 PIECEWISE graphs (gpustack/runner #251's vLLM 0.27 log, 23 MiB each with
all of it charged per graph). The larger, 24 MiB, is taken for both modes."""

NON_TORCH_INCREASE_BYTES = 794_820_608 - 610 * MiB
"""Estimate: memory outside torch that grows after vLLM's baseline snapshot, i.e. kernels the
CUDA driver loads lazily during loading and the profile run. memfit's own H100 measurement
(``memfit.runtime.CONTEXT_MEASUREMENTS``, CUDA 13, lazy loading): 610 MiB outside the
allocator after the first tensor, 758 MiB once GEMM, SDPA and optimizer kernels had run: the
148 MiB difference. Attention-backend and Triton/compiled kernels may load more."""

_SOURCE_SIZES = "vllm/config/vllm.py: VllmConfig._set_cudagraph_sizes"


def format_gib(b: int) -> str:
    """vLLM's ``vllm/utils/mem_utils.py: format_gib``: ``round(b / GiB, 2)`` as text.

    >>> format_gib(20 * 2**30 + 2**29)
    '20.5'
    """
    return f"{round(b / GiB, 2)}"


def requested_memory(total_bytes: int, gpu_memory_utilization: float) -> int:
    """``vllm/v1/worker/utils.py: request_memory``: ``ceil(total x util)``.

    >>> requested_memory(1000, 0.9)
    900
    """
    if not 0 < gpu_memory_utilization <= 1:
        raise MemfitError(f"--gpu-memory-utilization must be in (0, 1], got "
                          f"{gpu_memory_utilization}; vLLM's default is 0.9")
    return math.ceil(total_bytes * gpu_memory_utilization)


def default_batch_limits(total_bytes: int, gpu_name: str) -> tuple[int, int]:
    """``vllm serve``'s default ``(max_num_seqs, max_num_batched_tokens)`` for a GPU
    (``vllm/engine/arg_utils.py: EngineArgs.get_batch_defaults``, ``OPENAI_API_SERVER``):
    (1024, 16384) from 160 GiB; (1024, 8192) from 70 GiB unless an A100; else (256, 2048).

    >>> default_batch_limits(80 * 2**30, "h100-sxm-80gb")
    (1024, 8192)
    >>> default_batch_limits(80 * 2**30, "a100-80gb")
    (256, 2048)
    """
    if total_bytes >= 160 * GiB:
        return 1024, 16384
    if total_bytes >= 70 * GiB and "a100" not in gpu_name.lower():
        return 1024, 8192
    return 256, 2048


DEFAULT_ENGINE_VERSION = "0.33.0"


@dataclass(frozen=True, kw_only=True)
class EngineVersion:
    """What memfit models of one vLLM release, each read in that release's PyPI source
    distribution (``--engine-version``). The KV-cache arithmetic stays 0.33's in every version.

    Known limitations: only the releases in :data:`ENGINE_VERSIONS`; a release between two of
    them is not interpolated (pass the nearest one and read its notes in docs/serving.md)."""

    version: str
    runner: str
    """``V1`` (``vllm/v1/worker/gpu_model_runner.py``) or ``V0`` (``vllm/worker/model_runner.py``):
    which profile run and sampler run."""
    sampler: str
    """The sampler code path of the profile run's dummy sampling (see
    :func:`memfit.serving.profile_run.sampler_peak`): ``triton`` (0.33:
    ``topk_topp_triton.py``) or ``sort`` (``apply_top_k_top_p``'s ``logits.sort``)."""
    capture_sizes: str
    """The default CUDA-graph capture rule: ``0.33`` (:func:`cudagraph_capture_sizes`),
    ``0.11`` (``vllm/config/__init__.py: VllmConfig._set_cudagraph_sizes``: 1, 2, 4 and every 8
    up to ``min(2 x max_num_seqs, 512)``, at most ``max_num_batched_tokens``) or ``v0``
    (``vllm/config.py: VllmConfig._set_cudagraph_sizes``: 1, 2, 4 and every 8 up to the first
    such size >= ``max_num_seqs``; whole-model decode graphs)."""
    cuda_graphs_in_budget: bool
    """Whether ``determine_available_memory`` subtracts a CUDA-graph estimate (from v0.21,
    ``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS``). Before, graphs were captured after the KV
    pool was allocated (``compile_or_warm_up_model``; V0's ``capture_model``) and had to fit in
    ``(1 - util) x total``: the budget shows them but does not subtract them."""


ENGINE_VERSIONS: dict[str, EngineVersion] = {
    "0.33.0": EngineVersion(version="0.33.0", runner="V1", sampler="triton",
                            capture_sizes="0.33", cuda_graphs_in_budget=True),
    "0.11.0": EngineVersion(version="0.11.0", runner="V1", sampler="sort",
                            capture_sizes="0.11", cuda_graphs_in_budget=False),
    "0.7.3": EngineVersion(version="0.7.3", runner="V0", sampler="sort", capture_sizes="v0",
                           cuda_graphs_in_budget=False),
    "0.6.4.post1": EngineVersion(version="0.6.4.post1", runner="V0", sampler="sort",
                                 capture_sizes="v0", cuda_graphs_in_budget=False),
}
"""The vLLM releases memfit models (``--engine-version``)."""


def engine_version(version: str | EngineVersion = DEFAULT_ENGINE_VERSION) -> EngineVersion:
    """The :class:`EngineVersion` of ``version``; any other release is refused (one line).

    >>> engine_version("0.11.0").sampler
    'sort'
    """
    if isinstance(version, EngineVersion):
        return version
    spec = ENGINE_VERSIONS.get(str(version).strip().removeprefix("v"))
    if spec is None:
        raise MemfitError(f"--engine-version {version!r} is not modelled; memfit models vLLM "
                          f"{', '.join(ENGINE_VERSIONS)} (pass the nearest one)")
    return spec


def cudagraph_capture_sizes(max_num_seqs: int, max_num_batched_tokens: int, *,
                            blackwell: bool = False, rule: str = "0.33") -> list[int]:
    """The default ``cudagraph_capture_sizes`` (``_set_cudagraph_sizes``, no speculative
    decoding so the decode query length is 1): the ceiling is ``min(2 x max_num_seqs, 512)``
    (1024 on data-centre Blackwell, capability family 100), then at most
    ``max_num_batched_tokens``; sizes 1, 2, 4, every 8 below 256, every 16 from 256 to the
    ceiling, plus ``max_num_batched_tokens`` and ``max_num_seqs`` when under the ceiling.

    >>> len(cudagraph_capture_sizes(1024, 8192)), cudagraph_capture_sizes(1024, 8192)[-1]
    (51, 512)
    >>> cudagraph_capture_sizes(3, 8192)
    [1, 2, 3, 4]

    ``rule`` picks an older release's list (:attr:`EngineVersion.capture_sizes`): ``0.11``,
    1, 2, 4 and every 8 up to ``min(2 x max_num_seqs, 512)``, at most
    ``max_num_batched_tokens``; ``v0``, 1, 2, 4 and every 8 up to the first such size
    ``>= max_num_seqs``.

    >>> len(cudagraph_capture_sizes(1024, 8192, rule="0.11"))
    67
    >>> cudagraph_capture_sizes(256, 2048, rule="v0")[-1]
    256
    """
    if rule == "0.11":
        ceiling = min(max_num_seqs * 2, 512, max_num_batched_tokens)
        return [s for s in (1, 2, 4) if s <= ceiling] + list(range(8, ceiling + 1, 8))
    if rule == "v0":
        possible = [1, 2, 4] + [8 * i for i in range(1, 1025)]
        top = next((s for s in possible if s >= max_num_seqs), possible[-1])
        return [s for s in possible if s <= top]
    if rule != "0.33":
        raise MemfitError(f"unknown capture-size rule {rule!r}: 0.33, 0.11 or v0")
    ceiling = min(max_num_seqs * 2, 1024 if blackwell else 512)
    uniform_decode = [max_num_seqs] if max_num_seqs <= ceiling else []
    ceiling = min(max_num_batched_tokens, ceiling)
    sizes = [i for i in (1, 2, 4) if i <= ceiling]
    if ceiling >= 8:
        sizes += list(range(8, min(ceiling + 1, 256), 8))
    if ceiling >= 256:
        sizes += list(range(256, ceiling + 1, 16))
    if max_num_batched_tokens <= ceiling:
        sizes.append(max_num_batched_tokens)
    sizes += [s for s in uniform_decode if s <= max_num_batched_tokens]
    return sorted(set(sizes))


def cudagraph_counts(sizes: list[int], max_num_seqs: int, *,
                     rule: str = "0.33") -> dict[str, int]:
    """Graphs per mode under 0.33's default ``FULL_AND_PIECEWISE`` (optimization level O2,
    ``vllm/config/vllm.py: OPTIMIZATION_LEVEL_02``): a PIECEWISE graph for every size, a FULL
    graph for every size up to ``max_num_seqs`` (Model Runner V2:
    ``vllm/v1/worker/gpu/cudagraph_utils.py: CudaGraphManager._init_candidates``; V1:
    ``vllm/v1/cudagraph_dispatcher.py: initialize_cudagraph_keys``). 0.11's default mode is the
    same (``vllm/config/__init__.py: VllmConfig.__post_init__``, the same dispatcher rule); V0
    (``rule="v0"``) captures one whole-model decode graph per size, counted as FULL. An
    attention backend without full-graph support downgrades the mode; not modelled."""
    if rule == "v0":
        return {"PIECEWISE": 0, "FULL": len(sizes)}
    return {"PIECEWISE": len(sizes), "FULL": len([s for s in sizes if s <= max_num_seqs])}


def _mlp_width(config: Mapping[str, Any], tp: int) -> tuple[int, int, int]:
    data = text_config(config)
    hidden = int(data.get("hidden_size") or 0)
    inter = int(data.get("moe_intermediate_size") or data.get("intermediate_size") or
                4 * hidden)
    vocab = int(data.get("vocab_size") or 0)
    if not hidden or not vocab:
        raise MemfitError("the config has no hidden_size or vocab_size; pass a full "
                          "config.json, or --kv-cache-memory")
    return hidden, inter // tp, vocab


def cudagraph_estimate_bytes(config: Mapping[str, Any], *, sizes: list[int], max_num_seqs: int,
                             tp: int, dtype_bytes: int,
                             per_graph: int = CUDA_GRAPH_PER_GRAPH_BYTES,
                             rule: str = "0.33") -> int:
    """Estimate of what ``profile_cudagraph_memory`` returns under Model Runner V2: the first
    (largest) capture sets the throwaway pool's baseline, and every further graph, PIECEWISE
    or FULL (they share the pool), adds ``per_graph``: ``first + per_graph x (graphs - 1)``.
    The first capture is estimated as the largest graph's intermediates (``largest x (hidden
    + 2 x intermediate / tp) x dtype``, one layer's residual stream and gate/up output per token);
    ``per_graph`` is :data:`CUDA_GRAPH_PER_GRAPH_BYTES`. Not derived from first principles:
    vLLM measures both on the GPU, and its own figure moves between versions (vllm #45178,
    #57475, #50780). 0 with no sizes (``--enforce-eager``)."""
    if not sizes:
        return 0
    hidden, inter, _ = _mlp_width(config, tp)
    first = max(sizes) * (hidden + 2 * inter) * dtype_bytes
    graphs = sum(cudagraph_counts(sizes, max_num_seqs, rule=rule).values())
    return first + per_graph * (graphs - 1)


def baseline_bytes(parts: Mapping[str, int]) -> int:
    """What vLLM's baseline snapshot already holds (CUDA context, NCCL, cuBLAS workspace): not
    subtracted from the budget, but it must leave ``util x total`` free."""
    return sum(parts.values())


@dataclass(frozen=True, kw_only=True)
class Budget:
    """vLLM's startup budget on one GPU of the TP group (bytes).

    Known limitations: the CUDA-graph term and the memory outside torch are estimates (see
    :func:`cudagraph_estimate_bytes`, :data:`NON_TORCH_INCREASE_BYTES`); the activation peak is
    the traced profile run (:mod:`memfit.serving.profile_run`) unless given
    (``activation_source``). The model runner's persistent input buffers (V2's
    ``InputBuffers``: 13 bytes per batched token, ``vllm/v1/worker/gpu/input_batch.py``) and
    vLLM's workspace manager are not counted.
    """

    gpu: str
    total_bytes: int
    """``cudaMemGetInfo``'s total (``GpuSpec.usable_bytes``)."""
    gpu_memory_utilization: float
    requested_bytes: int
    weights_bytes: int
    weights_parts: dict[str, int]
    activation_peak_bytes: int
    activation_source: str
    non_torch_bytes: int
    cuda_graph_bytes: int
    cuda_graph_counts: dict[str, int]
    baseline_parts: dict[str, int]
    """CUDA context, NCCL, cuBLAS workspace: in vLLM's baseline, outside the budget."""
    multimodal: Any = None
    """A vision-language model's encoder share (``memfit.serving.multimodal.MultimodalBudget``:
    its weights are in ``weights_parts``, its profile in ``activation_peak_bytes``), else None."""
    engine_version: str = DEFAULT_ENGINE_VERSION
    free_bytes: int | None = None
    """Unified memory (Jetson): the memory free at startup as vLLM reads it, None: ``total``.
    vLLM's ``MemorySnapshot.measure`` (``vllm/utils/mem_utils.py``) keeps ``cudaMemGetInfo``'s
    total (on a Jetson the whole shared RAM), so ``requested = util x total`` of the whole RAM;
    on an integrated GPU it takes ``psutil.virtual_memory().available`` as free, which is what
    the OS and the CPU side leave: modelled as :func:`memfit.budget.budget_bytes`."""
    cuda_graphs_in_budget: bool = True
    """Whether the engine version subtracts the CUDA-graph estimate from the KV budget (from
    v0.21; :attr:`EngineVersion.cuda_graphs_in_budget`). When not, ``cuda_graph_bytes`` is what
    the capture will take after the KV pool is allocated, out of ``(1 - util) x total``."""

    @property
    def non_kv_bytes(self) -> int:
        return self.weights_bytes + self.activation_peak_bytes + self.non_torch_bytes

    @property
    def kv_cache_bytes(self) -> int:
        """``requested - non_kv_cache_memory - cudagraph_estimate`` (may be negative: vLLM
        then raises "No available memory for the cache blocks")."""
        return self.requested_bytes - self.non_kv_bytes - self._graphs_subtracted

    @property
    def _graphs_subtracted(self) -> int:
        return self.cuda_graph_bytes if self.cuda_graphs_in_budget else 0

    @property
    def baseline_bytes(self) -> int:
        return baseline_bytes(self.baseline_parts)

    @property
    def baseline_fits(self) -> bool:
        """``request_memory``'s check: free memory at the baseline >= requested."""
        free = self.total_bytes if self.free_bytes is None else self.free_bytes
        return free - self.baseline_bytes >= self.requested_bytes

    @property
    def log_line(self) -> str:
        """``gpu_worker.py: determine_available_memory``'s ``logger.info_once``."""
        return f"Available KV cache memory: {format_gib(self.kv_cache_bytes)} GiB"

    @property
    def log_lines(self) -> list[str]:
        """The budget lines vLLM logs at startup, in its order: the encoder cache's budget
        (a vision-language model), the CUDA-graph estimate
        (``cudagraph_utils.py: profile_cudagraph_memory``, ``%.2f GiB``), the available KV
        memory, and, with graphs, the utilization they are worth
        (``determine_available_memory``: ``round(util -/+ estimate / total, 4)``)."""
        lines = [] if self.multimodal is None else [self.multimodal.log_line]
        if self._graphs_subtracted:
            lines.append(f"Estimated CUDA graph memory: {self.cuda_graph_bytes / GiB:.2f} "
                         "GiB total")
        lines.append(self.log_line)
        if self._graphs_subtracted:
            util = self.gpu_memory_utilization
            delta = self.cuda_graph_bytes / self.total_bytes
            lines.append(
                "CUDA graph memory profiling is enabled (default since v0.21.0). The current "
                f"--gpu-memory-utilization={util:.4f} is equivalent to "
                f"--gpu-memory-utilization={round(util - delta, 4):.4f} without CUDA graph "
                "memory profiling. To maintain the same effective KV cache size as before, "
                f"increase --gpu-memory-utilization to {min(round(util + delta, 4), 1.0):.4f}.")
        return lines

    def utilization_for(self, kv_bytes: int) -> float:
        """The smallest ``--gpu-memory-utilization`` (4 decimals, rounded up) that leaves
        ``kv_bytes`` for the KV cache with the same non-KV terms."""
        need = kv_bytes + self.non_kv_bytes + self._graphs_subtracted
        return math.ceil(need / self.total_bytes * 10_000) / 10_000
