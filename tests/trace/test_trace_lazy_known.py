"""Known values computed on first read (Note: [lazy known values] in
``memfit/trace/known_values.py``) change nothing.

Expected values come from the eager path (``known_values.EAGER_KNOWN = True``: every op on known
values computed when the fake op runs, the code before the shortcut) and from the real step's own
values (hand-computed sums of the masks below).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from _hf import tiny_hf_llama
from memfit.trace import datadep, estimate, known_values


def _same(a: object, b: object) -> None:
    da, db = dataclasses.asdict(a), dataclasses.asdict(b)
    da.pop("trace_seconds"), db.pop("trace_seconds")  # the only field that may differ
    assert da == db


def _both(model: nn.Module, inputs: object, **kw: object) -> tuple[object, object]:
    lazy = estimate(model, inputs, optimizer="adamw", **kw)
    saved = known_values.EAGER_KNOWN
    known_values.EAGER_KNOWN = True
    try:
        eager = estimate(model, inputs, optimizer="adamw", **kw)
    finally:
        known_values.EAGER_KNOWN = saved
    return lazy, eager


class MaskBranch(nn.Module):
    """Reads a sum of its integer mask input, taken before an in-place op on an alias of it
    changes it: the read value is the pre-mutation one, as in the real step."""

    def __init__(self) -> None:
        super().__init__()
        self.small = nn.Linear(64, 64)
        self.big = nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 64))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        m = mask.clone()
        total = m.sum()  # pending: read only below
        causal = torch.ones(8, 8, dtype=torch.bool).tril()  # never read
        m.view(-1).add_(1)  # writes to m (through a view): every pending run is computed first
        assert causal.shape == (8, 8)
        out = self.small(x) if int(total) == 3 else self.big(x)
        return out.sum() + m.sum()


@pytest.mark.parametrize("ones", [3, 5])
def test_read_before_an_in_place_write_sees_the_old_value(ones: int) -> None:
    """With 3 ones in the mask the real step takes ``small``, with 5 ``big`` (hand count): the
    lazy trace takes the same branch, and its estimate equals the eager one field by field."""
    mask = torch.zeros(2, 4, dtype=torch.long)
    mask.view(-1)[:ones] = 1
    with torch.device("meta"):
        model = MaskBranch()
    x = torch.empty(16, 64, device="meta")
    lazy, eager = _both(model, (x, mask), device="cpu", steps=1)
    _same(lazy, eager)
    ran = {p.module.split(".")[0] for p in lazy.timeline if p.op == "aten.addmm.default"}
    assert ran == ({"small"} if ones == 3 else {"big"})


def test_unread_values_are_not_computed() -> None:
    """An op on known values that nothing reads is not run for real."""
    dd = datadep.DataDependentSizes()
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = mode.from_tensor(torch.ones(4, 4, dtype=torch.long))
    dd.know(fake, torch.ones(4, 4, dtype=torch.long))
    with mode:
        out = torch.ops.aten.tril.default(fake)
    dd.observe(torch.ops.aten.tril.default, (fake,), {}, out)
    value = dd.known[out]
    assert value.run is not None and value.tensor is None  # pending, nothing computed
    with mode:
        total = torch.ops.aten.sum.default(out)
    dd.observe(torch.ops.aten.sum.default, (out,), {}, total)
    assert dd.known_answer(torch.ops.aten._local_scalar_dense.default, (total,)) == 10  # 4+3+2+1
    assert value.run is None and value.tensor is not None  # computed on the read


@pytest.mark.parametrize("padded", [False, True])
def test_hugging_face_masks_lazy_equals_eager(padded: bool) -> None:
    """A Hugging Face Llama with a real attention mask (padded: the masked path) and math-kernel
    fp32 attention: the lazy estimate equals the eager one field by field, both targets."""
    model = tiny_hf_llama()
    ids = torch.zeros(2, 16, dtype=torch.long)
    mask = torch.ones(2, 16, dtype=torch.long)
    if padded:
        mask[1, :5] = 0
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": ids}
    for device, kw in (("cuda", {"gpu": "h100-sxm-80gb"}), ("cpu", {})):
        lazy, eager = _both(model, inputs, device=device, steps=1, **kw)
        _same(lazy, eager)
