"""The activation peak of vLLM's profile run, traced on the real transformers module.

vLLM sizes its KV pool after one profile run
(``vllm/v1/worker/gpu_worker.py: Worker.determine_available_memory``): inside
``vllm/utils/mem_utils.py: memory_profiling`` it runs
``vllm/v1/worker/gpu_model_runner.py: GPUModelRunner.profile_run`` and reads the allocator's
``allocated_bytes.all.peak``; the peak above what was allocated before the run is the line
``torch peak memory increase`` of ``MemoryProfilingResult.__repr__``. ``profile_run`` does:

1. (a multimodal model only) the vision encoder on a dummy batch of the largest items, its
   outputs kept in the encoder cache until the end: not traced here;
   :mod:`memfit.serving.multimodal` adds it from vLLM's code;
2. ``_dummy_run(max_num_tokens, is_profile=True)``: one forward of
   ``max_num_batched_tokens`` prefill tokens split over ``min(tokens, max_num_seqs)``
   requests, eager (``force_eager=is_profile``) and with no attention metadata, so each
   attention layer returns its output buffer zero-filled
   (``vllm/v1/attention/backends/flash_attn.py: FlashAttentionImpl.forward``: "Profiling
   run"): no quadratic scores, no KV writes. It returns the last layer's hidden states (all
   tokens) and their rows at each request's last token;
3. ``_dummy_sampler_run`` on those rows, *while the hidden states of all tokens are still
   referenced* by ``profile_run``: logits over ``max_num_seqs`` rows, then the sampler twice
   with top-k = vocab − 1 and top-p = 0.9 (the second time with a per-request generator).

The model forward (2). vLLM runs its own model code (``vllm/model_executor/models/llama.py``):
fused QKV and gate-up projections, ``SiluAndMul``, a fused add-RMSNorm that keeps two
``tokens × hidden`` tensors between sub-blocks (``hidden_states`` and ``residual``, updated in
place), attention that allocates its output and nothing else. Tracing transformers' module as
it is would overcount: its eager frames hold the embedding output, the layer's input, the
residual and the normed input at once (4 × ``tokens × hidden``, not 2), and its RMSNorm makes
float32 copies. What a sub-block *itself* allocates is the same in both codes where it matters:
transformers' MLP holds ``act(gate)``, ``up`` and their product (3 × ``tokens ×
intermediate``), vLLM's the fused ``gate_up`` (2 ×) and ``SiluAndMul``'s output (1 ×); Q, K, V
are the bytes of the fused QKV. So:

- the real transformers base model (``AutoModel``, no LM head: vLLM computes logits only for
  the sampled rows) is built on the meta device from the config with, per TP rank, the heads,
  the KV heads and the MLP widths divided by ``tp`` (vLLM's ``QKVParallelLinear``,
  ``MergedColumnParallelLinear``; the hidden size and the embedding's output are whole on every
  rank) and traced by :func:`memfit.estimate` (inference, CUDA target: the caching allocator's
  512-byte blocks) on ``(1, max_num_batched_tokens)`` token ids. All layers are traced
  (identical layers are replayed, so 32 layers of Llama-3-8B take well under a second); a
  mixed-layer model (dense and MoE layers) gets each kind;
- the attention function is the profile run's, registered with transformers'
  ``AttentionInterface`` under a name of its own (:func:`_profile_attention`): the output
  buffer, zero-filled, and no mask. Q, K, V, the rotary embedding and ``o_proj`` stay
  transformers' own code. SDPA would not do: with a sliding window or soft-capping it takes a
  mask or the math kernel, whose scores grow with tokens² (a Mistral layer at 8192 tokens), and
  some models (Gemma-2, gpt-oss) have no SDPA path at all;
- a marker op at the entry of each sub-block of each decoder layer (``self_attn``, ``mlp``, ...)
  gives the bytes alive there; the sub-block's *transient* is its highest point above them;
- the forward peak is the largest transient of a sub-block other than a norm (vLLM's fused
  RMSNorm allocates only its output) plus the two residual-stream tensors. Since every layer's
  activations are freed before the next layer runs, the peak does not grow with depth: a
  2-layer and a 4-layer trace of the same layer give the same number (tested).

The sampler (3) is arithmetic on ``vllm/v1/sample``'s code, on ``R = min(max_num_batched_tokens,
max_num_seqs)`` rows and the vocabulary ``V`` (padded to 64 for the LM head's output,
``vocab_parallel_embedding.py: pad_vocab_size``); see :mod:`memfit.serving.sampler`.

The profile run's peak is the larger of the forward's and the sampler phase's (the forward's
activations are freed before the sampler runs, except the final hidden states).

Other releases (``engine_version``, :data:`memfit.serving.budget.ENGINE_VERSIONS`): vLLM 0.11.0
and V0 (0.6.4.post1, 0.7.3) run the same forward (vLLM's fused layers, eager, attention writing
only its output) and a sampler that sorts the vocabulary (:mod:`memfit.serving.sampler`: 38 bytes
a logit inside ``logits.sort``), which sets the peak at their default 256 or 1,024 sequences.

Known limitations: the transformers sub-blocks keep a few temporaries vLLM's compiled code fuses
(rotary embedding's copies of Q and K; ``torch.compile`` also frees the normed input after the
first GEMM, which the two-tensor stream keeps): an overestimate of at most ``tokens × hidden``
bytes on the MLP, more on attention-bound layers; a transformers MLP with a fused ``gate_up``
(Phi-3) holds it while computing the product, one ``tokens × intermediate`` more than vLLM.
Mixture-of-experts layers are traced as transformers runs them (balanced routing), not as
vLLM's ``fused_moe`` workspaces; MLA, Mamba and linear-attention layers are traced with their
widths undivided by ``tp``; the vision encoder, LoRA, speculative decoding and pipeline
parallelism are not modelled; nor are the cuBLAS workspaces, which belong with the memory
outside the activations.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from memfit.errors import MemfitError
from memfit.serving.budget import DEFAULT_ENGINE_VERSION, EngineVersion
from memfit.serving.budget import engine_version as engine_version_spec
from memfit.serving.kv_spec import _check_tp_heads, _divide, text_config
from memfit.serving.sampler import DEFAULT_NUM_SMS, SamplerPeak, sampler_peak
from memfit.serving.sampler import allocator_bytes as _blocks

__all__ = ["DEFAULT_NUM_SMS", "ProfilePeak", "SamplerPeak", "profile_activation_peak",
           "sampler_peak"]

# The MLP widths vLLM's column-parallel layers divide by tp (per expert for MoE).
_TP_WIDTHS = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")
_MARKER = "aten.alias.default"
_TORCH_DTYPES = {"float16": "float16", "bfloat16": "bfloat16"}


@dataclass(frozen=True, kw_only=True)
class ProfilePeak:
    """The activation peak of vLLM's profile run on one GPU of the TP group: the bytes above
    the weights at the run's highest point (vLLM's "torch peak memory increase", less the
    cuBLAS workspace). ``int(peak)`` is ``peak.total_bytes``.

    Known limitations: see :mod:`memfit.serving.profile_run` (the vision encoder, MoE's fused
    kernels, MLA/Mamba widths under TP, and the temporaries vLLM's compiled code fuses).
    """

    total_bytes: int
    """``max(forward_peak_bytes, sampler.peak_bytes)``."""
    forward_peak_bytes: int
    """``stream_bytes`` plus the largest sub-block transient (``block_bytes[peak_block]``)."""
    stream_bytes: int
    """vLLM's residual stream between sub-blocks: ``hidden_states`` and ``residual``, two
    ``tokens × hidden`` tensors in the model dtype."""
    block_bytes: Mapping[str, int]
    """Each decoder sub-block's transient (its highest point above the bytes alive at its
    entry), the largest over the layers, as transformers' module allocates it."""
    peak_block: str
    """The sub-block whose transient sets the forward peak (norms excluded)."""
    sampler: SamplerPeak
    """The sampler phase (:func:`sampler_peak`)."""
    transformers_forward_bytes: int
    """For comparison: transformers' own forward traced as it is (its peak above the weights,
    without cuBLAS workspaces): what a plain trace would have said."""
    num_tokens: int
    tp: int
    trace_seconds: float
    notes: tuple[str, ...] = field(default=())
    engine_version: str = DEFAULT_ENGINE_VERSION
    """The vLLM release whose profile run this is (the sampler phase's code path)."""

    @property
    def sampler_peak_bytes(self) -> int:
        """The sampler phase's highest point (what it holds, the forward's output included)."""
        return self.sampler.peak_bytes

    def __int__(self) -> int:
        return self.total_bytes


