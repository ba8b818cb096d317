"""2:4 semi-structured sparsity: the compressed bytes of a weight, by torch's backend layout.

Torch-free (the analytic plan answers from it without importing torch); the technique that
prunes and converts a model is :func:`memfit.techniques.apply_semi_structured_sparsity`.

A 2:4 weight keeps 2 values in every group of 4 along the input dimension. torch stores a
``[m, k]`` (out x in) weight in one of two layouts (torch/sparse/semi_structured.py, torch 2.13):

- CUTLASS (``SparseSemiStructuredTensorCUTLASS``): ``packed``, the kept values, ``[m, k/2]`` in
  the weight's dtype, and ``meta``, the kept positions, ``[m, k / (ksparse * quadbits)]`` of
  ``meta_dtype`` (torch/sparse/_semi_structured_conversions.py:
  ``sparse_semi_structured_from_dense_cutlass``): ``meta_dtype`` is int32 for int8 weights and
  int16 for fp16/bf16/fp32; ``quadbits = meta_dtype.itemsize * 8 / 4`` (4-bit codes per meta
  element); ``ksparse`` is 4 (one 4-bit code per group of 4) except fp32, which is 1:2 (one
  code per pair, ``ksparse`` 2). So the metadata is ``m * k / 8`` bytes for fp16, bf16 and int8
  (one bit per weight) and ``m * k / 4`` for fp32.
- cuSPARSELt (``SparseSemiStructuredTensorCUSPARSELT``, what ``to_sparse_semi_structured``
  builds unless ``_FORCE_CUTLASS`` is set): one tensor, ``packed = [kept values | metadata]``,
  of ``numel * compression_factor / 16`` elements of the weight's dtype, with
  ``compression_factor`` 9 for fp16/bf16/fp32 and 10 for int8 and fp8
  (aten/src/ATen/native/sparse/cuda/cuSPARSELtOps.cpp: ``_cslt_compress``): ``numel / 2``
  values plus ``numel / 16`` (``numel / 8`` for 1-byte types) elements of metadata.

For fp16 and bf16 both layouts hold ``9/8`` bytes per weight instead of 2 (56.25%).

2:4 **training** (torchao's ``SemiSparseLinear``) saves compute, not memory: the dense weight,
its gradient and its optimizer states stay, and every forward compresses the weight again and
keeps the result for backward (:func:`training_bytes`: ``19/8`` bytes per fp16/bf16 weight, on
top of the dense ``2``).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from memfit.errors import MemfitError, suggest

PATTERNS: tuple[str, ...] = ("none", "2:4")
"""The sparsity patterns memfit plans (``--sparsity``): ``2:4`` is the one NVIDIA's sparse
tensor cores run (torch's ``to_sparse_semi_structured``)."""

BACKENDS: tuple[str, ...] = ("cutlass", "cusparselt")

MIN_COMPUTE_CAPABILITY = (8, 0)
"""Sparse tensor cores came with Ampere (NVIDIA A100 Tensor Core GPU Architecture whitepaper,
"Fine-Grained Structured Sparsity"); torch's own tests run the kernels on SM 8.x and 9.x only
(test/test_sparse_semi_structured.py: ``_IS_SM8X``, ``_IS_SM9X``, "CUTLASS kernels only work
for Ampere")."""

PLAN_FORMATS: tuple[str, ...] = ("fp16", "bf16")
"""The compute formats the plan prices 2:4 for: both backends run them (fp32 is 1:2 on CUTLASS
only; int8 and fp8 are not plan precisions with weight sparsity)."""


@dataclass(frozen=True)
class ShapeConstraint:
    """torch's ``_SEMI_STRUCTURED_SPARSE_CONFIG``: the sparse (weight) matrix's rows and columns
    are each a multiple of (and at least) ``sparse_min_rows`` / ``sparse_min_cols``; the dense
    operand's of ``dense_min_rows`` / ``dense_min_cols`` (torch pads the input to them)."""

    sparse_min_rows: int
    sparse_min_cols: int
    dense_min_rows: int
    dense_min_cols: int


SHAPE_CONSTRAINTS: dict[str, dict[str, ShapeConstraint]] = {
    # torch/sparse/semi_structured.py: SparseSemiStructuredTensorCUTLASS._DTYPE_SHAPE_CONSTRAINTS
    "cutlass": {
        "int8": ShapeConstraint(16, 128, 16, 16),
        "fp16": ShapeConstraint(32, 64, 8, 8),
        "bf16": ShapeConstraint(32, 64, 8, 8),
        "fp32": ShapeConstraint(32, 32, 4, 4),
    },
    # torch/sparse/semi_structured.py: SparseSemiStructuredTensorCUSPARSELT._DTYPE_SHAPE_CONSTRAINTS
    "cusparselt": {
        "fp8": ShapeConstraint(32, 32, 16, 16),
        "int8": ShapeConstraint(32, 32, 16, 16),
        "fp16": ShapeConstraint(16, 16, 8, 8),
        "bf16": ShapeConstraint(16, 16, 8, 8),
    },
}
"""Which dtypes each backend converts, and the weight shapes it accepts (torch 2.13)."""

# The element sizes of the dtypes the backends take (memfit.dtypes has them too, but imports
# torch lazily, which this torch-free module may not).
ELEMENT_BYTES: dict[str, int] = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1, "fp8": 1}

