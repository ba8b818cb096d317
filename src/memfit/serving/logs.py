"""Read what an engine measured from its startup log: vLLM (v1, and the older v0 formats) and
SGLang.

:func:`parse_engine_log` takes the text of a ``vllm serve`` / ``LLM(...)`` or
``python -m sglang.launch_server`` / ``sglang.Engine(...)`` startup log and returns an
:class:`EngineLog`: the settings the engine ran with (from its config / args lines) and the
numbers it printed (weights, profile-run activation peak, memory outside torch, CUDA graphs,
the KV budget, KV tokens, blocks, concurrency). Torch-free, pure text.

Each pattern names the line it reads, quoted from the engine's source:

- vLLM 0.33 (``/vllm/v1/...`` as shipped in the ``vllm==0.33.0`` sdist):
  ``gpu_model_runner.py: GPUModelRunner.load_model`` "Model loading took %s GiB memory and %.6f
  seconds"; ``gpu_worker.py: Worker.determine_available_memory`` "Available KV cache memory: %s
  GiB"; ``kv_cache_utils.py: update_kv_cache_capacity`` "%s KV cache size: %s tokens, Maximum
  concurrency for %s tokens per request: %.2fx"; ``gpu_worker.py:
  Worker.compile_or_warm_up_model`` "Free memory on device (...) on startup. Desired GPU memory
  utilization is (%s, %s GiB). Actual usage is %s GiB for consumed memory (weights + non-torch),
  %s GiB for peak activation, and %s GiB for CUDAGraph memory. ..."; ``gpu_model_runner.py``
  "Estimated CUDA graph memory: %.2f GiB total" and "Graph capturing finished in %.0f secs, took
  %.2f GiB"; ``utils/mem_utils.py: MemoryProfilingResult.__repr__`` (DEBUG) "Memory profiling
  takes %.2f seconds. Total non KV cache memory: %sGiB; torch peak memory increase: %sGiB; ...";
  ``v1/engine/core.py: EngineCore.__init__`` "Initializing a V1 LLM engine (v%s) with config: %s"
  (``config/vllm.py: VllmConfig.__str__``: ``model=..., max_seq_len=..., tensor_parallel_size=...,
  enforce_eager=..., kv_cache_dtype=...``); ``entrypoints/common/startup.py:
  log_non_default_args`` "non-default args: %s"; ``config/scheduler.py`` "Chunked prefill is
  enabled with max_num_batched_tokens=%d.".
- Older vLLM, as public logs show them: "Loading model weights took 14.9888 GB" and "# GPU
  blocks: 1952, # CPU blocks: 2048" (v0), "Memory profiling results: total_gpu_memory=...
  non_torch_memory=0.35GiB kv_cache_size=3.81GiB gpu_memory_utilization=0.90" (v0.6), "model
  weights take 7.97GiB; non_torch_memory takes 0.20GiB; PyTorch activation peak memory takes
  0.37GiB; the rest of the memory reserved for KV Cache is 1.57GiB." (v0.7-0.8), "GPU KV cache
  size: 2,042,016 tokens" on a line of its own (v1 before the lines were joined).
- SGLang 0.5.23 (``sglang/srt/...`` in its wheel): ``model_executor/model_runner.py:
  ModelRunner.load_model`` "Load weight end. elapsed=%.2f s, type=..., avail mem=%.2f GB, mem
  usage=%.2f GB."; ``mem_cache/memory_pool.py: _finalize_allocation_log`` "KV Cache is allocated.
  dtype: ..., #tokens: %d, K size: %.2f GB, V size: %.2f GB" (or "KV size: %.2f GB");
  ``model_executor/model_runner_components/cuda_graph_setup.py`` "Capture %s CUDA graph end.
  elapsed=..., mem usage=%.2f GB, avail mem=%.2f GB."; ``managers/scheduler.py`` "max_total_num_
  tokens=%d, chunked_prefill_size=%d, max_prefill_tokens=%d, max_running_requests=%d,
  context_len=%d, available_gpu_mem=%.2f GB"; ``entrypoints/engine.py`` "server_args=%s" (a dict
  now, ``ServerArgs(...)`` in older releases).

Both engines print "GB" for GiB (vLLM v0: ``/ float(2**30)``; SGLang: ``GB = 1024 * 1024 * 1024``
in ``memory_pool.py``), so every figure here is read as GiB. A printed figure carries the
engine's rounding (2 decimals of a GiB, 10.7 MB, in current releases).

Known limitations: with TP > 1 each worker prints its own lines; rank 0's (``TP0``,
``Worker_TP0``, or no prefix) win, except the KV budget, where the smallest wins (vLLM sizes
every worker's pool by the smallest: ``vllm/v1/core/kv_cache_planning.py:
get_kv_cache_configs``). Pipeline and data parallelism are not told apart.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from memfit.errors import MemfitError

__all__ = ["EngineLog", "parse_engine_log", "read_engine_log"]

GIB = 1 << 30

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_NUM = r"([0-9][0-9,]*(?:\.[0-9]+)?)"
_RANK = re.compile(r"\((\w+) pid=(\d+)\)|\[[^\]]*\b(TP\d+)\]")


@dataclass(frozen=True, kw_only=True)
class EngineLog:
    """What one engine startup log says. Bytes are integers (the printed GiB times 2**30,
    rounded); a field the log does not print is None.

    Known limitations: the printed GiB figures are rounded by the engine (to 0.01 GiB in
    current releases), so a byte field is exact only to that rounding.
    """

    engine: Literal["vllm", "sglang"]
    engine_version: str | None = None
    model: str | None = None
    tp: int | None = None
    max_model_len: int | None = None
    """vLLM ``max_seq_len`` / ``max_model_len``; SGLang ``context_len`` (as resolved)."""
    gpu_memory_utilization: float | None = None
    mem_fraction_static: float | None = None
    kv_cache_dtype: str | None = None
    block_size: int | None = None
    """vLLM ``block_size``; SGLang ``page_size``."""
    enforce_eager: bool | None = None
    max_num_batched_tokens: int | None = None
    """vLLM's scheduler budget; SGLang's ``chunked_prefill_size``."""
    max_num_seqs: int | None = None
    """vLLM ``max_num_seqs``; SGLang ``max_running_requests``."""
    kv_cache_memory_bytes: int | None = None
    """vLLM's ``--kv-cache-memory-bytes`` when the log names it (no profile run then)."""
    weights_bytes: int | None = None
    activation_peak_bytes: int | None = None
    non_torch_bytes: int | None = None
    cuda_graph_bytes: int | None = None
    """Measured at capture (vLLM "Graph capturing finished ... took"; SGLang "Capture ... CUDA
    graph end ... mem usage")."""
    cuda_graph_estimate_bytes: int | None = None
    """vLLM's estimate before the KV pool was sized ("Estimated CUDA graph memory")."""
    kv_cache_bytes: int | None = None
    """The KV budget: vLLM "Available KV cache memory" (smallest over the workers); SGLang
    K size + V size (or KV size)."""
    kv_cache_tokens: int | None = None
    """vLLM "GPU KV cache size: N tokens"; SGLang ``max_total_num_tokens`` (else "#tokens")."""
    num_gpu_blocks: int | None = None
    """vLLM v0 / early v1 "# GPU blocks: N"."""
    max_concurrency: float | None = None
    concurrency_len: int | None = None
    """The L in "Maximum concurrency for L tokens per request"."""
    ranks: int = 1
    """TP workers seen printing (1 when the log has no worker prefixes)."""
    lines: dict[str, str] = field(default_factory=dict)
    """Each field read -> the log line it was read from (prefixes and colours stripped)."""

    def measured(self) -> dict[str, int | float | None]:
        """The numbers the engine printed, keyed as :meth:`memfit.serving.ServePlan.to_json`
        keys them."""
        return {"weights_bytes": self.weights_bytes,
                "activation_peak_bytes": self.activation_peak_bytes,
                "non_torch_bytes": self.non_torch_bytes, "cuda_graph_bytes": self.cuda_graph_bytes,
                "kv_cache_bytes": self.kv_cache_bytes, "kv_cache_tokens": self.kv_cache_tokens,
                "num_gpu_blocks": self.num_gpu_blocks, "max_concurrency": self.max_concurrency}


