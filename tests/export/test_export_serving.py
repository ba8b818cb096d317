"""``memfit export SERVEPLAN.json --to vllm|sglang``: the engine's launch command or Python
keywords, compared with literal expected text (flag names from vLLM 0.33's
``EngineArgs.add_cli_args`` and SGLang 0.5.23's ``ServerArgs`` fields)."""

from __future__ import annotations

import json

import pytest

from memfit.cli import main
from memfit.errors import MemfitError
from memfit.export import export_plan
from memfit.serving import serve_plan

QWEN3_8B = {"_name_or_path": "Qwen/Qwen3-8B", "model_type": "qwen3", "hidden_size": 4096,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "max_position_embeddings": 40960, "torch_dtype": "bfloat16"}


def plan_json(**kwargs) -> dict:
    return serve_plan(QWEN3_8B, **kwargs).to_json()


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_vllm_command_from_a_kv_budget_plan() -> None:
    data = plan_json(kv_cache_memory=20 * 2**30, tp=2, kv_cache_dtype="fp8",
                     max_model_len=16384)
    out = export_plan(data, "vllm")
    assert out.text == (
        "vllm serve Qwen/Qwen3-8B \\\n"
        "    --tensor-parallel-size 2 \\\n"
        "    --max-model-len 16384 \\\n"
        "    --kv-cache-memory-bytes 21474836480 \\\n"
        "    --kv-cache-dtype fp8 \\\n"
        "    --block-size 16 \\\n"
        "    --max-num-batched-tokens 8192\n")
    assert any("--max-num-seqs" in note for note in out.notes)


def test_vllm_python_keywords() -> None:
    data = plan_json(kv_cache_memory=2**30, max_model_len=4096, async_scheduling=False)
    out = export_plan(data, "vllm", form="python")
    assert out.text == (
        "from vllm import LLM\n\n"
        "llm = LLM(\n"
        "    model='Qwen/Qwen3-8B',\n"
        "    tensor_parallel_size=1,\n"
        "    max_model_len=4096,\n"
        "    kv_cache_memory_bytes=1073741824,\n"
        "    block_size=16,\n"
        "    max_num_batched_tokens=8192,\n"
        "    async_scheduling=False,\n"
        ")\n")


def test_a_utilization_plan_exports_the_utilization_not_the_bytes() -> None:
    # the keys a plan sized from --gpu-memory-utilization carries (max_num_seqs, eager too)
    data = {**plan_json(kv_cache_memory=2**30, max_model_len=4096),
            "gpu_memory_utilization": 0.85, "max_num_seqs": 64, "enforce_eager": True}
    out = export_plan(data, "vllm")
    assert out.text == (
        "vllm serve Qwen/Qwen3-8B \\\n"
        "    --tensor-parallel-size 1 \\\n"
        "    --max-model-len 4096 \\\n"
        "    --gpu-memory-utilization 0.85 \\\n"
        "    --block-size 16 \\\n"
        "    --max-num-batched-tokens 8192 \\\n"
        "    --max-num-seqs 64 \\\n"
        "    --enforce-eager\n")
    sglang = export_plan(data, "sglang")
    assert sglang.text == (
        "python -m sglang.launch_server \\\n"
        "    --model-path Qwen/Qwen3-8B \\\n"
        "    --tp-size 1 \\\n"
        "    --context-length 4096 \\\n"
        "    --max-running-requests 64 \\\n"
        "    --chunked-prefill-size 8192 \\\n"
        "    --cuda-graph-backend-decode disabled \\\n"
        "    --cuda-graph-backend-prefill disabled\n")
    # vLLM's utilization is not SGLang's --mem-fraction-static: reported, not translated
    assert [g.setting for g in sglang.gaps] == ["gpu_memory_utilization"]


def test_sglang_command_and_fp8_name() -> None:
    data = plan_json(kv_cache_memory=20 * 2**30, tp=2, kv_cache_dtype="fp8",
                     max_model_len=16384)
    out = export_plan(data, "sglang")
    assert out.text == (
        "python -m sglang.launch_server \\\n"
        "    --model-path Qwen/Qwen3-8B \\\n"
        "    --tp-size 2 \\\n"
        "    --context-length 16384 \\\n"
        "    --kv-cache-dtype fp8_e4m3 \\\n"
        "    --chunked-prefill-size 8192\n")
    assert [g.setting for g in out.gaps] == ["kv_cache_bytes"]
    python = export_plan({**data, "mem_fraction_static": 0.8, "kv_cache_dtype": "fp8_e5m2"},
                         "sglang", form="python")
    assert python.text == (
        "import sglang\n\n"
        "engine = sglang.Engine(\n"
        "    model_path='Qwen/Qwen3-8B',\n"
        "    tp_size=2,\n"
        "    context_length=16384,\n"
        "    mem_fraction_static=0.8,\n"
        "    kv_cache_dtype='fp8_e5m2',\n"
        "    chunked_prefill_size=8192,\n"
        ")\n")
    assert python.gaps == ()