def _engine_config(config: Mapping[str, Any], tp: int) -> dict[str, Any]:
    """One TP rank's text config: heads, KV heads and MLP widths divided as vLLM's parallel
    layers divide them; ``head_dim`` pinned so that dividing the heads does not change it."""
    cfg = text_config(config)
    missing = [k for k in ("model_type", "hidden_size", "num_hidden_layers",
                           "num_attention_heads", "vocab_size") if cfg.get(k) is None]
    if not any(cfg.get(k) is not None for k in _TP_WIDTHS):
        missing.append("intermediate_size")
    if missing:
        raise MemfitError(f"the config has no {', '.join(missing)}: the profile run's "
                          "activation peak needs the model's full config.json (pass the "
                          "checkpoint's config, not a KV-only preset)")
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    out = dict(cfg)
    out["num_key_value_heads"] = _check_tp_heads(heads, kv_heads, tp)
    out["num_attention_heads"] = _divide(heads, tp, "num_attention_heads")
    out["head_dim"] = head_dim
    for key in _TP_WIDTHS:
        if cfg.get(key) is not None:
            out[key] = _divide(int(cfg[key]), tp, key)
    out["use_cache"] = False
    out["pad_token_id"] = None  # the embedding's padding row changes no byte
    for key in ("torch_dtype", "dtype", "architectures", "auto_map", "quantization_config"):
        out.pop(key, None)
    return out


