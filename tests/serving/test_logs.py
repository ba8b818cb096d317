"""Engine startup logs read into an EngineLog, and ``serve-plan --check`` against them.

The excerpts are quoted from public issues (each cites its thread); the expected values are
read off the quoted text by hand, or computed from the model's shapes where a figure follows from
others (K size = tokens x layers x KV heads x head_dim x 2 bytes). Lines of the current releases
(vLLM 0.33, SGLang 0.5.23) are written as their source formats them (cited).
"""

from __future__ import annotations

import json

import pytest

from memfit.cli import main
from memfit.errors import MemfitError
from memfit.serving import check_plan, log_inputs, parse_engine_log, serve_plan

GIB = 2**30

# https://github.com/LMCache/LMCache/issues/1739 (Qwen3-14B, one GPU, vLLM v1, Oct 2025)
V1_QWEN3_14B = """\
(EngineCore_DP0 pid=1133552) INFO 10-03 16:22:17 [gpu_worker.py:298] Available KV cache memory: 6.51 GiB
(EngineCore_DP0 pid=1133552) INFO 10-03 16:22:17 [kv_cache_utils.py:864] GPU KV cache size: 42,656 tokens
(EngineCore_DP0 pid=1133552) INFO 10-03 16:22:17 [kv_cache_utils.py:868] Maximum concurrency for 32,768 tokens per request: 1.30x
"""  # noqa: E501

# https://github.com/vllm-project/vllm/issues/10517 (Llama-3.1-8B-Instruct, RTX 3090, vLLM v0.6)
V0_LLAMA_3090 = """\
Loading model weights took 14.9888 GB
Memory profiling results: total_gpu_memory=23.58GiB initial_memory_usage=15.34GiB peak_torch_memory=17.06GiB memory_usage_post_profile=15.35GiB non_torch_memory=0.35GiB kv_cache_size=3.81GiB gpu_memory_utilization=0.90
GPU blocks: 1952, # CPU blocks: 2048
Maximum concurrency for 20000 tokens per request: 1.56x
"""  # noqa: E501

# https://github.com/vllm-project/vllm/pull/14447 (4 x 24 GB, TP workers, vLLM v0.8 v0 engine)
V0_TP_WORKERS = """\
(VllmWorkerProcess pid=521) INFO 04-12 08:21:19 [worker.py:267] model weights take 21.21GiB; non_torch_memory takes 0.20GiB; PyTorch activation peak memory takes 0.37GiB; the rest of the memory reserved for KV Cache is 1.57GiB.
(VllmWorkerProcess pid=507) INFO 04-12 08:21:19 [worker.py:267] Memory profiling takes 17.59 seconds
(VllmWorkerProcess pid=507) INFO 04-12 08:21:19 [worker.py:267] the current vLLM instance can use total_gpu_memory (23.58GiB) x gpu_memory_utilization (0.99) = 23.35GiB
(VllmWorkerProcess pid=507) INFO 04-12 08:21:19 [worker.py:267] model weights take 21.21GiB; non_torch_memory takes 0.20GiB; PyTorch activation peak memory takes 0.37GiB; the rest of the memory reserved for KV Cache is 1.57GiB.
(VllmWorkerProcess pid=577) INFO 04-12 08:21:19 [worker.py:267] Memory profiling takes 17.56 seconds
"""  # noqa: E501

# https://github.com/vllm-project/vllm/pull/10511 (vllm serve meta-llama/Meta-Llama-3-8B
# on an H100, the multi-line profiling table of v0.6.5)
V0_TABLE = """\
INFO 12-13 19:54:18 worker.py:243] Memory profiling results:
INFO 12-13 19:54:18 worker.py:243] duration     0.75 seconds
INFO 12-13 19:54:18 worker.py:243] total_gpu_memory     79.22GiB
INFO 12-13 19:54:18 worker.py:243] gpu_memory_utilization       0.90
INFO 12-13 19:54:18 worker.py:243] the current vLLM instance can use    71.29GiB
INFO 12-13 19:54:18 worker.py:243] model weights take   14.96GiB
INFO 12-13 19:54:18 worker.py:243] non_torch_memory     1.79GiB
INFO 12-13 19:54:18 worker.py:243] PyTorch activation peak memory       1.26GiB
INFO 12-13 19:54:18 worker.py:243] available_kv_cache_memory    53.29GiB
"""

