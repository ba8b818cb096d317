"""One Precision record per name (issue 21 §2): what each precision means, checked from first
principles, and no module of memfit keeping its own table of precisions.

Bytes: fp32 is 4 bytes an element, bf16 and fp16 are 2 (IEEE 754 binary32 / binary16, bfloat16's
1+8+7 bits). torch.autocast runs the listed ops in the low format and leaves the parameters
fp32 (the "-mixed" precisions, which are then the optimizer's fp32 master copy); pure bf16/fp16
casts the model itself; fp16-mixed needs loss scaling (GradScaler) because fp16's 5-bit exponent
underflows small gradients; bf16 needs compute capability 8.0, fp8 matmuls 8.9.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import memfit
from memfit import vocab
from memfit.dtypes import torch_dtype
from memfit.errors import MemfitError

SRC = Path(memfit.__file__).resolve().parent

# name: (autocast, params, compute, matmul, weight B, grad B, master B, compute B, GradScaler,
#        hardware it needs)
EXPECTED = {
    "fp32": (None, "fp32", "fp32", "fp32", 4, 4, 0, 4, False, None),
    "bf16-mixed": ("bf16", "fp32", "bf16", "bf16", 4, 4, 4, 2, False, "bf16"),
    "fp16-mixed": ("fp16", "fp32", "fp16", "fp16", 4, 4, 4, 2, True, None),
    "bf16": (None, "bf16", "bf16", "bf16", 2, 2, 0, 2, False, "bf16"),
    "fp16": (None, "fp16", "fp16", "fp16", 2, 2, 0, 2, False, None),
    "fp8": ("bf16", "fp32", "bf16", "fp8", 4, 4, 4, 2, False, "fp8"),
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_precision_means_what_torch_does(name: str) -> None:
    p = vocab.precision(name)
    got = (p.autocast, p.params, p.compute, p.matmul, p.weight_bytes, p.grad_bytes,
           p.master_bytes, p.compute_bytes, p.grad_scaler, p.needs)
    assert got == EXPECTED[name]
    assert p.name == name
    # mixed precision == an fp32 master copy under a lower compute format
    assert p.mixed == (name in ("bf16-mixed", "fp16-mixed", "fp8"))


def test_the_table_holds_every_name_once_in_order() -> None:
    assert list(vocab.PRECISIONS) == list(EXPECTED)
    assert vocab.names("precision", "fit") == ("fp32", "bf16-mixed", "fp16-mixed", "bf16")
    assert vocab.names("precision", "trace") == ("fp32", "bf16-mixed", "fp16-mixed", "bf16",
                                                 "fp16")


def test_bytes_agree_with_torch_element_sizes() -> None:
    """The record's bytes are the element sizes of the torch dtypes of its formats."""
    for p in vocab.PRECISIONS.values():
        assert torch_dtype(p.params).itemsize == p.weight_bytes == p.grad_bytes
        assert torch_dtype(p.compute).itemsize == p.compute_bytes


def test_torch_dtype_names_the_torch_dtypes() -> None:
    assert torch_dtype("fp32") is torch.float32
    assert torch_dtype("bf16") is torch.bfloat16
    assert torch_dtype("fp16") is torch.float16
    with pytest.raises(MemfitError, match=r"'int4' has no torch dtype.*valid: fp32, bf16, fp16"):
        torch_dtype("int4")


def test_an_unknown_precision_is_one_line_with_the_closest_and_the_valid() -> None:
    with pytest.raises(MemfitError) as info:
        vocab.precision("bf16_mixed")
    msg = str(info.value)
    assert "\n" not in msg
    assert "unknown precision 'bf16_mixed'" in msg and "did you mean 'bf16-mixed'" in msg
    assert msg.endswith("valid: fp32, bf16-mixed, fp16-mixed, bf16, fp16, fp8")


def test_the_trace_engine_reads_the_record() -> None:
    """(autocast dtype, dtype the model is cast to): autocast over an untouched fp32 model for
    the "-mixed" precisions, a cast model and no autocast for pure bf16/fp16."""
    from memfit.trace.options import PRECISIONS

    assert PRECISIONS == {
        "fp32": (None, None),
        "bf16-mixed": (torch.bfloat16, None),
        "fp16-mixed": (torch.float16, None),
        "bf16": (None, torch.bfloat16),
        "fp16": (None, torch.float16),
    }


