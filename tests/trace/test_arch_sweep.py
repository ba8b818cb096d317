"""A representative slice of ``bench/arch_sweep.py``: tiny transformers models trace on both
targets under bf16-mixed with Hugging Face's gradient checkpointing (the cells that crashed:
issue 11, section 1), including mixture-of-experts models (grouped_mm experts), an
encoder-decoder, speech and vision models. The whole sweep (every architecture, eight cells,
with a real CPU step as the "buildable" check) is the bench."""

from __future__ import annotations

from types import ModuleType

import pytest

from _bench import load_bench

pytest.importorskip("transformers")

ARCHITECTURES = [
    ("causal-lm", "gpt2"), ("causal-lm", "llama"), ("causal-lm", "mixtral"),
    ("causal-lm", "qwen3_moe"), ("causal-lm", "olmoe"), ("causal-lm", "deepseek_v3"),
    ("causal-lm", "gpt_oss"), ("causal-lm", "qwen2_moe"), ("causal-lm", "mamba"),
    ("seq2seq-lm", "t5"), ("seq2seq-lm", "bart"), ("speech-seq2seq", "whisper"),
    ("image-classification", "vit"), ("masked-lm", "bert"), ("ctc", "wav2vec2"),
]
CELLS = [("cuda", "bf16-mixed", True), ("cpu", "bf16-mixed", True)]


def _load() -> ModuleType:
    module = load_bench("arch_sweep")
    return module


@pytest.fixture(scope="module")
def sweep() -> ModuleType:
    return _load()


@pytest.mark.slow
@pytest.mark.parametrize(("family", "model_type"), ARCHITECTURES,
                         ids=[m for _, m in ARCHITECTURES])
def test_architecture_traces(sweep: ModuleType, family: str, model_type: str) -> None:
    row = sweep.run_one(family, model_type, cells=CELLS, check_real=False)
    assert row.get("buildable"), row.get("reason")
    failed = {k: v for k, v in row["cells"].items() if v not in ("ok", "n/a")}
    assert not failed, failed
    assert any(v == "ok" for v in row["cells"].values())
