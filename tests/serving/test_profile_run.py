"""vLLM's profile-run activation peak (memfit.serving.profile_run) on a tiny Llama config.

Expected bytes are computed by hand from vLLM's code and the MLP's shapes; the MLP's transient is
also measured on a real CPU forward of the same transformers module (the allocator's events under
the PyTorch profiler), independently of the trace.
"""

from __future__ import annotations

import pytest

from memfit.errors import MemfitError
from memfit.serving.profile_run import profile_activation_peak, sampler_peak

pytest.importorskip("transformers")

N = 128  # max_num_batched_tokens
H, FF, V = 64, 256, 1000  # hidden, intermediate, vocab
TINY = {"model_type": "llama", "hidden_size": H, "intermediate_size": FF, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": V,
        "max_position_embeddings": 512, "torch_dtype": "bfloat16"}


@pytest.fixture(scope="module")
def tiny():
    return profile_activation_peak(TINY, max_num_batched_tokens=N, max_num_seqs=16)


def test_forward_peak_by_hand(tiny) -> None:
    # The MLP holds act(gate), up and their product at once: 3 x tokens x intermediate, bf16;
    # around it vLLM's residual stream: hidden_states and residual, 2 x tokens x hidden.
    mlp = 3 * N * FF * 2
    assert tiny.block_bytes["mlp"] == mlp == 196_608
    assert tiny.peak_block == "mlp"
    assert tiny.stream_bytes == 2 * N * H * 2 == 32_768
    assert tiny.forward_peak_bytes == 229_376
    # transformers' own forward holds more (the embedding output, the layer's input, the normed
    # input, the norms' float32 copies): the plain trace is not the engine's peak
    assert tiny.transformers_forward_bytes > tiny.forward_peak_bytes


def test_attention_by_hand(tiny) -> None:
    # Q, K, V: 128 tokens x 4 heads x 16 dims, bf16 = 16 KiB each. The rotary embedding of K, at
    # its highest point, holds k * cos, rotate_half(k) and rotate_half(k) * sin (16 KiB each)
    # beside Q, K, V and the rotated Q: 7 x 16 KiB. The attention itself (vLLM's profile run:
    # its output buffer, zero-filled) and o_proj come after Q and K are dropped, lower.
    assert tiny.block_bytes["self_attn"] == 7 * N * H * 2 == 114_688


def test_attention_is_the_profile_runs() -> None:
    # No mask and no scores: a sliding window changes nothing, and a model transformers runs
    # without SDPA (Gemma-2's soft-capping) traces too
    def blocks(extra):
        return profile_activation_peak({**TINY, **extra}, max_num_batched_tokens=N,
                                       max_num_seqs=16).block_bytes
    full = blocks({"model_type": "mistral", "sliding_window": None})
    assert blocks({"model_type": "mistral", "sliding_window": 32}) == full
    assert full["self_attn"] == 7 * N * H * 2
    gemma2 = blocks({"model_type": "gemma2", "head_dim": 16, "attn_logit_softcapping": 50.0})
    assert gemma2["mlp"] == 3 * N * FF * 2


def test_sampler_by_hand(tiny) -> None:
    s = tiny.sampler
    rows = 16  # min(128 tokens, 16 seqs)
    assert s.rows == rows
    # profile_run holds the hidden states of all tokens, the last-token rows and rand_like of them
    assert s.held_bytes == N * H * 2 + 2 * 2048 == 20_480  # 16 x 64 x 2 = 2048 (512-multiple)
    assert s.logits_bytes == rows * 1024 * 2  # vocab 1000 padded to 1024, bf16
    assert s.float32_logits_bytes == s.probs_bytes == s.noise_bytes == rows * V * 4 == 64_000
    # Triton buffer: min(next_pow2(min(132, 16)), 132) = 16 rows of V float32; 16 <= 64 rows
    # also take the split-row workspace: stats 64*32*4 and parts 64*5*32*8*3 float32
    assert s.topk_buffer_bytes == 16 * V * 4 + 64 * 32 * 4 * 4 + 64 * 5 * 32 * 8 * 3 * 4
    # six 16-row metadata tensors (five float32, top_k int64) and the argmax ids (int64), each
    # one 512-byte block
    assert s.small_bytes == 7 * 512
    assert s.gather_bytes == 0
    sampler = 32_768 + 3 * 64_000 + 1_079_808 + 3584
    assert s.sampler_bytes == sampler
    assert tiny.sampler_peak_bytes == 20_480 + sampler
    assert tiny.total_bytes == int(tiny) == max(229_376, 20_480 + sampler)


