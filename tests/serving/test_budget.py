"""vLLM 0.33.0's startup budget: capture sizes, the subtraction, the answers, the CLI."""

from __future__ import annotations

import json
import math
import sys
import types

import pytest

from memfit.cli import main
from memfit.errors import MemfitError
from memfit.gpus import get_gpu
from memfit.serving import serve_plan
from memfit.serving.budget import (
    CUDA_GRAPH_PER_GRAPH_BYTES,
    NON_TORCH_INCREASE_BYTES,
    cudagraph_capture_sizes,
    cudagraph_counts,
    default_batch_limits,
    format_gib,
    requested_memory,
)

H100 = get_gpu("h100-sxm-80gb")
# 8,030,261,248 parameters in bf16, plus the RoPE cos/sin cache: 8192 positions x 128 x 2 B
LLAMA3_8B_BF16 = 8_030_261_248 * 2 + 8192 * 128 * 2


def test_capture_sizes_as_vllm_0_33_sets_them() -> None:
    # ceiling min(2 x 1024, 512) = 512: 1, 2, 4; 8..248 by 8 (31); 256..512 by 16 (17)
    sizes = cudagraph_capture_sizes(1024, 8192)
    assert sizes == [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]
    assert len(sizes) == 51
    # max_num_seqs 100: ceiling 200, and 100 itself (a uniform decode size) is added
    assert cudagraph_capture_sizes(100, 8192) == sorted([1, 2, 4, *range(8, 201, 8), 100])
    # max_num_batched_tokens 100 caps the ceiling and is captured itself
    assert cudagraph_capture_sizes(256, 100) == [1, 2, 4, *range(8, 97, 8), 100]
    # data-centre Blackwell: ceiling 1024
    assert cudagraph_capture_sizes(1024, 16384, blackwell=True)[-1] == 1024
    # FULL graphs only for decode batches up to max_num_seqs
    assert cudagraph_counts(sizes, 256) == {"PIECEWISE": 51, "FULL": 35}


def test_requested_memory_and_format_gib() -> None:
    assert requested_memory(85_017_493_504, 0.9) == math.ceil(85_017_493_504 * 0.9)
    assert format_gib(3 * 2**30 // 2) == "1.5"
    with pytest.raises(MemfitError, match=r"\(0, 1\]"):
        requested_memory(100, 1.01)
    with pytest.raises(MemfitError):
        requested_memory(100, 0)


def test_batch_defaults_by_gpu() -> None:
    assert default_batch_limits(get_gpu("h100-sxm-80gb").usable_bytes, "h100-sxm-80gb") == \
        (1024, 8192)
    assert default_batch_limits(get_gpu("a100-80gb").usable_bytes, "a100-80gb") == (256, 2048)
    assert default_batch_limits(get_gpu("l4").usable_bytes, "l4") == (256, 2048)
    assert default_batch_limits(get_gpu("b200").usable_bytes, "b200") == (1024, 16384)


def test_kv_budget_is_requested_less_each_term() -> None:
    act, graphs = 3 * 2**30, 2**30
    p = serve_plan("llama-3-8b", gpu="h100-sxm-80gb", activation_peak_bytes=act,
                   cuda_graph_bytes=graphs)
    b = p.budget
    assert b is not None
    assert b.weights_bytes == LLAMA3_8B_BF16
    expected = math.ceil(H100.usable_bytes * 0.9) - LLAMA3_8B_BF16 - act \
        - NON_TORCH_INCREASE_BYTES - graphs
    assert p.kv_cache_bytes == b.kv_cache_bytes == expected
    assert p.num_gpu_blocks == expected // (32 * 64 * 1024)
    assert b.log_line == f"Available KV cache memory: {round(expected / 2**30, 2)} GiB"
    # 1 GiB of graphs on 85,017,493,504 B: 0.0126 of the GPU
    assert b.log_lines[0] == "Estimated CUDA graph memory: 1.00 GiB total"
    assert "equivalent to --gpu-memory-utilization=0.8874" in b.log_lines[2]
    assert "increase --gpu-memory-utilization to 0.9126" in b.log_lines[2]
    js = p.to_json()
    for key in ("weights_bytes", "activation_peak_bytes", "non_torch_bytes",
                "cuda_graph_bytes", "kv_cache_bytes"):
        assert isinstance(js[key], int) and not isinstance(js[key], bool), key
    assert js["activation_source"] == "given"


def test_enforce_eager_has_no_graphs_and_graphs_count_per_mode() -> None:
    eager = serve_plan("llama-3-8b", gpu="h100-sxm-80gb", enforce_eager=True,
                       activation_peak_bytes=0)
    graphs = serve_plan("llama-3-8b", gpu="h100-sxm-80gb", activation_peak_bytes=0)
    assert eager.budget is not None and graphs.budget is not None
    assert eager.budget.cuda_graph_bytes == 0
    # 51 PIECEWISE + 51 FULL (max_num_seqs 1024) in one pool: the first capture at 512 tokens
    # x (4096 + 2 x 14336) x 2 bytes, then 101 more at the per-graph estimate
    first = 512 * (4096 + 2 * 14336) * 2
    assert graphs.budget.cuda_graph_bytes == first + 101 * CUDA_GRAPH_PER_GRAPH_BYTES
    assert eager.kv_cache_bytes - graphs.kv_cache_bytes == graphs.budget.cuda_graph_bytes


def test_the_profile_run_gives_the_activation_peak(monkeypatch) -> None:
    calls = []

    def fake(config: object, *, max_num_batched_tokens: int, max_num_seqs: int, tp: int,
             dtype_bytes: int, engine_version: str) -> int:
        calls.append((max_num_batched_tokens, max_num_seqs, tp, dtype_bytes, engine_version))
        return 123_456_789

    module = types.ModuleType("memfit.serving.profile_run")
    module.profile_activation_peak = fake  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "memfit.serving.profile_run", module)
    p = serve_plan("llama-3-8b", gpu="a100-80gb")
    assert p.budget is not None and p.budget.activation_peak_bytes == 123_456_789
    assert p.budget.activation_source == "profile_run"
    assert calls == [(2048, 256, 1, 2, "0.33.0")]  # A100: vllm serve's 2048 tokens, 256 seqs



