"""The ``memfit`` command line: one file per subcommand, errors as one line with exit code 2."""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from memfit import progress
from memfit._noise import quiet_loggers
from memfit.errors import MemfitError

EXIT_USAGE = 2


def plain_text(doc: str | None) -> str | None:
    """A docstring as ``--help`` shows it: reStructuredText literals and roles (two backticks,
    ``:func:`x```) written as the help strings write code, in single backticks."""
    if doc is None:
        return None
    doc = re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", doc)
    return re.sub(r"``(.+?)``", r"`\1`", doc, flags=re.S)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (what is wrong and where to look), exit 2; the
    description and epilog (module docstrings) in plain text (:func:`plain_text`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        for key in ("description", "epilog"):
            kwargs[key] = plain_text(kwargs.get(key))
        super().__init__(*args, **kwargs)
        # Note: [negative values] A value that starts with a minus and a digit (`--params -5b`,
        # `--seq -5k`, `--batch -1e3`) is a value, so that its own check answers ("must be
        # positive") rather than argparse's "expected one argument". argparse 3.13+ matches
        # this way (r"-\.?\d"); 3.11-3.12 took only plain numbers such as -5 or -.5. No memfit
        # option is spelled like a negative number, so nothing else changes.
        self._negative_number_matcher = re.compile(r"-\.?\d")

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"memfit: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    from memfit import __version__
    from memfit.cli import (
        export,
        fit,
        gpus,
        models,
        monitor,
        pack,
        plan,
        profile,
        rightsize,
        serve_plan,
        simulate,
        spot_plan,
        validate,
    )

    parser = _Parser(prog="memfit", description="Predict, measure and reduce the GPU memory of "
                     "PyTorch training and inference.")
    parser.add_argument("--version", action="version", version=f"memfit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    plan.register(sub)
    fit.register(sub)
    gpus.register(sub)
    models.register(sub)
    profile.register(sub)
    monitor.register(sub)
    validate.register(sub)
    export.register(sub)
    serve_plan.register(sub)
    simulate.register(sub)
    pack.register(sub)
    spot_plan.register(sub)
    rightsize.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    # The quiet rule: no progress display under --quiet, or --json printing JSON on stdout
    # (see memfit.progress). `validate --json FILE` writes a file and keeps its progress.
    quiet = bool(getattr(args, "quiet", False) or getattr(args, "json", False) is True)
    try:
        with progress.quiet() if quiet else contextlib.nullcontext(), quiet_loggers():
            return int(args.func(args) or 0)
    except MemfitError as exc:
        print(f"memfit: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
