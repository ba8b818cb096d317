"""memfit's CUDA prediction against memory figures that others measured on NVIDIA GPUs.

    python bench/published.py [--only ID_SUBSTRING] [--out PATH] [--no-write]

Cases live in ``bench/published/*.json``, one file per source (PyTorch's allocator tests, the
Liger-Kernel benchmark table, ...). Each file is ``{"source": "...", "cases": [...]}`` and each
case carries (``validate_case`` checks it):

- ``id``, ``kind`` (``allocator``, ``runtime``, ``op_step``, ``model_step``), ``method``;
- ``source``: ``url``, or ``repo`` + ``path`` + ``commit`` (40 hex digits) where the figure is;
- ``quote``: the line at the source, verbatim;
- ``quantity``: what was measured (:data:`QUANTITIES`);
- ``published``: ``bytes`` (and the ``value``/``unit`` as written, with the ``derivation``
  when the quote is a formula, e.g. PyTorch's tests write ``4 * 21 * 1024 * 1024``);
- ``config``: enough to rebuild the step; ``measured_on``: GPU, torch, CUDA as stated;
- ``exercises``: the memfit feature the case checks.

Methods (how memfit predicts each case):

- ``allocator_sim``: the case's allocation script (``malloc``/``free``/``empty_cache`` in
  order, per stream or private pool) replayed through ``memfit.trace.allocator``'s
  ``CachingAllocatorSim`` with the case's ``PYTORCH_CUDA_ALLOC_CONF``
  (``memfit.runtime.allocator_options_from_env``); the stat the test reads is taken from the
  simulator's counters or its ``snapshot()``.
- ``runtime``: memfit's runtime constants (``memfit.runtime``).
- ``trace``: ``memfit.estimate(..., device="cuda")`` on the step the case describes, built on
  meta tensors (the builders below rebuild each benchmark's code, cited in the case).

- ``plan``: ``memfit plan`` as the CLI runs it (``config["plan"]``: the model, RunConfig fields
  and ``method``, the formulas by default or ``trace``), on a whole published training run.

Targets (issue 11), over the cases of the other methods whose quantity is an allocator
statistic: median |error| <= 2 %, max |error| <= 5 %, and no case under-predicted by more than
3 %; ``plan`` cases are reported beside them. The run prints the table and
whether each target is met, and writes ``bench/results/published-<date>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import inspect
import json
import platform
import re
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
CASES_DIR = HERE / "published"
RESULTS_DIR = HERE / "results"

KINDS = ("allocator", "runtime", "op_step", "model_step")
METHODS = ("allocator_sim", "runtime", "trace", "plan")
QUANTITIES = ("max_memory_allocated", "max_memory_reserved", "memory_allocated",
              "memory_reserved", "active_bytes.all.allocated", "nvidia-smi")
# Allocator statistics: the targets apply to these (nvidia-smi also counts the CUDA context).
ALLOCATOR_QUANTITIES = frozenset(QUANTITIES) - {"nvidia-smi"}
TARGET_MEDIAN = 2.0  # percent
TARGET_MAX = 5.0
TARGET_UNDER = 3.0
_SHA = re.compile(r"^[0-9a-f]{40}$")


# ----------------------------------------------------------------------------- case files
def validate_case(case: dict[str, Any]) -> list[str]:
    """Problems with one case's schema (empty when it is well formed)."""
    problems = []
    cid = case.get("id", "<no id>")
    for key in ("id", "kind", "method", "source", "quote", "quantity", "published", "config",
                "exercises"):
        if key not in case:
            problems.append(f"{cid}: missing {key!r}")
    if problems:
        return problems
    if case["kind"] not in KINDS:
        problems.append(f"{cid}: kind {case['kind']!r} not in {KINDS}")
    if case["method"] not in METHODS:
        problems.append(f"{cid}: method {case['method']!r} not in {METHODS}")
    if case["quantity"] not in QUANTITIES:
        problems.append(f"{cid}: quantity {case['quantity']!r} not in {QUANTITIES}")
    if not isinstance(case["quote"], str) or not case["quote"].strip():
        problems.append(f"{cid}: empty quote")
    src = case["source"]
    has_url = isinstance(src.get("url"), str) and src["url"].startswith("http")
    has_repo = all(isinstance(src.get(k), str) and src[k] for k in ("repo", "path", "commit"))
    if not (has_url or has_repo):
        problems.append(f"{cid}: source needs a url or repo + path + commit")
    if has_repo and not _SHA.match(src["commit"]):
        problems.append(f"{cid}: source commit {src['commit']!r} is not a 40-hex commit hash")
    pub = case["published"]
    if not isinstance(pub.get("bytes"), int) or pub["bytes"] <= 0:
        problems.append(f"{cid}: published.bytes must be a positive int")
    if not isinstance(case["config"], dict) or not case["config"]:
        problems.append(f"{cid}: empty config")
    if not case["exercises"]:
        problems.append(f"{cid}: say which memfit feature the case exercises")
    if not problems and case["quantity"] in ALLOCATOR_QUANTITIES:
        problems += _gpu_problems(case)
    return problems


