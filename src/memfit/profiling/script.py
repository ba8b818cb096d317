"""Run a user's training script in this process under :func:`memfit.profile`, and predict it.

``memfit profile -- python train.py ARGS`` runs ``train.py`` with ``runpy`` (as ``__main__``,
with ``sys.argv`` and ``sys.path[0]`` set as Python would set them), so the profiler's hooks see
every op without changing the script.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from memfit.errors import MemfitError
from memfit.profiling.session import Profiler, TensorSpec

if TYPE_CHECKING:
    from memfit.trace.estimate import Estimate

# torch.optim class name -> the name memfit.estimate() models it as.
_OPTIMIZER_NAMES = {"AdamW": "adamw", "Adam": "adam", "SGD": "sgd", "Adafactor": "adafactor"}


@dataclass(frozen=True, kw_only=True)
class ScriptCommand:
    """What to run: a script path or ``-m module``, and its arguments."""

    target: str
    is_module: bool
    args: tuple[str, ...]


def parse_command(command: Sequence[str]) -> ScriptCommand:
    """``["python", "train.py", "--lr", "1"]`` (``python`` optional) or ``["-m", "pkg.train"]``."""
    cmd = list(command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if cmd and (os.path.basename(cmd[0]).startswith("python") and not cmd[0].endswith(".py")):
        cmd = cmd[1:]
    if not cmd:
        raise MemfitError("no script to profile; write e.g. `memfit profile --json out.json -- "
                          "python train.py --epochs 1`")
    if cmd[0] == "-m":
        if len(cmd) < 2:
            raise MemfitError("`-m` needs a module name, e.g. `memfit profile -- python -m "
                              "mypkg.train`")
        return ScriptCommand(target=cmd[1], is_module=True, args=tuple(cmd[2:]))
    if cmd[0].startswith("-"):
        raise MemfitError(f"python option {cmd[0]!r} is not supported here; run a script path "
                          "or `-m module`")
    if not os.path.isfile(cmd[0]):
        raise MemfitError(f"script {cmd[0]!r} not found; give the path of a Python file, e.g. "
                          "`memfit profile -- python train.py`")
    return ScriptCommand(target=cmd[0], is_module=False, args=tuple(cmd[1:]))


def run_script(command: ScriptCommand, profiler: Profiler) -> int:
    """Run the script under ``profiler``; return its exit code. ``SystemExit`` is caught, and so
    is any exception the script raises (its traceback is printed and the code is 1), so the
    profile of a failed run (e.g. ``torch.OutOfMemoryError``) can still be reported."""
    argv0 = command.target
    old_argv, old_path = sys.argv[:], sys.path[:]
    sys.argv = [argv0, *command.args]
    # As `python script.py` puts the script's folder first on sys.path, `python -m` the cwd.
    sys.path.insert(0, os.getcwd() if command.is_module
                    else os.path.dirname(os.path.abspath(command.target)))
    code = 0
    try:
        with profiler:
            try:
                if command.is_module:
                    runpy.run_module(command.target, run_name="__main__", alter_sys=True)
                else:
                    runpy.run_path(command.target, run_name="__main__")
            except SystemExit as exc:
                code = _exit_code(exc.code)
            except ImportError as exc:
                if command.is_module and _before_user_code(exc):
                    # runpy's own message ("No module named x"; for a missing parent package
                    # the finder's error is the cause), as one line with the fix.
                    cause = exc.__cause__ if isinstance(exc.__cause__, ImportError) else exc
                    text = str(cause)
                    raise MemfitError(f"-m {command.target}: {text[:1].lower()}{text[1:]}; run "
                                      "from the folder holding it, install it, or check the "
                                      "spelling") from None
                traceback.print_exc()  # raised by the script's own imports: see Note below
                code = 1
            except Exception:
                # Note: [report on failure] a run that dies (an OOM above all) is the one whose
                # memory the user most wants to see: print the traceback, still write reports.
                traceback.print_exc()
                code = 1
    finally:
        sys.argv = old_argv
        sys.path[:] = old_path
    return code


def _before_user_code(exc: BaseException) -> bool:
    """Whether ``exc`` came from runpy finding the module, before any of the user's code ran
    (every frame of its traceback is runpy's, importlib's or this module's)."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = (__file__, runpy.__file__, "<frozen runpy>")
    return all(f.filename in ours or f.filename.startswith("<frozen importlib") for f in frames)


def _exit_code(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def predict(profiler: Profiler, *, steps: int = 2) -> Estimate:
    """Trace the first model the profiled run called (with its first call's argument shapes and
    the optimizer it stepped) with :func:`memfit.estimate`, for predicted vs measured."""
    from memfit.trace import estimate

    if profiler.first_call is None:
        raise MemfitError("--predict found no model call with grad enabled in the profiled run; "
                          "profile a training step, or compare with an estimate in code: "
                          "prof.report(path, estimate=memfit.estimate(...))")
    model, args = profiler.first_call
    if not args:
        raise MemfitError("--predict: the model was called with keyword arguments only, which "
                          "the profiler cannot see; call it positionally or compare in code with "
                          "prof.report(path, estimate=memfit.estimate(model, inputs))")
    optimizer: str | None = None
    if profiler.optimizers:
        opt = profiler.optimizers[0]
        name = type(opt).__name__
        optimizer = _OPTIMIZER_NAMES.get(name)
        if optimizer == "sgd" and any(g.get("momentum", 0) for g in opt.param_groups):
            optimizer = "sgd-momentum"
        if optimizer is None:
            raise MemfitError(f"--predict: optimizer {name} is not modelled; valid: "
                              f"{', '.join(sorted(_OPTIMIZER_NAMES))}; compare in code with "
                              "memfit.estimate(..., optimizer=<factory>)")
    precision = "fp32"
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if dtypes == {torch.bfloat16}:
        precision = "bf16"
    elif dtypes == {torch.float16}:
        precision = "fp16"
    inputs = tuple(_meta(a) for a in args)
    return estimate(model, inputs, optimizer=optimizer,
                    precision=precision, device=profiler.device, steps=steps)


def _meta(a: Any) -> Any:
    if isinstance(a, TensorSpec):
        return a.meta()
    if isinstance(a, list | tuple):
        return type(a)(_meta(v) for v in a)
    if isinstance(a, dict):
        return {k: _meta(v) for k, v in a.items()}
    return a