# https://github.com/vllm-project/vllm/pull/17122 (Llama-3.1-8B-Instruct, 1 x L40S, vLLM 0.8)
V1_SEPARATE_LINES = """\
INFO 04-24 16:32:59 [loader.py:458] Loading weights took 2.95 seconds
INFO 04-24 16:33:00 [gpu_model_runner.py:1316] Model loading took 14.9889 GiB and 3.652170 seconds
INFO 04-24 16:33:13 [kv_cache_utils.py:634] GPU KV cache size: 158,656 tokens
INFO 04-24 16:33:13 [kv_cache_utils.py:637] Maximum concurrency for 32,768 tokens per request: 4.84x
"""

# https://github.com/vllm-project/vllm/issues/30031 (Qwen2-0.5B, vLLM 0.12.0): the engine's
# config line, cut after the fields read
V1_CONFIG = (
    "(EngineCore_DP0 pid=7130) INFO 12-04 23:05:33 [core.py:93] Initializing a V1 LLM engine "
    "(v0.12.0) with config: model='/home/nbw/model/Qwen2-0.5B/', speculative_config=None, "
    "tokenizer='/home/nbw/model/Qwen2-0.5B/', skip_tokenizer_init=False, tokenizer_mode=auto, "
    "revision=None, tokenizer_revision=None, trust_remote_code=False, dtype=torch.bfloat16, "
    "max_seq_len=32768, download_dir=None, load_format=auto, tensor_parallel_size=1, "
    "pipeline_parallel_size=1, data_parallel_size=1, disable_custom_all_reduce=False, "
    "quantization=None, enforce_eager=False, kv_cache_dtype=auto, device_config=cuda,\n")

# vLLM 0.33, as it formats them: gpu_model_runner.py: GPUModelRunner.load_model, gpu_worker.py:
# Worker.compile_or_warm_up_model, gpu_model_runner.py (graph estimate and capture),
# entrypoints/common/startup.py: log_non_default_args; with colours and TP worker prefixes
V033 = (
    "\x1b[1;36m(APIServer pid=10)\x1b[0;0m INFO 11-20 10:00:00 [utils.py:300] non-default args: "
    "{'model_tag': 'Qwen/Qwen3-8B', 'model': 'Qwen/Qwen3-8B', 'max_model_len': 16384, "
    "'tensor_parallel_size': 2, 'gpu_memory_utilization': 0.85, 'kv_cache_dtype': 'fp8', "
    "'block_size': 32, 'max_num_seqs': 64}\n"
    "\x1b[1;36m(Worker_TP1 pid=31)\x1b[0;0m INFO [gpu_model_runner.py:5089] Model loading took "
    "8.21 GiB memory and 12.345678 seconds\n"
    "\x1b[1;36m(Worker_TP0 pid=30)\x1b[0;0m INFO [gpu_model_runner.py:5089] Model loading took "
    "8.2 GiB memory and 12.301234 seconds\n"
    "(Worker_TP0 pid=30) INFO [gpu_model_runner.py:6410] Estimated CUDA graph memory: 0.42 GiB "
    "total\n"
    "(Worker_TP0 pid=30) INFO [gpu_worker.py:773] Available KV cache memory: 50.25 GiB\n"
    "(Worker_TP1 pid=31) INFO [gpu_worker.py:773] Available KV cache memory: 50.12 GiB\n"
    "(Worker_TP0 pid=30) INFO [gpu_model_runner.py:6517] Graph capturing finished in 9 secs, "
    "took 0.45 GiB\n"
    "(Worker_TP0 pid=30) INFO [gpu_worker.py:1052] Free memory on device (78.6/79.18 GiB) on "
    "startup. Desired GPU memory utilization is (0.85, 67.3 GiB). Actual usage is 8.95 GiB for "
    "consumed memory (weights + non-torch), 1.61 GiB for peak activation, and 0.45 GiB for "
    "CUDAGraph memory. Replace gpu_memory_utilization config with `--kv-cache-memory=1` (0.0 "
    "GiB) to fit into requested memory.\n")

