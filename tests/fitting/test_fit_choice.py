"""fit's choice and its output (issue 12): ties go to the simpler option, a checkpointing budget
is never above the device and collapses to the plain policy it equals, one time format."""

from __future__ import annotations

import re
import warnings

import pytest
from torch import nn

from memfit.fitting import FitConfig, Plan, fit
from memfit.fitting.cost import StepCost
from memfit.fitting.derive import plain_policy
from memfit.fitting.plan import TIE_TOLERANCE, Candidate, Rejected, rank, simplicity
from memfit.fitting.search import trace_one
from memfit.units import GiB, format_seconds

# test_fit's activation-heavy model (pytest puts this directory on sys.path).
from test_fit import make, params_bytes


@pytest.fixture(autouse=True)
def _quiet() -> None:
    warnings.simplefilter("ignore")


def _cand(seconds: float, peak_gib: float, **cfg: object) -> Candidate:
    return Candidate(config=FitConfig(**cfg), peak_bytes=int(peak_gib * GiB),  # type: ignore
                     cost=StepCost(compute_s=seconds, traffic_s=0.0, transfer_s=0.0, comm_s=0.0,
                                   dispatch_s=0.0, optimizer_s=0.0))


# -- one time format ------------------------------------------------------------------------

@pytest.mark.parametrize(("seconds", "text"), [
    (0.0, "0 s"), (0.00085, "850 µs"), (0.0125, "12.5 ms"), (0.99996, "1.00 s"), (4.2, "4.20 s"),
    (59.996, "1 min 00 s"),  # rounds to 60 s: shown in the next unit
    (2453.13, "40 min 53 s"),  # 40 * 60 + 53 = 2453
    (4991.83, "1 h 23 min"),  # 4991.83 / 60 = 83.2 min
    (5244.9211, "1 h 27 min"),  # 87.4 min
    (None, "unknown"),
])
def test_format_seconds(seconds, text) -> None:
    assert format_seconds(seconds) == text


def test_plan_prints_every_duration_one_way() -> None:
    """The issue's two numbers, 4991.83 s and 5,244,921.1 ms, in one plan: both in h/min."""
    plan = Plan(chosen=_cand(4991.83, 5.0, precision="bf16-mixed"),
                runners_up=(_cand(5244.9211, 4.0, precision="bf16-mixed",
                                  checkpointing="full"),),
                rejected=(Rejected(what="x", reason="y"),), budget_bytes=8 * GiB,
                global_batch=64, num_gpus=1, device="cpu", gpu=None, rates_source="test",
                search_seconds=61.0)
    text = plan.render(width=200)
    assert "1 h 23 min" in text and "1 h 27 min" in text and "1 min 01 s" in text
    assert not re.search(r"\d[\d,]*\.\d+ s\b", text.replace("0.00 s", ""))  # no "4991.83 s"
    assert not re.search(r"[\d,]{5,}\.\d ms", text)  # no "5,244,921.1 ms"


# -- ties go to the simpler option ------------------------------------------------------------

def test_simplicity_order() -> None:
    order = [FitConfig(), FitConfig(precision="bf16-mixed"),
             FitConfig(precision="bf16-mixed", checkpointing="selective"),
             FitConfig(precision="bf16-mixed", checkpointing="full"),
             FitConfig(precision="bf16-mixed", checkpointing="budget",
                       checkpoint_budget_bytes=GiB),
             FitConfig(precision="bf16-mixed", checkpointing="selective", chunked_loss=True)]
    keys = [simplicity(c) for c in order]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)


