"""The sampler phase of vLLM's profile run, per release, from the release's sampler code
(no torch): :func:`sampler_peak`. :mod:`memfit.serving.profile_run` traces the forward and takes
the larger of the two.

0.33.0 runs ``vllm/v1/sample``'s Triton top-k/top-p path on ``R = min(max_num_batched_tokens,
max_num_seqs)`` rows and the vocabulary ``V`` (padded to 64 for the LM head's output,
``vocab_parallel_embedding.py: pad_vocab_size``). vLLM 0.11.0 and V0 (0.6.4.post1, 0.7.3) run a
sampler that sorts the vocabulary (:func:`_sort_sampler_peak`: 38 bytes a logit inside
``logits.sort``), which sets the peak at their default 256 or 1,024 sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.errors import MemfitError
from memfit.serving.budget import DEFAULT_ENGINE_VERSION, EngineVersion
from memfit.serving.budget import engine_version as engine_version_spec

__all__ = ["DEFAULT_NUM_SMS", "SamplerPeak", "allocator_bytes", "sampler_peak"]

_BLOCK = 512
"""The CUDA caching allocator rounds every request up to 512 bytes
(``c10/cuda/CUDACachingAllocator.cpp: round_size``, ``kMinBlockSize``)."""

DEFAULT_NUM_SMS = 132
"""Streaming multiprocessors of an H100 SXM or H200: the rows of the sampler's Triton top-k/top-p
buffer (``vllm/v1/sample/ops/topk_topp_triton.py: apply_top_k_top_p_triton``)."""

_VOCAB_PADDING = 64  # vocab_parallel_embedding.py: DEFAULT_VOCAB_PADDING_SIZE
# topk_topp_triton.py: _apply_topp_split's cached workspace, used for batches of at most
# _SPLIT_MAX_BATCH rows: "stats" (64 * 32, 4) and "parts" (64, _SPLIT_ROUNDS 5,
# _SPLIT_MAX_SPLITS 32, _SPLIT_FANOUT 8, 3), float32.
_SPLIT_MAX_BATCH = 64
_SPLIT_STATS_ELEMENTS = 64 * 32 * 4
_SPLIT_PARTS_ELEMENTS = 64 * 5 * 32 * 8 * 3


def _blocks(nbytes: int) -> int:
    """``nbytes`` as the caching allocator hands it out (a multiple of 512)."""
    return -(-nbytes // _BLOCK) * _BLOCK


allocator_bytes = _blocks
"""``nbytes`` as the CUDA caching allocator hands it out (a multiple of 512), for the traced
forward of :mod:`memfit.serving.profile_run` too."""


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclass(frozen=True, kw_only=True)
class SamplerPeak:
    """``_dummy_sampler_run``'s tensors at its highest point, on one GPU (bytes, each rounded to
    the allocator's 512-byte blocks). See :func:`sampler_peak` for where each comes from."""

    rows: int
    """Requests of the dummy batch, ``min(max_num_batched_tokens, max_num_seqs)``: the logits'
    rows."""
    held_bytes: int
    """Held by ``profile_run`` throughout: the forward's hidden states of every token and the
    rows at each request's last token, plus ``torch.rand_like`` of those rows."""
    logits_bytes: int
    """The LM head's logits, in the model dtype, over the padded vocabulary."""
    float32_logits_bytes: int
    """``Sampler.forward``: ``logits.to(torch.float32)``."""
    topk_buffer_bytes: int
    """The Triton top-k/top-p kernel's per-program buffer (plus the split-row workspace for
    batches of at most 64 rows), cached after the first call."""
    probs_bytes: int
    """``TopKTopPSampler.forward_native``: ``logits.softmax(dim=-1, dtype=torch.float32)``."""
    noise_bytes: int
    """``random_sample``: the exponential noise, ``torch.empty`` like the probabilities."""
    small_bytes: int
    """The dummy sampling metadata (six per-request tensors) and the greedy token ids."""
    gather_bytes: int
    """Under TP, the all-gather of the logits at its highest point (this rank's shard, the
    gathered buffer and its reshaped copy); 0 at ``tp == 1``."""
    sort_bytes: int = 0
    """The sort-based path only (``sampler == "sort"``): ``logits.sort`` at its highest point,
    inside PyTorch's ``segmented_sort_pairs`` (``aten/src/ATen/native/cuda/Sort.cu``): the sorted
    values (float32) and indices (int64), the iota of source indices it sorts alongside (int64)
    and CUB's ``DeviceSegmentedRadixSort::SortPairs`` temporary storage, which holds the
    alternate keys and values buffers (float32 + int64): 4 + 8 + 8 + 12 = 32 bytes a logit."""
    engine_version: str = "0.33.0"
    sampler: str = "triton"
    """The code path modelled: ``triton`` (0.33) or ``sort`` (0.11, V0)."""

    @property
    def sampler_bytes(self) -> int:
        """The sampler's own tensors at its highest point (0.33: ``random_sample``'s noise; the
        sort-based path: inside ``logits.sort``)."""
        return (self.logits_bytes + self.float32_logits_bytes + self.topk_buffer_bytes
                + self.probs_bytes + self.noise_bytes + self.small_bytes + self.sort_bytes)

    @property
    def peak_bytes(self) -> int:
        """What is alive at the sampler phase's highest point, ``held_bytes`` included."""
        return self.held_bytes + max(self.sampler_bytes, self.gather_bytes)


