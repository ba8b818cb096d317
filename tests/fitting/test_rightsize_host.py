"""Host memory in ``rightsize_training`` and ``memfit rightsize --host-memory``: a configuration
whose offloaded states need more than each GPU's share of host RAM (less the margin) is dropped
and reported, at the bytes worked out here from the offload formulas; the share comes from
``--host-memory`` (a node's RAM), else the catalog's machine, else the GPU's memory; bad
``--host-memory`` is one line and exit 2; the JSON keeps its keys and adds the new ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memfit.cli import main
from memfit.errors import MemfitError
from memfit.fitting.rightsize import rightsize_training
from memfit.fitting.rightsize_host import HOST_MEMORY_MARGIN, host_limit

# A model whose optimizer states decide the fit (as test_rightsize_training's STATEFUL):
# embedding and head 8192 x 512 each, two blocks of q, k, v, o 4 x 512 x 512 and a gated MLP
# 3 x 512 x 2048, two norms 2 x 512; final norm 512.
MODEL = {"model_type": "llama", "hidden_size": 512, "num_hidden_layers": 2,
         "num_attention_heads": 8, "num_key_value_heads": 8, "intermediate_size": 2048,
         "vocab_size": 8192, "max_position_embeddings": 4096, "tie_word_embeddings": False,
         "torch_dtype": "bfloat16"}
P = 2 * 8192 * 512 + 2 * (4 * 512 * 512 + 3 * 512 * 2048 + 2 * 512) + 512
# ZeRO-Offload on one GPU under bf16-mixed keeps on the host the optimizer's fp32 master
# (4 B a parameter) and states, and an fp32 gradient copy (4 B): AdamW's m and v are 4 B each,
# so 4 + 8 + 4 = 16 B a parameter; 8-bit AdamW's are 1 B each plus an fp32 absmax per 256
# values (bitsandbytes' blocks), so 4 + 2 x (1 + 4 / 256) + 4 = 10 + 1/32 B.
ADAMW_HOST = 16 * P
EIGHT_BIT_HOST = 10 * P + P // 32
GPU_MEMORY = 1_150_000_000
"""Only optimizer offload fits here (test_rightsize_training's
``test_optimizer_offload_is_found_where_only_it_fits``): 8-bit AdamW's states on the GPU do
not."""


def _gpu(name: str, memory: int, **extra: object) -> dict[str, object]:
    return {"name": name, "memory_bytes": memory, "bandwidth_gbps": 100.0,
            "tflops": {"fp32": 0.01, "tf32": None, "fp16": 0.01, "bf16": 0.01, "fp8": None},
            "bf16": True, "fp8": False, "compute_capability": "8.0",
            "host_link": {"kind": "PCIe 4.0 x16", "gbps": 32.0},
            "gpu_link": {"kind": "NVLink", "gbps": 300.0},
            "price_per_hour": 1.0, "price_source": "test", "price_date": "2026-01-01", **extra}


@pytest.fixture
def model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    gpus = tmp_path / "gpus.json"
    gpus.write_text(json.dumps({"gpus": [
        _gpu("toy-a100-small", GPU_MEMORY),
        _gpu("toy-a100-cataloged", GPU_MEMORY, host_memory_per_gpu_bytes=12 * P,
             host_memory_source="toy machine: 12 P bytes a GPU")]}))
    monkeypatch.setenv("MEMFIT_GPU_FILE", str(gpus))
    path = tmp_path / "model.json"
    path.write_text(json.dumps(MODEL))
    return str(path)


def _size(model: str, **kw: object):  # type: ignore[no-untyped-def]
    args: dict[str, object] = dict(mode="train", train_tokens=1e6, seq=64, global_batch=8,
                                   gpus_max=1, gpus=["toy-a100-small"])
    args.update(kw)
    return rightsize_training(model, **args)  # type: ignore[arg-type]


def test_host_memory_below_the_offload_changes_the_answer(model: str) -> None:
    assert P == 16_779_776 and P % 32 == 0
    # The GPU's memory (1.15e9 B, the default share) holds AdamW's 16 B a parameter: the
    # fastest row is AdamW offloaded, as before the check.
    (row,) = _size(model).candidates
    assert (row.config["optimizer"], row.config["offload_optimizer"]) == ("adamw", True)
    assert row.config["host_bytes_per_gpu"] == ADAMW_HOST
    assert row.config["host_limit_bytes_per_gpu"] == int(GPU_MEMORY * (1 - HOST_MEMORY_MARGIN))
    # A node of one GPU whose RAM less 10% is one byte short of AdamW's host bytes (and enough
    # for 8-bit AdamW's): the answer becomes 8-bit AdamW offloaded, and the drop is reported.
    node = ADAMW_HOST * 10 // 9
    assert int(node * 0.9) == ADAMW_HOST - 1
    r = _size(model, host_memory=node)
    (row,) = r.candidates
    assert (row.config["optimizer"], row.config["offload_optimizer"]) == ("adamw-8bit", True)
    assert row.config["host_bytes_per_gpu"] == EIGHT_BIT_HOST
    (drop,) = r.host_rejected
    assert (drop["gpu"], drop["count"], drop["row_dropped"]) == ("toy-a100-small", 1, False)
    assert drop["least_host_bytes_per_gpu"] == ADAMW_HOST
    assert drop["limit_bytes_per_gpu"] == ADAMW_HOST - 1
    assert r.host_memory["node_bytes"] == node
    # Pruning changes nothing under the check either.
    assert _size(model, host_memory=node, prune=False).candidates == r.candidates
    # One byte more and AdamW's fits again.
    (row,) = _size(model, host_memory=node + 2).candidates
    assert row.config["optimizer"] == "adamw"
    # Below 8-bit AdamW's bytes nothing fits: the error says host memory, not the GPU.
    with pytest.raises(MemfitError, match=r"within host memory: .* --host-memory"):
        _size(model, host_memory=EIGHT_BIT_HOST)
    with pytest.raises(MemfitError, match="--host-memory must be a positive size"):
        _size(model, host_memory=0)


def test_the_catalog_machine_is_the_default(model: str) -> None:
    # 12 P bytes a GPU less 10% (10.8 P) holds 8-bit AdamW's 10.03 P, not AdamW's 16 P.
    r = _size(model, gpus=["toy-a100-cataloged"])
    (row,) = r.candidates
    assert row.config["optimizer"] == "adamw-8bit"
    assert r.host_memory["gpus"]["toy-a100-cataloged"] == {
        "ram_bytes_per_gpu": 12 * P, "source": "toy machine: 12 P bytes a GPU"}
    assert r.host_rejected[0]["least_host_bytes_per_gpu"] == ADAMW_HOST
    # --host-memory overrides the catalog.
    (row,) = _size(model, gpus=["toy-a100-cataloged"], host_memory=2**40).candidates
    assert row.config["optimizer"] == "adamw"


def test_each_gpu_gets_its_share_of_the_node() -> None:
    from memfit.gpus import get_gpu

    h100 = get_gpu("h100-sxm-80gb")
    for count, on_node in ((1, 1), (2, 2), (8, 8), (16, 8)):
        limit = host_limit(h100, count, host_memory=2**40, gpus_per_node=8)
        assert limit.ram_bytes == 2**40 // on_node
        assert limit.limit_bytes == int(2**40 // on_node * 0.9)
    # The catalog's: AWS p5.48xlarge, 2,048 GiB for 8 H100s.
    assert host_limit(h100, 1, host_memory=None, gpus_per_node=8).ram_bytes == 256 * 2**30
    # A GPU whose entry names no machine: its own memory.
    rtx = get_gpu("rtx-4090")
    assert rtx.host_memory_per_gpu_bytes is None
    assert host_limit(rtx, 4, host_memory=None, gpus_per_node=8).ram_bytes == rtx.memory_bytes


def _cli(capsys: pytest.CaptureFixture[str], model: str, *extra: str) -> tuple[int, str, str]:
    code = main(["rightsize", model, "--mode", "train", "--train-tokens", "1e6", "--seq", "64",
                 "--global-batch", "8", "--gpus-max", "1", "--gpus", "toy-a100-small", *extra])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(("value", "message"), [
    ("lots", "--host-memory 'lots' is not a size"),
    ("0", "--host-memory must be positive"),
    ("-2TiB", "--host-memory '-2TiB' is not a size"),
])
def test_cli_bad_host_memory_is_one_line(capsys: pytest.CaptureFixture[str], model: str,
                                         value: str, message: str) -> None:
    code, _, err = _cli(capsys, model, f"--host-memory={value}")
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_cli_host_memory_is_for_training(capsys: pytest.CaptureFixture[str], model: str) -> None:
    code = main(["rightsize", model, "--serve", "--qps", "1", "--prompt-tokens", "10",
                 "--output-tokens", "10", "--host-memory", "1TiB"])
    err = capsys.readouterr().err
    assert code == 2 and "drop it with --serve" in err and err.count("\n") == 1, err


def test_cli_json_adds_the_host_keys_and_the_table_one_line(
        capsys: pytest.CaptureFixture[str], model: str) -> None:
    node = str(ADAMW_HOST * 10 // 9)
    code, out, err = _cli(capsys, model, "--host-memory", node, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert set(data) == {"candidates", "pareto", "host_memory", "host_rejected"}
    (c,) = data["candidates"]
    assert set(c) == {"gpu", "count", "pricing", "price_per_gpu_hour", "config",
                      "step_seconds", "job_hours", "cost_usd"}
    assert {"host_bytes_per_gpu", "host_limit_bytes_per_gpu"} <= set(c["config"])
    assert set(data["host_memory"]) == {"margin", "node_bytes", "gpus"}
    (drop,) = data["host_rejected"]
    assert set(drop) == {"gpu", "count", "configurations", "least_host_bytes_per_gpu",
                         "limit_bytes_per_gpu", "row_dropped", "reason"}
    code, out, err = _cli(capsys, model, "--host-memory", node)
    assert code == 0, err
    lines = [line for line in out.splitlines() if line.startswith("host memory:")]
    assert len(lines) == 1 and "dropped" in lines[0], out


def test_a_user_file_sets_or_refuses_the_catalog_figure(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from memfit.gpus import get_gpu

    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"gpus": [{"name": "h100-sxm-80gb",
                                          "host_memory_per_gpu_bytes": 64 * 2**30}]}))
    monkeypatch.setenv("MEMFIT_GPU_FILE", str(path))
    h100 = get_gpu("h100-sxm-80gb")
    # a changed figure does not keep the built-in's machine as its source
    assert h100.host_memory_per_gpu_bytes == 64 * 2**30
    assert h100.host_memory_source is not None and "user file" in h100.host_memory_source
    path.write_text(json.dumps({"gpus": [{"name": "h100-sxm-80gb",
                                          "host_memory_per_gpu_bytes": "lots"}]}))
    with pytest.raises(MemfitError, match=r"host_memory_per_gpu_bytes.*positive whole number"):
        get_gpu("h100-sxm-80gb")
