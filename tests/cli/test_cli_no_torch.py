"""The analytic CLI paths never import torch or transformers (Note: [lazy public API]).

``import torch`` alone takes 2-3 s; `memfit plan --params 7e9`, `memfit gpus` and `memfit models`
need none of it. Each check runs in a fresh interpreter (this test process has torch loaded
already) and reads ``sys.modules`` after the command, so it tests what is imported, not how long
it takes. bench/cli_startup.py times the same commands.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import memfit

SRC = Path(memfit.__file__).resolve().parent.parent
HEAVY = ("torch", "transformers")

# The first command that imports a heavy module is the one named (later ones would see it loaded).
_RUN_ALL = textwrap.dedent("""
    import contextlib, io, json, sys
    from memfit.cli import main
    heavy = {heavy!r}
    found = []
    for argv in json.loads(sys.argv[1]):
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            try:
                code = main(argv)
            except SystemExit as exc:  # --help, --version
                code = exc.code
        loaded = [m for m in heavy if m in sys.modules]
        found.append({{"argv": argv, "code": code, "loaded": loaded}})
        if loaded:
            break
    print(json.dumps(found))
""")


def _python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(SRC), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env=env, timeout=300, check=False)


def _run_cli(commands: list[list[str]]) -> list[dict[str, object]]:
    done = _python(_RUN_ALL.format(heavy=HEAVY), json.dumps(commands))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _safetensors(tensors: dict[str, list[int]]) -> bytes:
    """A bf16 safetensors file by hand from the format spec (u64 little-endian header length,
    JSON header, data buffer): https://huggingface.co/docs/safetensors/index"""
    header, offset = {}, 0
    for name, shape in tensors.items():
        size = 2 * shape[0] * (shape[1] if len(shape) > 1 else 1)
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + bytes(offset)


def test_analytic_cli_paths_import_neither_torch_nor_transformers(tmp_path: Path) -> None:
    llama = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
             "vocab_size": 256, "max_position_embeddings": 128, "tie_word_embeddings": False}
    config = tmp_path / "config.json"
    config.write_text(json.dumps(llama))
    folder = tmp_path / "ckpt"  # a config.json with its weights: plan reads the headers too
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(llama))
    (folder / "model.safetensors").write_bytes(_safetensors({"lm_head.weight": [256, 64]}))
    commands = [
        ["--version"], ["--help"], ["plan", "--help"],
        ["gpus"], ["gpus", "--json"], ["models"], ["models", "--json"],
        ["plan", "--params", "7e9"], ["plan", "--params", "7e9", "--gpu", "a100-80gb", "--json"],
        ["plan", "gpt2"], ["plan", "llama-3-8b", "--gpu", "rtx-4090", "--mode", "lora"],
        ["plan", "llama-3-70b", "--gpu", "h100-80gb"],  # does not fit: suggestions, scale-out
        ["plan", "mistral-7b", "--mode", "inference", "--new-tokens", "128", "--json"],
        ["plan", "llama-3-8b", "--mode", "qlora", "--gpu", "a10g"],
        ["plan", "gpt2", "--method", "analytic", "--gpu", "t4"],
        ["plan", "--params", "7e9", "--gpus", "8", "--zero", "3"],  # formulas: nothing to trace
        ["plan", "llama-3-8b", "--gpus", "8", "--engine", "deepspeed", "--zero", "3"],
        ["plan", "llama-3-8b", "--gpus", "8", "--fsdp", "--method", "analytic"],
        ["plan", str(config), "--gpu", "h100-80gb"],
        ["plan", str(config), "--json"],
        ["plan", str(folder), "--gpu", "h100-80gb"],
        ["serve-plan", "gemma-3-1b", "--kv-cache-memory", "1GiB"],
        ["serve-plan", "deepseek-v3", "--kv-cache-memory", "8GiB", "--tp", "8", "--json"],
        ["plan", "llama-9-8b"],  # a usage error (exit 2) stays light too
    ]
    results = _run_cli(commands)
    offenders = [(r["argv"], r["loaded"]) for r in results if r["loaded"]]
    assert offenders == [], f"imported a heavy module: {offenders}"
    assert len(results) == len(commands)
    codes = {" ".join(r["argv"]): r["code"] for r in results}  # type: ignore[arg-type]
    assert codes.pop("plan llama-9-8b") == 2
    assert codes.pop("--help") == 0 and codes.pop("--version") == 0
    assert set(codes.values()) == {0}, codes


# A GPU driver's device files (NVIDIA, ROCm, WSL2): with one, monitor may ask torch.cuda.
_GPU_FILES = ("/dev/nvidiactl", "/dev/nvidia[0-9]*", "/proc/driver/nvidia/version", "/dev/kfd",
              "/dev/dxg")


@pytest.mark.skipif(any(glob.glob(p) for p in _GPU_FILES), reason="a GPU driver is here: "
                    "without NVML, monitor reads the GPUs through torch.cuda")
def test_monitor_once_reads_host_memory_without_torch() -> None:
    """`memfit monitor --once` on a host with no GPU shows host memory only; it imported torch
    (seconds) to learn there was no GPU. NVML (nvidia-ml-py) needs no torch either."""
    results = _run_cli([["monitor", "--once"], ["monitor", "--once", "--json"],
                        ["monitor", "--once", "--threshold", "0.5"]])
    assert [(r["argv"], r["loaded"], r["code"]) for r in results] == [
        (argv, [], 0) for argv in (["monitor", "--once"], ["monitor", "--once", "--json"],
                                   ["monitor", "--once", "--threshold", "0.5"])]


def test_the_check_sees_torch_when_a_command_needs_it() -> None:
    # validate does import torch (then refuses: no CUDA here); the same check must say so (a
    # test that cannot fail would prove nothing).
    results = _run_cli([["gpus"], ["validate", "--device", "cuda"]])
    assert results[0]["loaded"] == []
    assert "torch" in results[-1]["loaded"]


def test_import_memfit_is_light_and_the_api_stays_whole() -> None:
    code = textwrap.dedent("""
        import sys, json
        import memfit
        from memfit import RunConfig, plan, resolve_model, list_gpus, MemfitError
        light = [m for m in ("torch", "transformers") if m in sys.modules]
        p = plan(resolve_model("gpt2"), RunConfig(batch=2, seq=512))
        light += [m for m in ("torch", "transformers") if m in sys.modules]
        fn = memfit.estimate  # a torch-side name loads on first use
        import memfit.parallel.trace  # memfit.estimate: the engine, or each rank of a layout
        print(json.dumps({"light": light, "torch": "torch" in sys.modules,
                          "total": p.total_bytes, "same": fn is memfit.parallel.trace.estimate}))
    """)
    done = _python(code)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["light"] == [] and out["torch"] is True
    assert out["total"] > 0 and out["same"] is True


def test_every_public_name_has_a_source() -> None:
    assert set(memfit.__all__) - {"__version__"} == set(memfit._SOURCES)
    assert not hasattr(memfit, "no_such_name")