# https://github.com/vllm-project/vllm/issues/21348 (Qwen3-235B-A22B-FP8, SGLang, --tp 4)
SGLANG_QWEN3_235B = ("KV Cache is allocated. #tokens: 367404, K size: 8.23 GB, "
                     "V size: 8.23 GB\n")

# https://github.com/sgl-project/sglang/issues/2468 (Mistral-7B-Instruct-v0.1, Dec 2024)
SGLANG_MISTRAL = """\
[2024-12-13 01:44:59 TP0] Load weight end. type=MistralForCausalLM, dtype=torch.bfloat16, avail mem=9.69 GB
[2024-12-13 01:44:59 TP0] Memory pool end. avail mem=2.44 GB
[2024-12-13 01:44:59 TP0] Capture cuda graph begin. This can take up to several minutes.
[2024-12-13 01:45:01 TP0] Capture cuda graph end. Time elapsed: 2.19 s
[2024-12-13 01:45:02 TP0] max_total_num_tokens=56524, max_prefill_tokens=16384, max_running_requests=2049, context_len=32768
"""  # noqa: E501

# https://github.com/sgl-project/sglang/pull/12978 (two TP workers print their graph capture)
SGLANG_TP = """\
[2025-11-10 19:59:09 TP1] Capture cuda graph end. Time elapsed: 11.35 s. mem usage=1.04 GB. avail mem=11.22 GB.
[2025-11-10 19:59:09 TP0] Capture cuda graph end. Time elapsed: 11.39 s. mem usage=1.00 GB. avail mem=11.17 GB.
"""  # noqa: E501

# SGLang 0.5.23 as it formats them: model_executor/model_runner.py: ModelRunner.load_model,
# mem_cache/memory_pool.py: _finalize_allocation_log, managers/scheduler.py,
# entrypoints/engine.py (server_args as a dict)
SGLANG_0523 = (
    "[2026-11-20 10:00:00] server_args={'model_path': 'Qwen/Qwen3-8B', 'tp_size': 1, "
    "'mem_fraction_static': 0.83, 'context_length': None, 'kv_cache_dtype': 'fp8_e4m3', "
    "'page_size': 1, 'chunked_prefill_size': 8192, 'max_running_requests': None}\n"
    "[2026-11-20 10:00:05 TP0] Load weight end. elapsed=4.10 s, type=Qwen3ForCausalLM, "
    "avail mem=63.90 GB, mem usage=15.27 GB.\n"
    "[2026-11-20 10:00:05 TP0] KV Cache is allocated. dtype: torch.float8_e4m3fn, "
    "#tokens: 500000, KV size: 34.33 GB\n"
    "[2026-11-20 10:00:09 TP0] Capture decode CUDA graph end. elapsed=3.90 s, mem usage=0.61 GB, "
    "avail mem=7.71 GB.\n"
    "[2026-11-20 10:00:10 TP0] max_total_num_tokens=500000, chunked_prefill_size=8192, "
    "max_prefill_tokens=16384, max_running_requests=2048, context_len=40960, "
    "available_gpu_mem=7.70 GB\n")


def test_vllm_v1_lines_behind_an_engine_core_prefix() -> None:
    log = parse_engine_log(V1_QWEN3_14B)
    assert log.engine == "vllm"
    assert log.kv_cache_bytes == round(6.51 * GIB)
    assert log.kv_cache_tokens == 42656
    assert (log.concurrency_len, log.max_concurrency) == (32768, 1.30)
    assert log.weights_bytes is None and log.ranks == 1


