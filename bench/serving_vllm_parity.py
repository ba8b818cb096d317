"""memfit's vLLM KV-cache arithmetic against vLLM 0.33.0's own code, exactly, on a CPU (issue 22).

vLLM sizes its KV pool in plain Python once it knows the layers' specs and the bytes it may use
(``vllm/v1/core/kv_cache_planning.py: get_global_kv_cache_groups``, ``get_kv_cache_configs``,
``vllm/v1/core/kv_cache_utils.py: get_kv_cache_capacity``). This bench runs that code, in a
separate venv holding ``vllm==0.33.0`` (``bench/serving_vllm/setup.sh``), over a grid of models
x layouts x KV bytes x TP x KV dtype x async scheduling x ``max_model_len`` x prefix caching,
and compares each figure with :func:`memfit.serve_plan` exactly: the block size (after the
hybrid alignment), the KV cache groups (kind, layers, block size, page bytes), bytes per block,
``num_gpu_blocks``, the logged "GPU KV cache size" tokens and "Maximum concurrency", whether
startup passes the one-request check, and the largest ``max_model_len`` that fits. memfit does
not import vLLM: the two sides run in two processes and meet in JSON.

Run (from the repository root)::

    bash bench/serving_vllm/setup.sh                      # once: the vLLM venv (gitignored)
    bench/serving_vllm/.venv/bin/python bench/serving_vllm_parity.py [--quick]

The vLLM side runs in-process; the memfit side runs in ``--memfit-python`` (default
``/work/main/.venv/bin/python``, or ``$MEMFIT_PYTHON``) with ``PYTHONPATH=src``. Results go to
``bench/results/serving-vllm-parity-cpu-<date>.json``. Either side alone::

    python bench/serving_vllm_parity.py --side memfit --out memfit.json   # no vLLM needed
    bench/serving_vllm/.venv/bin/python bench/serving_vllm_parity.py --side vllm --out vllm.json

What the vLLM side builds by hand, and why: there is no GPU, so no model is instantiated. A real
``ModelConfig`` is built from each stored ``config.json`` (offline) and a real ``VllmConfig``
around it (``DeviceConfig("cuda")`` so nothing probes the device). Each cache-holding layer's
spec comes from vLLM's own ``get_kv_cache_spec`` methods, called on a stand-in for the layer
object carrying the attributes the layer's ``__init__`` would set
(``Attention.get_kv_cache_spec``, ``MLAAttention.get_kv_cache_spec``); a Mamba / gated-delta-net
layer is a stand-in subclass of the model's own layer class, registered in
``compilation_config.static_forward_context`` so that the platform's hybrid alignment reads its
prefill-checkpoint alignment, and whose spec is the class's own ``get_kv_cache_spec``
(:meth:`_VllmSide.state_layers`). Which layer is attention, sliding, Mamba or shared is read
from the transformers config object vLLM loaded (its ``layer_types``, Jamba's
``layers_block_type``, Nemotron-H's ``hybrid_override_pattern``, Gemma 3n's
``num_kv_shared_layers``), as the vLLM model files do; a model-wide window reaches every layer
only when the config has no ``layer_types`` or all sliding (``vllm/engine/arg_utils.py:
EngineArgs.create_engine_config``). The attention backend is FlashAttention
(``vllm/v1/attention/backends/flash_attn.py``); the hybrid block alignment is the platform's
``Platform._align_hybrid_block_size`` with that backend; the gated-delta-net prefill kernel is
the one ``_resolve_gdn_prefill_backend`` picks for the case's GPU (an H100, or an A100 where the
case says so); the KV cache layout is resolved by ``resolve_kv_cache_layout`` from the backends'
declared layouts."""

from __future__ import annotations

import argparse
import datetime as _dt
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODELS_JSON = ROOT / "bench" / "serving_vllm" / "models.json"
GiB = 2**30
MEMORY_GIB = (1, 7.5, 20, 61.3)
TPS = (1, 2, 4, 8)
KV_DTYPES = ("auto", "fp8")
BLOCK_SIZE = 16
MAX_NUM_BATCHED_TOKENS = 8192
SHORT_LEN = 4096
HYBRID = ("jamba", "nemotron_h", "qwen3_next")
# An EAGLE head of one decoder layer on these (full grid only): the draft's layer joins the pool
# (gpt-oss-20b + EAGLE is vLLM's own example of the 1.5x group-size rule, 12 sliding + 13 full)
EAGLE_MODELS = ("llama-3-8b", "gpt-oss-20b")
EAGLE_TOKENS = 3