def test_issue_cpu_table_ranks_the_simplest_first() -> None:
    """The table `memfit fit gpt2 --budget 8GB --global-batch 64 --device cpu` printed (all
    within 0.03% of each other): budget first before; now no checkpointing (one technique
    fewer), then selective (lower peak first), then budget."""
    budget2 = _cand(2453.13, 5.20, precision="bf16-mixed", checkpointing="budget",
                    checkpoint_budget_bytes=int(3.41 * GiB), micro_batch=2, accumulation=32)
    sel2 = _cand(2453.16, 4.67, precision="bf16-mixed", checkpointing="selective",
                 micro_batch=2, accumulation=32)
    none1 = _cand(2453.40, 4.97, precision="bf16-mixed", micro_batch=1, accumulation=64)
    budget1 = _cand(2453.62, 3.62, precision="bf16-mixed", checkpointing="budget",
                    checkpoint_budget_bytes=int(1.74 * GiB), micro_batch=1, accumulation=64)
    sel1 = _cand(2453.67, 3.37, precision="bf16-mixed", checkpointing="selective",
                 micro_batch=1, accumulation=64)
    ranked = rank([budget2, sel2, none1, budget1, sel1])
    assert ranked == [none1, sel1, sel2, budget1, budget2]


def test_a_real_speed_difference_still_wins() -> None:
    fast = _cand(100.0, 5.0, precision="bf16-mixed", checkpointing="budget",
                 checkpoint_budget_bytes=GiB)
    slow = _cand(100.0 * (1 + 2 * TIE_TOLERANCE), 4.0, precision="bf16-mixed")
    assert rank([slow, fast]) == [fast, slow]


def test_ties_are_measured_from_the_fastest_not_chained() -> None:
    """100, 100.9 and 101.8 s: the first two tie (within 1% of 100), the third is 1.8% slower
    and stays behind even though it is within 1% of the second."""
    a = _cand(100.0, 1.0, precision="bf16-mixed", checkpointing="full")
    b = _cand(100.9, 1.0, precision="bf16-mixed", checkpointing="selective")
    c = _cand(101.8, 1.0, precision="bf16-mixed")
    assert rank([a, b, c]) == [b, a, c]


def test_same_simplicity_goes_to_the_lower_peak() -> None:
    hi = _cand(10.0, 2.0, checkpointing="selective")
    lo = _cand(10.05, 1.0, checkpointing="selective")
    assert rank([hi, lo]) == [lo, hi]


def test_split_ties_go_to_the_lower_peak_then_fewer_accumulation_steps() -> None:
    """docs/fit.md "How it chooses": one configuration at two micro-batch splits that tie on
    time ranks the lower peak (the smaller micro-batch) first; at equal peaks, fewer steps."""
    small = _cand(10.0, 1.0, precision="fp16-mixed", micro_batch=2, accumulation=4)
    large = _cand(10.0, 2.0, precision="fp16-mixed", micro_batch=8, accumulation=1)
    assert rank([large, small]) == [small, large]
    same_peak = _cand(10.0, 1.0, precision="fp16-mixed", micro_batch=8, accumulation=1)
    assert rank([small, same_peak]) == [same_peak, small]


def test_measured_seconds_rank_the_same_way() -> None:
    a = _cand(1.0, 1.0, checkpointing="full").with_measured(2.000)
    b = _cand(2.0, 1.0).with_measured(2.010)
    assert rank([a, b], seconds=lambda c: c.measured_s) == [b, a]


# -- a checkpointing budget is never nonsense -----------------------------------------------

def test_plain_policy_of_a_uniform_budget() -> None:
    assert plain_policy("budget", ("selective",) * 4) == "selective"
    assert plain_policy("budget", ("full",) * 3) == "full"
    assert plain_policy("budget", (None, None)) == "none"
    assert plain_policy("budget", (None, "selective")) is None
    assert plain_policy("selective", ("selective",) * 4) is None


def test_budget_label_says_what_it_resolved_to() -> None:
    cfg = FitConfig(checkpointing="budget", checkpoint_budget_bytes=3 * GiB,
                    checkpoint_modes=(None, "selective", "selective", "full"))
    assert "budget(3.00 GiB: 1 full + 2 selective + 1 none)" in cfg.label()


def _floor_and_midpoint(model: nn.Module, sample: object, m: int) -> tuple[int, int]:
    from memfit._tensors import meta_batch
    from memfit.models.anatomy import find_blocks
    from memfit.techniques.block_profile import predict_activation_bytes, profile_blocks

    names = find_blocks(model)
    profiles = profile_blocks(model, names, meta_batch(sample, m))
    floor = predict_activation_bytes(profiles, ["full"] * len(names))
    ceiling = predict_activation_bytes(profiles, [None] * len(names))
    return floor, (floor + ceiling) // 2