def _int(text: str) -> int:
    return int(text.replace(",", ""))


def _gib(text: str) -> int:
    return round(float(text.replace(",", "")) * GIB)


def _bool(text: str) -> bool:
    return text.strip("'\"") == "True" or text.strip("'\"").lower() == "true"


def _str(text: str) -> str:
    return text.strip().strip("'\"")


# vLLM: one pattern per printed figure; (field, regex, converter). The first line that matches
# sets the field (except kv_cache_bytes, see the module docstring).
_Conv = Callable[[str], Any]
_VLLM: list[tuple[str, re.Pattern[str], _Conv]] = [
    # 0.33 "Model loading took %s GiB memory and %.6f seconds"; 0.8-0.11 "Model loading took
    # 14.9889 GiB and 3.65 seconds"; early v1 "... GB"; v0 "Loading model weights took 14.9888 GB"
    ("weights_bytes", re.compile(r"(?:Model loading|Loading model weights) took " + _NUM
                                 + r" ?Gi?B"), _gib),
    ("weights_bytes", re.compile(r"model weights take\s+" + _NUM + r" ?GiB"), _gib),
    ("weights_bytes", re.compile(r"\bweights memory: " + _NUM + r" ?GiB"), _gib),
    ("weights_bytes", re.compile(r"Actual usage is " + _NUM + r" GiB for weight\b"), _gib),
    ("activation_peak_bytes", re.compile(r"" + _NUM + r" GiB for peak activation"), _gib),
    ("activation_peak_bytes", re.compile(r"PyTorch activation peak memory(?: takes)?\s+" + _NUM
                                         + r" ?GiB"), _gib),
    ("activation_peak_bytes", re.compile(r"torch peak memory increase: " + _NUM + r" ?GiB"),
     _gib),
    ("non_torch_bytes", re.compile(r"" + _NUM + r" GiB for non-torch memory"), _gib),
    ("non_torch_bytes", re.compile(r"non_torch_memory(?: takes|=)?\s*" + _NUM + r" ?GiB"), _gib),
    ("non_torch_bytes", re.compile(r"non-torch forward increase memory: " + _NUM + r" ?GiB"),
     _gib),
    ("cuda_graph_bytes", re.compile(r"Graph capturing finished in \S+ secs?, took " + _NUM
                                    + r" GiB"), _gib),
    ("cuda_graph_bytes", re.compile(r"CUDA graph pool memory: " + _NUM + r" GiB \(actual\)"),
     _gib),
    ("cuda_graph_estimate_bytes", re.compile(r"Estimated CUDA graph memory: " + _NUM
                                             + r" GiB"), _gib),
    ("kv_cache_bytes", re.compile(r"Available KV cache memory: " + _NUM + r" ?GiB"), _gib),
    ("kv_cache_bytes", re.compile(r"reserved for KV Cache is " + _NUM + r" ?GiB"), _gib),
    ("kv_cache_bytes", re.compile(r"available_kv_cache_memory\s+" + _NUM + r" ?GiB"), _gib),
    ("kv_cache_bytes", re.compile(r"\bkv_cache_size=" + _NUM + r" ?GiB"), _gib),
    ("kv_cache_bytes", re.compile(r"reserved " + _NUM + r" GiB memory for KV Cache as "
                                  r"specified by kv_cache_memory_bytes"), _gib),
    ("kv_cache_tokens", re.compile(r"\b(?:GPU|XPU|NPU|CPU|TPU|HPU)(?: \+ host)? KV cache size: "
                                   + _NUM + r" tokens"), _int),
    ("num_gpu_blocks", re.compile(r"(?:# )?(?:GPU|CUDA) blocks: " + _NUM), _int),
    ("gpu_memory_utilization", re.compile(r"gpu_memory_utilization[ =(]+" + _NUM), float),
    ("gpu_memory_utilization", re.compile(r"Desired GPU memory utilization is \(" + _NUM), float),
    ("max_num_batched_tokens", re.compile(r"Chunked prefill is enabled with "
                                          r"max_num_batched_tokens=" + _NUM), _int),
]

