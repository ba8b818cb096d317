"""The training engines' own device buffers and the optimizer step's temporaries.

What FSDP2, DDP and DeepSpeed hold beside the model states (gathered parameters, unsharded
gradients, reduce buckets), at each moment of a step that competes for the peak; the optimizer
step's parameter-sized temporaries; and the host buffers ZeRO-Infinity swaps NVMe through. The
states themselves are in ``model_states.py`` (Note: [engine layouts]); ``planner.py`` puts these
buffers at the step's peak.
"""

from __future__ import annotations

from fractions import Fraction

from memfit import vocab
from memfit.analytic.config import RunConfig
from memfit.analytic.model_states import split_params
from memfit.dtypes import nbytes
from memfit.models.spec import ModelSpec, TransformerSpec

# DeepSpeed's defaults, in elements: deepspeed/runtime/zero/config.py (DeepSpeedZeroConfig:
# reduce_bucket_size, stage3_prefetch_bucket_size, sub_group_size) and offload_config.py
# (DeepSpeedZeroOffloadParamConfig: buffer_count 5, buffer_size 1e8;
# DeepSpeedZeroOffloadOptimizerConfig: buffer_count 4).
DS_REDUCE_BUCKET = 500_000_000
DS_PREFETCH_BUCKET = 50_000_000
DS_SUB_GROUP = 1_000_000_000
DS_PARAM_SWAP_BUFFERS = 5 * 100_000_000
DS_OPTIMIZER_SWAP_BUFFERS = 4

PERSISTENT_BUFFERS = frozenset({"DDP gradient buckets", "reduce bucket",
                                "attention-score buffer"})
"""Engine buffers allocated once and kept through the optimizer step (the others are freed
after each module's backward)."""


# Parameter-sized temporaries of one foreach optimizer step, in state-dtype elements per
# trainable parameter (torch/optim/adamw.py _multi_tensor_adamw: exp_avg_sq.sqrt() is taken out
# of place; Adafactor's variance estimate and Lion's update direction likewise). SGD updates in
# place; bitsandbytes' 8-bit step is one fused kernel.
STEP_TEMPORARIES_PER_PARAM: dict[str, int] = {
    "adam": 1, "adamw": 1, "lion": 1, "adafactor": 1,
    "sgd": 0, "sgd-momentum": 0, "adamw-8bit": 0,
}


