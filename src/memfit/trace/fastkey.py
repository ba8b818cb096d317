"""A cheaper fake-tensor cache key for the trace's fake mode, with the same hits and outputs.

Note: [fast cache key] Most of a trace's time is fake-tensor dispatch, and a third of that is
building the key of the fake mode's op cache (``torch/_subclasses/fake_tensor.py:
FakeTensorMode._cache_key``): for each tensor argument ``_prep_args_for_hash`` builds a
``TensorMetadata`` (``extract_tensor_metadata``: the suggested memory format and a contiguity
check in Python, three sparse-layout checks) and flattens its 17 fields one by one
(``TensorMetadata._flatten_into``, through ``dataclasses.fields``). For the tensors a trace
passes (this mode's own dense fake tensors, concrete sizes, not quantized), the key here records
the same facts in one tuple: dtype, shape, stride, device, storage offset, storage bytes,
requires_grad, conj, neg, inference. The fields it leaves out are constants on that path
(layout strided, not sparse, not quantized) or functions of shape and stride (the memory format
and whether the tensor is contiguous in it), so two calls get one key here exactly when they get
one key from torch, and the cache returns what it would have returned: the same cache entry
logic (``_cached_dispatch_impl``, ``_make_cache_entry``, ``_output_from_cache_entry``) runs
unchanged on top of it. Anything else (SymInts, sparse or quantized tensors, another mode's fake
tensors, graph modules) is keyed by torch's own code. The keys carry a marker object torch never
emits, so they cannot meet a key that another fake mode in the process (sharing the class-level
cache) built from different arguments.

``MEMFIT_SLOW_KEYS=1`` turns this off (torch's keys throughout), e.g. to compare.

Note: [identical blocks] Reusing the trace of one decoder block for its identical siblings was
weighed and not built. The fake mode's cache already serves the second to last blocks op by op
(after the first block nearly every op of the others is a cache hit), so what a block-level
replay could still save is the per-op key and lookup, about a tenth of the trace once the key is
the one here. The rest must run anyway: each block's
outputs must exist as fake tensors for the blocks after it, autograd must record each block's
graph (saved tensors, hooks, checkpointing) for the backward to make every parameter's gradient,
and the optimizer needs those gradients.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import (
    FakeTensor,
    FakeTensorConfig,
    TensorMetadata,
    in_kernel_invocation_manager,
)

_TENSOR = object()  # marks a tensor keyed here
_DELEGATED = object()  # marks an argument keyed by torch's code
_STRIDED = torch.strided

# TensorMetadata's fields (checked on torch 2.11 and 2.13): the key below stands for all of
# them. A torch that adds a field may key on something this key does not record, so the fast
# key is then off.
EXPECTED_FIELDS = ("dtype", "shape", "stride", "device", "layout", "memory_format",
                   "storage_offset", "storage_bytes", "requires_grad", "is_quantized", "is_conj",
                   "is_neg", "is_inference", "is_sparse", "is_coalesced", "dense_dim",
                   "sparse_dim")
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
          torch.memory_format)


def supported() -> bool:
    """Whether the installed torch keys fake tensors by the fields the fast key stands for."""
    if not dataclasses.is_dataclass(TensorMetadata):
        return False
    fields = tuple(f.name for f in dataclasses.fields(TensorMetadata))
    return fields == EXPECTED_FIELDS and hasattr(torch.Tensor, "_has_symbolic_sizes_strides")


def enabled() -> bool:
    return os.environ.get("MEMFIT_SLOW_KEYS", "") in ("", "0") and _SUPPORTED


_SUPPORTED = supported()


class FastCacheKey:
    """Mixin for a ``FakeTensorMode`` subclass: see Note: [fast cache key]. ``fast_keys`` turns
    it on for an instance."""

    fast_keys = False

    def _prep_args_for_hash(self, result: list[Any], args: Any, state: Any,
                            *rest: Any) -> None:
        if not self.fast_keys:
            super()._prep_args_for_hash(result, args, state, *rest)  # type: ignore[misc]
            return
        if isinstance(args, list | tuple | dict):
            result.append(type(args))
            result.append(f"length_{len(args)}")
        if isinstance(args, dict):
            self._prep_args_for_hash(result, args.keys(), state, *rest)
            self._prep_args_for_hash(result, args.values(), state, *rest)
            return
        append = result.append
        for arg in args:
            if isinstance(arg, FakeTensor):
                if (arg.fake_mode is self and arg.constant is None and arg.layout is _STRIDED
                        and not arg._has_symbolic_sizes_strides and not arg.is_quantized):
                    append((_TENSOR, arg.dtype, arg.shape, arg.stride(), arg.device,
                            arg.storage_offset(), arg.untyped_storage().nbytes(),
                            arg.requires_grad, arg.is_conj(), arg.is_neg(), arg.is_inference()))
                    continue
            elif isinstance(arg, _PLAIN):
                # As torch: the type too, since 1, 1.0 and True hash alike.
                append(type(arg))
                append(arg)
                continue
            elif isinstance(arg, list | tuple | dict):
                self._prep_args_for_hash(result, arg, state, *rest)
                continue
            append(_DELEGATED)
            super()._prep_args_for_hash(result, (arg,), state, *rest)  # type: ignore[misc]

    def _get_output_tensor_from_cache_entry(self, state: Any, entry: Any, key: Any, func: Any,
                                            args: Any) -> Any:
        """A cache hit's new output (Note: [cached outputs]); torch's own code for anything but
        a concrete dense output."""
        metadata = entry.metadata
        if (not self.fast_keys or metadata is None or entry.inplace_idx is not None
                or self.shape_env is not None or FakeTensorConfig.debug):
            return super()._get_output_tensor_from_cache_entry(  # type: ignore[misc]
                state, entry, key, func, args)
        plan = _PLANS.get(id(metadata))
        if plan is None or plan[0] is not metadata:
            plan = _plan(metadata)
            _PLANS[id(metadata)] = plan
        if plan[1] is None:  # SymInt stubs, another layout: torch's path
            return super()._get_output_tensor_from_cache_entry(  # type: ignore[misc]
                state, entry, key, func, args)
        _, shape, stride, offset, dtype, requires_grad, conj, neg, device = plan
        with torch._C._DisableTorchDispatch():
            empty = torch.empty_strided(shape, stride, dtype=dtype, device="meta",
                                        requires_grad=requires_grad)
        if conj:
            torch._C._set_conj(empty, True)
        if neg:
            torch._C._set_neg(empty, True)
        if isinstance(func, torch._ops.OpOverload) and func.is_view:
            view_arg = args[entry.view_idx]
            if not isinstance(view_arg, FakeTensor):
                raise AssertionError("view_arg must be a FakeTensor")
            storage = view_arg.untyped_storage()
            with in_kernel_invocation_manager(self):
                empty.set_(storage, offset, shape, stride)
        return _new_fake(self, empty, device)


def device_of(args: Any) -> Any:
    """``prim.device`` of a fake tensor, as ``FakeTensorMode.dispatch`` answers it
    (``torch/_subclasses/fake_tensor.py: _DISPATCH_META_HANDLERS[prim.device]``, i.e.
    ``_device_handler``), without the mode's dispatch wrappers around it: C++ asks it for each
    tensor an op touches (a trace asks it about twice per op)."""
    return _DEVICE_HANDLER(args)


def _device_handler() -> Any:
    from torch._subclasses import fake_tensor

    handlers = getattr(fake_tensor, "_DISPATCH_META_HANDLERS", {})
    handler = handlers.get(torch.ops.prim.device.default)
    if handler is not None:
        return handler

    def device(args: Any) -> Any:  # the same answer, for a torch without the table
        t = args[0]
        return torch.device("meta") if t.fake_mode.in_kernel_invocation else t.fake_device
    return device


_DEVICE_HANDLER = _device_handler()


def _same_fake_impl() -> dict[Any, Any]:
    """Ops whose fake implementation is the cacheable op's own: ``aten._unsafe_view`` and
    ``aten.view`` are both ``_view_meta`` (``torch/_subclasses/fake_impls.py``, one
    ``register_op_impl`` for the two), a view of the input's storage. The fake mode never caches
    ``_unsafe_view`` (``FakeTensorMode._validate_cache_key``: "unsafe view", since its schema does
    not say it aliases its input) and runs the whole fake dispatch for each one, while ``view``'s
    cache entry rebuilds the same view of the same storage. Empty when the installed torch
    registers them apart."""
    from torch._subclasses import fake_impls

    impls = getattr(fake_impls, "op_implementations_dict", {})
    aten = torch.ops.aten
    view, unsafe = aten.view.default, aten._unsafe_view.default
    if view in impls and impls.get(unsafe) is impls[view]:
        return {unsafe: view}
    return {}


SAME_FAKE_IMPL = _same_fake_impl()


def cacheable_twin(func: Any, args: Any) -> Any:
    """The op to dispatch for ``func`` on ``args``: see :func:`_same_fake_impl`."""
    twin = SAME_FAKE_IMPL.get(func)
    if twin is not None and args and isinstance(args[0], FakeTensor) and args[0].constant is None:
        return twin
    return func


# Note: [lifted constants] ``torch.tensor(0.0)`` under the fake mode makes a real CPU tensor and
# dispatches ``aten.lift_fresh`` on it (Adam makes one ``step`` tensor per parameter: 452 on a
# 7B Llama-2 trace, 11% of it). ``torch/_subclasses/fake_tensor.py: FakeTensorMode._dispatch_impl``
# (its constant-propagation branch: ``is_lift_func and not flat_arg_fake_tensors``) runs the real
# ``lift_fresh`` (which returns its argument), and, the result having at most
# ``CONSTANT_NUMEL_LIMIT`` (1) element (``may_turn_const``), returns
# ``converter.from_real_tensor(mode, out.clone(), make_constant=True)``: a fake tensor of the same
# dtype, shape, stride and device over a fresh meta storage, whose ``constant`` is the clone,
# built by the meta converter (``torch/_subclasses/meta_utils.py: MetaConverter.__call__``, a
# general description of the tensor first, about a millisecond). Hugging Face's KV cache makes
# ``torch.tensor([])`` per layer the same way. For a plain contiguous CPU tensor of at most one
# element, not a view, without autograd (what ``torch.tensor(scalar)`` makes) the converter's
# answer is ``FakeTensor(mode, empty_strided(shape, stride, dtype, meta), device,
# constant=clone)`` (its ``mk_fake_tensor`` callback on that meta tensor), which is what
# :func:`lifted_constant` builds directly, memo included. Anything else goes to torch's path.
_LIFT_FRESH = torch.ops.aten.lift_fresh.default
_CONSTANT_NUMEL_LIMIT = getattr(fake_tensor, "CONSTANT_NUMEL_LIMIT", 1)


def lifted_constant(mode: Any, func: Any, args: Any, kwargs: Any) -> FakeTensor | None:
    """The fake mode's answer to ``aten.lift_fresh`` of ``torch.tensor(scalar)`` (Note:
    [lifted constants]), or None for any other call."""
    if func is not _LIFT_FRESH or kwargs or len(args) != 1:
        return None
    t = args[0]
    if (type(t) is not torch.Tensor or t.numel() > _CONSTANT_NUMEL_LIMIT
            or t.layout is not _STRIDED or t.device.type != "cpu" or t.requires_grad
            or t.grad_fn is not None or t._base is not None or t.storage_offset()
            or not t.is_contiguous() or t.is_quantized or t.is_conj() or t.is_neg()
            or t.is_inference() or t.dtype.is_complex
            or t.untyped_storage().nbytes() != t.numel() * t.element_size()):
        return None
    from torch.utils._mode_utils import no_dispatch

    with no_dispatch():
        constant = t.clone()
        meta = torch.empty_strided(constant.shape, constant.stride(), dtype=constant.dtype,
                                   device="meta")
        fake = FakeTensor(mode, meta, constant.device, constant=constant)
    mode.fake_tensor_converter.set_tensor_memo(constant, fake)
    return fake


# Note: [cached outputs] On a cache hit the fake mode builds the output anew from the entry's
# metadata (``torch/_subclasses/fake_tensor.py:
# FakeTensorMode._get_output_tensor_from_cache_entry``: each size, stride and offset passed
# through ``check_value``, a meta ``empty_strided`` under ``in_kernel_invocation_manager``, for a
# view ``set_`` onto the input's storage, then ``FakeTensor.__new__``): about a quarter of a
# trace. The version here does the same for an entry of concrete sizes (no shape environment,
# strided layout), with shortcuts that give the same tensor: the sizes are read once per entry
# (:func:`_plan`: entries live as long as the class-level cache); the meta ``empty_strided`` runs
# under ``_DisableTorchDispatch`` alone (a factory on the meta device reads neither the fake
# mode's in-kernel flag nor the meta TLS key that the manager also sets; the view's ``set_``
# keeps the manager); and the fake tensor is made by :func:`_new_fake`: ``FakeTensor.__new__``'s
# ``Tensor._make_subclass`` call and mutable-data-pointer flag, then the attributes ``__new__``
# sets (the mode, the device, ``None`` for the constant, the real tensor and each memo) copied
# from a fake tensor that torch's ``FakeTensor.__new__`` made for the same mode and device
# (:func:`_template`), instead of set one by one through the memo descriptors.
# ``MEMFIT_SLOW_KEYS=1`` turns this off with the fast key.
_PLANS: dict[int, tuple[Any, ...]] = {}
_TEMPLATES: dict[tuple[int, Any], tuple[Any, dict[str, Any]]] = {}


def _plan(metadata: Any) -> tuple[Any, ...]:
    """``(metadata, shape, stride, offset, dtype, requires_grad, conj, neg, device)``, or
    ``(metadata, None)`` when the entry needs torch's path."""
    ints = (*metadata.shape, *metadata.stride, metadata.storage_offset)
    if (metadata.layout is not _STRIDED or not all(type(v) is int for v in ints)
            or (metadata.storage_bytes is not None and type(metadata.storage_bytes) is not int)):
        return (metadata, None)
    return (metadata, tuple(metadata.shape), tuple(metadata.stride), metadata.storage_offset,
            metadata.dtype, metadata.requires_grad, metadata.is_conj, metadata.is_neg,
            metadata.device)