_VLLM_CONCURRENCY = re.compile(r"Maximum concurrency for " + _NUM + r" tokens per request: "
                               + _NUM + r"x")
_VLLM_ENGINE = re.compile(r"Initializing an? (?:V1 )?LLM engine \(v([^)\s]+)\) with config: (.*)")
_VLLM_VERSION = re.compile(r"vLLM API server version ([0-9][^\s,]*)")
_VLLM_CONFIG: list[tuple[str, str, _Conv]] = [
    ("model", r"\bmodel='([^']*)'", _str), ("max_model_len", r"\bmax_seq_len=(\d+)", _int),
    ("tp", r"\btensor_parallel_size=(\d+)", _int),
    ("enforce_eager", r"\benforce_eager=(True|False)", _bool),
    ("kv_cache_dtype", r"\bkv_cache_dtype=([\w]+)", _str)]
_VLLM_ARGS = re.compile(r"non-default args: (\{.*)")
_ARGS_KEYS: dict[str, tuple[str, _Conv]] = {
    "model": ("model", _str), "model_tag": ("model", _str),
    "tensor_parallel_size": ("tp", _int), "max_model_len": ("max_model_len", _int),
    "gpu_memory_utilization": ("gpu_memory_utilization", float),
    "kv_cache_dtype": ("kv_cache_dtype", _str), "cache_dtype": ("kv_cache_dtype", _str),
    "block_size": ("block_size", _int), "enforce_eager": ("enforce_eager", _bool),
    "max_num_batched_tokens": ("max_num_batched_tokens", _int),
    "max_num_seqs": ("max_num_seqs", _int),
    "kv_cache_memory_bytes": ("kv_cache_memory_bytes", _int)}
