"""Pipeline parallelism in the per-rank trace (memfit/parallel/pipeline.py).

Each rank runs PyTorch's own ``torch.distributed.pipelining`` stage and schedule
(torch/distributed/pipelining/schedules.py: ScheduleGPipe._step_microbatches,
Schedule1F1B._step_microbatches) on its stage of the model, split as torchtitan splits it by hand
(torchtitan/distributed/pipeline_parallel.py: generate_llm_fqn_per_model_part), over a fake
process group. Expected values come from first principles: a stage allocates one gradient
receive buffer per micro-batch and keeps it (stage.py: PipelineStage._create_grad_recv_info,
_setup_backward_recv_info), the forward cache keeps a micro-batch's activations until its
backward (stage.py: forward_one_chunk), GPipe runs every forward before any backward, 1F1B at
most ``pp - stage`` forwards ahead; a micro-batch's saved activations are measured with
autograd's own saved-tensor hooks on a real forward. Or from real runs: one gloo process per
rank running the same stage and schedule under the profiler (memfit/parallel/measure.py). A P2P
work keeps its tensor while the schedule keeps the work (ProcessGroupGloo.hpp: SendWork::tensor_;
ProcessGroupNCCL.cpp: pointToPoint, work->outputs_).
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

import memfit
from _pipeline import per_rank
from memfit.errors import MemfitError
from memfit.parallel import Parallel
from memfit.parallel.measure import Case, build, tiny_spec
from memfit.parallel.pipeline import stage_layers, stage_modules
from memfit.recipe import Recipe

SEQ = 64
HIDDEN = 64  # tiny_spec's hidden size


def _case(microbatches: int, schedule: str, micro: int = 2, layers: int = 4) -> Case:
    return Case(spec=tiny_spec(layers), batch=micro * microbatches, seq=SEQ,
                recipe=Recipe(parallel=Parallel(gpus=2, pp=2, pp_schedule=schedule,
                                                microbatches=microbatches)))


def _checkpointed(case: Case, checkpointing: str) -> Case:
    """``case`` with its recipe's checkpointing policy ``checkpointing``."""
    recipe = dataclasses.replace(case.recipe, checkpointing=checkpointing)
    return dataclasses.replace(case, recipe=recipe)


_per_rank = per_rank  # traced once per case (tests/_pipeline.py)


# -- the layout --------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"pp_schedule": "zb"}, "pp_schedule='zb'"),
    ({"pp_schedule": "1F1B"}, "did you mean '1f1b'"),
    ({"microbatches": 0}, "microbatches=0"),
])
def test_bad_pipeline_layouts_get_one_line_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(MemfitError, match=match) as info:
        Parallel(gpus=2, pp=2, **kwargs)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("layout", "batch", "match"), [
    ({"pp": 4}, 4, "pp=4\\) is more stages than the model's 2 layers"),
    ({"pp": 2, "pp_schedule": "interleaved-1f1b"}, 4, "needs 4 stages, more than the model's 2"),
    ({"pp": 2, "microbatches": 3}, 4, "microbatches=3\\) does not divide the batch of 4"),
    ({"pp": 2, "microbatches": 1}, 4, "needs at least pp=2 micro-batches"),
    ({"pp": 2, "gpus": 8, "tp": 2}, 4, "DDP has not supported > 1D parallelism"),
])
def test_pipeline_the_model_or_batch_cannot_take_gets_one_line_errors(
        layout: dict, batch: int, match: str) -> None:
    model, inputs = build(Case(spec=tiny_spec(2), batch=batch, seq=16,
                               recipe=Recipe(parallel=Parallel(gpus=1))))
    parallel = Parallel(**{"gpus": layout.get("pp", 1), **layout})
    with pytest.raises(MemfitError, match=match) as info:
        memfit.estimate(model, inputs, device="cpu", parallel=parallel)
    assert "\n" not in str(info.value)


