"""``memfit plan --pp N --pp-split NAMES``: the pipeline split at the named modules
(``Parallel.pp_split_points``, memfit/parallel/pipeline_split.py) from the command line, on the
model transformers builds from a config.json.

The expected bytes are counted by hand: a tiny Llama (hidden 64, 4 heads, 2 KV heads, MLP 96,
vocabulary 256, 4 layers, fp32), each parameter one block of the CUDA caching allocator, rounded
up to 512 bytes (q, o: 64x64 = 16 KiB; k, v: 64x32 = 8 KiB; gate, up, down: 64x96 = 24 KiB;
each RMSNorm's 64 floats: 512 B).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from memfit.cli import main

LAYER_BYTES = 2 * 16384 + 2 * 8192 + 3 * 24576 + 2 * 512
"""One decoder layer's parameters as the allocator holds them (module docstring)."""


def _plan(capsys: Any, tmp_path: Path, *extra: str) -> tuple[int, str, str]:
    cfg = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 4,
           "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
           "vocab_size": 256, "max_position_embeddings": 256, "tie_word_embeddings": False}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    try:
        gpus = "4" if "--tp" in extra else "2"
        code = main(["plan", str(path), "--gpus", gpus, "--seq", "32", "--precision", "fp32",
                     "--json", *extra])
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def _stage_weights(out: str) -> list[int]:
    rows = sorted(json.loads(out)["per_rank"], key=lambda r: r["stages"])
    return [r["breakdown"]["weights"] for r in rows]


def test_pp_split_moves_the_named_layers_between_stages(capsys: Any, tmp_path: Path) -> None:
    """Split at model.layers.1, then at model.layers.3: the first stage gains layers 1 and 2 and
    the second loses them, two layers' bytes each way (the embedding, head, norm and rotary
    buffers stay where they were)."""
    code, early, err = _plan(capsys, tmp_path, "--pp", "2", "--pp-split", "model.layers.1")
    assert code == 0, err
    code, late, err = _plan(capsys, tmp_path, "--pp", "2", "--pp-split", "model.layers.3")
    assert code == 0, err
    (first_early, last_early), (first_late, last_late) = _stage_weights(early), _stage_weights(late)
    assert first_late - first_early == 2 * LAYER_BYTES
    assert last_early - last_late == 2 * LAYER_BYTES


def test_pp_split_with_a_tp_plan_splits_each_stage(capsys: Any, tmp_path: Path) -> None:
    """``--tp 2 --tp-plan`` beside the split: each stage's ranks hold half of the attention
    projections of its 2 layers (q, o: 16 KiB -> 8 KiB; k, v: 8 KiB -> 4 KiB), the rest as
    without tp."""
    split = ["--pp", "2", "--pp-split", "model.layers.2"]
    code, alone, err = _plan(capsys, tmp_path, *split)
    assert code == 0, err
    plan = json.dumps({"model.layers.*.self_attn.[qkv]_proj": "colwise",
                       "model.layers.*.self_attn.o_proj": "rowwise"})
    code, tp2, err = _plan(capsys, tmp_path, *split, "--tp", "2", "--tp-plan", plan)
    assert code == 0, err
    # --gpus 2 gives one rank per stage alone; the tp run's 4 ranks are two per stage
    halved = 2 * (2 * 8192 + 2 * 4096)
    assert [a - b for a, b in zip(_stage_weights(alone), _stage_weights(tp2), strict=True)] == \
        [halved, halved]


@pytest.mark.parametrize(("extra", "needle"), [
    (["--pp", "2", "--pp-split", "model.layers.9"],
     "'model.layers.9' is not a submodule of LlamaForCausalLM"),
    (["--pp", "2", "--pp-split", "model.layers.1,model.layers.2"],
     "--pp-split names 2 split point(s); --pp 2 (1f1b) runs 2 stages, which need 1"),
    (["--pp", "2", "--pp-split", "model.layers.1,"], "--pp-split 'model.layers.1,': an empty name"),
    (["--pp-split", "model.layers.1"], "does nothing without pipeline stages; add --pp N"),
])
def test_bad_pp_split_is_one_line_exit_2(capsys: Any, tmp_path: Path, extra: list[str],
                                         needle: str) -> None:
    code, _, err = _plan(capsys, tmp_path, *extra)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