_DICT_ITEM = re.compile(r"'(\w+)': ('[^']*'|[^,}\s]+)")

# SGLang
_SGL_WEIGHTS = re.compile(r"Load weight end\..*?mem usage=" + _NUM + r" ?GB")
_SGL_KV = re.compile(r"KV Cache is allocated\..*?#tokens: " + _NUM
                     + r"(?:, K size: " + _NUM + r" GB, V size: " + _NUM + r" GB|, KV size: "
                     + _NUM + r" GB)")
_SGL_GRAPH = re.compile(r"Capture .*?graph end\..*?mem usage=" + _NUM + r" ?GB")
_SGL_SCHED = re.compile(r"max_total_num_tokens=" + _NUM)
_SGL_SCHED_KEYS: dict[str, str] = {"chunked_prefill_size": "max_num_batched_tokens",
                                   "max_running_requests": "max_num_seqs",
                                   "context_len": "max_model_len"}
_SGL_ARGS = re.compile(r"server_args=(.*)")
_SGL_ARGS_KEYS: dict[str, tuple[str, _Conv]] = {
    "model_path": ("model", _str), "tp_size": ("tp", _int),
    "mem_fraction_static": ("mem_fraction_static", float),
    "context_length": ("max_model_len", _int), "kv_cache_dtype": ("kv_cache_dtype", _str),
    "page_size": ("block_size", _int), "max_running_requests": ("max_num_seqs", _int),
    "chunked_prefill_size": ("max_num_batched_tokens", _int),
    "disable_cuda_graph": ("enforce_eager", _bool)}
_SGL_ITEM = re.compile(r"'?(\w+)'?\s*[:=]\s*('[^']*'|[^,)}\s]+)")
_SGL_MARK = re.compile(r"Load weight end\.|KV Cache is allocated\.|max_total_num_tokens=|"
                       r"server_args=(?:ServerArgs\(|\{)|sglang")


def _clean(line: str) -> str:
    return _ANSI.sub("", line).rstrip("\r\n")


def _put(found: dict[str, object], lines: dict[str, str], key: str, value: object,
         line: str) -> None:
    if value is None or (isinstance(value, str) and value in ("None", "")):
        return
    if key not in found:
        found[key] = value
        lines[key] = line.strip()


def _items(found: dict[str, object], lines: dict[str, str], text: str, pattern: re.Pattern[str],
           keys: dict[str, tuple[str, _Conv]], line: str) -> None:
    for name, raw in pattern.findall(text):
        if name in keys and raw.strip("'\"") not in ("None", ""):
            key, conv = keys[name]
            try:
                _put(found, lines, key, conv(raw), line)
            except ValueError:
                continue


def _parse_vllm(lines_in: list[str], found: dict[str, object], lines: dict[str, str]) -> None:
    budgets: list[tuple[int, str]] = []
    for line in lines_in:
        m = _VLLM_ENGINE.search(line)
        if m:
            _put(found, lines, "engine_version", m.group(1), line)
            for key, regex, conv in _VLLM_CONFIG:
                c = re.search(regex, m.group(2))
                if c:
                    _put(found, lines, key, conv(c.group(1)), line)
            continue
        m = _VLLM_ARGS.search(line)
        if m:
            _items(found, lines, m.group(1), _DICT_ITEM, _ARGS_KEYS, line)
            continue
        m = _VLLM_VERSION.search(line)
        if m:
            _put(found, lines, "engine_version", m.group(1), line)
        m = _VLLM_CONCURRENCY.search(line)
        if m:
            _put(found, lines, "concurrency_len", _int(m.group(1)), line)
            _put(found, lines, "max_concurrency", float(m.group(2)), line)
        for key, pattern, conv in _VLLM:
            p = pattern.search(line)
            if not p:
                continue
            value = conv(p.group(1))
            if key == "kv_cache_bytes":
                budgets.append((value, line.strip()))
            else:
                _put(found, lines, key, value, line)
    if budgets:
        value, line = min(budgets)
        found["kv_cache_bytes"], lines["kv_cache_bytes"] = value, line


