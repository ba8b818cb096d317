"""The one fake/meta copy of a model and of its inputs (``memfit._tensors``), used by the trace
engine, checkpointing's block profiles and the fit search."""

from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

from memfit._tensors import fake_inputs, fake_model, meta_copy


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied: one parameter
        self.register_buffer("scale", torch.ones(4))
        self.table = torch.arange(6.0)  # a plain tensor attribute, not a buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x) * self.scale)


def test_meta_copy_holds_no_data_and_keeps_ties() -> None:
    model = _Tied()
    copy = meta_copy(model)
    tensors = [*copy.parameters(), *copy.buffers(), copy.table]
    assert all(t.device.type == "meta" for t in tensors)
    # The tied weight stays one parameter (10 x 4), the attribute is copied too (no real data).
    assert len(list(copy.parameters())) == 1
    assert copy.head.weight is copy.embed.weight
    assert copy.table.shape == (6,)
    # The original is untouched.
    assert model.embed.weight.device.type == "cpu" and model.table.device.type == "cpu"


def test_fake_model_and_inputs_keep_devices_and_requires_grad() -> None:
    model = meta_copy(_Tied())
    x = torch.empty(3, 5, dtype=torch.long, device="meta")
    w = torch.empty(2, 2, device="meta").requires_grad_()
    with FakeTensorMode(allow_non_fake_inputs=True):
        fmodel = fake_model(model, None)  # None: each tensor's own device, the CPU for meta
        memo: dict[int, torch.Tensor] = {}
        fx, (fw, fw2) = fake_inputs((x, [w, w]), None, memo)
        out = fmodel(fx)
    weight = fmodel.embed.weight
    assert is_fake(weight) and weight.device.type == "cpu" and weight.requires_grad
    assert is_fake(fx) and fx.dtype == torch.long and fx.shape == (3, 5)
    assert fw is fw2 and fw.requires_grad and not fx.requires_grad  # one copy per tensor
    assert out.shape == (3, 5, 10)
