"""Published config.json files of model types the formulas do not cover (issue 20): traced in the
precision asked whatever ``torch_dtype`` they name, Gemma-3's nested text config, LoRA on them,
and a traced plan's output of the same shape as an analytic one (seq, suggestions, scale-out).

The fixtures are in ``tests/data/published_configs`` (their README gives each hub id). The
traces run with fewer layers (``_shrunk``: every other field as published) to stay fast.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from memfit.cli import main

pytest.importorskip("transformers")

DATA = Path(__file__).parents[1] / "data" / "published_configs"
CONFIGS = sorted(DATA.glob("*.json"))
BLOCK = 512  # the CUDA caching allocator rounds every tensor up to 512 bytes
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")  # --lora-targets q,k,v,o (the default)


def _block(nbytes: int) -> int:
    return -(-nbytes // BLOCK) * BLOCK


def _shrunk(path: Path, folder: Path, layers: int = 2) -> Path:
    """``path`` with ``layers`` decoder layers (one vision layer), per-layer lists cut to match;
    every other field as published."""
    data = json.loads(path.read_text(encoding="utf-8"))
    for config, n in ((data, layers), (data.get("text_config"), layers),
                      (data.get("vision_config"), 1)):
        if isinstance(config, dict) and "num_hidden_layers" in config:
            config["num_hidden_layers"] = n
            for key in ("layer_types", "no_rope_layers"):
                if key in config:
                    config[key] = config[key][:n]
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / path.name
    out.write_text(json.dumps(data), encoding="utf-8")
    return out


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def _weights(model: Any, param_bytes: dict[int, int], buffer_size: int) -> int:
    """Bytes of the traced weights row: each parameter at ``param_bytes[id]`` bytes per element,
    each floating buffer at ``buffer_size`` (integer buffers as stored), 512-byte blocks."""
    total = sum(_block(p.numel() * param_bytes[id(p)]) for p in model.parameters())
    return total + sum(_block(b.numel() * (buffer_size if b.is_floating_point()
                                           else b.element_size())) for b in model.buffers())


# ------------------------------------------------------------------ ten published configs
def test_ten_published_configs_of_uncovered_types_with_their_hub_ids() -> None:
    from memfit.models.hf_config import SUPPORTED_MODEL_TYPES

    readme = (DATA / "README.md").read_text(encoding="utf-8")
    types = set()
    for path in CONFIGS:
        data = json.loads(path.read_text(encoding="utf-8"))
        assert data["model_type"] not in SUPPORTED_MODEL_TYPES, path.name
        assert "torch_dtype" in data, path.name  # as published: the field the bug followed
        row = next(line for line in readme.splitlines() if f"`{path.name}`" in line)
        assert "/" in row.split("|")[2], path.name  # a hub id: org/name
        types.add(data["model_type"])
    assert len(CONFIGS) == len(types) == 10


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_published_config_is_traced_in_the_precision_asked(path: Path, tmp_path: Path) -> None:
    """Weights at 4 bytes per parameter under bf16-mixed (fp32 parameters under autocast) and
    2 under pure bf16, whatever ``torch_dtype`` the file names (bfloat16, float16 or float32).
    Counted tensor by tensor from the built model's shapes: its parameters and buffers."""
    from memfit.analytic.config import RunConfig
    from memfit.analytic.traced import traced_estimate
    from memfit.categories import MemoryCategory
    from memfit.models.hf_auto import HFModelSpec
    from memfit.models.hf_config import load_hf_config

    spec = load_hf_config(_shrunk(path, tmp_path))
    assert isinstance(spec, HFModelSpec)
    model = spec.build()
    assert spec.param_count() == sum(p.numel() for p in model.parameters())
    for precision, size in (("bf16-mixed", 4), ("bf16", 2)):
        est = traced_estimate(spec, RunConfig(precision=precision, seq=32), None)
        expected = _weights(model, {id(p): size for p in model.parameters()}, size)
        assert est.breakdown[MemoryCategory.WEIGHTS] == expected, precision