def case_gpu(config: dict[str, Any]) -> Any:
    """The GPU a case ran on (a :class:`memfit.GpuSpec`, or None): ``config["gpu"]``, a catalog
    name or one that ``config["gpu_file"]`` adds (a ``--gpu-file`` JSON, relative to
    ``bench/published/``: a board memfit's catalog does not list)."""
    import memfit

    if not config.get("gpu"):
        return None
    extra = CASES_DIR / config["gpu_file"] if config.get("gpu_file") else None
    return memfit.get_gpu(config["gpu"], extra)


def _gpu_problems(case: dict[str, Any]) -> list[str]:
    """An allocator statistic larger than the case's GPU: the case names the wrong board. The
    caching allocator holds device memory only (``cudaMalloc``, or ``cuMemCreate`` pages with
    expandable segments: ``c10/cuda/CUDACachingAllocator.cpp``), so no allocated or reserved
    peak exceeds the device's ``total_memory``; a simulator given a smaller device empties its
    cache to stay under it (``release_cached_blocks``) and reserves less than the run did."""
    from memfit.errors import MemfitError

    cid = case["id"]
    try:
        gpu = case_gpu(case["config"])
    except MemfitError as exc:
        return [f"{cid}: config.gpu: {exc}"]
    published = case["published"]["bytes"]
    if gpu is not None and published > gpu.usable_bytes:
        return [f"{cid}: the published {published} bytes of {case['quantity']} exceed the "
                f"{gpu.usable_bytes} bytes of the {gpu.label} (config.gpu); name the board the "
                f"run was measured on (one outside memfit's catalog in a --gpu-file JSON, "
                f"config.gpu_file)"]
    return []


def load_cases(directory: Path = CASES_DIR) -> list[dict[str, Any]]:
    """Every case of every ``*.json`` file in ``directory``, with its file name in ``file``."""
    cases = []
    for path in sorted(directory.glob("*.json")):
        data = json.loads(path.read_text())
        for case in data["cases"]:
            cases.append({**case, "file": path.name})
    ids = [c["id"] for c in cases]
    dupes = {i for i in ids if ids.count(i) > 1}
    if dupes:
        raise ValueError(f"duplicate case ids: {sorted(dupes)}")
    return cases


# ----------------------------------------------------------------------------- allocator sim
def _sim_options(conf: str) -> tuple[dict[str, Any], list[str]]:
    """CachingAllocatorSim keyword arguments for a PYTORCH_CUDA_ALLOC_CONF string, and the
    options the simulator does not take (reported, not silently dropped)."""
    from memfit.runtime import allocator_options_from_env
    from memfit.trace.allocator import CachingAllocatorSim

    options = allocator_options_from_env(conf) if conf else {}
    accepted = set(inspect.signature(CachingAllocatorSim).parameters)
    renamed = {"max_split_size_mb": "max_split_size",
               "max_non_split_rounding_mb": "max_non_split_rounding_size",
               "large_segment_size_mb": "large_segment_size"}
    kwargs: dict[str, Any] = {}
    ignored = []
    for key, value in options.items():
        name = renamed.get(key, key)
        if name in accepted:
            if key.endswith("_mb") and isinstance(value, int):
                value <<= 20
            kwargs[name] = value
        else:
            ignored.append(key)
    return kwargs, ignored


def _pool_reserved(sim: Any, pool: str) -> int:
    return sum(s["total_size"] for s in sim.snapshot() if s["segment_type"] == pool)


def _stat(sim: Any, name: str, cumulative_active: int) -> int:
    if name == "reserved":
        return int(sim.reserved_bytes)
    if name == "allocated":
        return int(sim.allocated_bytes)
    if name == "peak_allocated":
        return int(sim.peak_allocated_bytes)
    if name == "peak_reserved":
        return int(sim.peak_reserved_bytes)
    if name in ("reserved_small", "reserved_large"):
        return _pool_reserved(sim, name.removeprefix("reserved_"))
    if name == "active_allocated_cumulative":
        return cumulative_active
    raise ValueError(f"unknown allocator stat {name!r}")


