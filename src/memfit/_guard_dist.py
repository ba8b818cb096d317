"""How the ranks of a distributed model agree inside :class:`memfit.oom_guard.GuardedStep`.

Note: [OOM agreement under DDP] (the behaviour is described in :mod:`memfit.oom_guard`). Every
collective here is reached by every rank at the same point of a step, whatever happened on it:

1. :meth:`RankAgreement.begin_batch`: rank 0's buffers are broadcast (DDP's own
   ``broadcast_buffers`` is switched off, a rank that ran out of memory would miss it);
2. :meth:`RankAgreement.micro_batch`: the micro-batch size is the smallest any rank wants
   (``ReduceOp.MIN``);
3. :meth:`RankAgreement.outcome`: after each attempt (run under ``no_sync``) the outcome is the
   worst of the ranks' (``ReduceOp.MAX`` over ``OK < OOM < ERROR``);
4. :meth:`RankAgreement.average_gradients`: once all succeeded, the gradients are averaged in
   one flat all-reduce per dtype and device, as DDP's reducer would.

:func:`global_item_count` (the batch's items over all ranks, once per batch) and
:func:`fsdp_ranks` (FSDP cannot retry on one rank) are used with any ``torch.distributed`` run.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from memfit._compat.torch_internals import flatten_dense_tensors, unflatten_dense_tensors

__all__ = ["ERROR", "OK", "OOM", "RankAgreement", "fsdp_ranks", "global_item_count"]

OK, OOM, ERROR = 0, 1, 2  # an attempt's outcome, agreed across DDP ranks by its maximum


def _initialized() -> bool:
    dist = torch.distributed
    return bool(dist.is_available() and dist.is_initialized())


def global_item_count(num_items: int) -> tuple[int, int]:
    """``(items over all ranks, world size)``; ``(num_items, 1)`` without ``torch.distributed``."""
    if not _initialized():
        return num_items, 1
    dist = torch.distributed
    total = torch.tensor(num_items, dtype=torch.long)
    if dist.get_backend() == "nccl":
        total = total.cuda()
    dist.all_reduce(total)
    return int(total.item()), dist.get_world_size()


def fsdp_ranks(model: nn.Module) -> int:
    """The number of ranks when the model is sharded with FSDP (FSDP2 or FSDP1), else 0."""
    if not _initialized():
        return 0
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:  # torch < 2.6: no FSDP2
        from torch.distributed.fsdp import FullyShardedDataParallel

        kinds: tuple[type, ...] = (FullyShardedDataParallel,)
    else:
        kinds = (FSDPModule, FullyShardedDataParallel)
    return torch.distributed.get_world_size() if isinstance(model, kinds) else 0


class RankAgreement:
    """The collectives that keep a ``DistributedDataParallel`` model's ranks in step.

    ``active`` is False (and nothing is communicated) unless ``torch.distributed`` is initialised
    and the model is a ``DistributedDataParallel``; ``active`` is read once per batch.
    """

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device

    @property
    def active(self) -> bool:
        if not _initialized():
            return False
        from torch.nn.parallel import DistributedDataParallel

        return isinstance(self.model, DistributedDataParallel)

    def _all_reduce(self, value: int, op: Any) -> int:
        dist = torch.distributed
        t = torch.tensor([value], dtype=torch.long)
        if dist.get_backend() == "nccl":
            t = t.to(self.device)
        dist.all_reduce(t, op=op)
        return int(t.item())

    def begin_batch(self) -> None:
        """Rank 0's buffers to every rank before the batch, as DDP does before each forward
        (``broadcast_buffers``), here at a point every rank reaches: DDP's own broadcast is
        switched off for the attempts, where a rank that ran out of memory would miss it."""
        model: Any = self.model
        if model.broadcast_buffers:
            for b in model.module.buffers():
                torch.distributed.broadcast(b, src=0)
        model.require_forward_param_sync = False

    def micro_batch(self, micro: int) -> int:
        """The micro-batch size every rank uses: the smallest any rank wants."""
        return self._all_reduce(micro, torch.distributed.ReduceOp.MIN)

    def outcome(self, outcome: int) -> int:
        """The attempt's outcome on the worst rank (``ERROR`` > ``OOM`` > ``OK``)."""
        return self._all_reduce(outcome, torch.distributed.ReduceOp.MAX)

    def raise_elsewhere(self) -> None:
        """Tell the other ranks that this one raised (they raise too instead of waiting)."""
        self.outcome(ERROR)

    def average_gradients(self) -> None:
        """Average the gradients over the ranks, as DDP's reducer would; a parameter without a
        gradient on a rank contributes zeros."""
        dist = torch.distributed
        world = dist.get_world_size()
        # Parameters DDP leaves out (``DistributedDataParallel.parameters_to_ignore``, qualified
        # names in its module: expert parallelism's own experts) are not averaged either.
        ignored = getattr(self.model, "parameters_to_ignore", set())
        inner = getattr(self.model, "module", self.model)
        params = [p for name, p in inner.named_parameters()
                  if p.requires_grad and name not in ignored]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for p in params:
            assert p.grad is not None
            groups.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
        for grads in groups.values():
            flat = flatten_dense_tensors(grads)
            dist.all_reduce(flat)
            flat.div_(world)
            for g, reduced in zip(grads, unflatten_dense_tensors(flat, grads), strict=True):
                g.copy_(reduced)
