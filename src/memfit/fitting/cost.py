"""Step-time model: FLOPs at a calibrated rate, memory traffic, transfers and launch overhead.

``step_seconds`` for one candidate = per micro-batch ``max(compute + traffic + transfers,
dispatch)`` times the accumulation, plus the optimizer step and, with several GPUs, the gradient
and parameter communication. The terms:

- compute: the FLOPs of forward + backward (``FlopCounterMode`` on the meta model with the
  technique applied, so checkpointing's recompute is counted exactly) at the catalog's dense peak
  for the precision times an efficiency factor: the measured bf16 matmul ceiling over the
  datasheet peak (shared/facts.md: A100 ~271 of 312 TFLOPS = 0.87, H100 ~794 of 989 = 0.80, H200
  ~790 of 989 = 0.80; 0.80 for GPUs without a measurement). On ``device="cpu"`` the rate is this
  machine's matmul FLOP/s, measured once and kept on disk, or the user's pinned rates
  (:mod:`memfit.fitting.rates`, Note: [rates do not move with the load]).
- traffic: activations are written in the forward, read in the backward and their gradients
  written: ``3 x`` the bytes the step would save without checkpointing (checkpointing keeps less
  but writes as much, and its recompute writes again in proportion to the FLOPs it adds), at the
  memory bandwidth; the optimizer step reads and writes parameters, gradients and states once.
- transfers: activation offload moves the saved bytes to the host and back; state offload moves
  gradients down and parameters up each step; parameter offload (ZeRO-Infinity's
  ``offload_param``, under ZeRO-3) fetches the rank's parameter shard from the host in every
  micro-batch's forward and again in its backward; all at the catalog's ``host_link.gbps`` (no
  overlap assumed: an upper bound on the cost).
- communication (``num_gpus``): ring all-reduce of the gradients (``2 (N-1)/N`` of their bytes)
  for DDP, ZeRO-1 and ZeRO-2; ZeRO-3/FSDP adds an all-gather of the parameters in forward and
  backward (``3 x`` ``(N-1)/N``), at ``gpu_link.gbps``, none of it hidden. With a layout
  (``gpus``), :func:`layout_comm`: what the compute does not hide.
- layouts (``memfit.fit(..., gpus=N)``, :func:`layout_comm`): each rank computes ``1/(tp pp)``
  of its data-parallel share, plus the pipeline bubble (Narayanan et al., SC'21, "Efficient
  Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", §2.2: the bubble is
  ``(p - 1) / m`` of the ideal time for ``p`` stages and ``m`` micro-batches, GPipe and 1F1B
  alike). Collectives run at the link their group crosses: ranks are laid out tp innermost,
  then data parallel, then pipeline stages outermost (Megatron-LM's and torchtitan's order),
  so a group stays inside a node when its span (``tp`` for tp, ``tp * dp`` for data parallel,
  every GPU for the pipeline) fits in ``gpus_per_node``; inside a node the catalog's
  ``gpu_link`` (NVLink), across nodes :data:`INTER_NODE_GBPS`.
- dispatch: eager PyTorch launches every op from Python (12.5 us per op the trace counts on
  CUDA, :data:`memfit.fitting.rates.CUDA_LAUNCH_S`; measured on this machine for the CPU), plus
  selective checkpointing's dispatch modes (Note: [selective checkpointing's dispatch]). On CUDA
  launches overlap the kernels (the step takes the longer of the two); on the CPU they add up.
  Either way small micro-batches pay more of it.

Note: [selective checkpointing's dispatch] memfit's selective checkpointing is torch's
``create_selective_checkpoint_contexts`` with a Python policy: every op of a selective block runs
through a Python ``TorchDispatchMode`` in the forward (``_CachingTorchDispatchMode``, which calls
the policy and stores the output or a marker) and again in the recompute
(``_CachedTorchDispatchMode``, which returns the stored outputs and reruns the rest). That host
time is charged as ``sac_s``: twice each selective block's forward ops
(:func:`memfit.fitting.traced.sac_ops`) times :data:`memfit.fitting.rates.CUDA_SAC_OP_S`
(34.5 us), on top of the block's launches. Calibrated on one model size on an H100 and an H200
host (``bench/step_cost_calibration.py``): there selective checkpointing measured 2.8-3.2x the
step and full checkpointing 1.9x, which the model without it put at 1.5x for both. A CPU target
charges nothing (``Rates.sac_op_s`` 0): there the kernels dwarf it (selective measured 1.02x the
step on one CPU thread, ``bench/results/techniques-cpu-2026-11-22.json``).

Known limitations: attention kernels are counted at the matmul rate; no compute/transfer overlap
is modelled (except data-parallel collectives under a layout, :func:`layout_comm`); the CPU
optimizer step of state offload runs at an assumed 20 GB/s host bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memfit.fitting.rates import INTER_NODE_GBPS, Rates, cpu_rates, gpu_rates

__all__ = ["INTER_NODE_GBPS", "Rates", "StepCost", "cpu_rates", "gpu_rates", "step_cost"]

HOST_OPTIMIZER_BYTES_PER_S = 20e9


@dataclass(frozen=True, kw_only=True)
class StepCost:
    """Predicted seconds of one optimizer step, by term."""

    compute_s: float
    traffic_s: float
    transfer_s: float
    comm_s: float
    dispatch_s: float
    optimizer_s: float
    async_launch: bool = True
    sac_s: float = 0.0
    """Selective checkpointing's Python dispatch (Note: [selective checkpointing's dispatch]):
    host time, added to ``dispatch_s``."""

    @property
    def total_s(self) -> float:
        work = self.compute_s + self.traffic_s + self.transfer_s
        host = self.dispatch_s + self.sac_s
        launch = max(work, host) if self.async_launch else work + host
        return launch + self.optimizer_s + self.comm_s

    def to_dict(self) -> dict[str, float]:
        return {"compute_s": self.compute_s, "traffic_s": self.traffic_s,
                "transfer_s": self.transfer_s, "comm_s": self.comm_s,
                "dispatch_s": self.dispatch_s, "sac_s": self.sac_s,
                "optimizer_s": self.optimizer_s,
                "async_launch": self.async_launch, "total_s": self.total_s}


def step_cost(rates: Rates, *, precision: str, micro_flops: float, accumulation: int,
              activation_traffic_bytes: int, offloaded_bytes: int, ops_per_micro: int,
              param_bytes: int, grad_bytes: int, state_bytes: int, offload_activations: bool,
              offload_states: bool, sharding: str, num_gpus: int, parallel: Any = None,
              boundary_bytes: int = 0, layers: int = 1,
              layout_bytes: dict[str, Any] | None = None,
              offload_params: bool = False, sac_ops_per_micro: int = 0) -> StepCost:
    """Seconds of one optimizer step of a candidate (see the module docstring for each term).

    ``micro_flops``: forward + backward (+ recompute) FLOPs of one micro-batch;
    ``activation_traffic_bytes``: activation bytes one micro-batch writes in its forward (and
    recompute); ``offloaded_bytes``: what activation offload moves to the host per micro-batch.
    With ``parallel`` (a :class:`memfit.Parallel`) every byte count is this rank's (the search
    scales them to the rank's share), ``micro_flops`` is the whole micro-batch's (divided here
    by ``tp * pp``), ``boundary_bytes`` is one block's input for one micro-batch (what a
    tensor-parallel all-reduce and a pipeline send move) and ``layers`` the model's blocks; the
    communication is :func:`layout_comm`'s (``layout_bytes``: its keyword arguments for the
    head's logits, the loss and the experts), ``num_gpus`` and ``sharding`` are then unused.
    ``offload_params``: the parameters live on the host, each rank's ZeRO-3 shard (``1 / dp``
    of ``param_bytes``) fetched twice a micro-batch. ``sac_ops_per_micro``: the ops selective
    checkpointing's dispatch modes see in one micro-batch (Note: [selective checkpointing's
    dispatch])."""
    rate = rates.flops[precision]
    compute = accumulation * micro_flops / rate
    traffic = accumulation * 3 * activation_traffic_bytes / rates.bandwidth
    dispatch = accumulation * ops_per_micro * rates.launch_s
    sac = accumulation * sac_ops_per_micro * rates.sac_op_s
    if parallel is not None:
        # Each rank runs 1/(tp pp) of the micro-batch's FLOPs, and its stage's work (compute,
        # traffic, launches) waits (pp - 1) micro-batch slots in the pipeline's fill and drain
        # (the bubble): (p - 1) / m of the step under GPipe and 1F1B, (p - 1) / (v m) under
        # interleaved 1F1B with v stages a rank (Narayanan et al. 2021, "Efficient Large-Scale
        # Language Model Training on GPU Clusters Using Megatron-LM", §2.2).
        v = 2 if getattr(parallel, "pp_schedule", "1f1b") == "interleaved-1f1b" else 1
        bubble = 1 + (parallel.pp - 1) / (v * accumulation)
        compute = compute / (parallel.tp * parallel.pp) * bubble
        traffic *= bubble
        dispatch *= bubble
        sac *= bubble
    transfer = 0.0
    if offload_activations:
        transfer += accumulation * 2 * offloaded_bytes / rates.host_link
    if offload_params:
        shards = parallel.dp if parallel is not None else num_gpus
        transfer += accumulation * 2 * param_bytes / shards / rates.host_link
    model_bytes = param_bytes + grad_bytes + state_bytes
    if offload_states:
        transfer += (grad_bytes + param_bytes) / rates.host_link
        optimizer = model_bytes * 2 / HOST_OPTIMIZER_BYTES_PER_S
    else:
        optimizer = model_bytes * 2 / rates.bandwidth
    comm = 0.0
    if parallel is not None:
        comm = layout_comm(rates, parallel, sharding=sharding, param_bytes=param_bytes,
                           grad_bytes=grad_bytes, boundary_bytes=boundary_bytes,
                           layers=layers, accumulation=accumulation,
                           compute_s=accumulation * micro_flops / rate
                           / (parallel.tp * parallel.pp), **(layout_bytes or {}))
    elif num_gpus > 1:
        link = rates.gpu_link or rates.host_link
        ring = (num_gpus - 1) / num_gpus
        comm = 2 * ring * grad_bytes / link
        if sharding == "zero3":
            comm += 2 * ring * param_bytes / link
    return StepCost(compute_s=compute, traffic_s=traffic, transfer_s=transfer, comm_s=comm,
                    dispatch_s=dispatch, optimizer_s=optimizer, async_launch=rates.async_launch,
                    sac_s=sac)


def _link(rates: Rates, span: int, gpus_per_node: int | None) -> float:
    """Bytes/s of a collective over ``span`` consecutive ranks: NVLink inside a node (the host
    link where the catalog has no GPU link), the inter-node network across nodes."""
    intra = rates.gpu_link or rates.host_link
    if gpus_per_node is None or span <= gpus_per_node:
        return intra
    return min(intra, rates.inter_node_link or INTER_NODE_GBPS * 1e9)


def layout_comm(rates: Rates, parallel: Any, *, sharding: str, param_bytes: int,
                grad_bytes: int, boundary_bytes: int, layers: int, accumulation: int,
                compute_s: float = 0.0, logits_bytes: int = 0, tokens: int = 0,
                moe_layers: int = 0, exchange_bytes: int = 0,
                expert_share: float = 0.0) -> float:
    """Seconds of one step's collectives under ``parallel`` that the compute does not hide.
    ``param_bytes`` / ``grad_bytes``: this rank's share before data-parallel sharding;
    ``compute_s``: this rank's compute for the step (no bubble), the window data-parallel
    collectives overlap (0: nothing hidden, an upper bound).

    - data parallel over ``dp`` ranks: :func:`_dp_comm`;
    - tensor parallel, with sequence and loss parallelism: :func:`_tp_comm`;
    - expert parallelism (``parallel.ep``; ``moe_layers`` MoE layers, ``exchange_bytes`` one
      layer's expert buffers for a micro-batch, ``experts x capacity x hidden``): two
      all-to-alls per MoE layer in the forward (dispatch, combine) and two in the backward
      (their reverses), each sending ``(ep-1)/ep`` of the buffers to the other ranks of the
      expert group (GShard, Lepikhin et al. 2020, §2.2 "dispatch ... AllToAll ... combine";
      torchtitan's ``AllToAllTokenDispatcher``; memfit's ``ExpertParallelMoE.run_experts``),
      on the critical path; the experts (``expert_share`` of ``grad_bytes`` and
      ``param_bytes``) leave the data-parallel reduction: with ``ep = dp`` each expert lives on
      one rank and is not reduced, with fewer FSDP2 reduce-scatters and all-gathers each
      rank's ``1/ep`` of them over the ``dp/ep`` ranks holding the same experts;
    - pipeline: one send of a block's input forward and one of its gradient back per stage
      boundary and micro-batch, not hidden (an upper bound)."""
    gpn = parallel.gpus_per_node
    dp, tp, pp = parallel.dp, parallel.tp, parallel.pp
    micro_compute = compute_s / max(1, accumulation)
    comm = 0.0
    ep = getattr(parallel, "ep", 1)
    expert_grads = expert_params = 0.0
    if ep > 1:  # the experts leave the dense data-parallel collectives (see above)
        expert_grads, expert_params = grad_bytes * expert_share, param_bytes * expert_share
        grad_bytes, param_bytes = int(grad_bytes - expert_grads), int(param_bytes - expert_params)
    # each term added in turn, in the order the sum always took (float addition is not associative)
    if dp > 1:
        for seconds in _dp_comm(rates, parallel, sharding=sharding, param_bytes=param_bytes,
                                grad_bytes=grad_bytes, expert_params=expert_params,
                                expert_grads=expert_grads, micro_compute=micro_compute,
                                accumulation=accumulation):
            comm += seconds
    if tp > 1:
        for seconds in _tp_comm(rates, parallel, boundary_bytes=boundary_bytes, layers=layers,
                                accumulation=accumulation, logits_bytes=logits_bytes,
                                tokens=tokens):
            comm += seconds
    if ep > 1:
        comm += accumulation * 4 * moe_layers * (ep - 1) / ep * exchange_bytes \
            / _link(rates, tp * ep, gpn)
    if pp > 1:  # interleaved: v stages a rank, v times the sends (Narayanan et al. §2.2)
        v = 2 if getattr(parallel, "pp_schedule", "1f1b") == "interleaved-1f1b" else 1
        comm += accumulation * 2 * v * boundary_bytes / _link(rates, parallel.gpus, gpn)
    return comm


def _dp_comm(rates: Rates, parallel: Any, *, sharding: str, param_bytes: int, grad_bytes: int,
             expert_params: float, expert_grads: float, micro_compute: float,
             accumulation: int) -> tuple[float, float, float]:
    """Seconds of the data-parallel collectives over ``dp`` ranks that the compute does not
    hide: (ZeRO-1's broadcast, the gradients' reduction, the parameters' all-gathers), see
    :func:`layout_comm` (``param_bytes`` / ``grad_bytes`` less the experts', which
    ``expert_params`` / ``expert_grads`` are). The gradients are reduced once per step, in the
    last micro-batch's backward (earlier ones skip it: ``no_sync`` /
    ``set_requires_gradient_sync(False)``, as memfit.oom_guard runs them), a ring all-reduce of
    ``2 (dp-1)/dp`` of their bytes (ZeRO's reduce-scatter + all-gather move the same),
    overlapped with that backward, 2/3 of the micro-batch's compute (DDP's buckets and FSDP2's
    reduce-scatter run while the backward goes on: Li et al., VLDB 2020, "PyTorch
    Distributed", §3.2.3; Zhao et al., VLDB 2023, "PyTorch FSDP", §3.3); FSDP2 all-gathers the
    parameters in every micro-batch, ``2 (dp-1)/dp`` of them with resharding after forward
    (zero3, HSDP inside its shard group) and ``(dp-1)/dp`` without (zero2), prefetched under
    the micro-batch's compute; ZeRO-1's ``ZeroRedundancyOptimizer`` broadcasts the updated
    parameters after the step, ``(dp-1)/dp``, nothing to hide it; HSDP all-reduces the
    gradient shard across the replicas too."""
    gpn = parallel.gpus_per_node
    dp, tp = parallel.dp, parallel.tp
    ep = getattr(parallel, "ep", 1)
    broadcast = 0.0
    link = _link(rates, tp * dp, gpn)
    if sharding == "hsdp":
        shard, replicas = parallel.fsdp, parallel.replicate
        inner = _link(rates, tp * shard, gpn)
        ring = (shard - 1) / shard
        reduce = 2 * ring * grad_bytes / inner
        reduce += 2 * (replicas - 1) / replicas * grad_bytes / shard / link
        gather = 2 * ring * param_bytes / inner
    else:
        ring = (dp - 1) / dp
        reduce = 2 * ring * grad_bytes / link
        gather = {"zero3": 2, "zero2": 1}.get(sharding, 0) * ring * param_bytes / link
        if sharding == "zero1":
            broadcast = ring * param_bytes / link
    holders = dp // ep
    if ep > 1 and holders > 1:  # FSDP2 over the dp/ep ranks holding the same experts
        e_ring = (holders - 1) / holders
        reduce += 2 * e_ring * expert_grads / ep / link
        gather += {"zero3": 2, "zero2": 1}.get(sharding, 0) * e_ring * expert_params / ep \
            / link
    return (broadcast, max(0.0, reduce - 2 / 3 * micro_compute),
            accumulation * max(0.0, gather - micro_compute))


def _tp_comm(rates: Rates, parallel: Any, *, boundary_bytes: int, layers: int,
             accumulation: int, logits_bytes: int, tokens: int) -> tuple[float, float]:
    """Seconds of the tensor-parallel collectives, all on the critical path: (the blocks', the
    root's), see :func:`layout_comm`:

    - two all-reduces of a block's input in the forward and two in the backward (Shoeybi et
      al. 2019, Megatron-LM §3: the ``f`` and ``g`` operators), each ``2 (tp-1)/tp`` of it, per
      block of this stage and micro-batch;
    - sequence parallelism (``parallel.sp``): each block's all-reduces become an all-gather
      before and a reduce-scatter after the attention and the MLP, the same bytes (Korthikanti
      et al. 2022, arXiv 2205.05198, §4.2.2: "a ring all-reduce is composed of two steps: a
      reduce-scatter followed by an all-gather ... the same bandwidth"), so the per-block term
      is unchanged; the root adds, per micro-batch, the token embedding's reduce-scatter
      (forward) and all-gather (backward) and the head's all-gather of its input (forward) and
      reduce-scatter of its gradient (backward), ``(tp-1)/tp`` of a block's input each
      (``memfit/parallel/apply.py: tp_plan``, torchtitan's plan);
    - the head's logits (``logits_bytes``: a micro-batch's, all of the vocabulary): with
      sequence parallelism and without loss parallelism the head all-gathers them in the
      forward, ``(tp-1)/tp`` of them (``ColwiseParallel(output_layouts=Replicate())``; its
      backward takes the local chunk, no collective); loss parallelism (``loss_parallel``)
      keeps them split and all-reduces, per token (``tokens`` in the micro-batch), the
      softmax's max and sum of exponentials and the picked log-probability, three fp32
      all-reduces (``torch/distributed/tensor/parallel/loss.py: _log_softmax`` two
      ``funcol.all_reduce``, ``_nll_loss_forward`` one ``_reduce_value``), ``2 (tp-1)/tp`` of
      ``4 tokens`` bytes each; without sequence parallelism the head then takes a replicated
      input, whose gradient ``ColwiseParallel`` all-reduces in the backward."""
    tp, pp = parallel.tp, parallel.pp
    tp_link = _link(rates, tp, parallel.gpus_per_node)
    split = (tp - 1) / tp
    per_block = 4 * 2 * split * boundary_bytes / tp_link
    blocks = accumulation * per_block * -(-layers // pp)
    root = 0.0
    if parallel.sp:  # embedding RS + AG, head input AG + RS
        root += 4 * split * boundary_bytes
    if parallel.loss_parallel:
        root += 3 * 2 * split * 4 * tokens
        if not parallel.sp:
            root += 2 * split * boundary_bytes
    elif parallel.sp:
        root += split * logits_bytes
    return blocks, accumulation * root / tp_link