def _template(mode: Any, device: Any) -> dict[str, Any]:
    """The attributes ``FakeTensor.__new__`` gives a fake tensor of ``mode`` on ``device``."""
    key = (id(mode), device)
    hit = _TEMPLATES.get(key)
    if hit is not None and hit[0] is mode:
        return hit[1]
    with torch._C._DisableTorchDispatch():
        elem = torch.empty(0, device="meta")
    made = FakeTensor(mode, elem, device)
    attrs = dict(vars(made))
    if attrs.get("fake_mode") is not mode or attrs.get("_fake_device") != device:
        attrs = {}  # a torch whose __new__ stores these elsewhere: never used (see _new_fake)
    _TEMPLATES[key] = (mode, attrs)
    return attrs


def _new_fake(mode: Any, elem: torch.Tensor, device: Any) -> FakeTensor:
    """``FakeTensor(mode, elem, device)`` for a device that is already normalized (it comes
    from a fake tensor's metadata): see Note: [cached outputs]."""
    attrs = _template(mode, device)
    if not attrs:
        return FakeTensor(mode, elem, device)
    t = torch.Tensor._make_subclass(FakeTensor, elem, elem.requires_grad, dispatch_device=True,
                                    device_for_backend_keys=device)
    if not getattr(mode, "_allow_unsafe_data_ptr_access", False):
        torch._C._set_throw_on_mutable_data_ptr(t)
    else:
        torch._C._set_warn_deprecated_on_mutable_data_ptr(t)
    t.__dict__.update(attrs)
    return t
