"""Expert parallelism for transformers' MoE experts (Mixtral, Qwen3-MoE, DeepSeek-V3, gpt-oss
and every other experts class transformers decorates with ``use_experts_implementation``).

transformers 5 stores a layer's experts as one module of fused 3-D parameters
(``transformers/models/mixtral/modeling_mixtral.py: MixtralExperts``: ``gate_up_proj``
``[experts, 2 * intermediate, hidden]``, ``down_proj`` ``[experts, hidden, intermediate]``;
gpt-oss: transposed, with biases, ``GptOssExperts``), called by the layer's block as
``experts(hidden_states [tokens, hidden], top_k_index [tokens, k], top_k_weights [tokens, k])``
after the block's own router. :func:`apply_hf_ep` keeps this rank's ``num_experts / ep`` slices
of each such parameter (dim 0, torchtitan's ``Shard(0)``) and swaps the module's forward for
:meth:`HFExpertParallel.forward`, which exchanges the tokens by all-to-all as memfit's builtin
expert parallelism does (:mod:`memfit.parallel.expert`). The router, the shared experts
(DeepSeek-V3) and every other parameter stay whole on each rank.

Note: [capacity dispatch on transformers' experts] transformers' own experts paths (eager loop,
``batched_mm``, ``grouped_mm``: ``transformers/integrations/moe.py``) run every routed token (no
drop), so the tokens per expert, and with expert parallelism the all-to-all's split sizes,
depend on the router. The expert-parallel forward instead gives every expert a buffer of
``capacity = min(tokens, ceil(tokens * k * capacity_factor / num_experts))`` slots (GShard /
Switch Transformer; the builtin ``MoE``'s dispatch,
``memfit.models.builtin_layers.dispatch_slots``), so the exchange has equal splits and every
size is known before the step: at the default ``capacity_factor=1.0``, the balanced load the
one-rank trace assumes (``memfit/trace/datadep.py``), whatever the router does; assignments past
an expert's capacity are dropped (the residual carries the token on). ``capacity_factor=None``
(capacity = tokens) drops nothing and computes exactly what transformers' experts compute, with
``num_experts / k`` times larger buffers.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from memfit.models.builtin_layers import dispatch_slots


def is_hf_experts(module: Any) -> bool:
    """Whether ``module`` is a transformers experts module of fused 3-D parameters (its class
    decorated by ``transformers.integrations.moe.use_experts_implementation``, which sets
    ``_is_expert_parallel``, ``has_gate``, ``has_bias``, ``is_transposed``)."""
    down = getattr(module, "down_proj", None)
    return (isinstance(module, nn.Module) and hasattr(module, "_is_expert_parallel")
            and hasattr(module, "has_gate")
            and isinstance(getattr(module, "num_experts", None), int)
            and isinstance(down, torch.Tensor) and down.dim() == 3)


def hf_moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The blocks of ``model`` whose ``experts`` child is a transformers experts module (e.g.
    ``model.layers.1.mlp`` of a Mixtral), by name."""
    return [(name, mod) for name, mod in model.named_modules()
            if is_hf_experts(getattr(mod, "experts", None))]


def expert_count(block: nn.Module) -> int:
    """The experts of a transformers MoE block, every rank's together."""
    experts: Any = block.experts
    return int(getattr(experts, "ep_experts", experts.num_experts))


