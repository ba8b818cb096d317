"""vLLM 0.33.0's startup budget on one GPU of the TP group: the weights as it loads them, the
profile run's activation peak, memory outside torch, the CUDA-graph estimate and the baseline
taken before the profile (CUDA context, NCCL, cuBLAS). :func:`serve_plan` takes the KV budget
from it; the SGLang plan takes the weights and the baseline.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from memfit.budget import budget_bytes
from memfit.errors import MemfitError
from memfit.models.checkpoint import tensor_entries
from memfit.serving.budget import (
    DEFAULT_ENGINE_VERSION,
    NON_TORCH_INCREASE_BYTES,
    Budget,
    cudagraph_capture_sizes,
    cudagraph_counts,
    cudagraph_estimate_bytes,
    requested_memory,
)
from memfit.serving.budget import engine_version as engine_version_spec
from memfit.serving.kv_spec import model_dtype_bytes
from memfit.serving.multimodal import (
    DYNAMIC_RESOLUTION,
    multimodal_budget,
    preprocessor_max_pixels,
)
from memfit.serving.weights import (
    WeightBytes,
    check_quant,
    weights_from_checkpoint,
    weights_from_config,
)

__all__ = ["baseline_parts", "model_folder", "startup_budget", "startup_weights"]


_QUANT_METHODS = {"awq": "awq", "gptq": "gptq", "fp8": "fp8", "modelopt_fp4": "nvfp4",
                  "bitsandbytes": "bnb-4bit"}


def _checkpoint_quant(config: Mapping[str, Any]) -> str | None:
    """The ``--quant`` a checkpoint's ``quantization_config`` names (vLLM reads it the same
    way: ``vllm/config/model.py: ModelConfig._verify_quantization``)."""
    qc = config.get("quantization_config")
    if not isinstance(qc, Mapping):
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "modelopt" and "FP4" in str(qc.get("quant_algo", "")).upper():
        method = "modelopt_fp4"
    if method not in _QUANT_METHODS:
        raise MemfitError(f"the checkpoint's quantization_config names {method!r}; serve-plan "
                          f"sizes {', '.join(sorted(_QUANT_METHODS))} (pass --kv-cache-memory)")
    return _QUANT_METHODS[method]


def _activation_peak(config: Mapping[str, Any], engine_version: str, **kw: int
                     ) -> tuple[int, str]:
    """The traced profile run of ``engine_version`` (:mod:`memfit.serving.profile_run`,
    imported here: it imports torch, which the ``--kv-cache-memory`` path never needs)."""
    import importlib

    profile_run = importlib.import_module("memfit.serving.profile_run")
    return int(profile_run.profile_activation_peak(config, engine_version=engine_version,
                                                   **kw)), "profile_run"


def model_folder(model: str | Path | Mapping[str, Any]) -> Path | None:
    """The folder a model argument names (a folder, its config.json, or a hub id's cached
    snapshot), or None (a preset, a dict)."""
    if isinstance(model, Mapping):
        return None
    from memfit.models import cached_snapshot, is_preset
    from memfit.models.hub import looks_like_hub_id

    text = str(model).strip()
    path = Path(text).expanduser()
    if path.is_file():
        return path.parent
    if path.is_dir():
        return path
    if looks_like_hub_id(text) and not is_preset(text):
        return cached_snapshot(text)
    return None


def startup_weights(model: str | Path | Mapping[str, Any], config: Mapping[str, Any], *,
                    gpu: Any, tp: int = 1, quant: str | None = None) -> WeightBytes:
    """The weights on one GPU of the TP group as the engine loads them: a folder's safetensors
    headers when the model is one (and ``quant`` is its own), else the config's shapes in the
    ``quant`` format (:mod:`memfit.serving.weights`). A quantization ``gpu`` cannot run is
    refused (one line)."""
    dtype_bytes = model_dtype_bytes(config)
    folder = model_folder(model)
    headers = folder is not None and tensor_entries(folder) is not None
    try:
        stored = _checkpoint_quant(config)
    except MemfitError:
        if not headers:
            raise
        stored = None  # a format serve-plan has no layout for: its headers give the bytes
    fmt = check_quant(quant or stored, gpu.compute_capability)
    if folder is not None and headers and (quant is None or quant == stored):
        return weights_from_checkpoint(folder, config, tp=tp, dtype_bytes=dtype_bytes)
    qc = config.get("quantization_config")
    group = qc.get("group_size") if isinstance(qc, Mapping) else None
    if fmt is not None and isinstance(group, int) and fmt.name in ("awq", "gptq"):
        fmt = dataclasses.replace(fmt, group_size=group)
    return weights_from_config(config, tp=tp, dtype_bytes=dtype_bytes, quant=fmt)


def baseline_parts(gpu: Any, tp: int = 1) -> dict[str, int]:
    """What a rank holds before the engine measures its baseline: the CUDA context, NCCL's
    buffers at ``tp > 1`` and the cuBLAS workspaces (``memfit.runtime.cuda_runtime_bytes``, the
    figures and sources there)."""
    from memfit.runtime import compute_capability_for, cuda_runtime_bytes

    arch = gpu.compute_capability or compute_capability_for(gpu.name)
    runtime = cuda_runtime_bytes(compute_capability=arch, num_gpus=tp, matmul_threads=1)
    return {"cuda_context": runtime["cuda_context"], "nccl": runtime["nccl"],
            "cublas_workspace": runtime["cublas_workspace"] + runtime["cublaslt_workspace"]}


def startup_budget(model: str | Path | Mapping[str, Any], config: Mapping[str, Any], *,
                   gpu: Any, gpu_memory_utilization: float = 0.9, tp: int = 1,
                   quant: str | None = None, max_num_batched_tokens: int = 8192,
                   max_num_seqs: int = 1024, enforce_eager: bool = False,
                   activation_peak_bytes: int | None = None,
                   cuda_graph_bytes: int | None = None, max_model_len: int | None = None,
                   max_images: int | None = None, max_videos: int | None = None,
                   max_pixels: int | None = None,
                   engine_version: str = DEFAULT_ENGINE_VERSION) -> Budget:
    """vLLM's startup budget (``engine_version``, 0.33.0 by default: :data:`memfit.serving.
    budget.ENGINE_VERSIONS`) on one GPU (a ``GpuSpec``) of the TP group: the weights
    (:mod:`memfit.serving.weights`: a folder's safetensors headers, else the config's shapes),
    the profile run's activation peak (``activation_peak_bytes`` if given; the version's
    sampler), memory outside torch, the CUDA-graph estimate at the version's capture sizes
    (``cuda_graph_bytes`` if given; 0 with ``enforce_eager``; subtracted from the KV budget from
    0.21 only) and the baseline (CUDA context, NCCL, cuBLAS: ``memfit.runtime``).
    A vision-language model adds its vision tower to the weights and its encoder to the
    profile run (:mod:`memfit.serving.multimodal`; ``max_images``, ``max_videos``,
    ``max_pixels``)."""
    from memfit.runtime import compute_capability_for

    version = engine_version_spec(engine_version)
    dtype_bytes = model_dtype_bytes(config)
    weights = startup_weights(model, config, gpu=gpu, tp=tp, quant=quant)
    kw = {"max_num_batched_tokens": max_num_batched_tokens, "max_num_seqs": max_num_seqs,
          "tp": tp, "dtype_bytes": dtype_bytes}
    folder = model_folder(model)
    if max_pixels is None and folder is not None and \
            config.get("model_type") in DYNAMIC_RESOLUTION:
        max_pixels = preprocessor_max_pixels(folder)
    mm = multimodal_budget(config, tp=tp, max_images=max_images, max_videos=max_videos,
                           max_pixels=max_pixels, dtype_bytes=dtype_bytes,
                           max_num_batched_tokens=max_num_batched_tokens,
                           max_num_seqs=max_num_seqs, max_model_len=max_model_len)
    if mm is not None and weights.source == "config":  # a folder's headers hold the tower
        weights = dataclasses.replace(weights, parts={**weights.parts, **mm.weights_parts})
    if activation_peak_bytes is not None:
        activation, activation_source = activation_peak_bytes, "given"
    else:
        activation, activation_source = _activation_peak(config, version.version, **kw)
        if mm is not None:  # the encoder's outputs stay cached through the decoder's run
            activation = mm.profile_peak(activation)
    arch = gpu.compute_capability or compute_capability_for(gpu.name)
    rule = version.capture_sizes
    sizes = [] if enforce_eager else cudagraph_capture_sizes(
        max_num_seqs, max_num_batched_tokens, blackwell=arch.startswith("10."), rule=rule)
    graphs = cudagraph_estimate_bytes(config, sizes=sizes, max_num_seqs=max_num_seqs, tp=tp,
                                      dtype_bytes=dtype_bytes, rule=rule) \
        if cuda_graph_bytes is None else (0 if enforce_eager else cuda_graph_bytes)
    baseline = baseline_parts(gpu, tp)
    return Budget(
        gpu=gpu.name, total_bytes=gpu.usable_bytes,
        gpu_memory_utilization=gpu_memory_utilization,
        requested_bytes=requested_memory(gpu.usable_bytes, gpu_memory_utilization),
        free_bytes=budget_bytes(gpu) if gpu.unified_memory else None,
        weights_bytes=weights.total, weights_parts=weights.parts,
        activation_peak_bytes=activation, activation_source=activation_source,
        non_torch_bytes=NON_TORCH_INCREASE_BYTES, cuda_graph_bytes=graphs,
        cuda_graph_counts=cudagraph_counts(sizes, max_num_seqs, rule=rule),
        baseline_parts=baseline, engine_version=version.version,
        cuda_graphs_in_budget=version.cuda_graphs_in_budget,
        multimodal=mm)

