"""One memory table for both methods: ``print(plan)``, ``memfit plan`` and ``--method trace``
(same rows, the allocator's reserve on its own row, footnotes where the methods count a
category differently, suggestions for both)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from memfit.analytic.config import RunConfig
from memfit.analytic.planner import plan
from memfit.cli import main
from memfit.models.spec import ParamCountSpec
from memfit.parallel import Parallel
from memfit.units import format_bytes

# A small Llama: 4 layers, hidden 256, 8 heads (2 KV heads of 32), MLP 512, vocab 1000, untied.
H, KV, FFN, VOCAB, LAYERS = 256, 64, 512, 1000, 4
# Parameters by hand: embeddings and head (vocab x h each), per layer q/o (h x h), k/v (h x kv),
# three MLP matrices (h x ffn) and two RMSNorm weights (h), plus the final norm.
PSI = 2 * VOCAB * H + LAYERS * (2 * H * H + 2 * H * KV + 3 * H * FFN + 2 * H) + H


def small_llama(tmp_path) -> str:
    cfg = {"model_type": "llama", "hidden_size": H, "num_hidden_layers": LAYERS,
           "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": FFN,
           "vocab_size": VOCAB, "max_position_embeddings": 512, "tie_word_embeddings": False}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def rows(text: str) -> dict[str, list[str]]:
    """Table rows by their first cell (footnote marks dropped)."""
    found = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if cells:
            found[cells[0].split(" [")[0]] = cells[1:]
    return found


def test_print_plan_is_the_table_and_repr_is_short() -> None:
    # 1e9 parameters, bf16-mixed AdamW (ZeRO paper): 2 + 2 + 12 bytes per parameter.
    p = plan(ParamCountSpec(name="1B", params=10**9), RunConfig())
    text = str(p)
    table = rows(text)
    assert table["weights"][0] == format_bytes(2 * 10**9)
    assert table["gradients"][0] == format_bytes(2 * 10**9)
    assert table["optimizer_states"][0] == format_bytes(12 * 10**9)
    assert table["activations"][0] == "unknown"
    assert table["allocator reserve"][0] == "not modelled"
    assert "[1] not modelled here: the 19% fit margin" in text
    assert "no --gpu given" in text
    r = repr(p)
    assert r.startswith("<MemoryPlan 1B: train, bf16-mixed, adamw") and len(r) < 200
    assert "breakdown=" not in r


def test_plan_cli_prints_the_same_table_as_str(capsys) -> None:
    code, out, err = run(capsys, "plan", "--params", "1e9", "--gpu", "h100-80gb")
    assert code == 0, err
    from memfit.gpus import get_gpu

    p = plan(ParamCountSpec(name="1,000,000,000 parameters", params=10**9), RunConfig(),
             get_gpu("h100-80gb"))
    assert rows(out) == rows(str(p))


def test_trace_table_rows_footnotes_and_model_state_identity(capsys, tmp_path) -> None:
    """bf16-mixed AdamW, batch 2 x 128: the trace's peak is in the optimizer step, where every
    model state is live. The trace holds fp32 parameters (4 B/param) and fp32 gradients
    (4 B/param) as torch.autocast training does, plus AdamW's exp_avg and exp_avg_sq (8 B/param);
    the analytic plan counts 2 + 2 + 12 B/param (ZeRO paper). Both sum to 16 B/param."""
    path = small_llama(tmp_path)
    common = ("plan", path, "--method", "trace", "--gpu", "a100-40gb", "--batch", "2", "--seq",
              "128")
    code, out, err = run(capsys, *common, "--json")
    assert code == 0, err
    data = json.loads(out)
    b = data["per_gpu"]["breakdown"]
    assert data["peak"]["phase"] == "optimizer"
    # the reserve is its own number; the column sums to the total
    reserve = data["per_gpu"]["allocator_reserve_bytes"]
    assert reserve == data["peak_reserved_bytes"] - data["peak_bytes"]
    assert data["per_gpu"]["total_bytes"] == sum(b.values()) + reserve
    states = b["weights"] + b["gradients"] + b["optimizer_states"]
    tensors = 2 + LAYERS * 9 + 1  # parameters; each tensor's blocks round up to 512 bytes
    assert 16 * PSI <= states <= 16 * PSI + 4 * 512 * tensors
    assert 4 * PSI <= b["weights"] <= 4 * PSI + 512 * tensors  # fp32 parameters

    analytic = plan_of(path, RunConfig(batch=2, seq=128))
    assert (analytic.breakdown["weights"] + analytic.breakdown["gradients"]
            + analytic.breakdown["optimizer_states"]) == 16 * PSI
    assert analytic.breakdown["weights"] == 2 * PSI

    code, out, err = run(capsys, *common)
    assert code == 0, err
    table = rows(out)
    assert table["allocator reserve"] == [format_bytes(reserve), "not modelled"]
    assert table["weights"] == [format_bytes(b["weights"]), format_bytes(2 * PSI)]
    assert table["total"][0] == format_bytes(data["per_gpu"]["total_bytes"])
    assert "weights [2]" in out and "optimizer_states [2]" in out
    assert "fp32 parameters and fp32 gradients, as torch.autocast" in out
    assert f"trace {format_bytes(states)}, analytic {format_bytes(16 * PSI)}" in out.replace(
        "\n", " ")
    assert "fits with" in out  # the shared verdict (cli._common.print_fit_verdict)


def plan_of(path: str, run_config: RunConfig):
    from memfit.models import resolve_model

    return plan(resolve_model(path), run_config)


def test_trace_suggests_changes_when_it_does_not_fit(capsys, tmp_path) -> None:
    """On a GPU of 900 MiB the traced step (about 832 MiB, most of it the CUDA runtime) leaves
    less than the trace's 15% margin: the analytic suggestions come with it, their saving the
    analytic re-plan's and their new total the trace's total minus that saving."""
    path = small_llama(tmp_path)
    gpus = tmp_path / "gpus.json"
    gpus.write_text(json.dumps({"gpus": [{"name": "a100-sxm-40gb",
                                          "memory_bytes": 900 * 2**20}]}))
    common = ("plan", path, "--method", "trace", "--gpu", "a100-40gb", "--gpu-file", str(gpus),
              "--batch", "2", "--seq", "128")
    code, out, err = run(capsys, *common, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["fits"] is False and data["suggestions"]
    base = plan_of(path, RunConfig(batch=2, seq=128))
    flags = {"--checkpointing full": {"checkpointing": "full"},
             "--offload-optimizer": {"offload_optimizer": True},
             "--optimizer adamw-8bit": {"optimizer": "adamw-8bit"},
             "--mode lora": {"mode": "lora"}, "--mode qlora": {"mode": "qlora"},
             "--batch 1 --grad-accum 2": {"batch": 1, "grad_accum": 2}}
    for s in data["suggestions"]:
        assert s["total_bytes"] == data["per_gpu"]["total_bytes"] - s["saved_bytes"]
        if s["change"] in flags:
            alt = plan_of(path, dataclasses.replace(base.run, **flags[s["change"]]))
            assert s["saved_bytes"] == base.total_bytes - alt.total_bytes
    code, out, err = run(capsys, *common)
    assert code == 0, err
    assert "does not fit" in out and "What would save memory" in out
    assert "applied to the trace's total" in out.replace("\n", " ")
    # how many GPUs: the trace models one, so the analytic plan answers (here none will do:
    # the CUDA context and NCCL's buffers alone exceed 500 MiB less the margin)
    assert "analytic plan: no number of GPUs up to 4096" in " ".join(out.split())


@pytest.mark.parametrize(("mode", "gpu", "chosen"), [
    ("inference", "t4", "fp16"),  # no bf16 (compute capability 7.5): 16-bit weights
    ("train", "t4", "fp16-mixed"),
    ("lora", "v100-16gb", "fp16-mixed"),  # compute capability 7.0
    ("inference", "h100-80gb", "bf16-mixed"),  # bf16 supported: the documented default
    ("train", None, "bf16-mixed"),  # no GPU named
])
def test_default_precision_is_the_best_the_gpu_supports(capsys, mode, gpu, chosen) -> None:
    argv = ["plan", "vit-b-16", "--mode", mode, *(["--gpu", gpu] if gpu else [])]
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["run"]["precision"] == chosen
    said = [n for n in data["notes"] if n.startswith("precision ")]
    if chosen == "bf16-mixed":
        assert said == []
    else:
        assert len(said) == 1 and said[0].startswith(f"precision {chosen}: the best the ")
        assert "no bf16" in said[0] and "give --precision" in said[0]
    if mode == "inference":  # 16-bit weights either way: 2 bytes per parameter
        assert data["per_gpu"]["breakdown"]["weights"] == 2 * data["model"]["params"]
    code, out, err = run(capsys, *argv)  # the table says so in one line, before the table
    assert code == 0, err
    if chosen != "bf16-mixed":
        said_at = out.index(f"\nprecision {chosen}: the best the")
        assert said_at < out.index("Memory per GPU")
    else:
        assert "\nprecision " not in out


def test_default_precision_with_the_trace(capsys) -> None:
    # ViT-B/16 inference on a T4 traced in fp16: 16-bit weights, 2 bytes per parameter (each
    # tensor's block rounded up to 512 bytes).
    code, out, err = run(capsys, "plan", "vit-b-16", "--mode", "inference", "--gpu", "t4",
                         "--method", "trace", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["run"]["precision"] == "fp16"
    assert data["notes"][0].startswith("precision fp16: the best the NVIDIA T4 supports")
    params = data["model"]["params"]
    weights = data["per_gpu"]["breakdown"]["weights"]
    assert 2 * params <= weights <= 2 * params + 512 * 300


def test_explicit_bf16_on_a_gpu_without_it_stays_an_error() -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from memfit.cli import main; sys.exit(main())",
         "plan", "vit-b-16", "--mode", "inference", "--gpu", "t4", "--precision", "bf16-mixed"],
        capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "no bf16 support" in proc.stderr
    assert "--precision fp16-mixed (fp16 for inference)" in proc.stderr


def test_this_needs_n_gpus_and_host_memory_per_node(capsys) -> None:
    """Llama-3-70B (Ψ = 70,553,706,496 parameters) with full checkpointing and the optimizer
    offloaded does not fit one H100: the fewest GPUs with ZeRO-3 that fit (checked against the
    plans on N and N - 1 GPUs), and host memory per node = the per-GPU offloaded share of the
    12Ψ bytes of fp32 masters + AdamW states and of the 4Ψ bytes of fp32 gradients (ZeRO-3
    shards them before they are offloaded: DeepSpeed ZeRO-Offload's 16Ψ/N,
    deepspeed/runtime/zero/stage3.py: estimate_zero3_model_states_mem_needs) times the GPUs on a
    node (8 by default)."""
    from dataclasses import replace

    from memfit.gpus import get_gpu
    from memfit.models import get_preset

    psi = 70_553_706_496
    code, out, err = run(capsys, "plan", "llama-3-70b", "--gpu", "h100-80gb", "--checkpointing",
                         "full", "--offload-optimizer", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["fits"] is False and data["model"]["params"] == psi
    s = data["scale_out"]
    n = s["gpus"]
    assert s["zero"] == 3 and s["flags"] == f"--gpus {n} --zero 3"
    one = plan(get_preset("llama-3-70b"), RunConfig(checkpointing="full", offload_optimizer=True),
               get_gpu("h100-80gb"))
    assert plan(one.model, replace(one.run, parallel=Parallel(gpus=n, zero=3)),
                one.gpu).fits is True
    assert plan(one.model, replace(one.run, parallel=Parallel(gpus=n - 1, zero=3)),
                one.gpu).fits is False
    per_gpu = -(-12 * psi // n) + -(-4 * psi // n)
    assert s["host_bytes_per_gpu"] == per_gpu
    assert s["host_bytes_per_node"] == per_gpu * min(n, 8)
    code, out, err = run(capsys, "plan", "llama-3-70b", "--gpu", "h100-80gb", "--checkpointing",
                         "full", "--offload-optimizer", "--gpus-per-node", "2")
    assert code == 0, err
    text = " ".join(out.split())
    assert f"this needs {n} GPUs (ZeRO-3 / FSDP: --gpus {n} --zero 3)" in text
    assert n > 2 and f"{-(-n // 2)} nodes of 2 GPUs" in text
    assert (f"host memory for offloaded states on {n} GPUs: {format_bytes(per_gpu)} per GPU, "
            f"{format_bytes(per_gpu * 2)} per node of 2 GPUs") in text


def test_no_gpu_count_helps_when_the_activations_alone_do_not_fit(capsys) -> None:
    # Llama-3-70B, no checkpointing: one micro-batch's activations stay on every GPU whatever
    # ZeRO shards.
    code, out, err = run(capsys, "plan", "llama-3-70b", "--gpu", "h100-80gb", "--json")
    assert code == 0, err
    assert json.loads(out)["scale_out"] is None
    code, out, err = run(capsys, "plan", "llama-3-70b", "--gpu", "h100-80gb")
    assert "no number of GPUs up to 4096 holds this step with ZeRO-3" in " ".join(out.split())


def test_inference_needs_the_fewest_gpus_over_tensor_and_pipeline_splits(capsys) -> None:
    from dataclasses import replace

    from memfit.gpus import get_gpu
    from memfit.models import get_preset

    argv = ("plan", "llama-3-70b", "--gpu", "h100-80gb", "--mode", "inference", "--batch", "8",
            "--seq", "4096", "--new-tokens", "512", "--json")
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    s = json.loads(out)["scale_out"]
    assert s["tp"] * s["pp"] == s["gpus"]
    base = plan(get_preset("llama-3-70b"),
                RunConfig(mode="inference", batch=8, seq=4096, new_tokens=512),
                get_gpu("h100-80gb"))
    assert plan(base.model, replace(base.run, parallel=Parallel(gpus=s["gpus"], tp=s["tp"],
                                                                pp=s["pp"])),
                base.gpu).fits
    for tp in (1, 2, 4, 8):  # the tps that divide 64 heads and 8 KV heads, within a node
        for pp in range(1, 81):
            if tp * pp < s["gpus"]:
                fewer = plan(base.model, replace(base.run, parallel=Parallel(gpus=tp * pp, tp=tp,
                                                                             pp=pp)),
                             base.gpu)
                assert fewer.fits is False


MiB = 2**20


@pytest.mark.parametrize(("name", "usable"), [
    # cudaDeviceProp.totalGlobalMem (= torch's total_memory, torch/csrc/cuda/Module.cpp) as
    # published: CUDA deviceQuery's exact bytes, or a MiB count truncated by mixbench / torch's
    # repr (totalGlobalMem / (1024 * 1024)). Sources in gpus.json.
    ("t4", 15_843_721_216),  # deviceQuery: 15110 MBytes (15843721216 bytes)
    ("a100-sxm-40gb", 42_298_834_944),  # deviceQuery: 40339 MBytes (42298834944 bytes)
    ("a100-pcie-80gb", 81049 * MiB),  # mixbench: Total global mem 81049 MB
    ("a100-sxm-80gb", 81049 * MiB),  # the PCIe board's figure (same GA100 and HBM2e stacks)
    ("rtx-3090", 24268 * MiB),  # torch repr: total_memory=24268MB
])
def test_catalog_usable_bytes_from_published_measurements(name, usable) -> None:
    from memfit.gpus import get_gpu

    gpu = get_gpu(name)
    assert gpu.usable_bytes == usable and gpu.usable_measured
    # the driver's total (nvidia-smi) is 1-2% more
    assert 0.01 < 1 - gpu.usable_bytes / gpu.memory_bytes < 0.02
    assert any(src.startswith("https://") and ("deviceQuery" in src or "total" in src.lower())
               for src in gpu.sources)


def test_the_table_says_when_the_capacity_is_the_drivers_total(capsys) -> None:
    from memfit.gpus import get_gpu, list_gpus

    for gpu in list_gpus():
        assert gpu.usable_measured == (gpu.usable_bytes != gpu.memory_bytes)
    assert not get_gpu("rtx-4090").usable_measured
    code, out, err = run(capsys, "plan", "gpt2", "--gpu", "rtx-4090")
    assert code == 0, err
    assert "usable on GPU [2]" in out and "[2] the driver's total; PyTorch's total_memory" in out
    code, out, err = run(capsys, "plan", "gpt2", "--gpu", "a100-40gb", "--json")
    gpu_json = json.loads(out)["gpu"]
    budget = gpu_json.pop("budget")  # how the capacity was reached (docs/edge.md)
    assert gpu_json == {"name": "a100-sxm-40gb", "capacity_bytes": 42_298_834_944,
                        "capacity_measured": True}
    assert budget["target"] == "cuda" and budget["budget_bytes"] == 42_298_834_944
    assert budget["unified_memory"] is False and budget["host_reserve_bytes"] is None
    code, out, err = run(capsys, "plan", "gpt2", "--gpu", "a100-40gb")
    assert "usable on GPU" in out and "driver's total" not in out


def test_json_has_one_seq_the_one_planned(capsys) -> None:
    # llama-3-8b's context is 8192 tokens; without --seq the plan uses it capped at 2048.
    code, out, err = run(capsys, "plan", "llama-3-8b", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert "seq" not in data and data["run"]["seq"] == 2048
    code, out, err = run(capsys, "plan", "llama-3-8b", "--seq", "512", "--json")
    assert json.loads(out)["run"]["seq"] == 512


@pytest.mark.parametrize(("precision", "weights_note"), [("bf16-mixed", True), ("bf16", False)])
def test_inference_trace_footnotes_weights_and_kv_cache(tmp_path, precision: str,
                                                        weights_note: bool) -> None:
    """An inference trace differs from the formulas in two rows that had no footnote: under
    bf16-mixed it holds the fp32 weights torch.autocast runs on (the formulas a bf16 model),
    and it runs one forward without a KV cache (use_cache=False), where the formulas keep the
    cache generation holds. Fake trace numbers: only the footnotes are checked (no trace)."""
    from types import SimpleNamespace

    from memfit.cli.trace_plan import trace_footnotes

    run_config = RunConfig(mode="inference", precision=precision, batch=2, seq=128)
    analytic = plan_of(small_llama(tmp_path), run_config)
    # KV cache by hand: K and V x layers x KV width (2 heads x 32) x 2 bytes x 128 tokens x 2
    kv = 2 * LAYERS * KV * 2 * 128 * 2
    assert analytic.breakdown["kv_cache"] == kv
    est = SimpleNamespace(breakdown={"weights": 4 * PSI, "activations": 1},
                          peak_phase="forward", peak_op="aten.mm.default")
    notes = {n.rows: n.text for n in trace_footnotes(est, analytic, run_config)}
    assert ("kv_cache",) in notes and format_bytes(kv) in notes[("kv_cache",)]
    assert (("weights",) in notes) is weights_note
    if weights_note:
        assert "fp32 weights" in notes[("weights",)] and "--precision bf16" in notes[("weights",)]


def test_host_line_names_step_counters_without_offload() -> None:
    """Without offloading, a trace's host memory is the Adam family's CPU step counters (a few
    bytes); the line called it 'offloaded states'. With --offload-optimizer it is those."""
    from types import SimpleNamespace

    from memfit.cli.trace_plan import host_line

    est = SimpleNamespace(host_peak_bytes=596)
    plain = host_line(est, RunConfig())
    assert plain is not None and "offloaded" not in plain and "step counters" in plain
    assert plain.endswith(format_bytes(596))
    offloaded = host_line(est, RunConfig(offload_optimizer=True))
    assert offloaded == f"host memory for offloaded states (peak): {format_bytes(596)}"
    assert host_line(SimpleNamespace(host_peak_bytes=0), RunConfig()) is None
