"""``memfit plan --mode train --sparsity 2:4``: torchao's SemiSparseLinear keeps the dense model
states and adds, per forward, compressed copies of every block projection's W and W^T and a
bitmask, held until backward (19/8 bytes per bf16 weight where the dimensions are multiples of
128: SparseSemiStructuredTile.cu, cited in memfit.semi_structured)."""

from __future__ import annotations

import json

import pytest
import torch

import memfit
from memfit.analytic.config import RunConfig
from memfit.categories import MemoryCategory
from memfit.cli import main
from memfit.errors import MemfitError
from memfit.models import resolve_model
from memfit.techniques import apply_semi_structured_sparsity
from memfit.techniques import semi_structured as tech

# llama-3-8b (config.json): hidden 4096, 32 layers, 8 KV heads of 128, MLP 14336.
HIDDEN, LAYERS, KV, MLP = 4096, 32, 8 * 128, 14336
PROJECTIONS = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN),  # q k v o
               (MLP, HIDDEN), (MLP, HIDDEN), (HIDDEN, MLP)]                      # gate up down


def _copies(out_f: int, in_f: int) -> int:
    """By hand from the tile kernel: W and W^T, each out*in/2 values + out*in/16 metadata
    elements of 2 bytes; the bitmask, 8 bytes per 8 x 8 tile."""
    return 2 * (out_f * in_f // 2 + out_f * in_f // 16) * 2 + out_f * in_f // 8


BLOCK = sum(_copies(o, i) for o, i in PROJECTIONS)


def _pair(**run: object) -> tuple[memfit.MemoryPlan, memfit.MemoryPlan]:
    llama = resolve_model("llama-3-8b")
    base = {"mode": "train", "precision": "bf16", "seq": 2048, **run}
    return (memfit.plan(llama, RunConfig(**base)),  # type: ignore[arg-type]
            memfit.plan(llama, RunConfig(**base, sparsity="2:4")))  # type: ignore[arg-type]


def test_training_keeps_the_model_states_and_adds_the_held_copies() -> None:
    dense, sparse = _pair()
    for cat in (MemoryCategory.WEIGHTS, MemoryCategory.GRADIENTS,
                MemoryCategory.OPTIMIZER_STATES, MemoryCategory.TEMPORARIES):
        assert sparse.breakdown[cat] == dense.breakdown[cat], cat
    added = (sparse.breakdown[MemoryCategory.ACTIVATIONS]
             - dense.breakdown[MemoryCategory.ACTIVATIONS])
    assert added == LAYERS * BLOCK
    assert BLOCK * 8 == 19 * sum(o * i for o, i in PROJECTIONS)
    assert sparse.total_bytes - dense.total_bytes == added > 0
    assert any("saves compute, not memory" in n for n in sparse.notes)


def test_full_checkpointing_holds_one_blocks_copies() -> None:
    """A block's copies are saved tensors: checkpointing drops them in the forward and the
    recomputation of the block in backward makes them again, one block at a time. (A batch that
    keeps the peak in backward: at the optimizer step the copies are gone.)"""
    dense, sparse = _pair(checkpointing="full", batch=4, seq=8192)
    assert sparse.peak_phase == dense.peak_phase == "backward"
    assert (sparse.breakdown[MemoryCategory.ACTIVATIONS]
            - dense.breakdown[MemoryCategory.ACTIVATIONS]) == BLOCK


def test_tensor_parallel_copies_are_the_shards() -> None:
    llama = resolve_model("llama-3-8b")
    run = RunConfig(mode="train", precision="bf16", seq=2048).relayout(gpus=2, tp=2)
    tp_dense = memfit.plan(llama, run)
    tp_sparse = memfit.plan(llama, RunConfig(mode="train", precision="bf16", seq=2048,
                                             sparsity="2:4").relayout(gpus=2, tp=2))
    assert (tp_sparse.breakdown[MemoryCategory.ACTIVATIONS]
            - tp_dense.breakdown[MemoryCategory.ACTIVATIONS]) == LAYERS * BLOCK // 2


def test_plan_and_apply_count_the_same_copies(tmp_path, monkeypatch) -> None:
    """The plan's added bytes for a tiny llama equal what apply_semi_structured_sparsity(mode=
    "training") reports for the real module's projections (the device checks bypassed: the swap
    itself runs on CPU)."""
    pytest.importorskip("torchao")
    transformers = pytest.importorskip("transformers")
    config = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 512,
              "vocab_size": 1000, "max_position_embeddings": 512}
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = resolve_model(tmp_path / "config.json")
    run = {"mode": "train", "precision": "bf16", "seq": 512, "batch": 8}  # peak in backward
    dense = memfit.plan(spec, RunConfig(**run))  # type: ignore[arg-type]
    sparse = memfit.plan(spec, RunConfig(**run, sparsity="2:4"))  # type: ignore[arg-type]
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).to(torch.bfloat16)
    monkeypatch.setattr(tech, "_training_refusal", lambda name, weight: None)
    report = apply_semi_structured_sparsity(model, mode="training")
    assert len(report.converted) == 2 * 7 and not report.skipped
    assert sparse.peak_phase == dense.peak_phase == "backward"
    assert (sparse.breakdown[MemoryCategory.ACTIVATIONS]
            - dense.breakdown[MemoryCategory.ACTIVATIONS]) == report.training_bytes