def sampler_peak(*, vocab_size: int, hidden_size: int, max_num_batched_tokens: int,
                 max_num_seqs: int, tp: int = 1, dtype_bytes: int = 2,
                 num_sms: int = DEFAULT_NUM_SMS,
                 engine_version: str | EngineVersion = DEFAULT_ENGINE_VERSION) -> SamplerPeak:
    """The sampler phase of a vLLM release's profile run, from its code (no torch);
    ``engine_version`` picks the release (:data:`memfit.serving.budget.ENGINE_VERSIONS`).
    0.33.0 (the default) is described here; 0.11.0 and V0 (0.6.4.post1, 0.7.3) in
    :func:`_sort_sampler_peak`.

    ``_dummy_run`` makes ``R = min(tokens, max_num_seqs)`` requests and returns the hidden
    states ``(tokens, hidden)`` and their ``R`` last-token rows; ``_dummy_sampler_run`` takes
    ``torch.rand_like`` of the rows, computes the logits (``LogitsProcessor._get_logits``: the
    LM head's output over the vocabulary padded to 64, all-gathered under TP:
    ``base_device_communicator.py: all_gather`` allocates the gathered buffer and a reshaped
    copy), and runs the sampler twice with ``all_random=False``, top-k = V − 1, top-p = 0.9, no
    penalties and no logprobs (``SamplingMetadata`` in ``_dummy_sampler_run``). In
    ``vllm/v1/sample/sampler.py: Sampler.forward`` the logits become float32 (a copy); greedy
    ids are taken (``argmax``, int64); the temperature divides in place. The first call goes to
    FlashInfer where it is available (``top_k_top_p_sampling_from_logits``, top-k first: a
    masked copy and its softmax, 2 × R × V float32); the second, with a generator, to
    ``TopKTopPSampler.forward_native``: ``apply_top_k_top_p`` (Triton, in place, with a cached
    ``(min(next_pow2(min(num_sms, R)), num_sms), V)`` float32 buffer), the softmax in float32,
    then ``random_sample``'s exponential noise of the same shape. The second call is the higher
    (the same two R × V float32 tensors plus the buffer), so it is the one counted.

    >>> s = sampler_peak(vocab_size=128256, hidden_size=4096, max_num_batched_tokens=8192,
    ...                  max_num_seqs=256)
    >>> s.rows, s.float32_logits_bytes == 256 * 128256 * 4
    (256, True)
    """
    for name, value in (("vocab_size", vocab_size), ("hidden_size", hidden_size),
                        ("max_num_batched_tokens", max_num_batched_tokens),
                        ("max_num_seqs", max_num_seqs), ("tp", tp),
                        ("dtype_bytes", dtype_bytes), ("num_sms", num_sms)):
        if value < 1:
            raise MemfitError(f"{name} must be a positive integer, got {value}")
    version = engine_version_spec(engine_version)
    tokens = max_num_batched_tokens
    rows = min(tokens, max_num_seqs)  # gpu_model_runner.py: _dummy_run, num_reqs
    padded = -(-vocab_size // _VOCAB_PADDING) * _VOCAB_PADDING
    logits = _blocks(rows * padded * dtype_bytes)
    gather = 0
    if tp > 1:
        gather = _blocks(rows * (padded // tp) * dtype_bytes) + 2 * logits
    if version.sampler == "sort":
        return _sort_sampler_peak(version, vocab_size=vocab_size, hidden_size=hidden_size,
                                  tokens=tokens, rows=rows, logits=logits, gather=gather,
                                  dtype_bytes=dtype_bytes)
    held = (_blocks(tokens * hidden_size * dtype_bytes)
            + 2 * _blocks(rows * hidden_size * dtype_bytes))
    fp32 = _blocks(rows * vocab_size * 4)
    programs = min(num_sms, rows)
    buffer = _blocks(min(_next_power_of_2(programs), num_sms) * vocab_size * 4)
    if rows <= _SPLIT_MAX_BATCH:
        buffer += _blocks(_SPLIT_STATS_ELEMENTS * 4) + _blocks(_SPLIT_PARTS_ELEMENTS * 4)
    # temperature, top_p, frequency/presence/repetition penalties: float32 (torch.full with a
    # float); top_k: int64 (torch.full with an int); greedy_sample's argmax: int64.
    small = 5 * _blocks(rows * 4) + _blocks(rows * 8) + _blocks(rows * 8)
    return SamplerPeak(rows=rows, held_bytes=held, logits_bytes=logits,
                       float32_logits_bytes=fp32, topk_buffer_bytes=buffer, probs_bytes=fp32,
                       noise_bytes=fp32, small_bytes=small, gather_bytes=gather,
                       engine_version=version.version, sampler=version.sampler)


def _sort_sampler_peak(version: EngineVersion, *, vocab_size: int, hidden_size: int,
                       tokens: int, rows: int, logits: int, gather: int,
                       dtype_bytes: int) -> SamplerPeak:
    """The sampler phase where top-k/top-p sorts the vocabulary: vLLM 0.11.0's V1 sampler and
    the V0 sampler (0.6.4.post1, 0.7.3). Both dummy samplings ask for top-k = V − 1 and a top-p
    below 1 (0.11: ``gpu_model_runner.py: _dummy_sampler_run``, top-p 0.9; V0:
    ``worker/model_runner.py: _dummy_run``, ``SamplingParams(top_p=0.99, top_k=vocab - 1)``), no
    logprobs, no min-p, no penalties, so both reach ``apply_top_k_top_p`` (0.11:
    ``v1/sample/ops/topk_topp_sampler.py``; V0: ``layers/sampler.py: _apply_top_k_top_p``),
    whose first line is ``logits.sort(dim=-1)`` on the float32 logits; every later step there
    (masks, softmax, cumsum, the scatter back) holds less than the sort, and so does what
    follows (the softmax, V0's log-softmax, the exponential noise).

    0.11 takes that path in ``TopKTopPSampler.forward_native``, which it uses when FlashInfer is
    not importable (installing vLLM alone does not bring it: it is the ``flashinfer`` extra) or
    ``VLLM_USE_FLASHINFER_SAMPLER=0``; with FlashInfer (``forward_cuda``:
    ``top_k_top_p_sampling_from_logits``, no sort) the phase is lower. V0 uses FlashInfer only
    with ``VLLM_USE_FLASHINFER_SAMPLER=1``.

    Alive inside the sort, on ``R = min(tokens, max_num_seqs)`` rows:

    - held by the caller: the forward's hidden states of every token (``tokens x hidden``);
      0.11 also the ``R`` last-token rows and their ``torch.rand_like`` (``2 x R x hidden``);
    - the logits in the model dtype over the padded vocabulary (the LM head's output; the
      ``[..., :vocab]`` slice keeps it whole);
    - ``logits.to(torch.float32)`` over the vocabulary (``R x V x 4``; the temperature divides
      it in place);
    - the sort: :attr:`SamplerPeak.sort_bytes`, ``R x V x 32``;
    - small: 0.11's dummy ``SamplingMetadata`` (temperature, top-p and three penalties float32,
      top-k int64) and the greedy ids (``argmax``, int64); V0's ``SamplingTensors`` (six in the
      model dtype, top-k int32).
    """
    elements = rows * vocab_size
    fp32 = _blocks(elements * 4)
    sort = (_blocks(elements * 4) + _blocks(elements * 8) + _blocks(elements * 8)
            + _blocks(elements * (4 + 8)))
    held = _blocks(tokens * hidden_size * dtype_bytes)
    if version.runner == "V1":
        held += 2 * _blocks(rows * hidden_size * dtype_bytes)
        small = 5 * _blocks(rows * 4) + _blocks(rows * 8) + _blocks(rows * 8)
    else:
        small = 6 * _blocks(rows * dtype_bytes) + _blocks(rows * 4)
    return SamplerPeak(rows=rows, held_bytes=held, logits_bytes=logits,
                       float32_logits_bytes=fp32, topk_buffer_bytes=0, probs_bytes=0,
                       noise_bytes=0, small_bytes=small, gather_bytes=gather, sort_bytes=sort,
                       engine_version=version.version, sampler=version.sampler)