def load_models() -> dict[str, dict[str, Any]]:
    """The stored configs (``bench/serving_vllm/models.json``), each with its ``_source``."""
    data: dict[str, dict[str, Any]] = json.loads(MODELS_JSON.read_text())
    return data


def hf_config(entry: dict[str, Any]) -> dict[str, Any]:
    """The config.json proper: the stored dict less the bench's ``_`` keys."""
    return {k: v for k, v in entry.items() if not k.startswith("_")}


def grid(quick: bool = False, models: list[str] | None = None) -> list[dict[str, Any]]:
    """Every case, as plain dicts both sides read. ``max_model_len`` None is the model's own
    context (each side derives it). Hybrid models run with prefix caching on (vLLM's
    ``mamba_cache_mode`` ``align``) and off (``none``); other models with it on (it changes
    nothing there). ``gpu`` is the device the GDN prefill kernel is chosen for: None is an
    H100 (SM90, FlashInfer's GDN kernel, memfit's default without ``--gpu``), ``a100-80gb``
    (SM80, Triton) is added for Qwen3-Next with prefix caching, where the kernel sets the
    block alignment. A TP that does not divide the heads is kept: both sides must refuse it."""
    cases = []
    # (--block-size, async scheduling): the default, async off, and a larger block
    schedules = [(BLOCK_SIZE, True)] if quick else [(BLOCK_SIZE, True), (BLOCK_SIZE, False),
                                                    (64, True)]
    for name, entry in load_models().items():
        if models and name not in models:
            continue
        cfg = entry.get("text_config") or entry
        hybrid = cfg.get("model_type") in HYBRID
        # (prefix caching, gpu)
        devices: list[tuple[bool, str | None]] = [(True, None)]
        if hybrid:
            devices.append((False, None))
        if cfg.get("model_type") == "qwen3_next":
            devices.append((True, "a100-80gb"))
        # only sliding-window layers read max_num_batched_tokens (the in-flight tokens)
        batched = (MAX_NUM_BATCHED_TOKENS,) if quick or not cfg.get("sliding_window") else \
            (MAX_NUM_BATCHED_TOKENS, 2048)
        for (prefix_caching, gpu), tp, kv_dtype, (block, async_scheduling), max_model_len, \
                mnbt, mem in itertools.product(devices, TPS[:2] if quick else TPS, KV_DTYPES,
                                               schedules, (None, SHORT_LEN), batched,
                                               MEMORY_GIB[:2] if quick else MEMORY_GIB):
            cases.append({
                "model": name, "tp": tp, "kv_cache_dtype": kv_dtype,
                "kv_cache_memory": int(mem * GiB), "memory_gib": mem,
                "async_scheduling": async_scheduling, "max_model_len": max_model_len,
                "max_num_batched_tokens": mnbt, "block_size": block,
                "prefix_caching": prefix_caching, "gpu": gpu, "speculative": None})
        if name in EAGLE_MODELS and not quick:
            for tp, max_model_len, mem in itertools.product(TPS[:2], (None, SHORT_LEN),
                                                            MEMORY_GIB[:2]):
                cases.append({
                    "model": name, "tp": tp, "kv_cache_dtype": "auto",
                    "kv_cache_memory": int(mem * GiB), "memory_gib": mem,
                    "async_scheduling": True, "max_model_len": max_model_len,
                    "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS, "block_size": BLOCK_SIZE,
                    "prefix_caching": True, "gpu": None, "speculative": "eagle"})
    for i, case in enumerate(cases):
        case["id"] = i
    return cases


# --------------------------------------------------------------------------- memfit side