def _torch_dtype(config: Mapping[str, Any], dtype_bytes: int) -> Any:
    import torch

    if dtype_bytes == 4:
        return torch.float32
    if dtype_bytes != 2:
        raise MemfitError(f"dtype_bytes must be 2 (bf16/fp16) or 4 (fp32), got {dtype_bytes}: "
                          "vLLM runs activations in the model dtype")
    cfg = text_config(config)
    name = str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16").removeprefix("torch.")
    return getattr(torch, _TORCH_DTYPES.get(name, "bfloat16"))


_ATTENTION = "memfit_vllm_profile_run"
"""The name under which :func:`_register_profile_attention` registers the profile run's
attention with transformers' ``AttentionInterface`` (and its mask with
``AttentionMaskInterface``)."""


def _profile_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                       *args: Any, **kwargs: Any) -> tuple[Any, None]:
    """vLLM's attention in the profile run: with no attention metadata the backend returns its
    output buffer zero-filled (``vllm/v1/attention/backends/flash_attn.py:
    FlashAttentionImpl.forward``, "Profiling run"), the buffer ``unified_attention_with_output``
    allocates: ``tokens × heads × head_dim`` in the query's dtype. Returned in the layout
    transformers' attention functions return, ``(batch, tokens, heads, head_dim)``."""
    batch, heads, tokens, _ = query.shape
    return query.new_zeros(batch, tokens, heads, value.shape[-1]), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """The profile run's attention takes no mask (vLLM's kernels are causal by construction)."""
    return None


def _register_profile_attention() -> None:
    """Register :func:`_profile_attention` under its own name (transformers' documented way to
    add an attention function; no existing implementation is replaced)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(_ATTENTION, _profile_attention)
    AttentionMaskInterface.register(_ATTENTION, _no_mask)


def _build(cfg: dict[str, Any], dtype: Any) -> Any:
    """transformers' base model (no LM head) of ``cfg`` on the meta device, its attention
    function the profile run's (:func:`_profile_attention`)."""
    import torch

    from memfit._noise import quiet_imports

    try:
        with quiet_imports():  # torchao's and transformers' import-time log lines
            import transformers
    except ImportError:
        raise MemfitError("the profile run's activation peak traces the transformers module: "
                          "pip install 'memfit[hf]'") from None
    _register_profile_attention()
    model_type = cfg.pop("model_type")
    try:
        hf_config = transformers.AutoConfig.for_model(model_type, **cfg)
    except ValueError as exc:
        raise MemfitError(f"transformers {transformers.__version__} does not know model type "
                          f"{model_type!r} ({exc}); upgrade transformers or pass a config of a "
                          "model it knows") from None
    try:
        with torch.device("meta"):
            model = transformers.AutoModel.from_config(hf_config, attn_implementation=_ATTENTION,
                                                       dtype=dtype)
    except ValueError as exc:
        raise MemfitError(f"transformers' {model_type!r} model takes no attention function "
                          f"but its own ({exc}); its profile-run peak cannot be traced") from None
    return model.eval()


def _decoder_layers(model: Any, num_layers: int) -> tuple[str, Any]:
    """The ``nn.ModuleList`` of decoder layers and its dotted name."""
    from torch import nn

    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == num_layers and name:
            return name, module
    raise MemfitError(f"{type(model).__name__} has no list of {num_layers} decoder layers; "
                      "its profile-run peak cannot be traced")


