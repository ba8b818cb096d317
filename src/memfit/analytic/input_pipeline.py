"""The input pipeline on a plan: device bytes per GPU, host bytes per node, and the node's RAM.

>>> from memfit.models.spec import ParamCountSpec
>>> from memfit.analytic.planner import plan
>>> from memfit.runtime.input_pipeline import DataLoaderSpec
>>> p = plan(ParamCountSpec(name="1B", params=10**9))
>>> q = with_input_pipeline(p, DataLoaderSpec(num_workers=8, prefetch_factor=4,
...                                           batch_bytes=1 << 30, depth=1), host_memory=32 << 30)
>>> q.input_pipeline.fits_host, q.input_pipeline.suggestion.num_workers
(False, 5)

The host check adds, per node, each GPU's pipeline
(:func:`memfit.runtime.input_pipeline.input_pipeline_memory`) and the host memory the plan
already holds for offloaded states (``MemoryPlan.host_bytes`` per GPU); the node's memory is the
``host_memory`` given (``memfit plan --host-memory``): a plan is usually made for another machine
than the one it runs on, so memfit does not read this one's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from memfit.categories import MemoryCategory
from memfit.models.spec import ModelSpec, TransformerSpec
from memfit.runtime.input_pipeline import (
    DataLoaderSpec,
    InputPipelineMemory,
    fitting_settings,
    input_pipeline_memory,
    tokens_sample_bytes,
)
from memfit.units import format_bytes

if TYPE_CHECKING:
    from memfit.analytic.planner import MemoryPlan

__all__ = ["PipelineOnPlan", "default_sample_bytes", "with_input_pipeline"]


def default_sample_bytes(model: ModelSpec, seq: int | None) -> int | None:
    """One sample's bytes when the user gives none: a language model's input ids and labels
    (int64, ``seq`` tokens each); a vision model's fp32 image and int64 label; None otherwise."""
    if not isinstance(model, TransformerSpec):
        return None
    if model.arch == "vision":
        return 4 * model.num_channels * model.image_size ** 2 + 8
    return tokens_sample_bytes(seq or model.default_seq_len)


@dataclass(frozen=True, kw_only=True)
class PipelineOnPlan:
    """The input pipeline's memory for a plan, and the node's host memory check."""

    memory: InputPipelineMemory
    gpus_on_node: int
    offload_node_bytes: int
    """Host memory for offloaded states on the node (the plan's ``host_bytes`` x GPUs)."""
    host_memory: int | None
    """The node's memory (``--host-memory``), or None: not checked."""
    suggestion: DataLoaderSpec | None = None
    """With the node over its memory: the nearest settings that fit (None when none do)."""

    @property
    def node_bytes(self) -> int:
        return self.memory.host_node_bytes + self.offload_node_bytes

    @property
    def fits_host(self) -> bool | None:
        return None if self.host_memory is None else self.node_bytes <= self.host_memory

    def lines(self) -> list[str]:
        """The plan's lines about the pipeline (the host warning, when over, first)."""
        out = [self.memory.describe()]
        if self.fits_host is False:
            assert self.host_memory is not None
            offload = (f" + offloaded states {format_bytes(self.offload_node_bytes)} = "
                       f"{format_bytes(self.node_bytes)}" if self.offload_node_bytes else "")
            fix = ("no DataLoader setting fits: lower the batch or the offload"
                   if self.suggestion is None else
                   f"fits with {_settings(self.suggestion)} "
                   f"({format_bytes(input_pipeline_memory(self.suggestion).host_node_bytes)} "
                   f"per node)")
            out.insert(0, f"warning: host memory: input pipeline "
                       f"{format_bytes(self.memory.host_node_bytes)}{offload} per node of "
                       f"{self.gpus_on_node} GPUs, "
                       f"over the node's {format_bytes(self.host_memory)}; {fix}")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {**self.memory.to_dict(), "gpus_on_node": self.gpus_on_node,
                "offload_bytes_per_node": self.offload_node_bytes,
                "host_bytes_per_node_total": self.node_bytes, "host_memory": self.host_memory,
                "fits_host": self.fits_host,
                "suggestion": None if self.suggestion is None else self.suggestion.to_dict()}


def _settings(spec: DataLoaderSpec) -> str:
    return (f"workers={spec.num_workers},prefetch={spec.prefetch}" if spec.num_workers
            else "workers=0")


def with_input_pipeline(plan: MemoryPlan, spec: DataLoaderSpec, *, host_memory: int | None = None,
                        gpus_per_node: int = 8) -> MemoryPlan:
    """``plan`` with ``spec``'s pipeline: its DevicePrefetcher batches (``depth``) added to
    ``ACTIVATIONS`` on each GPU, and the host side (with the offload) checked against
    ``host_memory`` per node."""
    on_node = min(plan.run.parallel.gpus, gpus_per_node)
    spec = dataclasses.replace(spec, gpus_per_node=on_node)
    memory = input_pipeline_memory(spec)
    offload = plan.host_bytes * on_node
    suggestion = None
    if host_memory is not None and memory.host_node_bytes + offload > host_memory:
        suggestion = fitting_settings(spec, host_memory - offload)
    report = PipelineOnPlan(memory=memory, gpus_on_node=on_node, offload_node_bytes=offload,
                            host_memory=host_memory, suggestion=suggestion)
    breakdown = dict(plan.breakdown)
    breakdown[MemoryCategory.ACTIVATIONS] += memory.device_bytes
    return dataclasses.replace(plan, breakdown=breakdown, input_pipeline=report)
