"""Options that cannot act are refused, not ignored: exit code 2 and one line naming the flag
(Note: [options that do nothing] in analytic/config.py); the Python API refuses the same."""

from __future__ import annotations

import pytest

import memfit
from memfit.analytic.config import RunConfig
from memfit.cli import main
from memfit.errors import MemfitError
from memfit.models import resolve_model

# llama-3-8b: max_position_embeddings 8192, RoPE, no rope_scaling; its smallest LoRA target of
# q,k,v,o is k/v: 4096 -> 8 KV heads x 128 = 1024, so full rank is 1024.
# gpt2: learned absolute position embeddings, n_positions 1024.
REFUSED = [
    (["plan", "llama-3-8b", "--seq", "16384"], "--seq 16384", "8192"),
    (["plan", "llama-3-8b", "--seq", "16384", "--method", "trace"], "--seq 16384", "8192"),
    (["plan", "gpt2", "--seq", "2048"], "--seq 2048", "learned position embeddings"),
    (["plan", "llama-3-8b", "--mode", "inference", "--seq", "8000", "--new-tokens", "500"],
     "--new-tokens 500", "8192"),
    (["plan", "llama-3-8b", "--new-tokens", "100", "--mode", "train"], "--new-tokens 100",
     "--mode inference"),
    (["plan", "llama-3-8b", "--optimizer", "sgd", "--mode", "inference"], "--optimizer sgd",
     "training mode"),
    (["plan", "llama-3-8b", "--optimizer", "adamw", "--mode", "inference"], "--optimizer adamw",
     "training mode"),  # explicit, even when it is the default
    (["plan", "llama-3-8b", "--lora-rank", "100000", "--mode", "lora"], "--lora-rank 100000",
     "full rank 1024"),
    (["plan", "llama-3-8b", "--lora-rank", "1025", "--mode", "qlora"], "--lora-rank 1025",
     "full rank 1024"),
    (["plan", "llama-3-8b", "--lora-rank", "8"], "--lora-rank 8", "--mode lora"),
    (["plan", "llama-3-8b", "--lora-targets", "all", "--mode", "inference"], "--lora-targets",
     "--mode lora"),
    (["plan", "llama-3-8b", "--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8",
     "--mode inference"),
    # inference has no backward to recompute in and no gradients to accumulate: both were
    # accepted and dropped (the same bytes as without them, and the header left them out)
    (["plan", "llama-3-8b", "--mode", "inference", "--checkpointing", "full"],
     "--checkpointing full", "training mode"),
    (["plan", "llama-3-8b", "--mode", "inference", "--grad-accum", "4"], "--grad-accum 4",
     "training mode"),
    (["fit", "gpt2", "--budget", "8GB", "--global-batch", "8", "--seq", "4096"], "--seq 4096",
     "1024"),
    (["fit", "mypkg.train:make", "--budget", "8GB", "--global-batch", "8", "--seq", "128"],
     "--seq 128", "sample batch"),
]


@pytest.mark.parametrize(("argv", "flag", "why"), REFUSED,
                         ids=[" ".join(a) for a, _, _ in REFUSED])
def test_refused_with_one_line_and_exit_2(capsys, argv: list[str], flag: str, why: str) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1, captured.err
    assert flag in lines[0] and why in lines[0], lines[0]
    assert captured.out == ""


ACCEPTED = [
    ["plan", "llama-3-8b", "--seq", "8192"],
    ["plan", "llama-3-8b", "--mode", "lora", "--lora-rank", "1024"],
    ["plan", "llama-3-8b", "--mode", "inference", "--seq", "4096", "--new-tokens", "4096"],
    ["plan", "llama-3-8b", "--mode", "inference"],
    ["plan", "gpt2", "--seq", "1024", "--optimizer", "sgd"],
]


@pytest.mark.parametrize("argv", ACCEPTED, ids=[" ".join(a) for a in ACCEPTED])
def test_sensible_options_still_plan(capsys, argv: list[str]) -> None:
    assert main(argv) == 0, capsys.readouterr().err


def test_python_api_refuses_too() -> None:
    llama = resolve_model("llama-3-8b")
    with pytest.raises(MemfitError, match="new-tokens"):
        RunConfig(mode="train", new_tokens=100)
    with pytest.raises(MemfitError, match="optimizer sgd"):
        RunConfig(mode="inference", optimizer="sgd")
    with pytest.raises(MemfitError, match="lora-rank 8"):
        RunConfig(mode="train", lora_rank=8)
    with pytest.raises(MemfitError, match="checkpointing selective"):
        RunConfig(mode="inference", checkpointing="selective")
    with pytest.raises(MemfitError, match="grad-accum 2"):
        RunConfig(mode="inference", grad_accum=2)
    with pytest.raises(MemfitError, match="full rank 1024"):
        memfit.plan(llama, RunConfig(mode="lora", lora_rank=100000))
    with pytest.raises(MemfitError, match="context of 8192"):
        memfit.plan(llama, RunConfig(seq=16384))


def test_rope_scaling_lifts_the_context_check(tmp_path) -> None:
    """A RoPE config with rope_scaling is planned past max_position_embeddings (the scaling
    decides the context); the same config without it is refused."""
    import json

    config = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 512,
              "vocab_size": 1000, "max_position_embeddings": 1024}
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps(config))
    scaled = tmp_path / "scaled"
    scaled.mkdir()
    (scaled / "config.json").write_text(json.dumps(
        {**config, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}))
    with pytest.raises(MemfitError, match="rope_scaling"):
        memfit.plan(resolve_model(plain), RunConfig(seq=4096))
    assert memfit.plan(resolve_model(scaled), RunConfig(seq=4096)).seq == 4096


