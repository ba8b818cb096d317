"""``memfit export``: write a plan as the config file a training tool reads.

The plan is a file written by ``memfit fit --save plan.json`` (or ``memfit fit --json``), or by
``memfit plan ... --json > plan.json`` (an analytic or traced plan: its run settings). The
exported file goes to standard output, or to ``--output``. Every setting the tool cannot
express is listed on standard error (and in the ``--json`` report), never dropped.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from memfit.cli._common import print_json

EPILOG = """examples:
  memfit fit gpt2 --gpu a100-40gb --global-batch 256 --save plan.json
  memfit export plan.json --to deepspeed --output ds_config.json
  memfit plan llama-3-8b --gpus 8 --zero 3 --checkpointing full --json > plan.json
  memfit export plan.json --to accelerate > accelerate_config.yaml
  memfit serve-plan llama-3.1-8b --kv-cache-memory 20GiB --json > serve.json
  memfit export serve.json --to vllm
  memfit export serve.json --to sglang --format python
"""


def register(sub: Any) -> None:
    from memfit.export import SERVING_TARGETS, TARGETS

    p = sub.add_parser("export", help="write a plan as a DeepSpeed/Accelerate/Lightning/"
                       "HF Trainer/torchtitan/torchtune config", description=__doc__,
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("plan", help="plan JSON (memfit fit --save, or memfit plan --json; for "
                   "vllm and sglang, memfit serve-plan --json)")
    p.add_argument("--to", required=True, metavar="TOOL",
                   help=f"target tool: {', '.join(TARGETS + SERVING_TARGETS)}")
    p.add_argument("--format", default="command", choices=("command", "python"),
                   help="vllm / sglang: the launch command (default) or the Python keywords "
                   "of vllm.LLM(...) / sglang.Engine(...)")
    p.add_argument("--output", "-o", help="write the file here (default: standard output)")
    p.add_argument("--json", action="store_true",
                   help="print a JSON report (target, file, gaps, notes; the file's text "
                        "when there is no --output)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from memfit.export import export_plan

    out = export_plan(args.plan, args.to, args.output, form=args.format)
    if args.json:
        report = out.to_dict()
        report["output"] = args.output
        if args.output is None:
            report["text"] = out.text
        print_json(report)
        return 0
    if args.output is None:
        sys.stdout.write(out.text)
    for gap in out.gaps:
        print(f"memfit export: {gap.line(out.target)}", file=sys.stderr)
    for note in out.notes:
        print(f"memfit export: note: {note}", file=sys.stderr)
    if args.output is not None:
        print(f"memfit export: wrote {args.output} ({out.target}; {len(out.gaps)} setting(s) "
              "it cannot express, listed above)", file=sys.stderr)
    return 0
