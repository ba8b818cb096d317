"""How long the analytic CLI commands take, next to ``import torch`` in the same run.

Run: ``python bench/cli_startup.py [--runs 7] [--compare-src /path/to/other/src]``

Each command runs as a fresh interpreter (what a user's shell does: the ``memfit`` console script
is ``from memfit.cli import main; sys.exit(main())``), ``--runs`` times, round-robin so that load
from other processes falls on every command alike. It reports the median wall time and the median
CPU time (user + system of the child, steadier on a shared machine), and whether the command
imported torch (read from ``sys.modules`` at exit). Two baselines run in the same rounds: an empty
interpreter (``python -c pass``, the floor) and ``python -c "import torch"``. With
``--compare-src`` the same commands also run against another checkout's ``src`` (e.g. the one
before lazy imports), so before and after come from one run. The target is 0.5 s wall
(issue 13). Bytecode is cached, as in an installed package (an untimed warm-up round writes it
under a temporary PYTHONPYCACHEPREFIX). Writes ``bench/results/cli-startup-cpu-<date>.json``
with the torch version and the command.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parent.parent / "src"
TARGET_S = 0.5

# the console script, plus one line at exit saying whether torch / transformers were imported
_CLI = ("import atexit, sys\n"
        "atexit.register(lambda: sys.stderr.write('\\n[bench] heavy=' + ','.join("
        "m for m in ('torch', 'transformers') if m in sys.modules) + '\\n'))\n"
        "from memfit.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n")

LLAMA_CONFIG = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8,
                "intermediate_size": 14336, "vocab_size": 128256,
                "max_position_embeddings": 8192, "tie_word_embeddings": False}


def commands(config_path: str) -> dict[str, list[str]]:
    return {
        "memfit --version": ["--version"],
        "memfit --help": ["--help"],
        "memfit gpus": ["gpus"],
        "memfit models": ["models"],
        "memfit plan --params 7e9": ["plan", "--params", "7e9"],
        "memfit plan llama-3-8b --gpu h100-80gb": ["plan", "llama-3-8b", "--gpu", "h100-80gb"],
        "memfit plan <llama config.json> --json": ["plan", config_path, "--json"],
    }


def run_once(argv: list[str], src: Path | None, pycache: Path) -> tuple[float, float, str | None]:
    """Wall seconds, child CPU seconds, and the heavy modules imported (None: not a CLI run)."""
    # Bytecode as an installed package has it: cached (under ``pycache``, written by the
    # warm-up round), whatever PYTHONDONTWRITEBYTECODE says here.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(pycache)
    if src is not None:
        env["PYTHONPATH"] = str(src)
    before = os.times()
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env,
                          check=False)
    wall = time.perf_counter() - t0
    after = os.times()
    cpu = (after.children_user - before.children_user) + (
        after.children_system - before.children_system)
    if done.returncode != 0:
        raise SystemExit(f"{argv!r} failed ({done.returncode}): {done.stderr[-500:]}")
    heavy = None
    for line in done.stderr.splitlines():
        if line.startswith("[bench] heavy="):
            heavy = line.removeprefix("[bench] heavy=")
    return wall, cpu, heavy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--compare-src", type=Path, default=None,
                        help="another checkout's src directory, timed in the same rounds")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "config.json"
        config.write_text(json.dumps(LLAMA_CONFIG))
        jobs: dict[str, tuple[list[str], Path | None]] = {
            "python -c pass": (["-c", "pass"], None),
            'python -c "import torch"': (["-c", "import torch"], None),
        }
        for name, argv in commands(str(config)).items():
            jobs[name] = (["-c", _CLI, *argv], SRC)
            if args.compare_src is not None:
                jobs[f"{name} [compare]"] = (["-c", _CLI, *argv], args.compare_src.resolve())
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in jobs}
        heavy: dict[str, str | None] = {}
        pycache = Path(tmp) / "pycache"
        for argv, src in jobs.values():  # warm-up: compile and cache the bytecode, untimed
            run_once(argv, src, pycache)
        for _ in range(args.runs):
            for name, (argv, src) in jobs.items():
                wall, cpu, loaded = run_once(argv, src, pycache)
                times[name].append((wall, cpu))
                heavy[name] = loaded

    rows: list[dict[str, Any]] = []
    torch_wall = statistics.median(w for w, _ in times['python -c "import torch"'])
    for name, samples in times.items():
        wall = statistics.median(w for w, _ in samples)
        cpu = statistics.median(c for _, c in samples)
        rows.append({"command": name, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
                     "wall_over_import_torch": round(wall / torch_wall, 3),
                     "imports": heavy[name], "runs": len(samples),
                     "meets_target": None if heavy[name] is None else wall <= TARGET_S})
    print(f"{'command':<48} {'wall s':>7} {'cpu s':>6} {'/torch':>6}  imports")
    for r in rows:
        print(f"{r['command']:<48} {r['wall_s']:>7.3f} {r['cpu_s']:>6.3f} "
              f"{r['wall_over_import_torch']:>6.2f}  {r['imports'] or '-'}")

    import torch  # only for the record, after the timings

    doc = {
        "what": "memfit CLI start-up: analytic commands vs import torch, fresh interpreters",
        "date": datetime.date.today().isoformat(),
        "device": "cpu",
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average": list(os.getloadavg()),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "target_wall_s": TARGET_S,
        "metric": f"median of {args.runs} runs, wall (perf_counter) and child user+system CPU; "
                  "bytecode cached (one untimed warm-up round)",
        "compare_src": None if args.compare_src is None else str(args.compare_src),
        "results": rows,
    }
    out = args.out or (Path(__file__).resolve().parent / "results" /
                       f"cli-startup-cpu-{doc['date']}.json")
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
