"""memfit.fit on CPU: small models, byte budgets, real runs measured with the profiler."""

from __future__ import annotations

import argparse
import copy
import json
import sys
import warnings

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from _models import Classifier, ReluBlock
from memfit.errors import MemfitError
from memfit.fitting import FitConfig, Plan, fit
from memfit.fitting.plan import TIE_TOLERANCE
from memfit.profiling.cpu import measure_cpu_peak

D, T, C = 32, 64, 8


class SeqNet(nn.Module):
    """Activations (batch x T x 4D per block) dominate its few parameters."""

    def __init__(self, d: int = D, n: int = 4) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[ReluBlock(d) for _ in range(n)])
        self.head = nn.Linear(d, C)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.blocks(x))
        return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def make(batch: int = 16) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    return SeqNet(), (torch.randn(batch, T, D), torch.randint(0, C, (batch, T)))


def params_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def act_bytes_per_sample() -> int:
    # First principles: each block saves its input (T x D), up's output and relu's output
    # (T x 4D each) in fp32.
    return 4 * 4 * (T * D + 2 * T * 4 * D)


FP32 = {"precision": ["fp32"]}


@pytest.fixture(autouse=True)
def _quiet() -> None:
    warnings.simplefilter("ignore")


def test_chosen_config_fits_when_run_for_real() -> None:
    model, batch = make(16)
    # Model states (weights, grads, 2 AdamW states) plus about 4 samples' activations: the full
    # batch of 16 cannot run in one go without checkpointing.
    budget = 4 * params_bytes(model) + 4 * act_bytes_per_sample()
    plan = fit(model, batch, global_batch=16, budget_bytes=budget, device="cpu", space=FP32,
               progress=False)
    cfg = plan.config
    assert cfg.micro_batch * cfg.accumulation == 16
    assert cfg.micro_batch < 16 or cfg.checkpointing != "none"
    assert plan.peak_bytes <= budget
    model, opt, step = plan.apply(model, log=False)
    step(batch)  # first step: creates the optimizer state
    peak = measure_cpu_peak(lambda: step(batch), model, opt, batch)
    assert peak.peak_bytes <= budget, (peak.peak_bytes, budget, cfg.label())


def test_budget_below_every_config_is_a_clear_error() -> None:
    model, batch = make(8)
    budget = 2 * params_bytes(model)  # weights + gradients alone exceed nothing; states do
    with pytest.raises(MemfitError, match="no configuration fits the budget of"):
        fit(model, batch, global_batch=8, budget_bytes=budget, device="cpu", progress=False)


def test_roomy_budget_picks_no_checkpointing_and_one_micro_batch() -> None:
    model, batch = make(8)
    plan = fit(model, batch, global_batch=8, budget_bytes=2**30, device="cpu", space=FP32,
               progress=False)
    # Independent check of the ordering: full checkpointing recomputes each block's forward, so
    # it counts strictly more FLOPs than none (FlopCounterMode, real tensors).
    from memfit.techniques import apply_activation_checkpointing

    def count(m: nn.Module) -> int:
        with FlopCounterMode(display=False) as fc:
            m(*batch).backward()
        return fc.get_total_flops()

    ckpt = copy.deepcopy(model)
    apply_activation_checkpointing(ckpt, "full")
    assert count(ckpt) > count(model)
    assert plan.config.checkpointing == "none"
    assert plan.config.micro_batch == 8 and plan.config.accumulation == 1
    # Ranked by step time, except that times within TIE_TOLERANCE tie and the simpler goes
    # first: no candidate is slower than a later one by more than the tolerance.
    steps = [plan.chosen.step_s] + [c.step_s for c in plan.runners_up]
    assert all(a <= b * (1 + TIE_TOLERANCE) for i, a in enumerate(steps) for b in steps[i:])
    assert steps[0] <= min(steps) * (1 + TIE_TOLERANCE)


def test_tight_budget_trades_speed_for_memory_in_cost_order() -> None:
    model, batch = make(16)
    roomy = fit(model, batch, global_batch=16, budget_bytes=2**30, device="cpu", space=FP32,
                progress=False)
    budget = 4 * params_bytes(model) + 4 * act_bytes_per_sample()
    tight = fit(model, batch, global_batch=16, budget_bytes=budget, device="cpu", space=FP32,
                progress=False)
    assert roomy.peak_bytes > budget  # the roomy choice does not fit the tight budget ...
    assert tight.step_seconds >= roomy.step_seconds  # ... and what fits is not faster
    for r in tight.rejected:
        if r.peak_bytes is not None:
            assert r.peak_bytes > budget * (1 - tight.headroom)