def memfit_side(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """memfit's figures for each case (memfit imported here only; no vLLM)."""
    import memfit
    from memfit.errors import MemfitError

    models = load_models()
    out = []
    for case in cases:
        row: dict[str, Any] = {"id": case["id"]}
        try:
            plan = memfit.serve_plan(
                hf_config(models[case["model"]]), kv_cache_memory=case["kv_cache_memory"],
                tp=case["tp"], kv_cache_dtype=case["kv_cache_dtype"],
                block_size=case["block_size"], max_model_len=case["max_model_len"],
                max_num_batched_tokens=case["max_num_batched_tokens"],
                async_scheduling=case["async_scheduling"],
                prefix_caching=case["prefix_caching"], gpu=case["gpu"],
                speculative_method=case.get("speculative"),
                num_speculative_tokens=EAGLE_TOKENS if case.get("speculative") else None)
        except MemfitError as exc:
            row["error"] = str(exc)
            out.append(row)
            continue
        row.update({
            "max_model_len": plan.max_model_len, "model_context": plan.model_context,
            "block_size": plan.block_size, "bytes_per_block": plan.bytes_per_block,
            "num_gpu_blocks": plan.num_gpu_blocks, "kv_cache_tokens": plan.kv_cache_tokens,
            "max_concurrency": plan.max_concurrency, "fits": plan.fits,
            "max_model_len_that_fits": plan.max_model_len_that_fits,
            "groups": [{"kind": "uniform_type" if g.uniform_type else g.spec.kind,
                        "layers": list(g.layers), "block_size": g.block_size,
                        "page_size_bytes": g.page_size_bytes} for g in plan.groups]})
        out.append(row)
    return out


# --------------------------------------------------------------------------- vLLM side

class _VllmSide:
    """vLLM 0.33.0's own functions over the grid (imported only in the vLLM venv)."""

    def __init__(self, workdir: Path) -> None:
        import vllm
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            ModelConfig,
            ParallelConfig,
            SchedulerConfig,
            VllmConfig,
        )
        from vllm.platforms.interface import DeviceCapability, Platform, PlatformEnum
        from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

        self.vllm = vllm
        self.ModelConfig, self.VllmConfig = ModelConfig, VllmConfig
        self.CacheConfig, self.DeviceConfig = CacheConfig, DeviceConfig
        self.ParallelConfig, self.SchedulerConfig = ParallelConfig, SchedulerConfig
        self.backend = FlashAttentionBackend

        class _FlashAttentionPlatform(Platform):
            """The platform's hybrid alignment with FlashAttention as the only non-SSM backend
            (on a GPU ``_find_non_ssm_backends`` reads it off the built layers)."""

            @classmethod
            def _find_non_ssm_backends(cls, vllm_config):  # type: ignore[no-untyped-def]
                return [FlashAttentionBackend]

        self.platform = _FlashAttentionPlatform

        def cuda(major: int, minor: int) -> Any:
            class _Cuda(Platform):
                """What ``_resolve_gdn_prefill_backend`` asks of ``current_platform`` on a CUDA
                GPU of this compute capability, with vLLM 0.33's CUDA 13 runtime (its wheels
                pin torch 2.14.0+cu130)."""

                _enum = PlatformEnum.CUDA

                @classmethod
                def get_device_capability(cls, device_id: int = 0) -> Any:
                    return DeviceCapability(major, minor)

                @classmethod
                def get_cuda_runtime_major(cls) -> int:
                    return 13

            return _Cuda()

        # the case's "gpu": None is an H100 (SM90), as FlashAttention stands for
        self.gpus = {None: cuda(9, 0), "a100-80gb": cuda(8, 0)}
        self.workdir = workdir
        self.models = load_models()
        self._model_configs: dict[tuple[str, int | None], Any] = {}

    def model_config(self, name: str, max_model_len: int | None) -> Any:
        key = (name, max_model_len)
        if key not in self._model_configs:
            folder = self.workdir / name
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "config.json").write_text(json.dumps(hf_config(self.models[name])))
            self._model_configs[key] = self.ModelConfig(
                model=str(folder), skip_tokenizer_init=True, max_model_len=max_model_len)
        return self._model_configs[key]

    def vllm_config(self, case: dict[str, Any]) -> Any:
        mc = self.model_config(case["model"], case["max_model_len"])
        import copy
        mc = copy.copy(mc)  # VllmConfig's post-init may update it per case
        vc = self.VllmConfig(
            model_config=mc, device_config=self.DeviceConfig(device="cuda"),
            cache_config=self.CacheConfig(block_size=case["block_size"],
                                          cache_dtype=case["kv_cache_dtype"],
                                          enable_prefix_caching=case["prefix_caching"]),
            parallel_config=self.ParallelConfig(tensor_parallel_size=case["tp"]),
            scheduler_config=self.SchedulerConfig(
                max_num_batched_tokens=case["max_num_batched_tokens"],
                max_model_len=mc.max_model_len, is_encoder_decoder=False,
                async_scheduling=case["async_scheduling"]))
        # VllmConfig.__post_init__ turns the hybrid KV cache manager off where
        # current_platform.support_hybrid_kv_cache() is false, as on this CPU (no platform);
        # CudaPlatform supports it, so a GPU server keeps it on.
        vc.scheduler_config.disable_hybrid_kv_cache_manager = False
        return vc

    def layer_kinds(self, vc: Any) -> list[tuple[str, int | None]]:
        """Each decoder layer as vLLM's model file builds it: ``(kind, window)`` with kind
        ``attention``, ``mla``, ``mamba``, ``shared`` or ``none``."""
        hf = vc.model_config.hf_text_config
        mt = hf.model_type
        n = hf.num_hidden_layers
        if mt == "jamba":  # jamba.py: config.layers_block_type[layer_idx]
            return [("attention" if t == "attention" else "mamba", None)
                    for t in hf.layers_block_type]
        if mt == "nemotron_h":  # nemotron_h.py: hybrid_override_pattern, M mamba, * attention
            return [{"M": ("mamba", None), "*": ("attention", None)}.get(c, ("none", None))
                    for c in hf.hybrid_override_pattern]
        if mt == "qwen3_next":  # qwen3_next.py: config.layer_types
            return [("mamba" if t == "linear_attention" else "attention", None)
                    for t in hf.layer_types]
        if vc.model_config.use_mla:  # deepseek_v2.py: MLAAttention on every layer
            return [("mla", None)] * n
        layer_types = getattr(hf, "layer_types", None)
        kinds: list[tuple[str, int | None]] = []
        for i in range(n):
            if mt == "gpt_oss":  # gpt_oss.py: OAIAttention, even layers windowed
                window = hf.sliding_window if i % 2 == 0 else None
            elif layer_types:  # llama.py / gemma2.py / gemma3.py / gemma3n.py
                window = hf.sliding_window if layer_types[i] == "sliding_attention" else None
            else:  # Attention.__init__: cache_config.sliding_window (arg_utils rule)
                window = vc.model_config.get_sliding_window()
            kinds.append(("attention", window))
        shared = getattr(hf, "num_kv_shared_layers", 0) or 0
        if shared:  # gemma3n.py: Gemma3nAttention.kv_sharing_target_layer_name
            first = n - shared
            for i in range(first, n):
                offset = 2 if kinds[i][1] is not None else 1
                if first - offset >= 0:
                    kinds[i] = ("shared", kinds[i][1])
        return kinds

    def state_layers(self, vc: Any, gpu: str | None) -> dict[str, Any]:
        """Stand-ins for the built Mamba / linear-attention layers, registered where vLLM
        looks them up (``compilation_config.static_forward_context``, read by
        ``get_layers_from_vllm_config``), so that ``Platform._align_hybrid_block_size`` reads
        their prefill-checkpoint alignment (``mamba/abstract.py:
        get_mamba_prefill_checkpoint_alignment``) and their specs come from the layer class's
        own ``get_kv_cache_spec``.

        Each is an instance of a subclass of the model's layer class (Jamba ``MambaMixer``,
        Nemotron-H ``MambaMixer2``, Qwen3-Next ``QwenGatedDeltaNetAttention``) whose
        ``__init__`` sets only what those methods read, and whose state shapes and dtypes are
        the model class's ``get_mamba_state_shape_from_config`` /
        ``get_mamba_state_dtype_from_config`` (what the layer's own ``get_state_shape`` and
        ``get_state_dtype`` return). The gated-delta-net layer's ``_checkpoint_alignment`` is
        set as its ``__init__`` sets it: ``FLASHINFER_GDN_CHECKPOINT_ALIGNMENT`` in ``align``
        mode when ``_resolve_gdn_prefill_backend`` (run with ``current_platform`` standing for
        the case's GPU) picks FlashInfer, else None."""
        from unittest import mock

        import torch
        from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as gdn
        from vllm.model_executor.layers.mamba.mamba_mixer import MambaMixer
        from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
        from vllm.model_executor.models import ModelRegistry
        from vllm.v1.attention.backends.gdn_attn import FLASHINFER_GDN_CHECKPOINT_ALIGNMENT

        mc, cc = vc.model_config, vc.cache_config
        names = [f"model.layers.{i}.mixer" for i, (k, _) in enumerate(self.layer_kinds(vc))
                 if k == "mamba"]
        if not names:
            return {}
        model_cls, _ = ModelRegistry.resolve_model_cls(mc.architecture, model_config=mc)
        shapes = tuple(model_cls.get_mamba_state_shape_from_config(vc))
        dtypes = tuple(model_cls.get_mamba_state_dtype_from_config(vc))
        mt = mc.hf_text_config.model_type
        base = {"jamba": MambaMixer, "nemotron_h": MambaMixer2,
                "qwen3_next": gdn.QwenGatedDeltaNetAttention}[mt]
        attrs: dict[str, Any] = {}
        if mt == "qwen3_next":
            with mock.patch.object(gdn, "current_platform", self.gpus[gpu]):
                _, backend = gdn._resolve_gdn_prefill_backend(vc)
            attrs = {"vllm_config": vc, "_checkpoint_alignment": (
                FLASHINFER_GDN_CHECKPOINT_ALIGNMENT
                if cc.mamba_cache_mode == "align" and backend == "flashinfer" else None)}

        class StandIn(base):  # type: ignore[misc, valid-type]
            def __init__(self) -> None:
                torch.nn.Module.__init__(self)
                self.__dict__.update(attrs)

            def get_state_shape(self) -> Any:
                return shapes

            def get_state_dtype(self) -> Any:
                return dtypes

        layers = {name: StandIn() for name in names}
        vc.compilation_config.static_forward_context.update(layers)
        return layers

    def specs(self, vc: Any, state_layers: dict[str, Any]) -> dict[str, Any]:
        """Every cache-holding layer's KVCacheSpec, from vLLM's own get_kv_cache_spec."""
        from types import SimpleNamespace

        from vllm.model_executor.layers.attention.attention import Attention
        from vllm.model_executor.layers.attention.mla_attention import MLAAttention
        from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
        from vllm.v1.attention.backend import AttentionType

        mc, pc, cc = vc.model_config, vc.parallel_config, vc.cache_config
        kinds = self.layer_kinds(vc)
        if mc.is_hybrid and mc.hf_text_config.model_type != "nemotron_h":
            # the layer split as ModelConfig counts it (for Nemotron-H it counts 0 attention
            # layers under transformers 5: layers_block_type says "full_attention")
            attention = sum(k == "attention" for k, _ in kinds)
            assert attention == mc.get_num_layers_by_block_type(pc, "attention"), kinds
        out: dict[str, Any] = {}
        dtype = kv_cache_dtype_str_to_dtype(cc.cache_dtype, mc)
        for i, (kind, window) in enumerate(kinds):
            if kind == "attention":
                head = mc.get_head_size()
                layer = SimpleNamespace(
                    attn_type=AttentionType.DECODER, kv_cache_dtype=cc.cache_dtype,
                    sliding_window=window, attn_backend=self.backend,
                    num_kv_heads=mc.get_num_kv_heads(pc), head_size=head, head_size_v=head,
                    kv_cache_torch_dtype=dtype)
                out[f"model.layers.{i}.self_attn.attn"] = Attention.get_kv_cache_spec(layer, vc)
            elif kind == "mla":
                hf = mc.hf_text_config
                layer = SimpleNamespace(
                    kv_cache_dtype=cc.cache_dtype, sliding_window=None,
                    head_size=hf.kv_lora_rank + hf.qk_rope_head_dim, topk_buffer_width=None,
                    indexer=None, non_causal_multi_token_decode=False)
                out[f"model.layers.{i}.self_attn.attn"] = MLAAttention.get_kv_cache_spec(
                    layer, vc)
            elif kind == "mamba":
                name = f"model.layers.{i}.mixer"
                out[name] = state_layers[name].get_kv_cache_spec(vc)
        return out

    def eagle_layer(self, vc: Any, specs: dict[str, Any]) -> dict[str, Any]:
        """An EAGLE head's one decoder layer as vLLM registers it: an ``Attention`` of the
        target's KV heads and head size, no window (the heads' configs have none), named after
        the target's layers (``llama_eagle.py``: ``start_layer_id``), its spec marked
        ``is_draft`` as ``GPUModelRunner.get_kv_cache_spec`` marks a draft layer's. No
        ``SpeculativeConfig`` is built (it loads the draft checkpoint): for EAGLE on these
        models it changes no KV figure (``num_prefill_lookahead_tokens`` 1 retains no sliding
        token; no Mamba layers)."""
        from dataclasses import replace
        from types import SimpleNamespace

        from vllm.model_executor.layers.attention.attention import Attention
        from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
        from vllm.v1.attention.backend import AttentionType

        mc, pc, cc = vc.model_config, vc.parallel_config, vc.cache_config
        head = mc.get_head_size()
        layer = SimpleNamespace(
            attn_type=AttentionType.DECODER, kv_cache_dtype=cc.cache_dtype, sliding_window=None,
            attn_backend=self.backend, num_kv_heads=mc.get_num_kv_heads(pc), head_size=head,
            head_size_v=head, kv_cache_torch_dtype=kv_cache_dtype_str_to_dtype(cc.cache_dtype,
                                                                                mc))
        spec = replace(Attention.get_kv_cache_spec(layer, vc), is_draft=True)
        return {f"model.layers.{len(self.layer_kinds(vc))}.self_attn.attn": spec}

    def run(self, case: dict[str, Any]) -> dict[str, Any]:
        from vllm.v1.attention.backends.utils import (
            get_supported_kv_cache_layouts,
            resolve_kv_cache_layout,
        )
        from vllm.v1.core import kv_cache_planning as kp
        from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            MambaSpec,
            MLAAttentionSpec,
            SlidingWindowSpec,
            UniformTypeKVCacheSpecs,
        )

        row: dict[str, Any] = {"id": case["id"]}
        try:
            vc = self.vllm_config(case)
            state_layers = self.state_layers(vc, case["gpu"])
            if vc.model_config.is_hybrid:  # Platform.update_block_size_for_backend, phase 2
                self.platform._align_hybrid_block_size(vc, self.backend)
            specs = self.specs(vc, state_layers)
            if case.get("speculative") == "eagle":
                specs.update(self.eagle_layer(vc, specs))
        except Exception as exc:  # vLLM refuses the configuration
            row["error"] = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
            return row
        layouts = [[x.name for x in get_supported_kv_cache_layouts([self.backend])]]
        mem = case["kv_cache_memory"]
        try:
            resolve_kv_cache_layout(vc, layouts, specs.values())
            groups = kp.get_global_kv_cache_groups(vc, [specs])
        except Exception as exc:  # vLLM cannot group these layers
            row["error"] = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
            return row
        builder = kp.DefaultKVCacheConfigBuilder()
        fits = True
        try:
            config = kp.get_kv_cache_configs(vc, [specs], [mem], groups)[0]
        except ValueError as exc:  # _check_enough_kv_cache_memory: startup would fail
            fits = False
            row["refusal"] = str(exc)[:200]
            bpb = kp._pool_bytes_per_block_from_builder(builder, vc, groups)
            config = builder.get_kv_cache_config_from_groups(vc, groups, mem // bpb)
        tokens, concurrency = get_kv_cache_capacity(vc, config)
        bpb = kp._pool_bytes_per_block_from_builder(builder, vc, groups)
        # the largest max_model_len whose one request fits beside the null block, searched up
        # to the model's context (_estimate_max_model_len_from_groups, as get_kv_cache_configs
        # calls it on available - bytes_per_block)
        context = self.model_config(case["model"], None).max_model_len
        saved = vc.model_config.max_model_len
        vc.model_config.max_model_len = context
        try:
            fit_len = kp._estimate_max_model_len_from_groups(builder, vc, groups, mem - bpb)
        finally:
            vc.model_config.max_model_len = saved

        def kind(spec: Any) -> str:
            if isinstance(spec, UniformTypeKVCacheSpecs):
                return "uniform_type"
            for cls, name in ((MambaSpec, "mamba"), (SlidingWindowSpec, "sliding"),
                              (MLAAttentionSpec, "mla"), (FullAttentionSpec, "full")):
                if isinstance(spec, cls):
                    return name
            return type(spec).__name__

        row.update({
            "max_model_len": vc.model_config.max_model_len, "model_context": context,
            "block_size": vc.cache_config.block_size, "bytes_per_block": bpb,
            "num_gpu_blocks": config.num_blocks, "kv_cache_tokens": tokens,
            "max_concurrency": concurrency, "fits": fits, "max_model_len_that_fits": fit_len,
            "kv_cache_layout": vc.cache_config.kv_cache_layout,
            "max_in_flight_tokens": vc.max_in_flight_tokens,
            "groups": [{"kind": kind(g.kv_cache_spec),
                        "layers": [int(n.split(".")[2]) for n in g.layer_names],
                        "block_size": g.kv_cache_spec.block_size,
                        "page_size_bytes": g.kv_cache_spec.page_size_bytes} for g in groups]})
        return row


def vllm_side(cases: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, str]]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import logging
    with tempfile.TemporaryDirectory() as tmp:
        side = _VllmSide(Path(tmp))
        logging.getLogger("vllm").setLevel(logging.ERROR)
        import torch
        import transformers
        versions = {"vllm": side.vllm.__version__, "torch": torch.__version__,
                    "transformers": transformers.__version__}
        return [side.run(case) for case in cases], versions


