"""``memfit plan --gpus N``: the per-rank trace by default (cli/parallel_plan.py), the formulas
under ``--method analytic`` / ``--params`` / ``--engine deepspeed``, and one-line errors.

The expected per-rank numbers come from an independent call of ``memfit.estimate(...,
parallel=memfit.Parallel(...))`` on the same model, with the layout written out here as PyTorch
runs it, not through the CLI's own mapping: bf16-mixed under FSDP2 is fp32 parameters with
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` and no autocast, as torchtitan runs
it (``torchtitan/distributed/utils.py: maybe_enable_amp``: "FSDP handles mixed precision
internally", a ``nullcontext``); DDP runs under autocast.
"""

from __future__ import annotations

import json

import pytest

from memfit.categories import MemoryCategory
from memfit.cli import main

# A tiny Llama: 2 layers, hidden 64, 4 heads (2 KV heads), MLP 128, vocab 96 (not a multiple of
# 64: FSDP's chunks of the embedding differ across 8 ranks, not across 2).
H, LAYERS, HEADS, KV_HEADS, FFN, VOCAB = 64, 2, 4, 2, 128, 96
BATCH, SEQ = 2, 32


def tiny_llama(tmp_path) -> str:
    cfg = {"model_type": "llama", "hidden_size": H, "num_hidden_layers": LAYERS,
           "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
           "intermediate_size": FFN, "vocab_size": VOCAB, "max_position_embeddings": 256,
           "tie_word_embeddings": False}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def independent_estimate(path: str, parallel, *, checkpointing: str = "none",
                         precision: str = "bf16-mixed"):
    """``memfit.estimate`` of the model the config builds (memfit's builder, SDPA), two AdamW
    steps on an H100 target, each rank role of ``parallel``."""
    import torch

    import memfit
    from memfit.models.build import build_model, example_inputs

    spec = memfit.resolve_model(path)
    with torch.device("meta"):
        model = build_model(spec, device="meta", attn_implementation="sdpa")
    if checkpointing != "none":
        from memfit.techniques.checkpointing import apply_activation_checkpointing

        apply_activation_checkpointing(model, policy=checkpointing)
    inputs = example_inputs(spec, batch=BATCH, seq=SEQ, device="meta")
    return memfit.estimate(model, inputs, optimizer="adamw", precision=precision,
                           device="cuda", gpu="h100-80gb", steps=2, parallel=parallel)


def assert_same_roles(data: dict, est) -> None:
    roles = data["per_rank"]
    assert [r["ranks"] for r in roles] == [list(e.ranks) for e in est.per_rank]
    for got, want in zip(roles, est.per_rank, strict=True):
        assert got["total_bytes"] == want.total_bytes
        assert got["peak_bytes"] == want.peak_bytes
        assert got["peak_reserved_bytes"] == want.peak_reserved_bytes
        assert got["breakdown"] == {c.value: int(want.breakdown.get(c, 0))
                                    for c in MemoryCategory}
    assert data["per_gpu"]["total_bytes"] == est.total_bytes


COMMON = ("--gpu", "h100-80gb", "--batch", str(BATCH), "--seq", str(SEQ))