def test_vllm_v0_profiling_results_and_gpu_blocks() -> None:
    log = parse_engine_log(V0_LLAMA_3090)
    assert log.weights_bytes == round(14.9888 * GIB)  # "GB" is GiB in vLLM (/ 2**30)
    assert log.non_torch_bytes == round(0.35 * GIB)
    assert log.kv_cache_bytes == round(3.81 * GIB)
    assert log.gpu_memory_utilization == 0.90
    assert log.num_gpu_blocks == 1952
    assert (log.concurrency_len, log.max_concurrency) == (20000, 1.56)
    # the figures agree with each other: 1952 blocks x 16 tokens / 20000 = 1.56
    assert round(log.num_gpu_blocks * 16 / log.concurrency_len, 2) == log.max_concurrency


def test_vllm_v0_workers_split_into_the_four_parts_of_the_budget() -> None:
    log = parse_engine_log(V0_TP_WORKERS)
    assert log.weights_bytes == round(21.21 * GIB)
    assert log.non_torch_bytes == round(0.20 * GIB)
    assert log.activation_peak_bytes == round(0.37 * GIB)
    assert log.kv_cache_bytes == round(1.57 * GIB)
    assert log.gpu_memory_utilization == 0.99
    assert log.ranks == 4  # three VllmWorkerProcess pids beside the driver
    # 21.21 + 0.20 + 0.37 + 1.57 = 23.35 GiB, the "can use" figure
    parts = (log.weights_bytes + log.non_torch_bytes + log.activation_peak_bytes
             + log.kv_cache_bytes)
    assert abs(parts - 23.35 * GIB) < 0.01 * GIB


def test_vllm_v0_profiling_table_with_padded_columns() -> None:
    log = parse_engine_log(V0_TABLE)
    assert log.weights_bytes == round(14.96 * GIB)
    assert log.non_torch_bytes == round(1.79 * GIB)
    assert log.activation_peak_bytes == round(1.26 * GIB)
    assert log.kv_cache_bytes == round(53.29 * GIB)
    assert log.gpu_memory_utilization == 0.90


def test_vllm_v1_separate_size_and_concurrency_lines() -> None:
    log = parse_engine_log(V1_SEPARATE_LINES)
    assert log.weights_bytes == round(14.9889 * GIB)
    assert log.kv_cache_tokens == 158656
    assert log.max_concurrency == 4.84 and log.concurrency_len == 32768
    assert round(158656 / 32768, 2) == 4.84


def test_vllm_engine_config_line() -> None:
    log = parse_engine_log(V1_CONFIG + V1_QWEN3_14B)
    assert log.engine_version == "0.12.0"
    assert log.model == "/home/nbw/model/Qwen2-0.5B/"
    assert (log.max_model_len, log.tp, log.enforce_eager, log.kv_cache_dtype) == \
        (32768, 1, False, "auto")


def test_vllm_033_lines_with_colours_and_tp_workers() -> None:
    log = parse_engine_log(V033)
    assert log.engine == "vllm"
    assert (log.model, log.max_model_len, log.tp) == ("Qwen/Qwen3-8B", 16384, 2)
    assert (log.gpu_memory_utilization, log.kv_cache_dtype, log.block_size) == \
        (0.85, "fp8", 32)
    assert log.max_num_seqs == 64
    assert log.weights_bytes == round(8.2 * GIB)  # rank 0's, though TP1 printed first
    assert log.kv_cache_bytes == round(50.12 * GIB)  # the smallest worker's pool
    assert log.cuda_graph_estimate_bytes == round(0.42 * GIB)
    assert log.cuda_graph_bytes == round(0.45 * GIB)
    assert log.activation_peak_bytes == round(1.61 * GIB)
    assert log.ranks == 2


