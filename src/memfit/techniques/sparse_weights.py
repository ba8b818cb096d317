"""Store pruned Linear weights sparse (CSR or BSR) for inference, only where that saves bytes.

Pruning by itself saves nothing: ``torch.nn.utils.prune`` keeps the original weight, a mask as
large as it and the product of the two (:mod:`memfit.trace.pruning`). The zeros save memory
once the weight is stored in a sparse layout, and then only below a break-even density, because
every kept value carries index bytes (``torch/sparse/__init__.py``; the layouts'
``crow_indices``, ``col_indices`` and ``values``):

- CSR (``torch.sparse_csr``), an ``R x C`` weight with ``nnz`` nonzeros: ``nnz`` values,
  ``nnz`` column indices and ``R + 1`` row pointers:
  ``nnz * (value_bytes + index_bytes) + (R + 1) * index_bytes``.
- BSR (``torch.sparse_bsr``) with ``bh x bw`` blocks, ``nb`` of which hold a nonzero:
  ``nb`` blocks of values, one column index per block and ``R / bh + 1`` row pointers:
  ``nb * (bh * bw * value_bytes + index_bytes) + (R / bh + 1) * index_bytes``.

The indices are int32 where they fit (torch takes int32 or int64 for both index tensors;
``to_sparse_csr`` makes int64): an fp32 weight then breaks even at about 50% density in CSR
(4 / (4 + 4)), 33% with int64 indices (4 / (4 + 8)); a bf16 one at 33% and 20%.
BSR pays one index per block, but a block is kept whole as soon as one of its entries is not zero:
unstructured pruning at 90% leaves hardly any 16 x 16 block empty (0.9^256), so BSR suits
block-structured pruning, CSR unstructured.

The converted layers (:class:`SparseLinear`) compute ``torch.sparse.mm(weight, x.T).T + bias``.
torch's CPU kernel takes fp32 and fp64 only (``addmm_out_sparse_csr_impl_mkl``: not
implemented for Half and BFloat16, torch 2.13), so on CPU other dtypes stay dense; CUDA's
(cuSPARSE) takes fp16 and bf16 too (not tested here).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.nn.utils import prune

from memfit.trace.pruning import note, pruned_names
from memfit.units import format_bytes

__all__ = ["FORMATS", "LayerSparsity", "SparseLinear", "SparsifyReport", "break_even_density",
           "pruning_hint", "sparse_bytes", "sparsify"]

log = logging.getLogger("memfit")

FORMATS = ("csr", "bsr", "auto")
Format = Literal["csr", "bsr", "auto"]
_INDEX_BYTES = {torch.int32: 4, torch.int64: 8}
_INT32_MAX = 2**31 - 1
# torch.sparse.mm's kernels by device type (see the module docstring)
_MATMUL_DTYPES = {"cpu": (torch.float32, torch.float64),
                  "cuda": (torch.float16, torch.bfloat16, torch.float32, torch.float64)}


def sparse_bytes(shape: tuple[int, int], nonzero: int, *, format: str,
                 blocksize: tuple[int, int] = (1, 1), value_bytes: int = 4,
                 index_bytes: int = 8) -> int:
    """Bytes of an ``R x C`` weight stored as CSR (``nonzero``: its nonzero entries) or BSR
    (``nonzero``: its blocks holding a nonzero entry), by the formulas of the module.

    >>> sparse_bytes((4, 8), 6, format="csr", value_bytes=4, index_bytes=8)  # 6*12 + 5*8
    112
    >>> sparse_bytes((4, 8), 2, format="bsr", blocksize=(2, 4), index_bytes=8)  # 2*(32+8) + 3*8
    104
    """
    rows, _ = shape
    if format == "csr":
        return nonzero * (value_bytes + index_bytes) + (rows + 1) * index_bytes
    if format == "bsr":
        bh, bw = blocksize
        return nonzero * (bh * bw * value_bytes + index_bytes) + (rows // bh + 1) * index_bytes
    raise ValueError(f"format must be 'csr' or 'bsr', got {format!r}")


def break_even_density(shape: tuple[int, int], *, format: str,
                       blocksize: tuple[int, int] = (1, 1), value_bytes: int = 4,
                       index_bytes: int = 8) -> float:
    """The density at which the sparse layout holds as many bytes as the dense weight: below
    it, storing sparse saves memory. For CSR the share of nonzero entries, for BSR the share of
    blocks holding one. Solves ``sparse_bytes(d * slots) == R * C * value_bytes``.

    >>> round(break_even_density((1024, 1024), format="csr"), 4)  # fp32, int64: ~4/12
    0.3327
    >>> round(break_even_density((1024, 1024), format="csr", index_bytes=4), 4)  # ~4/8
    0.4995
    """
    rows, cols = shape
    dense = rows * cols * value_bytes
    if format == "csr":
        slots, per_slot, fixed = rows * cols, value_bytes + index_bytes, (rows + 1) * index_bytes
    elif format == "bsr":
        bh, bw = blocksize
        slots = (rows // bh) * (cols // bw)
        per_slot, fixed = bh * bw * value_bytes + index_bytes, (rows // bh + 1) * index_bytes
    else:
        raise ValueError(f"format must be 'csr' or 'bsr', got {format!r}")
    return max(0.0, (dense - fixed) / (slots * per_slot))


class SparseLinear(nn.Module):
    """A Linear layer for inference whose weight is a CSR or BSR buffer:
    ``torch.sparse.mm(weight, x.T).T + bias`` over the last dimension of ``x``.

    Known limitations: inference only (the weight is a buffer, with no gradient); fp32 and fp64
    on CPU (see the module).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)
        self.bias = bias if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        out = torch.sparse.mm(self.weight, flat.t()).t()
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"layout={self.weight.layout}")


