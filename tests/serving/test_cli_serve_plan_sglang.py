"""``memfit serve-plan --engine sglang``: SGLang's pool on a catalog GPU, from the weights the
plan loads and the memory before them; vLLM's own flags refused in one line."""

from __future__ import annotations

import json

import pytest

from memfit.cli import main
from memfit.gpus import get_gpu

GIB = 2**30


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_llama_on_an_h100_by_hand(capsys) -> None:
    code, out, err = run(capsys, "serve-plan", "llama-3.1-8b", "--engine", "sglang", "--gpu",
                         "h100-sxm-80gb", "--mem-fraction-static", "0.8",
                         "--max-model-len", "32768", "--json")
    assert code == 0, err
    data = json.loads(out)
    total = get_gpu("h100-sxm-80gb").usable_bytes
    # 8,030,261,248 parameters in bf16 (vocab 128,256 is a multiple of 64: no padding) plus
    # the rotary cos/sin cache, 131,072 positions x 128 x 2 bytes
    weights = 8_030_261_248 * 2 + 131_072 * 128 * 2
    assert data["weights_bytes"] == weights
    pre = total - data["non_torch_bytes"]
    assert data["pre_load_bytes"] == pre
    # rest = (free after the weights) - pre-load free x (1 - 0.8), in GiB floats as SGLang
    # computes it; 32 layers x 8 KV heads x (128 + 128) x 2 bytes = 131,072 B a token
    rest = (pre - weights) / GIB - pre / GIB * (1 - 0.8)
    assert data["kv_cache_tokens"] == int(rest * GIB) // 131_072
    assert data["max_concurrency"] == data["kv_cache_tokens"] / 32768
    assert data["max_model_len_that_fits"] == 32768
    assert data["activation_peak_bytes"] is None and data["engine"] == "sglang"


def test_text_output_prints_sglangs_log_line(capsys) -> None:
    code, out, err = run(capsys, "serve-plan", "llama-3.1-8b", "--engine", "sglang", "--gpu",
                         "h100-sxm-80gb", "--mem-fraction-static", "0.8")
    assert code == 0, err
    tokens = json.loads(_json(capsys))["kv_cache_tokens"]
    assert f"KV Cache is allocated. dtype: torch.bfloat16, #tokens: {tokens}, " in out


def _json(capsys: pytest.CaptureFixture[str]) -> str:
    code, out, _ = run(capsys, "serve-plan", "llama-3.1-8b", "--engine", "sglang", "--gpu",
                       "h100-sxm-80gb", "--mem-fraction-static", "0.8", "--json")
    assert code == 0
    return out


@pytest.mark.parametrize("extra", [
    ("--gpu", "h100-sxm-80gb", "--kv-cache-memory", "1GiB"),
    ("--gpu", "h100-sxm-80gb", "--block-size", "32"),
    ("--gpu", "h100-sxm-80gb", "--gpu-memory-utilization", "0.8"),
    # vLLM's default written out is still vLLM's flag (it was compared as text with "0.9")
    ("--gpu", "h100-sxm-80gb", "--gpu-memory-utilization", "0.9"),
    ("--gpu", "h100-sxm-80gb", "--mem-fraction-static", "x"),
    ("--gpu", "h100-sxm-80gb", "--mem-fraction-static", "1.5"),
    # sized in the vLLM plan only: refused rather than ignored
    ("--gpu", "h100-sxm-80gb", "--activation-peak", "5GiB"),
    ("--gpu", "h100-sxm-80gb", "--max-images", "0"),
    ("--gpu", "h100-sxm-80gb", "--max-pixels", "1000000"),
    ("--gpu", "h100-sxm-80gb", "--draft-layers", "2"),
    (),
])
def test_vllms_flags_and_bad_input_are_one_line(capsys, extra) -> None:
    code, out, err = run(capsys, "serve-plan", "llama-3.1-8b", "--engine", "sglang", *extra)
    assert code == 2 and out == "" and err.count("\n") == 1, err


def test_mem_fraction_static_is_sglangs_only(capsys) -> None:
    code, _, err = run(capsys, "serve-plan", "llama-3.1-8b", "--kv-cache-memory", "1GiB",
                       "--mem-fraction-static", "0.8")
    assert code == 2 and "--engine sglang" in err