def hf_expert_numel(block: nn.Module) -> int:
    """The parameters expert parallelism splits in a transformers MoE block: its experts
    module's tensors stacked on the experts (dim 0), every rank's together."""
    experts: Any = block.experts
    total, ep = expert_count(block), int(getattr(experts, "ep_size", 1))
    return sum(int(p.numel()) * ep for p in experts.parameters(recurse=False)
               if p.dim() >= 1 and p.shape[0] == total // ep)


def hf_top_k(block: nn.Module) -> int:
    """Experts per token of a transformers MoE block: the block's or its router's ``top_k``
    (Mixtral, Qwen3-MoE, gpt-oss), else the config's ``num_experts_per_tok`` (DeepSeek-V3)."""
    owners: tuple[Any, ...] = (block, getattr(block, "gate", None), getattr(block, "router", None))
    for owner in owners:
        if isinstance(getattr(owner, "top_k", None), int):
            return int(owner.top_k)
    config = getattr(block, "config", None) or getattr(block.experts, "config", None)
    return int(getattr(config, "num_experts_per_tok", 0) or 0)


class HFExpertParallel(nn.Module):
    """The expert-parallel forward of a transformers experts module, mixed in before its class
    by :func:`apply_hf_ep` (the module keeps its name, its parameters' names and ``_apply_gate``):
    this rank holds experts ``[index * local, (index + 1) * local)`` of ``ep_experts``."""

    ep_group: Any
    ep_size: int
    ep_experts: int
    capacity_factor: float | None
    # What transformers' experts class and its decorator define (use_experts_implementation).
    has_gate: bool
    has_bias: bool
    is_transposed: bool
    down_proj: torch.Tensor
    act_fn: Any
    _apply_gate: Any
    post_expert_norm: Any

    tp_mesh: Any = None
    """The tensor-parallel mesh beside expert parallelism (each tp rank exchanges its share of
    the tokens), or None."""
    ep_mesh: Any = None
    """The ``(efsdp, ep)`` mesh of ``memfit.parallel.expert.ep_mesh``, or None."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """The exchange below; beside tensor parallelism on this tp rank's chunk of the tokens
        and their routing, the output all-gathered (Note: [expert parallelism beside tensor
        parallelism] in memfit/parallel/expert.py)."""
        if self.tp_mesh is None:
            return self.exchange(hidden_states, top_k_index, top_k_weights)
        from memfit.parallel.expert import tp_chunk, tp_gather

        mesh = self.tp_mesh
        if hidden_states.shape[0] % mesh.size():
            from memfit.errors import MemfitError

            raise MemfitError(f"Parallel(tp={mesh.size()}, ep={self.ep_size}): the "
                              f"{hidden_states.shape[0]} tokens of a step do not split evenly "
                              f"over the {mesh.size()} tensor-parallel ranks that route them; "
                              f"use batch * sequence divisible by {mesh.size()}")
        local = top_k_index.chunk(mesh.size())[mesh.get_local_rank()]
        out = self.exchange(tp_chunk(hidden_states, mesh), local, tp_chunk(top_k_weights, mesh))
        return tp_gather(out, mesh)

    def exchange(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        from torch.distributed import _functional_collectives as funcol

        tokens, hidden = hidden_states.shape
        k, experts, ep = top_k_index.shape[-1], self.ep_experts, self.ep_size
        local = experts // ep
        capacity = tokens if self.capacity_factor is None else max(1, min(tokens, math.ceil(
            tokens * k * self.capacity_factor / experts)))
        dest, token = dispatch_slots(top_k_index.reshape(-1), k, experts, capacity)
        buffers = hidden_states.new_zeros(experts * capacity + 1, hidden).index_add(
            0, dest, hidden_states.index_select(0, token))
        # Dispatch: chunk j of the buffers (rank j's experts) goes to rank j, arriving rank-major
        # [ep, local, capacity, hidden], made expert-major for the batched matmuls (as
        # memfit.parallel.expert.ExpertParallelMoE.run_experts does).
        received = funcol.all_to_all_single_autograd(
            buffers[:experts * capacity], None, None, self.ep_group)
        mine = received.view(ep, local, capacity, hidden).transpose(0, 1).reshape(
            local, ep * capacity, hidden)
        out = self.run_local(mine)
        back = out.view(local, ep, capacity, hidden).transpose(0, 1).reshape(
            experts * capacity, hidden)
        returned = funcol.all_to_all_single_autograd(back, None, None, self.ep_group)
        returned = torch.cat((returned, returned.new_zeros(1, hidden)))  # the dropped row: 0
        weighted = returned.index_select(0, dest) * top_k_weights.reshape(-1, 1).to(
            returned.dtype)
        return weighted.view(tokens, k, hidden).sum(dim=1).to(hidden_states.dtype)

    def run_local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's experts on their buffers, ``[local, slots, hidden]`` in and out: the
        math of transformers' ``batched_mm_experts_forward`` (up or gate-up projection, the
        class's ``_apply_gate`` or activation, down projection, biases, post-expert norm), one
        batched matmul per projection."""
        up = "gate_up_proj" if self.has_gate else "up_proj"
        proj = self._linear(x, getattr(self, up), getattr(self, f"{up}_bias", None))
        proj = self._apply_gate(proj) if self.has_gate else self.act_fn(proj)
        out = self._linear(proj, self.down_proj, getattr(self, "down_proj_bias", None))
        if getattr(self, "has_post_expert_norm", False):
            out = self.post_expert_norm(out)
        return out

    def _linear(self, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        w = weight if self.is_transposed else weight.transpose(1, 2)  # [local, in, out]
        if bias is None or not self.has_bias:
            return torch.bmm(x, w)
        return torch.baddbmm(bias[:, None, :], x, w)


_EP_CLASSES: dict[type, type] = {}


def _ep_class(cls: type) -> type:
    """``cls`` with :class:`HFExpertParallel`'s forward first (one class per experts class)."""
    if cls not in _EP_CLASSES:
        _EP_CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (HFExpertParallel, cls), {})
    return _EP_CLASSES[cls]


def apply_hf_ep(block: nn.Module, group: Any, index: int, ep: int,
                capacity_factor: float | None = 1.0, tp_mesh: Any = None) -> None:
    """Expert parallelism on one transformers MoE ``block`` (in place): its experts module keeps
    experts ``[index * E / ep, (index + 1) * E / ep)`` of each parameter stacked on dim 0 (the
    weights and their biases) and runs the expert-parallel forward over ``group``. Applying it
    twice changes nothing."""
    experts: Any = block.experts
    if isinstance(experts, HFExpertParallel):
        return
    total = int(experts.num_experts)
    local = total // ep
    for attr, param in list(experts.named_parameters(recurse=False)):
        if param.dim() >= 1 and param.shape[0] == total:
            shard = param.detach()[index * local:(index + 1) * local].clone()
            setattr(experts, attr, nn.Parameter(shard, requires_grad=param.requires_grad))
    experts.__class__ = _ep_class(type(experts))
    experts.ep_group, experts.ep_size, experts.ep_experts = group, ep, total
    experts.capacity_factor = capacity_factor
    experts.num_experts = local
    experts.tp_mesh = tp_mesh