def test_utilization_for_a_wanted_concurrency_round_trips() -> None:
    kw = {"gpu": "h100-sxm-80gb", "max_model_len": 8192, "activation_peak_bytes": 2**30,
          "cuda_graph_bytes": 2**30}
    p = serve_plan("llama-3-8b", concurrency=20, **kw)
    util = p.utilization_for_concurrency
    assert util is not None and 0 < util < 0.9
    # 20 requests of 8192 tokens x 128 KiB = 20 GiB of KV
    assert p.kv_bytes_for_concurrency == 20 * 8192 * 128 * 1024
    assert serve_plan("llama-3-8b", gpu_memory_utilization=util, **kw).max_concurrency >= 20
    below = round(util - 0.0001, 4)
    assert serve_plan("llama-3-8b", gpu_memory_utilization=below, **kw).max_concurrency < 20


def test_startup_oom_warned_when_weights_exceed_the_budget(capsys) -> None:
    p = serve_plan("llama-2-70b", gpu="l40s", max_model_len=4096)
    assert p.startup_oom is not None and "No available memory" in p.startup_oom
    assert p.num_gpu_blocks == 0 and not p.fits
    assert main(["serve-plan", "llama-2-70b", "--gpu", "l40s", "--max-model-len", "4096"]) == 0
    assert "WARNING: startup would fail" in capsys.readouterr().out


def test_baseline_must_leave_util_free() -> None:
    # at 0.999 the CUDA context alone leaves less than requested free: request_memory refuses
    p = serve_plan("llama-3-8b", gpu="h100-sxm-80gb", gpu_memory_utilization=0.999)
    assert p.startup_oom is not None and "request_memory" in p.startup_oom


def test_cli_prints_the_budget_and_vllms_lines(capsys) -> None:
    code = main(["serve-plan", "llama-3-8b", "--gpu", "h100-sxm-80gb", "--max-model-len",
                 "8192", "--concurrency", "10"])
    out, err = capsys.readouterr()
    assert code == 0, err
    for label in ("weights", "activation peak", "non-torch", "CUDA graphs", "KV cache",
                  "Available KV cache memory:", "GPU KV cache size:",
                  "set --gpu-memory-utilization"):
        assert label in out, label
    assert "14.96 GiB" in out  # 16,062,619,648 B of bf16 weights and RoPE cache