def test_sampler_many_rows_by_hand() -> None:
    # 100 rows: the buffer is min(next_pow2(100), 132) = 128 rows, no split workspace; an A100's
    # 108 SMs cap it at 108
    s = sampler_peak(vocab_size=V, hidden_size=H, max_num_batched_tokens=N, max_num_seqs=100)
    assert s.topk_buffer_bytes == 128 * V * 4
    a100 = sampler_peak(vocab_size=V, hidden_size=H, max_num_batched_tokens=N,
                        max_num_seqs=100, num_sms=108)
    assert a100.topk_buffer_bytes == 844 * 512  # 108 x 1000 x 4 = 432,000 B in 512-B blocks
    # more seqs than tokens: one request per token
    assert sampler_peak(vocab_size=V, hidden_size=H, max_num_batched_tokens=N,
                        max_num_seqs=256).rows == N


def test_tp_divides_heads_and_mlp() -> None:
    tp2 = profile_activation_peak(TINY, max_num_batched_tokens=N, max_num_seqs=16, tp=2)
    assert tp2.block_bytes["mlp"] == 3 * N * (FF // 2) * 2
    assert tp2.stream_bytes == 2 * N * H * 2  # the hidden size is whole on every rank
    assert tp2.forward_peak_bytes == 2 * N * H * 2 + 3 * N * (FF // 2) * 2
    # the logits are all-gathered: this rank's shard (16 x 512 bf16), the gathered buffer and
    # its reshaped copy (16 x 1024 bf16 each)
    assert tp2.sampler.gather_bytes == 16 * 512 * 2 + 2 * 16 * 1024 * 2


def test_peak_does_not_grow_with_depth(tiny) -> None:
    four = profile_activation_peak({**TINY, "num_hidden_layers": 4}, max_num_batched_tokens=N,
                                   max_num_seqs=16)
    assert four.block_bytes == tiny.block_bytes
    assert four.forward_peak_bytes == tiny.forward_peak_bytes


def test_bad_input() -> None:
    with pytest.raises(MemfitError, match="does not divide num_attention_heads"):
        profile_activation_peak(TINY, max_num_batched_tokens=N, max_num_seqs=16, tp=3)
    kv_only = {k: v for k, v in TINY.items() if k != "intermediate_size"}
    with pytest.raises(MemfitError, match="intermediate_size"):
        profile_activation_peak(kv_only, max_num_batched_tokens=N, max_num_seqs=16)
    with pytest.raises(MemfitError, match="max_num_seqs"):
        profile_activation_peak(TINY, max_num_batched_tokens=N, max_num_seqs=0)


def test_mlp_transient_matches_a_real_cpu_forward(tiny) -> None:
    """The same tiny transformers decoder run for real on CPU (bf16, no grad): the allocator's
    events inside each layer's MLP, from its entry, peak at the traced transient."""
    import torch
    import transformers
    from torch.profiler import ProfilerActivity, profile

    from memfit.cpu_peak import marked_allocator_events

    config = transformers.AutoConfig.for_model(
        **{k: v for k, v in TINY.items() if k != "torch_dtype"}, use_cache=False)
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(config, attn_implementation="sdpa",
                                               dtype=torch.bfloat16).eval()
    ranges: list = []

    def enter(*_):
        ranges.append(torch.profiler.record_function("mlp"))
        ranges[-1].__enter__()

    def leave(*_):
        ranges[-1].__exit__(None, None, None)

    for layer in model.layers:
        layer.mlp.register_forward_pre_hook(enter)
        layer.mlp.register_forward_hook(leave)
    ids = torch.randint(0, V, (1, N))
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model(input_ids=ids)
    running, start, peaks = 0, {}, {}
    for slot, nbytes in marked_allocator_events(prof, marker="mlp"):
        if slot % 2 and slot not in start:
            start[slot] = running
        running += nbytes
        if slot % 2:
            peaks[slot] = max(peaks.get(slot, 0), running - start[slot])
    assert len(peaks) == 2  # both layers' MLPs
    assert max(peaks.values()) == tiny.block_bytes["mlp"]


# ----------------------------------------------------------------------------- engine versions
# The sort-based sampler (vLLM 0.11.0's forward_native and V0's _apply_top_k_top_p, both
# reached by their dummy sampling's top-k = V - 1 and top-p < 1), by hand on 16 rows of the
# 1000-logit vocabulary: inside logits.sort live the 16-bit logits (16 x 1024 x 2 = 32,768 B),
# the float32 logits (16 x 1000 x 4 = 64,000 B), the sorted values (64,000 B), the indices
# (int64, 128,000 B), the iota of source indices (int64, 128,000 B) and CUB's alternate keys and
# values (float32 + int64, 192,000 B): 608,768 B.
SORT_PHASE = 32_768 + 64_000 + 64_000 + 128_000 + 128_000 + 192_000


def test_sort_sampler_by_hand_at_0_11() -> None:
    s = sampler_peak(vocab_size=V, hidden_size=H, max_num_batched_tokens=N, max_num_seqs=16,
                     engine_version="0.11.0")
    assert (s.sampler, s.engine_version) == ("sort", "0.11.0")
    assert s.sort_bytes == 64_000 + 128_000 + 128_000 + 192_000
    assert s.topk_buffer_bytes == s.probs_bytes == s.noise_bytes == 0
    # V1 holds the hidden states of all tokens, the 16 last-token rows and their rand_like
    assert s.held_bytes == N * H * 2 + 2 * 16 * H * 2 == 20_480
    # five float32 metadata tensors, top_k int64 and the argmax ids int64: one block each
    assert s.small_bytes == 7 * 512
    assert s.peak_bytes == 20_480 + SORT_PHASE + 7 * 512 == 632_832


def test_sort_sampler_by_hand_in_v0() -> None:
    for version in ("0.7.3", "0.6.4.post1"):
        s = sampler_peak(vocab_size=V, hidden_size=H, max_num_batched_tokens=N,
                         max_num_seqs=16, engine_version=version)
        # V0 holds the hidden states of all tokens only (the pruned rows die in compute_logits)
        assert s.held_bytes == N * H * 2 == 16_384
        # SamplingTensors: six in the model dtype and top_k int32, one block each
        assert s.small_bytes == 7 * 512
        assert s.peak_bytes == 16_384 + SORT_PHASE + 7 * 512 == 628_736


def test_the_release_picks_the_sampler_and_the_forward_is_traced_once(tiny) -> None:
    from memfit.serving.profile_run import _forward_trace

    before = _forward_trace.cache_info().hits
    at_011 = profile_activation_peak(TINY, max_num_batched_tokens=N, max_num_seqs=16,
                                     engine_version="0.11.0")
    assert _forward_trace.cache_info().hits == before + 1  # the tiny fixture's trace, reused
    assert at_011.forward_peak_bytes == tiny.forward_peak_bytes == 229_376
    assert at_011.total_bytes == 632_832 and at_011.engine_version == "0.11.0"
    assert tiny.total_bytes == 1_328_640 and tiny.engine_version == "0.33.0"


def test_an_unmodelled_release_is_refused() -> None:
    for version in ("0.10.1.1", "0.19", "latest"):
        with pytest.raises(MemfitError, match=r"0\.33\.0, 0\.11\.0, 0\.7\.3, 0\.6\.4\.post1"):
            sampler_peak(vocab_size=V, hidden_size=H, max_num_batched_tokens=N,
                         max_num_seqs=16, engine_version=version)
    from memfit.serving import serve_plan

    with pytest.raises(MemfitError, match="not modelled"):
        serve_plan(TINY, kv_cache_memory=2**30, engine_version="0.10.1.1")


def test_cli_engine_version(capsys, tmp_path) -> None:
    """``--engine-version 0.11.0``: the sort-based sampler's peak, 0.11's capture sizes (1, 2,
    4, 8, ..., min(2 x 16, 512, 128) = 32: 7 PIECEWISE, 5 FULL up to 16 sequences) and the
    graphs left out of the KV budget (captured after it, before v0.21)."""
    import json

    from memfit.cli import main

    (tmp_path / "config.json").write_text(json.dumps(TINY))
    argv = ["serve-plan", str(tmp_path), "--gpu", "h100-sxm-80gb", "--max-num-seqs", "16",
            "--max-num-batched-tokens", "128", "--max-model-len", "512", "--json"]
    assert main([*argv, "--engine-version", "0.11.0"]) == 0
    old = json.loads(capsys.readouterr().out)
    assert main(argv) == 0
    new = json.loads(capsys.readouterr().out)
    assert old["engine_version"] == "0.11.0" and new["engine_version"] == "0.33.0"
    b011, b033 = old, new  # the budget's keys are top-level
    assert b011["activation_peak_bytes"] == 632_832
    assert b033["activation_peak_bytes"] == 1_328_640
    assert b011["cuda_graphs"] == {"PIECEWISE": 7, "FULL": 5}
    assert not b011["cuda_graphs_in_budget"] and b033["cuda_graphs_in_budget"]
    non_kv = b011["weights_bytes"] + b011["activation_peak_bytes"] + b011["non_torch_bytes"]
    assert old["kv_cache_bytes"] == b011["requested_bytes"] - non_kv
    non_kv = b033["weights_bytes"] + b033["activation_peak_bytes"] + b033["non_torch_bytes"]
    assert new["kv_cache_bytes"] == b033["requested_bytes"] - non_kv - b033["cuda_graph_bytes"]
    for bad in (["--engine-version", "0.10.1.1"], ["--engine", "sglang", "--engine-version",
                                                    "0.11.0"]):
        assert main([*argv[:2], "--gpu", "h100-sxm-80gb", *bad]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "--engine-version" in err


def test_a_module_that_does_not_run_at_a_ranks_widths_is_one_line(capsys) -> None:
    """Qwen2.5-VL's text attention derives head_dim from hidden / heads, so one TP rank's heads
    (the hidden size kept) do not run: one line naming --activation-peak, exit 2, and the flag
    plans without the trace."""
    import json

    from memfit.cli import main

    cfg = {"model_type": "qwen2_5_vl", "hidden_size": 256, "intermediate_size": 512,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "vocab_size": 1024, "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]},
           "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}
    with pytest.raises(MemfitError, match="--activation-peak"):
        profile_activation_peak(cfg, max_num_batched_tokens=64, max_num_seqs=4, tp=2)
    capsys.readouterr()
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        Path(d, "config.json").write_text(json.dumps(cfg))
        args = ["serve-plan", d, "--gpu", "h100-sxm-80gb", "--tp", "2", "--max-images", "0",
                "--max-model-len", "4096"]
        assert main(args) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--activation-peak" in err
        assert main([*args, "--activation-peak", "1GiB", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["activation_peak_bytes"] == 2**30 and out["activation_source"] == "given"