# CUTLASS metadata (torch/sparse/_semi_structured_conversions.py:
# sparse_semi_structured_from_dense_cutlass): bytes of one meta element, and weights per group
# that one 4-bit code describes (ksparse).
CUTLASS_META_BYTES: dict[str, int] = {"int8": 4, "fp16": 2, "bf16": 2, "fp32": 2}
CUTLASS_KSPARSE: dict[str, int] = {"int8": 4, "fp16": 4, "bf16": 4, "fp32": 2}

# cuSPARSELt (aten/src/ATen/native/sparse/cuda/cuSPARSELtOps.cpp: _cslt_compress): the packed
# tensor holds numel * factor / 16 elements of the weight's dtype.
CUSPARSELT_COMPRESSION_FACTOR: dict[str, int] = {"fp16": 9, "bf16": 9, "fp32": 9, "int8": 10,
                                                 "fp8": 10}


@dataclass(frozen=True)
class CompressedBytes:
    """The bytes of one 2:4 weight in a backend's layout."""

    values: int
    """The kept values: half the weight's elements."""
    metadata: int
    """Where they were: 4-bit codes (CUTLASS ``meta``, or the tail of cuSPARSELt's ``packed``)."""

    @property
    def total(self) -> int:
        return self.values + self.metadata


def _check(dtype: str, backend: str) -> None:
    if backend not in SHAPE_CONSTRAINTS:
        raise MemfitError(f"unknown 2:4 backend {backend!r}{suggest(backend, BACKENDS)}; "
                          f"valid: {', '.join(BACKENDS)}")
    valid = SHAPE_CONSTRAINTS[backend]
    if dtype not in valid:
        raise MemfitError(f"torch's {backend} backend has no 2:4 kernels for {dtype}; valid: "
                          f"{', '.join(valid)}")