# --------------------------------------------------------------------------- comparison

FIELDS = ("max_model_len", "model_context", "block_size", "bytes_per_block", "num_gpu_blocks",
          "kv_cache_tokens", "max_concurrency", "fits", "max_model_len_that_fits", "groups")


def compare(cases: list[dict[str, Any]], vllm_rows: list[dict[str, Any]],
            memfit_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per case: both sides' figures and the fields that differ (exact equality;
    a case both sides refuse matches)."""
    v_by, m_by = {r["id"]: r for r in vllm_rows}, {r["id"]: r for r in memfit_rows}
    out = []
    for case in cases:
        v, m = v_by[case["id"]], m_by[case["id"]]
        if "error" in v or "error" in m:
            diff = [] if ("error" in v) == ("error" in m) else ["refused"]
        else:
            diff = [f for f in FIELDS if v.get(f) != m.get(f)]
        out.append({"case": case, "vllm": v, "memfit": m, "mismatch": diff})
    return out


def _fmt(row: dict[str, Any]) -> str:
    if "error" in row:
        return "refused"
    return (f"{row['num_gpu_blocks']:>8} {row['kv_cache_tokens']:>10} "
            f"{row['max_concurrency']:>8.2f}x")


def table(records: list[dict[str, Any]]) -> str:
    """A per-model summary and every mismatching case."""
    lines = [f"{'model':<20} {'cases':>5} {'match':>5} {'refused':>7}  mismatching fields"]
    by_model: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_model.setdefault(r["case"]["model"], []).append(r)
    for model, rs in by_model.items():
        fields = sorted({f for r in rs for f in r["mismatch"]})
        refused = sum("error" in r["vllm"] for r in rs)
        lines.append(f"{model:<20} {len(rs):>5} {sum(not r['mismatch'] for r in rs):>5} "
                     f"{refused:>7}  {', '.join(fields) or '-'}")
    bad = [r for r in records if r["mismatch"]]
    if bad:
        lines.append("")
        lines.append(f"{'model':<20} {'tp':>2} {'kv':>4} {'async':>5} {'len':>6} {'GiB':>5}  "
                     f"{'vLLM blocks/tokens/conc':>29}  {'memfit blocks/tokens/conc':>29}  fields")
        for r in bad:
            c = r["case"]
            lines.append(f"{c['model']:<20} {c['tp']:>2} {c['kv_cache_dtype']:>4} "
                         f"{c['async_scheduling']!s:>5} {c['max_model_len'] or 'ctx'!s:>6} "
                         f"{c['memory_gib']:>5}  {_fmt(r['vllm']):>29}  {_fmt(r['memfit']):>29}"
                         f"  {','.join(r['mismatch'])}")
    return "\n".join(lines)


CASE_COLUMNS = ("model", "tp", "kv_cache_dtype", "block_size", "async_scheduling",
                "max_model_len", "max_num_batched_tokens", "memory_gib", "prefix_caching",
                "gpu", "speculative")
RESULT_COLUMNS = ("max_model_len", "block_size", "bytes_per_block", "num_gpu_blocks",
                  "kv_cache_tokens", "max_concurrency", "fits", "max_model_len_that_fits")


def stored(records: list[dict[str, Any]], versions: dict[str, str], memfit_python: str,
           date: str) -> str:
    """The results file, one line per case: the case, vLLM's figures (memfit's are equal where
    ``mismatch`` is empty; mismatching cases keep both sides whole under ``mismatches``) and
    an index into the distinct KV cache group lists."""
    group_lists: list[Any] = []
    index: dict[str, int] = {}
    rows = []
    for r in records:
        v = r["vllm"]
        if "error" in v:
            result: Any = v["error"]
            gid = None
        else:
            result = [v[c] for c in RESULT_COLUMNS]
            key = json.dumps(v["groups"])
            gid = index.setdefault(key, len(group_lists))
            if gid == len(group_lists):
                group_lists.append([[g["kind"], g["layers"], g["block_size"], g["page_size_bytes"]]
                                    for g in v["groups"]])
        rows.append(json.dumps({"case": [r["case"][c] for c in CASE_COLUMNS], "vllm": result,
                                "groups": gid, "mismatch": r["mismatch"]}))
    exe = Path(sys.executable)
    head = {
        "what": "memfit.serve_plan against vLLM's own KV cache code, exactly "
                "(bench/serving_vllm_parity.py)",
        "date": date,
        "command": " ".join([str(exe.relative_to(ROOT)) if exe.is_relative_to(ROOT) else
                             str(exe), *sys.argv]),
        "versions": versions, "memfit_python": memfit_python, "attention_backend": "FLASH_ATTN",
        "kv_cache_layout": sorted({r["vllm"].get("kv_cache_layout") for r in records
                                   if "error" not in r["vllm"]}),
        "cases": len(records), "mismatching": sum(bool(r["mismatch"]) for r in records),
        "refused_by_both": sum("error" in r["vllm"] and "error" in r["memfit"]
                               for r in records),
        "models": {k: v.get("_source") for k, v in load_models().items()},
        "case_columns": CASE_COLUMNS, "result_columns": RESULT_COLUMNS,
        "group_columns": ("kind", "layers", "block_size", "page_size_bytes"),
        "mismatches": [r for r in records if r["mismatch"]],
    }
    text = json.dumps(head, indent=1)
    groups = ",\n".join(json.dumps(g) for g in group_lists)
    return (text[:-2] + ',\n "group_lists": [\n' + groups + '\n ],\n "rows": [\n'
            + ",\n".join(rows) + "\n ]\n}\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--side", choices=("both", "vllm", "memfit"), default="both")
    ap.add_argument("--quick", action="store_true", help="a small grid (TP 1-2, 1 and 7.5 GiB)")
    ap.add_argument("--models", help="comma-separated model names (default: all)")
    ap.add_argument("--out", help="where to write the JSON (default: bench/results/...)")
    ap.add_argument("--memfit-python", default=os.environ.get(
        "MEMFIT_PYTHON", "/work/main/.venv/bin/python"))
    ap.add_argument("--memfit-src", default=str(ROOT / "src"),
                    help="the memfit sources the memfit side imports (PYTHONPATH)")
    args = ap.parse_args(argv)
    cases = grid(args.quick, args.models.split(",") if args.models else None)
    if args.side == "memfit":
        rows = memfit_side(cases)
        Path(args.out or "memfit-side.json").write_text(json.dumps(rows))
        return 0
    t0 = time.perf_counter()
    vllm_rows, versions = vllm_side(cases)
    t_vllm = time.perf_counter() - t0
    if args.side == "vllm":
        Path(args.out or "vllm-side.json").write_text(json.dumps(
            {"versions": versions, "rows": vllm_rows}))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        mf = Path(tmp) / "memfit.json"
        env = {**os.environ, "PYTHONPATH": args.memfit_src}
        cmd = [args.memfit_python, str(Path(__file__).resolve()), "--side", "memfit",
               "--out", str(mf)] + (["--quick"] if args.quick else []) + \
            (["--models", args.models] if args.models else [])
        subprocess.run(cmd, check=True, env=env, cwd=ROOT)
        memfit_rows = json.loads(mf.read_text())
    records = compare(cases, vllm_rows, memfit_rows)
    print(table(records))
    mismatches = sum(bool(r["mismatch"]) for r in records)
    print(f"\n{len(records)} cases, {mismatches} mismatching; vLLM side {t_vllm:.0f} s")
    date = _dt.date.today().isoformat()
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / \
        f"serving-vllm-parity-cpu-{date}{'-quick' if args.quick else ''}.json"
    out.write_text(stored(records, versions, args.memfit_python, date))
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