def _parse_sglang(lines_in: list[str], found: dict[str, object], lines: dict[str, str]) -> None:
    for line in lines_in:
        m = _SGL_ARGS.search(line)
        if m:
            _items(found, lines, m.group(1), _SGL_ITEM, _SGL_ARGS_KEYS, line)
            continue
        m = _SGL_WEIGHTS.search(line)
        if m:
            _put(found, lines, "weights_bytes", _gib(m.group(1)), line)
        m = _SGL_KV.search(line)
        if m:
            tokens, k, v, kv = m.groups()
            _put(found, lines, "sglang_kv_tokens", _int(tokens), line)
            total = float(kv) if kv else float(k) + float(v)
            _put(found, lines, "kv_cache_bytes", round(total * GIB), line)
        m = _SGL_GRAPH.search(line)
        if m:
            _put(found, lines, "cuda_graph_bytes", _gib(m.group(1)), line)
        m = _SGL_SCHED.search(line)
        if m:
            _put(found, lines, "kv_cache_tokens", _int(m.group(1)), line)
            for name, raw in re.findall(r"(\w+)=(-?\d+)\b", line):
                if name in _SGL_SCHED_KEYS and int(raw) > 0:
                    _put(found, lines, _SGL_SCHED_KEYS[name], int(raw), line)
    if "kv_cache_tokens" not in found and "sglang_kv_tokens" in found:
        found["kv_cache_tokens"] = found["sglang_kv_tokens"]
        lines["kv_cache_tokens"] = lines["sglang_kv_tokens"]
    found.pop("sglang_kv_tokens", None)
    lines.pop("sglang_kv_tokens", None)


_FIELDS_READ = ("weights_bytes", "kv_cache_bytes", "kv_cache_tokens", "num_gpu_blocks",
                "max_concurrency", "activation_peak_bytes", "cuda_graph_bytes")


def parse_engine_log(text: str, *, source: str = "log") -> EngineLog:
    """The settings and figures of a vLLM or SGLang startup log (its whole text).

    >>> log = parse_engine_log("INFO 04-24 16:33:13 [kv_cache_utils.py:634] GPU KV cache "
    ...                        "size: 158,656 tokens")
    >>> log.engine, log.kv_cache_tokens
    ('vllm', 158656)

    A text with none of the lines either engine prints raises MemfitError (one line).
    """
    raw = [_clean(line) for line in text.splitlines()]
    prefixes = {next(g for g in m.groups() if g) + ":" + (m.group(2) or "")
                for line in raw for m in [_RANK.search(line)] if m}
    # TP workers: v1 "(Worker_TP1 pid=..)", SGLang "[... TP1]"; v0 "(VllmWorkerProcess pid=..)"
    # are the workers beside the driver, which prints without a prefix.
    workers = {p.split(":")[0] for p in prefixes if re.search(r"TP\d", p)}
    v0 = {p for p in prefixes if p.startswith("VllmWorkerProcess")}
    ranks = len(workers) or (len(v0) + 1 if v0 else 1)
    # rank 0's lines first (stable): a figure every worker prints is read from rank 0
    ordered = sorted(raw, key=lambda line: bool(re.search(r"\bTP[1-9]\d*\b|_TP[1-9]",
                                                          line.split(")")[0].split("]")[0])))
    body = [_RANK.sub("", line, count=1) for line in ordered]
    found: dict[str, object] = {}
    lines: dict[str, str] = {}
    is_sglang = any(_SGL_MARK.search(line) for line in body if "vllm" not in line.lower())
    if is_sglang:
        _parse_sglang(body, found, lines)
    if not is_sglang or not any(k in found for k in _FIELDS_READ):
        is_sglang = False
        found.clear()
        lines.clear()
        _parse_vllm(body, found, lines)
    if not any(k in found for k in _FIELDS_READ):
        raise MemfitError(
            f"{source}: no engine startup figures found (neither vLLM's \"GPU KV cache size\" / "
            "\"Available KV cache memory\" / \"Model loading took\" nor SGLang's \"KV Cache is "
            "allocated\" / \"Load weight end\" lines); pass the engine's whole startup log "
            "(vllm serve ... 2>&1 | tee log.txt)")
    return EngineLog(engine="sglang" if is_sglang else "vllm",
                     ranks=ranks, lines=lines, **found)  # type: ignore[arg-type]


def read_engine_log(path: str | Path) -> EngineLog:
    """:func:`parse_engine_log` of a file; a missing or unreadable file is a MemfitError."""
    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise MemfitError(f"cannot read the engine log {path}: {e.strerror or e}; pass the path "
                          "of a saved vLLM or SGLang startup log") from None
    return parse_engine_log(text, source=str(path))