def test_sglang_k_and_v_sizes_add_up_to_the_pool() -> None:
    log = parse_engine_log(SGLANG_QWEN3_235B)
    assert log.engine == "sglang"
    assert log.kv_cache_tokens == 367404
    assert log.kv_cache_bytes == round((8.23 + 8.23) * GIB)
    # Qwen3-235B-A22B: 94 layers, 4 KV heads (1 per rank at --tp 4), head_dim 128, 2 bytes
    k_bytes = 367404 * 94 * 1 * 128 * 2
    assert round(k_bytes / GIB, 2) == 8.23


def test_sglang_older_format_without_memory_figures() -> None:
    log = parse_engine_log(SGLANG_MISTRAL)
    assert log.engine == "sglang"
    assert log.kv_cache_tokens == 56524
    assert (log.max_model_len, log.max_num_seqs) == (32768, 2049)
    assert log.weights_bytes is None and log.cuda_graph_bytes is None


def test_sglang_rank_0_wins_and_workers_are_counted() -> None:
    log = parse_engine_log(SGLANG_TP + SGLANG_QWEN3_235B)
    assert log.cuda_graph_bytes == round(1.00 * GIB)
    assert log.ranks == 2


def test_sglang_0523_lines_and_server_args() -> None:
    log = parse_engine_log(SGLANG_0523)
    assert (log.model, log.tp, log.mem_fraction_static) == ("Qwen/Qwen3-8B", 1, 0.83)
    assert (log.kv_cache_dtype, log.block_size) == ("fp8_e4m3", 1)
    assert log.max_model_len == 40960  # context_length None in the args: the scheduler's
    assert log.max_num_seqs == 2048 and log.max_num_batched_tokens == 8192
    assert log.weights_bytes == round(15.27 * GIB)
    assert log.kv_cache_bytes == round(34.33 * GIB)
    assert log.kv_cache_tokens == 500000
    assert log.cuda_graph_bytes == round(0.61 * GIB)


def test_a_text_with_no_engine_lines_is_refused() -> None:
    with pytest.raises(MemfitError, match="no engine startup figures found"):
        parse_engine_log("hello\nINFO: Uvicorn running on http://0.0.0.0:8000\n")


# -- serve-plan --check --------------------------------------------------------------------

QWEN3_14B = {"model_type": "qwen3", "hidden_size": 5120, "num_hidden_layers": 40,
             "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
             "max_position_embeddings": 40960, "torch_dtype": "bfloat16"}


def test_log_inputs_fill_only_what_was_not_given() -> None:
    log = parse_engine_log(V1_CONFIG + V1_QWEN3_14B)
    inputs = log_inputs(log, tp=None, max_model_len=4096, kv_cache_dtype=None, block_size=None,
                        max_num_batched_tokens=None, kv_cache_memory=None)
    assert inputs == {"tp": 1, "max_model_len": 4096, "kv_cache_dtype": "auto",
                      "block_size": None, "max_num_batched_tokens": None,
                      "kv_cache_memory": round(6.51 * GIB)}


def test_check_rows_against_the_qwen3_14b_log() -> None:
    log = parse_engine_log(V1_QWEN3_14B)
    plan = serve_plan(QWEN3_14B, kv_cache_memory=log.kv_cache_bytes, max_model_len=32768)
    rows = {row.key: row for row in check_plan(plan, log, from_log=("kv_cache_bytes",))}
    # 40 layers x 2 x 8 heads x 128 x 2 B = 160 KiB a token, 2.5 MiB a 16-token block;
    # 6.51 GiB / 2.5 MiB = 2666.5 -> 2666 blocks = 42,656 tokens = 1.30 x 32,768
    assert rows["kv_cache_tokens"].predicted == 2666 * 16 == 42656
    assert rows["kv_cache_tokens"].error == 0
    assert rows["max_concurrency"].predicted == 1.30
    assert rows["kv_cache_bytes"].from_log
    assert "weights_bytes" not in rows  # the plan gives none yet