def test_fsdp_plan_traces_each_rank_by_default(capsys, tmp_path) -> None:
    """`plan --gpus 2 --fsdp` (bf16-mixed) reports the per-rank trace's numbers, equal to an
    independent `memfit.estimate(..., precision="fp32", parallel=Parallel(gpus=2, fsdp=2,
    param_dtype="bf16", reduce_dtype="fp32"))` (torchtitan's FSDP2 mixed precision: see the
    module's docstring), and says which method and engine produced them."""
    import memfit

    path = tiny_llama(tmp_path)
    code, out, err = run(capsys, "plan", path, "--gpus", "2", "--fsdp", *COMMON, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["method"] == "trace" and data["engine"] == "fsdp2"
    assert data["parallel"]["strategy"] == "fsdp" and data["parallel"]["fsdp"] == 2
    est = independent_estimate(path, memfit.Parallel(gpus=2, fsdp=2, param_dtype="bf16",
                                                     reduce_dtype="fp32"), precision="fp32")
    assert_same_roles(data, est)
    # The analytic plan of the same engine rides along, with its distance from the trace.
    assert data["analytic"]["engine"] == "fsdp2"
    live = est.total_bytes - (est.peak_reserved_bytes - est.peak_bytes)
    assert data["analytic"]["trace_live_bytes"] == live
    assert data["analytic"]["error"] == pytest.approx(data["analytic"]["total_bytes"] / live - 1)
    assert data["analytic"]["agrees"] == (abs(data["analytic"]["error"]) <= 0.05)
    assert data["analytic"]["agrees"] or data["analytic"]["why"]
    # The run object an export reads.
    assert data["run"]["gpus"] == 2 and data["run"]["zero"] == 3

    code, out, err = run(capsys, "plan", path, "--gpus", "2", "--fsdp", *COMMON)
    assert code == 0, err
    assert "method: per-rank trace" in out and "PyTorch FSDP2 fully_shard" in out
    assert "no autocast" in out
    assert "formulas (PyTorch FSDP2)" in out


def test_fsdp_n_is_hsdp(capsys, tmp_path) -> None:
    """`--gpus 4 --fsdp 2` shards over 2 ranks and replicates across the other 2 (HSDP on a
    2-D mesh): the same numbers as `Parallel(gpus=4, fsdp=2, ...)`; no formulas beside it
    (they shard over every data-parallel rank), and `--method analytic` refuses it."""
    import memfit

    path = tiny_llama(tmp_path)
    code, out, err = run(capsys, "plan", path, "--gpus", "4", "--fsdp", "2", *COMMON, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["parallel"]["strategy"] == "hsdp" and data["analytic"] is None
    assert_same_roles(data, independent_estimate(
        path, memfit.Parallel(gpus=4, fsdp=2, param_dtype="bf16", reduce_dtype="fp32"),
        precision="fp32"))
    code, _, err = run(capsys, "plan", path, "--gpus", "4", "--fsdp", "2", *COMMON,
                       "--method", "analytic")
    assert code == 2 and "HSDP" in err and "\n" not in err.strip()


def test_ddp_plan_traces_under_autocast(capsys, tmp_path) -> None:
    """`--gpus 2` without sharding is DDP (its gradient buckets) under autocast: the same
    numbers as `memfit.estimate(..., parallel=Parallel(gpus=2))`; full checkpointing is applied
    before the layout, as the single-GPU trace applies it."""
    import memfit

    path = tiny_llama(tmp_path)
    code, out, err = run(capsys, "plan", path, "--gpus", "2", "--checkpointing", "full",
                         *COMMON, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["method"] == "trace" and data["parallel"]["strategy"] == "ddp"
    assert_same_roles(data, independent_estimate(path, memfit.Parallel(gpus=2),
                                                 checkpointing="full"))
    assert data["analytic"]["engine"] == "ddp"


def test_method_analytic_gives_the_formulas(capsys, tmp_path) -> None:
    """`--method analytic` is `memfit.plan` with the same RunConfig: no per-rank trace."""
    import memfit

    path = tiny_llama(tmp_path)
    code, out, err = run(capsys, "plan", path, "--gpus", "2", "--fsdp", *COMMON,
                         "--method", "analytic", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert "per_rank" not in data
    want = memfit.plan(memfit.resolve_model(path),
                       memfit.RunConfig(gpus=2, zero=3, batch=BATCH, seq=SEQ),
                       memfit.get_gpu("h100-80gb"))
    assert data["per_gpu"]["total_bytes"] == want.total_bytes
    assert data["engine"] == "zero-paper"


@pytest.mark.parametrize(("argv", "says"), [
    (("--engine", "deepspeed", "--zero", "3"), "DeepSpeed's memory layout comes from the formulas"),
    (("--engine", "megatron", "--zero", "1"), "Megatron-LM's memory layout"),
    (("--zero", "3", "--offload-optimizer"), "ZeRO-Offload"),
    (("--engine", "fsdp2", "--offload-params"), "CPUOffloadPolicy"),
    (("--checkpointing", "selective-attn"), "analytic variant"),
    (("--mode", "inference"), "replicas"),
])
def test_formulas_where_the_trace_does_not_run(capsys, tmp_path, argv, says) -> None:
    """Engines other than PyTorch's, and layouts the trace refuses, fall back to the formulas
    with one line saying why (in the table's header and in --json's notes)."""
    path = tiny_llama(tmp_path)
    code, out, err = run(capsys, "plan", path, "--gpus", "2", *argv, *COMMON, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["method"] == "analytic" and "per_rank" not in data
    assert data["notes"][0].startswith("method: the formulas, not the per-rank trace")
    assert says in data["notes"][0] and "\n" not in data["notes"][0]
    code, out, err = run(capsys, "plan", path, "--gpus", "2", *argv, *COMMON)
    assert code == 0, err
    assert "method: the formulas, not the per-rank trace" in out


def test_params_stays_on_the_formulas(capsys) -> None:
    code, out, err = run(capsys, "plan", "--params", "7e9", "--gpus", "8", "--zero", "3",
                         "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["method"] == "analytic" and "no architecture to trace" in data["notes"][0]


@pytest.mark.parametrize(("argv", "needle"), [
    (("--tp", "3", "--gpus", "3"), "does not divide"),  # 4 heads
    (("--pp", "4", "--gpus", "4"), "layers"),  # 2 layers
    (("--gpus", "2", "--ep", "2"), "--ep 2"),  # the trace does not split experts yet
    (("--gpus", "2", "--method", "trace", "--engine", "deepspeed", "--zero", "3"),
     "--method trace over 2 GPUs"),
])
def test_bad_layout_is_one_line_exit_2(capsys, tmp_path, argv, needle) -> None:
    path = tiny_llama(tmp_path)
    code, _, err = run(capsys, "plan", path, *argv, *COMMON)
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert needle in lines[0]


def test_disagreement_reason_names_the_gap_and_the_categories(tmp_path) -> None:
    """The line the plan prints when formulas and trace are more than 5% apart: the formulas'
    unsharded-gradient buffer of the largest fully_shard unit (here a block of the tiny Llama:
    q 64x64 + k 64x32 + v 64x32 + o 64x64 + gate/up/down 3 x 64x128 + two norms of 64 = 36,992
    parameters, bf16 gradients + fp32 reduce-scatter input = 6 bytes each), both peaks, and the
    categories that differ by over 1% of the trace's live bytes (stand-in traces: 1 MiB fewer
    temporaries than the plan; 16 MiB more activations, of about 760 MiB with the runtime)."""
    from types import SimpleNamespace

    import memfit
    from memfit.cli.parallel_plan import disagreement_reason
    from memfit.units import format_bytes

    spec = memfit.resolve_model(tiny_llama(tmp_path))
    analytic = memfit.plan(spec, memfit.RunConfig(gpus=8, zero=3, engine="fsdp2", batch=BATCH,
                                                  seq=SEQ))
    assert analytic.engine_buffers["unsharded gradients"] == 36_992 * 6

    def stand_in(category: MemoryCategory, change: int) -> SimpleNamespace:
        trace = dict(analytic.breakdown)
        trace[category] += change
        return SimpleNamespace(breakdown=trace, total_bytes=sum(trace.values()), peak_bytes=0,
                               peak_reserved_bytes=0, peak_op="aten.mm.default",
                               peak_module="model.layers.1.mlp", peak_phase="backward")

    why = disagreement_reason(analytic, stand_in(MemoryCategory.TEMPORARIES, -2**20))
    assert f"unsharded gradients and their reduce-scatter copy ({format_bytes(36_992 * 6)})" in why
    assert "trace at aten.mm.default in model.layers.1.mlp (backward)" in why
    assert "plan - trace" not in why and "\n" not in why  # 1 MiB: under 1% of the live bytes
    why = disagreement_reason(analytic, stand_in(MemoryCategory.ACTIVATIONS, 2**24))
    assert "unsharded" not in why  # the plan is under the trace: not that gap
    assert why.endswith(f"plan - trace: activations -{format_bytes(2**24)}")


def test_disagreement_reason_names_an_untied_root(tmp_path) -> None:
    """With untied embeddings the root fully_shard unit gathers the embedding and the head
    together: vocab 4096 x hidden 64 twice + the final norm's 64 = 524,352 parameters, against
    a block's 36,992 (the largest unit the formulas gather); said when the trace is above the
    plan (a stand-in trace with 16 MiB more temporaries)."""
    from types import SimpleNamespace

    import memfit
    from memfit.analytic.table import format_params
    from memfit.cli.parallel_plan import disagreement_reason

    cfg = json.loads(open(tiny_llama(tmp_path)).read()) | {"vocab_size": 4096}
    path = tmp_path / "big_vocab.json"
    path.write_text(json.dumps(cfg))
    spec = memfit.resolve_model(str(path))
    analytic = memfit.plan(spec, memfit.RunConfig(gpus=8, zero=3, engine="fsdp2", batch=BATCH,
                                                  seq=SEQ))
    trace = dict(analytic.breakdown)
    trace[MemoryCategory.TEMPORARIES] += 2**24
    est = SimpleNamespace(breakdown=trace, total_bytes=sum(trace.values()), peak_bytes=0,
                          peak_reserved_bytes=0, peak_op="aten.view.default", peak_module="model",
                          peak_phase="forward")
    why = disagreement_reason(analytic, est)
    assert (f"gathers the embeddings and the head together ({format_params(524_352)} "
            f"parameters)") in why
    assert f"({format_params(4096 * 64)})" in why  # the embedding: the formulas' largest unit
