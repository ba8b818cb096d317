"""The CLI, in-process: outputs, the JSON contract, and one-line errors with exit code 2."""

from __future__ import annotations

import json

import pytest

from memfit.cli import main
from memfit.units import format_bytes


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_table_lora_example(capsys) -> None:
    code, out, err = run(capsys, "plan", "llama-3-8b", "--gpu", "rtx-4090", "--mode", "lora",
                         "--batch", "4", "--seq", "2048")
    assert code == 0, err
    for category in ("weights", "gradients", "optimizer_states", "activations", "kv_cache",
                     "temporaries", "runtime", "total"):
        assert category in out
    assert "fit" in out


def test_plan_json_contract(capsys) -> None:
    code, out, _ = run(capsys, "plan", "llama-3-8b", "--gpu", "h100-80gb", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["model"] == {"name": "llama-3-8b", "params": 8_030_261_248}
    assert isinstance(data["gpu"]["capacity_bytes"], int)
    breakdown = data["per_gpu"]["breakdown"]
    assert set(breakdown) == {"weights", "gradients", "optimizer_states", "activations",
                              "kv_cache", "temporaries", "runtime"}
    assert all(isinstance(v, int) for v in breakdown.values())
    assert data["per_gpu"]["total_bytes"] == sum(breakdown.values())
    assert isinstance(data["fits"], bool)
    assert data["headroom_bytes"] == data["gpu"]["capacity_bytes"] - data["per_gpu"][
        "total_bytes"]


def test_plan_json_without_gpu_uses_null(capsys) -> None:
    code, out, _ = run(capsys, "plan", "--params", "7.5e9", "--precision", "fp16-mixed",
                       "--optimizer", "adam", "--gpus", "64", "--zero", "2", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["gpu"] is None and data["fits"] is None and data["headroom_bytes"] is None
    b = data["per_gpu"]["breakdown"]
    # ZeRO-2: 2Ψ + 14Ψ/64 = 16.64 GB of model states (ZeRO paper)
    assert (b["weights"] + b["gradients"] + b["optimizer_states"]) / 1e9 == pytest.approx(
        16.64, abs=0.01)
    assert b["activations"] == 0 and data["activations_known"] is False


def test_params_only_table_says_unknown(capsys) -> None:
    code, out, _ = run(capsys, "plan", "--params", "7.5e9")
    assert code == 0
    assert "unknown" in out


def test_does_not_fit_lists_suggestions(capsys) -> None:
    code, out, _ = run(capsys, "plan", "llama-3-8b", "--gpu", "rtx-4090", "--batch", "8",
                       "--seq", "4096")
    assert code == 0
    assert "does not fit" in out
    assert "--checkpointing full" in out or "--mode qlora" in out


def test_config_json_and_zero3(capsys, tmp_path) -> None:
    cfg = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
           "vocab_size": 128256, "max_position_embeddings": 8192, "tie_word_embeddings": False}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    code, out, err = run(capsys, "plan", str(path), "--gpu", "h100-80gb", "--mode", "train",
                         "--precision", "bf16-mixed", "--checkpointing", "full", "--gpus", "8",
                         "--zero", "3", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["model"]["params"] == 8_030_261_248
    assert data["fits"] is True


def test_gpus_and_models_list(capsys) -> None:
    code, out, _ = run(capsys, "gpus")
    assert code == 0 and "h100" in out.lower() and "4090" in out
    code, out, _ = run(capsys, "models")
    assert code == 0 and "llama-3-8b" in out and "mixtral" in out


@pytest.mark.parametrize(("argv", "needle"), [
    (["plan", "llama-9-8b"], "llama"),  # unknown model: suggests close names
    (["plan", "llama-3-8b", "--gpu", "h1000"], "h100"),  # unknown GPU: suggests close names
    (["plan", "llama-3-8b", "--batch", "0"], "--batch"),
    (["plan", "llama-3-8b", "--batch", "four"], "--batch"),
    (["plan", "llama-3-8b", "--seq", "-5"], "--seq"),
    (["plan", "--params", "-7"], "--params"),
    (["plan", "--params", "lots"], "--params"),
    (["plan", "llama-3-8b", "--zero", "4", "--gpus", "8"], "--zero"),
    (["plan", "llama-3-8b", "--precision", "fp13"], "precision"),
    (["plan", "llama-3-8b", "--gpu", "v100-32gb", "--precision", "bf16-mixed"], "fp16-mixed"),
    (["plan", "llama-3-8b", "--tp", "3", "--gpus", "3"], "heads"),
    (["plan", "llama-3-8b", "--gpus", "6", "--tp", "4"], "divisible"),
    (["plan", "./missing/config.json"], "config"),
    (["plan"], "model"),
    (["plan", "llama-3-8b", "--params", "7e9"], "not both"),
    (["plan", "llama-3-8b", "--fsdp", "--zero", "2", "--gpus", "8"], "--fsdp"),
    (["plan", "llama-3-8b", "--mode", "inference", "--zero", "1", "--gpus", "2"], "inference"),
    (["plan", "--params", "7e9", "--mode", "lora"], "architecture"),
    (["plan", "llama-3-8b", "--method", "magic"], "method"),
    (["plan", "llama-3-8b", "--gpu", "t4", "--precision", "fp8"], "fp8"),
    # a name that fits boards of 40 and 80 GB: refused with the candidates, never guessed
    (["plan", "llama-3-8b", "--gpu", "a100"], "a100-sxm-40gb (40 GB HBM2), a100-sxm-80gb"),
    (["plan", "llama-3-8b", "--gpu", "h100"], "h100-sxm-80gb (80 GB HBM3), h100-pcie-80gb"),
])
def test_bad_input_is_one_line_exit_2(capsys, argv: list[str], needle: str) -> None:
    code, _, err = run_or_exit(capsys, argv)
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert needle.lower() in lines[0].lower()
    assert "Traceback" not in err


@pytest.mark.parametrize("argv", [
    ["plan", "--params", "-5b"],  # a minus and a digit is a value, not an option (3.11-3.12)
    ["plan", "--params=-5b"],
    ["plan", "--params", "-7.5e9"],
    ["plan", "--params", "0"],
    ["spot-plan", "--params", "-5b", "--work-hours", "5", "--write-bandwidth", "10GB/s"],
    ["plan", "llama-3-8b", "--seq", "-5k"],
])
def test_negative_count_is_refused_by_its_own_check(capsys, argv: list[str]) -> None:
    code, _, err = run_or_exit(capsys, argv)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "positive" in err and "expected one argument" not in err


@pytest.mark.parametrize(("text", "ok"), [
    ("1e15", True), ("1000T", True),  # the bound itself: 10**15 parameters
    ("1.0000001e15", False), ("1001T", False), ("1e30", False)])
def test_params_above_1e15_is_refused(capsys, text: str, ok: bool) -> None:
    code, out, err = run_or_exit(capsys, ["plan", "--params", text, "--json"])
    if ok:
        assert code == 0, err
        assert json.loads(out)["model"]["params"] == 10**15
    else:
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert "above 1e15" in err and "check the exponent" in err


def test_malformed_config_file(capsys, tmp_path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    code, _, err = run_or_exit(capsys, ["plan", str(bad)])
    assert code == 2 and len(err.strip().splitlines()) == 1
    unsupported = tmp_path / "u.json"
    unsupported.write_text(json.dumps({"model_type": "no-such-model-type"}))
    code, _, err = run_or_exit(capsys, ["plan", str(unsupported)])
    assert code == 2 and "llama" in err


def test_malformed_gpu_file(capsys, tmp_path) -> None:
    bad = tmp_path / "gpus.json"
    bad.write_text("[1, 2")
    code, _, err = run_or_exit(capsys, ["plan", "gpt2", "--gpu", "h100-80gb", "--gpu-file",
                                        str(bad)])
    assert code == 2 and len(err.strip().splitlines()) == 1


def run_or_exit(capsys, argv: list[str]) -> tuple[int, str, str]:
    """argparse errors raise SystemExit; everything else returns a code."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_method_trace_json_and_optimizer_offload(capsys) -> None:
    # GPT-2 (124,439,808 parameters, published) traced on meta tensors for an A100, fp32 AdamW.
    P = 124_439_808
    common = ("plan", "gpt2", "--method", "trace", "--gpu", "a100-40gb", "--precision", "fp32",
              "--batch", "1", "--seq", "64", "--json")
    code, out, err = run(capsys, *common)
    assert code == 0, err
    plain = json.loads(out)
    breakdown = plain["per_gpu"]["breakdown"]
    assert plain["method"] == "trace" and plain["model"]["params"] == P
    assert plain["per_gpu"]["total_bytes"] == (sum(breakdown.values())
                                               + plain["per_gpu"]["allocator_reserve_bytes"])
    # the host holds AdamW's step counters, one fp32 scalar for each of GPT-2's 148 parameter
    # tensors (12 blocks x 12, wte, wpe, ln_f's 2; the head is tied), and foreach's 1.0
    # increment (torch/optim/adam.py: _init_group, _multi_tensor_adam)
    assert plain["host_peak_bytes"] == 4 * 148 + 4
    code, out, err = run(capsys, *common, "--offload-optimizer")
    assert code == 0, err
    off = json.loads(out)
    # AdamW's two fp32 states (8 B/param) leave the device...
    assert off["per_gpu"]["breakdown"]["optimizer_states"] == 0
    assert breakdown["optimizer_states"] >= 8 * P
    assert plain["per_gpu"]["total_bytes"] - off["per_gpu"]["total_bytes"] >= 8 * P
    # ...for the host, with a host copy of the parameters and of the gradients: 16 B/param
    assert off["host_peak_bytes"] >= 16 * P


def test_plan_method_trace_refuses_what_it_does_not_model(capsys) -> None:
    code, _, err = run(capsys, "plan", "gpt2", "--method", "trace", "--gpus", "4", "--tp", "2",
                       "--zero", "1")
    assert code == 2
    assert "--method trace over 4 GPUs: the trace refused it" in err and "\n" not in err.strip()
    code, _, err = run(capsys, "plan", "gpt2", "--method", "trace", "--mode", "lora")
    assert code == 2
    assert "no q_proj, k_proj, v_proj, o_proj layers" in err and "\n" not in err.strip()


# A small Llama: 4 layers, hidden 256, 8 heads (2 KV heads of 32), MLP 512, vocab 1000; LoRA
# rank 8 on q, k, v, o.
SMALL_H, SMALL_KV, SMALL_FFN, SMALL_VOCAB, SMALL_LAYERS, SMALL_R = 256, 64, 512, 1000, 4, 8


def trace_small_llama(capsys, tmp_path, mode: str) -> dict[str, int]:
    cfg = {"model_type": "llama", "hidden_size": SMALL_H, "num_hidden_layers": SMALL_LAYERS,
           "num_attention_heads": 8, "num_key_value_heads": 2,
           "intermediate_size": SMALL_FFN, "vocab_size": SMALL_VOCAB,
           "max_position_embeddings": 512, "tie_word_embeddings": False}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    code, out, err = run(capsys, "plan", str(path), "--method", "trace", "--mode", mode,
                         "--lora-rank", str(SMALL_R), "--gpu", "a100-40gb", "--batch", "2",
                         "--seq", "128", "--json")
    assert code == 0, err
    return json.loads(out)["per_gpu"]["breakdown"]  # type: ignore[no-any-return]


def test_plan_method_trace_lora(capsys, tmp_path) -> None:
    h, kv, ffn, vocab, layers, r = (SMALL_H, SMALL_KV, SMALL_FFN, SMALL_VOCAB, SMALL_LAYERS,
                                    SMALL_R)
    b = trace_small_llama(capsys, tmp_path, "lora")
    # Base in bf16: embeddings, head, per layer q/o (h x h), k/v (h x kv), 3 MLP matrices and
    # 2 norms, plus the final norm. Adapters in fp32: r x (in + out) for q, k, v, o per layer.
    base = 2 * vocab * h + layers * (2 * h * h + 2 * h * kv + 3 * h * ffn + 2 * h) + h
    adapters = layers * r * ((h + h) + (h + kv) + (h + kv) + (h + h))
    tensors = 2 + layers * (7 + 2) + 1 + layers * 8  # each rounded up to 512 bytes at most
    assert 2 * base + 4 * adapters <= b["weights"] <= 2 * base + 4 * adapters + 512 * tensors
    # AdamW keeps two fp32 states for the adapters only; no gradient for the frozen base.
    assert 8 * adapters <= b["optimizer_states"] <= 8 * adapters + 2 * 512 * layers * 8
    assert b["gradients"] <= 4 * adapters + 512 * layers * 8


def test_plan_method_trace_qlora(capsys, tmp_path) -> None:
    # The small Llama above. Every linear layer but the head is stored in NF4 (torchao:
    # 4-bit codes n/2 bytes, one int8 scale per 64 weights, one bf16 factor per 256 scales, a
    # bf16 mean and the 16-entry bf16 codebook); embeddings, norms and the head stay bf16;
    # adapters (rank 8 on q, k, v, o) are fp32.
    h, kv, ffn, vocab, layers, r = (SMALL_H, SMALL_KV, SMALL_FFN, SMALL_VOCAB, SMALL_LAYERS,
                                    SMALL_R)
    b = trace_small_llama(capsys, tmp_path, "qlora")

    def nf4(n: int) -> int:
        return n // 2 + n // 64 + 2 * (n // 64 // 256) + 2 + 2 * 16

    linears = [h * h, h * kv, h * kv, h * h, h * ffn, h * ffn, h * ffn]
    bf16 = 2 * (2 * vocab * h + layers * 2 * h + h)
    adapters = layers * r * ((h + h) + (h + kv) + (h + kv) + (h + h))
    exact = bf16 + layers * sum(nf4(n) for n in linears) + 4 * adapters
    tensors = 3 + layers * (2 + 7 * 5 + 8)  # each rounded up to 512 bytes at most
    assert exact <= b["weights"] <= exact + 512 * tensors
    assert 8 * adapters <= b["optimizer_states"] <= 8 * adapters + 2 * 512 * layers * 8


def test_fit_verdict_keeps_the_margin() -> None:
    """One verdict for both methods: fits only with ``margin`` of the GPU free; inside the margin
    it says so and shows the headroom; past the capacity it shows how far over."""
    from rich.console import Console

    from memfit.cli._common import print_fit_verdict

    def verdict(total: int) -> str:
        out = Console(record=True, width=200)
        print_fit_verdict(out, 100 * 2**20, total, 0.15, "trace")
        return out.export_text().strip()

    assert verdict(85 * 2**20) == "fits with 15.00 MiB headroom"
    assert verdict(86 * 2**20).startswith("does not fit with the 15% margin memfit keeps for the "
                                          "trace")
    assert verdict(86 * 2**20).endswith("14.00 MiB headroom")
    assert verdict(110 * 2**20) == "does not fit: 10.00 MiB over"


def test_gpus_marks_usable_figures_that_are_not_pytorchs(capsys) -> None:
    """The table's 'usable' column is titled "what PyTorch can allocate"; for a GPU whose
    total_memory the catalog lacks it shows the driver's total or the label's GB (h100-pcie-80gb:
    80e9 bytes = 74.51 GiB, the marketing fallback), so that cell is marked and explained.
    The T4's 15,843,721,216 bytes are a published total_memory: unmarked."""
    code, out, _ = run(capsys, "gpus")
    assert code == 0
    cells = {line.split("│")[1].strip(): line.split("│")[3].strip()
             for line in out.splitlines() if line.startswith("│") and line.split("│")[1].strip()}
    assert cells["t4"] == format_bytes(15_843_721_216)
    assert cells["h100-pcie-80gb"] == format_bytes(80_000_000_000) + "*"
    assert "* not measured: PyTorch's total_memory for this GPU is not in the catalog" in " ".join(
        out.split())
