"""The analytic plan offers sparse embedding gradients where the embedding tables that could take
them hold at least half of a fully trained model's parameters (``memfit plan``, text and JSON),
and says nothing where they cannot (tied or untied decoders, LoRA, inference)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memfit.analytic.config import RunConfig
from memfit.analytic.planner import plan
from memfit.analytic.suggestions import SPARSE_EMBEDDING_SHARE, sparse_gradient_note
from memfit.cli import main
from memfit.models import get_preset
from memfit.models import load_hf_config as load_config
from memfit.units import format_bytes

# XLM-R base's dimensions as a BERT config: a 250k-token vocabulary on a 12-layer encoder
XLMR_BASE = {"model_type": "bert", "vocab_size": 250002, "hidden_size": 768,
             "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072,
             "max_position_embeddings": 514, "type_vocab_size": 1}
# by hand: tables 250002*768 + 514*768 + 1*768; per layer 4*768^2 + 4*768 (attention) +
# 2*768*3072 + 3072 + 768 (MLP) + 2 LayerNorms (2*768 each); the embeddings' LayerNorm 2*768;
# the pooler 768^2 + 768
TABLES = 250002 * 768 + 514 * 768 + 768
LAYER = 4 * 768**2 + 4 * 768 + 2 * 768 * 3072 + 3072 + 768 + 2 * 2 * 768
PARAMS = TABLES + 2 * 768 + 12 * LAYER + 768**2 + 768


def xlmr(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(XLMR_BASE))
    return path


def test_the_threshold_is_the_traced_fits() -> None:
    from memfit.techniques.sparse import DOMINANT_SHARE

    assert SPARSE_EMBEDDING_SHARE == DOMINANT_SHARE


def test_large_vocabulary_encoder_gets_the_note(tmp_path: Path) -> None:
    model = load_config(xlmr(tmp_path))
    assert model.param_count() == PARAMS == 278_043_648
    note = sparse_gradient_note(plan(model, RunConfig(mode="train", precision="fp32")))
    assert note is not None
    assert f"hold {TABLES / PARAMS:.0%} of the trainable" in note and "69%" in note
    assert f"instead of {format_bytes(4 * TABLES)} of dense gradients" in note  # fp32 grads
    assert "apply_sparse_embeddings" in note and "not AdamW" in note


def test_decoders_lora_and_inference_get_none(tmp_path: Path) -> None:
    encoder = load_config(xlmr(tmp_path))
    assert sparse_gradient_note(plan(encoder, RunConfig(mode="lora"))) is None
    assert sparse_gradient_note(plan(encoder, RunConfig(mode="inference"))) is None
    # untied decoder: the LM head is as large as the token table, which is then at most half
    assert sparse_gradient_note(plan(get_preset("llama-3-8b"), RunConfig(mode="train"))) is None
    # tied (gpt2): the head's dense gradient flows into the table
    assert sparse_gradient_note(plan(get_preset("gpt2"), RunConfig(mode="train"))) is None


@pytest.mark.parametrize("json_out", [False, True])
def test_memfit_plan_shows_it(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                              json_out: bool) -> None:
    code = main(["plan", str(xlmr(tmp_path)), "--gpu", "h100-80gb", "--batch", "8",
                 "--seq", "512", *(["--json"] if json_out else [])])
    out = capsys.readouterr().out
    assert code == 0
    if json_out:
        assert any("apply_sparse_embeddings" in n for n in json.loads(out)["notes"])
    else:
        assert "apply_sparse_embeddings" in " ".join(out.split())
