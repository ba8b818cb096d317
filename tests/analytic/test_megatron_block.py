"""--engine megatron plans Megatron-LM's own block (Note: [Megatron's block]) and its local
core attention's score buffer, checked by hand against Korthikanti et al.'s count.

Expected values from first principles: Korthikanti et al. (arXiv 2205.05198, §4.1) count
34sbh + 5as²b bytes per GPT block in 16-bit with dropout, which is exactly what Megatron's block
keeps (fused bias-GeLU keeps only its input: megatron/core/fusions/fused_bias_gelu.py).
Hugging Face's GPT-2 block runs gelu_new op by op, 3e more bytes per element of the 4h-wide
tensor (Note: [gelu_new]).
"""

from __future__ import annotations

import dataclasses

from memfit.analytic.activations import training_activations
from memfit.analytic.config import RunConfig
from memfit.analytic.engine_buffers import PERSISTENT_BUFFERS, engine_buffers
from memfit.models import get_preset

# Megatron-LM's functional-test GPT: 12 layers, hidden 512, 8 heads, seq 1024, micro-batch 4
S, B, H, A = 1024, 4, 512, 8
SPEC = dataclasses.replace(get_preset("gpt2"), num_layers=12, hidden_size=H, num_heads=A,
                           num_kv_heads=A, intermediate_size=4 * H, vocab_size=50304,
                           max_position_embeddings=1024)


def _run(engine: str, attention: str = "eager", **kw: object) -> RunConfig:
    return RunConfig.from_dict({"batch": B, "seq": S, "gpus": 8, "engine": engine,
                                "precision": "bf16-mixed", "attention": attention, **kw})


def test_megatron_block_is_korthikantis_count() -> None:
    sbh = S * B * H
    korthikanti = 34 * sbh + 5 * A * S * S * B  # 239,075,328 bytes
    acts = training_activations(SPEC, _run("megatron", zero=1), S)
    assert acts.per_layer == korthikanti == 239_075_328
    # the same config under an engine that runs Hugging Face's GPT-2 block (16-bit model, no
    # autocast): gelu_new keeps 3 x 2 bytes more per element of the s x b x 4h tensor
    hf = training_activations(SPEC, _run("fsdp2", zero=3), S)
    assert hf.per_layer == korthikanti + 3 * 2 * S * B * 4 * H


def test_megatron_local_attention_score_buffer() -> None:
    # get_global_memory_buffer().get_tensor((b * np, sq, sk), bf16, "mpu"): 2 x 4 x 8 x 1024²
    buffers = engine_buffers(SPEC, _run("megatron", zero=1), 0, S)
    assert buffers == {"attention-score buffer": 2 * B * A * S * S}
    assert "attention-score buffer" in PERSISTENT_BUFFERS
    # tensor parallelism splits the heads; fused attention has no such buffer
    assert engine_buffers(SPEC, _run("megatron", zero=1, tp=2), 0, S) == {
        "attention-score buffer": 2 * B * (A // 2) * S * S}
    assert engine_buffers(SPEC, _run("megatron", "flash", zero=1), 0, S) == {}
