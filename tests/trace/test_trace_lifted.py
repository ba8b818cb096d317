"""``torch.tensor(scalar)`` under the trace's fake mode (Note: [lifted constants] in
``memfit/trace/fastkey.py``) gives what torch's own path gives.

Expected values come from torch's path: ``FakeTensorMode.dispatch(aten.lift_fresh, ...)``
(``torch/_subclasses/fake_tensor.py: FakeTensorMode._dispatch_impl``'s constant branch and
``FakeTensorConverter.from_real_tensor``), and for whole estimates the trace with the shortcut
off (``tracker.lifted_constant`` answering None for every call).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from _hf import tiny_hf_llama
from memfit.trace import estimate, tracker
from memfit.trace.fastkey import lifted_constant

LIFT = torch.ops.aten.lift_fresh.default


@pytest.mark.parametrize("value", [
    torch.tensor(0.0), torch.tensor(3, dtype=torch.int64), torch.tensor(2.5, dtype=torch.float64),
    torch.tensor(True), torch.tensor(1.5, dtype=torch.bfloat16), torch.tensor([]),
    torch.tensor([7], dtype=torch.int32), torch.tensor([[2.0]])])
def test_same_fake_as_torch(value: torch.Tensor) -> None:
    mode = FakeTensorMode()
    ours = lifted_constant(mode, LIFT, (value,), {})
    theirs = mode.dispatch(LIFT, (), (value,), {})
    assert ours is not None
    assert type(ours) is type(theirs)
    for name in ("dtype", "shape", "device", "requires_grad", "is_leaf", "layout"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.stride() == theirs.stride() and ours.storage_offset() == theirs.storage_offset()
    assert ours.untyped_storage().nbytes() == theirs.untyped_storage().nbytes()
    assert ours.fake_mode is mode and ours.fake_device == theirs.fake_device
    assert sorted(vars(ours)) == sorted(vars(theirs))
    assert ours.constant.dtype == theirs.constant.dtype
    assert torch.equal(ours.constant, theirs.constant) and torch.equal(ours.constant, value)
    assert ours.constant is not value  # a copy, as torch's clone
    with mode:  # both take part in the fake mode's constant propagation alike
        ours_plus, theirs_plus = ours + 1, theirs + 1
    assert torch.equal(ours_plus.constant, theirs_plus.constant)


@pytest.mark.parametrize("value", [
    torch.zeros(2), torch.tensor(1.0, requires_grad=True), torch.tensor(1 + 2j),
    torch.zeros(4)[1], torch.zeros(4)[:0]])
def test_anything_else_goes_to_torch(value: torch.Tensor) -> None:
    """Not a fresh plain 0-dim tensor (more elements, autograd, complex, a view): None."""
    assert lifted_constant(FakeTensorMode(), LIFT, (value,), {}) is None


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))).sum() * torch.tensor(0.5)


@pytest.mark.parametrize("optimizer", ["adamw", "adam", "sgd"])
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_estimates_equal_the_slow_path(optimizer: str, device: str,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    with torch.device("meta"):
        model = Net()
    x = torch.empty(16, 32, device="meta")
    kw = {"gpu": "h100-sxm-80gb"} if device == "cuda" else {}
    fast = dataclasses.asdict(estimate(model, x, optimizer=optimizer, device=device, steps=2,
                                       **kw))
    calls = []

    def off(*args: object) -> None:
        calls.append(args[1])
        return None

    monkeypatch.setattr(tracker, "lifted_constant", off)
    slow = dataclasses.asdict(estimate(model, x, optimizer=optimizer, device=device, steps=2,
                                       **kw))
    assert LIFT in calls  # the slow run did go through torch's path
    fast.pop("trace_seconds"), slow.pop("trace_seconds")
    assert fast == slow


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_hugging_face_estimate_equals_the_slow_path(device: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Hugging Face's KV cache lifts ``torch.tensor([])`` per layer, AdamW a step per parameter."""
    model = tiny_hf_llama()
    ids = torch.zeros(1, 16, dtype=torch.long, device="meta")
    kw = {"gpu": "h100-sxm-80gb"} if device == "cuda" else {}
    inputs = {"input_ids": ids, "labels": ids}
    fast = dataclasses.asdict(estimate(model, inputs, optimizer="adamw", device=device, steps=2,
                                       **kw))
    monkeypatch.setattr(tracker, "lifted_constant", lambda *args: None)
    slow = dataclasses.asdict(estimate(model, inputs, optimizer="adamw", device=device, steps=2,
                                       **kw))
    fast.pop("trace_seconds"), slow.pop("trace_seconds")
    assert fast == slow