def test_a_projection_the_tile_kernel_cannot_take_is_refused(tmp_path) -> None:
    """hidden 192: [192, 192] is a multiple of cuSPARSELt's 16 (inference plans) but not of the
    tile kernel's 128 (training is refused)."""
    config = {"model_type": "llama", "hidden_size": 192, "num_hidden_layers": 2,
              "num_attention_heads": 3, "num_key_value_heads": 3, "intermediate_size": 512,
              "vocab_size": 1000, "max_position_embeddings": 512}
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = resolve_model(tmp_path / "config.json")
    memfit.plan(spec, RunConfig(mode="inference", precision="bf16", sparsity="2:4"))
    with pytest.raises(MemfitError, match=r"q projection shape \[192, 192\] is not a multiple "
                                          r"of \(128, 128\).*sparsify it in training"):
        memfit.plan(spec, RunConfig(mode="train", precision="bf16", sparsity="2:4"))


REFUSED = [
    (["--mode", "lora", "--sparsity", "2:4"], "not --mode lora"),
    (["--mode", "train", "--engine", "ddp", "--precision", "bf16-mixed", "--sparsity", "2:4"],
     "autocast keeps fp32 weights"),
    (["--mode", "train", "--engine", "megatron", "--sparsity", "2:4"], "Megatron-LM"),
    (["--mode", "train", "--gpu", "t4", "--precision", "fp16", "--sparsity", "2:4"],
     "compute capability 7.5"),
    (["--mode", "train", "--precision", "fp32", "--sparsity", "2:4"], "fp16 or bf16"),
]


@pytest.mark.parametrize(("argv", "why"), REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_refused_with_one_line_and_exit_2(capsys, argv: list[str], why: str) -> None:
    assert main(["plan", "llama-3-8b", *argv]) == 2
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1 and why in lines[0], captured.err
    assert captured.out == ""


def test_json_says_so(capsys) -> None:
    argv = ["plan", "llama-3-8b", "--gpu", "h100-sxm-80gb", "--mode", "train", "--precision",
            "bf16", "--seq", "2048", "--json"]
    assert main(argv) == 0
    dense = json.loads(capsys.readouterr().out)
    assert main([*argv, "--sparsity", "2:4"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["run"]["sparsity"] == "2:4"
    assert (out["per_gpu"]["breakdown"]["activations"]
            - dense["per_gpu"]["breakdown"]["activations"]) == LAYERS * BLOCK
    assert out["per_gpu"]["breakdown"]["weights"] == dense["per_gpu"]["breakdown"]["weights"]
    assert any("saves compute, not memory" in n for n in out["notes"])
