"""The trace's cheaper fake-tensor cache key (``memfit/trace/fastkey.py``) changes nothing.

Expected values come from an independent code path: the same trace with torch's own cache keys
(``MEMFIT_SLOW_KEYS=1``, i.e. ``torch/_subclasses/fake_tensor.py: FakeTensorMode._cache_key`` and
``_prep_args_for_hash`` unchanged), the fake tensor cache emptied before each run. The models
cover repeated identical blocks (a Llama- and a GPT-2-shaped transformer), blocks that differ,
checkpointed blocks and a block with a forward hook, on both targets.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode, _CacheKeyState
from torch.utils.checkpoint import checkpoint

from _hf import tiny_hf_llama
from memfit.trace import estimate, fastkey
from memfit.trace.tracker import TrackingFakeMode


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, 4, d // 4).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(x)))


class Stack(nn.Module):
    """Blocks of the given widths (hidden sizes) between an embedding and a head; ``ckpt``:
    activation checkpointing of each block."""

    def __init__(self, hiddens: list[int], dim: int = 32, vocab: int = 64,
                 ckpt: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, h) for h in hiddens)
        self.head = nn.Linear(dim, vocab)
        self.ckpt = ckpt

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.ckpt else block(x)
        logits = self.head(x)
        return F.cross_entropy(logits.flatten(0, 1), idx.flatten())


def _hf_llama() -> nn.Module:
    return tiny_hf_llama(layers=3)


def _hf_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=64, n_layer=3, n_head=4, vocab_size=128, n_positions=64)
    with torch.device("meta"):
        return GPT2LMHeadModel(cfg)


def _hooked() -> nn.Module:
    model = Stack([64, 64, 64])
    model.blocks[1].register_forward_hook(lambda _m, _a, out: out * 2)
    return model


MODELS = {
    "hf-llama": (_hf_llama, True),
    "hf-gpt2": (_hf_gpt2, True),
    "different-blocks": (lambda: Stack([48, 96, 64]), False),
    "checkpointed-blocks": (lambda: Stack([64, 64, 64], ckpt=True), False),
    "hooked-block": (_hooked, False),
}


def _trace(model: nn.Module, hf: bool, device: str, precision: str, slow: bool,
           monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    monkeypatch.setenv("MEMFIT_SLOW_KEYS", "1" if slow else "0")
    FakeTensorMode.cache_clear()
    idx = torch.zeros(2, 16, dtype=torch.long)
    inputs = {"input_ids": idx, "labels": idx} if hf else idx
    gpu = {"gpu": "a100-40gb"} if device == "cuda" else {}
    est = estimate(model, inputs, device=device, precision=precision, steps=2, **gpu)
    fast = sum(any(isinstance(v, tuple) and v and v[0] is fastkey._TENSOR for v in key.key)
               for key in FakeTensorMode.cache)
    assert (fast > 0) == (not slow)  # the path under test ran (or, slow, did not)
    fields = {f.name: getattr(est, f.name) for f in dataclasses.fields(est)}
    del fields["trace_seconds"]
    return fields


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize(("device", "precision"), [("cuda", "fp32"), ("cpu", "bf16-mixed")])
def test_fast_keys_give_the_same_estimate(name: str, device: str, precision: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Peak, reserved peak, per-category bytes, the whole timeline (op, phase, module and the
    bytes per category after each op), per-module attribution and per-op kernel peaks are
    identical with torch's own keys and with the fast ones."""
    if not fastkey.supported():
        pytest.fail("torch's TensorMetadata fields changed: review memfit/trace/fastkey.py")
    make, hf = MODELS[name]
    if hf:
        pytest.importorskip("transformers")
    model = make()
    expected = _trace(model, hf, device, precision, True, monkeypatch)
    got = _trace(model, hf, device, precision, False, monkeypatch)
    assert got["timeline"] == expected["timeline"]
    assert got == expected


def test_torch_metadata_fields_are_the_ones_the_fast_key_stands_for() -> None:
    """Fails loudly when torch changes what its fake-tensor cache keys on
    (``torch/_subclasses/fake_tensor.py: TensorMetadata``): the fast key must then be reviewed
    (it switches itself off meanwhile)."""
    fields = tuple(f.name for f in dataclasses.fields(
        torch._subclasses.fake_tensor.TensorMetadata))
    assert fields == fastkey.EXPECTED_FIELDS
    assert fastkey.supported()


def _keys(mode: TrackingFakeMode, func: object, args: tuple[object, ...]) -> object:
    return mode._cache_key(_CacheKeyState(None), func, args, {})


def test_fast_keys_tell_apart_what_torch_tells_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """For pairs of argument lists, two calls share a fast key exactly when they share torch's
    key: same shape with other strides, offset, dtype, requires_grad or storage size differ; a
    fresh tensor of the same metadata does not; 1, 1.0 and True differ."""
    from memfit.trace.datadep import DataDependentSizes
    from memfit.trace.tracker import Tracker

    mode = TrackingFakeMode(Tracker("cpu"), DataDependentSizes(None), lambda _n: None)
    with mode:
        base = torch.empty(4, 6)
        cases = {
            "same": torch.empty(4, 6),
            "transposed": torch.empty(6, 4).t(),
            "offset": torch.empty(30)[6:].view(4, 6),
            "bigger storage": torch.empty(5, 6)[:4],
            "dtype": torch.empty(4, 6, dtype=torch.bfloat16),
            "requires_grad": torch.empty(4, 6, requires_grad=True),
        }
    add = torch.ops.aten.add.Tensor
    for slow in (True, False):
        mode.fast_keys = not slow
        k0 = _keys(mode, add, (base, base))
        same = {name: _keys(mode, add, (t, base)) == k0 for name, t in cases.items()}
        scalars = [_keys(mode, torch.ops.aten.mul.Scalar, (base, s)) for s in (1, 1.0, True)]
        if slow:
            expected_same, expected_scalars = same, len(set(scalars))
        else:
            assert same == expected_same
            assert len(set(scalars)) == expected_scalars
    assert expected_same == {"same": True, "transposed": False, "offset": False,
                             "bigger storage": False, "dtype": False, "requires_grad": False}
    assert expected_scalars == 3


def test_unsafe_view_shares_view_fake_impl() -> None:
    """``aten._unsafe_view`` is dispatched as ``aten.view`` only while torch registers one fake
    implementation for both (``torch/_subclasses/fake_impls.py: _view_meta``); the result is a
    view of the input's storage either way (no new allocation for the tracker)."""
    from torch._subclasses import fake_impls

    aten = torch.ops.aten
    impls = fake_impls.op_implementations_dict
    assert impls[aten._unsafe_view.default] is impls[aten.view.default]
    assert fastkey.SAME_FAKE_IMPL == {aten._unsafe_view.default: aten.view.default}
    with FakeTensorMode() as mode:
        x = torch.empty(2, 3, 4)
        out = aten._unsafe_view.default(x, [6, 4])
        assert fastkey.cacheable_twin(aten._unsafe_view.default, (x, [6, 4])) is aten.view.default
    assert mode is not None
    assert out.untyped_storage()._cdata == x.untyped_storage()._cdata
    assert (tuple(out.shape), out.stride()) == ((6, 4), (4, 1))