@pytest.mark.parametrize(("model_type", "extra", "scaled"), [
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, False),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, True),
    ("gpt_neox", {"rope_scaling": {"type": "linear", "factor": 2.0}}, True),
    ("phi", {"rope_scaling": {"type": "linear", "factor": 2.0}}, True),
    ("falcon", {"rope_scaling": {"type": "linear", "factor": 2.0}}, True),
    ("falcon", {}, False),
])
def test_rope_stretch_is_read_in_both_spellings_and_every_rope_family(
        tmp_path, model_type: str, extra: dict, scaled: bool) -> None:
    """transformers 5 writes ``rope_parameters`` (``rope_type`` "default" stretches nothing);
    older files ``rope_scaling``. GPT-NeoX, Phi and Falcon use RoPE too."""
    import json

    config = {"model_type": model_type, "hidden_size": 256, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 512,
              "vocab_size": 1000, "max_position_embeddings": 1024, **extra}
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = resolve_model(tmp_path / "config.json")
    assert spec.position == "rope" and spec.rope_scaling is scaled


def test_python_plan_takes_names_as_the_cli_does() -> None:
    """``memfit.plan("gpt2", run, "t4")`` (names, as the README's estimate(gpu="...") takes
    them) plans the preset on the catalog GPU; it raised AttributeError ('str' object has no
    attribute 'num_layers' / 'bf16') deep inside the planner."""
    run_config = RunConfig(precision="fp16-mixed")
    by_name = memfit.plan("gpt2", run_config, "t4")
    by_spec = memfit.plan(resolve_model("gpt2"), run_config, memfit.get_gpu("t4"))
    assert by_name.total_bytes == by_spec.total_bytes and by_name.gpu == by_spec.gpu
    assert by_name.model.param_count() == 124_439_808  # GPT-2 (facts.md)
    with pytest.raises(MemfitError, match="did you mean 'gpt2'"):
        memfit.plan("gpt3")
    with pytest.raises(MemfitError, match="unknown GPU 't5'"):
        memfit.plan("gpt2", run_config, "t5")
