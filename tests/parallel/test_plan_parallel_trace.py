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
    independent `memfit.estimate(..., precision="fp32", parallel=memfit.Parallel(gpus=2, fsdp=2,
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
    assert data["run"]["parallel"]["gpus"] == 2 and data["run"]["parallel"]["zero"] == 3

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
    numbers as `memfit.estimate(...,
                                parallel=memfit.Parallel(gpus=2))`; full checkpointing is applied
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
                       memfit.RunConfig(parallel=memfit.Parallel(gpus=2, zero=3), batch=BATCH,
                                        seq=SEQ),
                       memfit.get_gpu("h100-80gb"))
    assert data["per_gpu"]["total_bytes"] == want.total_bytes
    assert data["engine"] == "zero-paper"


@pytest.mark.parametrize(("argv", "says"), [
    (("--engine", "deepspeed", "--zero", "3"), "DeepSpeed's memory layout comes from the formulas"),
    (("--engine", "megatron", "--zero", "1"), "Megatron-LM's memory layout"),
    (("--zero", "3", "--offload-optimizer"), "ZeRO-Offload"),
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
    (("--gpus", "2", "--ep", "2"), "needs a mixture-of-experts model"),  # a dense Llama
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
    """The line the plan prints when formulas and trace are more than 5% apart: both peaks and
    the categories that differ by over 1% of the trace's live bytes. The formulas'
    unsharded-gradient buffer in a block's backward (Note: [FSDP2 buffers by moment] in
    memfit/analytic/engine_buffers.py: the block's, q 64x64 + k 64x32 + v 64x32 + o 64x64 +
    gate/up/down 3 x 64x128 + two norms of 64 = 36,992 parameters, bf16 gradients + fp32
    reduce-scatter input = 6 bytes each; and the root's bf16 gradients made before the blocks'
    backward, unsharded until the end of backward: untied head 96x64 + final norm 64; the
    untied embedding's gradient comes after the blocks) is no longer named as a
    gap (stand-in traces: 1 MiB fewer temporaries than the plan; 16 MiB more activations, of
    about 760 MiB with the runtime)."""
    from types import SimpleNamespace

    import memfit
    from memfit.analytic.traced import disagreement_reason
    from memfit.units import format_bytes

    spec = memfit.resolve_model(tiny_llama(tmp_path))
    analytic = memfit.plan(spec, memfit.RunConfig(parallel=memfit.Parallel(gpus=8, zero=3),
                                                  engine="fsdp2", batch=BATCH, seq=SEQ))
    unsharded = 36_992 * 6 + (VOCAB * H + H) * 2
    assert analytic.engine_buffers["unsharded gradients"] == unsharded

    def stand_in(category: MemoryCategory, change: int) -> SimpleNamespace:
        trace = dict(analytic.breakdown)
        trace[category] += change
        return SimpleNamespace(breakdown=trace, total_bytes=sum(trace.values()), peak_bytes=0,
                               peak_reserved_bytes=0, peak_op="aten.mm.default",
                               peak_module="model.layers.1.mlp", peak_phase="backward")

    why = disagreement_reason(analytic, stand_in(MemoryCategory.TEMPORARIES, -2**20))
    assert "unsharded" not in why  # counted by moment now, no longer a known gap
    assert "trace at aten.mm.default in model.layers.1.mlp (backward)" in why
    assert "plan - trace" not in why and "\n" not in why  # 1 MiB: under 1% of the live bytes
    why = disagreement_reason(analytic, stand_in(MemoryCategory.ACTIVATIONS, 2**24))
    assert "unsharded" not in why  # the plan is under the trace: not that gap
    assert why.endswith(f"plan - trace: activations -{format_bytes(2**24)}")


def test_disagreement_reason_names_an_untied_root(tmp_path) -> None:
    """With untied embeddings the root fully_shard unit gathers the embedding and the head together
    (FSDPParamGroup.unshard: one foreach_all_gather over the group's parameters): vocab 4096 x
    hidden 64 twice + the final norm's 64 = 524,352 parameters, against a block's 36,992. The
    formulas now count that whole root (memfit/analytic/engine_buffers.py: fsdp_root_params), so the
    plan no longer gives the old reason that they gather only the largest of a block, the embedding
    and the head (a stand-in trace with 16 MiB more temporaries)."""
    from types import SimpleNamespace

    import memfit
    from memfit.analytic.engine_buffers import fsdp_root_params, fsdp_unit_params
    from memfit.analytic.traced import disagreement_reason

    cfg = json.loads(open(tiny_llama(tmp_path)).read()) | {"vocab_size": 4096}
    path = tmp_path / "big_vocab.json"
    path.write_text(json.dumps(cfg))
    spec = memfit.resolve_model(str(path))
    run = memfit.RunConfig(parallel=memfit.Parallel(gpus=8, zero=3), engine="fsdp2", batch=BATCH,
                           seq=SEQ)
    assert fsdp_root_params(spec, run) == fsdp_unit_params(spec, run) == 524_352
    analytic = memfit.plan(spec, run)
    trace = dict(analytic.breakdown)
    trace[MemoryCategory.TEMPORARIES] += 2**24
    est = SimpleNamespace(breakdown=trace, total_bytes=sum(trace.values()), peak_bytes=0,
                          peak_reserved_bytes=0, peak_op="aten.view.default", peak_module="model",
                          peak_phase="forward")
    why = disagreement_reason(analytic, est)
    assert "gathers the embeddings and the head together" not in why
    assert "trace at aten.view.default in model (forward)" in why


# -- layouts traced on memfit's builtin decoders: pipeline, sequence, loss and expert parallelism

@pytest.fixture(scope="module")
def pipeline_warmed(tmp_path_factory) -> None:
    """One pipeline trace before the compared ones: the first pipeline trace in a process
    holds one 512-byte tensor more (an ``aten.lift_fresh.default`` at step 0 that later traces
    do not see; a known issue of the pipeline trace, reported), so the CLI's trace and the
    independent one are both later traces and must agree to the byte."""
    path = tiny_llama(tmp_path_factory.mktemp("warm"))
    import memfit

    builtin_estimate(memfit.resolve_model(path), memfit.Parallel(gpus=2, pp=2), batch=2)


def builtin_estimate(spec, parallel, *, batch: int, precision: str = "bf16-mixed",
                     backend: str = "builtin"):
    """``memfit.estimate`` of ``build_model(spec, backend=backend)`` (SDPA), two AdamW steps
    on an H100 target, each rank role of ``parallel``."""
    import memfit
    from memfit.models.build import build_model, example_inputs

    model = build_model(spec, backend=backend, device="meta", attn_implementation="sdpa")
    inputs = example_inputs(spec, batch=batch, seq=SEQ, device="meta")
    return memfit.estimate(model, inputs, optimizer="adamw", precision=precision,
                           device="cuda", gpu="h100-80gb", steps=2, parallel=parallel)


def test_builtin_build_counts_the_hugging_face_parameters() -> None:
    """The builtin decoder the plan traces pipelines on is the same model as the Hugging Face
    build: GPT-2 has 124,439,808 parameters (wte 50257 x 768 + wpe 1024 x 768 + 12 blocks of
    7,087,872 + the final LayerNorm's 1,536; the head is tied), Qwen3-0.6B 596,049,920 (tied
    head: 151936 x 1024 embedding + 28 blocks + final norm), each backend's module counted."""
    import memfit
    from memfit.models.build import build_model

    gpt2_block = 768 * 2304 + 2304 + 768 * 768 + 768 + 2 * 768 * 3072 + 3072 + 768 + 4 * 768
    assert 50257 * 768 + 1024 * 768 + 12 * gpt2_block + 1536 == 124_439_808
    for name, params in (("gpt2", 124_439_808), ("qwen3-0.6b", 596_049_920)):
        spec = memfit.resolve_model(name)
        for backend in ("builtin", "transformers"):
            model = build_model(spec, backend=backend, device="meta")
            assert sum(p.numel() for p in model.parameters()) == params, (name, backend)


def test_pp_on_a_preset_is_traced_on_the_builtin_decoder(capsys, pipeline_warmed) -> None:
    """`plan gpt2 --gpus 2 --pp 2` traces each stage of memfit's builtin GPT-2 (Hugging Face's
    module is not split by memfit's pipeline) and says so in one line: the numbers equal an
    independent `memfit.estimate(build_model(spec, backend="builtin"), ...,
    parallel=memfit.Parallel(gpus=2, pp=2))` under autocast (no FSDP), stage 0 on rank 0, stage 1 on
    rank 1 (the (pp, dp) mesh). `--batch 1` is the micro-batch: the step runs pp = 2 of them
    (Parallel's default micro-batches), so the independent call gets 2 rows."""
    import memfit

    code, out, err = run(capsys, "plan", "gpt2", "--gpus", "2", "--pp", "2", "--gpu",
                         "h100-80gb", "--batch", "1", "--seq", str(SEQ), "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["method"] == "trace" and data["model"]["backend"] == "builtin"
    assert data["parallel"]["pp"] == 2 and data["parallel"]["pp_schedule"] == "1f1b"
    assert data["parallel"]["microbatches"] == 2
    assert [r["stages"] for r in data["per_rank"]] == [[0], [1]]
    assert any("memfit's builtin gpt2 decoder" in n and "--pp 2" in n for n in data["notes"])
    est = builtin_estimate(memfit.resolve_model("gpt2"), memfit.Parallel(gpus=2, pp=2), batch=2)
    assert_same_roles(data, est)
    # The formulas beside it count the same two micro-batches in flight (--grad-accum's).
    assert data["analytic"] is not None and data["analytic"]["engine"] == "ddp"


def test_pp_schedule_and_microbatches(capsys, tmp_path, pipeline_warmed) -> None:
    """`--pp-schedule gpipe --microbatches 4 --batch 1` is `Parallel(gpus=2, pp=2,
    pp_schedule="gpipe", microbatches=4)` on 4 rows (4 micro-batches of 1); without
    `--microbatches`, `--grad-accum 3` gives the micro-batches (3 rows). A Llama config.json
    is traced on transformers' own LlamaForCausalLM, split into stages
    (memfit/parallel/hf_pipeline.py)."""
    import memfit

    path = tiny_llama(tmp_path)
    spec = memfit.resolve_model(path)
    common = ("--gpu", "h100-80gb", "--batch", "1", "--seq", str(SEQ), "--json")
    code, out, err = run(capsys, "plan", path, "--gpus", "2", "--pp", "2", "--pp-schedule",
                         "gpipe", "--microbatches", "4", *common)
    assert code == 0, err
    assert json.loads(out)["model"]["backend"] == "transformers"
    assert_same_roles(json.loads(out), builtin_estimate(
        spec, memfit.Parallel(gpus=2, pp=2, pp_schedule="gpipe", microbatches=4), batch=4,
        backend="transformers"))
    code, out, err = run(capsys, "plan", path, "--gpus", "2", "--pp", "2", "--grad-accum",
                         "3", *common)
    assert code == 0, err
    data = json.loads(out)
    assert data["parallel"]["microbatches"] == 3
    assert_same_roles(data, builtin_estimate(
        spec, memfit.Parallel(gpus=2, pp=2, microbatches=3), batch=3, backend="transformers"))


def tiny_moe(tmp_path) -> str:
    """The tiny Llama as a Mixtral: 4 experts, top 2 (memfit's builtin MoE layers)."""
    cfg = json.loads(open(tiny_llama(tmp_path)).read()) | {
        "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}
    path = tmp_path / "moe.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_ep_is_traced(capsys, tmp_path) -> None:
    """`--gpus 2 --ep 2` on a Mixtral config.json: DDP over the 2 ranks with 2 experts each
    of transformers' MixtralExperts (memfit/parallel/hf_expert.py), the same numbers as
    `Parallel(gpus=2, ep=2)` on the transformers build under autocast; `--gpus 4 --ep 2 --fsdp`
    is FSDP2 over the 4 ranks beside it, under autocast (expert parallelism refuses FSDP2's
    MixedPrecisionPolicy). No formulas beside them: they do not model expert parallelism."""
    import memfit

    path = tiny_moe(tmp_path)
    spec = memfit.resolve_model(path)
    code, out, err = run(capsys, "plan", path, "--gpus", "2", "--ep", "2", *COMMON, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["parallel"]["ep"] == 2 and data["model"]["backend"] == "transformers"
    assert data["analytic"] is None
    assert_same_roles(data, builtin_estimate(spec, memfit.Parallel(gpus=2, ep=2),
                                             batch=BATCH, backend="transformers"))
    code, out, err = run(capsys, "plan", path, "--gpus", "4", "--ep", "2", "--fsdp", *COMMON,
                         "--json")
    assert code == 0, err
    assert_same_roles(json.loads(out), builtin_estimate(
        spec, memfit.Parallel(gpus=4, ep=2, zero=3), batch=BATCH, backend="transformers"))


def test_tp_fsdp_sp_loss_parallel_is_the_2d_trace(capsys, tmp_path) -> None:
    """`--gpus 4 --tp 2 --fsdp --sp --loss-parallel`: FSDP2 over 2 data-parallel ranks x tp 2
    on a 2-D mesh, sequence and loss parallel, on transformers' LlamaForCausalLM (hf_pipeline:
    the attention's keyword input all-gathered, the whole sequence's positions) (precision fp32 with
    MixedPrecisionPolicy(bf16, fp32), as the module's docstring says); the text says which
    backend built it."""
    import memfit

    path = tiny_llama(tmp_path)
    argv = ("plan", path, "--gpus", "4", "--tp", "2", "--fsdp", "--sp", "--loss-parallel",
            *COMMON)
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["parallel"]["sp"] is True and data["parallel"]["loss_parallel"] is True
    assert data["parallel"]["fsdp"] == 2 and data["parallel"]["tp"] == 2
    assert_same_roles(data, builtin_estimate(
        memfit.resolve_model(path),
        memfit.Parallel(gpus=4, tp=2, fsdp=2, sp=True, loss_parallel=True, param_dtype="bf16",
                        reduce_dtype="fp32"), batch=BATCH, precision="fp32",
        backend="transformers"))
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    assert "memfit's builtin llama decoder" not in out and "sequence parallel" in out


def test_pp_on_a_family_the_builtin_backend_cannot_build_falls_back(capsys, tmp_path) -> None:
    """GPT-NeoX's parallel attention + MLP block has no builtin decoder: `--pp 2` falls back to
    the formulas (which model 1F1B) with the build's one-line reason."""
    cfg = {"model_type": "gpt_neox", "hidden_size": H, "num_hidden_layers": LAYERS,
           "num_attention_heads": HEADS, "intermediate_size": FFN, "vocab_size": VOCAB,
           "max_position_embeddings": 256, "rotary_pct": 0.25}
    path = tmp_path / "neox.json"
    path.write_text(json.dumps(cfg))
    code, out, err = run(capsys, "plan", str(path), "--gpus", "2", "--pp", "2", *COMMON,
                         "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["method"] == "analytic"
    assert "builtin backend has no parallel attention + MLP block" in data["notes"][0]
    assert "\n" not in data["notes"][0]
    # Options only the trace models make that refusal an error.
    code, _, err = run(capsys, "plan", str(path), "--gpus", "2", "--pp", "2",
                       "--pp-schedule", "gpipe", *COMMON)
    assert code == 2 and "--pp-schedule gpipe over 2 GPUs" in err
    assert len([line for line in err.splitlines() if line.strip()]) == 1


@pytest.mark.parametrize(("argv", "needle"), [
    (("--gpus", "2", "--sp"), "Parallel(sp=True, tp=1)"),
    (("--gpus", "2", "--loss-parallel"), "Parallel(loss_parallel=True, tp=1)"),
    (("--gpus", "2", "--microbatches", "2"), "--microbatches 2 does nothing"),
    (("--gpus", "2", "--pp-schedule", "gpipe"), "--pp-schedule gpipe does nothing"),
    (("--gpus", "2", "--pp", "2", "--pp-schedule", "1fb1"), "did you mean '1f1b'"),
    (("--gpus", "2", "--pp", "2", "--microbatches", "0"), "--microbatches must be"),
    (("--gpus", "2", "--ep", "3"), "ep=3 does not divide the 2 data-parallel ranks"),
    (("--gpus", "2", "--ep", "2", "--method", "analytic"), "the formulas do not model"),
    (("--gpus", "2", "--loss-parallel", "--tp", "2", "--method", "analytic"),
     "--loss-parallel: the formulas do not model"),
])
def test_bad_parallel_flags_are_one_line_exit_2(capsys, tmp_path, argv, needle) -> None:
    """Bad combinations of the layout flags: Parallel's own checks (sp / loss parallel need tp,
    the schedule's name, ep divides the data-parallel ranks), pipeline flags without --pp, and
    trace-only flags under --method analytic: exit 2, one line."""
    code, _, err = run(capsys, "plan", tiny_moe(tmp_path), *argv, *COMMON)
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert needle in lines[0]


def test_pp_beside_zero1_and_loss_parallel_is_traced(capsys, tmp_path, pipeline_warmed) -> None:
    """`--gpus 4 --pp 2 --zero 1`: DDP on each stage with ZeroRedundancyOptimizer over its 2
    data-parallel ranks (memfit/parallel/pipeline_parallelize.py: replicate_stages), one role per
    rank, the same numbers as `Parallel(gpus=4, pp=2, zero=1)` on the builtin build; `--gpus 4
    --pp 2 --tp 2 --loss-parallel`: the last stage's logits split by vocabulary. Both on the
    transformers module (a Llama). Both used to fall back to the formulas ("the trace refused
    it")."""
    import memfit

    path = tiny_llama(tmp_path)
    spec = memfit.resolve_model(path)
    common = ("--gpu", "h100-80gb", "--batch", "1", "--seq", str(SEQ), "--json")
    code, out, err = run(capsys, "plan", path, "--gpus", "4", "--pp", "2", "--zero", "1",
                         *common)
    assert code == 0, err
    data = json.loads(out)
    assert data["method"] == "trace" and data["parallel"]["strategy"] == "zero1"
    assert data["model"]["backend"] == "transformers"  # a Llama: its own module's stages
    assert_same_roles(data, builtin_estimate(spec, memfit.Parallel(gpus=4, pp=2, zero=1),
                                             batch=2, backend="transformers"))
    code, out, err = run(capsys, "plan", path, "--gpus", "4", "--pp", "2", "--tp", "2",
                         "--loss-parallel", *common)
    assert code == 0, err
    data = json.loads(out)
    assert data["method"] == "trace" and data["parallel"]["loss_parallel"] is True
    assert data["model"]["backend"] == "transformers"
    assert_same_roles(data, builtin_estimate(
        spec, memfit.Parallel(gpus=4, pp=2, tp=2, loss_parallel=True), batch=2,
        backend="transformers"))


def test_fsdp2_cpu_offload_is_traced_with_host_bytes_apart(capsys, tmp_path) -> None:
    """`--engine fsdp2 --offload-params --gpus 2`: FSDP2 with CPUOffloadPolicy, traced (it used
    to fall back to the formulas): the device's numbers equal an independent
    `memfit.estimate(..., parallel=Parallel(gpus=2, fsdp=2, cpu_offload=True, ...))` of the
    same model, the host's are reported apart (`host_peak_bytes`), and the formulas beside it
    (fsdp2 with offload: parameters, gradients and states on the host) agree within 5%."""
    import memfit

    path = tiny_llama(tmp_path)
    code, out, err = run(capsys, "plan", path, "--gpus", "2", "--engine", "fsdp2",
                         "--offload-params", *COMMON, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["method"] == "trace" and "cpu offload" in data["parallel"]["describe"]
    est = independent_estimate(path, memfit.Parallel(gpus=2, fsdp=2, cpu_offload=True,
                                                     param_dtype="bf16", reduce_dtype="fp32"),
                               precision="fp32")
    assert_same_roles(data, est)
    assert data["per_rank"][0]["host_peak_bytes"] == est.per_rank[0].host_peak_bytes > 0
    assert data["analytic"]["agrees"] is True
