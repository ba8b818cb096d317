"""The fit search's pruning and trace sharing change no answer: on small models the pruned search
(``memfit.fitting.search.Search``) shows the same table, with the same peaks and step times, as
the exhaustive one (every combination explored, every trace run), and every combination it left
out could not have entered the table (Note: [pruning] in memfit/fitting/search_bounds.py)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from memfit.fitting.plan import simplicity
from memfit.fitting.search import Search, SearchOptions, trace_one
from test_fit import make


@pytest.fixture(autouse=True)
def _quiet() -> None:
    warnings.simplefilter("ignore")


def _tiny_lm() -> tuple[torch.nn.Module, Any]:
    """A two-layer eager-attention decoder: SDPA, chunked loss and checkpointing are all
    searched, and at 128 tokens its activations dominate its weights."""
    from memfit.models.build import build_model, example_inputs
    from memfit.models.spec import TransformerSpec

    spec = TransformerSpec(name="tiny", family="llama", arch="decoder", hidden_size=64,
                           num_layers=2, num_heads=4, num_kv_heads=4, head_dim=16,
                           intermediate_size=128, vocab_size=512, max_position_embeddings=512)
    torch.manual_seed(0)
    model = build_model(spec, backend="builtin", device="cpu", attn_implementation="eager")
    return model, example_inputs(spec, batch=1, seq=128, device="cpu")


def _run(model: torch.nn.Module, batch: Any, *, exhaustive: bool, **kw: Any) -> Search:
    args: dict[str, Any] = dict(optimizer="adamw", gpu=None, budget_bytes=None,
                                device="cpu", loss_fn=None, reduction="mean", count_fn=None,
                                num_gpus=1, measure=False, space=None, progress=False, top=5,
                                headroom=None)
    args.update(kw)
    options = SearchOptions(prune=False, share_traces=False) if exhaustive else None
    s = Search(model, batch, options=options, **args)
    s.plan = s.run()  # type: ignore[attr-defined]
    return s


def _table(s: Search) -> list[tuple[str, int, float]]:
    plan = s.plan  # type: ignore[attr-defined]
    return [(c.config.label(), c.peak_bytes, c.step_s) for c in (plan.chosen, *plan.runners_up)]


def _check(fast: Search, full: Search) -> None:
    # Same table (configurations, peaks, step times: the answer), fewer traces.
    assert _table(fast) == _table(full)
    assert fast.plan.traces < full.plan.traces  # type: ignore[attr-defined]
    # Every pruned combination: each of its candidates (from the exhaustive search) is at least
    # its bound at that micro-batch, and none is in the exhaustive table.
    shown = set(_table(full))
    assert fast.skipped
    for combo, by_m in fast.skipped.items():
        for c in full.candidates:
            cfg = c.config
            if (cfg.precision, cfg.checkpointing, cfg.optimizer, cfg.chunked_loss,
                    cfg.attention) != combo:
                continue
            assert c.cost.total_s >= by_m[cfg.micro_batch], (combo, cfg.label())
            assert simplicity(cfg) >= fast.simplest(combo)
            assert (cfg.label(), c.peak_bytes, c.step_s) not in shown


@pytest.mark.parametrize("budget_mib", [6, 64])
def test_pruned_search_equals_exhaustive_on_cpu(budget_mib: int) -> None:
    # 6 MiB: several micro-batches and checkpointing policies fit, ties across policies; 64 MiB:
    # the whole batch fits and the plain step ties with the policies that only cost memory.
    # Rates pinned: how much pruning saves depends on the step times, and a CPU's measured
    # rates differ between machines (at 100 GFLOP/s in both precisions nothing is pruned here;
    # a fresh run measured rates where pruning saved no trace). A CPU without bf16 matrix units.
    rates = {"flops": {"fp32": 100e9, "bf16-mixed": 30e9, "bf16": 30e9}, "bandwidth": 20e9,
             "launch_s": 4e-6}
    model, batch = make(16)
    fast = _run(model, batch, exhaustive=False, global_batch=16,
                budget_bytes=budget_mib * 2**20, rates=rates)
    full = _run(model, batch, exhaustive=True, global_batch=16,
                budget_bytes=budget_mib * 2**20, rates=rates)
    _check(fast, full)


def test_pruned_search_equals_exhaustive_on_a_cuda_target() -> None:
    # fp16-mixed shares bf16-mixed's traces; selective checkpointing recomputes no matmul, so on
    # a roomy GPU it ties with the plain step at best and is pruned by rule 2 (simpler first).
    model, batch = _tiny_lm()
    space = {"precision": ["bf16-mixed", "fp16-mixed"], "checkpointing": ["none", "selective"],
             "micro_batch": [4, 16], "optimizer": ["adamw"], "chunked_loss": [False],
             "attention": ["model"], "offload_states": [False], "offload_activations": [False]}
    kw: dict[str, Any] = dict(global_batch=16, gpu="a100-40gb", device="cuda", space=space,
                              top=2)
    fast = _run(model, batch, exhaustive=False, **kw)
    full = _run(model, batch, exhaustive=True, **kw)
    _check(fast, full)
    assert {c[1] for c in fast.skipped} == {"selective"}
    assert any("ties with 2 simpler" in r.reason for r in fast.rejected)


def test_fp16_mixed_traces_as_bf16_mixed_on_a_cuda_target() -> None:
    # Note: [fp16 is traced as bf16]: CUDA autocast's lower_precision_fp list is one list for
    # both half dtypes (aten/src/ATen/autocast_mode.h: AT_FORALL_LOWER_PRECISION_FP, registered
    # for CUDA in autocast_mode.cpp), both are 2 bytes, and SDPA's kernels take both on sm80+
    # (sdp_utils.cpp: check_tensor_dtype). Traced independently, the two steps agree exactly,
    # with and without checkpointing and with the SDPA switch.
    from memfit.gpus import get_gpu

    model, batch = _tiny_lm()
    for ckpt, attention in (("none", "model"), ("selective", "sdpa")):
        traced = [trace_one(model, batch, precision=p, ckpt=ckpt, optimizer="adamw",
                            chunked=False, attention=attention, m=4, per_gpu=8,
                            device="cuda", gpu=get_gpu("a100-40gb"), loss_fn=None,
                            num_gpus=1) for p in ("bf16-mixed", "fp16-mixed")]
        assert not isinstance(traced[0], str)
        assert traced[0] == traced[1], (ckpt, attention)


def test_model_states_depend_on_precision_and_optimizer_only() -> None:
    # Note: [model-state bound]: the bound takes weights, gradients and optimizer states from any
    # traced sibling with the same precision and optimizer; checkpointing, chunked loss and the
    # attention kernel change activations only. Checked against independent traces.
    from memfit.gpus import get_gpu

    model, batch = _tiny_lm()
    for precision in ("fp32", "bf16-mixed"):
        states = set()
        for ckpt, chunked, attention, m in (("none", False, "model", 4),
                                            ("full", True, "sdpa", 2)):
            t = trace_one(model, batch, precision=precision, ckpt=ckpt, optimizer="adamw",
                          chunked=chunked, attention=attention, m=m, per_gpu=8, device="cuda",
                          gpu=get_gpu("a100-40gb"), loss_fn=None, num_gpus=1)
            assert not isinstance(t, str)
            states.add((t.weights, t.grads, t.states))
        assert len(states) == 1, (precision, states)
        # First principles: fp32 weights and gradients (mixed precision keeps fp32 weights;
        # the weights' blocks also hold the buffers and the allocator's rounding), AdamW's two
        # fp32 states per parameter, at least.
        n = sum(p.numel() for p in model.parameters())
        weights, grads, opt = states.pop()
        assert grads == 4 * n, precision
        assert weights >= 4 * n and opt >= 8 * n, precision


def test_pruning_compares_times_as_rank_does() -> None:
    # Note: [tie arithmetic] / [pruning]: the README's GPT-2 search, in small. Plain 8-bit
    # AdamW costed at micro-batch 8 is 6e-11 s slower than at 4 (float rounding before an int
    # truncation of the traffic bytes); selective checkpointing with 8-bit AdamW can at best
    # equal plain 8-bit at each micro-batch. By raw floats only the two micro-batch-4
    # candidates are <= its bound at 4, fewer than top = 5, so it was traced; rank() groups by
    # 9 significant digits, where all six simpler candidates are <= the bound: pruned.
    from memfit.fitting.config import FitConfig
    from memfit.fitting.cost import StepCost
    from memfit.fitting.plan import Candidate, rank, tie_time

    t4, t8 = 1.3342232941971166, 1.334223294258853  # the README search's two times
    assert t4 < t8 and tie_time(t4) == tie_time(t8)
    model, batch = _tiny_lm()
    space = {"precision": ["bf16-mixed", "fp16-mixed"], "checkpointing": ["none", "selective"],
             "micro_batch": [4, 8, 16], "optimizer": ["adamw-8bit"], "chunked_loss": [False],
             "attention": ["model"], "offload_states": [False], "offload_activations": [False]}

    def cand(precision: str, ckpt: str, m: int, seconds: float) -> Candidate:
        cfg = FitConfig(precision=precision, checkpointing=ckpt, micro_batch=m,
                        accumulation=16 // m, optimizer="adamw-8bit")
        return Candidate(config=cfg, peak_bytes=m, cost=StepCost(
            compute_s=seconds, traffic_s=0.0, transfer_s=0.0, comm_s=0.0, dispatch_s=0.0,
            optimizer_s=0.0))

    plain = [cand(p, "none", m, t4 if m == 4 else t8) for p in ("bf16-mixed", "fp16-mixed")
             for m in (4, 8, 16)]
    combo = ("bf16-mixed", "selective", "adamw-8bit", False, "model")
    kept = {}
    for tie in (False, True):
        s = Search(model, batch, optimizer="adamw", global_batch=16, gpu="a100-40gb",
                   budget_bytes=None, device="cuda", loss_fn=None, reduction="mean",
                   count_fn=None, num_gpus=1, measure=False, space=space, progress=False,
                   top=5, headroom=None, options=SearchOptions(tie_arithmetic=tie))
        s.candidates = list(plain)
        s.bounds = lambda c: {4: t4, 8: t8, 16: t8}  # type: ignore[method-assign]
        kept[tie] = not s.pruned(combo, 0.0)
    assert kept == {False: True, True: False}
    # And rank() agrees: the combination's best candidates (at their bounds) rank after all
    # six simpler ones, so none of them could have entered a table of 5.
    best = [cand("bf16-mixed", "selective", m, t4 if m == 4 else t8) for m in (4, 8, 16)]
    ranked = rank(best + plain)
    assert ranked[:6] == rank(plain) and set(map(id, ranked[6:])) == set(map(id, best))