def predict_allocator(config: dict[str, Any]) -> tuple[int, str]:
    """Replay ``config["script"]`` through the simulator; the measured stat (a delta between
    two marks, or a value at one mark)."""
    from memfit.trace.allocator import CachingAllocatorSim

    kwargs, ignored = _sim_options(config.get("alloc_conf", ""))
    sim = CachingAllocatorSim(**kwargs)
    handles: dict[str, int] = {}
    marks: dict[str, int] = {}
    measure = config["measure"]
    cumulative = 0
    for op in config["script"]:
        verb = op[0]
        if verb == "malloc":
            _, name, nbytes, *rest = op
            before = sim.allocated_bytes
            handles[name] = sim.malloc(int(nbytes), stream=int(rest[0]) if rest else 0)
            cumulative += sim.allocated_bytes - before
        elif verb == "free":
            sim.free(handles.pop(op[1]))
        elif verb == "empty_cache":
            sim.empty_cache()
        elif verb == "mark":
            marks[op[1]] = _stat(sim, measure["stat"], cumulative)
        else:
            raise ValueError(f"unknown allocator script op {op!r}")
    value = marks[measure["to"]] - (marks[measure["from"]] if measure.get("from") else 0)
    note = f"PYTORCH_CUDA_ALLOC_CONF options not simulated: {ignored}" if ignored else ""
    return value, note


def predict_runtime(config: dict[str, Any]) -> tuple[int, str]:
    from memfit import runtime

    fn = getattr(runtime, config["function"])
    return int(fn(**config.get("kwargs", {}))), ""


# ----------------------------------------------------------------------------- trace builders
class _KeepGrads(torch.optim.Optimizer):
    """An optimizer that does nothing: no step, and ``zero_grad`` keeps the gradients, as a
    benchmark loop that calls ``backward`` repeatedly without zeroing accumulates into them."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {})

    def step(self, closure: Any = None) -> None:
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None


class _InjectGrad(torch.autograd.Function):
    """A scalar "loss" whose backward hands ``dy`` to ``y``: ``y.backward(dy)`` as a loss.

    ``y.backward(dy)`` with ``dy`` of another dtype than ``y``: the engine's
    ``validate_outputs`` (``torch/csrc/autograd/engine.cpp``, called by ``Engine::execute`` on
    the root gradients) casts ``dy`` into the caller's gradient list, which holds the cast copy
    until ``backward`` returns. The cast here is kept on ``ctx`` (alive until the graph is
    freed) for the same lifetime."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
        ctx.dy = dy
        ctx.y_dtype = y.dtype
        return y.new_zeros(())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.root = ctx.dy.to(ctx.y_dtype)
        return ctx.root, None


class _RetainGraph(nn.Module):
    """Runs ``inner`` with every tensor autograd saves held in a list until the next forward:
    ``backward(retain_graph=True)`` keeps saved tensors until the graph dies, which in the
    benchmarks is the end of each iteration (the next forward)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self._kept: list[torch.Tensor] = []

    def forward(self, *args: Any) -> Any:
        self._kept.clear()

        def pack(t: torch.Tensor) -> torch.Tensor:
            self._kept.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return self.inner(*args)


class _LeafInput(nn.Module):
    """Holds a benchmark's input ``x`` (a leaf that requires grad, so its ``.grad`` persists
    across iterations like a parameter's) and its upstream gradient ``dy`` (a buffer)."""

    def __init__(self, op: nn.Module, x: torch.Tensor, dy: torch.Tensor | None,
                 extra_buffers: dict[str, torch.Tensor] | None = None) -> None:
        super().__init__()
        self.op = op
        self.x = nn.Parameter(x)
        if dy is not None:
            self.register_buffer("dy", dy)
        for name, t in (extra_buffers or {}).items():
            self.register_buffer(name, t)

    def forward(self) -> Any:
        y = self.op(self.x)
        # dy goes out with y: the loss function sees the traced copy's buffer, not this one
        return (y, self.dy) if hasattr(self, "dy") else y


_DTYPES = {"torch.float32": torch.float32, "torch.bfloat16": torch.bfloat16,
           "torch.float16": torch.float16}


