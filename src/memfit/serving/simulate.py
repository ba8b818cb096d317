"""``simulate``: a continuous-batching simulator running vLLM 0.33's scheduling rules under the KV
budget :func:`~memfit.serving.serve_plan` computed, with step times from a roofline
(:mod:`memfit.serving.roofline`), and static batching of the same requests beside it.

The rules, as ``vllm/v1/core/sched/scheduler.py: Scheduler.schedule`` runs them with vLLM's
defaults (FCFS policy, chunked prefill on, ``long_prefill_token_threshold`` 0, watermark 0,
``scheduler_reserve_full_isl`` on, no speculative decoding, no KV connector):

1. Each step has a token budget of ``max_num_batched_tokens``. The **running** requests go
   first, in the order they were admitted: each gets ``min(num_tokens - num_computed_tokens,
   budget left)`` tokens (1 for a decode; the rest of the prompt, or as much as fits, for a
   prefill: **chunked prefill**), while the budget lasts.
2. Each scheduled request takes KV blocks for its new tokens
   (``vllm/v1/core/kv_cache_manager.py: KVCacheManager.allocate_slots``): it holds
   ``cdiv(num_computed_tokens + new, block_size)`` blocks; the pool has ``num_gpu_blocks - 1``
   free at the start (``vllm/v1/core/block_pool.py: BlockPool.__init__`` keeps one null block).
3. When the pool runs out, the **last** running request is preempted (``running.pop()``, FCFS)
   and freed (``Scheduler._preempt_request``): its blocks go back, its ``num_computed_tokens``
   is reset to 0 (**recompute**: vLLM V1 has no swap), and it goes to the **front** of the
   waiting queue. This repeats until the allocation fits or the request preempted itself.
4. Only when no request was preempted this step are **waiting** requests admitted, in queue
   order, while the budget lasts and fewer than ``max_num_seqs`` run. A waiting request is
   admitted only if blocks for all its tokens so far (``num_tokens``: the prompt, plus the
   outputs of a preempted one) are free (``allocate_slots(full_sequence_must_fit=True)``,
   ``scheduler_reserve_full_isl``); else admission stops (FCFS: no skipping ahead). It gets
   ``min(num_tokens, budget left)`` tokens.
5. After the step (``Scheduler.update_from_output``) a request whose computed tokens caught up
   with its tokens samples one output token; at ``output_tokens`` it finishes and frees its
   blocks. A resumed request recomputes its prompt and earlier outputs, then samples the next.

Prefix caching is **off** in the simulator (vLLM's default is on; it would only help requests
that share prefixes, which generated workloads do not). Scheduling is synchronous: vLLM's
default async scheduling overlaps the next schedule with the current step, which changes no
decision here except that an engine step and the CPU work around it overlap (the roofline has
no CPU term unless ``step_overhead_s`` is set). Only full-attention (and MLA) KV cache groups
are simulated: a sliding-window or Mamba group frees or holds blocks by other rules (refused).

Static batching beside it: when the engine is free it takes up to ``max_num_seqs`` waiting
requests (as many as the pool holds at the batch's padded length), prefills them in one pass
padded to the longest prompt, decodes them all for the longest output, and only then takes the
next batch (no token budget, no chunking, no preemption).

Time: a request arrives at its ``arrival_time`` (with ``max_concurrency``, as
``vllm bench serve --max-concurrency``, no earlier than a free client slot) and joins the
waiting queue before the next step. TTFT is from then to the end of the step that sampled its
first token; TPOT is ``(last token - first token) / (output_tokens - 1)``, as vLLM's benchmark
defines them; throughput is over the time from the first arrival to the last token.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from memfit.errors import MemfitError
from memfit.serving.plan import ServePlan, load_config
from memfit.serving.roofline import (
    BANDWIDTH_EFFICIENCY,
    COMPUTE_EFFICIENCY,
    Roofline,
    model_flop_params,
)
from memfit.serving.workload import Request, check_requests, percentile

__all__ = ["PERCENTILES", "BatchingStats", "Simulation", "percentile", "roofline_for",
           "simulate"]

PERCENTILES = (50, 90, 95, 99)


def _cdiv(a: int, b: int) -> int:
    return -(a // -b)


@dataclass(frozen=True, kw_only=True)
class BatchingStats:
    """What one batching policy gives on the workload."""

    policy: str
    duration_s: float
    num_requests: int
    output_tokens: int
    input_tokens: int
    ttft_s: tuple[float, ...]
    """Per request, in arrival order."""
    tpot_s: tuple[float, ...]
    """Per request with 2 or more output tokens, in arrival order."""
    first_token_s: tuple[float, ...]
    finish_s: tuple[float, ...]
    preemptions: int
    peak_kv_blocks: int
    """The most KV blocks in use at once (the null block not counted)."""
    steps: int

    @property
    def request_throughput(self) -> float:
        return self.num_requests / self.duration_s if self.duration_s else math.inf

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s else math.inf

    @property
    def total_throughput(self) -> float:
        return (self.input_tokens + self.output_tokens) / self.duration_s \
            if self.duration_s else math.inf

    def to_json(self) -> dict[str, Any]:
        def dist(values: Sequence[float]) -> dict[str, float | None]:
            if not values:
                return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
            return {"mean": sum(values) / len(values),
                    **{f"p{q}": percentile(values, q) for q in PERCENTILES}}

        return {"policy": self.policy, "duration_s": self.duration_s,
                "num_requests": self.num_requests, "input_tokens": self.input_tokens,
                "output_tokens": self.output_tokens,
                "request_throughput": self.request_throughput,
                "output_token_throughput": self.output_throughput,
                "total_token_throughput": self.total_throughput,
                "ttft_s": dist(self.ttft_s), "tpot_s": dist(self.tpot_s),
                "preemptions": self.preemptions, "peak_kv_blocks": self.peak_kv_blocks,
                "steps": self.steps}


@dataclass(frozen=True, kw_only=True)
class Simulation:
    """:func:`simulate`'s answer: continuous batching (vLLM's rules) and static batching on the
    same requests, the roofline used and the pool."""

    continuous: BatchingStats
    static: BatchingStats | None
    roofline: Roofline
    num_gpu_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_concurrency: int | None
    prefix_caching: bool = False
    notes: tuple[str, ...] = field(default=())

    def to_json(self) -> dict[str, Any]:
        return {"engine": "vllm", "rules": "vllm 0.33.0 v1 scheduler (FCFS, chunked prefill, "
                "preemption by recompute)", "prefix_caching": self.prefix_caching,
                "num_gpu_blocks": self.num_gpu_blocks, "block_size": self.block_size,
                "max_num_seqs": self.max_num_seqs,
                "max_num_batched_tokens": self.max_num_batched_tokens,
                "max_concurrency": self.max_concurrency,
                "roofline": self.roofline.to_json(),
                "continuous": self.continuous.to_json(),
                "static": None if self.static is None else self.static.to_json(),
                "notes": list(self.notes)}


class _Req:
    """One request's state in the engine (vLLM's ``Request``: ``num_computed_tokens``,
    ``num_tokens = prompt + outputs``, its blocks)."""

    __slots__ = (
        "blocks",
        "computed",
        "finish",
        "first",
        "i",
        "max_out",
        "out",
        "preempted",
        "prompt",
        "send",
    )

    def __init__(self, i: int, r: Request) -> None:
        self.i = i
        self.prompt = r.prompt_tokens
        self.max_out = r.output_tokens
        self.send = r.arrival_time
        self.computed = 0
        self.out = 0
        self.blocks = 0
        self.first: float | None = None
        self.finish: float | None = None
        self.preempted = False

    @property
    def num_tokens(self) -> int:
        return self.prompt + self.out


class _Clients:
    """The requests not yet sent: each at its arrival time, or (``max_concurrency``, as
    ``vllm bench serve --max-concurrency``) once one of that many client slots is free: a
    request is sent at ``max(arrival, the earliest time a slot freed)``."""

    def __init__(self, reqs: list[_Req], max_concurrency: int | None) -> None:
        self.pending = deque(reqs)
        self.slots: deque[float] | None = None if max_concurrency is None else \
            deque([0.0] * max_concurrency)

    def _send_time(self) -> float | None:
        if not self.pending:
            return None
        if self.slots is None:
            return self.pending[0].send
        if not self.slots:
            return None
        return max(self.pending[0].send, self.slots[0])

    def arrived(self, now: float) -> list[_Req]:
        out = []
        while (t := self._send_time()) is not None and t <= now:
            req = self.pending.popleft()
            req.send = t
            if self.slots is not None:
                self.slots.popleft()
            out.append(req)
        return out

    def done(self, now: float) -> None:
        if self.slots is not None:
            self.slots.append(now)

    def next_time(self) -> float | None:
        return self._send_time()


def _stats(policy: str, reqs: list[_Req], *, preemptions: int, peak: int,
           steps: int) -> BatchingStats:
    start = min(r.send for r in reqs)
    firsts = [r.first for r in reqs]
    finishes = [r.finish for r in reqs]
    assert all(f is not None for f in firsts) and all(f is not None for f in finishes)
    end = max(f for f in finishes if f is not None)
    return BatchingStats(
        policy=policy, duration_s=end - start, num_requests=len(reqs),
        output_tokens=sum(r.max_out for r in reqs), input_tokens=sum(r.prompt for r in reqs),
        ttft_s=tuple(r.first - r.send for r in reqs if r.first is not None),
        tpot_s=tuple((r.finish - r.first) / (r.max_out - 1) for r in reqs
                     if r.max_out > 1 and r.finish is not None and r.first is not None),
        first_token_s=tuple(f for f in firsts if f is not None),
        finish_s=tuple(f for f in finishes if f is not None),
        preemptions=preemptions, peak_kv_blocks=peak, steps=steps)


def _continuous(requests: list[Request], *, num_blocks: int, block_size: int, max_num_seqs: int,
                budget: int, roofline: Roofline,
                max_concurrency: int | None) -> BatchingStats:
    reqs = [_Req(i, r) for i, r in enumerate(requests)]
    clients = _Clients(list(reqs), max_concurrency)
    capacity = num_blocks - 1  # the null block
    free = capacity
    running: list[_Req] = []
    waiting: deque[_Req] = deque()
    now = 0.0
    preemptions = peak = steps = 0
    done = 0
    while done < len(reqs):
        waiting.extend(clients.arrived(now))
        scheduled: list[tuple[_Req, int, int]] = []  # (request, new tokens, cached before)
        token_budget = budget
        preempted = False
        idx = 0
        # the step's sums, kept as the requests are scheduled: new tokens, KV touched
        # (sum(n + c)) and query-key pairs (sum(n c + n (n + 1) / 2))
        context = pairs = 0
        while idx < len(running) and token_budget > 0:  # 1. running first
            req = running[idx]
            cached = req.computed
            new = req.prompt + req.out - cached
            if new > token_budget:
                new = token_budget
            if new <= 0:
                idx += 1
                continue
            need = -((cached + new) // -block_size) - req.blocks
            fitted = True
            while need > free:  # 3. preempt the last running request (recompute)
                victim = running.pop()
                free += victim.blocks
                victim.blocks = victim.computed = 0
                victim.preempted = True
                waiting.appendleft(victim)
                preemptions += 1
                preempted = True
                if victim is req:
                    fitted = False
                    break
            if not fitted:
                break
            free -= need
            req.blocks += need
            token_budget -= new
            scheduled.append((req, new, cached))
            context += new + cached
            pairs += new * cached + new * (new + 1) // 2
            idx += 1
        if not preempted:  # 4. admit waiting requests
            while token_budget > 0 and waiting and len(running) < max_num_seqs:
                req = waiting[0]
                if _cdiv(req.num_tokens, block_size) > free:  # scheduler_reserve_full_isl
                    break
                new = min(req.num_tokens, token_budget)
                need = _cdiv(new, block_size)
                waiting.popleft()
                running.append(req)
                free -= need
                req.blocks = need
                token_budget -= new
                scheduled.append((req, new, 0))
                context += new
                pairs += new * (new + 1) // 2
        peak = max(peak, capacity - free)
        if not scheduled:
            nxt = clients.next_time()
            if nxt is None or running or waiting:
                raise MemfitError("the simulated engine stalled (no request fits the KV pool); "
                                  "this is a bug: please report the plan and the requests")
            now = max(now, nxt)
            continue
        now += roofline.step_seconds(tokens=budget - token_budget, rows=len(scheduled),
                                     context_tokens=context, attention_pairs=pairs)
        steps += 1
        for req, n, _ in scheduled:  # 5. sample, finish, free
            req.computed += n
            if req.computed < req.prompt + req.out:
                continue  # a prefill chunk: no token yet
            req.out += 1
            if req.first is None:
                req.first = now
            if req.out >= req.max_out:
                req.finish = now
                running.remove(req)
                free += req.blocks
                req.blocks = 0
                done += 1
                clients.done(now)
    return _stats("continuous", reqs, preemptions=preemptions, peak=peak, steps=steps)


def _static(requests: list[Request], *, num_blocks: int, block_size: int, max_num_seqs: int,
            roofline: Roofline, max_concurrency: int | None) -> BatchingStats:
    reqs = [_Req(i, r) for i, r in enumerate(requests)]
    clients = _Clients(list(reqs), max_concurrency)
    capacity = num_blocks - 1
    queue: deque[_Req] = deque()
    now = 0.0
    steps = peak = done = 0
    while done < len(reqs):
        queue.extend(clients.arrived(now))
        if not queue:
            nxt = clients.next_time()
            assert nxt is not None
            now = max(now, nxt)
            continue
        batch: list[_Req] = []
        longest_p = longest_o = 0
        for req in queue:
            p, o = max(longest_p, req.prompt), max(longest_o, req.max_out)
            if len(batch) == max_num_seqs or \
                    (len(batch) + 1) * _cdiv(p + o - 1, block_size) > capacity:
                break
            batch.append(req)
            longest_p, longest_o = p, o
        for _ in batch:
            queue.popleft()
        k = len(batch)
        peak = max(peak, k * _cdiv(longest_p + longest_o - 1, block_size))
        now += roofline.step_seconds(tokens=k * longest_p, rows=k, context_tokens=k * longest_p,
                                     attention_pairs=k * longest_p * (longest_p + 1) // 2)
        steps += 1
        for req in batch:
            req.first = now
            if req.max_out == 1:
                req.finish = now
        for j in range(1, longest_o):  # decode step j: each row has longest_p + j - 1 cached
            c = longest_p + j - 1
            now += roofline.step_seconds(tokens=k, rows=k, context_tokens=k * (c + 1),
                                         attention_pairs=k * (c + 1))
            steps += 1
            for req in batch:
                if req.max_out == j + 1:
                    req.finish = now
        for _ in batch:  # the batch leaves together: then the clients send more
            done += 1
            clients.done(now)
    return _stats("static", reqs, preemptions=0, peak=peak, steps=steps)


def roofline_for(plan: ServePlan, *, gpu: Any = None, config: Mapping[str, Any] | None = None,
                 weights_bytes: int | None = None, flops_dtype: str | None = None,
                 quant: str | None = None, compute_efficiency: float = COMPUTE_EFFICIENCY,
                 bandwidth_efficiency: float = BANDWIDTH_EFFICIENCY,
                 step_overhead_s: float = 0.0) -> Roofline:
    """The roofline for ``plan``'s model on ``gpu`` (a name or ``GpuSpec``; default the plan's
    ``--gpu``): FLOP parameters from the model's config (:func:`model_flop_params`), weights
    from the plan's budget, else ``weights_bytes``, else the config's shapes in the model's
    dtype or the ``quant`` format (:func:`memfit.serving.weights.weights_from_config`); KV
    bytes per token from the plan's layers; the dense peak in ``flops_dtype`` (default: fp8
    with ``quant="fp8"`` on a GPU with fp8, whose W8A8 matmuls run in fp8; else bf16, or fp16
    where the GPU has no bf16; weight-only formats compute in 16 bits)."""
    from memfit.gpus import GpuSpec, get_gpu
    from memfit.serving.kv_spec import model_dtype_bytes
    from memfit.serving.weights import check_quant, weights_from_config

    if gpu is None:
        if plan.budget is None:
            raise MemfitError("the roofline needs a GPU: pass gpu= (memfit simulate --gpu NAME)")
        gpu = plan.budget.gpu
    spec = gpu if isinstance(gpu, GpuSpec) else get_gpu(str(gpu))
    fmt = check_quant(quant, spec.compute_capability)
    cfg = dict(config) if config is not None else load_config(plan.model)[1]
    params, lm_head, attn = model_flop_params(cfg, tp=plan.tp)
    if weights_bytes is None:
        weights_bytes = plan.budget.weights_bytes if plan.budget is not None else \
            weights_from_config(cfg, tp=plan.tp, dtype_bytes=model_dtype_bytes(cfg),
                                quant=fmt).total
    key = flops_dtype or ("fp8" if quant == "fp8" and spec.tflops.get("fp8") else
                          "bf16" if spec.tflops.get("bf16") else "fp16")
    tflops = spec.tflops.get(key)
    if not tflops:
        raise MemfitError(f"{spec.name} has no {key} TFLOPS in the catalog; pass flops_dtype "
                          "(fp16, bf16, fp8)")
    return Roofline(peak_flops=tflops * 1e12, bandwidth=spec.bandwidth_gbps * 1e9,
                    params=params, lm_head_params=lm_head, attention_flops_per_pair=attn,
                    weights_bytes=weights_bytes,
                    kv_bytes_per_token=sum(layer.bytes_per_token for layer in plan.layers),
                    compute_efficiency=compute_efficiency,
                    bandwidth_efficiency=bandwidth_efficiency, step_overhead_s=step_overhead_s)


def simulate(plan: ServePlan, requests: Sequence[Request], *, roofline: Roofline | None = None,
             gpu: Any = None, quant: str | None = None, max_concurrency: int | None = None,
             static: bool = True, compute_efficiency: float = COMPUTE_EFFICIENCY,
             bandwidth_efficiency: float = BANDWIDTH_EFFICIENCY,
             step_overhead_s: float = 0.0) -> Simulation:
    """Serve ``requests`` under ``plan`` (its ``num_gpu_blocks``, ``block_size``,
    ``max_num_seqs`` and ``max_num_batched_tokens``) by vLLM 0.33's scheduling rules (the
    module's docstring restates them), timed by ``roofline`` (default :func:`roofline_for`
    the plan's model on ``gpu``, its weights in ``quant``), with static batching beside it
    (``static=False``: not).

    >>> from memfit.serving import serve_plan, poisson_requests
    >>> plan = serve_plan("llama-3-8b", kv_cache_memory=2**30, max_model_len=2048)
    >>> reqs = poisson_requests(20, 5.0, prompt_tokens=256, output_tokens=64)
    >>> sim = simulate(plan, reqs, gpu="h100-sxm-80gb")
    >>> sim.continuous.num_requests, sim.continuous.preemptions
    (20, 0)

    Bad input (no requests, a request longer than ``max_model_len`` or than the pool, a
    sliding-window or Mamba model) raises MemfitError (one line).
    """
    reqs = check_requests(requests)
    kinds = {layer.kind for layer in plan.layers} - {"shared"}
    if not kinds <= {"full", "mla"}:
        raise MemfitError(f"{plan.model} has {', '.join(sorted(kinds - {'full', 'mla'}))} "
                          "layers: the simulator models full-attention KV blocks only (sliding-"
                          "window and Mamba groups free and hold blocks by other rules)")
    if not plan.fits or plan.num_gpu_blocks < 2:
        raise MemfitError(f"the plan's KV pool ({plan.num_gpu_blocks} blocks) does not hold one "
                          f"request of max_model_len {plan.max_model_len}: vLLM would not start; "
                          "raise the KV budget or lower --max-model-len")
    if max_concurrency is not None and (isinstance(max_concurrency, bool) or
                                        not isinstance(max_concurrency, int) or
                                        max_concurrency < 1):
        raise MemfitError(f"--max-concurrency must be an integer >= 1, got {max_concurrency!r}")
    capacity = plan.num_gpu_blocks - 1
    for n, r in enumerate(reqs):
        total = r.prompt_tokens + r.output_tokens
        if total > plan.max_model_len:
            raise MemfitError(f"request {n} (arrival {r.arrival_time:g} s) needs {total} tokens, "
                              f"above max_model_len {plan.max_model_len}; shorten it or raise "
                              "--max-model-len")
        if _cdiv(total - 1, plan.block_size) > capacity:
            raise MemfitError(f"request {n} needs {_cdiv(total - 1, plan.block_size)} KV blocks, "
                              f"more than the pool's {capacity}; raise the KV budget")
    if roofline is None:
        roofline = roofline_for(plan, gpu=gpu, quant=quant, compute_efficiency=compute_efficiency,
                                bandwidth_efficiency=bandwidth_efficiency,
                                step_overhead_s=step_overhead_s)
    max_num_seqs = plan.max_num_seqs or 1024
    common = dict(num_blocks=plan.num_gpu_blocks, block_size=plan.block_size,
                  max_num_seqs=max_num_seqs, roofline=roofline, max_concurrency=max_concurrency)
    cont = _continuous(reqs, budget=plan.max_num_batched_tokens, **common)  # type: ignore[arg-type]
    stat = _static(reqs, **common) if static else None  # type: ignore[arg-type]
    return Simulation(
        continuous=cont, static=stat, roofline=roofline, num_gpu_blocks=plan.num_gpu_blocks,
        block_size=plan.block_size, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=plan.max_num_batched_tokens, max_concurrency=max_concurrency,
        notes=("prefix caching off (vLLM's default is on: it only helps shared prefixes)",
               "synchronous scheduling; no TP all-reduce, CPU overhead or CUDA-graph padding "
               "in the step time unless step_overhead_s is set"))
