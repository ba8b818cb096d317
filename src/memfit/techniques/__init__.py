"""Memory techniques, each applied with one call, composable in a documented order.

Note: [composition order] Apply them in this order (each step's docstring says why):

1. ``configure_allocator`` — before any CUDA work (the allocator reads its settings once).
2. build the model; ``use_sdpa`` (attention kernels); ``apply_lora`` / ``apply_qlora``.
3. ``apply_chunked_loss`` (replaces the LM head's loss).
4. ``apply_activation_checkpointing`` (wraps blocks; checkpointed blocks keep their inputs in
   the recompute closure, not as saved tensors).
5. ``offload_activations`` (moves what checkpointing still saves).
6. ``torch.compile``, then sharding (FSDP2) — as torchtitan: AC before compile before FSDP.
7. ``apply_sparse_embeddings`` before the optimizer is built (it must take sparse gradients);
   ``make_optimizer`` over the trainable parameters; ``apply_precision`` around the loop;
   ``accumulate`` inside it.
8. Inference: ``quantize_weights`` on the eval model; ``sparsify`` on a pruned one (it removes
   the pruning first: ``weight_orig`` and the mask go); ``apply_semi_structured_sparsity``
   (2:4) on the eval model, after the weights are in fp16/bf16 on the GPU (it compresses the
   weights as they are then).

``tests/techniques/test_tech_composition.py`` applies steps 3 to 7 to one model (chunked loss,
selective checkpointing, offload, ``torch.compile``, FSDP2, AdamW) and checks the loss, gradients
and updated weights are bit-identical to the plain model's.
"""

from memfit.techniques.accumulation import (
    AccumulatedStep,
    AccumulationResult,
    accumulate,
    count_tokens,
    split_batch,
)
from memfit.techniques.allocator import AllocatorSettings, configure_allocator
from memfit.techniques.attention import sdpa_backends, set_attn_implementation, use_sdpa
from memfit.techniques.checkpointing import (
    Budget,
    CheckpointPlan,
    EveryK,
    Full,
    OpPolicy,
    Policy,
    Selective,
    Torchtitan,
    apply_activation_checkpointing,
    remove_activation_checkpointing,
)
from memfit.techniques.loss import apply_chunked_loss, chunked_cross_entropy
from memfit.techniques.offload import (
    OffloadActivations,
    apply_activation_offload,
    offload_activations,
)
from memfit.techniques.optim import CPUOffloadOptimizer, make_optimizer
from memfit.techniques.peft import LoRALinear, apply_lora, apply_qlora, trainable_parameters
from memfit.techniques.precision import MasterWeights, MixedPrecision, apply_precision
from memfit.techniques.quant import convert_qat, prepare_qat, quantize_weights, weight_bytes
from memfit.techniques.semi_structured import (
    SemiStructuredReport,
    apply_semi_structured_sparsity,
    mask_2_4,
)
from memfit.techniques.sparse import SparseAdamWithDense, apply_sparse_embeddings
from memfit.techniques.sparse_weights import (
    SparseLinear,
    SparsifyReport,
    break_even_density,
    sparsify,
)

__all__ = [
    "AccumulatedStep",
    "AccumulationResult",
    "AllocatorSettings",
    "Budget",
    "CPUOffloadOptimizer",
    "CheckpointPlan",
    "EveryK",
    "Full",
    "LoRALinear",
    "MasterWeights",
    "MixedPrecision",
    "OffloadActivations",
    "OpPolicy",
    "Policy",
    "Selective",
    "SemiStructuredReport",
    "SparseAdamWithDense",
    "SparseLinear",
    "SparsifyReport",
    "Torchtitan",
    "accumulate",
    "apply_activation_checkpointing",
    "apply_activation_offload",
    "apply_chunked_loss",
    "apply_lora",
    "apply_precision",
    "apply_qlora",
    "apply_semi_structured_sparsity",
    "apply_sparse_embeddings",
    "break_even_density",
    "chunked_cross_entropy",
    "configure_allocator",
    "convert_qat",
    "count_tokens",
    "make_optimizer",
    "mask_2_4",
    "offload_activations",
    "prepare_qat",
    "quantize_weights",
    "remove_activation_checkpointing",
    "sdpa_backends",
    "set_attn_implementation",
    "sparsify",
    "split_batch",
    "trainable_parameters",
    "use_sdpa",
    "weight_bytes",
]
