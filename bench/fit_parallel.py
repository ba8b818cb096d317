"""memfit fit over 8 GPUs: the layout search (``gpus=8``: DDP / ZeRO-1 / ZeRO-2 / FSDP / HSDP x
tp x pp, the winners traced per rank) against the older ZeRO-only search (``num_gpus=8``) in the
same process, for Llama-3.2-1B and Llama-3.1-8B (H100 80GB, seq 2048, global batch 64).

Run: ``python bench/fit_parallel.py [preset ...]``. Writes
``bench/results/fit-parallel-cpu-<date>.json`` (wall seconds, traces, the chosen configuration and
layout per search, torch version, command). The machine is shared: compare the two searches'
seconds as a ratio, measured one after the other in this run.
"""

from __future__ import annotations

import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch

import memfit
from memfit.models.build import build_model, example_inputs

PRESETS = ("llama-3.2-1b", "llama-3.1-8b")
GPU, GPUS, GLOBAL_BATCH, SEQ = "h100-80gb", 8, 64, 2048


def search(preset: str, layout: bool) -> dict[str, object]:
    spec = memfit.resolve_model(preset)
    model = build_model(spec, device="meta")
    sample = example_inputs(spec, batch=1, seq=SEQ)
    kwargs = {"gpus": GPUS, "gpus_per_node": 8} if layout else {"num_gpus": GPUS}
    started = time.perf_counter()
    plan = memfit.fit(model, sample, global_batch=GLOBAL_BATCH, gpu=GPU, progress=False,
                      **kwargs)  # type: ignore[arg-type]
    seconds = time.perf_counter() - started
    par = plan.parallel
    return {"preset": preset, "search": "layouts (gpus=8)" if layout else "zero (num_gpus=8)",
            "wall_seconds": round(seconds, 1), "traces": plan.traces,
            "configurations": plan.candidates_considered,
            "chosen": plan.config.label(), "layout": par.describe() if par else None,
            "peak_bytes": plan.peak_bytes, "peak_traced_per_rank": plan.chosen.per_rank,
            "step_seconds": plan.step_seconds,
            "runners_up": [c.config.label() for c in plan.runners_up]}


def main() -> None:
    presets = sys.argv[1:] or PRESETS
    rows = []
    for preset in presets:
        base = search(preset, layout=False)
        new = search(preset, layout=True)
        new["seconds_vs_zero_search"] = round(new["wall_seconds"] / base["wall_seconds"], 2)  # type: ignore[operator]
        rows += [base, new]
    print(f"{'preset':<14} {'search':<18} {'wall s':>7} {'traces':>6}  chosen")
    for r in rows:
        print(f"{r['preset']:<14} {r['search']:<18} {r['wall_seconds']:>7} {r['traces']:>6}  "
              f"{r['chosen']} ({r['peak_bytes'] / 2**30:.2f} GiB"  # type: ignore[operator]
              f"{', per-rank trace' if r['peak_traced_per_rank'] else ''})")
    date = datetime.date.today().isoformat()
    out = Path(__file__).parent / "results" / f"fit-parallel-cpu-{date}.json"
    out.write_text(json.dumps({
        "what": " ".join(__doc__.split("\n\n")[0].split()),
        "torch": torch.__version__, "python": platform.python_version(),
        "machine": f"{platform.machine()}, {GPU} target searched on this CPU (shared, 2 cores)",
        "date": date, "command": "python " + " ".join(sys.argv), "runs": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