def compressed_bytes(out_features: int, in_features: int, dtype: str = "bf16",
                     backend: str = "cusparselt") -> CompressedBytes:
    """Bytes of an ``[out_features, in_features]`` weight converted by torch to 2:4 (see the
    module docstring for each constant's source).

    >>> compressed_bytes(4096, 4096, "bf16", "cutlass").total  # 4096*4096*2 * 9/16
    18874368
    """
    _check(dtype, backend)
    m, k = out_features, in_features
    size = ELEMENT_BYTES[dtype]
    values = m * (k // 2) * size
    if backend == "cutlass":
        quadbits = CUTLASS_META_BYTES[dtype] * 8 // 4
        meta_cols = k // (CUTLASS_KSPARSE[dtype] * quadbits)
        return CompressedBytes(values, m * meta_cols * CUTLASS_META_BYTES[dtype])
    packed = m * k * CUSPARSELT_COMPRESSION_FACTOR[dtype] // 16  # C++ integer division
    return CompressedBytes(values, packed * size - values)


def bytes_per_weight(dtype: str) -> Fraction:
    """Compressed bytes per weight element for the plan's formats (the same in both backends:
    :data:`PLAN_FORMATS`), e.g. ``9/8`` for bf16."""
    if dtype not in PLAN_FORMATS:
        raise MemfitError(f"2:4 sparsity is planned for {' and '.join(PLAN_FORMATS)} weights, "
                          f"not {dtype}")
    return Fraction(ELEMENT_BYTES[dtype] * CUSPARSELT_COMPRESSION_FACTOR[dtype], 16)


# 2:4 training: torchao's SemiSparseLinear.forward (torchao/sparsity/training/__init__.py, 0.18)
# calls semi_structured_sparsify(self.weight, backend="cusparselt")
# (torchao/sparsity/training/autograd.py: _SparsifyFunc.forward), which is
# torch._sparse_semi_structured_tile(weight, algorithm="", use_cutlass=False)
# (aten/src/ATen/native/sparse/cuda/SparseSemiStructuredTile.cu): it returns W and W^T
# compressed in cuSPARSELt's layout plus a bitmask, wrapped in one
# SparseSemiStructuredTensorCUSPARSELT that F.linear's autograd saves for backward.

TRAINING_FORMATS: tuple[str, ...] = ("fp16", "bf16")
"""The weight dtypes the tile kernel takes (SparseSemiStructuredTile.cu:
``_sparse_semi_structured_tile``'s ``TORCH_CHECK`` of Half or BFloat16)."""

TRAINING_TILE = 128
"""Both dimensions of the weight must be multiples of 128: ``MetadataCuSparseLt::
getMetadataSize`` checks ``rows % 128 == 0 && cols % 128 == 0`` for W and again for W^T."""

TILE_META_ELEMENT_BYTES = 2
"""The metadata element, ``ElementInputE = uint16_t`` (SparseSemiStructuredPack.h); the
metadata is one bit per dense value: ``rows * cols / (8 * sizeof(ElementInputE))`` elements of
the weight's 2-byte dtype (``MetadataCuSparseLt::getMetadataSize``)."""

TILE_WARP = (32, 64)
"""``kWarpX, kWarpY`` (SparseSemiStructuredPack.h): one thread block per 32 x 64 of the input."""

TILE_THREAD = (8, 8)
"""``kThreadX, kThreadY``: one thread per 8 x 8 tile, which writes one ``uint64`` of masks
(``Tile8x8Masks``, 8 bytes) into ``threads_masks``, the bitmask tensor
(``sparse_semi_structured_tile_typed``)."""


TRAINING_BYTES_PER_WEIGHT = Fraction(19, 8)
"""What 2:4 training adds per fp16/bf16 weight and forward: W and W^T at 9/8 bytes each (as
:func:`bytes_per_weight`) plus the 1-bit-per-weight bitmask, where the dimensions are multiples
of 128 (:func:`training_bytes` counts exactly)."""


@dataclass(frozen=True)
class TrainingBytes:
    """What one forward of torchao's ``SemiSparseLinear`` allocates for an ``[out, in]`` weight
    and keeps (in the autograd graph) until that layer's backward, besides what a dense
    ``nn.Linear`` allocates."""

    compressed: int
    """W in cuSPARSELt's layout: ``rows * ceil(cols / 2)`` kept values plus the metadata, in one
    storage of the weight's dtype (``MetadataCuSparseLt::create_compressed_representation``)."""
    compressed_t: int
    """W^T, the same for ``[in, out]`` (what the backward's ``grad @ W`` multiplies by)."""
    bitmask: int
    """``threads_masks``: 8 bytes per 8 x 8 tile of the (warp-rounded) weight."""

    @property
    def total(self) -> int:
        return self.compressed + self.compressed_t + self.bitmask


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _tile_compressed(rows: int, cols: int, size: int) -> int:
    data_scalars = rows * _ceil_div(cols, 2)
    meta_scalars = rows * cols // (8 * TILE_META_ELEMENT_BYTES)
    return (data_scalars + meta_scalars) * size


def training_bytes(out_features: int, in_features: int, dtype: str = "bf16") -> TrainingBytes:
    """The bytes one forward of torchao's ``SemiSparseLinear`` adds for an ``[out_features,
    in_features]`` weight, held until the layer's backward when its input needs a gradient
    (else freed after the matmul). ``19/8`` bytes per fp16/bf16 weight.

    >>> training_bytes(4096, 4096, "bf16").total  # 4096*4096 * (9/8 + 9/8 + 1/8)
    39845888
    """
    if dtype not in TRAINING_FORMATS:
        raise MemfitError(f"2:4 training (torch's _sparse_semi_structured_tile) takes "
                          f"{' and '.join(TRAINING_FORMATS)} weights, not {dtype}")
    m, k = out_features, in_features
    size = ELEMENT_BYTES[dtype]
    warp_x, warp_y = TILE_WARP
    thread_x, thread_y = TILE_THREAD
    bitmask = (_ceil_div(m, warp_x) * (warp_x // thread_x)
               * _ceil_div(k, warp_y) * (warp_y // thread_y) * 8)
    return TrainingBytes(_tile_compressed(m, k, size), _tile_compressed(k, m, size), bitmask)


def training_shape_problem(out_features: int, in_features: int, dtype: str) -> str | None:
    """Why torchao's ``SemiSparseLinear`` cannot run an ``[out_features, in_features]`` weight
    of ``dtype`` (the checks of ``_sparse_semi_structured_tile``), or None when it can."""
    if dtype not in TRAINING_FORMATS:
        return (f"{dtype}: torch's 2:4 tile kernel takes {' and '.join(TRAINING_FORMATS)} "
                "weights")
    if out_features % TRAINING_TILE or in_features % TRAINING_TILE or not out_features \
            or not in_features:
        return (f"shape [{out_features}, {in_features}] is not a multiple of "
                f"({TRAINING_TILE}, {TRAINING_TILE}), the minimum of torch's 2:4 tile kernel "
                "(cuSPARSELt metadata) that torchao's SemiSparseLinear runs")
    return None


def shape_problem(out_features: int, in_features: int, dtype: str, backend: str) -> str | None:
    """Why torch's ``backend`` cannot convert an ``[out_features, in_features]`` weight of
    ``dtype`` (torch's ``_validate_device_dim_dtype_shape``), or None when it can."""
    _check(dtype, backend)
    c = SHAPE_CONSTRAINTS[backend][dtype]
    m, k = out_features, in_features
    if m < c.sparse_min_rows or m % c.sparse_min_rows or k < c.sparse_min_cols \
            or k % c.sparse_min_cols:
        return (f"shape [{m}, {k}] is not a multiple of ({c.sparse_min_rows}, "
                f"{c.sparse_min_cols}), {backend}'s {dtype} minimum")
    return None


def check_pattern(pattern: str) -> None:
    """Refuse a pattern other than :data:`PATTERNS`, in one line."""
    if pattern not in PATTERNS:
        raise MemfitError(f"unknown sparsity pattern {pattern!r}{suggest(pattern, PATTERNS)}; "
                          f"valid: {', '.join(PATTERNS)} (2:4 is the pattern NVIDIA's sparse "
                          "tensor cores run)")


def check_gpu(label: str, compute_capability: str | None) -> None:
    """Refuse a GPU without sparse tensor cores (compute capability below 8.0), in one line."""
    if compute_capability is None:
        raise MemfitError(f"{label} is not an NVIDIA GPU with a compute capability: torch's "
                          "2:4 kernels (CUTLASS, cuSPARSELt) need NVIDIA compute capability "
                          "8.0 or later; drop --sparsity or choose such a GPU")
    major, _, minor = compute_capability.partition(".")
    if (int(major), int(minor or 0)) < MIN_COMPUTE_CAPABILITY:
        raise MemfitError(f"{label} (compute capability {compute_capability}) has no sparse "
                          "tensor cores: torch's 2:4 kernels need compute capability 8.0 or "
                          "later (A100, A10, L4, H100, ...); drop --sparsity or choose such a "
                          "GPU")