def _mark_sub_blocks(layers: Any) -> None:
    """A forward pre-hook on each sub-block of each decoder layer that runs one op allocating
    nothing (``aten.alias`` of its first tensor input): a timeline point at the sub-block's entry,
    whose bytes are those alive there (frees of the previous sub-block's temporaries included).
    The hook runs before the trace's module attribution enters the sub-block, so the point is
    attributed to the layer; the sub-block is named by the op after it."""
    import torch

    def marker(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor):
                torch.ops.aten.alias.default(value)
                return

    for layer in layers:
        for child in layer.children():
            child.register_forward_pre_hook(marker, with_kwargs=True)


def _sub_block_transients(timeline: Any, layer_names: set[str], runtime_index: int,
                          ) -> dict[str, tuple[int, bool]]:
    """``{sub-block: (largest transient over the layers, is a norm)}`` from the timeline's
    marker points (see :func:`_mark_sub_blocks`). Bytes exclude the runtime category (the cuBLAS
    workspace, allocated at the first matmul)."""

    def live(i: int) -> int:
        b = timeline[i].bytes
        return sum(b) - b[runtime_index]

    out: dict[str, tuple[int, bool]] = {}
    n = len(timeline)
    for i, point in enumerate(timeline):
        if point.op != _MARKER or point.module not in layer_names or i + 1 >= n:
            continue
        inner = timeline[i + 1].module
        if not inner.startswith(point.module + "."):
            continue  # the sub-block ran no op of its own
        child = inner[len(point.module) + 1:].split(".")[0]
        name = f"{point.module}.{child}"
        base = peak = live(i)
        j = i + 1
        while j < n and timeline[j].op != _MARKER and (
                timeline[j].module == name or timeline[j].module.startswith(name + ".")):
            peak = max(peak, live(j))
            j += 1
        previous = out.get(child, (0, False))[0]
        out[child] = (max(previous, peak - base), "norm" in child.lower())
    return out


@dataclass(frozen=True)
class _ForwardTrace:
    """What one trace of the forward gives (cached per config, tokens, tp and dtype)."""

    blocks: tuple[tuple[str, int, bool], ...]
    stream: int
    plain: int
    seconds: float


@functools.lru_cache(maxsize=64)
def _forward_trace(config_json: str, max_num_batched_tokens: int, tp: int,
                   dtype_bytes: int) -> _ForwardTrace:
    """Trace the forward of ``config_json`` (a ``config.json`` dict, JSON-encoded so that it
    hashes) once per ``(config, tokens, tp, dtype)``: the trace does not depend on the sampler,
    the engine version or ``max_num_seqs``, and a bench of many logs of one model reuses it."""
    import torch

    from memfit.categories import MemoryCategory
    from memfit.ledger import CATEGORIES
    from memfit.trace import estimate

    config = json.loads(config_json)
    started = time.perf_counter()
    cfg = _engine_config(config, tp)
    dtype = _torch_dtype(config, dtype_bytes)
    hidden = int(cfg["hidden_size"])
    num_layers = int(cfg["num_hidden_layers"])
    model = _build(cfg, dtype)
    prefix, layers = _decoder_layers(model, num_layers)
    _mark_sub_blocks(layers)
    precision = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    ids = torch.zeros(1, max_num_batched_tokens, dtype=torch.long, device="meta")
    est = estimate(model, {"input_ids": ids}, optimizer=None, precision=precision,
                   device="cuda", steps=1)
    blocks = _sub_block_transients(est.timeline, {f"{prefix}.{i}" for i in range(num_layers)},
                                   CATEGORIES.index(MemoryCategory.RUNTIME))
    if not any(not norm for _, norm in blocks.values()):
        raise MemfitError(f"{type(model).__name__}: no decoder sub-block was seen in the trace; "
                          "its profile-run peak cannot be traced")
    stream = 2 * _blocks(max_num_batched_tokens * hidden * dtype.itemsize)
    in_allocator = sum(v for k, v in est.runtime.items() if k in est.runtime_in_allocator)
    plain = est.peak_bytes - est.breakdown[MemoryCategory.WEIGHTS] - in_allocator
    return _ForwardTrace(blocks=tuple((k, v, norm) for k, (v, norm) in blocks.items()),
                         stream=stream, plain=plain, seconds=time.perf_counter() - started)