def test_save_load_round_trip(tmp_path) -> None:
    model, batch = make(8)
    plan = fit(model, batch, global_batch=8, budget_bytes=2**30, device="cpu", progress=False)
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path) == plan
    data = json.loads(path.read_text())
    data["chosen"]["config"]["precision"] = "fp64"
    path.write_text(json.dumps(data))
    with pytest.raises(MemfitError, match="precision"):
        Plan.load(path)
    path.write_text("{not json")
    with pytest.raises(MemfitError, match="not valid JSON"):
        Plan.load(path)
    path.write_text(json.dumps({"format": "other"}))
    with pytest.raises(MemfitError, match="not a memfit plan"):
        Plan.load(path)
    del data["budget_bytes"]
    data["chosen"]["config"]["precision"] = "fp32"
    path.write_text(json.dumps(data))
    with pytest.raises(MemfitError, match="malformed plan"):
        Plan.load(path)


@pytest.mark.parametrize("ckpt", ["none", "full"])
def test_apply_matches_a_manual_loop_in_fp32(ckpt: str) -> None:
    model, batch = make(8)
    space = {"precision": ["fp32"], "checkpointing": [ckpt], "micro_batch": [2]}
    plan = fit(model, batch, global_batch=8, budget_bytes=2**30, device="cpu", space=space,
               progress=False)
    assert plan.config.micro_batch == 2 and plan.config.accumulation == 4
    manual = copy.deepcopy(model)
    applied, _, step = plan.apply(copy.deepcopy(model), log=False)
    opt = torch.optim.AdamW(manual.parameters(), lr=1e-3)
    for i in range(3):
        x, y = batch[0] + i, batch[1]
        loss = step((x, y))
        total = 0.0
        for xs, ys in zip(x.split(2), y.split(2), strict=True):
            part = manual(xs, ys) * xs.shape[0] / x.shape[0]
            part.backward()
            total += float(part)
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert float(loss) == pytest.approx(total, rel=1e-5)
    for (name, a), b in zip(applied.named_parameters(), manual.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)


def test_search_traces_few_configs_for_a_small_model() -> None:
    # (How long it takes, a target, is timed in bench/speed_targets.py.)
    model, batch = make(16)
    plan = fit(model, batch, global_batch=16, budget_bytes=2**30, device="cpu", progress=False)
    assert plan.traces <= 8  # monotonicity: one trace per combination when the largest fits


def test_measure_picks_the_fastest_measured() -> None:
    model, batch = make(8)
    plan = fit(model, batch, global_batch=8, budget_bytes=2**30, device="cpu", measure=True,
               space=FP32, progress=False, top=3)
    measured = [c.measured_s for c in (plan.chosen, *plan.runners_up[:2])]
    assert all(m is not None and m > 0 for m in measured)
    assert plan.chosen.measured_s == min(measured)  # type: ignore[type-var]


def test_unsupported_precision_is_rejected_with_a_reason() -> None:
    model, batch = make(4)
    plan = fit(model, batch, global_batch=4, gpu="v100-16gb", device="cuda",
               space={"precision": ["bf16-mixed", "fp32"], "checkpointing": ["none"],
                      "micro_batch": [4]}, progress=False)
    assert plan.config.precision == "fp32"
    assert any("bf16-mixed" in r.what and "not supported" in r.reason for r in plan.rejected)