def test_apply_precision_reads_the_record() -> None:
    from memfit.techniques.precision import apply_precision

    model = torch.nn.Linear(4, 4)
    assert apply_precision(model, "fp16-mixed", device_type="cpu").scaler is not None
    mp = apply_precision(model, "bf16-mixed", device_type="cpu")
    assert mp.scaler is None and mp.autocast_dtype is torch.bfloat16
    assert model.weight.dtype is torch.float32  # autocast leaves the parameters fp32
    assert apply_precision(model, "bf16", device_type="cpu").autocast_dtype is None
    assert model.weight.dtype is torch.bfloat16  # pure bf16 casts the model


def test_the_analytic_run_reads_the_record() -> None:
    from memfit.analytic.config import RunConfig

    assert RunConfig(precision="fp8").compute_format == "bf16"
    assert RunConfig(precision="fp8").mixed
    assert not RunConfig(precision="bf16").mixed
    assert RunConfig(precision="fp16").compute_format == "fp16"


@pytest.mark.parametrize(("extra", "says"), [
    ((), "--method trace does not model --precision fp8 yet"),
    (("--gpus", "2", "--zero", "3"), "--method trace over 2 GPUs: --precision fp8 is not traced"),
])
def test_a_precision_the_trace_does_not_take_is_refused_by_plan_method_trace(
        capsys: pytest.CaptureFixture[str], extra: tuple[str, ...], says: str) -> None:
    from memfit.cli import main

    code = main(["plan", "gpt2", "--method", "trace", "--precision", "fp8", "--gpu",
                 "h100-sxm-80gb", *extra])
    err = capsys.readouterr().err
    assert code == 2 and says in err and "Traceback" not in err


# --------------------------------------------------------------------------------------------
# No second table


def _precision_keys(node: ast.AST) -> list[str]:
    """The precision names among a dict literal's keys, or a tuple/list/set literal's items."""
    if isinstance(node, ast.Dict):
        items = node.keys
    elif isinstance(node, ast.Tuple | ast.List | ast.Set):
        items = node.elts
    else:
        return []
    return [i.value for i in items
            if isinstance(i, ast.Constant) and i.value in vocab.PRECISIONS]


# The exporters translate into another tool's own names (Lightning's "16-mixed", Accelerate's
# "no") and say which precisions that tool trains in: its vocabulary, not what a precision means
# to memfit; nothing memfit computes reads them.
_OTHER_TOOLS = "export/"
_HOMES = {"vocab.py", "dtypes.py"}
# torch's 2:4 backends' own per-dtype constants (shape minimums, metadata layouts), each copied
# from torch's source with its file named: what a kernel accepts, not what a precision means.
_BACKEND_TABLES = {"semi_structured.py"}


def _tables(path: Path) -> list[str]:
    """Dict literals keyed by two or more precision (or format) names, and membership tests
    (``x in ("bf16", "fp16")``) against two or more of them: a table of what precisions mean."""
    found = []
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict) and len(_precision_keys(node)) >= 2:
            found.append(f"{node.lineno}: dict keyed by {_precision_keys(node)}")
        elif isinstance(node, ast.Compare) and any(isinstance(op, ast.In | ast.NotIn)
                                                   for op in node.ops):
            for right in node.comparators:
                if len(_precision_keys(right)) >= 2:
                    found.append(f"{node.lineno}: 'in' {_precision_keys(right)}")
    return found


def test_the_scan_finds_a_table(tmp_path: Path) -> None:
    """The scan itself: it finds the shapes of table it is meant to forbid."""
    source = ('A = {"bf16-mixed": 1, "fp16-mixed": 2}\n'
              'if p in ("bf16", "fp16"):\n    pass\n'
              'B = {"fp32": 4, "bf16": 2}\n'
              'C = {"fp32": 4}\n')
    path = tmp_path / "probe.py"
    path.write_text(source)
    assert [line.split(":")[0] for line in _tables(path)] == ["1", "2", "4"]


def test_no_module_keeps_its_own_precision_table() -> None:
    offenders = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel in _HOMES | _BACKEND_TABLES or rel.startswith(_OTHER_TOOLS):
            continue
        if found := _tables(path):
            offenders[rel] = found
    assert not offenders, ("read memfit.vocab.precision(name) (and memfit.dtypes for bytes and "
                           f"torch dtypes) instead of a table: {offenders}")