# ------------------------------------------------------------------------------ SmolLM3-3B
def _smollm3_params(layers: int, vocab: int = 128_256, hidden: int = 2048,
                    intermediate: int = 11_008, heads: int = 16, kv_heads: int = 4) -> int:
    """SmolLM3ForCausalLM (transformers' modeling_smollm3.py), head tied to the embedding: per
    layer q and o (h x h), k and v (h x kv_heads * head_dim), gate, up and down (h x
    intermediate), two RMSNorm weights; a final norm."""
    head_dim = hidden // heads
    per_layer = (2 * hidden * hidden + 2 * hidden * kv_heads * head_dim
                 + 3 * hidden * intermediate + 2 * hidden)
    return vocab * hidden + layers * per_layer + hidden


def test_smollm3_published_config_builds_fp32_weights() -> None:
    """The full published config (torch_dtype bfloat16): 3.08B parameters, built in fp32 for
    the trace, 4 bytes each (it was 2: transformers 5's from_config followed torch_dtype)."""
    from memfit.models.hf_config import load_hf_config

    spec = load_hf_config(DATA / "smollm3-3b.json")
    params = _smollm3_params(36)
    assert params == 3_075_098_624 and spec.param_count() == params
    model = spec.build()
    assert sum(p.numel() * p.element_size() for p in model.parameters()) == 4 * params