@dataclass(frozen=True, kw_only=True)
class LayerSparsity:
    """What :func:`sparsify` did with one Linear layer's weight."""

    name: str
    shape: tuple[int, int]
    density: float
    """Share of the weight's entries that are not zero."""
    format: str
    """``"csr"``, ``"bsr"`` or ``"dense"`` (kept)."""
    bytes_before: int
    """The weight as the model held it: the weight, or for a pruned one ``weight_orig``,
    ``weight_mask`` and the recomputed weight."""
    bytes_after: int
    """The weight as stored now: the sparse layout's values and indices, or the dense weight."""
    reason: str
    """Why this format (the break-even density it was compared to)."""


@dataclass(frozen=True)
class SparsifyReport:
    layers: tuple[LayerSparsity, ...]

    @property
    def bytes_before(self) -> int:
        return sum(lay.bytes_before for lay in self.layers)

    @property
    def bytes_after(self) -> int:
        return sum(lay.bytes_after for lay in self.layers)

    @property
    def converted(self) -> list[str]:
        return [lay.name for lay in self.layers if lay.format != "dense"]

    def __str__(self) -> str:
        lines = [f"{'layer':<20} {'shape':>12} {'density':>8} {'format':>6} "
                 f"{'before':>11} {'after':>11}  why"]
        for lay in self.layers:
            shape = f"{lay.shape[0]}x{lay.shape[1]}"
            lines.append(f"{lay.name:<20} {shape:>12} {lay.density:>8.1%} {lay.format:>6} "
                         f"{format_bytes(lay.bytes_before):>11} "
                         f"{format_bytes(lay.bytes_after):>11}  {lay.reason}")
        lines.append(f"weights: {format_bytes(self.bytes_before)} -> "
                     f"{format_bytes(self.bytes_after)} ({len(self.converted)} of "
                     f"{len(self.layers)} layers sparse)")
        return "\n".join(lines)


def storage_bytes(t: torch.Tensor) -> int:
    """Bytes of the storages a dense, CSR or BSR tensor holds (values and indices)."""
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return sum(p.untyped_storage().nbytes()
                   for p in (t.values(), t.crow_indices(), t.col_indices()))
    return t.untyped_storage().nbytes()


def _to_layout(weight: torch.Tensor, format: str, blocksize: tuple[int, int],
               index_dtype: torch.dtype) -> torch.Tensor:
    if format == "csr":
        s, make = weight.to_sparse_csr(), torch.sparse_csr_tensor
    else:
        s, make = weight.to_sparse_bsr(blocksize), torch.sparse_bsr_tensor
    # Note: [compact indices] to_sparse_csr/bsr go through COO: their col_indices are a view of
    # the COO's [2, nnz] indices, twice their own bytes. Copies hold only what the formula counts.
    return make(s.crow_indices().to(index_dtype, copy=True),
                s.col_indices().to(index_dtype, copy=True), s.values().clone(), s.shape,
                check_invariants=True)