def test_sharding_splits_model_states_over_gpus() -> None:
    model, batch = make(4)
    space = {"precision": ["fp32"], "checkpointing": ["none"], "micro_batch": [2],
             "offload_states": [False], "offload_activations": [False]}
    plan = fit(model, batch, global_batch=8, gpu="a100-40gb", device="cuda", num_gpus=2,
               space=space, progress=False, top=10)
    peaks = {c.config.sharding: c.peak_bytes for c in (plan.chosen, *plan.runners_up)}
    # ZeRO-1 keeps half of the optimizer states on each of the 2 GPUs: half of what the trace
    # engine holds as optimizer state for the unsharded step (at least AdamW's two fp32 tensors
    # per parameter, each rounded up to the CUDA allocator's 512-byte blocks).
    import memfit
    from memfit.categories import MemoryCategory

    est = memfit.estimate(model, (batch[0][:2], batch[1][:2]), device="cuda", gpu="a100-40gb")
    states = est.breakdown[MemoryCategory.OPTIMIZER_STATES]
    assert states >= sum(2 * -(-4 * p.numel() // 512) * 512 for p in model.parameters())
    assert peaks["none"] - peaks["zero1"] == pytest.approx(states / 2, abs=1)
    assert peaks["zero1"] > peaks["zero2"] > peaks["zero3"]


def test_bad_input() -> None:
    model, batch = make(4)
    with pytest.raises(MemfitError, match="give a budget"):
        fit(model, batch, global_batch=4, device="cpu")
    with pytest.raises(MemfitError, match="global_batch"):
        fit(model, batch, global_batch=0, budget_bytes=2**30, device="cpu")
    with pytest.raises(MemfitError, match="did you mean 'precision'"):
        fit(model, batch, global_batch=4, budget_bytes=2**30, device="cpu",
            space={"precison": ["fp32"]})
    with pytest.raises(MemfitError, match="must divide"):
        fit(model, batch, global_batch=4, budget_bytes=2**30, device="cpu",
            space={"micro_batch": [3]})
    with pytest.raises(MemfitError):
        FitConfig(precision="fp64")


# -- CLI ------------------------------------------------------------------------------------------

FACTORY = '''
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    def forward(self, x):
        return self.blocks(x).pow(2).mean()

def make():
    return Net(), torch.randn(4, 16)

def bad():
    return 42
'''


def _cli(argv: list[str]) -> int:
    from memfit.cli import fit as fit_cli
    from memfit.cli import main as _main  # noqa: F401  (the real entry point's error handling)

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    fit_cli.register(sub)
    args = parser.parse_args(["fit", *argv])
    try:
        return int(args.func(args) or 0)
    except MemfitError as exc:
        print(f"memfit: error: {exc}", file=sys.stderr)
        return 2


def test_cli(tmp_path, monkeypatch, capsys) -> None:
    (tmp_path / "fitfactory.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "plan.json"
    assert _cli(["fitfactory:make", "--budget", "1MB", "--global-batch", "8",
                 "--save", str(out)]) == 0
    text = capsys.readouterr().out
    assert "chosen" in text and "saved to" in text
    assert Plan.load(out).global_batch == 8
    assert _cli(["fitfactory:make", "--budget", "1MB", "--global-batch", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["format"] == "memfit-plan/1"
    for argv, message in (
        (["fitfactory:bad", "--budget", "1MB", "--global-batch", "8"], "returned int"),
        (["fitfactory:make", "--global-batch", "8"], "--budget"),
        (["fitfactory:make", "--budget", "lots", "--global-batch", "8"], "not a size"),
        (["fitfactory:make", "--budget", "1MB", "--global-batch", "x"], "--global-batch"),
        (["nomodule_xyz:make", "--budget", "1MB", "--global-batch", "8"], "cannot import"),
        (["fitfactory:make", "--budget", "100B", "--global-batch", "8"], "no configuration"),
    ):
        assert _cli(argv) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1


def test_report_and_progress_bar(capsys) -> None:
    model, batch = make(16)
    budget = 4 * params_bytes(model) + 4 * act_bytes_per_sample()
    plan = fit(model, batch, global_batch=16, budget_bytes=budget, device="cpu", progress=True)
    text = str(plan)
    cfg = plan.config
    assert "chosen" in text and f"mb={cfg.micro_batch}x{cfg.accumulation}" in text
    assert "rejected" in text and "> budget" in text  # why the faster ones were rejected
    assert "compute" in text and "rates:" in text


def test_apply_bf16_mixed_trains_on_cpu() -> None:
    model, batch = make(8)
    plan = fit(model, batch, global_batch=8, budget_bytes=2**30, device="cpu",
               space={"precision": ["bf16-mixed"], "checkpointing": ["selective"]},
               progress=False)
    model, _, step = plan.apply(model, log=False)
    before = [p.detach().clone() for p in model.parameters()]
    losses = [float(step(batch)) for _ in range(3)]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]  # same batch three times: AdamW lowers its loss
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_attention_backend_is_searched_for_an_eager_model() -> None:
    # An eager-attention model keeps the s x s scores; the search must offer SDPA, and with a
    # budget between the two peaks (measured here independently) SDPA is the one that fits.
    from memfit.models.build import build_model, example_inputs
    from memfit.models.spec import TransformerSpec

    spec = TransformerSpec(name="tiny", family="llama", arch="decoder", hidden_size=64,
                           num_layers=2, num_heads=4, num_kv_heads=4, head_dim=16,
                           intermediate_size=128, vocab_size=256, max_position_embeddings=512)
    torch.manual_seed(0)
    inputs = example_inputs(spec, batch=4, seq=256, device="cpu")
    inputs["input_ids"].random_(0, 256)
    inputs["labels"].copy_(inputs["input_ids"])
    batch = (inputs["input_ids"], inputs["labels"])

    def peak(attn: str) -> int:
        model = build_model(spec, backend="builtin", device="cpu", attn_implementation=attn)
        opt = torch.optim.AdamW(model.parameters())

        def step() -> None:
            for _ in range(2):
                model(*batch).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

        return measure_cpu_peak(step, model, batch).peak_bytes

    eager, sdpa = peak("eager"), peak("sdpa")
    assert sdpa < eager
    model = build_model(spec, backend="builtin", device="cpu", attn_implementation="eager")
    budget = int((eager + sdpa) / 2 / 0.95)  # fit keeps 5% headroom
    plan = fit(model, batch, global_batch=4, budget_bytes=budget, device="cpu",
               space={"precision": ["fp32"], "checkpointing": ["none"], "micro_batch": [4]},
               progress=False)
    assert plan.config.attention == "sdpa"


def test_cuda_target_traces_checkpointed_attention_models() -> None:
    # Every checkpointing candidate of an SDPA model on a CUDA target is traced, none rejected
    # because the engine failed (the recompute in backward must use the same attention kernels).
    from memfit.fitting.search import ENGINE_FAILED
    from memfit.models.build import build_model, example_inputs
    from memfit.models.spec import TransformerSpec

    spec = TransformerSpec(name="t", family="llama", arch="decoder", hidden_size=64,
                           num_layers=2, num_heads=4, num_kv_heads=4, head_dim=16,
                           intermediate_size=192, vocab_size=512)
    torch.manual_seed(0)
    model = build_model(spec, backend="builtin", device="cpu")
    inputs = example_inputs(spec, batch=4, seq=64, device="cpu")
    space = {"precision": ["fp32"], "checkpointing": ["none", "selective", "full"],
             "micro_batch": [4], "optimizer": ["adamw"], "offload_states": [False],
             "offload_activations": [False], "chunked_loss": [False]}
    plan = fit(model, inputs, global_batch=4, gpu="a100-40gb", device="cuda", space=space,
               progress=False, top=10)
    assert not [r for r in plan.rejected if ENGINE_FAILED in r.reason]
    traced = {c.config.checkpointing for c in (plan.chosen, *plan.runners_up)}
    assert traced == {"none", "selective", "full"}


def test_offload_candidates_carry_the_traced_peak() -> None:
    # The search derives offload variants from the trace without offload, then traces the ones
    # that reach the table with the offload applied: their peak is what memfit.estimate says
    # for that exact setup (activation offload after checkpointing, states on the host).
    import memfit
    from memfit.techniques import apply_activation_offload, make_optimizer

    model, batch = make(4)
    space = {"precision": ["fp32"], "checkpointing": ["none"], "micro_batch": [4],
             "optimizer": ["adamw"], "offload_states": [False, True],
             "offload_activations": [True], "chunked_loss": [False]}
    plan = fit(model, batch, global_batch=4, gpu="a100-40gb", device="cuda", space=space,
               progress=False, top=10)
    got = {c.config.offload_states: c.peak_bytes for c in (plan.chosen, *plan.runners_up)}
    assert set(got) == {False, True}
    for offload_states in (False, True):
        traced = copy.deepcopy(model)
        apply_activation_offload(traced)
        est = memfit.estimate(
            traced, batch, device="cuda", gpu="a100-40gb", steps=2,
            optimizer=lambda ps, o=offload_states: make_optimizer(ps, "adamw", offload_states=o))
        assert got[offload_states] == est.total_bytes, offload_states
        host = next(c.host_bytes for c in (plan.chosen, *plan.runners_up)
                    if c.config.offload_states == offload_states)
        assert host == est.host_peak_bytes > 0
    assert "host (offload)" in str(plan)


@pytest.mark.parametrize(("precision", "micro_batch", "checkpointing"), [
    ("fp32", 16, "none"), ("fp32", 4, "none"), ("fp32", 16, "full"), ("fp32", 8, "full"),
    ("fp32", 16, "selective"), ("fp32", 4, "selective"), ("bf16-mixed", 16, "none"),
    ("bf16-mixed", 4, "full"), ("bf16-mixed", 16, "selective")])
def test_predicted_peak_matches_the_applied_step_measured(precision: str, micro_batch: int,
                                                          checkpointing: str) -> None:
    # Each configuration alone in the space: the plan's peak (traced, or derived for the
    # accumulating micro-batches) against the profiler's measurement of the step Plan.apply
    # builds, the optimizer's states already made. Within the trace engine's 1% target.
    # (Before: 4 x 4 accumulation 6.8% low, the whole batch left out; bf16-mixed 2-3% low, the
    # CPU kernels' scratch inside ops left out of the one-step derivation.)
    model, batch = make(16)
    space = {"precision": [precision], "micro_batch": [micro_batch],
             "checkpointing": [checkpointing], "chunked_loss": [False]}
    plan = fit(model, batch, global_batch=16, budget_bytes=2**30, device="cpu", space=space,
               progress=False)
    assert (plan.config.micro_batch, plan.config.checkpointing) == (micro_batch, checkpointing)
    model, opt, step = plan.apply(model, log=False)
    step(batch)
    real = measure_cpu_peak(lambda: step(batch), model, opt, batch).peak_bytes
    print(f"{precision} {micro_batch} {checkpointing}: plan {plan.peak_bytes} real {real} "
          f"error {100 * (plan.peak_bytes - real) / real:+.3f}%")
    assert abs(plan.peak_bytes - real) <= 0.01 * real, (plan.peak_bytes, real)


def test_every_micro_batch_in_the_table_matches_its_applied_step_measured() -> None:
    # Micro-batches below the largest one traced used to be derived from its trace, shrinking
    # only the activations alive at that trace's one-step peak (the optimizer's step: the input
    # alone). Issue 20's classifier at micro-batch 128 of 4096 was predicted at micro-batch
    # 256's peak, 7.7% over the measured step; the test above pins one micro-batch per search,
    # which is always traced, so it never saw a derived one. Every candidate of the table
    # against memfit.profile's peak of the step Plan.apply builds for it, in its steady state
    # (the optimizer's states made by a first step): within the trace engine's 1%.
    import dataclasses

    import memfit

    def make_clf() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
        torch.manual_seed(0)
        return Classifier(32, 128, 512, 3, 10), (torch.randn(128, 32),
                                                  torch.randint(0, 10, (128,)))

    model, batch = make_clf()
    space = {"precision": ["fp32"], "checkpointing": ["none"], "micro_batch": [16, 128],
             "chunked_loss": [False]}
    plan = fit(model, batch, global_batch=128, budget_bytes=2**30, device="cpu", space=space,
               progress=False)
    table = (plan.chosen, *plan.runners_up)
    assert {c.config.micro_batch for c in table} == {16, 128}
    for cand in table:
        model, batch = make_clf()
        model, opt, step = dataclasses.replace(plan, chosen=cand).apply(model, log=False)
        step(batch)
        with memfit.profile(device="cpu", baseline=(model, opt, batch)) as prof:
            step(batch)
        real = prof.peak_bytes
        print(f"{cand.config.label()}: plan {cand.peak_bytes} real {real} "
              f"error {100 * (cand.peak_bytes - real) / real:+.3f}%")
        assert cand.traced
        assert abs(cand.peak_bytes - real) <= 0.01 * real, (cand.config.label(),
                                                             cand.peak_bytes, real)


def test_a_trace_with_fixed_modes_checkpoints_as_they_say() -> None:
    # The verification of a derived micro-batch (and the per-rank trace) traces a checkpointing
    # budget's step with the per-block modes the search resolved, as Plan.apply's FixedModes
    # runs them; resolving the budget again at another micro-batch would trace another step.
    # (trace_one used to overwrite its modes argument with None before reading it.)
    from memfit.fitting.search import trace_one

    model, batch = make(8)
    modes = ("full", None, "selective", None)
    t = trace_one(model, batch, precision="fp32", ckpt="budget", optimizer="adamw",
                  chunked=False, attention="model", m=2, per_gpu=8, device="cpu", gpu=None,
                  loss_fn=None, num_gpus=1, modes=modes)
    assert not isinstance(t, str)
    assert t.checkpoint_modes == modes