def test_smollm3_plan_holds_fp32_weights_and_adam_states(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    """``memfit plan`` under bf16-mixed: weights 4 B/param (every tensor's bytes a multiple of
    512: no rounding) and AdamW's two fp32 moments 8 B/param; the fp32 weights are the master
    copy, so 12 B/param of weights, master and states (16 with the fp32 gradients)."""
    path = _shrunk(DATA / "smollm3-3b.json", tmp_path)
    code, out, err = _cli(capsys, "plan", str(path), "--precision", "bf16-mixed", "--seq", "64",
                          "--json")
    assert code == 0, err
    answer = json.loads(out)
    breakdown = answer["per_gpu"]["breakdown"]
    params = _smollm3_params(2)
    rotary = 2 * BLOCK  # the rotary embedding's inv_freq and original_inv_freq (64 floats each)
    assert breakdown["weights"] == 4 * params + rotary
    tensors = 2 * 9 + 2  # per layer q, k, v, o, gate, up, down and two norms; embedding, norm
    # AdamW's step counts (one scalar per parameter tensor) are host memory (torch keeps them on
    # the CPU unless fused or capturable: Note: [optimizer step counters on the host])
    assert breakdown["optimizer_states"] == 8 * params
    assert answer["host_peak_bytes"] == 4 * tensors + 4  # and foreach's 1.0 increment


# ------------------------------------------------------------------------------- Gemma-3
def test_gemma3_published_config_reads_the_vocabulary_transformers_defaults() -> None:
    """No vocab_size anywhere in the published file: Gemma3TextConfig's default (262,208) gives
    the token ids, and the model's count is the published 4,300,079,472 (by hand: the text
    model, SigLIP's 27 layers, the projector)."""
    from memfit.models.hf_config import load_hf_config

    spec = load_hf_config(DATA / "gemma3-4b-it.json")
    inputs = spec.example_inputs(batch=1, seq=16)  # raised "no vocab_size in the config"
    assert inputs["input_ids"].shape == (1, 16)
    vocab, h, layers = 262_208, 2560, 34
    text = vocab * h + layers * (2560 * 2048 + 2 * 2560 * 1024 + 2048 * 2560 + 3 * h * 10_240
                                 + 4 * h + 2 * 256) + h
    v, inner, patches = 1152, 4304, (896 // 14) ** 2
    vision = (3 * 14 * 14 * v + v + patches * v
              + 27 * (4 * (v * v + v) + 2 * v * inner + inner + v + 4 * v) + 2 * v)
    assert spec.param_count() == text + vision + v + v * h == 4_300_079_472


def test_gemma3_checkpointing_recompute_past_the_sliding_window(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Full checkpointing at a sequence past the 1024-token sliding window: the nested text
    config keeps no KV cache, so the recompute does not append one and the mask matches. No
    fake-tensor traceback on stderr."""
    path = _shrunk(DATA / "gemma3-4b-it.json", tmp_path)
    code, out, err = _cli(capsys, "plan", str(path), "--checkpointing", "full", "--batch", "2",
                          "--seq", "1100", "--json", "--quiet")
    assert code == 0, err
    assert "Traceback" not in err and "failed while attempting" not in err
    assert json.loads(out)["run"]["seq"] == 1100


def test_gemma3_lora_is_traced(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """LoRA on a model type the formulas do not cover: the base frozen in bf16, fp32 adapters
    of rank 16 (A: r x in, B: out x r). peft names no default target_modules for gemma3 (the
    multimodal type), so every nn.Linear but the head gets one, the text model's and SigLIP's
    (issue 25 §4); ``--lora-targets q,k,v,o`` puts them on the q/k/v/o_proj layers only."""
    from torch import nn

    from memfit.models.hf_config import load_hf_config

    path = _shrunk(DATA / "gemma3-4b-it.json", tmp_path)
    model = load_hf_config(path).build()
    sizes = {id(p): 2 for p in model.parameters()}
    linears = [(name.rsplit(".", 1)[-1], m.in_features, m.out_features)
               for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and not name.endswith("lm_head")]
    for argv, adapted in (((), linears),
                          (("--lora-targets", "q,k,v,o"),
                           [lin for lin in linears if lin[0] in PROJECTIONS])):
        code, out, err = _cli(capsys, "plan", str(path), "--mode", "lora", "--seq", "64",
                              "--json", *argv)
        assert code == 0, err
        expected = _weights(model, sizes, 2) + sum(
            _block(4 * 16 * fan_in) + _block(4 * fan_out * 16) for _, fan_in, fan_out in adapted)
        plan = json.loads(out)
        assert plan["per_gpu"]["breakdown"]["weights"] == expected
        assert plan["lora"]["layers"] == len(adapted)
    assert len(adapted) == 4 * 2 + 3  # the text model's 2 layers, SigLIP's 1 (no o_proj)


def test_gemma3_qlora_names_the_weight_nf4_cannot_hold(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    """SigLIP's MLP (1152 x 4304) is no whole number of torchao's NF4 blocks (64 x 256
    weights): one line saying so and what to use, before the trace."""
    path = _shrunk(DATA / "gemma3-4b-it.json", tmp_path)
    code, _out, err = _cli(capsys, "plan", str(path), "--mode", "qlora", "--seq", "64")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert "NF4" in lines[0] and "vision_tower" in lines[0] and "--mode lora" in lines[0]


def test_lora_on_an_uncovered_type_over_several_gpus_says_why(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _shrunk(DATA / "smollm3-3b.json", tmp_path)
    code, _out, err = _cli(capsys, "plan", str(path), "--mode", "lora", "--gpus", "2")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert "smollm3" in lines[0] and "drop --gpus" in lines[0]


def test_an_op_failing_on_fake_tensors_logs_no_traceback() -> None:
    """torch's fake tensors log the traceback of an op that fails on meta (to stderr) before
    raising it; the trace raises it alone (the CLI says it in one line), and leaves the
    logger as it was."""
    import logging

    import torch
    from torch import nn

    from memfit._compat.torch_internals import FAKE_TENSOR_LOGGER
    from memfit.trace import estimate

    class Mismatch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(x).expand(2, 8, 5).sum()

    class Records(logging.Handler):
        def __init__(self) -> None:
            super().__init__(level=logging.DEBUG)
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    with torch.device("meta"):
        model = Mismatch()
    logger = logging.getLogger(FAKE_TENSOR_LOGGER)
    records, level = Records(), logger.level
    logger.addHandler(records)
    try:
        with pytest.raises(RuntimeError, match="expanded size"):
            estimate(model, torch.empty(2, 8, 4, device="meta"), device="cpu", optimizer=None)
    finally:
        logger.removeHandler(records)
    assert records.messages == [] and logger.level == level


# --------------------------------------------------- the shape of a traced plan's output
def test_uncovered_type_reports_its_sequence(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """The header and ``run.seq`` say the tokens per row traced: --seq, else the model's
    context capped at 2048 (SmolLM3: 65,536)."""
    path = _shrunk(DATA / "smollm3-3b.json", tmp_path, layers=1)
    code, out, err = _cli(capsys, "plan", str(path), "--seq", "96")
    assert code == 0, err
    assert "batch 1, seq 96" in out
    code, out, err = _cli(capsys, "plan", str(path), "--json")
    assert code == 0, err
    assert json.loads(out)["run"]["seq"] == 2048


def test_uncovered_type_that_does_not_fit_gets_retraced_suggestions_and_a_gpu_count(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """On a 5 GiB GPU the one-layer SmolLM3 step (about 7 GiB) does not fit: each suggestion's
    new total is what a plan with that change traces (run here on its own), and a GPU count
    (:func:`sharded_total`'s floor, checked below) is given with its flags."""
    path = _shrunk(DATA / "smollm3-3b.json", tmp_path, layers=1)
    gpus = tmp_path / "gpus.json"
    capacity = 5 * 2**30
    gpus.write_text(json.dumps({"gpus": [{"name": "a100-sxm-40gb", "memory_bytes": capacity}]}))
    common = (str(path), "--gpu", "a100-40gb", "--gpu-file", str(gpus), "--batch", "2",
              "--seq", "128")
    code, out, err = _cli(capsys, "plan", *common, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["fits"] is False and data["run"]["seq"] == 128
    changes = {s["change"]: s for s in data["suggestions"]}
    assert set(changes) == {"--checkpointing full", "--batch 1 --grad-accum 2",
                            "--offload-optimizer"}
    total = data["per_gpu"]["total_bytes"]
    for change, s in changes.items():
        code, alone, err = _cli(capsys, "plan", *common, *change.split(), "--json")
        assert code == 0, err
        assert s["total_bytes"] == json.loads(alone)["per_gpu"]["total_bytes"], change
        assert s["saved_bytes"] == total - s["total_bytes"] and s["saving_from"] == "trace"
    scale = data["scale_out"]
    count = scale["gpus"]
    assert count >= 2 and scale["flags"] == f"--gpus {count} --fsdp" and scale["lower_bound"]
    assert scale["per_gpu_total_bytes"] <= int(capacity * 0.85)  # the trace's 15% margin
    code, out, err = _cli(capsys, "plan", *common)
    assert code == 0, err
    text = " ".join(out.split())
    assert "batch 2, seq 128" in text and "What would save memory" in text
    assert "re-traced" in text and f"this needs at least {count} GPUs" in text
    # more GPUs come after the single changes (issue 20: options before hardware)
    assert text.index("What would save memory") < text.index(f"this needs at least {count}")


def test_sharded_total_divides_the_model_states_op_by_op() -> None:
    """Three ops of a one-GPU trace (bytes per category in the ledger's order: weights,
    gradients, optimizer states, activations, kv_cache, temporaries, runtime), 100 bytes of
    reserve and runtime outside the live tensors. Over 4 GPUs the states (and the optimizer
    step's temporaries) are a quarter at every op, the activations as traced: the forward op
    100 + 400/4 = 200, the backward op 50 + 800/4 = 250, the optimizer op (400 + 400 + 800 +
    400)/4 = 500, its peak; plus the 100 and NCCL's assumed buffers (16 channels x 2
    connections x 9,633,792 bytes, memfit.runtime)."""
    from memfit.cli.trace_plan import sharded_total

    def at(phase: str, *bytes_: int) -> SimpleNamespace:
        return SimpleNamespace(phase=phase, bytes=bytes_)

    timeline = [at("forward", 400, 0, 0, 100, 0, 0, 0),
                at("backward", 400, 400, 0, 50, 0, 0, 0),
                at("optimizer", 400, 400, 800, 0, 0, 400, 0)]
    est = SimpleNamespace(timeline=timeline, total_bytes=2000 + 100)
    assert sharded_total(est, 1) == 2100
    assert sharded_total(est, 4) == 500 + 100 + 16 * 2 * 9_633_792
