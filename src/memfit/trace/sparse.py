"""Sparse COO gradients (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``) in a
trace: what torch allocates for them, which fake tensors get wrong.

A sparse COO tensor owns no storage of its own: it is its ``indices`` ([sparse_dim, nnz], int64)
and ``values`` ([nnz, *dense]) tensors, which the tracker records (``Tracker.track``).

Measured with the profiler's allocator events (CPU, torch 2.13; ``bench/sparse_embedding.py``
prints the same comparison):

- The backward of an embedding lookup allocates nothing: its gradient is the uncoalesced COO
  tensor whose indices are the looked-up ids (a view, when they are int64) and whose values are
  the incoming gradient (a view): ``nnz`` is the number of ids, repeats included
  (``aten/src/ATen/native/Embedding.cpp: embedding_sparse_backward``). ``EmbeddingBag``'s values
  are a new ``[ids, dim]`` tensor gathered from the bags' gradients.
- ``AccumulateGrad`` keeps it as the ``.grad`` without a copy when nothing else holds its indices
  and values (``torch/csrc/autograd/functions/accumulate_grad.h``); fake tensors, which the
  trace's own bookkeeping holds, are cloned there instead. :func:`steal` models the real engine.
- SGD adds it to the weight in place (no coalesce, no allocation).
- ``coalesce()`` (Adagrad, SparseAdam) allocates indices and values for all ``nnz`` entries and
  shrinks them in place to the ``unique`` ids (no reallocation: the storages keep the ``nnz``
  size), and inside the CPU kernel sorts the flattened ids: three ``nnz``-long int64 temporaries
  (the sorted ids, their permutation, and the ``arange`` the sort starts from)
  (``aten/src/ATen/native/sparse/SparseTensor.cpp: _coalesce_sparse_cpu``). Fake tensors give it
  no entries at all; :func:`coalesce` gives it ``unique`` of them: counted from the real ids when
  the trace has them (real integer inputs), else ``min(rows, nnz)`` (every id distinct), an
  assumption the estimate's notes state.
- Two sparse gradients of one weight (a table looked up twice) are summed by concatenation:
  ``nnz1 + nnz2`` entries (``SparseTensorMath.cpp: add_out_sparse_cpu``); fake tensors again give
  none (:func:`add`). Accumulating over micro-batches sums into ``.grad`` in place the same way:
  new indices and values, then the old ones freed (:func:`add_`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from memfit.errors import MemfitError

aten = torch.ops.aten

ASSUMPTION = ("sparse gradients: every id a batch looks up is distinct (unique rows = min(table "
              "rows, ids)), as the ids' values are unknown (meta or fake inputs); pass the real "
              "integer inputs to count them")

CREATE = aten._sparse_coo_tensor_with_dims_and_tensors.default
_COALESCE = aten._coalesce.default
CLONE = aten.clone.default
_ADD = aten.add.Tensor
_ADD_ = aten.add_.Tensor
_MASK = aten.sparse_mask.default
_BAG_BACKWARD = aten._embedding_bag_backward.default
OPS = (CREATE, _COALESCE, CLONE, _ADD, _ADD_, _MASK, _BAG_BACKWARD)
"""The ops :func:`handles` looks at (:data:`CREATE` only to remember known ids)."""
_SORT_TEMPORARIES = 3  # int64 [nnz] each, inside _coalesce_sparse_cpu's sort (see the module)


def is_sparse(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.layout is torch.sparse_coo


def parts(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The storage-owning tensors of a sparse COO tensor: (indices, values)."""
    return t._indices(), t._values()