def test_check_error_is_the_plan_minus_the_log() -> None:
    # the same log with the budget given by hand: 6 GiB -> 6 GiB / 2.5 MiB = 2457 blocks
    log = parse_engine_log(V1_QWEN3_14B)
    plan = serve_plan(QWEN3_14B, kv_cache_memory=6 * GIB, max_model_len=32768)
    row = next(r for r in check_plan(plan, log) if r.key == "kv_cache_tokens")
    assert row.predicted == 2457 * 16 == 39312
    assert row.error == 39312 - 42656
    assert row.relative_error == pytest.approx((39312 - 42656) / 42656)


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_check_json(capsys, tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_14B))
    (tmp_path / "startup.log").write_text(V1_QWEN3_14B)
    code, out, err = cli(capsys, "serve-plan", str(tmp_path), "--check",
                         str(tmp_path / "startup.log"), "--json")
    assert code == 0, err
    data = json.loads(out)
    check = {row["what"]: row for row in data["check"]}
    assert set(check) == {"kv_cache_bytes", "kv_cache_tokens", "max_concurrency"}
    assert check["kv_cache_tokens"] == {"what": "kv_cache_tokens", "predicted": 42656,
                                        "logged": 42656, "error": 0, "relative_error": 0.0,
                                        "from_log": False}
    assert data["plan"]["max_model_len"] == 32768  # from "Maximum concurrency for 32,768"
    assert data["plan"]["kv_cache_bytes"] == round(6.51 * GIB)


def test_cli_check_skips_the_rows_of_another_request_length(capsys, tmp_path) -> None:
    # the log's 1.30x is for 32,768 tokens a request; at 8,192 the plan's is 4x that: the row
    # would have shown a +300% "error" that is only the two lengths
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_14B))
    (tmp_path / "startup.log").write_text(V1_QWEN3_14B)
    argv = ("serve-plan", str(tmp_path), "--check", str(tmp_path / "startup.log"),
            "--max-model-len", "8192")
    code, out, err = cli(capsys, *argv, "--json")
    assert code == 0, err
    assert [row["what"] for row in json.loads(out)["check"]] == ["kv_cache_bytes"]
    code, out, err = cli(capsys, *argv)
    assert code == 0, err
    assert "not compared: the plan's are for --max-model-len 8,192, the log's for 32,768" in out


def test_cli_check_text(capsys, tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_14B))
    (tmp_path / "startup.log").write_text(V1_QWEN3_14B)
    code, out, err = cli(capsys, "serve-plan", str(tmp_path), "--kv-cache-memory", "6GiB",
                         "--check", str(tmp_path / "startup.log"))
    assert code == 0, err
    assert "KV cache tokens  predicted 39,312, logged 42,656, error -3,344 (-7.84%)" in out


@pytest.mark.parametrize("text", ["nothing an engine prints\n", ""])
def test_cli_check_unreadable_log_is_one_line_exit_2(capsys, tmp_path, text: str) -> None:
    (tmp_path / "startup.log").write_text(text)
    code, _, err = cli(capsys, "serve-plan", "llama-3-8b", "--check",
                       str(tmp_path / "startup.log"))
    assert code == 2
    assert "no engine startup figures found" in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_cli_without_a_budget_is_one_line_exit_2(capsys) -> None:
    code, _, err = cli(capsys, "serve-plan", "llama-3-8b")
    assert code == 2 and err.count("\n") == 1
    assert "--kv-cache-memory BYTES" in err and "--gpu NAME" in err


def test_log_inputs_from_sglang_keep_its_page_and_chunk_out() -> None:
    log = parse_engine_log(SGLANG_0523.replace("'fp8_e4m3'", "'bf16'"))
    inputs = log_inputs(log, tp=None, max_model_len=None, kv_cache_dtype=None,
                        block_size=None, max_num_batched_tokens=None, kv_cache_memory=None)
    # SGLang's page_size 1 and chunked_prefill_size are not vLLM's block and batch budget;
    # its "bf16" is vLLM's "bfloat16"
    assert inputs == {"tp": 1, "max_model_len": 40960, "kv_cache_dtype": "bfloat16",
                      "block_size": None, "max_num_batched_tokens": None,
                      "kv_cache_memory": round(34.33 * GIB)}
