"""Replaying identical blocks changes no byte: the estimate with block replay
(``memfit/trace/blocks.py``, Note: [replaying identical blocks]) equals the estimate of every
block traced for real (``replay.disabled()``, the same as ``MEMFIT_NO_REPLAY=1``), field for
field: peak, reserved, breakdown, timeline (bytes by category after every op, the op's module),
modules, phase and op peaks.

Each case is a place where a block's replay must reproduce what the real block did to the
world outside it: a pure-bf16 block drops its input in the forward, a bf16-mixed one saves it
for the backward; checkpointing under autocast lets the cached casts die when the forward ends;
Hugging Face attributes the rotary backward to no module; frozen weights get no gradient; MoE
routes through ``_grouped_mm``; a later step starts where the first did.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import memfit
from memfit.trace import blocks, replay
from memfit.trace.replay_windows import ReplayMismatch

_LAYERS = 6


def _fields(est: memfit.Estimate) -> dict[str, object]:
    return {f.name: getattr(est, f.name) for f in dataclasses.fields(est)
            if f.name != "trace_seconds"}


def _both(model: nn.Module, inputs: Any, **kw: Any) -> tuple[memfit.Estimate, memfit.Estimate,
                                                             dict[str, int]]:
    """The estimate with replay, its replay counts, and the estimate without."""
    kw = {"optimizer": "adamw", "precision": "bf16-mixed", "device": "cuda",
          "gpu": "h100-80gb", **kw}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        before = dict(replay.counts)
        fast = memfit.estimate(model, inputs, **kw)
        used = {k: replay.counts[k] - before[k] for k in before}
        with replay.disabled():
            slow = memfit.estimate(model, inputs, **kw)
    return fast, slow, used


def _builtin(layers: int = _LAYERS, moe: bool = False) -> tuple[nn.Module, Any]:
    from memfit.models.build import build_model, example_inputs
    from memfit.parallel.measure import tiny_moe_spec, tiny_spec

    spec = tiny_moe_spec(layers=layers) if moe else tiny_spec(layers=layers)
    model = build_model(spec, backend="builtin", device="meta")
    return model, example_inputs(spec, batch=2, seq=64, device="meta")


def _replays(steps: int, layers: int = _LAYERS) -> int:
    """Blocks 2 .. N-2 in the first step (0, 1 and N-1 run), 1 .. N-1 in each later one."""
    return (layers - 3) + (steps - 1) * (layers - 1)


@pytest.mark.parametrize("checkpointing", [None, "full", "selective"])
@pytest.mark.parametrize("precision", ["bf16-mixed", "fp32", "bf16"])
def test_replayed_blocks_give_the_estimate_of_the_real_trace(
        precision: str, checkpointing: str | None) -> None:
    model, inputs = _builtin()
    if checkpointing:
        from memfit.techniques.checkpointing import apply_activation_checkpointing

        apply_activation_checkpointing(model, policy=checkpointing)
    fast, slow, used = _both(model, inputs, precision=precision)
    assert used["replayed"] == _replays(2) and used["redone"] == 0
    assert _fields(fast) == _fields(slow)


def _hf(kind: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        if kind == "llama":
            return transformers.LlamaForCausalLM(transformers.LlamaConfig(
                hidden_size=64, intermediate_size=128, num_hidden_layers=_LAYERS,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=256))
        if kind == "qwen3":
            return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
                hidden_size=64, intermediate_size=128, num_hidden_layers=_LAYERS,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256))
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_embd=64, n_layer=_LAYERS, n_head=4, vocab_size=256, n_positions=64,
            bos_token_id=0, eos_token_id=0))


@pytest.mark.parametrize(("kind", "precision", "steps"), [
    ("llama", "fp32", 2),          # keyword arguments: the rotary tables as one tuple
    ("llama", "fp16-mixed", 3),    # three steps: the first step's templates twice
    ("qwen3", "bf16-mixed", 2),    # q/k norms
    ("gpt2", "bf16-mixed", 2),     # learned positions, Conv1D projections
])
def test_hugging_face_decoders(kind: str, precision: str, steps: int) -> None:
    model = _hf(kind)
    ids = torch.zeros(2, 32, dtype=torch.long, device="meta")
    fast, slow, used = _both(model, {"input_ids": ids, "labels": ids}, precision=precision,
                             steps=steps)
    assert used["replayed"] == _replays(steps) and used["redone"] == 0
    assert _fields(fast) == _fields(slow)


def test_moe_blocks_and_one_step_with_sgd() -> None:
    model, inputs = _builtin(moe=True)
    fast, slow, used = _both(model, inputs, optimizer="sgd", steps=1)
    assert used["replayed"] == _replays(1) and used["redone"] == 0
    assert _fields(fast) == _fields(slow)


def test_frozen_weights_have_no_gradient_to_replay() -> None:
    """Only the norms train (a LoRA-like partial freeze): the frozen projections' ``.grad``
    stays None in the replayed backward, as in the real one."""
    model, inputs = _builtin()
    for name, p in model.named_parameters():
        p.requires_grad_("norm" in name)
    fast, slow, used = _both(model, inputs)
    assert used["replayed"] == _replays(2) and used["redone"] == 0
    assert _fields(fast) == _fields(slow)
    assert fast.breakdown[memfit.MemoryCategory.GRADIENTS] < 64 * 1024  # the norms' alone


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp32", "bf16"])
def test_a_forward_without_grad_replays_its_blocks(precision: str) -> None:
    """Inference: the forward template alone; under autocast the cached casts outlive each
    block until the forward ends, as in the real forward."""
    model, inputs = _builtin()
    fast, slow, used = _both(model, inputs, optimizer=None, precision=precision)
    assert used["replayed"] == _replays(2) and used["redone"] == 0
    assert _fields(fast) == _fields(slow)


@pytest.mark.parametrize("cache", [False, True])
def test_a_hugging_face_forward_without_grad_with_and_without_its_kv_cache(
        cache: bool) -> None:
    """A KV cache is an object each block adds its own entries to: those blocks run."""
    model = _hf("llama")
    model.config.use_cache = cache
    ids = torch.zeros(2, 32, dtype=torch.long, device="meta")
    fast, slow, used = _both(model, {"input_ids": ids}, optimizer=None)
    assert used["replayed"] == (0 if cache else _replays(2)) and used["redone"] == 0
    assert _fields(fast) == _fields(slow)


@pytest.mark.parametrize("case", ["three-blocks", "cpu-target", "user-hook"])
def test_where_nothing_is_replayed(case: str) -> None:
    model, inputs = _builtin(layers=3 if case == "three-blocks" else _LAYERS)
    kw: dict[str, Any] = {}
    if case == "cpu-target":
        kw = {"device": "cpu", "gpu": None}
    elif case == "user-hook":  # it would not run inside a replayed block
        model.model.layers[3].mlp.register_forward_hook(lambda *_: None)
    fast, slow, used = _both(model, inputs, **kw)
    assert used["replayed"] == 0
    assert _fields(fast) == _fields(slow)


class _Odd(nn.Module):
    """A decoder whose blocks are called out of order, or with per-block arguments, or twice
    per step (two forwards summed before one backward, as accumulation in one graph)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.emb = nn.Embedding(64, 32)
        self.layers = nn.ModuleList(_Block() for _ in range(_LAYERS))
        self.head = nn.Linear(32, 64)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        total = 0.0
        for _ in range(2 if self.how == "twice" else 1):
            x = self.emb(idx)
            order = list(range(_LAYERS))
            if self.how == "reversed":
                order.reverse()
            for i in order:
                x = self.layers[i](x, float(i) if self.how == "per-block" else 1.0)
            total = total + self.head(x).float().logsumexp(-1).mean()
        return total  # type: ignore[return-value]


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)) * scale)