class SparseIds:
    """Where the trace knows the real ids of a fake sparse tensor (the creating op's indices
    argument has a known value: :mod:`memfit.trace.known_values`), to count the unique ones."""

    def __init__(self, known: Any) -> None:
        self.known = known  # a KnownValues: fake tensor -> its real value
        self.ids = WeakIdKeyDictionary()  # fake sparse tensor -> its real indices, when read
        self.assumed = False

    def remember(self, out: torch.Tensor, indices: torch.Tensor) -> None:
        """``out``'s indices are ``indices`` (a fake tensor) read as ``[sparse_dim, nnz]``."""
        if indices in self.known.known:
            known, dims = self.known, out.sparse_dim()
            self.ids[out] = lambda: _as_ids(known.value(indices), dims)

    def created(self, func: Any, args: Any, out: Any) -> None:
        """Remember the indices argument of a sparse tensor's creation, if its value is known."""
        if func is CREATE and is_sparse(out) and len(args) > 3:
            self.remember(out, args[3])

    def _value(self, t: torch.Tensor) -> torch.Tensor | None:
        read = self.ids.get(t)
        return None if read is None else read()  # type: ignore[no-any-return]

    def unique(self, t: torch.Tensor) -> int:
        """The number of distinct index columns of ``t`` (its real ids), or ``min(rows, nnz)``."""
        nnz = t._nnz()
        ids = self._value(t)
        if ids is not None and ids.dim() == 2 and ids.shape[-1] == nnz:
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            with unset_fake_temporarily():
                return int(torch.unique(ids, dim=1).shape[1]) if nnz else 0
        self.assumed = True
        rows = 1
        for size in t.shape[:t.sparse_dim()]:
            rows *= size
        return min(rows, nnz)


def _as_ids(value: torch.Tensor | None, sparse_dim: int) -> torch.Tensor | None:
    return None if value is None else value.reshape(sparse_dim, -1)


def handles(func: Any, args: Any) -> bool:
    """Whether :func:`run` may answer ``func`` on ``args`` (a cheap test, first on the op)."""
    if func is _COALESCE:
        return True
    if func is _BAG_BACKWARD:
        return len(args) > 9 and bool(args[9])
    if func is _MASK:
        return len(args) > 1 and is_sparse(args[1]) and not is_sparse(args[0])
    if func is CLONE or func is _ADD or func is _ADD_:
        return bool(args) and is_sparse(args[0])
    return False


def run(func: Any, args: Any, kwargs: dict[str, Any], mode: Any, ids: SparseIds, *,
        engine_call: bool, cpu_kernels: bool) -> Any:
    """The real op's outputs, as fake tensors (or None: let the fake mode run it).

    ``engine_call``: the op was called by autograd's engine (AccumulateGrad's clone, the input
    buffer's sum); ``cpu_kernels``: model the CPU kernels' transient memory."""
    if func is CLONE and engine_call:
        return steal(args[0], mode, ids)
    if func is _COALESCE:
        return coalesce(args[0], mode, ids, cpu_kernels=cpu_kernels)
    if func is _BAG_BACKWARD:
        return bag_backward(args, mode, ids, cpu_kernels=cpu_kernels)
    if func is _MASK:
        return sparse_mask(args[0], args[1], mode, cpu_kernels=cpu_kernels)
    if func is _ADD and len(args) > 1 and is_sparse(args[1]):
        return add(args[0], args[1], kwargs.get("alpha", 1), mode, ids)
    if func is _ADD_ and len(args) > 1 and is_sparse(args[1]):
        return add_(args[0], args[1], kwargs.get("alpha", 1), mode, ids)
    return None


def _build(mode: Any, like: torch.Tensor | tuple[int, int, list[int]], indices: torch.Tensor,
           values: torch.Tensor, coalesced: bool) -> torch.Tensor:
    """A sparse COO tensor of ``like``'s dims and shape (or ``(sparse_dim, dense_dim, shape)``)
    over ``indices`` and ``values``, sharing their storages."""
    dims = like if isinstance(like, tuple) else (like.sparse_dim(), like.dense_dim(),
                                                 list(like.shape))
    with mode:
        out = CREATE(*dims, indices, values,
                      dtype=values.dtype, layout=torch.sparse_coo, device=values.device,
                      is_coalesced=coalesced)
    return out  # type: ignore[no-any-return]


def steal(grad: torch.Tensor, mode: Any, ids: SparseIds) -> torch.Tensor:
    """AccumulateGrad's shallow copy of a sparse gradient with contiguous indices and values
    (its only holder in a real run): the same storages, no allocation."""
    indices, values = parts(grad)
    if not (indices.is_contiguous() and values.is_contiguous()):
        with mode:
            indices, values = indices.clone(), values.clone()
    out = _build(mode, grad, indices, values, grad.is_coalesced())
    if grad in ids.ids:
        ids.ids[out] = ids.ids[grad]
    return out