def _trace_budget(model: nn.Module, sample: object, m: int, device_budget: int | None):
    t = trace_one(model, sample, precision="fp32", ckpt="budget",
                  optimizer="adamw", chunked=False, attention="model", m=m, per_gpu=m,
                  device="cpu", gpu=None, loss_fn=None, num_gpus=1,
                  device_budget=device_budget)
    assert not isinstance(t, str), t
    return t


def test_budget_is_clamped_to_what_the_device_leaves_for_activations() -> None:
    """fp32 weights + gradients = 2 x the parameter bytes (counted by hand from the model):
    the activation budget never exceeds the device budget less those."""
    model, sample = make(8)
    floor, mid = _floor_and_midpoint(model, sample, 8)
    assert floor < mid
    weights_and_grads = 2 * params_bytes(model)
    assert _trace_budget(model, sample, 8, None).checkpoint_budget == mid
    room = (floor + mid) // 2
    t = _trace_budget(model, sample, 8, weights_and_grads + room)
    assert t.checkpoint_budget == room
    # Less room than every block checkpointed needs: the floor, i.e. ckpt=full everywhere.
    t = _trace_budget(model, sample, 8, weights_and_grads + floor // 2)
    assert t.checkpoint_budget == floor
    assert plain_policy("budget", t.checkpoint_modes) == "full"


def test_fit_table_has_no_budget_above_the_device_or_equal_to_aplain_policy() -> None:
    """A budget so tight that no checkpointing does not fit: the table's budgets are below the
    budget, none is uniform (it would be its plain policy), and nothing faster by under 1% is
    more complex than the chosen configuration."""
    model, batch = make(16)
    no_ckpt = fit(model, batch, global_batch=16, budget_bytes=2**30, device="cpu",
                  space={"precision": ["fp32"], "checkpointing": ["none"],
                         "micro_batch": [16]}, progress=False)
    budget = int(no_ckpt.peak_bytes * 0.8 / 0.95)
    plan = fit(model, batch, global_batch=16, budget_bytes=budget, device="cpu",
               space={"precision": ["fp32"]}, progress=False, top=8)
    shown = (plan.chosen, *plan.runners_up)
    for c in shown:
        if c.config.checkpointing == "budget":
            assert c.config.checkpoint_budget_bytes <= budget
            assert plain_policy("budget", c.config.checkpoint_modes) is None
    fastest = min(c.step_s for c in shown)
    tied = [c for c in shown if c.step_s <= fastest * (1 + TIE_TOLERANCE)]
    assert simplicity(plan.chosen.config) == min(simplicity(c.config) for c in tied)


@pytest.mark.parametrize("width", [80, 60])
@pytest.mark.parametrize("busy", [False, True])
def test_plan_table_is_never_cut_at_narrow_widths(width, busy) -> None:
    """`memfit fit` prints at the terminal's width: no cell is cut ("…"), no line is wider
    than the terminal, and every word of every configuration is there (with offload and
    measured times the configurations move under the table)."""
    import dataclasses

    cfg = dict(precision="bf16-mixed", checkpointing="budget", micro_batch=64,
               checkpoint_budget_bytes=int(6.15 * GiB),
               checkpoint_modes=("selective",) * 11 + (None,))
    if busy:
        cfg.update(optimizer="adamw-8bit", chunked_loss=True, offload_activations=True,
                   offload_states=True)
    chosen = _cand(2453.13, 21.2, **cfg)
    if busy:
        chosen = dataclasses.replace(chosen, host_bytes=3 * GiB, measured_s=0.5)
    other = _cand(2460.0, 20.0, precision="bf16-mixed", checkpointing="selective")
    plan = Plan(chosen=chosen, runners_up=(other,), rejected=(), budget_bytes=40 * GiB,
                global_batch=64, num_gpus=1, device="cuda", gpu="a100-sxm-40gb",
                rates_source="test")
    text = plan.render(width=width)
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= width
    words = set(text.split())
    for cand in (chosen, other):
        assert set(cand.config.label().split()) <= words, cand.config.label()
    assert "21.20 GiB" in text and "40 min 53 s" in text
