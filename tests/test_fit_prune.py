"""The fit search's pruning and trace sharing change no answer: on small models the pruned search
(``memfit.fitting.search._Search``) shows the same table, with the same peaks and step times, as
the exhaustive one (every combination explored, every trace run), and every combination it left
out could not have entered the table (Note: [pruning] in memfit/fitting/search.py)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from memfit.fitting import search
from memfit.fitting.plan import simplicity
from memfit.fitting.search import _Search
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


def _run(model: torch.nn.Module, batch: Any, *, exhaustive: bool, **kw: Any) -> _Search:
    args: dict[str, Any] = dict(optimizer="adamw", gpu=None, budget_bytes=None,
                                device="cpu", loss_fn=None, reduction="mean", count_fn=None,
                                num_gpus=1, measure=False, space=None, progress=False, top=5,
                                headroom=None)
    args.update(kw)
    s = _Search(model, batch, **args)
    if exhaustive:
        s.prune = False
        s.share_traces = False
    s.plan = s.run()  # type: ignore[attr-defined]
    return s


def _table(s: _Search) -> list[tuple[str, int, float]]:
    plan = s.plan  # type: ignore[attr-defined]
    return [(c.config.label(), c.peak_bytes, c.step_s) for c in (plan.chosen, *plan.runners_up)]


def _check(fast: _Search, full: _Search) -> None:
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
    model, batch = make(16)
    fast = _run(model, batch, exhaustive=False, global_batch=16,
                budget_bytes=budget_mib * 2**20)
    full = _run(model, batch, exhaustive=True, global_batch=16,
                budget_bytes=budget_mib * 2**20)
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
    base = search._meta_copy(model)
    for ckpt, attention in (("none", "model"), ("selective", "sdpa")):
        traced = [search._trace_one(base, batch, precision=p, ckpt=ckpt, optimizer="adamw",
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
    base = search._meta_copy(model)
    for precision in ("fp32", "bf16-mixed"):
        states = set()
        for ckpt, chunked, attention, m in (("none", False, "model", 4),
                                            ("full", True, "sdpa", 2)):
            t = search._trace_one(base, batch, precision=precision, ckpt=ckpt,
                                  optimizer="adamw", chunked=chunked, attention=attention, m=m,
                                  per_gpu=8, device="cuda", gpu=get_gpu("a100-40gb"),
                                  loss_fn=None, num_gpus=1)
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
