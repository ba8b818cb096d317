"""bench/serving_vllm_parity.py's memfit side runs in memfit's own venv, without vLLM.

The vLLM side needs its separate venv (bench/serving_vllm/setup.sh) and is not run here; this
checks that the grid and the memfit half of the comparison work on their own, and that the
figures the bench reads are the ones worked out by hand.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

from _bench import load_bench

ROOT = Path(__file__).resolve().parents[2]
GiB = 2**30


def _bench() -> ModuleType:
    module = load_bench("serving_vllm_parity")
    return module


def test_memfit_side_runs_without_vllm() -> None:
    bench = _bench()
    cases = bench.grid(quick=True, models=["llama-3-8b", "gemma-3-1b", "qwen3-next-80b-a3b"])
    # 3 models x TP (1, 2) x KV dtype (auto, fp8) x 2 lengths x 2 memory figures; the hybrid
    # Qwen3-Next three times: prefix caching on (an H100 and an A100) and off
    assert len(cases) == (1 + 1 + 3) * 2 * 2 * 2 * 2
    assert sorted({(c["prefix_caching"], c["gpu"] or "") for c in cases
                   if c["model"] == "qwen3-next-80b-a3b"}) == [
        (False, ""), (True, ""), (True, "a100-80gb")]
    rows = bench.memfit_side(cases)
    assert "vllm" not in sys.modules
    assert [r["id"] for r in rows] == [c["id"] for c in cases]
    assert not [r for r in rows if "error" in r]
    by = {(c["model"], c["tp"], c["kv_cache_dtype"], c["max_model_len"], c["memory_gib"]): r
          for c, r in zip(cases, rows, strict=True)}
    # Llama-3-8B at TP 1, bf16, its 8192 context, 1 GiB: a 16-token block over 32 layers of
    # 8 KV heads x (128 + 128) x 2 bytes is 32 x 16 x 8 x 256 x 2 = 2 MiB, so 512 blocks;
    # one request takes 8192 / 16 = 512 of them: concurrency 1.0, 8192 tokens, and it does
    # not fit beside the null block (511 usable blocks hold 511 x 16 = 8176 tokens)
    llama = by[("llama-3-8b", 1, "auto", None, 1)]
    assert llama["bytes_per_block"] == 32 * 16 * 8 * 256 * 2 == 2 * 2**20
    assert (llama["num_gpu_blocks"], llama["kv_cache_tokens"]) == (512, 8192)
    assert llama["max_concurrency"] == 1.0
    assert (llama["fits"], llama["max_model_len_that_fits"]) == (False, 8176)
    # fp8 KV at TP 2: 4 KV heads of 1 byte, a quarter of the block
    assert by[("llama-3-8b", 2, "fp8", None, 1)]["num_gpu_blocks"] == 4 * 512
    # the grid's groups carry kind, layers, block size and page bytes for the comparison
    assert llama["groups"] == [{"kind": "full", "layers": list(range(32)), "block_size": 16,
                                "page_size_bytes": 16 * 8 * 256 * 2}]


def test_compare_flags_each_differing_field() -> None:
    bench = _bench()
    case = {"id": 0, "model": "m"}
    same = {"id": 0, "num_gpu_blocks": 5, "kv_cache_tokens": 80, "groups": []}
    assert bench.compare([case], [same], [dict(same)])[0]["mismatch"] == []
    other = {**same, "kv_cache_tokens": 81}
    assert bench.compare([case], [same], [other])[0]["mismatch"] == ["kv_cache_tokens"]
    # one side refusing and the other not is a mismatch; both refusing is not
    refused = {"id": 0, "error": "ValueError: no"}
    assert bench.compare([case], [refused], [same])[0]["mismatch"] == ["refused"]
    assert bench.compare([case], [refused], [dict(refused)])[0]["mismatch"] == []