def coalesce(t: torch.Tensor, mode: Any, ids: SparseIds, *, cpu_kernels: bool) -> torch.Tensor:
    """``_coalesce``: ``nnz``-sized storages holding the ``unique`` entries (see the module)."""
    nnz = t._nnz()
    unique = ids.unique(t)
    indices, values = parts(t)
    index_bytes = 8 * nnz  # int64
    if cpu_kernels:
        tracker = mode.tracker
        held = (index_bytes * t.sparse_dim() + values.numel() * values.element_size()
                + _SORT_TEMPORARIES * index_bytes)
        tracker.transient(tracker.current + held)
    with mode:
        new_indices = torch.empty((t.sparse_dim(), nnz), dtype=torch.long,
                                  device=indices.device)[:, :unique]
        new_values = torch.empty(values.shape, dtype=values.dtype,
                                 device=values.device)[:unique]
    return _build(mode, t, new_indices, new_values, True)


def bag_backward(args: Any, mode: Any, ids: SparseIds, *,
                 cpu_kernels: bool) -> torch.Tensor:
    """``EmbeddingBag(sparse=True)``'s gradient: the bags' gradients gathered to one row per id
    (``[ids, dim]``, new) with the ids as indices (``EmbeddingBag.cpp:
    _embedding_bag_sparse_backward``, then ``embedding_sparse_backward``). On CPU the sum
    mode's forward leaves ``offset2bag`` empty and the backward rebuilds it (``make_offset2bag``:
    a zeroed ``[ids + 1]`` int64 tensor, then its cumsum, alive while the rows are gathered).
    ``padding_idx`` entries are counted (an upper bound: the real gradient drops them)."""
    grad, indices, offset2bag = args[0], args[1], args[3]
    n = indices.numel()
    values_shape = (n, grad.shape[-1])
    if cpu_kernels:
        tracker = mode.tracker
        values_bytes = n * grad.shape[-1] * grad.element_size()
        rebuilt = 8 * (n + 1) if offset2bag.numel() == 0 else 0
        tracker.transient(tracker.current + rebuilt + values_bytes)
    with mode:
        new_indices = indices.reshape(1, n).to(torch.long)
        values = torch.empty(values_shape, dtype=grad.dtype, device=grad.device)
    out = _build(mode, (1, 1, [int(args[6]), int(grad.shape[-1])]), new_indices, values, False)
    ids.remember(out, indices)
    return out


def sparse_mask(dense: torch.Tensor, mask: torch.Tensor, mode: Any, *,
                cpu_kernels: bool) -> torch.Tensor | None:
    """``dense.sparse_mask(mask)``: ``dense``'s entries at ``mask``'s indices, as a sparse
    tensor of ``mask``'s ``nnz`` (Adagrad's and SparseAdam's states at the touched rows).

    The CPU kernel (``SparseTensor.cpp: sparse_mask``: ``dense.mul(mask of ones)``) allocates a
    one-element ``ones``, gathers ``dense``'s rows (``index``: ``[nnz, *dense]``), copies the
    indices and multiplies into the values, then frees the gathered rows and the ``ones``."""
    nnz = mask._nnz()
    if nnz == 0:
        return None
    indices, mask_values = parts(mask)
    values_shape = (nnz, *dense.shape[mask.sparse_dim():])
    if cpu_kernels:
        tracker = mode.tracker
        values_bytes = dense.element_size()
        for size in values_shape:
            values_bytes *= size
        ones = mask_values.element_size()
        tracker.transient(tracker.current + ones + 2 * values_bytes + indices.numel() * 8)
    with mode:
        new_indices = indices.clone()
        new_values = torch.empty(values_shape, dtype=dense.dtype, device=dense.device)
    return _build(mode, mask, new_indices, new_values, mask.is_coalesced())


