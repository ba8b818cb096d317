"""The techniques composed in the documented order (Note: [composition order] in
``memfit.techniques``): chunked loss -> checkpointing -> offload -> torch.compile -> FSDP2, then
the optimizer. Each keeps the math, so one training step matches the plain model's bit for bit."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import memfit.techniques.offload as offload_module
from memfit.models.build import build_model, example_inputs
from memfit.models.spec import TransformerSpec
from memfit.techniques import (
    apply_activation_checkpointing,
    apply_activation_offload,
    apply_chunked_loss,
    make_optimizer,
)

SPEC = TransformerSpec(name="t", family="llama", arch="decoder", hidden_size=32, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
                       vocab_size=512, norm="rmsnorm", position="rope", mlp="swiglu")


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # FSDP2 shards are DTensors


def train_step(model: nn.Module, step_model: nn.Module, inputs: dict[str, torch.Tensor]
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    opt = make_optimizer(model.parameters(), "adamw", impl="for-loop")
    loss = step_model(**inputs)
    loss.backward()
    grads = {n: full(p.grad).clone() for n, p in model.named_parameters()}
    opt.step()
    return loss.detach(), grads


@pytest.mark.slow
def test_all_in_the_documented_order_keep_the_math(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch.distributed.fsdp", reason="needs FSDP2 (torch >= 2.6)")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # On the CPU offload passes tensors through; make it copy them, as it does on a GPU.
    monkeypatch.setattr(offload_module, "stands_for_device", lambda t: t.device.type == "cpu")
    torch.manual_seed(0)
    base = apply_chunked_loss(build_model(SPEC, backend="builtin", device="cpu"), chunk_size=16)
    model = copy.deepcopy(base)
    apply_activation_checkpointing(model, "selective")
    hooks = apply_activation_offload(model, min_bytes=0)
    # aot_eager: AOTAutograd's graphs run by eager kernels (no C++ compiler needed on CPU)
    compiled = torch.compile(model, backend="aot_eager")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        for block in model.model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        inputs = example_inputs(SPEC, batch=2, seq=24, device="cpu")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # dynamo's notes on checkpoint's context_fn
            loss0, grads0 = train_step(base, base, inputs)
            loss1, grads1 = train_step(model, compiled, inputs)
        assert torch.equal(loss0, loss1)
        assert grads0.keys() == grads1.keys()
        for name in grads0:
            assert torch.equal(grads0[name], grads1[name]), name
        for (name, p), q in zip(base.named_parameters(), model.parameters(), strict=True):
            assert torch.equal(p.detach(), full(q.detach())), name
        assert hooks.stats.offloaded > 0
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()
