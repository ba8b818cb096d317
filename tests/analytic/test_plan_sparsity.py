"""``memfit plan --sparsity 2:4``: the blocks' projections priced compressed, the rest dense;
bad combinations refused in one line with exit 2."""

from __future__ import annotations

import json

import pytest

import memfit
from memfit.analytic.config import RunConfig
from memfit.categories import MemoryCategory
from memfit.cli import main
from memfit.errors import MemfitError
from memfit.gpus import get_gpu
from memfit.models import resolve_model
from memfit.models.spec import ParamCountSpec
from memfit.semi_structured import compressed_bytes
from memfit.techniques import apply_semi_structured_sparsity

# llama-3-8b (config.json): hidden 4096, 32 layers, 32 heads of 128, 8 KV heads, MLP 14336,
# vocabulary 128256, untied head.
HIDDEN, LAYERS, KV, MLP, VOCAB = 4096, 32, 8 * 128, 14336, 128256
PROJECTIONS = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN),  # q k v o
               (MLP, HIDDEN), (MLP, HIDDEN), (HIDDEN, MLP)]                      # gate up down
LINEAR = LAYERS * sum(o * i for o, i in PROJECTIONS)
OTHER = 2 * VOCAB * HIDDEN + LAYERS * 2 * HIDDEN + HIDDEN  # embed, head, 2 norms/layer, final


def test_llama_weights_are_compressed_projections_plus_dense_rest() -> None:
    llama = resolve_model("llama-3-8b")
    dense = memfit.plan(llama, RunConfig(mode="inference", precision="bf16"))
    sparse = memfit.plan(llama, RunConfig(mode="inference", precision="bf16", sparsity="2:4"),
                         get_gpu("a100-sxm-40gb"))
    assert dense.breakdown[MemoryCategory.WEIGHTS] == (LINEAR + OTHER) * 2
    # bf16: kept values (1 byte per weight) + one 4-bit code per group of 4 (1/8 byte); the
    # cuSPARSELt and CUTLASS layouts hold the same bytes for each projection.
    expected = LINEAR * 9 // 8 + OTHER * 2
    per_layer = {b: sum(compressed_bytes(o, i, "bf16", b).total for o, i in PROJECTIONS)
                 for b in ("cutlass", "cusparselt")}
    assert per_layer["cutlass"] == per_layer["cusparselt"]
    assert sparse.breakdown[MemoryCategory.WEIGHTS] == expected == LAYERS * per_layer[
        "cutlass"] + OTHER * 2
    assert any("2:4 sparsity" in n and "stay dense" in n for n in sparse.notes)
    others = [c for c in MemoryCategory if c is not MemoryCategory.WEIGHTS]
    assert all(sparse.breakdown[c] == dense.breakdown[c] for c in others if c in dense.breakdown)


def test_plan_and_apply_count_the_same_bytes(tmp_path) -> None:
    """The plan's compressed bytes for a tiny llama equal what apply_semi_structured_sparsity
    reports for the real module's projections (its head kept dense)."""
    import torch

    config = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 512,
              "vocab_size": 1000, "max_position_embeddings": 512}
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = resolve_model(tmp_path / "config.json")
    sparse = memfit.plan(spec, RunConfig(mode="inference", precision="bf16", sparsity="2:4"))
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).to(torch.bfloat16)
    report = apply_semi_structured_sparsity(model)
    rest = sum(p.numel() * p.element_size() for p in model.parameters()) - report.dense_bytes
    assert len(report.pruned) == 2 * 7
    assert sparse.breakdown[MemoryCategory.WEIGHTS] == report.compressed_bytes + rest


def test_a_projection_torch_cannot_compress_is_refused(tmp_path) -> None:
    """hidden 200: the q projection is [200, 200], not a multiple of cuSPARSELt's 16 x 16."""
    config = {"model_type": "llama", "hidden_size": 200, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 512,
              "vocab_size": 1000, "max_position_embeddings": 512}
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = resolve_model(tmp_path / "config.json")
    with pytest.raises(MemfitError, match=r"q projection shape \[200, 200\] is not a multiple"):
        memfit.plan(spec, RunConfig(mode="inference", precision="bf16", sparsity="2:4"))
    # 32 heads of 8: split 32 ways, each q shard is [8, 256], under the 16-row minimum
    config.update(hidden_size=256, num_attention_heads=32, num_key_value_heads=32)
    (tmp_path / "config.json").write_text(json.dumps(config))
    narrow = RunConfig(mode="inference", precision="bf16", sparsity="2:4")
    memfit.plan(resolve_model(tmp_path / "config.json"), narrow)
    with pytest.raises(MemfitError, match=r"q projection \(its --tp 32 shard\) shape \[8, 256\]"):
        memfit.plan(resolve_model(tmp_path / "config.json"), narrow.relayout(gpus=32, tp=32))


REFUSED = [
    (["--gpu", "t4", "--mode", "inference", "--sparsity", "2:4"], "compute capability 7.5"),
    (["--gpu", "v100-sxm2-16gb", "--mode", "inference", "--precision", "fp16", "--sparsity",
      "2:4"], "compute capability 7.0"),
    (["--mode", "inference", "--sparsity", "3:4"], "unknown sparsity pattern '3:4'"),
    (["--mode", "inference", "--precision", "fp32", "--sparsity", "2:4"], "fp16 or bf16"),
    (["--mode", "inference", "--precision", "fp8", "--gpu", "h100-sxm-80gb", "--sparsity",
      "2:4"], "fp16 or bf16"),
    (["--mode", "lora", "--sparsity", "2:4"], "--mode inference"),
    (["--mode", "inference", "--quant", "int4", "--sparsity", "2:4"], "--quant int4"),
    (["--mode", "inference", "--sparsity", "2:4", "--method", "trace"], "formulas"),
]


@pytest.mark.parametrize(("argv", "why"), REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_refused_with_one_line_and_exit_2(capsys, argv: list[str], why: str) -> None:
    assert main(["plan", "llama-3-8b", *argv]) == 2
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1 and why in lines[0], captured.err
    assert captured.out == ""


def test_a_parameter_count_alone_is_refused() -> None:
    with pytest.raises(MemfitError, match="--params"):
        memfit.plan(ParamCountSpec(name="8B", params=8_000_000_000),
                    RunConfig(mode="inference", sparsity="2:4"))


def test_json_and_table_say_so(capsys) -> None:
    argv = ["plan", "llama-3-8b", "--gpu", "a100-sxm-40gb", "--mode", "inference",
            "--sparsity", "2:4"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["run"]["sparsity"] == "2:4"
    assert out["per_gpu"]["breakdown"]["weights"] == LINEAR * 9 // 8 + OTHER * 2
    assert any("2:4 sparsity" in n for n in out["notes"])
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "2:4 sparse linear weights" in text and "9/8 bytes per weight" in text