def optimizer_step_temporaries(model: ModelSpec, run: RunConfig, stage: int) -> int:
    """Device bytes of the optimizer step's temporaries on one GPU (0 when offloaded)."""
    if not run.training or run.offload_optimizer or (run.layout == "fsdp2"
                                                      and run.offload_params):
        return 0  # the step runs on the host
    trainable = split_params(model, run, stage=stage).trainable
    if run.zero >= 1:
        trainable = -(-trainable // run.parallel.dp)
    state_bytes = vocab.precision(run.precision).weight_bytes  # states in the parameters' dtype
    return STEP_TEMPORARIES_PER_PARAM[run.optimizer] * state_bytes * trainable



def largest_module_params(model: ModelSpec, run: RunConfig) -> int:
    """DeepSpeed's "largest layer": the most parameters one module holds itself (stage3.py:
    model_to_params sums ``m.parameters(recurse=False)`` per module): the embedding, the LM head
    or one linear layer, divided by tp. 0 when only the parameter count is known."""
    if not isinstance(model, TransformerSpec):
        return 0
    h = model.hidden_size
    largest = max(s.in_features * s.out_features for s in model.linear_shapes())
    if model.arch != "vision":
        largest = max(largest, model.vocab_size * h)
    return -(-largest // run.parallel.tp)


def fsdp_root_params(model: ModelSpec, run: RunConfig) -> int:
    """The root fully_shard unit: every parameter outside the blocks (embeddings, final norm and
    an untied LM head). ``fully_shard(model)`` after each block puts them in one
    FSDPParamGroup, and FSDPParamGroup.unshard all-gathers a group's parameters together
    (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py: foreach_all_gather), so an untied
    embedding and head are gathered at once."""
    if not isinstance(model, TransformerSpec):
        return 0
    return -(-(model.embedding_params() + model.head_params()) // run.parallel.tp)


def fsdp_unit_params(model: ModelSpec, run: RunConfig) -> int:
    """The largest fully_shard unit: a block, or the root (torchtitan shards each block and the
    root; the root gathers its own parameters, embedding and untied head together)."""
    if not isinstance(model, TransformerSpec):
        return 0
    return max(-(-model.layer_params() // run.parallel.tp), fsdp_root_params(model, run))


def fsdp2_buffers(model: ModelSpec, run: RunConfig, stage: int) -> dict[str, dict[str, int]]:
    """FSDP2's buffers at each moment of a training step that competes for the peak (the
    moments of ``Activations.moment``): by moment, by name.

    Note: [FSDP2 buffers by moment] (torch/distributed/fsdp/_fully_shard/, torch 2.13; the
    same functions in 2.11)
    - At the loss: the root gathered, and the last block's all-gather output, which forward
      keeps until the next copy-out (below). No gradient exists yet (zero_grad(set_to_none=
      True)).
    - Start of backward: with ``reshard_after_forward=True`` passed to every fully_shard call
      (memfit/parallel/apply.py: apply_fsdp, as torchtitan does) the root is resharded after
      its forward too (FSDPState._lazy_init keeps it gathered only when the argument is left to
      its default, ``_auto_reshard_after_forward``); its pre-backward gathers it again, and
      during that copy-out its all_gather_output and its unsharded parameters are both alive
      (FSDPParamGroup.wait_for_unshard frees the output "immediately after the current
      copy-out" in backward): twice the root, with every activation.
    - In a block's backward: the root, the block being run and the one prefetched; the block's
      unsharded gradients (param dtype) until FSDPParamGroup.post_backward hands them to
      foreach_reduce (_fsdp_collectives.py), which copies them into reduce_scatter_input
      (reduce_dtype: fp32 under torchtitan's MixedPrecisionPolicy) before
      ``unsharded_grads.clear()`` frees them; and the root's own gradients made so far (the
      final norm's and the LM head's, or a tied embedding's; an untied input embedding's
      gradient comes after the blocks), which stay unsharded until the root's post-backward at
      the end of backward.
    - In forward, FSDPParamGroup.wait_for_unshard keeps the previous group's all-gather result
      (its all_gather_output, as large as its unsharded parameters) "to free after the next
      copy-out" (implicit prefetching): while block i's parameters are copied out of their own
      all_gather_output, the previous group's output is still alive. At the first block that
      previous group is the root: root twice and block twice; later a block: root and three
      blocks. With LoRA's small activations these are the step's peak."""
    split = split_params(model, run, stage=stage)
    cb = nbytes(1, run.compute_format)
    reduce = vocab.precision(run.precision).grad_bytes
    trained = Fraction(split.trainable, split.total) if split.total else Fraction(1)
    root, block = fsdp_root_params(model, run), split.largest_layer
    if not isinstance(model, TransformerSpec):  # only the parameter count: the old bound
        root = block
    root_grads = 0
    if isinstance(model, TransformerSpec) and run.mode == "train":
        # trained in full fine-tuning, frozen under LoRA. In a block's backward only the root's
        # parameters used after the blocks have gradients: the final norm, the head (a tied
        # embedding's through it), BERT's pooler; an untied input embedding's gradient is made
        # last, after every block's backward.
        tied = model.vocab_size * model.hidden_size if (
            model.arch == "decoder" and model.tie_embeddings) else 0
        root_grads = -(-(model.head_params() + tied) // run.parallel.tp) * cb
    at_loss = {"all-gathered parameters": (root + block) * cb}
    in_backward = {"all-gathered parameters": (root + 2 * block) * cb,
                   "unsharded gradients": int(block * trained) * (cb + reduce) + root_grads}
    gathering = "all-gathered parameters and all-gather outputs"
    forward_end = {gathering: (root + 3 * block) * cb}
    forward_start = {gathering: (2 * root + 2 * block) * cb}
    backward_start = {gathering: 2 * root * cb}
    return {"loss": at_loss, "block": in_backward, "forward end": forward_end,
            "forward start": forward_start, "backward start": backward_start}


def _fsdp2_backward_end(model: ModelSpec, run: RunConfig, all_gradients: int
                        ) -> dict[str, int] | None:
    """FSDP2 at the end of backward (Note: [FSDP2 root reduce-scatter]): every block's sharded
    gradient, and the root's unsharded gradients with their reduce-scatter input. None when the
    root has no trained parameter (LoRA) or the layout is not FSDP2."""
    if (run.layout != "fsdp2" or not run.training or run.mode != "train"
            or not isinstance(model, TransformerSpec) or not model.param_count()):
        return None
    cb = nbytes(1, run.compute_format)
    reduce = vocab.precision(run.precision).grad_bytes
    root = fsdp_root_params(model, run)
    blocks_sharded = all_gradients - all_gradients * root * run.parallel.tp // model.param_count()
    # Just before: the input embedding's backward (the root's last op), with the root still
    # gathered, its gradients (the head's, a tied embedding's through it) and the embedding's
    # new gradient (a tied one's twice, until AccumulateGrad sums them), and the first block's
    # fp32 reduce-scatter input, which FSDPParamGroup.post_backward keeps in
    # comm_ctx.reduce_scatter_states (torch 2.13; reduce_scatter_state in 2.11) until the next
    # group's post_backward, the root's, reclaims it.
    tied = -(-model.vocab_size * model.hidden_size // run.parallel.tp) if (
        model.arch == "decoder" and model.tie_embeddings) else 0
    first_block = -(-model.layer_params() // run.parallel.tp)
    at_embedding = root * cb + (root + tied) * cb + first_block * reduce
    return {"gradients": blocks_sharded,
            "root's unsharded gradients and reduce-scatter input": max(root * (cb + reduce),
                                                                      at_embedding)}


def engine_buffers(model: ModelSpec, run: RunConfig, stage: int,
                   seq: int | None = None) -> dict[str, int]:
    """GPU bytes of the engine's own buffers during backward, by name (Note: [engine layouts] in
    model_states.py for the states themselves). The ZeRO paper's layout has none here (its
    gathered blocks are counted in planner.py: ``_zero_paper_temporaries``). ``seq``: the
    sequence length (Megatron's attention-score buffer is sized by it)."""
    if not run.training or run.layout == "zero-paper":
        return {}
    split = split_params(model, run, stage=stage)
    cb = nbytes(1, run.compute_format)
    out: dict[str, int] = {}
    layout, dp = run.layout, run.parallel.dp
    if layout == "fsdp2":
        # the buffers of a block's backward (Note: [FSDP2 buffers by moment]); the planner
        # takes those at the loss when that is the peak
        out.update(fsdp2_buffers(model, run, stage)["block"])
    elif layout == "ddp" and dp > 1:
        # DDP copies gradients into its buckets unless gradient_as_bucket_view=True
        # (torch.nn.parallel.DistributedDataParallel docs: the saving "will be equal to the total
        # gradients size")
        out["DDP gradient buckets"] = split.trainable * vocab.precision(run.precision).grad_bytes
    elif layout == "megatron" and run.attention == "eager" and seq and isinstance(
            model, TransformerSpec):
        # Megatron's unfused core attention (--transformer-impl local) writes QK^T into one
        # buffer that stays allocated: megatron/core/transformer/dot_product_attention.py,
        # DotProductAttention.forward: parallel_state.get_global_memory_buffer().get_tensor(
        # (b * np, sq, sk), query.dtype, "mpu"), baddbmm's input (beta=0)
        heads = -(-model.num_heads // run.parallel.tp)
        out["attention-score buffer"] = cb * heads * seq * seq * run.batch
    elif layout == "deepspeed":
        if run.zero >= 1:
            # stage_1_and_2.py: setup_buckets / stage3.py: _setup_for_real_optimizer allocate
            # torch.empty(reduce_bucket_size) in the 16-bit dtype (contiguous_gradients, on by
            # default and forced on by cpu_offload)
            out["reduce bucket"] = DS_REDUCE_BUCKET * cb
        elif dp > 1:
            out["reduce bucket"] = min(DS_REDUCE_BUCKET, split.trainable) * cb
        if run.zero == 3:
            largest = largest_module_params(model, run)
            # the module being run, gathered, and its 16-bit gradient: 4 bytes per parameter of
            # the largest module, DeepSpeed's largest_layer_memory (stage3.py:
            # estimate_zero3_model_states_mem_needs)
            out["gathered module and its gradient"] = largest * 2 * cb
            out["prefetch bucket"] = min(DS_PREFETCH_BUCKET,
                                         split.total - largest) * cb if split.total else 0
    return {name: b for name, b in out.items() if b}


def _engine_step_temporaries(model: ModelSpec, run: RunConfig, stage: int) -> int | None:
    """The optimizer step's device temporaries where the engine decides them; None: PyTorch's
    foreach optimizer (``optimizer_step_temporaries``)."""
    if run.layout == "deepspeed":
        if run.offload_optimizer:
            return 0  # DeepSpeedCPUAdam steps on the host
        trainable = split_params(model, run, stage=stage).trainable
        part = -(-trainable // run.parallel.dp) if run.zero >= 1 else trainable
        if run.zero == 3:
            part = min(part, DS_SUB_GROUP)  # stage3.py: _prepare_fp32_grad_for_sub_group
        # stage_1_and_2.py: step() casts the flat 16-bit gradient partition to fp32
        # (flat_grad_partition.to(fp32)); FusedAdam keeps no temporaries
        return 4 * part
    if run.layout == "megatron":
        return 0  # fused Adam over the fp32 main grads already counted
    return None


def nvme_host_buffers(model: ModelSpec, run: RunConfig, stage: int) -> int:
    """Pinned host buffers ZeRO-Infinity swaps NVMe through (offload_config.py defaults)."""
    if run.offload_to != "nvme":
        return 0
    cb = nbytes(1, run.compute_format)
    total = 0
    if run.offload_params:
        total += DS_PARAM_SWAP_BUFFERS * cb
    if run.offload_optimizer:
        trainable = split_params(model, run, stage=stage).trainable
        part = -(-trainable // run.parallel.dp) if run.zero >= 1 else trainable
        total += DS_OPTIMIZER_SWAP_BUFFERS * min(part, DS_SUB_GROUP) * 4
    return total