def test_a_hybrid_plan_leaves_the_block_to_vllm_and_keeps_its_prefix_caching() -> None:
    data = {**plan_json(kv_cache_memory=2**30, max_model_len=4096),
            "kv_cache_groups": [{"kind": "mamba"}, {"kind": "full"}], "block_size": 1056,
            "mamba_cache_mode": "none"}
    out = export_plan(data, "vllm")
    assert "--block-size" not in out.text
    assert "--no-enable-prefix-caching" in out.text
    # planned with prefix caching (vLLM's default, mamba_cache_mode align): no flag
    out = export_plan({**data, "mamba_cache_mode": "align"}, "vllm")
    assert "--block-size" not in out.text and "prefix-caching" not in out.text


def test_cli_round_trip_through_serve_plan_json(capsys, tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_8B))
    code, out, err = cli(capsys, "serve-plan", str(tmp_path), "--kv-cache-memory", "1GiB",
                         "--max-model-len", "4096", "--json")
    assert code == 0, err
    (tmp_path / "serve.json").write_text(out)
    code, out, err = cli(capsys, "export", str(tmp_path / "serve.json"), "--to", "vllm")
    assert code == 0, err
    assert out.startswith(f"vllm serve {tmp_path} \\\n    --tensor-parallel-size 1 \\\n")
    assert "--kv-cache-memory-bytes 1073741824" in out
    code, out, err = cli(capsys, "export", str(tmp_path / "serve.json"), "--to", "sglang",
                         "--format", "python")
    assert code == 0, err
    assert out.startswith("import sglang\n\nengine = sglang.Engine(\n")
    assert "not in the sglang export: kv_cache_bytes=1073741824" in err


def test_fit_plan_to_vllm_and_serve_plan_to_deepspeed_are_one_line_exit_2(
        capsys, tmp_path) -> None:
    (tmp_path / "serve.json").write_text(json.dumps(plan_json(kv_cache_memory=2**30,
                                                              max_model_len=4096)))
    code, _, err = cli(capsys, "export", str(tmp_path / "serve.json"), "--to", "deepspeed")
    assert code == 2 and "a serve plan (memfit serve-plan) exports --to vllm" in err
    assert err.count("\n") == 1
    train = {"format": "memfit-plan/1"}
    (tmp_path / "plan.json").write_text(json.dumps(train))
    code, _, err = cli(capsys, "export", str(tmp_path / "plan.json"), "--to", "sglang")
    assert code == 2 and "--to sglang exports a serve plan, and this is not one" in err
    assert err.count("\n") == 1
    code, _, err = cli(capsys, "export", str(tmp_path / "serve.json"), "--to", "deepspeed",
                       "--format", "python")
    assert code == 2 and "--format python is for --to vllm and --to sglang" in err


def test_a_malformed_serve_plan_is_refused() -> None:
    data = {**plan_json(kv_cache_memory=2**30, max_model_len=4096), "tp": 0}
    with pytest.raises(MemfitError, match="'tp' must be a positive integer"):
        export_plan(data, "vllm")
    data = {**plan_json(kv_cache_memory=2**30, max_model_len=4096),
            "gpu_memory_utilization": 1.5}
    with pytest.raises(MemfitError, match=r"must be in \(0, 1\]"):
        export_plan(data, "sglang")


def test_an_sglang_plan_exports_with_sglangs_settings(tmp_path, capsys) -> None:
    """``serve-plan --engine sglang --json`` names its settings SGLang's way (context_len,
    page_size, chunked_prefill_size, mem_fraction_static): both exports read them."""
    from memfit.cli import main

    assert main(["serve-plan", "llama-3.1-8b", "--engine", "sglang", "--gpu", "h100-sxm-80gb",
                 "--mem-fraction-static", "0.8", "--max-model-len", "32768", "--json"]) == 0
    plan = tmp_path / "sglang.json"
    plan.write_text(capsys.readouterr().out)
    assert main(["export", str(plan), "--to", "sglang"]) == 0
    out = capsys.readouterr().out
    assert out == ("python -m sglang.launch_server \\\n    --model-path llama-3.1-8b \\\n"
                   "    --tp-size 1 \\\n    --context-length 32768 \\\n"
                   "    --mem-fraction-static 0.8 \\\n    --page-size 1 \\\n"
                   "    --chunked-prefill-size 8192\n")
    assert main(["export", str(plan), "--to", "vllm"]) == 0
    out, err = capsys.readouterr()
    # SGLang's page is not vLLM's block: no --block-size; its rules are named in a note
    assert "--block-size" not in out and "--max-model-len 32768" in out
    assert "sized by sglang's rules" in err
