"""The FLOPs and aten ops of one training sample that
:func:`memfit.fitting.rightsize.rightsize_training` feeds ``fit``'s cost model: counted by
``FlopCounterMode`` on fake tensors with the techniques applied (as ``fit``'s ``count_flops``),
on the model cut to one and to two blocks and extended linearly to all of them (exact for a
stack of identical blocks)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__: list[str] = []


@dataclass(frozen=True)
class _Counted:
    flops: float
    """Forward + backward (+ recompute) FLOPs of one sample."""
    ops: int
    """Aten ops dispatched for one micro-batch."""
    sac_ops: int = 0
    """Ops selective checkpointing's dispatch modes see (``memfit.fitting.traced.
    selective_ops``); 0 without it."""
    linear_flops: float = 0.0
    """Of :attr:`flops`, the matmuls of the linear layers (``aten.mm`` / ``aten.addmm``): what
    fp8 training (torchao's float8 linears) runs at the fp8 rate; attention stays 16-bit."""

    def plus(self, other: _Counted, times: int = 1) -> _Counted:
        """``self + times x other``, term by term."""
        return _Counted(flops=self.flops + times * other.flops, ops=self.ops + times * other.ops,
                        linear_flops=self.linear_flops + times * other.linear_flops,
                        sac_ops=self.sac_ops + times * other.sac_ops)

    def minus(self, other: _Counted) -> _Counted:
        return _Counted(flops=self.flops - other.flops, ops=self.ops - other.ops,
                        linear_flops=self.linear_flops - other.linear_flops,
                        sac_ops=self.sac_ops - other.sac_ops)


def _count(spec: Any, run: Any, seq: int) -> _Counted:
    """FLOPs and ops of one sample of ``spec`` run as ``run`` says, on fake tensors: the
    techniques applied as ``fit``'s ``count_flops`` applies them."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import FlopCounterMode

    from memfit._loss import model_loss
    from memfit._tensors import fake_inputs, fake_model
    from memfit.models.build import build_model, example_inputs
    from memfit.techniques.recipe import apply_techniques

    class _Ops(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            # A fake tensor's ``.device`` is a dispatched op (two or so per real op) that no
            # kernel launch answers; the trace does not count it either (``trace/tracker.py``).
            if func is not torch.ops.prim.device.default:
                self.n += 1
            return func(*args, **(kwargs or {}))

    recipe = dataclasses.replace(run.recipe, qlora=False, parallel=None, micro_batch=1,
                                 accumulation=1)
    base = build_model(spec, device="meta")
    # The techniques go on the meta model: LoRA's adapters cast the base (``model.to``), which
    # fake parameters refuse.
    apply_techniques(base, recipe)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = fake_model(base, "cpu")
        inputs = fake_inputs(example_inputs(spec, batch=1, seq=seq), "cpu")
        ops = _Ops()
        with FlopCounterMode(display=False) as counter, ops:
            model_loss(model, inputs).backward()
    linear = sum(f for op, f in counter.get_flop_counts().get("Global", {}).items()
                 if str(op) in _LINEAR_OPS)
    sac = 0
    if recipe.checkpointing == "selective":
        from memfit.fitting.traced import selective_ops

        plain = build_model(spec, device="meta")
        apply_techniques(plain, dataclasses.replace(recipe, checkpointing="none",
                                                    checkpoint_modes=None))
        sac = selective_ops(plain, example_inputs(spec, batch=1, seq=seq),
                            ("selective",) * spec.num_layers)
    return _Counted(flops=float(counter.get_total_flops()), ops=ops.n,
                    linear_flops=float(linear), sac_ops=sac)


_LINEAR_OPS = ("aten.mm", "aten.addmm")


def _architecture(spec: Any) -> Any:
    """What of ``spec`` the counts depend on: a builtin :class:`~memfit.models.spec.
    TransformerSpec` without its name and source (labels: two config files of the same
    architecture in two folders count the same), any other spec whole (a Hugging Face spec's
    equality leaves its config out, so its source stays in the key)."""
    from memfit.models.spec import TransformerSpec

    if isinstance(spec, TransformerSpec):
        return dataclasses.replace(spec, name="", source=None)
    return spec


_COUNTS: dict[tuple[Any, ...], _Counted] = {}
"""The counts of every search in this process, by model, LoRA, attention, seq and policy."""


class _Counter:
    """FLOPs and ops per checkpointing policy (and chunked loss), counted on one and two blocks
    and extended to every block (the blocks are identical: ``total(L) = c(1) + (L - 1) (c(2) -
    c(1))``). The chunked loss changes only the head and the loss, so its difference is counted
    once, on one block without checkpointing, and added to each policy's count."""

    def __init__(self, spec: Any, run: Any, seq: int) -> None:
        self.spec, self.run, self.seq = spec, run, seq
        # What the counts depend on (not the precision, optimizer, batch or layout), so that
        # later searches in the process reuse them.
        self.key = (_architecture(spec), run.mode, run.lora_rank, run.lora_targets,
                    run.attention, seq)
        self.cache = _COUNTS

    def _raw(self, ckpt: str, chunked: bool, layers: int) -> _Counted:
        key = (*self.key, ckpt, chunked, layers)
        if key not in self.cache:
            run = dataclasses.replace(self.run, checkpointing=ckpt, chunked_loss=chunked)
            self.cache[key] = _count(dataclasses.replace(self.spec, num_layers=layers), run,
                                     self.seq)
        return self.cache[key]

    def __call__(self, ckpt: str, chunked: bool = False) -> _Counted:
        layers = self.spec.num_layers
        one = self._raw(ckpt, False, 1)
        total = one if layers == 1 else one.plus(self._raw(ckpt, False, 2).minus(one),
                                                 layers - 1)
        if chunked:
            total = total.plus(self._raw("none", True, 1).minus(self._raw("none", False, 1)))
        return total