def test_pipeline_traces_training_with_the_models_own_loss() -> None:
    model, inputs = build(_case(2, "1f1b"))
    parallel = Parallel(gpus=2, pp=2)
    with pytest.raises(MemfitError, match="pass an optimizer") as info:
        memfit.estimate(model, inputs, device="cpu", optimizer=None, parallel=parallel)
    assert "\n" not in str(info.value)
    with pytest.raises(MemfitError, match="drop loss_fn"):
        memfit.estimate(model, inputs, device="cpu", parallel=parallel,
                        loss_fn=lambda m, b: m(**b))


def test_stages_split_the_effective_layers_as_torchtitan_does() -> None:
    """generate_llm_fqn_per_model_part (input_weight = output_weight = 1): the embedding and the
    norm + head count as one layer each, the effective layers are dealt out evenly, the first
    ``effective % stages`` stages taking one more. 4 blocks on 2 stages: 6 effective, 3 each:
    embedding + blocks 0-1 | blocks 2-3 + head. On 4 stages: 2, 2, 1, 1 effective. 32 blocks on
    4 stages: 34 effective, 9, 9, 8, 8: 8 blocks (+ embedding), 9, 8, 7 (+ head)."""
    assert stage_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert stage_layers(4, 4) == [range(0, 1), range(1, 3), range(3, 4), range(4, 4)]
    assert stage_layers(32, 4) == [range(0, 8), range(8, 17), range(17, 25), range(25, 32)]
    model, _ = build(_case(2, "1f1b"))
    first, = stage_modules(model, Parallel(gpus=2, pp=2), 0)
    last, = stage_modules(model, Parallel(gpus=2, pp=2), 1)
    assert list(first.layers) == ["0", "1"] and first.embed_tokens is not None
    assert first.lm_head is None and first.norm is None
    assert list(last.layers) == ["2", "3"] and last.embed_tokens is None
    assert last.lm_head is model.lm_head  # the model's own modules, not copies
    layouts = Parallel(gpus=2, pp=2, pp_schedule="interleaved-1f1b", microbatches=2)
    # interleaved: 4 virtual stages (blocks 0 | 1-2 | 3 | head); rank 0 holds stages 0 and 2
    assert [list(m.layers) for m in stage_modules(model, layouts, 0)] == [["0"], ["3"]]


# -- micro-batches in flight, from first principles ---------------------------------------------


