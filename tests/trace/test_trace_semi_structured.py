"""``memfit.estimate`` on a model whose linear weights are torch's 2:4 semi-structured tensors.

torch converts only CUDA tensors (``to_sparse_semi_structured`` checks the device), but the
subclasses themselves can be built on CPU from their parts: the CUTLASS ``packed`` and ``meta``
of torch's own conversion (Python, it runs on CPU), or a cuSPARSELt ``packed`` of the size
``_cslt_compress`` allocates. The trace counts their inner tensors: the compressed bytes.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.sparse import SparseSemiStructuredTensorCUSPARSELT, SparseSemiStructuredTensorCUTLASS
from torch.sparse._semi_structured_conversions import sparse_semi_structured_from_dense_cutlass

import memfit
from memfit.categories import MemoryCategory
from memfit.semi_structured import compressed_bytes
from memfit.techniques import mask_2_4

SHAPES = [(128, 256), (64, 128)]  # out, in of the two layers


def _model(backend: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 64)).to(torch.bfloat16)
    for layer in (model[0], model[2]):
        w = layer.weight.detach() * mask_2_4(layer.weight)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "prototype stage"
            if backend == "cutlass":
                packed, meta = sparse_semi_structured_from_dense_cutlass(w)
                sparse = SparseSemiStructuredTensorCUTLASS(
                    w.shape, packed=packed, meta=meta, packed_t=None, meta_t=None,
                    compressed_swizzled_bitmask=None, requires_grad=False)
            else:  # _cslt_compress's allocation: numel * 9 / 16 bf16 elements
                packed = torch.zeros(w.numel() * 9 // 16, dtype=w.dtype)
                sparse = SparseSemiStructuredTensorCUSPARSELT(
                    w.shape, packed=packed, meta=None, packed_t=None, meta_t=None,
                    compressed_swizzled_bitmask=None, requires_grad=False)
        layer.weight = nn.Parameter(sparse, requires_grad=False)
    return model


@pytest.mark.parametrize("backend", ["cutlass", "cusparselt"])
def test_the_trace_counts_the_compressed_weights(backend: str) -> None:
    model = _model(backend)
    x = torch.randn(8, 256, dtype=torch.bfloat16)
    biases = (128 + 64) * 2
    est = memfit.estimate(model, x, optimizer=None, precision="bf16", device="cpu")
    # bf16: 9/8 bytes per weight (half the values + a 4-bit code per group of 4), by hand
    expected = sum(m * k * 9 // 8 for m, k in SHAPES) + biases
    assert expected == sum(compressed_bytes(m, k, "bf16", backend).total
                           for m, k in SHAPES) + biases
    assert est.breakdown[MemoryCategory.WEIGHTS] == expected
    # On the CUDA target each inner tensor is its own allocation, rounded up to 512 bytes
    # (the caching allocator's kMinBlockSize).
    cuda = memfit.estimate(model, x, optimizer=None, precision="bf16", device="cuda")
    parts = [(m * k, m * k // 8) if backend == "cutlass" else (m * k * 9 // 8,)
             for m, k in SHAPES]
    rounded = sum(-(-b // 512) * 512 for p in parts for b in p) + 2 * 512
    assert cuda.breakdown[MemoryCategory.WEIGHTS] == rounded