class _BenchLlamaRMSNorm(nn.Module):
    """``LlamaRMSNorm`` exactly as Liger-Kernel's ``benchmark_rms_norm.py`` defines it."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


Step = dict[str, Any]  # model, inputs, loss_fn, optimizer, keep_output, steps


def _dy_loss(out: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    y, dy = out
    return _InjectGrad.apply(y, dy)


def _norm_step(op: nn.Module, unused_params: dict[str, tuple[int, ...]],
               shape: tuple[int, ...], dtype: torch.dtype) -> Step:
    # Liger builds its own module (fp32 parameters, unused here) next to the baseline's: its
    # parameters are on the device while the baseline runs.
    extra = {name: torch.empty(s, device="meta") for name, s in unused_params.items()}
    leaf = _LeafInput(op, torch.empty(shape, dtype=dtype, device="meta"),
                      torch.empty(shape, dtype=dtype, device="meta"), extra)
    model = _RetainGraph(leaf)
    return {"model": model, "inputs": (), "loss_fn": _dy_loss, "optimizer": _KeepGrads,
            "keep_output": True, "steps": 3}


def build_liger_rms_norm(cfg: dict[str, Any]) -> Step:
    """``bench_memory_rms_norm``: LigerRMSNorm + LlamaRMSNorm (fp32 weights), x (M, H) in
    ``dtype`` requiring grad, dy pre-allocated; ``full()`` = y = llama_rms(x);
    y.backward(dy, retain_graph=True), 10 times, grads never zeroed."""
    h = cfg["H"]
    with torch.device("meta"):
        op = _BenchLlamaRMSNorm(h, eps=cfg["eps"])
    return _norm_step(op, {"liger_weight": (h,)}, (cfg["M"], h), _DTYPES[cfg["dtype"]])


def build_liger_layer_norm(cfg: dict[str, Any]) -> Step:
    """``bench_memory_layer_norm``: LigerLayerNorm (fp32 weight + bias) + torch.nn.LayerNorm,
    x (M, N) requiring grad, dy pre-allocated, retain_graph=True, grads never zeroed."""
    n = cfg["N"]
    with torch.device("meta"):
        op = nn.LayerNorm(n, eps=cfg["eps"])
    return _norm_step(op, {"liger_weight": (n,), "liger_bias": (n,)}, (cfg["M"], n),
                      _DTYPES[cfg["dtype"]])


class _ClearGrads(_KeepGrads):
    """No step; ``zero_grad`` drops the gradients (a forward-only benchmark never has any)."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None


def build_liger_mlp(cfg: dict[str, Any]) -> Step:
    """``bench_memory_swiglu`` / ``bench_memory_geglu``: transformers' ``LlamaMLP(LlamaConfig(
    hidden_size, intermediate_size, hidden_act))`` in ``dtype``; x (B, T, hidden) requiring
    grad; ``full()`` = y = layer(x); y.backward(torch.randn_like(y), retain_graph=True), grads
    never zeroed. ``mode: forward``: ``fwd()`` = layer(x) only (the prediction is the forward
    phase's peak, see ``phase``)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    dtype = _DTYPES[cfg["dtype"]]
    config = LlamaConfig(hidden_size=cfg["hidden_size"],
                         intermediate_size=cfg["intermediate_size"], hidden_act=cfg["hidden_act"])
    with torch.device("meta"):
        op = LlamaMLP(config).to(dtype)
    batch = cfg.get("B", cfg.get("bsz"))
    leaf = _LeafInput(op, torch.empty(batch, cfg["T"], cfg["hidden_size"], dtype=dtype,
                                      device="meta"), None)
    model = _RetainGraph(leaf)

    forward_only = cfg.get("mode") == "forward"

    def loss_fn(y: torch.Tensor) -> torch.Tensor:
        if forward_only:  # no upstream gradient to allocate: y stands in for it
            return _InjectGrad.apply(y, y)
        return _InjectGrad.apply(y, torch.randn_like(y))  # dy made inside full(), as there

    return {"model": model, "inputs": (), "loss_fn": loss_fn,
            "optimizer": _ClearGrads if forward_only else _KeepGrads,
            "keep_output": True, "steps": 3}


class _CrossEntropyStep(nn.Module):
    def __init__(self, rows: int, vocab: int) -> None:
        super().__init__()
        self.logits = nn.Parameter(torch.empty(rows, vocab, device="meta"))
        self.register_buffer("target", torch.empty(rows, dtype=torch.long, device="meta"))
        self.ce = nn.CrossEntropyLoss()

    def forward(self) -> torch.Tensor:
        return self.ce(self.logits, self.target)


def build_liger_cross_entropy(cfg: dict[str, Any]) -> Step:
    """``bench_memory_cross_entropy``: _input (B*T, V) fp32 requiring grad, int64 target;
    ``full()`` = torch.nn.CrossEntropyLoss()(_input, target).backward(), grads never zeroed."""
    model = _CrossEntropyStep(cfg["B"] * cfg["T"], cfg["V"])
    return {"model": model, "inputs": (), "loss_fn": lambda y: y, "optimizer": _KeepGrads,
            "keep_output": False, "steps": 3}


def _zero_grads_in_place(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``zero_grad`` zeroes the gradients in place (``set_to_none=False``): the default of
    ``torch.nn.Module.zero_grad`` before torch 2.0, which the Trainer of 2022 called."""
    def zero_grad(set_to_none: bool = True) -> None:
        type(opt).zero_grad(opt, set_to_none=False)

    opt.zero_grad = zero_grad  # type: ignore[method-assign]
    return opt