def _saved_bytes_of_one_micro_batch(case: Case) -> int:
    """Bytes one micro-batch's forward through stage 0 leaves alive for its backward: the
    storages autograd saves (its saved-tensor hooks on a real forward) and the stage's output,
    not the parameters nor the batch itself."""
    model, inputs = build(case)
    stage, = stage_modules(model, case.parallel, 0)
    skip = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    skip.add(inputs["input_ids"].untyped_storage().data_ptr())
    micro = inputs["input_ids"][: case.batch // (case.parallel.microbatches or 2)]
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        saved[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = stage(micro)
    saved[out.untyped_storage().data_ptr()] = out.untyped_storage().nbytes()
    return sum(n for ptr, n in saved.items() if ptr not in skip)


def test_gpipe_keeps_every_micro_batch_and_1f1b_at_most_pp() -> None:
    """With the micro-batch size fixed (2 rows of 64 tokens), each extra micro-batch adds to
    stage 0's peak its rows of the batch (input_ids and labels, int64: 2 x 2 x 64 x 8 = 2,048
    bytes) and its gradient receive buffer, which the stage allocates per micro-batch and keeps
    (stage.py: _create_grad_recv_info): 2 x 64 x 64 fp32 = 32,768 bytes. Beyond that:
    - under 1F1B (past pp = 2 micro-batches) nothing: the activations in flight stay at
      pp - 0 = 2 (Schedule1F1B._step_microbatches: warmup_chunks);
    - under GPipe, one more micro-batch's saved activations and output, since every forward
      runs before the first backward (ScheduleGPipe._step_microbatches)."""
    rows = 2 * 2 * SEQ * 8
    recv_buffer = 2 * SEQ * HIDDEN * 4
    one_f1b = [_per_rank(_case(m, "1f1b"))[0].peak_bytes for m in (3, 4, 5)]
    step = rows + recv_buffer
    assert [b - a for a, b in itertools.pairwise(one_f1b)] == [step, step]
    activations = _saved_bytes_of_one_micro_batch(_case(2, "gpipe"))
    gpipe = [_per_rank(_case(m, "gpipe"))[0].peak_bytes for m in (3, 4, 5)]
    step = rows + recv_buffer + activations
    assert [b - a for a, b in itertools.pairwise(gpipe)] == [step, step]
    assert activations > 10 * recv_buffer  # a micro-batch's activations dominate


# -- the truth: real ranks over gloo --------------------------------------------------------------

GLOO_CASES = {"1f1b": _case(4, "1f1b"), "gpipe": _case(4, "gpipe"),
              "interleaved-1f1b": _case(4, "interleaved-1f1b")}


@pytest.fixture(scope="module")
def measured_two() -> list[list[dict[str, int]]]:
    """This module's 2-rank cases in one set of 2 gloo processes (a spawn costs each rank a
    fresh interpreter importing torch): GLOO_CASES twice each, GLOO_CHECKPOINTED once; each
    case built, wrapped and profiled from scratch inside the rank, as in its own spawn."""
    from memfit.parallel.measure import measure

    return measure([*GLOO_CASES.values(), *GLOO_CASES.values(), *GLOO_CHECKPOINTED], world=2,
                   repeats=1)


@pytest.fixture(scope="module")
def measured_pipelines(measured_two: list) -> dict[str, list[dict[str, int]]]:
    """Each rank's lowest of its two runs of each case (what ``measure(..., repeats=2)`` keeps:
    Note: [gloo's timing] in memfit/parallel/measure.py)."""
    from memfit.parallel.measure import lowest

    n = len(GLOO_CASES)
    peaks = [lowest(a, b) for a, b in zip(measured_two[:n], measured_two[n:2 * n], strict=True)]
    return dict(zip(GLOO_CASES, peaks, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(GLOO_CASES))
def test_each_stage_matches_a_real_gloo_run_within_1_percent(
        name: str, measured_pipelines: dict) -> None:
    """Per stage (rank), the trace's peak is within 1% of the real rank's: 2 gloo processes,
    4 layers on 2 stages, 4 micro-batches of 2 rows (more than pp, so that 1F1B and GPipe keep
    different numbers in flight), AdamW, 2 steps; each rank runs
    torch.distributed.pipelining's PipelineStage and Schedule1F1B / ScheduleGPipe /
    ScheduleInterleaved1F1B (two stages per rank)."""
    measured = measured_pipelines[name]
    for est in _per_rank(GLOO_CASES[name]):
        real = measured[est.ranks[0]]["peak"]
        assert abs(est.peak_bytes - real) <= 0.01 * real, (
            f"{name} stage {est.ranks}: predicted {est.peak_bytes:,} bytes, measured {real:,}")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(GLOO_CASES))
def test_each_phase_of_each_stage_matches_a_real_gloo_run_within_1_percent(
        name: str, measured_pipelines: dict) -> None:
    """Per stage and step: the schedule's part of the step (its forwards and backwards
    interleave, so the measurement has one range around ``schedule.step``: the trace's higher of
    its forward and backward phases) and the optimizer's, each within 1% of the real rank's high
    point inside the same range."""
    measured = measured_pipelines[name]
    for est in _per_rank(GLOO_CASES[name]):
        real = measured[est.ranks[0]]["phases"]
        for step in range(2):
            pred = max(est.phase_peaks[(step, "forward")], est.phase_peaks[(step, "backward")])
            for key, value in ((f"{step}:pipeline", pred),
                               (f"{step}:optimizer", est.phase_peaks[(step, "optimizer")])):
                assert abs(value - real[key]) <= 0.01 * real[key], (
                    f"{name} stage {est.ranks} {key}: predicted {value:,}, measured {real[key]:,}")


@pytest.mark.slow
def test_gpipe_keeps_more_in_flight_than_1f1b_on_real_ranks(measured_pipelines: dict) -> None:
    """The measured stage-0 peak is higher under GPipe (4 micro-batches in flight) than under
    1F1B (2), as the trace says."""
    gpipe, one_f1b = measured_pipelines["gpipe"][0]["peak"], measured_pipelines["1f1b"][0]["peak"]
    assert gpipe > one_f1b
    ratio = gpipe / one_f1b
    traced = _per_rank(GLOO_CASES["gpipe"])[0].peak_bytes / _per_rank(
        GLOO_CASES["1f1b"])[0].peak_bytes
    assert abs(ratio - traced) < 0.01


# The 4-rank gloo checks (pp 4; pp 2 x FSDP2 2) are in test_parallel_combos.py, measured in its
# set of 4 ranks.


def test_interleaved_1f1b_traces_two_stages_per_rank() -> None:
    """ScheduleInterleaved1F1B: each rank holds stages rank and rank + pp (torchtitan's loop
    placement); rank 0 has the embedding, rank 1 the head."""
    case = dataclasses.replace(_case(2, "interleaved-1f1b"), recipe=Recipe(
        parallel=Parallel(gpus=2, pp=2, pp_schedule="interleaved-1f1b", microbatches=2)))
    first, second = _per_rank(case)
    assert first.peak_bytes > 0 and second.peak_bytes > 0
    assert first.breakdown[memfit.MemoryCategory.WEIGHTS] > 0


# -- activation checkpointing on a stage ----------------------------------------------------------


def _gpipe_steps(checkpointing: str | None) -> list[int]:
    """Stage 0's traced peak (CUDA target, H100) growth per extra GPipe micro-batch of 2 rows,
    from 3 to 5 micro-batches, with the model's blocks checkpointed as given."""
    peaks = []
    for m in (3, 4, 5):
        case = _checkpointed(_case(m, "gpipe"), checkpointing or "none")
        model, inputs = build(case)
        est = memfit.estimate(model, inputs, device="cuda", gpu="h100-80gb",
                              parallel=case.parallel)
        peaks.append(est.per_rank[0].peak_bytes)
    return [b - a for a, b in itertools.pairwise(peaks)]


def test_full_checkpointing_keeps_only_block_inputs_per_micro_batch_in_flight() -> None:
    """Pipeline stages with checkpointed blocks, traced for a CUDA target (the recompute runs
    inside the stage's backward: torch/distributed/pipelining/_backward.py: stage_backward calls
    torch.autograd.backward, which the trace runs with its CUDA routing and autocast modes kept,
    as in a real backward; without it the recompute took CPU kernels and torch/utils/
    checkpoint.py's check failed). Under GPipe every micro-batch's forward runs before any
    backward (ScheduleGPipe._step_microbatches), so each extra micro-batch adds what one forward
    through stage 0 (embedding + blocks 0-1) leaves for its backward. With full checkpointing a
    block keeps only its inputs (non-reentrant checkpoint: torch/utils/checkpoint.py:
    _checkpoint_without_reentrant_generator keeps the function's arguments for the recompute):
    the hidden states entering block 0 and block 1 and the stage's output (the forward cache,
    stage.py: forward_one_chunk), 3 x 2 x 64 x 64 fp32 = 98,304 bytes, and the RoPE cos and sin
    tables passed to every block, 2 x 64 x 16 fp32 = 8,192 bytes (the CPU RNG state checkpoint
    saves is host memory on a GPU); plus, as without checkpointing, the micro-batch's rows of
    input_ids and labels (2 x 2 x 64 x 8 = 2,048) and its gradient receive buffer (32,768).
    Selective checkpointing also keeps every matmul and attention output of each block
    (memfit.techniques.block_profile.SAVE_OPS): q, k, v and o projections 4 x 32,768, gate and up
    2 x 2 x 64 x 128 fp32 = 2 x 65,536, down 32,768; memory-efficient attention (fp32: aten/src/
    ATen/native/transformers/cuda/sdp_utils.cpp: use_flash_attention's check_tensor_dtype takes
    fp16/bf16 only) its output 32,768, float32 logsumexp [2, 4, 64] = 2,048 and its RNG seed
    and offset, 8 bytes each in one 512-byte block (c10/cuda/CUDACachingAllocator.cpp:
    kMinBlockSize): 330,752 per block.
    Every size is a multiple of 512, so the CUDA allocator's rounding adds nothing."""
    hidden = 2 * SEQ * HIDDEN * 4
    rows, recv_buffer, rope = 2 * 2 * SEQ * 8, hidden, 2 * SEQ * 16 * 4
    full = rows + recv_buffer + 3 * hidden + rope
    assert _gpipe_steps("full") == [full, full]
    per_block = 4 * hidden + 2 * (2 * SEQ * 128 * 4) + hidden + hidden + 2 * 4 * SEQ * 4 + 2 * 512
    selective = full + 2 * per_block
    assert _gpipe_steps("selective") == [selective, selective]
    assert _gpipe_steps(None)[0] > selective  # without checkpointing: every activation


def test_the_first_pipeline_trace_of_a_process_equals_the_later_ones() -> None:
    """torch/distributed/pipelining/microbatch.py makes a tensor when first imported (module
    level: sum_reducer = _LossReducer(torch.tensor(0.0), operator.add)); imported inside the
    first trace it was traced as a 512-byte CUDA allocation at step 0 (and a fake tensor left in
    torch's module). A fresh process traces the same pipeline twice: same peaks, and torch's
    constant is a real tensor."""
    import subprocess
    import sys

    code = (
        "import memfit\n"
        "from torch._subclasses.fake_tensor import FakeTensor\n"
        "from memfit.parallel import Parallel\n"
        "from memfit.parallel.measure import Case, build, tiny_spec\n"
        "layout = Parallel(gpus=2, pp=2, pp_schedule='gpipe', microbatches=3)\n"
        "case = Case(spec=tiny_spec(4), batch=6, seq=64, recipe=memfit.Recipe(parallel=layout))\n"
        "for _ in range(2):\n"
        "    model, inputs = build(case)\n"
        "    est = memfit.estimate(model, inputs, device='cuda', gpu='h100-80gb',\n"
        "                          parallel=case.parallel)\n"
        "    print([e.peak_bytes for e in est.per_rank])\n"
        "from torch.distributed.pipelining import microbatch\n"
        "print(isinstance(microbatch.sum_reducer.init_value, FakeTensor))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=600).stdout.splitlines()
    assert out[0] == out[1], out
    assert out[2] == "False"


GLOO_CHECKPOINTED = [_checkpointed(_case(4, "1f1b"), "full"),
                     _checkpointed(_case(4, "gpipe"), "selective")]


@pytest.mark.slow
def test_checkpointed_stages_match_a_real_gloo_run_within_1_percent(measured_two: list) -> None:
    """Activation checkpointing of every block (memfit.techniques.checkpointing, applied by
    measure.build in both runs), 4 layers on 2 stages, 4 micro-batches of 2 rows: full under
    1F1B, selective under GPipe. Per stage the trace's peak is within 1% of the real gloo rank's,
    whose stage backward recomputes each block (torch/utils/checkpoint.py, non-reentrant)."""
    for case, measured in zip(GLOO_CHECKPOINTED, measured_two[2 * len(GLOO_CASES):],
                              strict=True):
        for est in _per_rank(case):
            real = measured[est.ranks[0]]["peak"]
            assert abs(est.peak_bytes - real) <= 0.01 * real, (
                f"{case.recipe.checkpointing} {case.parallel.pp_schedule} stage {est.ranks}: "
                f"predicted {est.peak_bytes:,}, measured {real:,}")
