"""``memfit serve-plan`` in-process: its output, its JSON, and one-line errors with exit 2."""

from __future__ import annotations

import json

import pytest

from memfit.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_text_output_has_the_lines_vllm_logs(capsys) -> None:
    code, out, err = run(capsys, "serve-plan", "llama-3-8b", "--kv-cache-memory", "1GiB")
    assert code == 0, err
    # 1 GiB / (32 layers x 64 KiB pages) = 512 blocks of 16 tokens
    assert "num_gpu_blocks: 512" in out
    assert ("GPU KV cache size: 8,192 tokens, Maximum concurrency for 8,192 tokens per "
            "request: 1.00x") in out
    # 511 blocks beside the null block: vLLM refuses 8192 tokens
    assert "does NOT fit" in out and "largest --max-model-len that fits: 8,176" in out


def test_json_from_a_config_file(capsys, tmp_path) -> None:
    config = {"model_type": "qwen3", "hidden_size": 1024, "num_attention_heads": 16,
              "num_key_value_heads": 8, "num_hidden_layers": 28, "head_dim": 128,
              "torch_dtype": "bfloat16", "max_position_embeddings": 40960}
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, out, err = run(capsys, "serve-plan", str(tmp_path), "--kv-cache-memory",
                         str(2**30), "--json", "--max-model-len", "4096")
    assert code == 0, err
    data = json.loads(out)
    # 16 x 8 x 256 x 2 = 65536 B pages, 28 layers
    assert data["num_gpu_blocks"] == 2**30 // 65536 // 28 == 585
    assert data["max_concurrency"] == round(585 / 256, 2)
    assert data["kv_cache_tokens"] == 585 * 16  # int(585 / 256 x 4096)
    assert data["activation_peak_bytes"] is None


@pytest.mark.parametrize(("argv", "words"), [
    (["--tp", "3"], "does not divide num_attention_heads (32)"),
    (["--max-model-len", "9000"], "above llama-3-8b's context of 8192 tokens"),
    (["--kv-cache-memory", "-5"], "--kv-cache-memory must be a number of bytes >= 0"),
    (["--kv-cache-dtype", "int4"], "unknown --kv-cache-dtype 'int4'"),
    # a text-only model: vLLM refuses --limit-mm-per-prompt, nothing here could use them
    (["--max-images", "2"], "--max-images: llama-3-8b has no vision encoder"),
    (["--max-videos", "0", "--max-pixels", "100"], "--max-videos, --max-pixels: llama-3-8b"),
    # vLLM's SchedulerConfig: max_num_batched_tokens >= max_num_seqs (default 1024 here)
    (["--max-num-batched-tokens", "512"], "--max-num-batched-tokens 512 is below --max-num-seqs "
                                          "1024"),
    (["--max-num-batched-tokens", "512", "--max-num-seqs", "513"], "below --max-num-seqs 513"),
    # `vllm serve --block-size` takes 1, 8, 16, ..., 256 only
    (["--block-size", "7"], "--block-size 7 is not one vLLM takes"),
    (["--block-size", "48"], "choose one of 1, 8, 16, 32, 64, 128, 256"),
    # an Apple GPU is not ROCm
    (["--gpu", "m2-max-32gb"], "m2-max-32gb is apple (Metal (MPS):"),
])
def test_bad_input_is_one_line_exit_2(capsys, argv: list[str], words: str) -> None:
    base = ["serve-plan", "llama-3-8b", "--kv-cache-memory", "1GiB"]
    code, _, err = run(capsys, *base, *argv)
    assert code == 2
    assert words in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_no_async_scheduling_keeps_one_batch_in_flight(capsys) -> None:
    argv = ["serve-plan", "mistral-7b", "--kv-cache-memory", "4GiB", "--json"]
    _, out, _ = run(capsys, *argv)
    _, out_sync, _ = run(capsys, *argv, "--no-async-scheduling")
    two, one = json.loads(out), json.loads(out_sync)
    assert (two["max_in_flight_tokens"], one["max_in_flight_tokens"]) == (16384, 8192)
    blocks = 4 * 2**30 // (32 * 65536)
    # a 4096-token window over 32768 tokens: cdiv(4095 + in flight, 16) + 1 blocks per layer
    assert two["max_concurrency"] == round(blocks / (1280 + 1), 2)
    assert one["max_concurrency"] == round(blocks / (768 + 1), 2)


@pytest.mark.parametrize(("argv", "code"), [
    # 511 usable blocks of 16 tokens beside the null block: 8,176 tokens, not 8,192
    (["llama-3-8b", "--kv-cache-memory", "1GiB"], 1),
    (["llama-3-8b", "--kv-cache-memory", "1GiB", "--json"], 1),
    (["llama-3-8b", "--kv-cache-memory", "1GiB", "--max-model-len", "4096"], 0),
    # 70B bf16 weights (~138 GB) on a 48 GB L40S: no KV pool, vLLM fails at startup
    (["llama-2-70b", "--gpu", "l40s", "--max-model-len", "4096", "--activation-peak", "1GiB"],
     1),
    # SGLang: 16 GB of 8B bf16 weights leave 80 GB of room on an H100; on a 24 GB L4 the
    # default --mem-fraction-static leaves none; 70B on an L40S fills the card before the pool
    (["llama-3.1-8b", "--engine", "sglang", "--gpu", "h100-sxm-80gb"], 0),
    (["llama-3.1-8b", "--engine", "sglang", "--gpu", "l4"], 1),
    (["llama-3-70b", "--engine", "sglang", "--gpu", "l40s"], 1),
])
def test_check_fit_exits_1_when_the_plan_does_not_fit(capsys, argv: list[str],
                                                      code: int) -> None:
    got, out, err = run(capsys, "serve-plan", *argv, "--check-fit")
    assert got == code, err
    if code and not out:  # found before a plan exists: one line saying so, not "error"
        assert err.startswith("memfit: does not fit: ") and err.count("\n") == 1, err
    # without --check-fit a plan answered exits 0 (SGLang's no-room-at-all stays bad input)
    plain, _, _ = run(capsys, "serve-plan", *argv)
    assert plain == (2 if code and not out else 0)


def test_check_fit_bad_input_is_still_exit_2(capsys) -> None:
    code, _, err = run(capsys, "serve-plan", "llama-3-8b", "--kv-cache-memory", "1GiB",
                       "--tp", "3", "--check-fit")
    assert code == 2 and err.count("\n") == 1, err