def add(a: torch.Tensor, b: torch.Tensor, alpha: Any, mode: Any,
        ids: SparseIds) -> torch.Tensor:
    """Sparse + sparse: the entries of both, concatenated (see the module)."""
    ia, va = parts(a)
    ib, vb = parts(b)
    with mode:
        indices = torch.cat([ia, ib], 1)
        values = torch.cat([va, vb if alpha == 1 else vb * alpha], 0)
    out = _build(mode, a, indices, values, False)
    read_a, read_b = ids.ids.get(a), ids.ids.get(b)
    if read_a is not None and read_b is not None:
        ids.ids[out] = lambda: _cat(read_a(), read_b())
    return out


def add_(a: torch.Tensor, b: torch.Tensor, alpha: Any, mode: Any,
         ids: SparseIds) -> torch.Tensor:
    """Sparse ``+=`` sparse (AccumulateGrad summing a micro-batch's gradient into ``.grad``):
    ``a`` gets new indices and values holding both (``add_out_sparse_cpu`` with ``r`` = ``a``,
    then ``alias_into_sparse``); its old ones are freed unless something else holds them."""
    total = add(a, b, alpha, mode, ids)
    old = parts(a)
    with mode:
        aten.copy_sparse_to_sparse_(a, total)  # a's parts: copies of total's, which then die
    mode.tracker.track(a)  # the new parts first, then the old ones go (with ``old``)
    del old
    if total in ids.ids:
        ids.ids[a] = ids.ids[total]
    else:
        ids.ids.pop(a, None)
    return a


def _cat(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    return None if a is None or b is None else torch.cat([a, b], 1)


# torch's optimizers whose step raises on a sparse gradient ("... does not support sparse
# gradients": torch/optim/adam.py, adamw.py (Adam's), rmsprop.py, adamax.py, nadam.py,
# radam.py, adadelta.py, asgd.py, rprop.py; LBFGS flattens gradients with .view). SGD and
# Adagrad take one, but not with weight decay (SGD: "add(sparse, dense) is not supported";
# Adagrad: "weight_decay option is not compatible with sparse gradients"), both checked on
# torch 2.13 by tests/trace/test_trace_sparse.py.
_REJECTING = ("Adam", "AdamW", "RMSprop", "Adamax", "NAdam", "RAdam", "Adadelta", "ASGD",
              "Rprop", "LBFGS")
_NO_DECAY = ("SGD", "Adagrad")


def _torch_class(opt: torch.optim.Optimizer) -> str | None:
    """The torch.optim class whose ``step`` ``opt`` runs (a subclass that keeps it counts)."""
    for cls in type(opt).__mro__:
        if cls.__module__.startswith("torch.optim") and "step" in vars(cls):
            return cls.__name__
        if "step" in vars(cls):
            return None  # a step of its own: not torch's
    return None


def check_optimizer(opt: torch.optim.Optimizer, model: nn.Module) -> None:
    """Refuse, before the trace, an optimizer whose step torch would fail on the sparse
    gradient of an ``nn.Embedding`` / ``nn.EmbeddingBag`` with ``sparse=True``."""
    sparse = {id(m.weight): name for name, m in model.named_modules()
              if isinstance(m, nn.Embedding | nn.EmbeddingBag) and m.sparse
              and m.weight.requires_grad}
    if not sparse:
        return
    cls = _torch_class(opt)
    for group in opt.param_groups:
        names = [sparse[id(p)] for p in group["params"] if id(p) in sparse]
        if not names or cls is None:
            continue
        shown = type(opt).__name__  # AdamW runs Adam's step: name the class the user chose
        if cls in _REJECTING:
            why = f"torch.optim.{shown} does not take sparse gradients"
        elif cls in _NO_DECAY and group.get("weight_decay", 0):
            why = (f"torch.optim.{shown} with weight_decay={group['weight_decay']} does not "
                   "take sparse gradients")
        else:
            continue
        raise MemfitError(
            f"{names[0] or 'the model'} has sparse gradients (sparse=True) but {why}: use "
            "torch.optim.SGD or Adagrad without weight decay, torch.optim.SparseAdam, or "
            "memfit.techniques.SparseAdamWithDense (SparseAdam for the tables, Adam for the "
            "rest), or build the table with sparse=False")
