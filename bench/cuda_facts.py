"""The CUDA runtime constants memfit models, measured on the GPU at hand.

    python bench/cuda_facts.py [--out PATH]

memfit's runtime model (``memfit.runtime``) takes the CUDA context and the cuBLAS workspaces
from PyTorch's source and published figures. This script measures them on a real GPU:

- the device as PyTorch sees it (``total_memory``: the catalog's usable bytes);
- the memory this process holds outside PyTorch's caching allocator, read from NVML per
  process (``nvmlDeviceGetComputeRunningProcesses``, so other processes on the GPU do not
  count), minus ``torch.cuda.memory_reserved()``: the CUDA context, after init and after each
  workload that loads more kernels (cuBLAS GEMMs, each SDPA backend, a training step);
- what the first GEMM of each dtype leaves in the caching allocator besides its output
  (cuBLAS / cuBLASLt workspaces, which PyTorch allocates through the allocator);

and prints each next to memfit's prediction. Writes ``bench/results/cuda-facts-<gpu>-<date>.json``
(or ``--out``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from memfit import runtime

MiB = 1 << 20


def _nvml_used(pid: int) -> int | None:
    try:
        import pynvml
    except ImportError:
        return None
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
        if proc.pid == pid:
            return int(proc.usedGpuMemory)
    return None


def _outside_allocator(label: str, rows: list[dict[str, Any]]) -> None:
    torch.cuda.synchronize()
    used = _nvml_used(os.getpid())
    reserved = torch.cuda.memory_reserved()
    rows.append({"after": label, "nvml_process_used": used, "torch_reserved": reserved,
                 "outside_allocator": None if used is None else used - reserved,
                 "torch_allocated": torch.cuda.memory_allocated()})


def _first_gemm(dtype: torch.dtype) -> dict[str, Any]:
    a = torch.randn(1024, 1024, device="cuda", dtype=dtype)
    b = torch.randn(1024, 1024, device="cuda", dtype=dtype)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = a @ b
    torch.cuda.synchronize()
    grew = torch.cuda.memory_allocated() - before - out.numel() * out.element_size()
    del a, b, out
    return {"dtype": str(dtype), "allocated_besides_output": grew}


def _sdpa(backend: Any) -> dict[str, Any]:
    from torch.nn.attention import sdpa_kernel

    q, k, v = (torch.randn(4, 16, 1024, 64, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    try:
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            torch.cuda.synchronize()
            kept = torch.cuda.memory_allocated() - base - out.numel() * out.element_size()
            out.sum().backward()
    except RuntimeError as exc:
        return {"backend": str(backend), "error": str(exc).splitlines()[0][:200]}
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return {"backend": str(backend), "saved_besides_output": kept, "peak_above_inputs": peak}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("cuda_facts: no CUDA device here; run it on a GPU machine", file=sys.stderr)
        return 2
    torch.cuda.init()
    props = torch.cuda.get_device_properties(0)
    context: list[dict[str, Any]] = []
    torch.zeros(1, device="cuda")
    _outside_allocator("init (one small tensor)", context)
    gemms = [_first_gemm(d) for d in (torch.float32, torch.bfloat16, torch.float16)]
    _outside_allocator("fp32/bf16/fp16 GEMMs", context)
    from torch.nn.attention import SDPBackend

    sdpa = [_sdpa(b) for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                               SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH)]
    _outside_allocator("SDPA (flash, efficient, cuDNN, math), fwd+bwd", context)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(),
                                torch.nn.LayerNorm(4096), torch.nn.Linear(4096, 1024)).cuda()
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(torch.randn(64, 1024, device="cuda")).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    _outside_allocator("an MLP training step (autocast bf16, AdamW)", context)

    cc = f"{props.major}.{props.minor}"
    predicted = {
        "cuda_context_bytes": runtime.cuda_context_bytes(torch.version.cuda),
        "cublas_workspace_bytes": runtime.cublas_workspace_bytes(cc),
        "cublaslt_workspace_bytes": runtime.cublaslt_workspace_bytes(cc),
    }
    result = {
        "what": "CUDA runtime constants (bench/cuda_facts.py)",
        "date": dt.date.today().isoformat(),
        "command": " ".join(sys.argv),
        "device": torch.cuda.get_device_name(), "compute_capability": cc,
        "total_memory": props.total_memory, "multiprocessors": props.multi_processor_count,
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(), "python": platform.python_version(),
        "CUDA_MODULE_LOADING": os.environ.get("CUDA_MODULE_LOADING"),
        "mem_get_info": list(torch.cuda.mem_get_info()),
        "context": context, "first_gemm": gemms, "sdpa": sdpa, "memfit_predicted": predicted,
    }
    name = torch.cuda.get_device_name().lower().replace(" ", "-")
    out = args.out or Path(f"bench/results/cuda-facts-{name}-{result['date']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{result['device']}: total_memory {props.total_memory:,} B; torch {torch.__version__}"
          f", CUDA {torch.version.cuda}")
    for row in context:
        outside = row["outside_allocator"]
        print(f"  outside the allocator after {row['after']}: "
              f"{'n/a' if outside is None else f'{outside / MiB:.1f} MiB'}")
    print(f"  memfit's context: {predicted['cuda_context_bytes'] / MiB:.1f} MiB")
    for g in gemms:
        print(f"  first {g['dtype']} GEMM left {g['allocated_besides_output']:,} B "
              f"(memfit: cuBLAS {predicted['cublas_workspace_bytes']:,} + cuBLASLt "
              f"{predicted['cublaslt_workspace_bytes']:,})")
    for s in sdpa:
        print(f"  {s}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
