"""Validate the trace engine on a real GPU: 56 configs (7 families x precision x
checkpointing x optimizer/batch, and 8 with activation or optimizer-state offload), predicted vs
torch.cuda.max_memory_allocated/reserved.

    python bench/validate_gpu.py                 # on a CUDA machine
    python bench/validate_gpu.py --device cpu    # the same matrix, small sizes, on the CPU

Writes bench/results/validate-<device>-<date>.json (device name, torch version, command).
Targets (issue 3): median error <= 2%, max <= 5% on reserved, never under-predict by > 3%.
"""

from __future__ import annotations

import datetime as dt
import sys

import torch

from memfit.cli import main

if __name__ == "__main__":
    args = sys.argv[1:]
    device = "cpu" if "--device" in args and args[args.index("--device") + 1] == "cpu" else "cuda"
    if "--json" not in args:
        name = (torch.cuda.get_device_name().lower().replace(" ", "-")
                if device == "cuda" and torch.cuda.is_available() else "cpu")
        args += ["--json", f"bench/results/validate-{name}-{dt.date.today().isoformat()}.json"]
    if "--device" not in args:
        args += ["--device", device]
    sys.exit(main(["validate", *args]))
