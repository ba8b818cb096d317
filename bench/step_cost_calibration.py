"""fit's predicted step times against the GPU measurements on record, before and after the
selective-checkpointing dispatch term (Note: [selective checkpointing's dispatch] in
``memfit/fitting/cost.py``), offline: no GPU, the models traced on this machine.

    python bench/step_cost_calibration.py [--out bench/results/step-cost-calibration-<date>.json]

Reads the recorded measurements:

- ``bench/results/techniques-{h100,h200}-2026-11-27.json`` (``bench/techniques.py --device
  cuda``: memfit's Llama-style 58.5 M-parameter model, 8 blocks, 4 x 512 tokens, fp32 AdamW):
  the baseline, full and selective checkpointing, chunked cross-entropy and 4 micro-batches of
  1 (the bench's Budget row is left out: its budget, 50% of the activations, is not the one fit
  would choose);
- ``bench/results/fit-search-h100-2026-11-27{,-2}-partial.json`` (``bench/fit.py --device
  cuda``: gpt2, seq 512, global batch 32, 12 GB): fit's top five, each measured.

For each, ``memfit.fit`` is run with its space pinned to that one configuration (``ckpt=none``
searched beside it, see ``_predict``; a CUDA target, the recorded GPU) and that candidate's
cost read: "after" is this checkout's model, "before" the same cost without the
selective-checkpointing term (``sac_s`` = 0) and with the old 8 us an eager op, which is what
fit predicted before.

It also derives, from the techniques rows, the per-op constants
(``memfit.fitting.rates.CUDA_LAUNCH_S``, ``CUDA_SAC_OP_S``): host seconds per eager op, the
baseline's measured step over the ops its trace counts (the baseline is host-bound: its
predicted GPU work, compute + traffic, is well under the measured step), and the seconds per op
of selective checkpointing's modes, what the selective row measured beyond ``ops x`` that, over
the ops its modes see (``memfit.fitting.traced.sac_ops``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import re
import statistics
import sys
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
TECHNIQUES = {"h100-sxm-80gb": "techniques-h100-2026-11-27.json",
              "h200-141gb": "techniques-h200-2026-11-27.json"}
FIT_RUNS = ("fit-search-h100-2026-11-27-partial.json",
            "fit-search-h100-2026-11-27-2-partial.json")
# techniques row -> the fit space that is the same configuration (micro-batch, ckpt, chunked)
TECHNIQUE_ROWS = {"baseline": (4, "none", False), "ckpt-full": (4, "full", False),
                  "ckpt-selective": (4, "selective", False), "chunked-ce": (4, "none", True),
                  "grad-accum": (1, "none", False)}


def _fit_rows(text: str) -> list[dict[str, Any]]:
    """The ranked rows of a rendered fit table: configuration, predicted and measured ms."""
    rows: list[dict[str, Any]] = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("│").split("│")]
        if len(cells) < 7:
            continue
        if cells[0]:  # a new row
            m = re.match(r"([\d.]+) ms", cells[4])
            k = re.match(r"([\d.]+) ms", cells[6])
            if not (m and k):
                continue
            rows.append({"rank": cells[0], "config": cells[1],
                         "recorded_predicted_s": float(m.group(1)) / 1e3,
                         "measured_s": float(k.group(1)) / 1e3})
        elif rows and cells[1]:
            rows[-1]["config"] += " " + cells[1]
    return rows


def _space(label: str) -> dict[str, Any]:
    """fit's space for a rendered configuration label such as ``bf16-mixed, ckpt=selective,
    mb=32x1, adamw, chunked-loss``."""
    parts = [p.strip() for p in label.split(",")]
    ckpt = next((p.split("=")[1].split("(")[0] for p in parts if p.startswith("ckpt=")), "none")
    mb = next(p for p in parts if p.startswith("mb="))
    opt = "adamw-8bit" if "adamw-8bit" in parts else "adamw"
    return {"precision": [parts[0]], "checkpointing": [ckpt],
            "micro_batch": [int(mb[3:].split("x")[0])], "optimizer": [opt],
            "chunked_loss": ["chunked-loss" in parts], "offload_states": [False],
            "offload_activations": [False]}


def _predict(model: Any, sample: Any, *, gpu: str, global_batch: int, budget: int,
             space: dict[str, Any]) -> Any:
    """fit's candidate for the one configuration ``space`` pins. ``ckpt=none`` is searched
    beside it: fit takes a checkpointed candidate's activation traffic from the same
    combination's trace without checkpointing (``SearchState.activation_traffic``), as the
    recorded full searches did."""
    from memfit.fitting import fit

    ckpt = space["checkpointing"][0]
    plan = fit(model, sample, global_batch=global_batch, budget_bytes=budget, gpu=gpu,
               device="cuda", progress=False, top=50,
               space={**space, "checkpointing": sorted({ckpt, "none"})})
    found = [c for c in (plan.chosen, *plan.runners_up) if c.config.checkpointing == ckpt]
    if not found:
        raise SystemExit(f"fit found no {ckpt} candidate for {space}: {plan}")
    return found[0]


OLD_LAUNCH_S = 8e-6
"""Host seconds per eager op on CUDA before this calibration."""


def _row(name: str, gpu: str, measured: float, chosen: Any, rates: Any) -> dict[str, Any]:
    after = chosen.cost
    ops = round(after.dispatch_s / rates.launch_s)
    before = dataclasses.replace(after, sac_s=0.0, dispatch_s=ops * OLD_LAUNCH_S)
    sac_ops = round(after.sac_s / rates.sac_op_s) if rates.sac_op_s else 0
    return {"config": name, "gpu": gpu, "chosen": chosen.config.label(), "measured_s": measured,
            "before_s": before.total_s, "after_s": after.total_s,
            "measured_over_before": measured / before.total_s,
            "measured_over_after": measured / after.total_s,
            "ops_per_step": ops, "sac_ops_per_step": sac_ops, "cost": after.to_dict()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--skip-gpt2", action="store_true", help="the techniques rows only")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    sys.path.insert(0, str(ROOT))
    from memfit.fitting.rates import gpu_rates
    from memfit.gpus import get_gpu
    from memfit.models.build import build_model, example_inputs
    from techniques import SIZES, Context

    rows: list[dict[str, Any]] = []
    sizes = SIZES["cuda"]
    spec = Context(device="cpu", sizes=sizes, spec=sizes.spec(), inputs={}).spec
    model = build_model(spec, backend="builtin", device="meta")
    sample = example_inputs(spec, batch=1, seq=sizes.seq, device="cpu")
    chosen_at: dict[tuple[int, str, bool], Any] = {}
    for gpu, name in TECHNIQUES.items():
        rates = gpu_rates(get_gpu(gpu))
        measured = {r["key"]: r["step_seconds"] for r in
                    json.loads((RESULTS / name).read_text())["rows"] if r["status"] == "ok"}
        for key, (mb, ckpt, chunked) in TECHNIQUE_ROWS.items():
            at = (mb, ckpt, chunked)
            if (gpu, at) not in chosen_at:
                chosen_at[(gpu, at)] = _predict(model, sample, gpu=gpu,
                                                global_batch=sizes.batch, budget=60 * 2**30,
                                                space={"precision": ["fp32"],
                                                       "checkpointing": [ckpt],
                                                       "micro_batch": [mb],
                                                       "optimizer": ["adamw"],
                                                       "chunked_loss": [chunked],
                                                       "offload_states": [False],
                                                       "offload_activations": [False]})
            rows.append({"bench": name, **_row(key, gpu, measured[key], chosen_at[(gpu, at)],
                                                rates)})
            print(f"{gpu:<15} {key:<15} measured {measured[key] * 1e3:7.1f} ms  before "
                  f"{rows[-1]['before_s'] * 1e3:6.1f}  after {rows[-1]['after_s'] * 1e3:6.1f}",
                  flush=True)

    # The per-op constants from the techniques rows (see the module docstring).
    launch, sac = [], []
    for gpu in TECHNIQUES:
        by = {r["config"]: r for r in rows if r["gpu"] == gpu}
        base, sel = by["baseline"], by["ckpt-selective"]
        per_op = base["measured_s"] / base["ops_per_step"]
        launch.append(per_op)
        sac.append((sel["measured_s"] - per_op * sel["ops_per_step"]) / sel["sac_ops_per_step"])
    derived = {"host_s_per_eager_op": statistics.mean(launch),
               "host_s_per_eager_op_by_gpu": launch,
               "sac_s_per_op": statistics.mean(sac), "sac_s_per_op_by_gpu": sac}
    print(f"derived: {derived}")

    if not args.skip_gpt2:
        from memfit.models import resolve_model

        gspec = resolve_model("gpt2")
        gmodel = build_model(gspec, device="cpu")
        gsample = example_inputs(gspec, batch=1, seq=512, device="cpu")
        rates = gpu_rates(get_gpu("h100-sxm-80gb"))
        measured_by: dict[str, list[float]] = {}
        recorded: dict[str, float] = {}
        for name in FIT_RUNS:
            for r in _fit_rows(json.loads((RESULTS / name).read_text())["output"]):
                measured_by.setdefault(r["config"], []).append(r["measured_s"])
                recorded[r["config"]] = r["recorded_predicted_s"]
        for label, measured in measured_by.items():
            chosen = _predict(gmodel, gsample, gpu="h100-sxm-80gb", global_batch=32,
                              budget=12 * 10**9, space=_space(label))
            row = _row(label, "h100-sxm-80gb", statistics.mean(measured), chosen, rates)
            row.update(bench=list(FIT_RUNS), measured_each_s=measured,
                       recorded_predicted_s=recorded[label])
            rows.append(row)
            print(f"gpt2 {label:<70} measured {row['measured_s'] * 1e3:6.1f} ms  before "
                  f"{row['before_s'] * 1e3:6.1f}  after {row['after_s'] * 1e3:6.1f}",
                  flush=True)

    summary = {}
    for group, keep in (("techniques", lambda r: "techniques" in str(r["bench"])),
                        ("gpt2", lambda r: "fit-search" in str(r["bench"]))):
        sel = [r for r in rows if keep(r)]
        if sel:
            summary[group] = {
                f"measured_over_{w}": [min(r[f"measured_over_{w}"] for r in sel),
                                       max(r[f"measured_over_{w}"] for r in sel)]
                for w in ("before", "after")}
    print(f"measured / predicted, [min, max]: {summary}")

    import torch

    out = {"what": "fit's predicted step vs the recorded GPU measurements, before and after "
                   "the selective-checkpointing dispatch term (offline; see the script)",
           "command": "python bench/step_cost_calibration.py",
           "date": dt.date.today().isoformat(), "torch": torch.__version__,
           "old_launch_s": OLD_LAUNCH_S, "derived": derived,
           "measured_over_predicted": summary, "rows": rows}
    path = Path(args.out or RESULTS / f"step-cost-calibration-{out['date']}.json")
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