def _plan(name: str, weight: torch.Tensor, before: int, *, format: Format,
          blocksize: tuple[int, int], min_saving: float, index_dtype: torch.dtype
          ) -> tuple[LayerSparsity, torch.Tensor | None]:
    """The layer's entry, and its sparse weight if converting it saves at least ``min_saving``."""
    rows, cols = shape = (int(weight.shape[0]), int(weight.shape[1]))
    dense = rows * cols * weight.element_size()
    nonzero = int(torch.count_nonzero(weight))
    density = nonzero / (rows * cols) if rows * cols else 1.0
    index_bytes = _INDEX_BYTES[index_dtype]

    def kept(why: str) -> tuple[LayerSparsity, None]:
        return LayerSparsity(name=name, shape=shape, density=density, format="dense",
                             bytes_before=before, bytes_after=dense, reason=why), None

    supported = _MATMUL_DTYPES.get(weight.device.type, ())
    if weight.dtype not in supported:
        return kept(f"torch.sparse.mm on {weight.device.type} takes "
                    f"{', '.join(str(d).removeprefix('torch.') for d in supported) or 'nothing'}"
                    f", not {str(weight.dtype).removeprefix('torch.')}")
    candidates: dict[str, tuple[int, float, float]] = {}  # format -> bytes, density, break-even
    if format in ("csr", "auto"):
        candidates["csr"] = (sparse_bytes(shape, nonzero, format="csr",
                                          value_bytes=weight.element_size(),
                                          index_bytes=index_bytes), density,
                             break_even_density(shape, format="csr",
                                                value_bytes=weight.element_size(),
                                                index_bytes=index_bytes))
    bh, bw = blocksize
    if format in ("bsr", "auto") and rows % bh == 0 and cols % bw == 0:
        blocks = (weight.reshape(rows // bh, bh, cols // bw, bw) != 0).any(dim=(1, 3))
        held = int(blocks.sum())
        candidates["bsr"] = (sparse_bytes(shape, held, format="bsr", blocksize=blocksize,
                                          value_bytes=weight.element_size(),
                                          index_bytes=index_bytes), held / blocks.numel(),
                             break_even_density(shape, format="bsr", blocksize=blocksize,
                                                value_bytes=weight.element_size(),
                                                index_bytes=index_bytes))
    if not candidates:
        return kept(f"{rows}x{cols} is not a multiple of the {bh}x{bw} blocks")
    best = min(candidates, key=lambda f: candidates[f][0])
    nbytes, have, even = candidates[best]
    what = "density" if best == "csr" else f"{bh}x{bw}-block density"
    if nbytes >= dense or dense - nbytes < min_saving * dense:
        return kept(f"{best}: {what} {have:.1%} >= {even:.1%} break-even"
                    + (f" less {min_saving:.0%}" if min_saving else ""))
    sparse = _to_layout(weight.detach(), best, blocksize, index_dtype)
    return LayerSparsity(name=name, shape=shape, density=density, format=best,
                         bytes_before=before, bytes_after=storage_bytes(sparse),
                         reason=f"{what} {have:.1%} < {even:.1%} break-even"), sparse


def sparsify(model: nn.Module, *, format: Format = "auto", blocksize: tuple[int, int] = (16, 16),
             min_saving: float = 0.0, index_dtype: torch.dtype = torch.int32) -> SparsifyReport:
    """Convert ``model``'s Linear weights to CSR or BSR (:class:`SparseLinear`) where that holds
    at least ``min_saving`` of the dense weight's bytes less; for inference, in place.

    A pruned weight (``torch.nn.utils.prune``) is made permanent first (``prune.remove``: the
    mask and ``weight_orig`` go) whether or not it is then converted; any weight with enough
    zeros is a candidate. ``format="auto"`` takes the smaller of CSR and BSR (``blocksize``
    blocks; BSR needs the weight's shape to be a multiple of them). ``index_dtype``: int32
    (half the index bytes of torch's default int64) falls back to int64 where a size does not fit.

    >>> model = nn.Sequential(nn.Linear(64, 64))
    >>> _ = prune.l1_unstructured(model[0], "weight", amount=0.9)
    >>> sparsify(model).converted
    ['0']
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
    if index_dtype not in _INDEX_BYTES:
        raise ValueError(f"index_dtype must be torch.int32 or torch.int64, got {index_dtype}")
    if not 0.0 <= min_saving < 1.0:
        raise ValueError(f"min_saving is a share of the dense bytes in [0, 1), got {min_saving}")
    if len(blocksize) != 2 or min(blocksize) < 1:
        raise ValueError(f"blocksize is (rows, columns) of at least 1, got {blocksize}")
    if isinstance(model, nn.Linear):
        raise ValueError("sparsify replaces the Linear layers inside a model; wrap a bare "
                         "nn.Linear in nn.Sequential")
    layers = []
    for name, mod in list(model.named_modules()):
        if not isinstance(mod, nn.Linear):
            continue
        pruned = "weight" in pruned_names(mod)
        if pruned:
            held = [getattr(mod, key) for key in ("weight_orig", "weight_mask", "weight")]
            before = sum(storage_bytes(t) for t in held)
            prune.remove(mod, "weight")
        else:
            before = storage_bytes(mod.weight)
        weight = mod.weight
        fits = max(weight.numel(), weight.shape[0] + 1) <= _INT32_MAX
        entry, sparse = _plan(name, weight, before, format=format,
                              blocksize=blocksize, min_saving=min_saving,
                              index_dtype=index_dtype if fits else torch.int64)
        layers.append(entry)
        if sparse is not None:
            _replace(model, name, SparseLinear(sparse, mod.bias))
    report = SparsifyReport(tuple(layers))
    log.info("memfit: sparse weights for %d of %d Linear layers: %s -> %s",
             len(report.converted), len(layers), format_bytes(report.bytes_before),
             format_bytes(report.bytes_after))
    return report


def pruning_hint(model: nn.Module) -> str | None:
    """One line on what ``model``'s pruned weights (``torch.nn.utils.prune``) cost in training,
    or None if it has none (``memfit fit`` adds it to its plan's suggestions)."""
    return note(model, training=True)


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, new)
