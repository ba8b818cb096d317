"""``memfit.techniques.sparsify``: pruned Linear weights stored as CSR or BSR only below the
break-even density, with bytes checked against hand-computed formulas and the real tensors'
storages, and outputs against the dense pruned model (fp32, CPU, ``torch.sparse.mm``)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils import prune

from memfit.techniques import SparseLinear, break_even_density, sparsify
from memfit.techniques.sparse_weights import sparse_bytes
from memfit.trace.pruning import pruned_names

pytestmark = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")

# fp32 CPU: torch.sparse.mm may sum each output in another order than the dense matmul. Measured:
# max abs difference 0.0 on these models; 2.9e-6 on a 64 x 128 CSR product of randn inputs.
RTOL, ATOL = 1e-5, 1e-5


def real_bytes(weight: torch.Tensor) -> int:
    """The storages a CSR/BSR tensor holds, read from torch (not from memfit)."""
    return sum(t.untyped_storage().nbytes()
               for t in (weight.values(), weight.crow_indices(), weight.col_indices()))


def test_break_even_density_by_hand() -> None:
    # 4 x 8 fp32 weight: 128 dense bytes.
    # CSR, int64: nnz * (4 + 8) + 5 * 8 = 128 -> nnz = 88 / 12 of 32 entries
    assert break_even_density((4, 8), format="csr") == pytest.approx(88 / 12 / 32)
    # CSR, int32: nnz * (4 + 4) + 5 * 4 = 128 -> nnz = 108 / 8
    assert break_even_density((4, 8), format="csr", index_bytes=4) == pytest.approx(108 / 8 / 32)
    # CSR, bf16 values, int64: nnz * (2 + 8) + 40 = 64 -> nnz = 2.4
    assert break_even_density((4, 8), format="csr", value_bytes=2) == pytest.approx(2.4 / 32)
    # BSR 2 x 4 blocks, int64: 4 blocks; nb * (8 * 4 + 8) + 3 * 8 = 128 -> nb = 104 / 40
    assert break_even_density((4, 8), format="bsr", blocksize=(2, 4)) == pytest.approx(
        104 / 40 / 4)
    # the byte formula crosses the dense bytes there: 7 entries save, 8 do not
    assert sparse_bytes((4, 8), 7, format="csr") == 7 * 12 + 40 == 124
    assert sparse_bytes((4, 8), 8, format="csr") == 136
    # large square fp32: the familiar 1/3 (int64) and 1/2 (int32), less the row pointers
    assert break_even_density((4096, 4096), format="csr") == pytest.approx(1 / 3, abs=1e-3)
    assert break_even_density((4096, 4096), format="csr", index_bytes=4) == pytest.approx(
        1 / 2, abs=1e-3)


def pruned_mlp(amount: float) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 32))
    for mod in (model[0], model[2]):
        prune.l1_unstructured(mod, "weight", amount=amount)
    return model


def test_csr_bytes_are_the_real_storages_and_the_formula() -> None:
    model = pruned_mlp(0.9)
    report = sparsify(model, format="csr")
    assert report.converted == ["0", "2"]
    first, second = report.layers
    # l1_unstructured prunes round(0.9 * n) entries: 8192 -> 819 kept, 2048 -> 205 kept
    assert isinstance(model[0], SparseLinear) and model[0].weight.layout is torch.sparse_csr
    assert model[0].weight.values().numel() == 819
    # int32 indices: values and column indices per entry, rows + 1 row pointers
    assert first.bytes_after == 819 * (4 + 4) + 65 * 4 == real_bytes(model[0].weight)
    assert second.bytes_after == 205 * (4 + 4) + 33 * 4 == real_bytes(model[2].weight)
    # before: weight_orig, weight_mask and the recomputed weight, each 128 x 64 fp32
    assert first.bytes_before == 3 * 128 * 64 * 4
    assert report.bytes_before == 3 * 4 * (128 * 64 + 64 * 32)
    assert report.bytes_after == first.bytes_after + second.bytes_after


def test_int64_indices() -> None:
    model = pruned_mlp(0.9)
    report = sparsify(model, format="csr", index_dtype=torch.int64)
    assert model[0].weight.crow_indices().dtype is torch.int64
    assert report.layers[0].bytes_after == 819 * (4 + 8) + 65 * 8 == real_bytes(model[0].weight)


def block_sparse(rows: int, cols: int, keep: list[tuple[int, int]], block: int = 16) -> nn.Linear:
    torch.manual_seed(1)
    lin = nn.Linear(cols, rows)
    mask = torch.zeros(rows, cols)
    for r, c in keep:
        mask[r * block:(r + 1) * block, c * block:(c + 1) * block] = 1
    prune.custom_from_mask(lin, "weight", mask)
    return lin


def test_auto_takes_bsr_for_block_pruning_and_csr_for_unstructured() -> None:
    # 64 x 128 with 3 of its 32 16x16 blocks kept: BSR 3 * (256 * 4 + 4) + 5 * 4 = 3104 bytes,
    # CSR 768 * 8 + 65 * 4 = 6404 bytes
    model = nn.Sequential(block_sparse(64, 128, [(0, 0), (1, 3), (3, 7)]))
    report = sparsify(model)  # auto, 16 x 16 blocks
    assert model[0].weight.layout is torch.sparse_bsr
    assert report.layers[0].bytes_after == 3 * (256 * 4 + 4) + 5 * 4 == real_bytes(
        model[0].weight)
    # unstructured 90%: every 16 x 16 block keeps an entry; CSR wins
    model = pruned_mlp(0.9)
    assert [lay.format for lay in sparsify(model).layers] == ["csr", "csr"]


def test_dense_where_sparse_would_not_save() -> None:
    # 50% fp32 with int64 indices is above the ~1/3 break-even: kept dense, but prune.remove'd
    model = pruned_mlp(0.5)
    report = sparsify(model, format="csr", index_dtype=torch.int64)
    assert report.converted == []
    assert isinstance(model[0], nn.Linear) and not pruned_names(model[0])
    assert not hasattr(model[0], "weight_orig") and not hasattr(model[0], "weight_mask")
    assert report.layers[0].bytes_before == 3 * 128 * 64 * 4
    assert report.layers[0].bytes_after == 128 * 64 * 4  # the mask and the copy are gone
    assert "break-even" in report.layers[0].reason
    # int32 at 50%: 4096 * 8 + 65 * 4 = 33028 > 32768, still not a saving
    assert sparsify(pruned_mlp(0.5), format="csr").converted == []
    # 60% pruned, int32: 3277 * 8 + 260 = 26476 < 32768 (19% less); min_saving=0.25 keeps it
    assert sparsify(pruned_mlp(0.6), format="csr").converted == ["0", "2"]
    assert sparsify(pruned_mlp(0.6), format="csr", min_saving=0.25).converted == []


def test_bsr_needs_a_multiple_of_the_blocks_and_cpu_needs_fp32() -> None:
    model = nn.Sequential(nn.Linear(30, 20))
    prune.l1_unstructured(model[0], "weight", amount=0.95)
    assert "not a multiple" in sparsify(model, format="bsr").layers[0].reason
    model = nn.Sequential(nn.Linear(64, 64)).to(torch.bfloat16)
    prune.l1_unstructured(model[0], "weight", amount=0.95)
    report = sparsify(model)
    assert report.converted == [] and "bfloat16" in report.layers[0].reason


@pytest.mark.parametrize("format", ["csr", "bsr"])
def test_outputs_match_the_dense_model(format: str) -> None:
    dense = pruned_mlp(0.9) if format == "csr" else nn.Sequential(
        block_sparse(64, 128, [(0, 0), (2, 5)]), nn.ReLU(), block_sparse(32, 64, [(1, 1)]))
    x = torch.randn(4, 7, 128)  # a leading batch of sequences: the layer flattens and restores
    with torch.no_grad():
        expected = dense(x)
    report = sparsify(dense, format=format, blocksize=(16, 16))
    assert report.converted == ["0", "2"]
    with torch.no_grad():
        got = dense(x)
    assert got.shape == expected.shape == (4, 7, 32)
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)


def test_bad_arguments() -> None:
    model = pruned_mlp(0.9)
    with pytest.raises(ValueError, match="format must be one of"):
        sparsify(model, format="coo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="index_dtype"):
        sparsify(model, index_dtype=torch.int16)
    with pytest.raises(ValueError, match="min_saving"):
        sparsify(model, min_saving=1.5)
    with pytest.raises(ValueError, match="wrap a bare"):
        sparsify(nn.Linear(4, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing was changed by the refused calls
        assert pruned_names(model[0]) == ["weight"]


def test_estimate_refuses_a_sparsified_model_in_one_line() -> None:
    # Before the check: RuntimeError("Sparse CSR tensors do not have strides") from fake_model.
    from memfit.errors import MemfitError
    from memfit.trace import estimate

    model = pruned_mlp(0.9)
    sparsify(model)
    with pytest.raises(MemfitError, match=r"0\.weight is a sparse_csr tensor.*before memfit"):
        estimate(model, torch.randn(2, 128), optimizer=None, device="cpu")