@pytest.mark.parametrize(("how", "redone"), [("reversed", 0), ("per-block", 0), ("twice", 1)])
def test_calls_a_replay_cannot_stand_for_run_for_real(how: str, redone: int) -> None:
    """Out of order or with other arguments: the replay stops before it starts. Twice in one
    step: the second forward finds replayed blocks already called, and the trace is redone
    without replay."""
    with torch.device("meta"):
        model = _Odd(how)
    idx = torch.zeros(2, 16, dtype=torch.long, device="meta")
    fast, slow, used = _both(model, (idx,))
    assert used["redone"] == redone
    assert _fields(fast) == _fields(slow)


def test_a_template_found_unreplayable_after_replays_redoes_the_trace(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks 2 .. N-2 are replayed in the forward before block N-1's backward is recorded; a
    backward template refused there (forced here) redoes the trace without replay."""
    model, inputs = _builtin()

    def refuse(self: Any, grad: Any) -> None:
        raise ReplayMismatch("refused by the test")

    monkeypatch.setattr(blocks._Blocks, "_close_template", refuse)
    fast, slow, used = _both(model, inputs)
    assert used["redone"] == 1
    assert _fields(fast) == _fields(slow)


def test_block_replay_is_what_makes_the_trace_fast() -> None:
    """Not a timing: the count of ops the fake mode ran. A replayed block's ops are recorded
    (the timeline has every op) but not dispatched."""
    from memfit.trace.tracker import TrackingFakeMode

    model, inputs = _builtin(layers=8)
    calls = {"n": 0}
    tracked = TrackingFakeMode._tracked

    def counting(self: Any, *args: Any) -> Any:
        calls["n"] += 1
        return tracked(self, *args)

    kw = {"optimizer": "adamw", "precision": "bf16-mixed", "device": "cuda", "gpu": "h100-80gb"}
    counted = []
    with pytest.MonkeyPatch.context() as m, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m.setattr(TrackingFakeMode, "_tracked", counting)
        fast = memfit.estimate(model, inputs, **kw)
        counted.append(calls["n"])
        with replay.disabled():
            slow = memfit.estimate(model, inputs, **kw)
        counted.append(calls["n"] - counted[0])
    assert fast.num_ops == slow.num_ops
    # 8 blocks x 2 steps = 16 block calls, 4 of them run (0, 1 and 7, then 0): fewer than half
    # the ops dispatched
    assert counted[0] < counted[1] / 2