def test_cli_json_fills_the_budget_keys(capsys) -> None:
    code = main(["serve-plan", "llama-3-8b", "--gpu", "h100-sxm-80gb", "--tp", "2", "--json",
                 "--enforce-eager"])
    out, err = capsys.readouterr()
    assert code == 0, err
    data = json.loads(out)
    assert data["cuda_graph_bytes"] == 0
    assert data["baseline_parts"]["nccl"] > 0  # TP 2 initialises NCCL before the baseline
    # test_weights: 8,030,527,488 per rank at tp 2, plus the replicated 2 MiB RoPE cache
    assert data["weights_bytes"] == 8_030_527_488 + 8192 * 128 * 2


@pytest.mark.parametrize(("argv", "needle"), [
    (["--gpu", "h100-sxm-80gb", "--gpu-memory-utilization", "1.5"], "(0, 1]"),
    (["--gpu", "h100-sxm-80gb", "--gpu-memory-utilization", "0"], "(0, 1]"),
    (["--gpu", "v100-16gb", "--quant", "fp8"], "compute capability 7.5"),
    (["--gpu", "h100-sxm-80gb", "--quant", "bnb-4bit"], "bitsandbytes"),
    (["--gpu", "no-such-gpu"], "unknown GPU"),
    ([], "pass --gpu"),
])
def test_cli_bad_input_one_line_exit_2(capsys, argv: list[str], needle: str) -> None:
    code = main(["serve-plan", "llama-3-8b", *argv])
    _, err = capsys.readouterr()
    assert code == 2
    assert needle in err and len(err.strip().splitlines()) == 1


def test_checkpoint_quantization_config_chooses_the_layout(tmp_path) -> None:
    config = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
              "vocab_size": 128256, "max_position_embeddings": 8192, "torch_dtype": "float16",
              "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 64}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    p = serve_plan(tmp_path, gpu="l4", activation_peak_bytes=0, cuda_graph_bytes=0)
    assert p.budget is not None
    # groups of 64 from the checkpoint's config: o_proj has 64 groups of zeros and scales
    o = 4096 * 512 * 4 + 64 * 512 * 4 + 64 * 4096 * 2
    qkv = 4096 * 768 * 4 + 64 * 768 * 4 + 64 * 6144 * 2
    assert p.budget.weights_parts["attention"] == 32 * (qkv + o)
    # the same checkpoint on a V100 (7.0): AWQ needs 7.5
    with pytest.raises(MemfitError, match="compute capability"):
        serve_plan(tmp_path, gpu="v100-16gb")


def test_folder_weights_come_from_the_headers(tmp_path) -> None:
    import struct

    config = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
              "vocab_size": 100, "max_position_embeddings": 256, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    shapes = {"model.embed_tokens.weight": [100, 64], "lm_head.weight": [100, 64],
              "model.layers.0.self_attn.q_proj.weight": [64, 64]}
    header, offset = {}, 0
    for name, shape in shapes.items():
        n = shape[0] * shape[1] * 2
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    (tmp_path / "model.safetensors").write_bytes(
        struct.pack("<Q", len(raw)) + raw + b"\0" * offset)
    p = serve_plan(tmp_path, gpu="l4", tp=2, activation_peak_bytes=0, max_model_len=256)
    assert p.budget is not None
    # vocab 100 pads to 128: 64 rows per rank; q_proj halves; RoPE cache 256 x 16 x 2
    assert p.budget.weights_parts["embedding"] == p.budget.weights_parts["lm_head"] == 64 * 64 * 2
    assert p.budget.weights_parts["attention"] == 64 * 64 * 2 // 2
    assert p.budget.weights_bytes == 2 * 64 * 64 * 2 + 64 * 64 + 256 * 16 * 2


def test_an_amd_gpu_is_one_line(capsys) -> None:
    """vLLM on ROCm picks other attention backends (block 64 for AITER's unified attention):
    not modelled, refused in one line rather than a traceback on the gfx architecture name."""
    from memfit.cli import main

    assert main(["serve-plan", "llama-3-8b", "--gpu", "mi300x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ROCm" in err and "--kv-cache-memory" in err