def profile_activation_peak(config: Mapping[str, Any], *, max_num_batched_tokens: int,
                            max_num_seqs: int, tp: int = 1, dtype_bytes: int = 2,
                            num_sms: int = DEFAULT_NUM_SMS,
                            engine_version: str | EngineVersion = DEFAULT_ENGINE_VERSION,
                            ) -> ProfilePeak:
    """The activation peak of a vLLM release's profile run (0.33.0 by default; see
    ``engine_version`` below) on one GPU of a ``tp`` group, traced on the transformers module of
    ``config`` (a ``config.json`` dict) at the engine's dummy batch: ``max_num_batched_tokens``
    prefill tokens, the sampler over ``max_num_seqs`` rows. See the module docstring for what is
    traced and why.

    ``num_sms``: the GPU's streaming multiprocessors (132 on an H100 SXM or H200, 108 on an
    A100), the rows of the sampler's Triton buffer (0.33 only).

    ``engine_version``: a release of :data:`memfit.serving.budget.ENGINE_VERSIONS`; it picks
    the sampler phase (:func:`sampler_peak`). The forward is the same model in each (vLLM's
    fused layers, eager in the profile run); others are refused (one line).

    The forward's trace is cached per ``(config, tokens, tp, dtype)``; ``trace_seconds`` is the
    first trace's.

    >>> cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 256,
    ...        "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 1000}
    >>> peak = profile_activation_peak(cfg, max_num_batched_tokens=128, max_num_seqs=16)
    >>> peak.peak_block, peak.block_bytes["mlp"] == 3 * 128 * 256 * 2
    ('mlp', True)
    """
    for name, value in (("max_num_batched_tokens", max_num_batched_tokens),
                        ("max_num_seqs", max_num_seqs), ("tp", tp)):
        if value < 1:
            raise MemfitError(f"{name} must be a positive integer, got {value}")
    version = engine_version_spec(engine_version)
    cfg = _engine_config(config, tp)  # refuses an incomplete config before any trace
    dtype_size = 4 if dtype_bytes == 4 else _torch_dtype(config, dtype_bytes).itemsize
    hidden = int(cfg["hidden_size"])
    vocab = int(cfg["vocab_size"])
    notes: list[str] = []
    full = text_config(config)
    if any(full.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        notes.append("mixture-of-experts layers traced as transformers runs them (balanced "
                     "routing), not as vLLM's fused_moe")
    if isinstance(config.get("vision_config"), Mapping):
        notes.append("the vision encoder's dummy batch and encoder cache are not in this "
                     "trace (memfit.serving.multimodal adds them)")
    if tp > 1 and any(full.get(k) for k in ("kv_lora_rank", "mamba_d_state", "linear_num_key_heads",
                                            "ssm_state_size")):
        notes.append("MLA / Mamba / linear-attention widths traced undivided by tp")

    try:
        trace = _forward_trace(json.dumps(config, sort_keys=True, default=str),
                               max_num_batched_tokens, tp, dtype_bytes)
    except (RuntimeError, TypeError, ValueError, IndexError, AttributeError) as exc:
        # transformers' module of this type did not run with one TP rank's widths (some
        # classes derive head_dim from hidden / heads and ignore the config's head_dim)
        first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        raise MemfitError(f"tracing the profile run of {cfg['model_type']!r} at tp {tp} failed "
                          f"({first}); pass --activation-peak BYTES (activation_peak_bytes=, "
                          "e.g. the figure a startup log prints) to plan without it") from None
    candidates = {k: v for k, v, norm in trace.blocks if not norm}
    peak_block = max(candidates, key=lambda k: candidates[k])
    forward = trace.stream + candidates[peak_block]
    sampler = sampler_peak(vocab_size=vocab, hidden_size=hidden,
                           max_num_batched_tokens=max_num_batched_tokens,
                           max_num_seqs=max_num_seqs, tp=tp, dtype_bytes=dtype_size,
                           num_sms=num_sms, engine_version=version)
    return ProfilePeak(total_bytes=max(forward, sampler.peak_bytes), forward_peak_bytes=forward,
                       stream_bytes=trace.stream, block_bytes={k: v for k, v, _ in trace.blocks},
                       peak_block=peak_block, sampler=sampler,
                       transformers_forward_bytes=trace.plain,
                       num_tokens=max_num_batched_tokens, tp=tp,
                       trace_seconds=trace.seconds, notes=tuple(notes),
                       engine_version=version.version)