def build_hf_trainer_bert(cfg: dict[str, Any]) -> Step:
    """Hugging Face ``Trainer`` on ``BertForSequenceClassification`` (bert-large-uncased's
    config), ``batch`` x ``seq`` per micro-step: eager attention (the only one in 2022),
    dropout 0.1, gradients zeroed in place between steps (so gradient accumulation changes
    nothing but the micro-batch), optional gradient checkpointing (reentrant, as in 2022) and
    fp16 autocast; optimizer ``adamw`` (per-parameter loop, like ``adamw_hf``), ``adafactor``
    or ``adamw-8bit`` (bitsandbytes)."""
    from transformers import BertConfig, BertForSequenceClassification

    from memfit.trace.optim import make_optimizer

    config = BertConfig(**cfg["model_config"])
    config._attn_implementation = cfg.get("attn_implementation", "eager")
    with torch.device("meta"):
        model = BertForSequenceClassification(config)
    model.train()
    if cfg.get("gradient_checkpointing"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    batch, seq = cfg["batch"], cfg["seq"]
    inputs = {"input_ids": torch.zeros(batch, seq, dtype=torch.long),
              "labels": torch.zeros(batch, dtype=torch.long)}
    name = cfg.get("optimizer_name", "adamw")

    def optimizer(params: Any) -> torch.optim.Optimizer:
        if name == "adamw":
            opt = torch.optim.AdamW(params, lr=5e-5, weight_decay=0.0, foreach=False)
        else:
            opt = make_optimizer(name, params, cuda_target=True)
        return _zero_grads_in_place(opt)

    return {"model": model, "inputs": inputs, "loss_fn": None, "optimizer": optimizer,
            "keep_output": False, "steps": 3}


class _InjectGrads2(torch.autograd.Function):
    """``torch.autograd.grad((a, b), ..., (da, db))`` as a scalar loss: its backward hands
    ``da`` and ``db`` to ``a`` and ``b``."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, da: torch.Tensor,
                db: torch.Tensor) -> torch.Tensor:
        ctx.grads = (da, db)
        return a.new_zeros(())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return (*ctx.grads, None, None)


class _RopeStep(nn.Module):
    """q and k as leaves in their transposed (1, heads, seq, head_dim) layout, as the benchmark
    builds them (``randn(1, seq, heads, dim).transpose(1, 2)``); cos, sin, position ids, dq and
    dk allocated before the measured function, as there."""

    def __init__(self, seq: int, q_heads: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype) -> None:
        super().__init__()

        def transposed(heads: int) -> torch.Tensor:
            return torch.empty(1, seq, heads, head_dim, dtype=dtype, device="meta").transpose(1, 2)

        self.q = nn.Parameter(transposed(q_heads))
        self.k = nn.Parameter(transposed(kv_heads))
        self.register_buffer("dq", torch.empty_like(self.q))
        self.register_buffer("dk", torch.empty_like(self.k))
        self.register_buffer("pos_ids", torch.empty(1, seq, dtype=torch.long, device="meta"))
        self.register_buffer("inv_freq", torch.empty(head_dim // 2, device="meta"))
        self.cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def _rotary(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``LlamaRotaryEmbedding.forward`` (transformers 4.44, under ``torch.no_grad``), run
        once before the measured iterations as ``cos, sin = rotary_emb(k, pos_ids)`` is: its
        matmul makes the main thread's cuBLAS workspace, which stays allocated."""
        with torch.no_grad():
            inv = self.inv_freq[None, :, None].float().expand(self.pos_ids.shape[0], -1, 1)
            freqs = (inv @ self.pos_ids[:, None, :].float()).transpose(1, 2)
            emb = torch.cat((freqs, freqs), dim=-1)
            return emb.cos().to(self.k.dtype), emb.sin().to(self.k.dtype)

    def forward(self) -> tuple[torch.Tensor, ...]:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        if self.cos_sin is None:
            self.cos_sin = self._rotary()
        cos, sin = self.cos_sin
        q_out, k_out = apply_rotary_pos_emb(self.q, self.k, cos, sin)
        return q_out, k_out, self.dq, self.dk


def build_liger_rope(cfg: dict[str, Any]) -> Step:
    """``bench_memory_rope``: transformers' ``apply_rotary_pos_emb`` (q * cos + rotate_half(q) *
    sin, the same in the installed version as in 2024's) on q (1, Hq, S, D) and k (1, Hkv, S,
    D); ``full()`` = torch.autograd.grad((q_out, k_out), (q, k), (dq, dk), retain_graph=True):
    the gradients are returned, not stored."""
    hidden = cfg.get("hidden_size", cfg.get("H"))
    seq = cfg.get("seq_len", cfg.get("T"))
    heads = cfg["num_q_heads"]
    model = _RetainGraph(_RopeStep(seq, heads, cfg["num_kv_heads"], hidden // heads,
                                   _DTYPES[cfg["dtype"]]))

    def loss_fn(out: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return _InjectGrads2.apply(*out)

    return {"model": model, "inputs": (), "loss_fn": loss_fn, "optimizer": _ClearGrads,
            "keep_output": True, "steps": 3}


BUILDERS: dict[str, Callable[[dict[str, Any]], Step]] = {
    "liger_rope": build_liger_rope,
    "hf_trainer_bert": build_hf_trainer_bert,
    "liger_rms_norm": build_liger_rms_norm,
    "liger_layer_norm": build_liger_layer_norm,
    "liger_mlp": build_liger_mlp,
    "liger_cross_entropy": build_liger_cross_entropy,
}


def _on_output(loss_of: Any) -> Any:
    """memfit's ``loss_fn(model, batch)`` from a loss of the model's output (None: the default)."""
    if loss_of is None:
        return None
    from memfit._tensors import call_model

    return lambda model, batch: loss_of(call_model(model, batch))


def predict_trace(case: dict[str, Any]) -> tuple[int, str, Any]:
    import memfit

    cfg = case["config"]
    step = BUILDERS[cfg["builder"]](cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = memfit.estimate(step["model"], step["inputs"], optimizer=step["optimizer"],
                              loss_fn=_on_output(step["loss_fn"]),
                              precision=cfg.get("precision", "fp32"),
                              device="cuda", gpu=cfg.get("gpu") or _gpu_for(case),
                              steps=step["steps"], keep_output=step["keep_output"])
    quantity = case["quantity"]
    if cfg.get("phase") == "forward":
        # The forward's own peak, from the second step on: the workspaces of autograd's
        # thread, made by the backward passes that ran earlier in the same process (the
        # benchmark runs its "full" mode first), stay allocated, as they do after the trace's
        # first backward.
        value = max(v for (step, phase), v in est.phase_peaks.items()
                    if phase == "forward" and step >= 1)
    elif quantity in ("max_memory_allocated", "active_bytes.all.allocated", "memory_allocated"):
        value = est.peak_bytes
    elif quantity in ("max_memory_reserved", "memory_reserved"):
        value = est.peak_reserved_bytes
    elif "context_bytes_measured" in cfg:
        # nvidia-smi = what the process holds outside the allocator + the allocator's
        # segments; the outside part is the context the same source measured, so the case
        # checks memfit's reserved bytes.
        value = est.peak_reserved_bytes + cfg["context_bytes_measured"]
    else:  # nvidia-smi: the device's used memory, context included
        value = est.total_bytes
    return int(value), "; ".join(est.assumptions), est


_GPU_NAMES = {"A100-SXM4-80GB": "a100-80gb", "A100-SXM4-40GB": "a100-40gb",
              "H100 80GB HBM3": "h100-sxm", "H100 PCIe": "h100-pcie"}


def _gpu_for(case: dict[str, Any]) -> str | None:
    gpu = case.get("measured_on", {}).get("gpu", "")
    for key, name in _GPU_NAMES.items():
        if key in gpu:
            return name
    return None


# ----------------------------------------------------------------------------- run
def predict(case: dict[str, Any]) -> dict[str, Any]:
    """memfit's prediction for one case: ``predicted`` bytes, ``note``, seconds, breakdown."""
    started = time.perf_counter()
    breakdown: dict[str, int] = {}
    try:
        if case["method"] == "allocator_sim":
            value, note = predict_allocator(case["config"])
        elif case["method"] == "runtime":
            value, note = predict_runtime(case["config"])
        elif case["method"] == "plan":
            value, note = predict_plan(case), "the analytic plan (memfit plan --method analytic)"
        elif case["method"] == "trace":
            value, note, est = predict_trace(case)
            breakdown = {k.value: v for k, v in est.breakdown.items() if v}
            breakdown["runtime_in_allocator"] = sum(
                est.runtime[k] for k in est.runtime_in_allocator)
        else:
            raise ValueError(f"method {case['method']!r} has no predictor")
        error = None
    except Exception as exc:  # a case that cannot run is reported, the others still run
        value, note, error = None, "", f"{type(exc).__name__}: {exc}"
    published = case["published"]["bytes"]
    result = {
        "id": case["id"], "kind": case["kind"], "method": case["method"],
        "quantity": case["quantity"], "file": case["file"],
        "source": _short_source(case["source"]), "published_bytes": published,
        "predicted_bytes": value, "seconds": round(time.perf_counter() - started, 2),
        "note": note, "error": error, "exercises": case["exercises"],
    }
    if breakdown:
        result["predicted_breakdown"] = breakdown
    if value is not None:
        result["error_pct"] = round(100.0 * (value - published) / published, 3)
    if "plan" in case["config"] and case["method"] != "plan":
        planned = predict_plan(case)
        result["plan_predicted_bytes"] = planned
        result["plan_error_pct"] = round(100.0 * (planned - published) / published, 3)
    return result


def predict_plan(case: dict[str, Any]) -> int:
    """The analytic planner's answer for a model-step case (``config["plan"]``: a memfit model
    preset, or a config.json path relative to ``bench/published/``, and RunConfig fields), in
    the case's quantity: for nvidia-smi, the plan's total with its assumed CUDA context
    replaced by the context the source measured; for an allocator statistic, the plan's total
    without what lives outside PyTorch's allocator (the CUDA context, NCCL's buffers), with the
    cuBLAS workspaces of the run's ``CUBLAS_WORKSPACE_CONFIG`` when the case sets one
    (``config["cublas_workspace_config"]``). Method ``plan`` cases check the planner alone;
    for the others it is reported next to the trace's prediction, to size the margin
    ``plan``'s "fits" keeps."""
    import memfit

    cfg = case["config"]
    spec = cfg["plan"]
    model = spec["model"]
    if (CASES_DIR / model).is_file():
        model = str(CASES_DIR / model)
    run = memfit.RunConfig.from_dict(spec["run"])
    gpu = case_gpu(cfg)
    if spec.get("method") == "trace":
        with _environment(cfg.get("env", {})):
            return _plan_trace(memfit.resolve_model(model), run, gpu, case["quantity"])
    plan = memfit.plan(memfit.resolve_model(model), run, gpu=gpu)
    parts = plan.runtime_parts
    if case["quantity"] == "nvidia-smi" and "context_bytes_measured" in cfg:
        return int(plan.total_bytes - parts.get("cuda_context", 0)
                   + cfg["context_bytes_measured"])
    if case["quantity"] in ALLOCATOR_QUANTITIES:
        value = plan.total_bytes - parts.get("cuda_context", 0) - parts.get("nccl", 0)
        if cfg.get("cublas_workspace_config"):
            # the plan counts two cuBLAS workspaces (the main thread's and autograd's device
            # thread's handle), each of the default size; the run's setting replaces both
            value += (2 * cublas_config_bytes(cfg["cublas_workspace_config"])
                      - parts.get("cublas_workspace", 0) - parts.get("cublaslt_workspace", 0))
        return int(value)
    return int(plan.total_bytes)


@contextlib.contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    """The run's environment variables (``PYTORCH_CUDA_ALLOC_CONF``: the trace's allocator
    reads it, as torch does), restored after."""
    import os

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _plan_trace(model: Any, run: Any, gpu: Any, quantity: str) -> int:
    """``memfit plan --method trace`` (the default for --gpus > 1): each rank role traced on
    meta tensors; the most loaded rank's peak allocated or reserved bytes."""
    from memfit.analytic.traced import parallel_layout, trace_parallel

    est = trace_parallel(model, run, gpu, parallel_layout(run))
    if quantity in ("max_memory_reserved", "memory_reserved"):
        return int(est.peak_reserved_bytes)
    return int(est.peak_bytes)


def cublas_config_bytes(conf: str) -> int:
    """Bytes of one cuBLAS workspace under ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE_KiB:COUNT``
    pairs; aten/src/ATen/cuda/CublasHandlePool.cpp: parseChosenWorkspaceSize).

    >>> cublas_config_bytes(":4096:8"), cublas_config_bytes(":4096:2:16:8")
    (33554432, 8519680)
    """
    fields = [int(f) for f in conf.strip().strip(":").split(":")]
    return sum(size * 1024 * count for size, count in zip(fields[::2], fields[1::2], strict=True))


def _short_source(src: dict[str, Any]) -> str:
    if src.get("repo"):
        return f"{src['repo']}:{src['path']}@{src['commit'][:10]}"
    return str(src["url"])


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Error statistics over the allocator-level cases, and whether each target is met."""
    # the targets are the trace's and the simulator's; method ``plan`` cases (memfit plan from
    # the CLI, a whole training run) are reported with the other plan errors
    errors = [r["error_pct"] for r in results if r.get("method") != "plan"
              and r["quantity"] in ALLOCATOR_QUANTITIES and r.get("error_pct") is not None]
    failed = [r["id"] for r in results if r["error"]]
    # nvidia-smi cases (whole steps, CUDA context included): reported, outside the targets
    smi = [r["error_pct"] for r in results
           if r["quantity"] == "nvidia-smi" and r.get("error_pct") is not None]
    smi_stats = {} if not smi else {
        "nvidia_smi_cases": len(smi),
        "nvidia_smi_median_abs_error_pct": round(statistics.median(abs(e) for e in smi), 3),
        "nvidia_smi_worst_under_prediction_pct": round(min(min(smi), 0.0), 3),
        "nvidia_smi_worst_over_prediction_pct": round(max(max(smi), 0.0), 3)}
    plan_errors = [r["plan_error_pct"] for r in results if "plan_error_pct" in r] + [
        r["error_pct"] for r in results
        if r.get("method") == "plan" and r.get("error_pct") is not None]
    if plan_errors:
        smi_stats["plan_cases"] = len(plan_errors)
        smi_stats["plan_worst_under_prediction_pct"] = round(min(min(plan_errors), 0.0), 3)
        smi_stats["plan_worst_over_prediction_pct"] = round(max(max(plan_errors), 0.0), 3)
    if not errors:
        return {"cases": 0, "failed": failed, **smi_stats}
    abs_errors = [abs(e) for e in errors]
    worst_under = min(min(errors), 0.0)
    return {
        "cases": len(errors), "failed": failed, **smi_stats,
        "median_abs_error_pct": round(statistics.median(abs_errors), 3),
        "max_abs_error_pct": round(max(abs_errors), 3),
        "worst_under_prediction_pct": round(worst_under, 3),
        "worst_over_prediction_pct": round(max(max(errors), 0.0), 3),
        "targets": {
            f"median |error| <= {TARGET_MEDIAN}%": statistics.median(abs_errors) <= TARGET_MEDIAN,
            f"max |error| <= {TARGET_MAX}%": max(abs_errors) <= TARGET_MAX,
            f"never under-predicted by more than {TARGET_UNDER}%": -worst_under <= TARGET_UNDER,
            "every case ran": not failed,
        },
    }


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    return f"{n / 2**20:,.2f} MiB" if n >= 2**20 else f"{n:,} B"


def print_table(results: list[dict[str, Any]], summary: dict[str, Any],
                out: Any = sys.stdout) -> None:
    head = (f"{'id':<44} {'kind':<9} {'quantity':<22} {'published':>15} {'predicted':>15} "
            f"{'error':>8}")
    print(head, file=out)
    print("-" * len(head), file=out)
    for r in results:
        err = f"{r['error_pct']:+.2f}%" if r.get("error_pct") is not None else "FAILED"
        print(f"{r['id']:<44} {r['kind']:<9} {r['quantity'][:22]:<22} "
              f"{_fmt_bytes(r['published_bytes']):>15} {_fmt_bytes(r['predicted_bytes']):>15} "
              f"{err:>8}", file=out)
        if "plan_error_pct" in r:
            print(f"    analytic plan: {_fmt_bytes(r['plan_predicted_bytes'])} "
                  f"({r['plan_error_pct']:+.2f}%)", file=out)
        if r["error"]:
            print(f"    error: {r['error'][:200]}", file=out)
    print(file=out)
    if summary.get("cases"):
        print(f"allocator-level cases: {summary['cases']}; median |error| "
              f"{summary['median_abs_error_pct']}%, max |error| {summary['max_abs_error_pct']}%, "
              f"worst under-prediction {summary['worst_under_prediction_pct']}%", file=out)
        for target, met in summary["targets"].items():
            print(f"  [{'met' if met else 'NOT MET'}] {target}", file=out)
    if summary.get("nvidia_smi_cases"):
        print(f"nvidia-smi cases (outside the targets): {summary['nvidia_smi_cases']}; median "
              f"|error| {summary['nvidia_smi_median_abs_error_pct']}%, range "
              f"{summary['nvidia_smi_worst_under_prediction_pct']}% .. "
              f"+{summary['nvidia_smi_worst_over_prediction_pct']}%", file=out)
    if summary.get("plan_cases"):
        print(f"analytic plan on the same model steps: {summary['plan_cases']} cases, "
              f"{summary['plan_worst_under_prediction_pct']}% .. "
              f"+{summary['plan_worst_over_prediction_pct']}%", file=out)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def run(only: str | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    cases = [c for c in load_cases() if only is None or only in c["id"]]
    problems = [p for c in cases for p in validate_case(c)]
    if problems:
        raise SystemExit("malformed cases:\n" + "\n".join(problems))
    with _quiet():
        results = [predict(c) for c in cases]
    return results, summarize(results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", help="run the cases whose id contains this text")
    parser.add_argument("--out", type=Path, help="results JSON path")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    results, summary = run(args.only)
    print_table(results, summary)
    elapsed = time.perf_counter() - started
    print(f"\n{len(results)} cases in {elapsed:.1f} s")
    if not args.no_write:
        out = args.out or RESULTS_DIR / f"published-{dt.date.today().isoformat()}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({
            "command": " ".join(["python", "bench/published.py", *(argv or sys.argv[1:])]),
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "seconds": round(elapsed, 1),
            "summary": summary,
            "results": results,
        }, indent=1) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
