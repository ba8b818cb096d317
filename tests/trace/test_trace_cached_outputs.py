"""A fake-cache hit's output built by ``memfit/trace/fastkey.py`` (Note: [cached outputs]) is the
tensor torch builds.

Expected values come from torch's own path: a plain ``FakeTensorMode`` running the same ops
(``torch/_subclasses/fake_tensor.py: FakeTensorMode._get_output_tensor_from_cache_entry``), hits
in both (each op runs twice, the second a hit).
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from memfit.trace import fastkey


class FastMode(fastkey.FastCacheKey, FakeTensorMode):
    fast_keys = True


OPS = {
    "matmul": lambda a, b: a @ b,
    "transpose (a view)": lambda a, b: a.t(),
    "slice (a view with an offset)": lambda a, b: a[1:, 2:],
    "add": lambda a, b: a + b.t(),
    "to bf16": lambda a, b: a.to(torch.bfloat16),
    "conj of complex": lambda a, b: torch.complex(a, a).conj(),
    "neg bit": lambda a, b: torch.complex(a, a).conj().imag,
    "split (tuple of views)": lambda a, b: a.split(2),
    "requires grad": lambda a, b: a.detach().requires_grad_() * 2,
}


def _describe(t: torch.Tensor, inputs: tuple[torch.Tensor, ...]) -> tuple[object, ...]:
    attrs = {k: (v if k != "fake_mode" else None) for k, v in vars(t).items()}
    shares = tuple(t.untyped_storage()._cdata == i.untyped_storage()._cdata for i in inputs)
    return (type(t), t.dtype, t.shape, t.stride(), t.storage_offset(), t.device, t.layout,
            t.requires_grad, t.is_conj(), t.is_neg(), t.untyped_storage().nbytes(), shares,
            t.is_leaf, sorted(attrs.items(), key=lambda kv: kv[0]), t.fake_device)


def _run(mode: FakeTensorMode, name: str, device: str) -> list[tuple[object, ...]]:
    with mode:
        a = torch.empty(6, 8, device=device)
        b = torch.empty(8, 6, device=device)
        outs = []
        for _ in range(2):  # the second is a cache hit
            out = OPS[name](a, b)
            outs.append(out)
    hits = mode.cache_hits
    assert hits >= 1, name
    results = []
    for out in outs:
        flat = out if isinstance(out, tuple) else (out,)
        assert all(type(t) is FakeTensor and t.fake_mode is mode for t in flat)
        results.append([_describe(t, (a, b)) for t in flat])
    return results


@pytest.mark.parametrize("device", ["cpu"])  # CUDA fakes: tests/trace/test_trace_fastkey.py
@pytest.mark.parametrize("name", list(OPS))
def test_hit_equals_torchs(name: str, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    made = []
    new_fake = fastkey._new_fake
    monkeypatch.setattr(fastkey, "_new_fake", lambda *a: made.append(1) or new_fake(*a))
    FakeTensorMode.cache_clear()
    fast = _run(FastMode(allow_non_fake_inputs=False), name, device)
    assert made  # the hit took the shortcut
    FakeTensorMode.cache_clear()
    slow = _run(FakeTensorMode(), name, device)
    assert fast == slow
    assert fast[0] == fast[1]  # the hit equals the miss
